"""A study directory: the one owner of its files, as :class:`~flarepp.storage.rundir.RunDir`
is of a run's.

A study (``flarepp sweep``, ``compare``, ``lra compare``, ``drivaerml pareto``, an adaptive
search) is a list of :class:`Point` s, each a complete run config with the labels its
reports group by; the experiment engine (:mod:`flarepp.experiments.engine`) trains them.
:class:`StudyDir` names every file of its directory and is the one reader and writer of
each; no other module spells one (``tests/test_study_files.py`` scans the source):

* ``study.json`` -- the :class:`Study` (its points' configs read as stored, through
  :meth:`RunConfig.from_stored`), created and grown under ``.study.lock``, a lease held for
  milliseconds (:meth:`StudyDir.locked`);
* ``runs/<point>/`` -- one run directory per point (a :class:`RunDir`);
* ``claims/<point>/.lock`` -- the lease a process holds while it works on the point
  (:meth:`StudyDir.claim`, :class:`~flarepp.locks.Lease`): the one record of who
  works on a point, across hosts;
* ``events/<host>-<pid>.jsonl`` -- what each process did to which point, one file per
  process (an earlier flarepp's single ``events.jsonl`` is still read);
* ``superseded/<point>/<time>`` -- runs of data no longer at a point's path, kept;
* ``launch/`` -- the launchers' job files and worker logs; ``optuna.journal`` -- an adaptive
  search's Optuna storage; ``tensorboard/<point>`` -- a tracked point's TensorBoard log;
* ``report.md`` and ``results.csv`` -- the study's report (its plug-ins name their own
  files); ``sweep.json`` / ``pareto.json`` -- the spec of a study an earlier flarepp made.

Every point name that becomes a path (a run, a claim, a superseded run, a TensorBoard log)
goes through :func:`flarepp.io.confined`: a name read from ``study.json`` or from a search's
journal never leads outside the study.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from flarepp.io import UnreadableFile, atomic_write_json, check_name, confined, read_json
from flarepp.locks import GRACE_S, LOCK_NAME, Lease, RunLocked, file_safe, host_id
from flarepp.storage.config import RunConfig
from flarepp.storage.rundir import RunDir

FORMAT = 1
"""The format of ``study.json``."""


def check_point_name(name: Any) -> str:
    """``name``, a point's name: it becomes a path under ``runs/``, ``claims/``,
    ``superseded/`` and ``tensorboard/``, so it is a relative path of plain parts
    (:func:`flarepp.io.check_name`); anything else is :class:`~flarepp.io.UnsafeName`."""
    check_name(name, what="point name", inside="the study")
    return name


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
    def from_stored(cls, d: dict[str, Any]) -> "Point":
        """A point as ``study.json`` stores it: its config read as stored (a config of an
        earlier version keeps what its runs trained with)."""
        return cls(d["name"], RunConfig.from_stored(d["config"]), dict(d["labels"]))


@dataclass
class Study:
    """What ``study.json`` holds (module docstring). ``kind`` names the command that made
    it; ``reports`` the report plug-ins; ``info`` facts the reports state (read from the
    data when the study was made); ``timing_epochs`` > 0 gives every point a separate
    timing run first (Figure 5's cost); ``continue_with`` the command that continues it."""

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
    def from_stored(cls, d: dict[str, Any]) -> "Study":
        return cls(d["kind"], [Point.from_stored(p) for p in d["points"]], list(d["reports"]),
                   dict(d.get("info", {})), int(d.get("timing_epochs", 0)),
                   d.get("continue_with", ""))

    def identity(self) -> dict[str, Any]:
        """What the study computes: its points' names, labels and config identities (runtime
        fields, facts, messages and the points' order aside)."""
        return json.loads(json.dumps({
            "kind": self.kind, "timing_epochs": self.timing_epochs,
            "points": sorted([p.name, p.labels, p.config.identity()] for p in self.points)}))


def _say(problem: str) -> None:
    print(f"flarepp: {problem}", file=sys.stderr)


class StudyDir:
    """The files of one study directory, named here and nowhere else (module docstring).

    Readers raise a sentence naming the file; ``study.json`` is written atomically
    (:mod:`flarepp.io`)."""

    STUDY = "study.json"
    LOCK = ".study.lock"
    RUNS = "runs"
    CLAIMS = "claims"
    EVENTS = "events"
    EVENTS_LOG = "events.jsonl"       # the one event log of a study an earlier flarepp made
    SUPERSEDED = "superseded"
    LAUNCH = "launch"
    JOURNAL = "optuna.journal"
    TENSORBOARD = "tensorboard"
    REPORT = "report.md"
    RESULTS = "results.csv"
    EARLIER_SPECS = {"sweep": "sweep.json", "pareto": "pareto.json"}

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"StudyDir({str(self.path)!r})"

    # -- names ---------------------------------------------------------------------------
    study_path = property(lambda self: self.path / self.STUDY)
    journal_path = property(lambda self: self.path / self.JOURNAL)
    launch_dir = property(lambda self: self.path / self.LAUNCH, doc="the launchers' files")
    events_dir = property(lambda self: self.path / self.EVENTS)
    report_path = property(lambda self: self.path / self.REPORT)
    results_path = property(lambda self: self.path / self.RESULTS)

    def has_study(self) -> bool:
        return self.study_path.exists()

    def _confined(self, folder: str, name: str) -> Path:
        check_point_name(name)
        return confined(self.path / folder, name, what="point name")

    def run_path(self, name: str) -> Path:
        """``runs/<name>``: the point's run directory."""
        return self._confined(self.RUNS, name)

    def run(self, name: str) -> RunDir:
        return RunDir(self.run_path(name))

    def claim(self, name: str, *, grace_s: float = GRACE_S) -> Lease:
        """The lease ``claims/<name>/.lock`` of point ``name`` (not taken yet): a process
        works on the point only while it holds it; ``acquire()`` raises ``RunLocked`` while
        another live process does, and takes a gone holder's over (``stale`` names it)."""
        return Lease(self._confined(self.CLAIMS, name) / LOCK_NAME, grace_s=grace_s)

    def tensorboard_path(self, name: str) -> Path:
        """``tensorboard/<name>``: the TensorBoard log of a tracked point."""
        return self._confined(self.TENSORBOARD, name)

    # -- study.json -------------------------------------------------------------------------
    def read_study(self) -> Study:
        """The study stored in ``study.json``; a file that is not a study (cut short, edited
        by hand) is :class:`~flarepp.io.UnreadableFile` naming it and what is wrong."""
        path = self.study_path
        if not path.exists():
            raise FileNotFoundError(f"{str(path)!r} does not exist: no study was started in "
                                    f"{str(self.path)!r}")
        stored = read_json(path)
        try:
            if not isinstance(stored, dict):
                raise TypeError(f"it holds a JSON {type(stored).__name__}, not an object")
            if not isinstance(stored.get("points"), list) or not all(
                    isinstance(p, dict) for p in stored["points"]):
                raise TypeError("its 'points' is not a list of point objects")
            return Study.from_stored(stored)
        except KeyError as err:
            raise UnreadableFile(f"{path}: not a study: key {err} is missing") from None
        except (TypeError, ValueError, AttributeError) as err:
            raise UnreadableFile(f"{path}: not a study: {err}") from None

    def write_study(self, study: Study) -> Path:
        """Write ``study`` as ``study.json`` (the caller holds :meth:`locked`)."""
        return atomic_write_json(self.study_path, study.to_dict())

    @contextlib.contextmanager
    def locked(self, wait_s: float) -> Iterator[None]:
        """The lease ``.study.lock``, waited for up to ``wait_s`` (it is held for
        milliseconds): the creation and growth of ``study.json``, and an adaptive search's
        trial bookkeeping. A holder still there after the wait is a sentence naming it."""
        self.path.mkdir(parents=True, exist_ok=True)
        lock = Lease(self.path / self.LOCK, heartbeat=False)
        try:
            lease = lock.acquire()
        except RunLocked as err:  # said, then waited for: a stopped holder (Ctrl-Z) keeps it
            _say(f"waiting up to {wait_s:.0f} s for {err}")
            try:
                lease = lock.wait(timeout_s=wait_s)
            except RunLocked as still:
                raise RunLocked(f"waited {wait_s:.0f} s for the study's lock: {still}; resume "
                                "or end that process (a stopped one: `kill -CONT` it)") from None
        try:
            yield
        finally:
            lease.release()

    def read_earlier_spec(self) -> tuple[str, dict[str, Any]] | None:
        """``(kind, spec)`` of a study an earlier flarepp made (``sweep.json`` of a sweep,
        ``pareto.json`` of a Pareto study), or None without either."""
        for kind, name in self.EARLIER_SPECS.items():
            if (self.path / name).is_file():
                return kind, read_json(self.path / name)
        return None

    # -- runs kept aside --------------------------------------------------------------------
    def set_aside(self, name: str) -> Path:
        """Move point ``name``'s run to ``superseded/<name>/<time>-<pid>-<random>`` (kept,
        not deleted); returns where it is now."""
        kept = (self._confined(self.SUPERSEDED, name)
                / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{os.urandom(3).hex()}")
        kept.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.run_path(name), kept)
        return kept

    # -- events -----------------------------------------------------------------------------
    def events_file(self) -> Path:
        """This process's own event file, ``events/<host>-<pid>.jsonl``: no other process
        appends to it, so its lines never interleave with another's, whatever the
        filesystem."""
        return self.events_dir / f"{file_safe(host_id())}-{os.getpid()}.jsonl"

    def record_event(self, point: str, event: str, **extra: Any) -> None:
        """Append one line to this process's event file. A disk too full for the line is
        said on stderr (the event is lost, the work it records is not)."""
        record = {"point": point, "event": event, "pid": os.getpid(), "host": host_id(),
                  "time": time.time(), **extra}
        path = self.events_file()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
            try:
                os.write(fd, (json.dumps(record) + "\n").encode())
            finally:
                os.close(fd)
        except OSError as err:
            print(f"could not record event {record} in {path}: {err}", file=sys.stderr)

    def read_events(self, *, unreadable: Callable[[str], None] = _say) -> list[dict[str, Any]]:
        """Every process's events merged in time order. A line that is not an event record
        (cut short by a full disk or a kill) is left out and said through ``unreadable``,
        naming its file and line number."""
        files = [self.path / self.EVENTS_LOG, *sorted(self.events_dir.glob("*.jsonl"))]
        found = []
        for path in (f for f in files if f.is_file()):
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                try:
                    record = json.loads(line)
                    record["point"], record["event"]  # noqa: B018 (an event names both)
                    found.append((float(record["time"]), len(found), record))
                except (ValueError, KeyError, TypeError):
                    unreadable(f"{path} line {number} is not an event record (cut short by "
                               f"a full disk or a kill?), left out: {line[:80]!r}")
        return [record for *_, record in sorted(found, key=lambda f: f[:2])]


__all__ = ["FORMAT", "Point", "Study", "StudyDir", "check_point_name"]
