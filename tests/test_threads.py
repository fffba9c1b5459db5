"""CPU threads chosen by measurement (flarepp.threads): the cores a process may use (affinity,
cgroup quota, a launcher's share), the user's setting winning, the fastest count kept, a new
measurement when the step time drifts, and the cases where nothing is measured. Step times
here are simulated (a step advances a fake clock by what its thread count costs)."""

from __future__ import annotations

import os

import pytest
import torch

from flarepp import threads
from flarepp.threads import (CORES_ENV, THREADS_ENV, ThreadTuner, candidates, cgroup_cpu_quota,
                             measure_threads, usable_cores, user_threads, worker_share)


@pytest.fixture(autouse=True)
def _no_user_setting(monkeypatch):
    """No user setting (the suite's OMP_NUM_THREADS=1 removed); the count restored after."""
    for name in (THREADS_ENV, CORES_ENV, *threads.USER_ENVS):
        # set, then delete: monkeypatch records the variable's absence, so what a test (or
        # set_threads) writes into it is removed at the end, not left to the next test
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_TORCH_AT_IMPORT", before)
    monkeypatch.setattr(threads, "thread_budget", lambda loader_workers=0: 4)
    yield
    torch.set_num_threads(before)


class _Clock:
    """The tuner's clock: a step advances it by what its thread count costs (no sleeping,
    so a loaded machine cannot change what is chosen)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(threads, "time", fake)
    return fake


def _step(cost: dict[int, float]):
    clock = threads.time

    def step() -> None:
        clock.now += cost[torch.get_num_threads()]
    return step


def test_candidates_are_powers_of_two_and_the_budget():
    assert candidates(1) == [1]
    assert candidates(2) == [1, 2]
    assert candidates(6) == [1, 2, 4, 6]
    assert candidates(8) == [1, 2, 4, 8]


def test_the_cgroup_quota_bounds_the_usable_cores(tmp_path, monkeypatch):
    """v2 ``cpu.max`` (the tightest of the cgroup and its ancestors, rounded up) and v1
    ``cpu.cfs_quota_us``; ``max`` and -1 are no limit; FLAREPP_CORES bounds it further."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "a" / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "a" / "b" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/a/b\n") == 1.5
    v1 = tmp_path / "v1" / "cpu,cpuacct" / "job"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path / "v1", "4:cpu,cpuacct:/job\n") is None
    (v1 / "cpu.cfs_quota_us").write_text("300000\n")
    assert cgroup_cpu_quota(tmp_path / "v1", "4:cpu,cpuacct:/job\n") == 3.0
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("0::/a/b\n")
    assert usable_cores(cgroup_root=tmp_path, proc=tmp_path / "proc") == min(
        2, usable_cores(cgroup_root=tmp_path / "none"))
    monkeypatch.setenv(CORES_ENV, "1")
    assert usable_cores(cgroup_root=tmp_path / "none") == 1
    assert worker_share(3, cores=8) == 2 and worker_share(16, cores=8) == 1


def test_the_fastest_count_is_kept_and_said():
    said = []
    choice = measure_threads(_step({1: 0.004, 2: 0.001, 4: 0.012}), budget_s=10)
    assert choice.threads == 2 and torch.get_num_threads() == 2
    assert choice.how == "measured" and set(choice.step_s) == {1, 2, 4}
    tuner = ThreadTuner(say=said.append)
    step = _step({1: 0.001, 2: 0.003, 4: 0.006})
    while tuner.measuring:
        with tuner.step():
            step()
    assert tuner.choice.threads == 1 and said == [tuner.choice.line()]
    assert tuner.choice.record()["threads"] == 1 and "1: " in said[0]


def test_a_drift_of_the_step_time_measures_again():
    """Another job starts: the chosen count's steps become slow, the counts are measured
    again and the fastest now is kept."""
    said = []
    cost = {1: 0.004, 2: 0.002, 4: 0.002}
    tuner = ThreadTuner(say=said.append, rounds=1, window=3, window_s=0)
    step = _step(cost)
    for _ in range(30):
        with tuner.step():
            step()
    assert tuner.choice.threads in (2, 4) and tuner.choice.measurements == 1
    cost.update({2: 0.03, 4: 0.05})  # two of the cores now busy elsewhere
    for _ in range(40):
        with tuner.step():
            step()
    assert tuner.choice.threads == 1 and tuner.choice.measurements == 2
    assert any("measuring again" in line for line in said)


