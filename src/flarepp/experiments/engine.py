"""The one experiment engine: a point source -> claimed points -> train a point -> events.

A :class:`~flarepp.storage.studydir.Study` is a list of points, each a complete run config
(the grid of ``flarepp sweep``, the models x datasets x seeds of ``flarepp compare``, the
trials of an adaptive search, ...), plus the report plug-ins that tabulate it
(:mod:`flarepp.experiments.reports`). Its directory and every file in it belong to
:class:`~flarepp.storage.studydir.StudyDir`.

**One loop** (:func:`run_study`), fed by a **point source** (:class:`PointSource`, as Hydra
keeps the sweeper apart from the launcher and Optuna keeps one optimize loop over its
storage): the loop asks the source for the next point, works on it and tells the source
what became of it. Working on a point is the same for every source (:class:`PointWork`):

* its state (:func:`point_state`); a settled point (finished, failed, pruned) is told, not
  trained;
* its claim, ``claims/<point>/.lock``: a process works on a point only while it holds this
  :class:`~flarepp.locks.Lease` (an exclusive create with a heartbeat, which holds
  across hosts sharing the directory). The lease is the one record of who works on what:
  a point whose holder was killed is taken over at once on the holder's host, and by
  another host once the holder's heartbeat is older than its grace period; the taker
  resumes it from its checkpoint (its run directory's lock is taken over with the claim);
* training it (:func:`train_point`) under the failure policy below; every step is an event
  (``events/<host>-<pid>.jsonl``: who started, resumed, finished, failed, took over or hit
  an error on which point; :func:`read_events` merges them).

The sources: :class:`GridSource`, a study's fixed points, in passes until a pass trains
nothing (so points whose holders died meanwhile are taken over then); and the adaptive
search's :class:`~flarepp.experiments.search.SearchSource`, Optuna's ask and tell.

``study.json`` is written by :func:`create_study` under an exclusive lock, with every
point's ``data_root`` resolved to an absolute path: two different studies started at the
same instant on one directory cannot both be accepted (the second is refused, naming what
differs), and a process joining from another working directory trains on the same data. A
study grows but never changes: one that holds every stored point unchanged and adds points
(more seeds, a longer schedule) replaces it, and its finished runs count.

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
checkpointed). Anything else (a full disk, a locked run directory, data that cannot be read,
CUDA out of memory, a bug) is recorded as an ``error`` event and leaves the point resumable
from its checkpoints: the next run of the study retries it once the cause is fixed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

import torch

from flarepp.data.fingerprint import DataMismatch, check_same_data
from flarepp.locks import GRACE_S, Lease, RunLock, RunLocked
from flarepp.storage.checkpoint import CheckpointError, newest_readable_checkpoint
from flarepp.storage.config import RUNTIME_FIELDS, RunConfig
from flarepp.storage.rundir import RunDir
from flarepp.storage.studydir import Point, Study, StudyDir, check_point_name
from flarepp.tasks import TASKS, build_task
from flarepp.train import Trainer, latest_checkpoint
from flarepp.train.callbacks import TrainerCallback, TrainingPruned
from flarepp.train.checks import apply_overrides
from flarepp.train.loop import TrainingInterrupted

if TYPE_CHECKING:
    from flarepp.train.tracking import TrackSettings

STUDY_LOCK_WAIT_S = 60.0  # the study's lock is held for milliseconds by a live holder
FAILED_NAME = RunDir.FAILED


class StudyConflict(ValueError):
    """The directory holds another study, or a run of another config."""


class StudyInterrupted(Exception):
    """A stop signal (:data:`flarepp.train.loop.STOP_SIGNALS`) stopped the study after a
    step; rerunning it continues."""

    def __init__(self, signum: int, point: str, continue_with: str) -> None:
        self.signum, self.exit_code = signum, 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name} while training {point}; "
                         f"its state is checkpointed: continue with `{continue_with}`")


# ---------------------------------------------------------------------------------------------
# study.json: created, joined, grown

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
    """The study stored in ``out_dir`` (:meth:`StudyDir.read_study`), its ``continue_with``
    naming ``out_dir`` (where it is now, wherever it was made)."""
    study = StudyDir(out_dir).read_study()
    return dataclasses.replace(study, continue_with=continue_command(out_dir))


def open_study(out_dir: str | Path) -> Study:
    """The study stored in ``out_dir`` (a directory an earlier flarepp started is opened by
    :func:`flarepp.experiments.studies.open_any_study`)."""
    return read_study(out_dir)


def resolve_paths(study: Study, out_dir: Path) -> Study:
    """Every point's ``data_root`` as an absolute path (relative to this process's cwd),
    and the command that continues the study in ``out_dir``."""
    points = [dataclasses.replace(p, config=dataclasses.replace(
        p.config, data_root=str(Path(p.config.data_root).expanduser().resolve())))
              for p in study.points]
    return dataclasses.replace(study, points=points, continue_with=continue_command(out_dir))


def study_lock(out_dir: Path):
    """The study's lock (:meth:`StudyDir.locked`), waited for up to
    :data:`STUDY_LOCK_WAIT_S`."""
    return StudyDir(out_dir).locked(STUDY_LOCK_WAIT_S)


def create_study(out_dir: str | Path, study: Study) -> Study:
    """The study of ``out_dir``: ``study`` (paths resolved) written there if the directory
    holds none or ``study`` grows the stored one (:func:`_grows`), else the stored one when
    it computes the same; another is refused."""
    out_dir = Path(out_dir)
    study = resolve_paths(study, out_dir)
    with study_lock(out_dir):
        stored = read_study(out_dir) if StudyDir(out_dir).has_study() else None
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
    StudyDir(out_dir).write_study(study)


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
    return f"flarepp sweep --out {shlex.quote(str(out_dir))}"


# ---------------------------------------------------------------------------------------------
# events (StudyDir's, by the study's path)

def events_file(out_dir: str | Path) -> Path:
    """This process's own event file (:meth:`StudyDir.events_file`)."""
    return StudyDir(out_dir).events_file()


