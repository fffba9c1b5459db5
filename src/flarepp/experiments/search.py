"""Adaptive search: ``flarepp sweep PRESET --search optuna --trials K --grid ...`` (Optuna).

**The space** is written as a grid's axes (:mod:`.studies`), each any ``--set`` key:
``V1,V2,...`` is a choice among values, ``LOW:HIGH`` a real range (``LOW:HIGH:log``
log-uniform) and ``LOW..HIGH`` an integer one (``:log`` too), both ends included; a real
value is used to 4 significant digits. A trial's config is built as a grid point's (the
preset, ``--set``, ``--data``, then the trial's values), and the trial *is* a point of the
study: named and labelled like a grid point (``lr-0.001234_seed-7``), added to
``study.json`` when it is asked (the study grows), trained by the engine's
:func:`~.engine.train_point`, so ``flarepp sweep report`` and its plug-ins read the trials as
they read grid points, plus the ``search`` plug-in (:mod:`.reports.search`): the trials, their
states and the best one.

**The objective** is the task's headline on its validation split (``--set
val_fraction=F`` carves one from the training data; a task with its own, LRA, uses it),
else on its first evaluation split (the test split: said once, since choosing on test
data overstates the result), minimised or maximised as the task says. It is reported
after every evaluation epoch; the pruner (``median`` by default: a trial whose best value so
far is worse than the median of the completed trials' at the same epoch, once
``--startup-trials`` trials have completed) stops a run, whose state is checkpointed and
which is recorded ``pruned``, final, like a diverged one. TPE (default) draws its first
``--startup-trials`` trials at random.

**Storage**: ``optuna.journal`` in the study directory (Optuna's ``JournalStorage`` on a
``JournalFileBackend``, whose lock is a symlink, safe on NFS), shared by every worker that
runs the same command. The spec (preset, ``--set``, data, space, sampler, pruner, the
objective) is stored in the Optuna study and in ``study.json``: a worker that brings another
one is refused, naming what differs. ``--trials K`` counts the study's trials (another
worker, or a later run, may raise it).

**Workers** (:func:`run_search`): under the study's lock (:func:`~.engine.study_lock`, held
for milliseconds) a worker fails stale trials, asks Optuna for a trial, records its point,
grows ``study.json`` and claims the point (:func:`~.engine.point_claim`), so a running
trial's point is always claimed by a live worker. Optuna's heartbeat (``fail_stale_trials``)
needs a database storage; here a running trial whose point's claim is free is one whose
worker died: it is failed and a retry with the same values is enqueued, which resumes the
point from its checkpoint (nothing is trained twice). A point that hit an environment error
(a full disk, other data at the path) is left resumable and retried so by the next worker
to start; values that another trial already evaluated are not trained again (its result is
told); a trial whose values another worker is training now is failed, said.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from flarepp.experiments.engine import (DataFingerprints, Point, Study, StudyConflict,
                                        StudyInterrupted, check_runtime, open_study,
                                        point_claim, point_state, read_events, record_event,
                                        resolve_paths, run_dir, set_aside, store_study,
                                        study_lock, train_point)
from flarepp.experiments.studies import SWEEP_REPORTS, Range, parse_range, sweep_study
from flarepp.io import UnreadableFile
from flarepp.registry import Registry
from flarepp.storage.config import RunConfig
from flarepp.storage.rundir import RunDir
from flarepp.train.callbacks import TrainerCallback
from flarepp.train.checks import apply_overrides

if TYPE_CHECKING:
    from flarepp.train.tracking import TrackSettings

JOURNAL_NAME = "optuna.journal"
OPTUNA_STUDY = "flarepp"
SPEC_ATTR = "flarepp_search"
EXTRA = "search"
SEARCH_REPORTS = ["runs", "search", *[r for r in SWEEP_REPORTS if r != "runs"]]
FIXED_KEYS = ("preset", "val_fraction")
"""Keys a search cannot vary: they choose the objective's task and split."""


