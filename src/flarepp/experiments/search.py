"""Adaptive search: ``flarepp sweep PRESET --search optuna --trials K --grid ...`` (Optuna).

**The space** is written as a grid's axes (:mod:`.studies`), each any ``--set`` key:
``V1,V2,...`` is a choice among values, ``LOW:HIGH`` a real range (``LOW:HIGH:log``
log-uniform) and ``LOW..HIGH`` an integer one (``:log`` too), both ends included; a real
value is used to 4 significant digits. A trial's config is built as a grid point's (the
preset, ``--set``, ``--data``, then the trial's values), and the trial *is* a point of the
study: named and labelled like a grid point (``lr-0.001234_seed-7``), added to
``study.json`` when it is asked (the study grows), so ``flarepp sweep report`` and its
plug-ins read the trials as they read grid points, plus the ``search`` plug-in
(:mod:`.reports.search`): the trials, their states and the best one.

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
worker, or a later run, may raise it). A journal that is missing, empty or holds no search
while ``study.json`` holds trials is refused: the search's history would be lost.

**Workers**: a search is a point source of the engine's one loop
(:class:`SearchSource` for :func:`~.engine.run_study`): under the study's lock
(:func:`~.engine.study_lock`, held for milliseconds) it asks Optuna for a trial, records its
point, grows ``study.json`` and claims the point, so a running trial's point is always
claimed by a live worker; the loop trains it and the source tells Optuna the result. The
point's claim is the one record of which worker lives: a running trial whose point's claim
the loop can take (its holder is gone, or never took it) is one whose worker died, and the
journal follows: the trial is failed and a retry with the same values enqueued, which
resumes the point from its checkpoint (nothing is trained twice). A point that hit an
environment error (a full disk, other data at the path) is left resumable and retried so by
the next worker to start; a trial whose point could not be recorded (a full disk at
``study.json``) is retried too and never counts towards ``--trials``; values that another
trial already evaluated are not trained again (its result is told); a trial whose values
another worker is training now is failed, said.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from flarepp.experiments.engine import (Claim, Offer, Outcome, Point, PointState, Study,
                                        StudyConflict, StudyInterrupted, read_study,
                                        resolve_paths, study_lock)
from flarepp.experiments.studies import (SWEEP_REPORTS, Range, open_any_study, parse_range,
                                         split_values, sweep_study)
from flarepp.io import UnreadableFile, UnsafeName
from flarepp.locks import RunLocked
from flarepp.registry import Registry
from flarepp.storage.config import RunConfig
from flarepp.storage.rundir import RunDir
from flarepp.storage.studydir import StudyDir, check_point_name
from flarepp.tasks import TASKS
from flarepp.train import get_preset
from flarepp.train.callbacks import TrainerCallback
from flarepp.train.checks import apply_overrides

JOURNAL_NAME = StudyDir.JOURNAL
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


def _optuna_part(build: Callable[[Any, int], Any]) -> Callable[[int], Any]:
    """``startup -> build(optuna, startup)``: a sampler or pruner, Optuna imported on use."""
    return lambda startup: build(require_optuna(), startup)


for _registry, _name, _doc, _build in (
        # TPE's constant liar (Optuna's default): running trials count as bad, so workers
        # spread out
        (SAMPLERS, "tpe", "Tree-structured Parzen estimator after the startup trials",
         lambda o, n: o.samplers.TPESampler(n_startup_trials=n)),
        (SAMPLERS, "random", "independent uniform draws",
         lambda o, n: o.samplers.RandomSampler()),
        (PRUNERS, "median", "worse than the completed trials' median at the same epoch",
         lambda o, n: o.pruners.MedianPruner(n_startup_trials=n)),
        (PRUNERS, "none", "every trial runs to the end", lambda o, n: o.pruners.NopPruner())):
    _registry.add(_name, _optuna_part(_build), doc=_doc)


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
        self._check_axes(base)

    def _check_axes(self, base: RunConfig) -> None:
        """Every axis's values (a range's ends) make a config, before anything trains."""
        axes = self.axes()
        if all(not isinstance(a, Range) and len(a) == 1 for _, a in axes):
            raise ValueError("the search space has no axis to search: give a range "
                             "(KEY=LOW:HIGH) or more than one value (KEY=V1,V2)")
        for key, axis in axes:
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
        base = get_preset(self.preset, list(self.sets))
        return base if self.data is None else dataclasses.replace(base, data_root=self.data)

    def axes(self) -> list[tuple[str, Axis]]:
        """Each axis as a :class:`Range` or a tuple of values."""
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


def _stored_search(out: StudyDir) -> Study | None:
    """The search stored in ``out`` (None: no study yet); another kind of study is refused."""
    if not out.has_study():
        return None
    stored = read_study(out.path)
    if stored.kind != "search":
        raise StudyConflict(f"{str(out.path)!r} holds a {stored.kind} study, not a search; "
                            f"continue it with `{stored.continue_with}` or choose another --out")
    return stored


def _lost_history(journal: Path, stored: Study, state: str) -> UnreadableFile:
    return UnreadableFile(
        f"{journal}: {state}, while {StudyDir.STUDY} beside it holds {len(stored.points)} "
        "trials' points: starting a new search there would lose the search's history "
        "(the trials, their values and states); restore the journal (from a backup), or "
        "start the search in another --out")


def open_search(spec: SearchSpec, out_dir: str | Path):
    """The Optuna study of ``out_dir`` (created with ``spec`` if there is none); a directory
    that holds another spec, a study that is not a search, or a search whose journal was
    lost (missing, emptied or overwritten: :func:`_lost_history`) is refused (a
    sentence)."""
    optuna = require_optuna()
    out = StudyDir(out_dir)
    with study_lock(out.path):
        stored = _stored_search(out)
        journal = out.journal_path
        if stored is not None and (not journal.exists() or journal.stat().st_size == 0):
            raise _lost_history(journal, stored, "is missing" if not journal.exists()
                                else "is empty (0 bytes)")
        storage = journal_storage(journal)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        options = dict(sampler=SAMPLERS.get(spec.sampler)(spec.startup_trials),
                       pruner=PRUNERS.get(spec.pruner)(spec.startup_trials))
        try:
            study = optuna.load_study(study_name=OPTUNA_STUDY, storage=storage, **options)
        except KeyError:
            if stored is not None:
                raise _lost_history(journal, stored, "holds no search") from None
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
# the point source


class SearchSource:
    """Optuna's ask and tell as a point source of the engine's one loop (module docstring):
    each trial is asked, made a point of the study and claimed under the study's lock, and
    its outcome told. ``trials``: how many trials the study is to have."""

    def __init__(self, spec: SearchSpec, trials: int) -> None:
        if trials < 1:
            raise ValueError(f"--trials must be >= 1, got {trials}")
        self.spec, self.trials, self.axes = spec, trials, spec.axes()
        self.optuna: Any = None
        self.out = StudyDir(".")
        self.log: Callable[[str], None] = print
        self._first = True

    def start(self, out: StudyDir, log: Callable[[str], None]) -> None:
        self.out, self.log = out, log
        self.optuna = open_search(self.spec, out.path)
        if not self.spec.metric.startswith("val_"):
            print(f"flarepp sweep: the search chooses on {self.spec.metric}, the test data (no "
                  "validation split): give --set val_fraction=0.2 to choose on validation",
                  file=sys.stderr)

    def next(self, claim: Claim) -> Offer | None:
        """The next trial, asked and claimed under the study's lock; None once the study has
        its trials."""
        with study_lock(self.out.path):
            if self._first:
                self._retry_errors()
                self._first = False
            self._follow_claims(claim)
            if len(counted(self.optuna.get_trials(deepcopy=False))) >= self.trials:
                return None
            trial = self.optuna.ask()
            point, study, lease = self._record(trial, claim)
        return Offer(point, f"trial {trial.number} {point.name}", study, claim=lease,
                     callbacks=(TrialPruning(trial, self.spec.split, self.spec.metric,
                                             self.spec.pruner),), ticket=trial)

    def _record(self, trial: Any, claim: Claim) -> tuple[Point, Study, Any]:
        """The trial's point, added to ``study.json`` and claimed (``None``: another worker
        holds it; the loop checks it again and says so). A trial whose point could not be
        recorded (a full disk) is retried, never counted; one that conflicts is failed."""
        try:
            point = self.spec.point(suggest(trial, self.axes))
            trial.set_user_attr("point", point.name)
            study = _add_point(self.out, self.spec, point, self.trials)
            try:
                return point, study, claim(point.name)
            except RunLocked:  # another worker is training these values now
                return point, study, None
        except OSError as err:
            self._fail(trial, retry=f"its point could not be recorded: {err}")
            raise
        except BaseException:  # a conflict: nothing to retry
            self._fail(trial)
            raise

    def _follow_claims(self, claim: Claim) -> None:
        """The journal follows the claims (module docstring): a running trial whose point's
        claim the loop can take has lost its worker; it is failed and its values retried."""
        for trial in self.optuna.get_trials(deepcopy=False, states=(_states().RUNNING,)):
            name, holder = trial.user_attrs.get("point"), None
            if name is not None:
                try:
                    lease = claim(self._journal_point(trial, name))
                except RunLocked:
                    continue  # its worker is alive
                holder = lease.stale
                lease.release()
            self._fail(trial, retry="its worker died")
            if name is not None:
                self.out.record_event(name, "stale", trial=trial.number, holder=None if
                                      holder is None else holder.describe())
            self.log(f"trial {trial.number} ({name or 'no point yet'}): its worker died; "
                     "failed as stale, and a retry with the same values resumes its point")

    def _journal_point(self, trial: Any, name: Any) -> str:
        """A point name the journal recorded, refused in a sentence when it is no name of a
        point (it becomes a path: ``../x`` would lead out of the study)."""
        try:
            return check_point_name(name)
        except UnsafeName as err:
            raise UnreadableFile(f"{self.out.journal_path}: trial {trial.number} records the "
                                 f"point {name!r}, which no search writes: {err}; restore "
                                 "the journal, or start the search in another --out") from None

    def _retry_errors(self) -> None:
        """Enqueue a retry of every failed trial left resumable by an environment error."""
        trials = self.optuna.get_trials(deepcopy=False)
        replaced = superseded(trials)
        for trial in trials:
            if trial.state == _states().FAIL and "error" in trial.user_attrs \
                    and trial.number not in replaced:
                self._retry(trial, "an error left it resumable")
                self.log(f"trial {trial.number}: retrying its point "
                         f"{trial.user_attrs.get('point')} (it stopped on an error)")

    def _retry(self, trial: Any, why: str) -> None:
        self.optuna.enqueue_trial(dict(trial.params), user_attrs={"retry_of": trial.number,
                                                                  "retry_why": why})

    def _fail(self, trial: Any, retry: str | None = None) -> None:
        """Fail ``trial`` unless it is finished (another worker may have judged it stale);
        with ``retry`` (under the study's lock), enqueue a retry of its values once, saying
        why."""
        running = {t.number for t in self.optuna.get_trials(
            deepcopy=False, states=(_states().RUNNING,))}
        if trial.number not in running:
            return
        self.optuna.tell(trial.number, state=_states().FAIL, skip_if_finished=True)
        if retry:
            self._retry(trial, retry)

    def tell(self, offer: Offer, outcome: Outcome) -> str | None:
        trial, status = offer.ticket, outcome.status
        if status == "held":
            trial.set_user_attr("duplicate", True)
            self._fail(trial)
            self.log(f"{offer.tag}: another worker is training these values now; failed")
            return "skipped"
        if status == "error":
            trial.set_user_attr("error", outcome.error or "an error")
            self._fail(trial)
            return "error"
        state = outcome.state or PointState(status, error=outcome.error)  # failed, pruned
        if status == "settled":
            for step, value in history(self.out.run_path(offer.point.name), self.spec.metric):
                trial.report(value, step)
            self.log(f"{offer.tag}: evaluated before ({state.status})")
        self._tell(trial, state.status, state.metrics, state.error)
        return "reused" if status == "settled" else status

    def _tell(self, trial: Any, status: str, metrics: dict[str, Any] | None,
              error: str | None) -> None:
        """Tell Optuna a point's result: its objective (done), pruned, or failed."""
        value = (metrics or {}).get(self.spec.metric)
        if status == "done" and isinstance(value, (int, float)) and math.isfinite(value):
            self.optuna.tell(trial, float(value))
        elif status == "pruned":
            self.optuna.tell(trial, state=_states().PRUNED)
        else:
            trial.set_user_attr("failed", error or f"{self.spec.metric} is {value}")
            self.optuna.tell(trial, state=_states().FAIL)

    def abandon(self, offer: Offer, error: BaseException) -> None:
        """A stop signal: the trial is failed and retried (its point checkpointed, the retry
        resumes it); anything else (a bug, a conflict) fails it, retried by the next
        start."""
        if isinstance(error, StudyInterrupted):
            with study_lock(self.out.path):
                self._fail(offer.ticket, retry="interrupted")
            return
        offer.ticket.set_user_attr("error", f"{type(error).__name__}: {error}")
        self._fail(offer.ticket)


def study_source(out_dir: str | Path, trials: int | None = None) -> Study | SearchSource:
    """What continues the study of ``out_dir`` (:func:`~.studies.open_any_study`): a search
    is its own point source (its stored spec, ``trials`` or the stored count), any other
    study its fixed points; ``trials`` for a study that is no search is refused."""
    study = open_any_study(out_dir)
    if study.kind == "search":
        spec, stored = stored_search(study)
        return SearchSource(spec, trials or stored)
    if trials is not None:
        raise ValueError(f"--trials: {str(out_dir)!r} holds a {study.kind} study, not a "
                         "search")
    return study


def _add_point(out: StudyDir, spec: SearchSpec, point: Point, trials: int) -> Study:
    """``study.json`` with ``point`` (the caller holds the study lock)."""
    stored = read_study(out.path) if out.has_study() else None
    points = list(stored.points) if stored is not None else []
    same = next((p for p in points if p.name == point.name), None)
    if same is not None and same.config.identity() != point.config.identity():
        raise StudyConflict(f"point {point.name} of {str(out.path)!r} is stored with another "
                            "config than these values give; choose another --out")
    study = spec.study(points + ([] if same is not None else [point]), trials, out.path)
    if stored is None or same is None or stored.info.get("trials") != trials:
        out.write_study(study)
    return study


__all__ = ["JOURNAL_NAME", "PRUNERS", "SAMPLERS", "SEARCH_REPORTS", "SearchSource",
           "SearchSpec", "TrialPruning", "counted", "history", "open_search", "search_spec",
           "spec_difference", "stored_search", "study_source", "suggest"]