def record_event(out_dir: str | Path, point: str, event: str, **extra: Any) -> None:
    """Append an event of ``point`` to this process's file (:meth:`StudyDir.record_event`)."""
    StudyDir(out_dir).record_event(point, event, **extra)


def read_events(out_dir: str | Path, **options: Any) -> list[dict[str, Any]]:
    """Every process's events in time order (:meth:`StudyDir.read_events`)."""
    return StudyDir(out_dir).read_events(**options)


# ---------------------------------------------------------------------------------------------
# "finished with this config"

def run_dir(out_dir: str | Path, point: Point | str) -> Path:
    """``runs/<point>`` of the study in ``out_dir`` (:meth:`StudyDir.run_path`)."""
    return StudyDir(out_dir).run_path(point if isinstance(point, str) else point.name)


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
            self._cache[key] = build_task(config, config.data_root).data_identity()
        return self._cache[key]


def stored_fingerprint(directory: Path) -> dict[str, Any] | None:
    """The data fingerprint stored in a run's newest readable checkpoint (an unreadable newer
    one is passed over, as ``--resume`` does); None without a readable one."""
    found = newest_readable_checkpoint(directory)
    if found.state is None:
        return None
    return found.state.get("data", {}).get("identity") or {}


def _other_data(stored_data: dict[str, Any] | None, config: RunConfig,
                fingerprint: Callable[[RunConfig], dict[str, Any]]) -> str | None:
    """Why a run whose checkpoint stores ``stored_data`` is of other data than ``config``'s
    path holds now, or None (the same data, or nothing stored to compare)."""
    if not stored_data:
        return None
    try:
        check_same_data(stored_data, fingerprint(config), what="reuse")
    except DataMismatch as err:
        return str(err)
    return None


def _finished_state(directory: Path, point: Point,
                    fingerprint: Callable[[RunConfig], dict[str, Any]] | None) -> PointState:
    """The state of a run that holds ``metrics.json`` (:func:`point_state`)."""
    run = RunDir(directory)
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