def require_optuna():
    """``optuna``, or a sentence naming the extra that installs it."""
    try:
        import optuna
    except ImportError:
        raise ValueError("--search optuna needs the optuna package, which is not installed: "
                         f"pip install 'flarepp[{EXTRA}]'") from None
    return optuna


SAMPLERS: Registry[Callable[[int], Any]] = Registry("sampler")
PRUNERS: Registry[Callable[[int], Any]] = Registry("pruner")


@SAMPLERS.register("tpe", doc="Tree-structured Parzen estimator after the startup trials")
def _tpe(startup: int):
    # constant liar (Optuna's default): running trials count as bad, so workers spread out
    return require_optuna().samplers.TPESampler(n_startup_trials=startup)


@SAMPLERS.register("random", doc="independent uniform draws")
def _random(startup: int):
    return require_optuna().samplers.RandomSampler()


@PRUNERS.register("median", doc="worse than the completed trials' median at the same epoch")
def _median(startup: int):
    return require_optuna().pruners.MedianPruner(n_startup_trials=startup)


@PRUNERS.register("none", doc="every trial runs to the end")
def _no_pruner(startup: int):
    return require_optuna().pruners.NopPruner()


# ---------------------------------------------------------------------------------------------
# the spec


Axis = Range | tuple[str, ...]


