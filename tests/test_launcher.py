"""`flarepp sweep ... --launcher local|slurm`: workers started through submitit that share a
study by its claims. The local launcher runs real processes through submitit's local
executor (the path a SLURM task takes, without SLURM); the SLURM launcher is checked on the
job array it submits to a stand-in `sbatch`."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from flarepp.cli import main
from flarepp.experiments.engine import read_events

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["checkpoint_every=1", "model.dim=8", "model.heads=2", "model.latents=4",
        "model.blocks=1", "batch_size=4", "pct_start=0.3"]


def _npz(path: Path, n: int = 16) -> Path:
    rng = np.random.default_rng(0)
    x = rng.random((n, 40, 2)).astype(np.float32)
    np.savez(path, x=x, y=(np.sin(3 * x[..., :1]) + x[..., 1:] ** 2))
    return path


def _argv(data: Path, out: Path, *more: str) -> list[str]:
    return ["sweep", "npz", "--data", str(data), "--out", str(out),
            *[a for s in TINY for a in ("--set", s)], *more]


def _launch(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "flarepp", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _worker_mid_point(out: Path, deadline: float) -> tuple[str, int]:
    """A point some worker is training (it has a checkpoint, no metrics) and that worker's pid."""
    while time.monotonic() < deadline:
        for claim in out.glob("claims/*/.lock"):
            run = out / "runs" / claim.parent.name
            try:
                pid = json.loads(claim.read_text())["pid"]
            except (OSError, ValueError):
                continue  # released or being written this instant
            if any(run.glob("checkpoints/*.pt")) and not (run / "metrics.json").exists():
                return claim.parent.name, pid
        time.sleep(0.02)
    raise AssertionError("no worker was ever seen in the middle of a point")


@pytest.mark.slow
def test_launched_workers_train_each_point_once_and_a_killed_ones_point_resumes(tmp_path):
    """A 4-point sweep through the local launcher with 2 workers, one of which is SIGKILLed in
    the middle of a point: the launch says a worker died, the point is left resumable (or the
    other worker, on the same host, took it over at once), and a second launch finishes the
    study; every point finishes exactly once, the killed one resumed from its checkpoint,
    each run logged every epoch once, and the report has every point done. A failure points
    to the launcher (workers that do not share the claims) or to a lost point."""
    data, out = _npz(tmp_path / "d.npz"), tmp_path / "sw"
    argv = _argv(data, out, "--set", "epochs=4", "--grid", "seed=0,1,2,3", "--launcher",
                 "local", "--workers", "2")
    first = _launch(argv)
    point, pid = _worker_mid_point(out, time.monotonic() + 300)
    os.kill(pid, signal.SIGKILL)
    said, err = first.communicate(timeout=600)
    assert first.returncode == 1, err.decode()[-2000:]
    assert "started 2 local worker(s)" in said.decode()
    assert "ended without finishing" in err.decode()
    assert main([*argv, "--report"]) == 0
    events = read_events(out)
    finished = sorted(e["point"] for e in events if e["event"] == "finish")
    assert finished == ["seed-0", "seed-1", "seed-2", "seed-3"]
    assert [e["event"] for e in events if e["point"] == point][-2:] == ["resume", "finish"]
    killed = [(e["point"], e["event"]) for e in events if e["pid"] == pid]
    assert killed[-1] in ((point, "start"), (point, "resume"))  # it died in that point
    for name in finished:
        log = (out / "runs" / name / "log.jsonl").read_text().splitlines()
        assert [json.loads(line)["epoch"] for line in log] == list(range(1, 5))
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert sorted(r["point"] for r in rows if r["status"] == "done") == finished