def point_state(out_dir: Path, point: Point,
                fingerprint: Callable[[RunConfig], dict[str, Any]] | None = None) -> PointState:
    """Whether ``point`` is finished (module docstring); ``fingerprint`` gives the current
    data's (without it the data is not checked: reports read state without loading data)."""
    directory = run_dir(out_dir, point)
    run = RunDir(directory)
    if run.has_metrics():
        return _finished_state(directory, point, fingerprint)
    failure = read_failure(directory)
    if failure is not None:
        return PointState("failed", error=failure["error"])
    pruned = run.read_pruned()
    if pruned is not None:
        return PointState("pruned", error=pruned["reason"])
    other = (None if fingerprint is None
             else _other_data(stored_fingerprint(directory), point.config, fingerprint))
    if other is not None:  # resuming it would refuse the data at every rerun
        return PointState("pending", error=other, other_data=True)
    return PointState("pending")


# ---------------------------------------------------------------------------------------------
# train a point

@dataclass(frozen=True)
class Outcome:
    """What became of a point the loop worked on: ``finished``, ``failed`` (numerically,
    final), ``pruned`` (final), ``error`` (left resumable; ``error`` says why), ``held``
    (another live process holds it; ``error`` names it) or ``settled`` (finished, failed or
    pruned before: ``state``). A finished point's ``state`` holds its metrics."""

    status: str
    state: PointState | None = None
    error: str | None = None


TRAINED = ("finished", "failed", "pruned", "error")
"""The outcomes of a point this process worked on."""

OUTCOMES = ("finished", "failed", "pruned", "error", "skipped", "reused")
"""What :func:`run_study` counts a point as for this process."""


def environment_errors() -> tuple[type[BaseException], ...]:
    """Errors that have nothing to do with the numbers: they leave a point resumable. A
    failed allocation is one of them: the trainer's :class:`~flarepp.allocator.OutOfMemory`
    (a ``MemoryError`` whose sentence names the stage, the bytes and the option that bounds
    it), numpy's ``MemoryError`` and torch's ``OutOfMemoryError``."""
    return (OSError, RunLocked, DataMismatch, CheckpointError, MemoryError,
            torch.OutOfMemoryError)


def error_kind(err: BaseException) -> str:
    return "environment" if isinstance(err, environment_errors()) else "unexpected"


def time_epoch(config: RunConfig, *, epochs: int = 2) -> dict[str, Any]:
    """A separate timing run (paper Sec. D.4): ``epochs`` training epochs of ``config`` from
    scratch in a temporary directory; the last one's wall time (data loading included) and
    this process's CPU time over it. Nothing is evaluated or kept."""
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


def _time_point(study: Study, out: StudyDir, point: Point, config: RunConfig,
                log: Callable[[str], None], tag: str) -> None:
    """The point's separate timing run, once, where the study asks for one."""
    run = out.run(point.name)
    if study.timing_epochs and not run.has_cost():
        cost = time_epoch(config, epochs=study.timing_epochs)
        run.write_cost(cost)
        out.record_event(point.name, "timed", **cost)
        log(f"{tag}: an epoch takes {cost['epoch_seconds']:.3g} s "
            f"({cost['epoch_cpu_seconds']:.3g} s CPU)")