@dataclass(frozen=True)
class SearchSpec:
    """What a search computes: ``space`` (``(key, the --grid text)`` per axis) over
    ``preset`` with ``sets`` and ``data``, the sampler, the pruner and the startup trials.
    The objective (:attr:`metric`, :attr:`direction`) follows from the preset."""

    preset: str
    space: tuple[tuple[str, str], ...]
    sets: tuple[str, ...] = ()
    data: str | None = None
    sampler: str = "tpe"
    pruner: str = "median"
    startup_trials: int = 5
    split: str = field(init=False)
    metric: str = field(init=False)
    direction: str = field(init=False)

    def __post_init__(self) -> None:
        from flarepp.tasks import TASKS
        SAMPLERS.entry(self.sampler)
        PRUNERS.entry(self.pruner)
        if self.startup_trials < 0:
            raise ValueError(f"--startup-trials must be >= 0, got {self.startup_trials}")
        if not self.space:
            raise ValueError("give the search space with --grid KEY=V1,V2 KEY=LOW:HIGH[:log] "
                             "KEY=LOW..HIGH (e.g. --grid lr=1e-4:1e-2:log)")
        for key, _ in self.space:
            if key in FIXED_KEYS:
                raise ValueError(f"--grid {key}: a search keeps {key} fixed (it chooses the "
                                 f"objective); give it with --set, or search each {key} apart")
        base = self.base()
        task = TASKS.get(base.task)
        split = "val" if base.val_fraction > 0 else task.eval_splits[0]
        object.__setattr__(self, "split", split)
        object.__setattr__(self, "metric", f"{split}_{task.headline}")
        object.__setattr__(self, "direction",
                           "minimize" if task.lower_is_better else "maximize")
        axes = self.axes()
        if all(not isinstance(a, Range) and len(a) == 1 for _, a in axes):
            raise ValueError("the search space has no axis to search: give a range "
                             "(KEY=LOW:HIGH) or more than one value (KEY=V1,V2)")
        for key, axis in axes:  # every value's config is checked before anything trains
            kind = int if isinstance(axis, Range) and axis.integer else float
            ends = [kind(axis.low), kind(axis.high)] if isinstance(axis, Range) else axis
            read = {}
            for value in ends:
                config = apply_overrides(base, [f"{key}={value}"])
                same = read.setdefault(json.dumps(config.identity(), sort_keys=True,
                                                  default=str), value)
                if not isinstance(axis, Range) and same != value:  # lr=0.001,1e-3
                    raise ValueError(f"--grid {key}: the choices {same} and {value} read as "
                                     "the same config; give each value once")

    def base(self) -> RunConfig:
        from flarepp.train import get_preset
        base = get_preset(self.preset, list(self.sets))
        return base if self.data is None else dataclasses.replace(base, data_root=self.data)

    def axes(self) -> list[tuple[str, Axis]]:
        """Each axis as a :class:`Range` or a tuple of values."""
        from flarepp.experiments.studies import split_values
        out: list[tuple[str, Axis]] = []
        for key, text in self.space:
            found = parse_range(key, text)
            out.append((key, found if found is not None else tuple(split_values(text))))
        return out

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {**d, "space": [list(a) for a in self.space], "sets": list(self.sets)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SearchSpec":
        return cls(d["preset"], tuple((k, v) for k, v in d["space"]), tuple(d["sets"]),
                   d["data"], d["sampler"], d["pruner"], int(d["startup_trials"]))

    def point(self, values: dict[str, str]) -> Point:
        """The study point of a trial's values (named, configured and labelled as the grid
        point of those values would be; its data path resolved)."""
        (point,) = sweep_study(self.preset, [(k, [v]) for k, v in values.items()],
                               sets=list(self.sets), data=self.data).points
        root = str(Path(point.config.data_root).expanduser().resolve())
        return dataclasses.replace(point, config=dataclasses.replace(point.config,
                                                                     data_root=root))

    def study(self, points: list[Point], trials: int, out_dir: Path) -> Study:
        return resolve_paths(Study("search", points, list(SEARCH_REPORTS),
                                   info={"search": self.to_dict(), "trials": trials}),
                             out_dir)


def search_spec(preset: str, axes: list[tuple[str, list[str]]], *, sets: Sequence[str] = (),
                data: str | None = None, sampler: str = "tpe", pruner: str = "median",
                startup_trials: int = 5) -> SearchSpec:
    """The spec of ``flarepp sweep PRESET --search optuna --grid ...`` (``axes`` as
    :func:`~.studies.parse_axes` returns them); ``data`` (default: the preset's) is resolved
    here, so that workers started in other directories share the spec."""
    from flarepp.train import get_preset
    space = tuple((key, ",".join(values)) for key, values in axes)
    data = data if data is not None else get_preset(preset, list(sets)).data_root
    return SearchSpec(preset, space, tuple(sets), str(Path(data).expanduser().resolve()),
                      sampler, pruner, startup_trials)


def stored_search(study: Study) -> tuple[SearchSpec, int]:
    """The spec and the trial count of a stored search study."""
    return SearchSpec.from_dict(study.info["search"]), int(study.info["trials"])


def spec_difference(stored: dict[str, Any], mine: dict[str, Any]) -> str:
    """What differs between two specs' dicts, in words (the first difference)."""
    a, b = dict(stored["space"]), dict(mine["space"])
    for key in dict.fromkeys([*a, *b]):
        if key not in b:
            return f"the search space differs: {key} is searched there ({a[key]}), not here"
        if key not in a:
            return f"the search space differs: {key} is searched here ({b[key]}), not there"
        if a[key] != b[key]:
            return f"the search space differs: {key} is {a[key]} there and {b[key]} here"
    for key in stored.keys() | mine.keys():
        if stored.get(key) != mine.get(key):
            return f"its {key} differs: {stored.get(key)!r} there, {mine.get(key)!r} here"
    return "nothing"


# ---------------------------------------------------------------------------------------------
# the Optuna study


def journal_storage(path: Path):
    """Optuna's journal storage of ``path``; a file that is no journal (overwritten, edited
    by hand) is :class:`~flarepp.io.UnreadableFile` naming it, not the JSON parser's words."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    try:
        return JournalStorage(JournalFileBackend(str(path)))
    # JSONDecodeError is a ValueError; Optuna asserts on an unknown op code
    except (ValueError, KeyError, TypeError, AttributeError, AssertionError) as err:
        raise UnreadableFile(f"{path}: not an Optuna journal ({type(err).__name__}: {err})"
                             ) from None


def open_search(spec: SearchSpec, out_dir: str | Path):
    """The Optuna study of ``out_dir`` (created with ``spec`` if there is none); a directory
    that holds another spec, or a study that is not a search, is refused (a sentence)."""
    optuna = require_optuna()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with study_lock(out_dir):
        if (out_dir / "study.json").exists():
            stored = open_study(out_dir)
            if stored.kind != "search":
                raise StudyConflict(f"{str(out_dir)!r} holds a {stored.kind} study, not a "
                                    f"search; continue it with `{stored.continue_with}` or "
                                    "choose another --out")
        storage = journal_storage(out_dir / JOURNAL_NAME)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        options = dict(sampler=SAMPLERS.get(spec.sampler)(spec.startup_trials),
                       pruner=PRUNERS.get(spec.pruner)(spec.startup_trials))
        try:
            study = optuna.load_study(study_name=OPTUNA_STUDY, storage=storage, **options)
        except KeyError:
            study = optuna.create_study(study_name=OPTUNA_STUDY, storage=storage,
                                        direction=spec.direction, **options)
        stored_spec = study.user_attrs.get(SPEC_ATTR)
        if stored_spec is None:
            study.set_user_attr(SPEC_ATTR, spec.to_dict())
        elif stored_spec != spec.to_dict():
            raise StudyConflict(f"{str(out_dir)!r} holds a search of another spec "
                                f"({spec_difference(stored_spec, spec.to_dict())}); run its "
                                "own command to continue it, or choose another --out")
    return study


def _states():
    return require_optuna().trial.TrialState


def superseded(trials: Sequence[Any]) -> set[int]:
    """Numbers of trials that a retry (enqueued with the same values) replaced."""
    return {int(t.user_attrs["retry_of"]) for t in trials if "retry_of" in t.user_attrs}


def counted(trials: Sequence[Any]) -> list[Any]:
    """The trials that count towards ``--trials``: asked, and not replaced by a retry."""
    replaced = superseded(trials)
    return [t for t in trials if t.number not in replaced and t.state != _states().WAITING]


def _retry(study: Any, trial: Any, why: str) -> None:
    study.enqueue_trial(dict(trial.params), user_attrs={"retry_of": trial.number,
                                                        "retry_why": why})


def fail_stale_trials(study: Any, out_dir: Path, log: Callable[[str], None]) -> list[int]:
    """Fail every running trial whose point no live worker claims, enqueueing a retry with
    its values (the caller holds the study lock); returns their numbers."""
    from flarepp.storage.rundir import RunLocked
    stale = []
    for trial in study.get_trials(deepcopy=False, states=(_states().RUNNING,)):
        name = trial.user_attrs.get("point")
        if name is not None:
            claim = point_claim(out_dir, name)
            try:
                claim.acquire()
            except RunLocked:
                continue  # its worker is alive
            claim.release()
        study.tell(trial.number, state=_states().FAIL)
        _retry(study, trial, "its worker died")
        if name is not None:
            record_event(out_dir, name, "stale", trial=trial.number)
        log(f"trial {trial.number} ({name or 'no point yet'}): its worker died; failed as "
            "stale, and a retry with the same values resumes its point")
        stale.append(trial.number)
    return stale


def _retry_errors(study: Any, log: Callable[[str], None]) -> None:
    """Enqueue a retry of every failed trial left resumable by an environment error."""
    trials = study.get_trials(deepcopy=False)
    replaced = superseded(trials)
    for trial in trials:
        if trial.state == _states().FAIL and "error" in trial.user_attrs \
                and trial.number not in replaced:
            _retry(study, trial, "an error left it resumable")
            log(f"trial {trial.number}: retrying its point "
                f"{trial.user_attrs.get('point')} (it stopped on an error)")


def suggest(trial: Any, axes: list[tuple[str, Axis]]) -> dict[str, str]:
    """The trial's value of every axis, as the text a ``--set`` item takes."""
    values = {}
    for key, axis in axes:
        if isinstance(axis, Range) and axis.integer:
            values[key] = str(trial.suggest_int(key, int(axis.low), int(axis.high),
                                                log=axis.log))
        elif isinstance(axis, Range):
            values[key] = format(trial.suggest_float(key, axis.low, axis.high, log=axis.log),
                                 ".4g")
        else:
            values[key] = str(trial.suggest_categorical(key, list(axis)))
    return values


# ---------------------------------------------------------------------------------------------
# pruning through the trainer's callback


def history(run: Path, metric: str) -> list[tuple[int, float]]:
    """``(epoch, value)`` of every finite ``metric`` in the run's ``log.jsonl``."""
    logged = RunDir(run)
    records = logged.read_log() if logged.has_log() else []
    return [(int(r["epoch"]), float(r[metric])) for r in records
            if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric])]