@pytest.mark.slow
def test_a_preempted_worker_is_requeued_and_resumes_its_point(tmp_path):
    """submitit's preemption signal (SIGUSR2) reaches a worker mid-point: the trainer stops
    after the step with a checkpoint, submitit requeues the worker, and the requeued worker
    resumes the point to the end (every epoch logged once). A failure points to the trainer
    not stopping on SIGUSR2 or the worker not handing over to submitit's requeue."""
    data, out = _npz(tmp_path / "d.npz"), tmp_path / "sw"
    argv = _argv(data, out, "--set", "epochs=5", "--grid", "seed=0", "--launcher", "local")
    proc = _launch(argv)
    point, pid = _worker_mid_point(out, time.monotonic() + 300)
    os.kill(pid, signal.SIGUSR2)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err.decode()[-2000:]
    events = [(e["pid"], e["event"]) for e in read_events(out)]
    assert [e for _, e in events] == ["start", "interrupt", "resume", "finish"]
    assert events[0][0] == pid != events[2][0]
    log = (out / "runs" / point / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in log] == list(range(1, 6))


@pytest.mark.slow
def test_a_stopped_local_launch_stops_its_workers_and_the_study_continues(tmp_path):
    """SIGTERM to `flarepp sweep --launcher local` while its worker trains: the launch says it
    stops its workers, the worker stops after its step with a checkpoint (an `interrupt`
    event), no worker process is left, and the launch exits 143; the same command then
    resumes the point and finishes it. A failure points to orphaned workers, which went on
    training after their launch was stopped."""
    data, out = _npz(tmp_path / "d.npz"), tmp_path / "sw"
    argv = _argv(data, out, "--set", "epochs=300", "--grid", "seed=0", "--launcher", "local")
    proc = _launch(argv)
    point, pid = _worker_mid_point(out, time.monotonic() + 300)
    proc.send_signal(signal.SIGTERM)
    said, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err.decode()[-2000:]
    assert "stopping 1 worker(s)" in said.decode()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"worker {pid} still runs after its launch was stopped")
    assert [e["event"] for e in read_events(out)] == ["start", "interrupt"]
    assert main([*_argv(data, out, "--set", "epochs=300", "--grid", "seed=0")]) == 0
    assert [e["event"] for e in read_events(out)][-2:] == ["resume", "finish"]


_FAKE_SBATCH = """#!/bin/sh
cp "$1" "{record}"
echo "Submitted batch job 4242"
"""


