"""The one experiment engine behind ``flarepp sweep`` (and compare, lra compare, drivaerml
pareto): the grid, the locked creation of a study with resolved paths, one rule for
"finished" (config and data fingerprint), one failure policy (numerical failures final,
environment errors resumable), kill-and-resume with several processes, every task's own
metric in the report, and the one seed aggregation."""

import csv
import dataclasses
import errno
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from flarepp.cli import main
from flarepp.experiments.engine import StudyConflict, create_study, read_events, run_study
from flarepp.experiments.reports import Row, aggregate, collect, write_report
from flarepp.experiments.reports.runs import precision_ratios
from flarepp.experiments.studies import grid_names, parse_axes, split_values, sweep_study

TINY = ["epochs=8", "checkpoint_every=1", "model.dim=8", "model.heads=2", "model.latents=4",
        "batch_size=4"]
GRID = ["model.mixer=flare,flarepp", "model.blocks=1,2", "seed=0,1"]
QUIET = dict(log=lambda _: None)


def _npz(path: Path, seed: int = 0, n: int = 24) -> Path:
    rng = np.random.default_rng(seed)
    x = rng.random((n, 40, 2)).astype(np.float32)
    np.savez(path, x=x, y=(np.sin(3 * x[..., :1]) + x[..., 1:] ** 2))
    return path


def _sets(items):
    return [a for s in items for a in ("--set", s)]


def test_grid_parsing_and_point_names():
    assert split_values("flare,flarepp") == ["flare", "flarepp"]
    assert split_values("[none,none,standard],standard") == ["[none,none,standard]",
                                                             "standard"]
    points = grid_names(parse_axes(["model.mixer=flare,flarepp", "seed=0,1,2"]))
    assert [n for n, _ in points][:2] == ["mixer-flare_seed-0", "mixer-flare_seed-1"]
    assert len(points) == 6 and points[-1][1] == (("model.mixer", "flarepp"), ("seed", "2"))
    for bad in (["seed"], ["seed=0,,1"], ["seed=0,0"], ["seed=0", "seed=1"]):
        with pytest.raises(ValueError):
            parse_axes(bad)


def test_a_study_is_checked_resolved_and_created_once(tmp_path, monkeypatch):
    """Every point's config is checked when the study is made; its data paths are stored
    resolved (a process joining from another directory reads the same data); a grid over
    data_root gives each point its own data; a directory holding another study is refused.
    A failure points to the spec (a relative path stored, --grid data_root ignored)."""
    with pytest.raises(ValueError, match="latnts"):
        sweep_study("npz", parse_axes(["model.latnts=2,4"]), data="d.npz")
    monkeypatch.chdir(tmp_path)
    study = create_study("sw", sweep_study("npz", parse_axes(["seed=0,1"]), data="d.npz"))
    assert {p.config.data_root for p in study.points} == {str(tmp_path / "d.npz")}
    grid = sweep_study("npz", parse_axes(["data_root=a.npz,b.npz"]), data="d.npz")
    assert [p.config.data_root for p in create_study("g", grid).points] == [
        str(tmp_path / "a.npz"), str(tmp_path / "b.npz")]
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the same command from another directory
    with pytest.raises(StudyConflict, match="data_root differ"):
        create_study("../sw", sweep_study("npz", parse_axes(["seed=0,1"]), data="d.npz"))
    assert create_study("../sw", sweep_study("npz", parse_axes(["seed=0,1"]),
                                             data="../d.npz")).points == study.points
    with pytest.raises(StudyConflict, match="another study"):
        create_study("../sw", sweep_study("npz", parse_axes(["seed=0,2"]), data="../d.npz"))


