"""Launchers: start a study's workers on this machine or on a SLURM cluster, through submitit.

The job is apart from the launcher (as in Hydra's submitit launcher): every worker is a
:class:`StudyWorker`, which runs the study's claim loop (:func:`~.engine.run_study`) on the
shared study directory; the claims decide which worker trains which point, so the launcher
only decides how many workers run, where, and with which resources.

* ``local`` -- ``workers`` processes on this machine (submitit's local executor: real
  processes, the same path a SLURM task takes), each with ``FLAREPP_CORES`` set to its
  share of the usable cores (within which it times its threads, :mod:`flarepp.threads`)
  and, given ``gpus_per_task``, its own GPUs (without it, the GPUs this process sees);
* ``slurm`` -- one job array of ``workers`` tasks (``sbatch``), each task one node, one
  process, ``cpus_per_task`` cores (its ``FLAREPP_CORES``) and ``gpus_per_task`` GPUs.

Preemption and time limits: submitit asks SLURM to send SIGUSR2 ``signal_delay_s`` before a
job's end. The trainer stops on it after the current step and writes a checkpoint
(:data:`flarepp.train.loop.STOP_SIGNALS`); the worker then hands over to submitit, which
requeues the same worker (:meth:`StudyWorker.checkpoint`); the point resumes from that
checkpoint. SIGTERM alone (``scancel``) stops the worker the same way, without a requeue.
A worker killed outright leaves its point to the others: on its host at once, from another
host once its heartbeat is older than the claim's grace period.

A local launch that waits for its workers (the default) stops them when it is itself
stopped (SIGTERM, SIGHUP, Ctrl-C): each worker gets SIGTERM, stops after its step with a
checkpoint, and the launch waits for them (up to ``STOP_WAIT_S``) before it exits 143 (130
for Ctrl-C); the same command continues the study. SLURM jobs outlive the launch by design
(``scancel`` stops them).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flarepp.experiments.engine import (Study, StudyInterrupted, check_runtime, create_study,
                                        point_state, run_study)
from flarepp.experiments.studies import open_any_study
from flarepp.locks import GRACE_S, HOST_ENV
from flarepp.registry import Registry
from flarepp.storage.studydir import StudyDir
from flarepp.threads import CORES_ENV, usable_cores, worker_share

STOP_WAIT_S = 120.0
"""Seconds a stopped local launch waits for its workers' checkpoints before it exits."""

LOCAL_TIME_MIN = 60 * 24 * 365
"""The local executor's time limit when none is given: none in practice."""

INSTALL_HINT = "pip install 'flarepp[cluster]' (the PyPI package 'submitit')"

LAUNCHER_SBATCH = {"array": "--workers", "time": "--time", "partition": "--partition",
                   "account": "--account", "qos": "--qos", "cpus-per-task": "--cpus-per-task",
                   "gpus-per-task": "--gpus-per-task", "job-name": None, "nodes": None,
                   "ntasks-per-node": None, "signal": None, "output": None, "error": None,
                   "open-mode": None}
"""``#SBATCH`` options the SLURM launcher writes itself (one task per node, the job array
of the workers, SLURM's warning signal, the worker logs), and the launcher option that sets
each where there is one: an ``--sbatch`` item may not replace them."""


class LauncherUnavailable(OSError):
    """The launcher cannot start workers here (submitit missing, no SLURM)."""


@dataclass(frozen=True)
class LaunchSpec:
    """How to start a study's workers: the launcher's name (:data:`LAUNCHERS`), how many
    workers, and the resources of each (SLURM: ``time_min`` the job's limit in minutes,
    ``partition``, ``account``, ``qos``, ``sbatch`` further ``#SBATCH`` options as
    ``(key, value)`` pairs); ``claim_grace_s`` and ``runtime`` are passed to every worker's
    :func:`~.engine.run_study`."""

    launcher: str = "local"
    workers: int = 1
    time_min: int | None = None
    partition: str | None = None
    gpus_per_task: int = 0
    cpus_per_task: int | None = None
    account: str | None = None
    qos: str | None = None
    sbatch: tuple[tuple[str, str], ...] = ()
    claim_grace_s: float = GRACE_S
    runtime: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        LAUNCHERS.entry(self.launcher)  # an unknown name lists the known ones
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        texts = [(f"--{k}", getattr(self, k)) for k in ("partition", "account", "qos")]
        for option, text in [*texts, *(("--sbatch", f"{k}={v}") for k, v in self.sbatch)]:
            if text is not None and any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
                raise ValueError(f"{option} {text!r} holds a line break or another control "
                                 "character: each SLURM option is one line of the job script")
        for key, _ in self.sbatch:
            name = key.strip().lstrip("-").replace("_", "-")
            if name in LAUNCHER_SBATCH:
                instead = LAUNCHER_SBATCH[name]
                raise ValueError(f"--sbatch {key}=...: the launcher writes #SBATCH --{name} "
                                 "itself" + (f"; give {instead} instead" if instead else
                                             " (one task per node, the workers' job array, "
                                             "their logs and the warning signal)"))