def test_the_slurm_launcher_submits_one_job_array_with_the_resources_asked(tmp_path,
                                                                          monkeypatch, capsys):
    """`--launcher slurm` submits one array of --workers tasks (at most --workers at once),
    each with the partition, time, GPUs, cores, account, qos and extra #SBATCH options asked,
    SLURM's warning signal before the time limit, its cores as FLAREPP_CORES and its own
    host id; without --wait it returns once submitted. A failure points to an option that
    does not reach sbatch."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "submitted.sh"
    for tool, text in [("sbatch", _FAKE_SBATCH.format(record=record)), ("srun", "#!/bin/sh\n")]:
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "sw"
    assert main(_argv(tmp_path / "d.npz", out, "--grid", "seed=0,1,2", "--launcher", "slurm",
                      "--workers", "3", "--time", "90", "--partition", "gpu",
                      "--gpus-per-task", "1", "--cpus-per-task", "8", "--account", "proj",
                      "--qos", "high", "--sbatch", "constraint=a100")) == 0
    script = record.read_text()
    for line in ["--array=0-2%3", "--partition=gpu", "--time=90", "--gpus-per-task=1",
                 "--cpus-per-task=8", "--account=proj", "--qos=high", "--constraint=a100",
                 "--signal=USR2@90", "--nodes=1", "--ntasks-per-node=1"]:
        assert f"#SBATCH {line}\n" in script, line
    assert "export FLAREPP_CORES=8\n" in script and "unset FLAREPP_HOST_ID\n" in script
    said = capsys.readouterr().out
    assert "started 3 slurm worker(s): job(s) 4242_0, 4242_1, 4242_2" in said
    assert (out / "study.json").is_file()


@pytest.mark.parametrize("case, code, said", [
    ("no submitit", 1, "pip install 'flarepp[cluster]'"),
    ("no sbatch", 1, "needs SLURM's 'sbatch' on PATH"),
    ("no time", 2, "--launcher slurm needs --time MINUTES"),
    ("unknown", 2, "unknown launcher 'pbs'; known launchers: local, slurm"),
    ("no launcher", 2, "--workers describes launched workers: give --launcher local|slurm"),
])
def test_a_launcher_that_cannot_start_is_a_sentence(tmp_path, monkeypatch, capsys, case,
                                                    code, said):
    """submitit not installed, no `sbatch`, no time limit for SLURM, an unknown launcher, a
    launcher option without a launcher: each one sentence naming the fix, and nothing is
    written (no study directory). A failure points to a traceback or a half-started study."""
    launcher = {"no submitit": "local", "unknown": "pbs"}.get(case, "slurm")
    more = ["--launcher", launcher, "--time", "60"]
    if case == "no submitit":
        monkeypatch.setitem(sys.modules, "submitit", None)
    if case == "no sbatch":
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    if case == "no time":
        more = ["--launcher", "slurm"]
    if case == "no launcher":
        more = ["--workers", "2"]
    out = tmp_path / "sw"
    assert main(_argv(tmp_path / "d.npz", out, "--grid", "seed=0", *more)) == code
    err = capsys.readouterr().err
    assert err.startswith("flarepp sweep: error: ") and said in err and err.count("\n") == 1
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# what a launch may be asked (issue 41)


@pytest.mark.parametrize("option, said", [
    (["--partition", "gpu\n#SBATCH --nodelist=victim"],
     "--partition 'gpu\\n#SBATCH --nodelist=victim' holds a line break"),
    (["--sbatch", "constraint=a100\n#SBATCH --exclusive"], "--sbatch 'constraint=a100\\n"),
    (["--sbatch", "array=0-99"], "the launcher writes #SBATCH --array itself; give --workers"),
    (["--sbatch", "time=10"], "#SBATCH --time itself; give --time instead"),
    (["--sbatch", "output=/tmp/x"], "#SBATCH --output itself (one task per node"),
])
def test_a_launch_option_that_would_rewrite_the_job_script_is_refused(tmp_path, capsys,
                                                                      option, said):
    """A newline in --partition or --sbatch became a line of its own in the SLURM job script
    (any #SBATCH option, or a shell line after it); `--sbatch array=...` silently replaced
    the launcher's job array (its --workers). Each is one sentence (exit 2) before anything
    is written or submitted. A failure points to LaunchSpec passing text into the script."""
    out = tmp_path / "sw"
    assert main(_argv(tmp_path / "d.npz", out, "--grid", "seed=0", "--launcher", "slurm",
                      "--time", "60", *option)) == 2
    err = capsys.readouterr().err
    assert err.startswith("flarepp sweep: error: ") and said in err and err.count("\n") == 1
    assert not out.exists()


class _FakeLocalExecutor:
    """submitit's local executor, recording what it would start instead of starting it."""

    started: list = []

    def __init__(self, folder):
        self.folder = folder

    def update_parameters(self, **options):
        self.options = options

    def submit(self, worker):
        self.started.append(worker)
        return types.SimpleNamespace(job_id=str(len(self.started)), result=lambda: None,
                                     done=lambda: True)


def test_local_workers_are_capped_by_the_open_points_and_the_cores(tmp_path, monkeypatch,
                                                                   capsys):
    """`--launcher local --workers 6` on a one-point study started six torch processes, five
    of which found nothing to do: as many workers start as the study has open points (and
    this machine usable cores), and the launch says so. A failure points to launch() using
    --workers as given."""
    from flarepp.experiments import launch as launching
    monkeypatch.setattr(_FakeLocalExecutor, "started", [])
    monkeypatch.setattr(launching, "_submitit",
                        lambda: types.SimpleNamespace(LocalExecutor=_FakeLocalExecutor))
    out = tmp_path / "sw"
    assert main(_argv(tmp_path / "d.npz", out, "--grid", "seed=0", "--launcher", "local",
                      "--workers", "6")) == 1  # the fake workers leave the point pending
    assert len(_FakeLocalExecutor.started) == 1
    said = capsys.readouterr().out
    assert "starting 1 of the 6 workers asked: the study has 1 open point(s)" in said
    assert "started 1 local worker(s)" in said