def test_a_user_setting_wins_and_nothing_is_measured(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert user_threads() == (3, "OMP_NUM_THREADS")
    tuner = ThreadTuner()
    assert not tuner.measuring and tuner.choice.threads == 3
    assert tuner.choice.how == "set by OMP_NUM_THREADS" and torch.get_num_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    threads.set_threads(1)
    assert user_threads() == (1, "--threads")
    monkeypatch.delenv(THREADS_ENV)
    threads._Applied.by_us = False
    torch.set_num_threads(2)
    assert user_threads() == (2, "torch.set_num_threads")


def test_nothing_is_measured_where_it_cannot_pay(monkeypatch):
    assert ThreadTuner(steps=5).choice.how == "not measured: 5 step(s) of work"
    assert ThreadTuner(device="meta").choice.how.startswith("not measured: the run computes")
    assert ThreadTuner(skip="not measured: why").choice.how == "not measured: why"
    monkeypatch.setattr(threads, "thread_budget", lambda loader_workers=0: 1)
    assert ThreadTuner(steps=10 ** 6).choice.threads == 1
    assert torch.get_num_threads() == 1


def test_bench_threads_prints_its_table(monkeypatch, capsys):
    """`flarepp bench threads` on tiny sizes: a row per case with the step time at each count,
    the fastest and the chosen count (timing is never asserted)."""
    import time

    from flarepp.cli import main
    monkeypatch.setattr(threads, "time", time)
    monkeypatch.setattr(threads, "thread_budget", lambda loader_workers=0: 1)
    monkeypatch.setattr("flarepp.bench.threads.thread_budget", lambda loader_workers=0: 1)
    assert main(["bench", "threads", "--resolutions", "6", "--n", "32", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ["case", "1", "thr"]
    assert lines[2].startswith("darcy-tiny 6x6") and lines[3].startswith("Table 7 surrogate N=32")
    assert all("ms" in line and line.split("ms")[-1].split()[:2] == ["1", "1"]
               for line in lines[2:4])


def test_a_thread_count_beyond_the_machine_is_refused_in_a_sentence(tmp_path, monkeypatch,
                                                                    capsys):
    """Issue 41 #22: `--threads 100000` started 32,298 threads and then failed with "can't
    start new thread"; `OMP_NUM_THREADS=100000` ended in a store error's advice ("convert
    the store again"). Both are now refused before any work (exit 2), in a sentence naming
    the option or variable and the most this machine can run; no thread count changes."""
    from flarepp.cli import main
    before = torch.get_num_threads()
    most = threads.THREADS_PER_CORE * (os.cpu_count() or 1)
    command = ["train", "darcy-tiny", "--data", str(tmp_path), "--out", str(tmp_path / "run")]
    assert main([*command, "--threads", "100000"]) == 2
    err = capsys.readouterr().err
    assert "error: --threads asks for 100000 CPU threads" in err and f"at most {most}" in err
    assert torch.get_num_threads() == before and THREADS_ENV not in os.environ
    monkeypatch.setenv("OMP_NUM_THREADS", "100000")
    assert main(command) == 2
    err = capsys.readouterr().err
    assert "error: OMP_NUM_THREADS asks for 100000 CPU threads" in err
    assert "convert" not in err and torch.get_num_threads() == before
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("OMP_NUM_THREADS", str(most))  # as many as it may ask: accepted
    assert user_threads() == (most, "OMP_NUM_THREADS")


def test_a_tuner_puts_back_the_count_it_found(monkeypatch):
    """A measurement changes the count for the work it times only: ``restore`` (and leaving
    a ``with ThreadTuner()`` block) puts back the count found before, so a run or an
    evaluation leaves its process as it found it."""
    torch.set_num_threads(3)
    monkeypatch.setattr(threads._Applied, "by_us", True)  # 3: flarepp's count, not a user's
    with ThreadTuner(budget_s=10) as tuner:
        step = _step({1: 0.001, 2: 0.004, 3: 0.004, 4: 0.008})
        while tuner.measuring:
            with tuner.step():
                step()
        assert tuner.choice.threads == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 3 and threads._Applied.by_us


@pytest.mark.slow
def test_a_run_leaves_the_thread_count_it_found(darcy_dir, tmp_path, monkeypatch):
    """The trainer's thread tuning chose the count and left it set in the process after the
    run (the timing epochs of a study, an evaluation, the next run all inherited it); now
    the trainer's thread callback puts back the count it found when the trainer closes."""
    from flarepp.train import get_preset, train
    monkeypatch.setattr("flarepp.train.callbacks.thread_budget", lambda loader_workers=0: 1)
    torch.set_num_threads(2)
    monkeypatch.setattr(threads._Applied, "by_us", True)  # flarepp's own count, not a user's
    config = get_preset("darcy-tiny", ["epochs=1", "dataset_options={'resolution': 8, "
                                       "'n_train': 4, 'n_test': 2}", "model.dim=8",
                                       "model.heads=2", "model.blocks=1", "model.latents=2"])
    metrics = train(config, tmp_path / "run", data_root=darcy_dir, progress=False)
    assert metrics["epochs"] == 1
    log = (tmp_path / "run" / "log.jsonl").read_text()
    assert '"threads": 1' in log  # the run itself ran at the one usable core's count
    assert torch.get_num_threads() == 2