def train_point(study: Study, out_dir: Path, point: Point, config: RunConfig,
                log: Callable[[str], None], tag: str, *,
                callbacks: Sequence[TrainerCallback] = (),
                track: TrackSettings | None = None) -> Outcome:
    """Time (if the study asks) and train or resume one claimed point: ``finished`` (its
    metrics in ``state``), ``failed`` (numerically: final, ``failed.json``), ``pruned`` (a
    callback stopped it: final, ``pruned.json``) or ``error`` (resumable; an event).
    ``callbacks`` go to the trainer (:mod:`flarepp.train.callbacks`); ``track`` (a
    :class:`~flarepp.train.tracking.TrackSettings`) adds a tracker, the study's directory
    naming its experiment, and has the run's figures drawn for it."""
    out = StudyDir(out_dir)
    directory = out.run_path(point.name)
    if track is not None:
        callbacks = [*track.callbacks(directory, point.name, study=out_dir), *callbacks]
    try:
        _time_point(study, out, point, config, log, tag)
        resume = latest_checkpoint(directory) is not None
        out.record_event(point.name, "resume" if resume else "start")
        log(f"{tag}: {'resuming' if resume else 'training'} into {directory}")
        metrics = Trainer(config, directory, resume=resume, progress=False,
                          callbacks=callbacks, plot=track is not None).fit()
    except TrainingPruned as err:
        RunDir(directory).write_pruned(err.reason, err.epoch)
        out.record_event(point.name, "prune", epoch=err.epoch, reason=err.reason)
        log(f"{tag}: pruned after epoch {err.epoch} (final): {err.reason}")
        return Outcome("pruned", error=err.reason)
    except FloatingPointError as err:
        RunDir(directory).write_failure(err)
        out.record_event(point.name, "fail", error=str(err))
        log(f"{tag}: failed (final, not retried): {err}")
        return Outcome("failed", error=str(err))
    except TrainingInterrupted as err:
        out.record_event(point.name, "interrupt", signal=err.signum)
        raise StudyInterrupted(err.signum, point.name, study.continue_with) from None
    except Exception as err:  # recorded, resumable: retried when the study runs again
        error = f"{type(err).__name__}: {err}"
        out.record_event(point.name, "error", error=error, kind=error_kind(err))
        log(f"{tag}: {error_kind(err)} error, left resumable (retried on the next run): "
            f"{error}")
        return Outcome("error", error=error)
    headline = f"test_{TASKS.get(config.task).headline}"
    out.record_event(point.name, "finish", **{headline: metrics[headline]})
    log(f"{tag}: {headline} {metrics[headline]:.4g}")
    return Outcome("finished", PointState("done", metrics))


def check_runtime(runtime: list[str] | None) -> None:
    """``runtime`` (``--set`` items for one process of a study) names runtime fields only."""
    for item in runtime or []:
        if item.split("=", 1)[0].strip() not in RUNTIME_FIELDS:
            raise ValueError(f"{item!r}: only runtime fields ({', '.join(RUNTIME_FIELDS)}) "
                             "may differ between the processes of a study")


def set_aside(out_dir: Path, point: Point, log: Callable[[str], None], tag: str) -> None:
    """Move ``point``'s run, trained on data no longer at its path, to
    ``superseded/<point>/<time>`` (kept, not deleted), so that the point trains afresh on
    the data there now instead of resuming checkpoints that refuse it."""
    out = StudyDir(out_dir)
    kept = out.set_aside(point.name)
    out.record_event(point.name, "superseded", kept=str(kept))
    log(f"{tag}: its run of the other data is kept in {kept}; training it afresh")


# ---------------------------------------------------------------------------------------------
# the one loop and its point sources

@dataclass
class Offer:
    """A point a source hands the loop: ``tag`` names it in log lines; ``study`` is the
    study as the source knows it now (a search grows it trial by trial); ``first``: this
    process has not been offered it before; ``claim``: its lease when the source took it (a
    search claims its trial's point under the study's lock), else the loop claims it;
    ``callbacks`` go to its trainer; ``ticket`` is the source's own (a search's trial)."""

    point: Point
    tag: str
    study: Study
    first: bool = True
    claim: Lease | None = None
    callbacks: Sequence[TrainerCallback] = ()
    ticket: Any = None


Claim = Callable[[str], Lease]
"""Takes the claim of a point by name (:meth:`PointWork.claim`)."""