def test_two_studies_started_at_the_same_instant_are_not_both_accepted(tmp_path):
    """Creation is locked: of two different studies created at once on one directory,
    exactly one is stored and the other is refused (before: the last sweep.json won and
    the other's runs vanished from the report)."""
    barrier, outcomes = threading.Barrier(8), []

    def start(seeds: str) -> None:
        study = sweep_study("npz", parse_axes([f"seed={seeds}"]), data=str(tmp_path / "d"))
        barrier.wait()
        try:
            create_study(tmp_path / "sw", study)
            outcomes.append(("ok", seeds))
        except StudyConflict:
            outcomes.append(("refused", seeds))

    threads = [threading.Thread(target=start, args=(s,)) for s in ["0,1", "0,2"] * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    accepted = {s for what, s in outcomes if what == "ok"}
    assert len(accepted) == 1 and len(outcomes) == 8
    stored = json.loads((tmp_path / "sw" / "study.json").read_text())
    assert [p["labels"]["seed"] for p in stored["points"]] == accepted.pop().split(",")


def test_one_seed_aggregation_and_precision_ratio():
    """Table 11 uses the sample standard deviation (ddof 1); Figure 7's ratio is the mean
    16-bit metric over the mean FP32 metric of the same mixer, depth and budget; failed and
    pending runs are left out."""
    rows = [Row(point=f"{p}-{s}", status="done", mixer="flare", sdpa_scale="1", blocks=2,
                latents=8, precision=p, seed=s, value=t, train_value=t / 2)
            for p, s, t in [("fp32", 0, 0.10), ("fp32", 1, 0.14), ("fp16", 0, 0.15),
                            ("fp16", 1, 0.21)]]
    rows.append(dataclasses.replace(rows[0], status="failed", value=float("nan")))
    groups = {g.key["precision"]: g for g in aggregate(rows, ["mixer", "precision"])}
    mean, std, n = groups["fp32"].stats()
    assert (mean, n) == (pytest.approx(0.12), 2) and std == pytest.approx(math.sqrt(0.0008))
    assert groups["fp16"].stats("train_value")[0] == pytest.approx(0.09)
    (ratio,) = precision_ratios(rows)
    assert ratio["ratio"] == pytest.approx(0.18 / 0.12)


def _run(cmd, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "flarepp", *cmd, "--quiet"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


@pytest.mark.slow
def test_killed_sweep_resumes_and_two_processes_share_it(tmp_path):
    """A 2 x 2 x 2 sweep is SIGKILLed while a point is half-trained (it has a checkpoint, no
    metrics), then continued by two processes at once: every point ends exactly once, the
    half-trained one resumes from its checkpoint, finished points are not redone, each
    run's log holds every epoch once, and the report's tables and Figure 4 exist."""
    data = _npz(tmp_path / "d.npz")
    out = tmp_path / "sw"
    start = ["sweep", "npz", "--data", str(data), "--out", str(out), *_sets(TINY),
             "--grid", *GRID]
    first = _run(start)
    half = None
    deadline = time.monotonic() + 600
    while half is None and first.poll() is None and time.monotonic() < deadline:
        finished = {e["point"] for e in read_events(out) if e["event"] == "finish"}
        for run in (out / "runs").glob("*") if (out / "runs").exists() else []:
            if finished and run.name not in finished and any(run.glob("checkpoints/*.pt")):
                half = run.name
                break
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert half is not None, "the first process ended before it could be killed mid-point"
    done_before = {e["point"] for e in read_events(out) if e["event"] == "finish"}
    second = _run(start, cwd=tmp_path)
    third = _run(["sweep", "--out", str(out)])
    for proc in (second, third):
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err.decode()[-2000:]
    events = read_events(out)
    names = [n for n, _ in grid_names(parse_axes(GRID))]
    assert sorted(e["point"] for e in events if e["event"] == "finish") == sorted(names)
    assert any(e["point"] == half and e["event"] == "resume" for e in events)
    later = [e for e in events if e["pid"] != first.pid]
    assert not any(e["point"] in done_before and e["event"] in ("start", "resume")
                   for e in later)
    for name in names:
        log = [json.loads(line) for line in (out / "runs" / name / "log.jsonl").read_text()
               .splitlines()]
        assert [r["epoch"] for r in log] == list(range(1, 9))
    assert main(["sweep", "report", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert len(rows) == 8 and all(r["status"] == "done" for r in rows)
    assert {r["mixer"]: r["sdpa_scale"] for r in rows} == {"flare": "1",
                                                            "flarepp": "1/sqrt(4)"}
    text = (out / "report.md").read_text()
    assert "Table 11" in text and "± " in text and "Figure 4" in text
    assert (out / "fig4_depth_latents.png").stat().st_size > 0


@pytest.mark.slow
def test_divergence_is_final_and_a_full_disk_is_not(tmp_path, monkeypatch):
    """Two points: one diverges (lr 1e30), the other's second checkpoint write hits a full
    disk (ENOSPC). The diverged point is final, recorded with its error and shown in the
    report; the other is left resumable, shown pending with the disk error, and on the
    rerun after space is freed resumes from its first checkpoint and finishes, while the
    diverged one is not retried. Before: both got a permanent failed.json."""
    import flarepp.train.checkpoint as loop  # the module that writes a run's checkpoints
    data = _npz(tmp_path / "d.npz")
    study = sweep_study("npz", parse_axes(["lr=1e-3,1e30"]), data=str(data),
                        sets=[*TINY, "epochs=3", "div_factor=1.0"])
    out = tmp_path / "sw"
    create_study(out, study)
    real_save = loop.save_checkpoint

    def full_disk(path, state):
        if state["epoch"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_save(path, state)

    monkeypatch.setattr(loop, "save_checkpoint", full_disk)
    done = run_study(study, out, **QUIET)
    assert done["failed"] == ["lr-1e30"] and done["error"] == ["lr-1e-3"]
    assert not (out / "runs" / "lr-1e-3" / "failed.json").exists()
    _, rows = collect(out)
    by = {r.point: r for r in rows}
    assert by["lr-1e30"].status == "failed" and "loss became" in by["lr-1e30"].error
    assert by["lr-1e-3"].status == "pending"
    assert "No space left on device" in by["lr-1e-3"].error
    monkeypatch.setattr(loop, "save_checkpoint", real_save)  # space freed
    assert main(["sweep", "--out", str(out), "--quiet", "--report"]) == 0
    events = read_events(out)
    assert [e["event"] for e in events if e["point"] == "lr-1e-3"][-2:] == ["resume", "finish"]
    assert [e["event"] for e in events if e["point"] == "lr-1e30"] == ["start", "fail"]
    log = (out / "runs" / "lr-1e-3" / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in log] == [1, 2, 3]
    text = (out / "report.md").read_text()
    assert "| failed |" in text and "loss became" in text


@pytest.mark.slow
def test_a_failed_allocation_leaves_its_point_resumable_with_its_sentence(tmp_path,
                                                                         monkeypatch):
    """A point whose training runs out of memory (the trainer's OutOfMemory, one sentence
    naming the stage, the bytes and the option that bounds them) is an environment error:
    left resumable, its event of kind "environment" holding the sentence, the study's exit
    status 1; the next run trains it. Before, it was recorded as an "unexpected" error."""
    import flarepp.experiments.engine as engine
    from flarepp.allocator import OutOfMemory
    sentence = ("out of memory in a training step of epoch 1 (an allocation of 2 GiB "
                "failed): bound it with batch_size (now 4); no checkpoint was written yet")

    def out_of_memory(self):  # as the trainer's stages raise it (flarepp.train.stages)
        raise OutOfMemory(sentence)
    data = _npz(tmp_path / "d.npz")
    study = sweep_study("npz", parse_axes(["seed=0"]), data=str(data), sets=[*TINY, "epochs=1"])
    out = tmp_path / "sw"
    create_study(out, study)
    with monkeypatch.context() as patch:
        patch.setattr(engine.Trainer, "train_epoch", out_of_memory)
        done = run_study(study, out, **QUIET)
        assert done["error"] == ["seed-0"]
        assert main(["sweep", "--out", str(out), "--quiet"]) == 1
    error = [e for e in read_events(out) if e["event"] == "error"][-1]
    assert error["kind"] == "environment" and error["error"] == f"OutOfMemory: {sentence}"
    assert run_study(study, out, **QUIET)["finished"] == ["seed-0"]


@pytest.mark.slow
def test_reuse_checks_the_data_fingerprint(tmp_path):
    """A finished point is reused only while the data at its path is the data it was
    trained on: after the data is regenerated there, the rerun does not reuse it: it keeps
    the old run under superseded/ (nothing is thrown away) and trains the point afresh
    (resuming its checkpoints refused the new data at every rerun). Before: the stale
    result was reported as current."""
    data = _npz(tmp_path / "d.npz")
    out = tmp_path / "sw"
    study = sweep_study("npz", parse_axes(["seed=0"]), data=str(data),
                        sets=[*TINY, "epochs=1"])
    assert run_study(study, out, **QUIET)["finished"] == ["seed-0"]
    assert run_study(study, out, **QUIET)["reused"] == ["seed-0"]
    original = data.read_bytes()
    _npz(data, seed=1)  # regenerated at the same path
    (row,) = collect(out)[1]
    assert row.status == "pending" and "reuse: the run was trained on the data" in row.error
    done = run_study(study, out, **QUIET)
    assert done["finished"] == ["seed-0"] and done["reused"] == []
    assert len(list((out / "superseded" / "seed-0").iterdir())) == 1
    assert run_study(study, out, **QUIET)["reused"] == ["seed-0"]
    data.write_bytes(original)
    assert run_study(study, out, **QUIET)["finished"] == ["seed-0"]


@pytest.mark.slow
def test_a_study_grows_by_new_points_and_keeps_its_finished_runs(tmp_path):
    """A grid that holds every stored point unchanged and adds some (a longer schedule,
    more seeds) grows the study: the finished run is reused, only the new point trains,
    and the report holds both. A grid that drops a stored point, or changes one, is still
    refused, naming the points, and the stored study is left as it was."""
    data = _npz(tmp_path / "d.npz")
    out = tmp_path / "sw"

    def study(epochs: str, sets=()):
        return sweep_study("npz", parse_axes([f"epochs={epochs}"]), data=str(data),
                           sets=[*TINY, "pct_start=0.3", *sets])

    assert run_study(study("1"), out, **QUIET)["finished"] == ["epochs-1"]
    done = run_study(study("1,2"), out, **QUIET)
    assert done["reused"] == ["epochs-1"] and done["finished"] == ["epochs-2"]
    stored = json.loads((out / "study.json").read_text())
    assert [p["name"] for p in stored["points"]] == ["epochs-1", "epochs-2"]
    assert {r.epochs for r in collect(out)[1] if r.status == "done"} == {1, 2}
    with pytest.raises(StudyConflict, match=r"\['epochs-2'\] are not asked for"):
        create_study(out, study("1"))
    with pytest.raises(StudyConflict, match="batch_size differ"):
        create_study(out, study("1,2,3", sets=["batch_size=2"]))
    assert json.loads((out / "study.json").read_text()) == stored


def _tiny_data(task: str, root: Path) -> list[str]:
    """Tiny data for ``task``'s preset and the ``--set`` items that fit a run to it."""
    if task == "rollout-tiny":
        assert main(["data", "make", "advection-diffusion", "--out", str(root), "--train", "8",
                     "--test", "4", "--resolution", "16", "--quiet"]) == 0
        return ["dataset_options.n_train=8", "dataset_options.n_test=4", "model.dim=16",
                "batch_size=4", f"data_root={root}"]
    if task == "lm-tiny":
        (root / "pkg").mkdir(parents=True)
        for k in range(12):
            (root / "pkg" / f"m{k}.py").write_text(f"def f{k}(x):\n    return x * {k}\n" * 30)
        return ["dataset_options.n_train=32", "dataset_options.n_test=8",
                "dataset_options.context=32", "model.dim=16", "batch_size=8",
                f"data_root={root}"]
    if task == "lra-listops-tiny":
        from flarepp.data.lra import make_listops
        make_listops(root, n_train=32, n_val=8, n_test=8, min_length=10, max_length=40,
                     progress=False)
        return ["model.dim=16", "model.heads=2", "model.blocks=1", "model.latents=4",
                "batch_size=8",
                f"data_root={root}"]
    assert main(["data", "make", "surface-flow", "--out", str(root), "--train", "2",
                 "--test", "1", "--resolution", "300", "--quiet"]) == 0
    return ["model.dim=16", "model.latents=4", "dataset_options.cells_per_step=128",
            f"data_root={root}"]


@pytest.mark.slow
@pytest.mark.parametrize("preset, metric", [
    ("rollout-tiny", "rollout_rel_l2"), ("lm-tiny", "bits_per_byte"),
    ("lra-listops-tiny", "accuracy"), ("drivaerml-tiny", "nmse")])
def test_every_task_sweeps_and_reports_its_own_metric(preset, metric, tmp_path):
    """`flarepp sweep PRESET --grid seed=0,1 --set epochs=1` on every task: one run per
    point, and the report tabulates the task's own headline metric. Before, every task
    but fields failed (`RolloutTask.__init__() got an unexpected keyword argument`)."""
    sets = _tiny_data(preset, tmp_path / "data")
    out = tmp_path / "sw"
    argv = ["sweep", preset, "--grid", "seed=0,1", "--set", "epochs=1", "--set",
            "pct_start=0.3", *_sets(sets), "--out", str(out), "--quiet", "--report"]
    assert main(argv) == 0
    runs = sorted(p.parent.name for p in out.glob("runs/*/metrics.json"))
    assert runs == ["seed-0", "seed-1"]
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["status"] for r in rows] == ["done", "done"]
    assert all(math.isfinite(float(r[f"test_{metric}"])) for r in rows)
    assert f"test `{metric}`" in (out / "report.md").read_text()
    assert main(argv) == 0  # the rerun reuses both
    assert [e["event"] for e in read_events(out)].count("finish") == 2


def test_report_reads_any_study(tmp_path):
    """`flarepp sweep report DIR` of a directory without a study names the problem."""
    with pytest.raises(FileNotFoundError, match="no study"):
        write_report(tmp_path)


def test_a_sweep_of_an_earlier_flarepp_is_continued(tmp_path):
    """A directory an earlier `flarepp sweep` started (sweep.json: base config, axes, data)
    opens as the same study: the same point names, so its runs are found and reused."""
    from flarepp.experiments.studies import open_any_study
    from flarepp.train import get_preset
    out = tmp_path / "old"
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({
        "base": get_preset("npz").to_dict(), "data_root": str(tmp_path / "d.npz"),
        "axes": [["model.mixer", ["flare", "flarepp"]], ["seed", ["0", "1"]]]}))
    study = open_any_study(out)
    assert [p.name for p in study.points] == ["mixer-flare_seed-0", "mixer-flare_seed-1",
                                              "mixer-flarepp_seed-0", "mixer-flarepp_seed-1"]
    assert (out / "study.json").is_file() and study.continue_with.startswith("flarepp sweep")


@pytest.mark.slow
def test_ctrl_c_names_the_command_that_continues(tmp_path):
    """Ctrl-C stops the sweep after a step with exit status 130 and says how to continue
    with a command `sweep` accepts (before: `--resume`, which it does not take)."""
    data = _npz(tmp_path / "d.npz")
    out = tmp_path / "sw"
    proc = _run(["sweep", "npz", "--data", str(data), "--out", str(out),
                 *_sets([*TINY, "epochs=200"]), "--grid", "seed=0"])
    deadline = time.monotonic() + 300
    while not list(out.glob("runs/seed-0/checkpoints/*.pt")) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err.decode()
    assert f"continue with `flarepp sweep --out {out}`" in err.decode()
    assert "--resume" not in err.decode()
    assert read_events(out)[-1]["event"] == "interrupt"