class StudyWorker:
    """One worker of a launched study: the claim loop on ``out_dir``, requeued by submitit
    on preemption or at its time limit (it has submitit's ``checkpoint`` method)."""

    def __init__(self, out_dir: str | Path, runtime: tuple[str, ...] = (),
                 claim_grace_s: float = GRACE_S, track: Any = None) -> None:
        self.out_dir = str(out_dir)
        self.runtime = list(runtime)
        self.claim_grace_s = claim_grace_s
        self.track = track  # a TrackSettings: where this worker tracks its runs

    def __call__(self) -> dict[str, list[str]]:
        requeue = _preemption_handler()
        try:
            return run_study(open_any_study(self.out_dir), self.out_dir, runtime=self.runtime,
                             claim_grace_s=self.claim_grace_s, log=_say, track=self.track)
        except StudyInterrupted as err:
            print(f"flarepp: {err}", flush=True)
            if requeue is not None and err.signum == requeue[0]:
                requeue[1](err.signum, None)  # submitit: checkpoint() below, requeue, exit
            raise

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """What submitit resubmits on preemption: this same worker (its points' state is in
        their checkpoints, not in the worker)."""
        import submitit
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


def _say(line: str) -> None:
    print(line, flush=True)


def _preemption_handler() -> tuple[int, Callable[..., Any]] | None:
    """The signal submitit requeues on and its handler, in a submitit job (else ``None``)."""
    name = "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    if "SUBMITIT_EXECUTOR" not in os.environ or not hasattr(signal, name):
        return None
    signum = getattr(signal, name)
    handler = signal.getsignal(signum)
    return (signum, handler) if callable(handler) else None


def _submitit():
    try:
        import submitit
    except ImportError:
        raise LauncherUnavailable(f"--launcher needs submitit: {INSTALL_HINT}") from None
    return submitit


LAUNCHERS: Registry = Registry("launcher")


@LAUNCHERS.register("local", doc="worker processes on this machine (submitit's local executor)")
def local_jobs(spec: LaunchSpec, folder: Path, worker: StudyWorker) -> list[Any]:
    executor = _submitit().LocalExecutor(folder)
    # each worker times its threads within its share (flarepp.threads)
    setup = [f"export {CORES_ENV}={worker_share(spec.workers, usable_cores())}"]
    gpus = spec.gpus_per_task
    if not gpus:  # submitit would hide every GPU: the workers see what this process sees
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        setup.append("unset CUDA_VISIBLE_DEVICES" if seen is None
                     else f"export CUDA_VISIBLE_DEVICES={shlex.quote(seen)}")
    jobs = []
    for i in range(spec.workers):
        executor.update_parameters(timeout_min=spec.time_min or LOCAL_TIME_MIN,
                                   gpus_per_node=gpus,
                                   visible_gpus=tuple(range(i * gpus, (i + 1) * gpus)),
                                   setup=setup)
        jobs.append(executor.submit(worker))
    return jobs


@LAUNCHERS.register("slurm", doc="a SLURM job array (sbatch) through submitit")
def slurm_jobs(spec: LaunchSpec, folder: Path, worker: StudyWorker) -> list[Any]:
    executor = _submitit().SlurmExecutor(folder)
    options = {k: v for k, v in [("partition", spec.partition), ("account", spec.account),
                                 ("qos", spec.qos), ("cpus_per_task", spec.cpus_per_task),
                                 ("gpus_per_task", spec.gpus_per_task or None)]
               if v is not None}
    threads = spec.cpus_per_task or "${SLURM_CPUS_PER_TASK:-1}"
    executor.update_parameters(
        job_name="flarepp-sweep", time=spec.time_min, nodes=1, ntasks_per_node=1,
        array_parallelism=spec.workers, additional_parameters=dict(spec.sbatch),
        # each task names its own host: an id exported from the submitting shell would
        # make every node judge the others' pids as its own
        setup=[f"export {CORES_ENV}={threads}", f"unset {HOST_ENV}"], **options)
    return executor.submit_array([worker] * spec.workers)


@dataclass
class LaunchOutcome:
    """What a launch did: its jobs; after waiting, the study's points by state (``done``,
    ``failed``, ``pending``) and a sentence per worker that died; ``note``: why fewer
    workers than asked were started."""

    jobs: list[Any]
    folder: Path
    states: dict[str, list[str]] | None = None
    died: list[str] | None = None
    note: str | None = None


def worker_count(spec: LaunchSpec, study: Study, out_dir: Path) -> tuple[int, str | None]:
    """How many of ``spec.workers`` to start: no more than the study's open points (not
    finished, failed or pruned; a worker without a point would start a process for
    nothing) and, on this machine, than its usable cores; the sentence says why fewer."""
    limits = {"open point(s)": sum(point_state(out_dir, p).status == "pending"
                                   for p in study.points)}
    if spec.launcher == "local":
        limits["usable core(s)"] = usable_cores()
    count = min(spec.workers, *limits.values())
    if count == spec.workers:
        return count, None
    why = " and ".join(f"{n} {what}" for what, n in limits.items() if n < spec.workers)
    return count, (f"flarepp sweep: starting {count} of the {spec.workers} workers asked: "
                   f"the study has {why}")