class PointSource(Protocol):
    """What to work on next; :func:`run_study` is the one loop that works on it.

    ``start`` creates or joins the study in ``out`` before the first point; ``next`` gives
    the next point (None: nothing is left for this process), and may take its claim through
    ``claim`` (``RunLocked`` while another live process holds it); ``tell`` hears what
    became of it and says what it counts as for this process (one of :data:`OUTCOMES`, or
    None: not counted); ``abandon`` hears the error that stops the loop while it works on a
    point (a stop signal, a conflict, a bug), raised after it."""

    def start(self, out: StudyDir, log: Callable[[str], None]) -> None: ...

    def next(self, claim: Claim) -> Offer | None: ...

    def tell(self, offer: Offer, outcome: Outcome) -> str | None: ...

    def abandon(self, offer: Offer, error: BaseException) -> None: ...


class GridSource:
    """A study's fixed points (a grid, a comparison, ...), offered in passes: a pass offers
    every point not settled or worked on yet, and the next pass those that another process
    held, until a pass trains nothing (so points whose holders died meanwhile are taken
    over then)."""

    def __init__(self, study: Study) -> None:
        self.study = study
        self._offers: Iterator[Offer] = iter(())
        self._counted: dict[str, str | None] = {}
        self._trained = False
        self.log: Callable[[str], None] = print

    def start(self, out: StudyDir, log: Callable[[str], None]) -> None:
        self.study, self.log = create_study(out.path, self.study), log
        self._offers = self._passes()

    def _passes(self) -> Iterator[Offer]:
        waiting, first = list(enumerate(self.study.points)), True
        while waiting:
            self._trained = False
            for i, point in waiting:
                yield Offer(point, f"[{i + 1}/{len(self.study.points)}] {point.name}",
                            self.study, first=first)
            waiting = [(i, p) for i, p in waiting if self._counted.get(p.name) == "skipped"]
            if not self._trained:
                return
            first = False

    def next(self, claim: Claim) -> Offer | None:
        return next(self._offers, None)

    def tell(self, offer: Offer, outcome: Outcome) -> str | None:
        self._trained |= outcome.status in TRAINED
        counted: str | None = outcome.status if outcome.status in TRAINED else "skipped"
        if outcome.status == "settled" and offer.first:
            if outcome.state.status == "done":
                counted = "reused"
            else:  # failed or pruned before: final, not counted again
                self.log(f"{offer.tag}: {outcome.state.status} before (final, not retried): "
                         f"{outcome.state.error}")
                counted = None
        self._counted[offer.point.name] = counted
        return counted

    def abandon(self, offer: Offer, error: BaseException) -> None:
        """Nothing to undo: the point's run keeps its checkpoints."""