class TrialPruning(TrainerCallback):
    """Reports the objective of every evaluation epoch to an Optuna trial and stops the run
    when the pruner says so (its ``splits``: the objective's split, evaluated every epoch);
    never after the last epoch, when the run has cost all it will."""

    def __init__(self, trial: Any, split: str, metric: str, pruner: str) -> None:
        self.trial, self.metric, self.pruner = trial, metric, pruner
        self.splits = (split,)
        self.epochs = 0

    def on_run_start(self, config: RunConfig, run_dir: Path, epoch: int) -> None:
        self.epochs = config.epochs
        for step, value in history(run_dir, self.metric):  # a resumed run's epochs
            self.trial.report(value, step)

    def on_epoch_end(self, epoch: int, record: dict[str, Any]) -> str | None:
        value = record.get(self.metric)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        self.trial.report(value, epoch)
        if epoch < self.epochs and self.trial.should_prune():
            return (f"the {self.pruner} pruner stopped it at epoch {epoch} ({self.metric} "
                    f"{value:.4g}: {PRUNERS.entry(self.pruner).doc})")
        return None


# ---------------------------------------------------------------------------------------------
# workers


OUTCOMES = ("finished", "pruned", "failed", "error", "reused", "skipped")


def run_search(spec: SearchSpec, out_dir: str | Path, trials: int, *,
               runtime: list[str] | None = None, track: TrackSettings | None = None,
               log: Callable[[str], None] = print) -> dict[str, list[str]]:
    """Ask and evaluate trials of the search in ``out_dir`` until it has ``trials`` (module
    docstring); several processes may run it at once. Returns this process's point names by
    outcome: ``finished``, ``pruned``, ``failed`` (numerically), ``error`` (left resumable),
    ``reused`` (values evaluated before) and ``skipped`` (values another worker is
    training)."""
    from flarepp.storage.rundir import RunLocked
    if trials < 1:
        raise ValueError(f"--trials must be >= 1, got {trials}")
    check_runtime(runtime)
    out_dir = Path(out_dir)
    optuna_study = open_search(spec, out_dir)
    if not spec.metric.startswith("val_"):
        print(f"flarepp sweep: the search chooses on {spec.metric}, the test data (no "
              "validation split): give --set val_fraction=0.2 to choose on validation",
              file=sys.stderr)
    axes, fingerprints = spec.axes(), DataFingerprints()
    done: dict[str, list[str]] = {k: [] for k in OUTCOMES}
    first = True
    while True:
        with study_lock(out_dir):
            if first:
                _retry_errors(optuna_study, log)
                first = False
            fail_stale_trials(optuna_study, out_dir, log)
            if len(counted(optuna_study.get_trials(deepcopy=False))) >= trials:
                break
            trial = optuna_study.ask()
            try:
                point = spec.point(suggest(trial, axes))
                trial.set_user_attr("point", point.name)
                study = _add_point(out_dir, spec, point, trials)
                claim = point_claim(out_dir, point.name)
                claim.acquire()
            except RunLocked:
                trial.set_user_attr("duplicate", True)
                optuna_study.tell(trial, state=_states().FAIL)
                log(f"trial {trial.number} {point.name}: another worker is training these "
                    "values now; failed")
                done["skipped"].append(point.name)
                continue
            except BaseException:  # a conflict, a full disk: nothing to retry
                optuna_study.tell(trial, state=_states().FAIL)
                raise
        try:
            outcome = _evaluate(optuna_study, trial, study, out_dir, point, spec, runtime,
                                track, fingerprints, log)
        except StudyInterrupted:  # checkpointed: a retry of the same values resumes it
            with study_lock(out_dir):
                optuna_study.tell(trial, state=_states().FAIL)
                _retry(optuna_study, trial, "interrupted")
            raise
        except BaseException as err:  # a bug or a conflict: retried by the next start
            trial.set_user_attr("error", f"{type(err).__name__}: {err}")
            optuna_study.tell(trial, state=_states().FAIL, skip_if_finished=True)
            raise
        finally:
            claim.release()
        done[outcome].append(point.name)
    return done


