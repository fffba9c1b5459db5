"""The one experiment engine: a study -> claimed points -> train a point -> events.

A :class:`Study` is a list of :class:`Point` s, each a complete run config (the grid of
``flarepp sweep``, the models x datasets x seeds of ``flarepp compare``, ...), plus the
report plug-ins that tabulate it (:mod:`flarepp.experiments.reports`). Its directory holds

* ``study.json``, written by :func:`create_study` under an exclusive lock, with every
  point's ``data_root`` resolved to an absolute path: two different studies started at the
  same instant on one directory cannot both be accepted (the second is refused, naming
  what differs), and a process joining from another working directory trains on the same
  data. A study grows but never changes: one that holds every stored point unchanged and
  adds points (more seeds, a longer schedule) replaces it, and its finished runs count;
* ``runs/<point>/``, one run directory of the :class:`~flarepp.train.Trainer` per point;
* ``claims/<point>/.lock``: a process works on a point only while it holds this
  :class:`~flarepp.storage.locks.Lease` (an exclusive create with a heartbeat, which holds
  across hosts sharing the directory), so several processes, on one machine or many, may
  share one study: a point whose holder was killed is taken over at once on the holder's
  host, and by another host once the holder's heartbeat is older than its grace period; the
  taker resumes it from its checkpoint. A process makes passes over the points until one
  trains nothing, so it also takes over points whose holders died while it worked;
* ``events/<host>-<pid>.jsonl``: who started, resumed, finished, failed or hit an error on
  which point, one file per process (appends of several hosts to one file can interleave on
  NFS), merged in time order when read (:func:`read_events`; a study of an earlier flarepp
  has one ``events.jsonl``, still read).

One rule for "finished with this config" (:func:`point_state`): the run directory holds
``metrics.json``, its stored config computes what the point's config computes (runtime
fields and the data's path aside) and its checkpoint's data fingerprint equals that of the
data at the point's ``data_root`` now (:mod:`flarepp.data.fingerprint`), read from its
newest readable checkpoint; a finished run of another config is an error, never a stale
table entry; a run of other data (finished or not) is not reused or resumed: it is moved to
``superseded/<point>/`` and the point trains afresh (:func:`set_aside`).

One failure policy (:func:`train_point`): a numerical failure (the loss became non-finite)
is final -- ``failed.json`` records it, the point is not retried, the report shows it; so is
a run a callback pruned (an adaptive search's pruner: ``pruned.json``, its state
checkpointed).
Anything else (a full disk, a locked run directory, data that cannot be read, CUDA out of
memory, a bug) is recorded as an ``error`` event and leaves the point resumable from its
checkpoints: the next run of the study retries it once the cause is fixed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from flarepp.io import UnreadableFile, atomic_write_json, read_json
from flarepp.storage.config import RunConfig
from flarepp.storage.locks import (GRACE_S, LOCK_NAME, Lease, LockHolder, RunLock, RunLocked,
                                   file_safe, host_id)
from flarepp.storage.rundir import RunDir
from flarepp.train.checks import apply_overrides

if TYPE_CHECKING:
    from flarepp.train.callbacks import TrainerCallback
    from flarepp.train.tracking import TrackSettings

STUDY_NAME = "study.json"
STUDY_LOCK_WAIT_S = 60.0  # the study's lock is held for milliseconds by a live holder
SUPERSEDED_DIR = "superseded"  # runs of data no longer at a point's path, kept
EVENTS_DIR = "events"
EVENTS_NAME = "events.jsonl"  # the single log of a study an earlier flarepp started
FAILED_NAME = RunDir.FAILED
PRUNED_NAME = RunDir.PRUNED
COST_NAME = RunDir.COST
FORMAT = 1


class StudyConflict(ValueError):
    """The directory holds another study, or a run of another config."""


class StudyInterrupted(Exception):
    """A stop signal (:data:`flarepp.train.loop.STOP_SIGNALS`) stopped the study after a
    step; rerunning it continues."""

    def __init__(self, signum: int, point: str, continue_with: str) -> None:
        import signal
        self.signum, self.exit_code = signum, 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name} while training {point}; "
                         f"its state is checkpointed: continue with `{continue_with}`")


@dataclass(frozen=True)
class Point:
    """One run of a study: its name (the run directory under ``runs/``), its complete
    config, and the labels its reports group by (axis values, model, dataset, seed...)."""

    name: str
    config: RunConfig
    labels: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "labels": self.labels, "config": self.config.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Point":
        return cls(d["name"], RunConfig.from_dict(d["config"]), dict(d["labels"]))


@dataclass
class Study:
    """What a study directory holds (module docstring). ``kind`` names the command that
    made it; ``reports`` the report plug-ins; ``info`` facts the reports state (read from
    the data when the study was made); ``timing_epochs`` > 0 gives every point a separate
    timing run first (Figure 5's cost); ``continue_with`` the command that continues it
    (set by :func:`create_study`)."""

    kind: str
    points: list[Point]
    reports: list[str]
    info: dict[str, Any] = field(default_factory=dict)
    timing_epochs: int = 0
    continue_with: str = ""

    def __post_init__(self) -> None:
        names = [p.name for p in self.points]
        if not names:
            raise ValueError("a study needs at least one point")
        if len(set(names)) != len(names):
            raise ValueError(f"repeated point names in {names}")
        for name in names:
            check_point_name(name)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "kind": self.kind, "reports": self.reports,
                "continue_with": self.continue_with, "info": self.info,
                "timing_epochs": self.timing_epochs,
                "points": [p.to_dict() for p in self.points]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Study":
        return cls(d["kind"], [Point.from_dict(p) for p in d["points"]], list(d["reports"]),
                   dict(d.get("info", {})), int(d.get("timing_epochs", 0)),
                   d.get("continue_with", ""))

    def identity(self) -> dict[str, Any]:
        """What the study computes: its points' names, labels and config identities (runtime
        fields, facts, messages and the points' order aside)."""
        return json.loads(json.dumps({
            "kind": self.kind, "timing_epochs": self.timing_epochs,
            "points": sorted([p.name, p.labels, p.config.identity()] for p in self.points)}))


def check_point_name(name: Any) -> None:
    """A point's name is its run directory under ``runs/`` and its claim under ``claims/``:
    a relative path of plain parts, never one that leaves the study (``../x``, ``/x``)."""
    parts = name.split("/") if isinstance(name, str) else [""]
    if any(part in ("", ".", "..") or "\\" in part or "\0" in part for part in parts):
        raise ValueError(f"point name {name!r} is not a relative path inside the study "
                         "(parts separated by '/', none empty, '.' or '..')")


def _point_key(point: Point) -> str:
    return json.dumps([point.labels, point.config.identity()], sort_keys=True, default=str)


def same_point_names(study: Study, stored: Study) -> Study:
    """``study`` with each point that ``stored`` holds under another name (the same labels
    and config: a grid's axes or values given in another order) renamed to the stored name,
    so its finished run counts."""
    names = {_point_key(p): p.name for p in stored.points}
    return dataclasses.replace(study, points=[
        dataclasses.replace(p, name=names.get(_point_key(p), p.name)) for p in study.points])


def read_study(out_dir: str | Path) -> Study:
    """The study stored in ``out_dir/study.json``, its ``continue_with`` naming ``out_dir``
    (where it is now, wherever it was made); a file that is not a study (cut short, edited by
    hand) is :class:`~flarepp.io.UnreadableFile` naming it and what is wrong."""
    path = Path(out_dir) / STUDY_NAME
    stored = read_json(path)
    try:
        if not isinstance(stored, dict):
            raise TypeError(f"it holds a JSON {type(stored).__name__}, not an object")
        if not isinstance(stored.get("points"), list) or not all(
                isinstance(p, dict) for p in stored["points"]):
            raise TypeError("its 'points' is not a list of point objects")
        study = Study.from_dict(stored)
    except KeyError as err:
        raise UnreadableFile(f"{path}: not a study: key {err} is missing") from None
    except (TypeError, ValueError, AttributeError) as err:
        raise UnreadableFile(f"{path}: not a study: {err}") from None
    return dataclasses.replace(study, continue_with=continue_command(out_dir))


def resolve_paths(study: Study, out_dir: Path) -> Study:
    """Every point's ``data_root`` as an absolute path (relative to this process's cwd),
    and the command that continues the study in ``out_dir``."""
    points = [dataclasses.replace(p, config=dataclasses.replace(
        p.config, data_root=str(Path(p.config.data_root).expanduser().resolve())))
              for p in study.points]
    return dataclasses.replace(study, points=points, continue_with=continue_command(out_dir))


@contextlib.contextmanager
def study_lock(out_dir: Path) -> Iterator[None]:
    """The lease ``out_dir/.study.lock``, waited for (it is held for milliseconds): the
    creation and growth of ``study.json``, and an adaptive search's trial bookkeeping."""
    lock = Lease(out_dir / ".study.lock", heartbeat=False)
    try:
        lease = lock.acquire()
    except RunLocked as err:  # said, then waited for: a stopped holder (Ctrl-Z) keeps it
        print(f"flarepp: waiting up to {STUDY_LOCK_WAIT_S:.0f} s for {err}", file=sys.stderr,
              flush=True)
        try:
            lease = lock.wait(timeout_s=STUDY_LOCK_WAIT_S)
        except RunLocked as still:
            raise RunLocked(f"waited {STUDY_LOCK_WAIT_S:.0f} s for the study's lock: {still}; "
                            "resume or end that process (a stopped one: `kill -CONT` it)"
                            ) from None
    try:
        yield
    finally:
        lease.release()


def create_study(out_dir: str | Path, study: Study) -> Study:
    """The study of ``out_dir``: ``study`` (paths resolved) written there if the directory
    holds none or ``study`` grows the stored one (:func:`_grows`), else the stored one when
    it computes the same; another is refused."""
    out_dir = Path(out_dir)
    study = resolve_paths(study, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with study_lock(out_dir):
        stored = read_study(out_dir) if (out_dir / STUDY_NAME).exists() else None
        if stored is not None:
            study = same_point_names(study, stored)
        if stored is None or _grows(study, stored):
            store_study(out_dir, study)
            return study
    if stored.identity() != study.identity():
        raise StudyConflict(f"{str(out_dir)!r} holds another study ({_difference(stored, study)});"
                            f" continue it with `{continue_command(out_dir)}`, ask for all of "
                            "its points (and more, to grow it) or choose another --out")
    return stored


def store_study(out_dir: Path, study: Study) -> None:
    """Write ``study`` as the study of ``out_dir`` (the caller holds :func:`study_lock`)."""
    atomic_write_json(Path(out_dir) / STUDY_NAME, study.to_dict())


def _grows(study: Study, stored: Study) -> bool:
    """``study`` holds every point of ``stored`` with the same labels and config identity,
    and more: the stored runs stay valid, the new points are added."""
    if study.kind != stored.kind or study.timing_epochs != stored.timing_epochs:
        return False
    mine = {name: rest for name, *rest in study.identity()["points"]}
    old = {name: rest for name, *rest in stored.identity()["points"]}
    return len(mine) > len(old) and all(mine.get(name) == rest for name, rest in old.items())


def _difference(stored: Study, mine: Study) -> str:
    if stored.kind != mine.kind:
        return f"a {stored.kind} study, not a {mine.kind} one"
    old = {p.name: p for p in stored.points}
    new = {p.name: p for p in mine.points}
    missing = sorted(set(old) - set(new))
    if missing:
        return f"points {missing[:3]} are not asked for"
    for name, point in old.items():
        a, b = point.config.identity(), new[name].config.identity()
        keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        if keys:
            return f"point {name} has a different config: its {', '.join(keys)} differ"
    return "other labels or timing runs"


def continue_command(out_dir: str | Path) -> str:
    """The command that continues (or joins) the study of ``out_dir``, whatever made it."""
    import shlex
    return f"flarepp sweep --out {shlex.quote(str(out_dir))}"


def open_study(out_dir: str | Path) -> Study:
    """The study stored in ``out_dir`` (``study.json``; a directory an earlier flarepp
    started is opened by :func:`flarepp.experiments.studies.open_any_study`)."""
    path = Path(out_dir) / STUDY_NAME
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist: no study was started in "
                                f"{str(out_dir)!r}")
    return read_study(out_dir)


# ---------------------------------------------------------------------------------------------
# events

def events_file(out_dir: str | Path) -> Path:
    """This process's own event file, ``events/<host>-<pid>.jsonl``: no other process appends
    to it, so its lines never interleave with another's, whatever the filesystem."""
    return Path(out_dir) / EVENTS_DIR / f"{file_safe(host_id())}-{os.getpid()}.jsonl"


def record_event(out_dir: Path, point: str, event: str, **extra: Any) -> None:
    """Append one line to this process's event file (:func:`events_file`). A disk too full
    for the line is said on stderr."""
    record = {"point": point, "event": event, "pid": os.getpid(), "host": host_id(),
              "time": time.time(), **extra}
    path = events_file(out_dir)
    try:
        path.parent.mkdir(exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
    except OSError as err:
        print(f"could not record event {record} in {path}: {err}", file=sys.stderr)


def _say_unreadable(problem: str) -> None:
    print(f"flarepp: {problem}", file=sys.stderr)


def read_events(out_dir: str | Path, *,
                unreadable: Callable[[str], None] = _say_unreadable) -> list[dict[str, Any]]:
    """Every process's events (``events/*.jsonl``, and an earlier flarepp's ``events.jsonl``)
    merged in time order. A line that is not an event record (cut short by a full disk or a
    kill) is left out and said through ``unreadable``, naming its file and line number."""
    out_dir = Path(out_dir)
    files = [out_dir / EVENTS_NAME, *sorted((out_dir / EVENTS_DIR).glob("*.jsonl"))]
    found = []
    for path in (f for f in files if f.is_file()):
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            try:
                record = json.loads(line)
                record["point"], record["event"]  # noqa: B018 (an event names both)
                found.append((float(record["time"]), len(found), record))
            except (ValueError, KeyError, TypeError):
                unreadable(f"{path} line {number} is not an event record (cut short by a "
                           f"full disk or a kill?), left out: {line[:80]!r}")
    return [record for *_, record in sorted(found, key=lambda f: f[:2])]


# ---------------------------------------------------------------------------------------------
# "finished with this config"

def run_dir(out_dir: str | Path, point: Point | str) -> Path:
    return Path(out_dir) / "runs" / (point if isinstance(point, str) else point.name)


def point_claim(out_dir: str | Path, name: str, *, grace_s: float = GRACE_S) -> Lease:
    """The claim of point ``name`` (module docstring): a process trains the point only while
    it holds it; ``acquire()`` raises ``RunLocked`` while another process does, and takes a
    gone holder's claim over (``stale`` then names it)."""
    return Lease(Path(out_dir) / "claims" / name / LOCK_NAME, grace_s=grace_s)


@dataclass
class PointState:
    """``status``: ``done``, ``failed`` (numerically, final), ``pruned`` (stopped by a
    pruner, final) or ``pending``; ``error``: why a failed point failed or a pruned one was
    pruned, or why a finished run is not reused (or an unfinished one not resumed)."""

    status: str
    metrics: dict[str, Any] | None = None
    error: str | None = None
    other_data: bool = False  # the run's checkpoints are of other data than at its path now


def read_failure(directory: Path) -> dict[str, Any] | None:
    """The final failure recorded in ``directory`` (``failed.json``), or None. Only a
    numerical failure is final; a ``failed.json`` an earlier flarepp wrote for any other
    error (a full disk, a locked directory) is not, and the point is retried."""
    record = RunDir(directory).read_failure()
    if record is None:
        return None
    return record if record.get("type", "FloatingPointError") == "FloatingPointError" else None


class DataFingerprints:
    """The fingerprint of the data each config names, computed once per data set."""

    def __init__(self) -> None:
        self._cache: dict[str, dict[str, Any]] = {}

    def __call__(self, config: RunConfig) -> dict[str, Any]:
        key = json.dumps([config.task, config.dataset, config.dataset_options,
                          config.data_root], sort_keys=True, default=str)
        if key not in self._cache:
            from flarepp.tasks import build_task
            self._cache[key] = build_task(config, config.data_root).data_identity()
        return self._cache[key]


def stored_fingerprint(directory: Path) -> dict[str, Any] | None:
    """The data fingerprint stored in a run's newest readable checkpoint (an unreadable newer
    one is passed over, as ``--resume`` does); None without a readable one."""
    from flarepp.storage.checkpoint import newest_readable_checkpoint
    found = newest_readable_checkpoint(directory)
    if found.state is None:
        return None
    return found.state.get("data", {}).get("identity") or {}


def _other_data(stored_data: dict[str, Any] | None, config: RunConfig,
                fingerprint: Callable[[RunConfig], dict[str, Any]]) -> str | None:
    """Why a run whose checkpoint stores ``stored_data`` is of other data than ``config``'s
    path holds now, or None (the same data, or nothing stored to compare)."""
    from flarepp.data.fingerprint import DataMismatch, check_same_data
    if not stored_data:
        return None
    try:
        check_same_data(stored_data, fingerprint(config), what="reuse")
    except DataMismatch as err:
        return str(err)
    return None


def point_state(out_dir: Path, point: Point,
                fingerprint: Callable[[RunConfig], dict[str, Any]] | None = None) -> PointState:
    """Whether ``point`` is finished (module docstring); ``fingerprint`` gives the current
    data's (without it the data is not checked: reports read state without loading data)."""
    directory = run_dir(out_dir, point)
    run = RunDir(directory)
    if run.has_metrics():
        stored = run.read_config()
        # the data is compared by content below: its path may differ (moved, or stored
        # unresolved by an earlier flarepp)
        a, b = ({k: v for k, v in c.identity().items() if k != "data_root"}
                for c in (stored, point.config))
        if a != b:
            keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            raise StudyConflict(f"{str(directory)!r} holds a finished run of a different "
                                f"config (its {', '.join(keys)} differ); choose another --out")
        metrics = run.read_metrics()
        if fingerprint is None:
            return PointState("done", metrics)
        stored_data = stored_fingerprint(directory)
        if stored_data is None:
            return PointState("pending", error="the finished run has no readable checkpoint "
                                               "to check its data against")
        other = _other_data(stored_data, point.config, fingerprint)
        if other is not None:
            return PointState("pending", error=other, other_data=True)
        return PointState("done", metrics)
    failure = read_failure(directory)
    if failure is not None:
        return PointState("failed", error=failure["error"])
    pruned = RunDir(directory).read_pruned()
    if pruned is not None:
        return PointState("pruned", error=pruned["reason"])
    other = (None if fingerprint is None
             else _other_data(stored_fingerprint(directory), point.config, fingerprint))
    if other is not None:  # resuming it would refuse the data at every rerun
        return PointState("pending", error=other, other_data=True)
    return PointState("pending")


# ---------------------------------------------------------------------------------------------
# train a point

def environment_errors() -> tuple[type[BaseException], ...]:
    """Errors that have nothing to do with the numbers: they leave a point resumable."""
    import torch

    from flarepp.data.fingerprint import DataMismatch
    from flarepp.storage.checkpoint import CheckpointError
    return (OSError, RunLocked, DataMismatch, CheckpointError, torch.OutOfMemoryError)


def time_epoch(config: RunConfig, *, epochs: int = 2) -> dict[str, Any]:
    """A separate timing run (paper Sec. D.4): ``epochs`` training epochs of ``config`` from
    scratch in a temporary directory; the last one's wall time (data loading included) and
    this process's CPU time over it. Nothing is evaluated or kept."""
    import tempfile

    import torch

    from flarepp.train import Trainer
    with tempfile.TemporaryDirectory(prefix="flarepp-timing-") as tmp:
        # the schedule must last the timing epochs (a run of fewer epochs is timed too)
        timed = dataclasses.replace(config, epochs=max(config.epochs, epochs))
        trainer = Trainer(timed, Path(tmp) / "run", progress=False)
        try:
            for _ in range(epochs):
                wall, cpu = time.perf_counter(), time.process_time()
                trainer.train_epoch()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        finally:
            trainer.close()
    return {"epoch_seconds": wall, "epoch_cpu_seconds": cpu, "timing_epochs": epochs,
            "device": str(trainer.device), "threads": torch.get_num_threads()}


def train_point(study: Study, out_dir: Path, point: Point, config: RunConfig,
                log: Callable[[str], None], tag: str, *,
                callbacks: Sequence[TrainerCallback] = (),
                track: TrackSettings | None = None) -> str:
    """Time (if the study asks) and train or resume one claimed point; returns ``finished``,
    ``failed`` (numerically: final, ``failed.json``), ``pruned`` (a callback stopped it:
    final, ``pruned.json``) or ``error`` (resumable; an event). ``callbacks`` go to the
    trainer (:mod:`flarepp.train.callbacks`); ``track`` (a
    :class:`~flarepp.train.tracking.TrackSettings`) adds a tracker, the study's directory
    naming its experiment, and has the run's figures drawn for it."""
    from flarepp.train import Trainer, latest_checkpoint
    from flarepp.train.callbacks import TrainingPruned
    from flarepp.train.loop import TrainingInterrupted
    directory = run_dir(out_dir, point)
    if track is not None:
        callbacks = [*track.callbacks(directory, point.name, study=out_dir), *callbacks]
    try:
        if study.timing_epochs and not RunDir(directory).has_cost():
            cost = time_epoch(config, epochs=study.timing_epochs)
            RunDir(directory).write_cost(cost)
            record_event(out_dir, point.name, "timed", **cost)
            log(f"{tag}: an epoch takes {cost['epoch_seconds']:.3g} s "
                f"({cost['epoch_cpu_seconds']:.3g} s CPU)")
        resume = latest_checkpoint(directory) is not None
        record_event(out_dir, point.name, "resume" if resume else "start")
        log(f"{tag}: {'resuming' if resume else 'training'} into {directory}")
        metrics = Trainer(config, directory, resume=resume, progress=False,
                          callbacks=callbacks, plot=track is not None).fit()
    except TrainingPruned as err:
        RunDir(directory).write_pruned(err.reason, err.epoch)
        record_event(out_dir, point.name, "prune", epoch=err.epoch, reason=err.reason)
        log(f"{tag}: pruned after epoch {err.epoch} (final): {err.reason}")
        return "pruned"
    except FloatingPointError as err:
        RunDir(directory).write_failure(err)
        record_event(out_dir, point.name, "fail", error=str(err))
        log(f"{tag}: failed (final, not retried): {err}")
        return "failed"
    except TrainingInterrupted as err:
        record_event(out_dir, point.name, "interrupt", signal=err.signum)
        raise StudyInterrupted(err.signum, point.name, study.continue_with) from None
    except Exception as err:  # recorded, resumable: retried when the study runs again
        kind = "environment" if isinstance(err, environment_errors()) else "unexpected"
        record_event(out_dir, point.name, "error", error=f"{type(err).__name__}: {err}",
                     kind=kind)
        log(f"{tag}: {kind} error, left resumable (retried on the next run): "
            f"{type(err).__name__}: {err}")
        return "error"
    from flarepp.tasks import TASKS
    headline = f"test_{TASKS.get(config.task).headline}"
    record_event(out_dir, point.name, "finish", **{headline: metrics[headline]})
    log(f"{tag}: {headline} {metrics[headline]:.4g}")
    return "finished"


def check_runtime(runtime: list[str] | None) -> None:
    """``runtime`` (``--set`` items for one process of a study) names runtime fields only."""
    from flarepp.storage.config import RUNTIME_FIELDS
    for item in runtime or []:
        if item.split("=", 1)[0].strip() not in RUNTIME_FIELDS:
            raise ValueError(f"{item!r}: only runtime fields ({', '.join(RUNTIME_FIELDS)}) "
                             "may differ between the processes of a study")


def run_study(study: Study, out_dir: str | Path, *, runtime: list[str] | None = None,
              log: Callable[[str], None] = print,
              claim_grace_s: float = GRACE_S,
              track: TrackSettings | None = None) -> dict[str, list[str]]:
    """Train every point of ``study`` that is neither finished nor held by another process
    (the study is created in ``out_dir`` first, or joined: :func:`create_study`), in passes
    until a pass trains nothing (points held by processes that died meanwhile are taken
    over then).

    ``runtime`` are ``--set`` items of runtime fields (``device=cpu``) for this process
    only; ``claim_grace_s`` the seconds without a heartbeat after which another host takes
    this process's points over; ``track`` sends this process's runs to a tracker
    (:func:`train_point`). Returns this process's point names by outcome: ``finished``,
    ``failed``, ``pruned``, ``error`` (left resumable), ``skipped`` (held by another
    process), ``reused``. A study directory where no claim can be made raises
    :class:`~flarepp.storage.locks.LockUnavailable` before anything is trained."""
    check_runtime(runtime or [])
    out_dir = Path(out_dir)
    study = create_study(out_dir, study)
    fingerprints = DataFingerprints()
    outcome: dict[str, str | None] = {}

    def state(point: Point, tag: str) -> PointState | None:
        try:
            return point_state(out_dir, point, fingerprints)
        except StudyConflict:
            raise
        except Exception as err:  # the data cannot be read: the same policy as training
            record_event(out_dir, point.name, "error", error=f"{type(err).__name__}: {err}",
                         kind="environment" if isinstance(err, environment_errors())
                         else "unexpected")
            log(f"{tag}: cannot check its data, left for the next run: "
                f"{type(err).__name__}: {err}")
            return None

    def visit(point: Point, tag: str, first: bool) -> str | None:
        """This process's outcome for ``point``; ``None``: failed before (final)."""
        now = state(point, tag)
        if now is None:
            return "error"
        if now.status in ("failed", "pruned"):
            if first:
                log(f"{tag}: {now.status} before (final, not retried): {now.error}")
            return None if first else "skipped"
        if now.status == "done":
            return "reused" if first else "skipped"  # later: finished by its holder
        claim = point_claim(out_dir, point.name, grace_s=claim_grace_s)
        try:
            claim.acquire()
        except RunLocked:
            return "skipped"
        try:
            now = state(point, tag)  # another process may have finished it meanwhile
            if now is None or now.status != "pending":
                return "error" if now is None else "skipped"
            if claim.stale is not None:
                _take_over(out_dir, point, claim.stale, log, tag)
            if now.error:
                log(f"{tag}: not reused: {now.error}")
            if now.other_data:
                set_aside(out_dir, point, log, tag)
            config = apply_overrides(point.config, runtime) if runtime else point.config
            return train_point(study, out_dir, point, config, log, tag, track=track)
        finally:
            claim.release()

    waiting = list(enumerate(study.points))
    while waiting:
        trained = False
        for i, point in waiting:
            was = outcome.get(point.name)
            outcome[point.name] = visit(point, f"[{i + 1}/{len(study.points)}] {point.name}",
                                        first=was is None)
            trained |= outcome[point.name] in ("finished", "failed", "pruned", "error")
        waiting = [(i, p) for i, p in waiting if outcome[p.name] == "skipped"]
        if not trained:
            break
    return {k: [p.name for p in study.points if outcome.get(p.name) == k]
            for k in ("finished", "failed", "pruned", "error", "skipped", "reused")}


def _take_over(out_dir: Path, point: Point, gone: LockHolder, log: Callable[[str], None],
               tag: str) -> None:
    """``point`` was claimed by ``gone``, a process judged gone: its run directory's lock is
    taken over too (its last heartbeat may be a moment younger than the claim's)."""
    RunLock(run_dir(out_dir, point)).take_over_from(gone)
    record_event(out_dir, point.name, "takeover", holder=gone.describe())
    log(f"{tag}: taken over from {gone.describe()}, which left it without releasing it")


def set_aside(out_dir: Path, point: Point, log: Callable[[str], None], tag: str) -> None:
    """Move ``point``'s run, trained on data no longer at its path, to
    ``superseded/<point>/<time>`` (kept, not deleted), so that the point trains afresh on
    the data there now instead of resuming checkpoints that refuse it."""
    kept = (Path(out_dir) / SUPERSEDED_DIR / point.name
            / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{os.urandom(3).hex()}")
    kept.parent.mkdir(parents=True, exist_ok=True)
    os.replace(run_dir(out_dir, point), kept)
    record_event(out_dir, point.name, "superseded", kept=str(kept))
    log(f"{tag}: its run of the other data is kept in {kept}; training it afresh")


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


__all__ = ["DataFingerprints", "Point", "PointState", "Study", "StudyConflict",
           "StudyInterrupted", "check_runtime", "continue_command", "create_study",
           "events_file", "open_study", "point_claim", "point_state", "read_events",
           "read_failure", "read_study", "record_event", "run_dir", "run_study",
           "same_point_names", "set_aside", "store_study", "study_lock", "time_epoch",
           "train_point"]