class PointWork:
    """How the loop works on one offered point, whatever its source (module docstring):
    its state, its claim and a gone holder's takeover, a run of other data set aside, and
    training under the failure policy. ``runtime`` are ``--set`` items of runtime fields for
    this process; ``grace_s`` the seconds without a heartbeat after which another host
    takes this process's points over; ``track`` where its runs are tracked."""

    def __init__(self, out: StudyDir, runtime: list[str], log: Callable[[str], None],
                 grace_s: float, track: TrackSettings | None) -> None:
        self.out, self.runtime, self.log = out, runtime, log
        self.grace_s, self.track = grace_s, track
        self.fingerprints = DataFingerprints()

    def claim(self, name: str) -> Lease:
        """Point ``name``'s claim, taken (``RunLocked`` names a live holder); a gone
        holder's run directory lock is taken over with it (its last heartbeat may be a
        moment younger than the claim's)."""
        lease = self.out.claim(name, grace_s=self.grace_s).acquire()
        if lease.stale is not None:
            RunLock(self.out.run_path(name)).take_over_from(lease.stale)
        return lease

    def state(self, offer: Offer) -> Outcome:
        """``pending`` or ``settled`` with the point's state, or ``error`` when its data
        cannot be read (the policy of training: recorded, left for the next run)."""
        try:
            state = point_state(self.out.path, offer.point, self.fingerprints)
        except StudyConflict:
            raise
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
            self.out.record_event(offer.point.name, "error", error=error, kind=error_kind(err))
            self.log(f"{offer.tag}: cannot check its data, left for the next run: {error}")
            return Outcome("error", error=error)
        return Outcome("pending" if state.status == "pending" else "settled", state)

    def visit(self, offer: Offer) -> Outcome:
        """Work on ``offer``: a settled point is told; a pending one is claimed (unless the
        source claimed it), checked again under its claim and trained."""
        if offer.claim is None:  # a settled point is not claimed, a held one not waited for
            before = self.state(offer)
            if before.status != "pending":
                return before
            try:
                offer.claim = self.claim(offer.point.name)
            except RunLocked as held:
                self.log(f"{offer.tag}: left to its holder: {held}")
                return Outcome("held", error=str(held))
        now = self.state(offer)  # under the claim: its holder may have settled it meanwhile
        if now.status != "pending":
            return now
        self._prepare(offer, now.state)
        config = (apply_overrides(offer.point.config, self.runtime) if self.runtime
                  else offer.point.config)
        return train_point(offer.study, self.out.path, offer.point, config, self.log,
                           offer.tag, callbacks=offer.callbacks, track=self.track)

    def _prepare(self, offer: Offer, state: PointState) -> None:
        """Record a takeover of a gone holder; set a run of other data aside."""
        gone = offer.claim.stale
        if gone is not None:
            self.out.record_event(offer.point.name, "takeover", holder=gone.describe())
            self.log(f"{offer.tag}: taken over from {gone.describe()}, which left it without "
                     "releasing it")
        if state.error:
            self.log(f"{offer.tag}: not reused: {state.error}")
        if state.other_data:
            set_aside(self.out.path, offer.point, self.log, offer.tag)


def run_study(study: Study | PointSource, out_dir: str | Path, *,
              runtime: list[str] | None = None, log: Callable[[str], None] = print,
              claim_grace_s: float = GRACE_S,
              track: TrackSettings | None = None) -> dict[str, list[str]]:
    """The one loop: work on every point ``study`` offers in ``out_dir`` (a
    :class:`Study` is offered by a :class:`GridSource`; an adaptive search is its own
    :class:`PointSource`), telling the source each outcome (module docstring).

    ``runtime`` are ``--set`` items of runtime fields (``device=cpu``) for this process
    only; ``claim_grace_s`` the seconds without a heartbeat after which another host takes
    this process's points over; ``track`` sends this process's runs to a tracker
    (:func:`train_point`). Returns this process's point names by what they count as
    (:data:`OUTCOMES`: ``finished``, ``failed``, ``pruned``, ``error`` (left resumable),
    ``skipped`` (held by another process), ``reused``). A study directory where no claim can
    be made raises :class:`~flarepp.locks.LockUnavailable` before anything is
    trained."""
    check_runtime(runtime)
    source = GridSource(study) if isinstance(study, Study) else study
    work = PointWork(StudyDir(out_dir), list(runtime or []), log, claim_grace_s, track)
    source.start(work.out, log)
    counted: dict[str, str | None] = {}
    while (offer := source.next(work.claim)) is not None:
        try:
            counted[offer.point.name] = source.tell(offer, work.visit(offer))
        except BaseException as err:
            source.abandon(offer, err)
            raise
        finally:  # after the source is told: a claimed point is never left untold
            if offer.claim is not None:
                offer.claim.release()
    return {k: [name for name, c in counted.items() if c == k] for k in OUTCOMES}


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


__all__ = ["Claim", "DataFingerprints", "FAILED_NAME", "GridSource", "OUTCOMES", "Offer",
           "Outcome", "Point", "PointSource", "PointState", "PointWork", "Study",
           "StudyConflict", "StudyInterrupted", "check_point_name", "check_runtime",
           "continue_command", "create_study", "environment_errors", "events_file",
           "open_study", "point_state",
           "read_events", "read_failure", "read_study", "record_event", "resolve_paths",
           "run_dir", "run_study", "same_point_names", "set_aside", "store_study",
           "study_lock", "time_epoch", "train_point"]