def _add_point(out_dir: Path, spec: SearchSpec, point: Point, trials: int) -> Study:
    """``study.json`` with ``point`` (the caller holds the study lock)."""
    stored = open_study(out_dir) if (out_dir / "study.json").exists() else None
    points = list(stored.points) if stored is not None else []
    same = next((p for p in points if p.name == point.name), None)
    if same is not None and same.config.identity() != point.config.identity():
        raise StudyConflict(f"point {point.name} of {str(out_dir)!r} is stored with another "
                            "config than these values give; choose another --out")
    study = spec.study(points + ([] if same is not None else [point]), trials, out_dir)
    if stored is None or same is None or stored.info.get("trials") != trials:
        store_study(out_dir, study)
    return study


def _evaluate(optuna_study: Any, trial: Any, study: Study, out_dir: Path, point: Point,
              spec: SearchSpec, runtime: list[str] | None, track: TrackSettings | None,
              fingerprints: DataFingerprints, log: Callable[[str], None]) -> str:
    """Evaluate one claimed trial: tell its result, training its point unless evaluated."""
    state_of = _states()
    tag = f"trial {trial.number} {point.name}"
    directory = run_dir(out_dir, point)
    try:
        now = point_state(out_dir, point, fingerprints)
    except StudyConflict:
        raise
    except Exception as err:  # the data cannot be read: left resumable, as a grid point
        trial.set_user_attr("error", f"{type(err).__name__}: {err}")
        optuna_study.tell(trial, state=state_of.FAIL)
        log(f"{tag}: cannot check its data, left for the next run: {type(err).__name__}: {err}")
        return "error"
    if now.status in ("done", "pruned", "failed"):
        for step, value in history(directory, spec.metric):
            trial.report(value, step)
        log(f"{tag}: evaluated before ({now.status})")
        _tell(optuna_study, trial, now.status, now.metrics, spec.metric, now.error)
        return "reused"
    if now.error:
        log(f"{tag}: not reused: {now.error}")
    if now.other_data:
        set_aside(out_dir, point, log, tag)
    config = apply_overrides(point.config, runtime) if runtime else point.config
    outcome = train_point(study, out_dir, point, config, log, tag, track=track,
                          callbacks=[TrialPruning(trial, spec.split, spec.metric,
                                                     spec.pruner)])
    if outcome == "error":
        errors = [e for e in read_events(out_dir)
                  if e["point"] == point.name and e["event"] == "error"]
        trial.set_user_attr("error", errors[-1]["error"] if errors else "an error")
        optuna_study.tell(trial, state=state_of.FAIL)
        return outcome
    metrics = point_state(out_dir, point).metrics if outcome == "finished" else None
    _tell(optuna_study, trial, {"finished": "done"}.get(outcome, outcome), metrics,
          spec.metric, None)
    return outcome


def _tell(optuna_study: Any, trial: Any, status: str, metrics: dict[str, Any] | None,
          metric: str, error: str | None) -> None:
    """Tell Optuna a point's result: its objective (done), pruned, or failed."""
    state_of = _states()
    value = (metrics or {}).get(metric)
    if status == "done" and isinstance(value, (int, float)) and math.isfinite(value):
        optuna_study.tell(trial, float(value))
    elif status == "pruned":
        optuna_study.tell(trial, state=state_of.PRUNED)
    else:
        trial.set_user_attr("failed", error or f"{metric} is {value}")
        optuna_study.tell(trial, state=state_of.FAIL)


__all__ = ["JOURNAL_NAME", "PRUNERS", "SAMPLERS", "SEARCH_REPORTS", "SearchSpec",
           "TrialPruning", "counted", "fail_stale_trials", "history", "open_search",
           "run_search", "search_spec", "spec_difference", "stored_search", "superseded",
           "suggest"]