def check_launcher(spec: LaunchSpec) -> None:
    """Raise before anything is written when ``spec``'s workers cannot be started here:
    submitit missing (:data:`INSTALL_HINT`), SLURM's commands missing, no time limit."""
    _submitit()
    if spec.launcher != "slurm":
        return
    if spec.time_min is None:
        raise ValueError("--launcher slurm needs --time MINUTES (each job's time limit; a "
                         "worker stopped by it is requeued and its point resumes)")
    for tool in ("sbatch", "srun"):
        if shutil.which(tool) is None:
            raise LauncherUnavailable(f"--launcher slurm needs SLURM's {tool!r} on PATH and "
                                      "finds none: run it where jobs are submitted (a login "
                                      "node), or use --launcher local")


def launch(study: Study, out_dir: str | Path, spec: LaunchSpec, *, wait: bool,
           track: Any = None) -> LaunchOutcome:
    """Create (or join) ``study`` in ``out_dir`` and start its workers on it, at most
    ``spec.workers`` (:func:`worker_count`; ``track``: a
    :class:`~flarepp.train.tracking.TrackSettings` for their runs); with ``wait``, wait for
    them and read the points' states from the directory."""
    check_launcher(spec)
    check_runtime(list(spec.runtime))
    out_dir = Path(out_dir).resolve()  # the workers may start elsewhere
    study = create_study(out_dir, study)
    count, note = worker_count(spec, study, out_dir)
    folder = StudyDir(out_dir).launch_dir
    worker = StudyWorker(out_dir, spec.runtime, spec.claim_grace_s, track)
    jobs = (LAUNCHERS.get(spec.launcher)(dataclasses.replace(spec, workers=count), folder,
                                         worker) if count else [])
    outcome = LaunchOutcome(jobs, folder, note=note)
    if not wait:
        return outcome
    outcome.died = _wait(jobs, spec)
    outcome.states = {"done": [], "failed": [], "pending": []}
    for point in study.points:
        outcome.states.setdefault(point_state(out_dir, point).status, []).append(point.name)
    return outcome


def _wait(jobs: list[Any], spec: LaunchSpec) -> list[str]:
    """Wait for ``jobs`` (a local launch stops them when it is stopped); a sentence per job
    that died."""
    died = []
    stopping = _stop_workers_with_launch(jobs) if spec.launcher == "local" else None
    for i, job in enumerate(jobs):
        try:
            job.result()
        except Exception as err:  # noqa: BLE001 -- submitit reports a dead job so
            last = str(err).strip().splitlines()[-1:] or [type(err).__name__]
            died.append(f"worker {i + 1} (job {job.job_id}) ended without finishing: "
                        f"{last[0]}; its log: {job.paths.stderr}")
    if stopping is not None:
        stopping()
    return died


def _stop_local_job(job: Any) -> None:
    """SIGTERM to the worker processes of a local job, found under the job's process (Linux
    ``/proc``): the job is a shell running submitit's controller, which would kill its
    workers a second after a SIGINT (before their checkpoint) and dies of a SIGTERM without
    forwarding it. Elsewhere, submitit's own cancel."""
    try:
        root = int(job.job_id)
    except (TypeError, ValueError):
        return
    if not Path(f"/proc/{root}").exists():
        try:
            job.cancel()
        except Exception:  # noqa: BLE001 -- a job that already ended
            pass
        return
    stack, workers = [root], []
    while stack:
        pid = stack.pop()
        try:
            stack += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            if b"submitit.core._submit" in Path(f"/proc/{pid}/cmdline").read_bytes():
                workers.append(pid)
        except (OSError, ValueError):
            continue
    for pid in workers:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass


def _stop_workers_with_launch(jobs: list[Any]) -> Callable[[], None]:
    """While a local launch waits: SIGTERM, SIGHUP or SIGINT to it stop its workers first
    (module docstring). Returns the function that puts the earlier handlers back."""
    watched = [s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None))
               if s is not None]

    def stop(signum: int, _frame: Any) -> None:
        restore()
        _say(f"flarepp sweep: {signal.Signals(signum).name}: stopping {len(jobs)} worker(s); "
             "each writes a checkpoint and the same command continues the study")
        for job in jobs:
            _stop_local_job(job)
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline and not all(job.done() for job in jobs):
            time.sleep(0.2)
        raise SystemExit(130 if signum == signal.SIGINT else 128 + signum)

    previous = {s: signal.signal(s, stop) for s in watched}

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return restore


__all__ = ["INSTALL_HINT", "LAUNCHERS", "LaunchOutcome", "LaunchSpec", "LauncherUnavailable",
           "LAUNCHER_SBATCH", "StudyWorker", "check_launcher", "launch", "local_jobs",
           "slurm_jobs", "usable_cores", "worker_count"]
