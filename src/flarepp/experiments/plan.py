"""A plan: several sweeps run and reported as one (``flarepp sweep --plan FILE``).

A plan file lists studies, each a ``flarepp sweep`` (a preset, a grid, ``--set`` items)
on named data draws, and optionally the page that quotes their reports. It is JSON, the
format of every file flarepp reads or writes (run configs, ``study.json``, metrics), read by
the standard library on every Python flarepp supports (TOML needs Python 3.11, YAML a
package)::

    {"out": "runs/results",             the studies' directories: OUT/<name>   (--out)
     "data_dir": "data",                 the data draws' directories: DATA/<draw> (--data)
     "data": {"darcy-draw0": {"dataset": "darcy", "train": 200, "test": 100, "seed": 0},
              "real-darcy": {"path": "/data/darcy"}},    made if missing / only read
     "studies": [{"name": "presets-darcy", "preset": "darcy-tiny",
                  "grid": ["lr=1e-3,3e-3", "seed=0,1,2"], "sets": ["val_fraction=0.2"],
                  "data": ["darcy-draw0", "darcy-draw1"],   a data_root axis (or one name:
                                                             the study's --data)
                  "title": "...", "sections": ["selection"], "caveat": "..."}],
     "page": "../results.md", "head": "head.md", "appendix": "earlier.md", "figures": "."}

``out`` (default ``runs/plan``) and ``data_dir`` (default ``data``) are relative to the
working directory, as ``--out`` and ``--data`` (which replace them) are; ``page``, ``head``
(the page's opening), ``appendix`` (appended to it) and ``figures`` (where the page's
images are copied) to the plan file's folder. A study's
``sections`` are the report plug-ins its part of the page quotes; ``caveat`` is printed
under its heading. Unknown keys, presets, plug-ins and data names are refused, naming them.

Each study is an ordinary sweep of the one engine: ``flarepp sweep --out OUT/<name>``
continues or reports on it alone, several ``flarepp sweep --plan FILE`` processes share
every study through its claims, and a study grows (more seeds, a longer schedule) by
growing its grid here.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flarepp.data.generators import GENERATORS
from flarepp.experiments.engine import Study
from flarepp.experiments.reports import REPORTS, report_sections, status_counts, training_hours
from flarepp.experiments.studies import parse_axes, sweep_study
from flarepp.io import atomic_write_bytes, atomic_write_text, read_json
from flarepp.storage.studydir import StudyDir
from flarepp.train.presets import PRESETS

PLAN_KEYS = ("out", "data_dir", "data", "studies", "page", "head", "appendix", "figures")
STUDY_KEYS = ("name", "title", "preset", "grid", "sets", "data", "sections", "caveat")
DRAW_KEYS = ("dataset", "train", "test", "seed", "resolution", "path")


@dataclass(frozen=True)
class DataDraw:
    """A data directory of the plan: made by the generator ``dataset`` (``flarepp data
    make DATASET --train --test --seed [--resolution]``) where it is missing, or an
    existing ``path`` that is only read."""

    name: str
    dataset: str | None = None
    train: int = 0
    test: int = 0
    seed: int = 0
    resolution: int | None = None
    path: str | None = None

    def directory(self, data_dir: str | Path) -> Path:
        return Path(self.path) if self.path is not None else Path(data_dir) / self.name

    def make(self, data_dir: str | Path, log: Callable[[str], None] = print) -> Path:
        """The draw's directory, generated first if it does not exist: into a temporary
        sibling renamed into place, so a process that finds it finds it whole (two
        processes that both make it keep the first)."""
        target = self.directory(data_dir)
        if target.exists():
            return target
        if self.dataset is None:
            raise FileNotFoundError(f"data {self.name!r}: {str(target)!r} does not exist")
        entry = GENERATORS.entry(self.dataset)
        resolution = entry.defaults.get("resolution") if self.resolution is None \
            else self.resolution
        temporary = target.parent / f".{target.name}.making-{os.getpid()}"
        shutil.rmtree(temporary, ignore_errors=True)
        log(f"making {target} ({self.dataset}, {self.train} / {self.test} samples, seed "
            f"{self.seed})")
        entry.obj(temporary, n_train=self.train, n_test=self.test, resolution=resolution,
                  seed=self.seed, progress=False, overwrite=False)
        try:
            temporary.rename(target)
        except OSError:
            if not target.exists():
                raise
            shutil.rmtree(temporary)  # another process made it meanwhile: the same data
        return target


@dataclass(frozen=True)
class PlanStudy:
    """One study of a plan (module docstring): a sweep of ``preset`` (or of the grid's
    ``preset`` axis) over ``grid`` with ``sets``, on ``data``: several draw names (a
    ``data_root`` axis after the grid's) or one (the study's ``--data``)."""

    name: str
    title: str
    preset: str | None
    grid: tuple[str, ...]
    sets: tuple[str, ...]
    data: tuple[str, ...] | str | None
    sections: tuple[str, ...]
    caveat: str = ""

    def draws(self) -> list[str]:
        return [] if self.data is None else [self.data] if isinstance(self.data, str) \
            else list(self.data)

    def _arguments(self, plan: "Plan", data_dir: str | Path) -> tuple[list[str], str | None]:
        """The sweep's grid (with the data axis) and its ``--data``."""
        where = [str(plan.data[d].directory(data_dir)) for d in self.draws()]
        if isinstance(self.data, tuple):
            return [*self.grid, f"data_root={','.join(where)}"], None
        return list(self.grid), where[0] if where else None

    def study(self, plan: "Plan", data_dir: str | Path) -> Study:
        """The sweep's :class:`~.engine.Study` (every config checked here)."""
        grid, data = self._arguments(plan, data_dir)
        axes = parse_axes(grid)
        try:
            return sweep_study(self.preset or dict(axes)["preset"][0], axes,
                               sets=list(self.sets), data=data)
        except ValueError as err:
            raise ValueError(f"{plan.path}: study {self.name!r}: {err}") from None

    def command(self, plan: "Plan", data_dir: str | Path, out: str | Path) -> str:
        """The ``flarepp sweep`` command this study is (its page shows it)."""
        grid, data = self._arguments(plan, data_dir)
        return " ".join(["flarepp", "sweep", *([self.preset] if self.preset else []),
                         "--out", str(Path(out) / self.name), "--quiet",
                         *(["--data", data] if data else []), "--grid", *grid,
                         *[a for s in self.sets for a in ("--set", s)]])


@dataclass(frozen=True)
class Plan:
    """A plan file read and checked (:func:`read_plan`)."""

    path: Path
    studies: tuple[PlanStudy, ...]
    data: dict[str, DataDraw]
    out: str = "runs/plan"
    data_dir: str = "data"
    page: str | None = None
    head: str | None = None
    appendix: str | None = None
    figures: str = "."

    def beside(self, name: str) -> Path:
        """A path the plan names relative to its own folder."""
        return self.path.parent / name

    def select(self, names: list[str] | None) -> list[PlanStudy]:
        """The studies named (all of them for None), in the plan's order."""
        known = [s.name for s in self.studies]
        unknown = [n for n in names or [] if n not in known]
        if unknown:
            raise ValueError(f"{self.path}: no study {unknown[0]!r} (its studies: "
                             f"{', '.join(known)})")
        return [s for s in self.studies if names is None or s.name in names]


def _keys(where: str, given: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = [k for k in given if k not in allowed]
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (known: "
                         f"{', '.join(allowed)})")


def _texts(where: str, value: Any, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: {key!r} must be a list of strings, got {value!r}")
    return tuple(value)


def _draw(path: Path, name: str, spec: Any) -> DataDraw:
    where = f"{path}: data {name!r}"
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected an object, got {spec!r}")
    _keys(where, spec, DRAW_KEYS)
    if "path" in spec:
        if set(spec) != {"path"}:
            raise ValueError(f"{where}: an existing 'path' is only read; give it alone")
        return DataDraw(name, path=str(spec["path"]))
    missing = [k for k in ("dataset", "train", "test") if k not in spec]
    if missing:
        raise ValueError(f"{where}: give {', '.join(missing)} (or the 'path' of existing "
                         "data)")
    try:
        GENERATORS.entry(spec["dataset"])
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    for key, least in (("train", 1), ("test", 1), ("seed", 0), ("resolution", 1)):
        value = spec.get(key, least)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{where}: {key!r} must be an integer >= {least}, got {value!r}")
    return DataDraw(name, spec["dataset"], spec["train"], spec["test"], spec.get("seed", 0),
                    spec.get("resolution"))


def _study(path: Path, spec: Any, data: dict[str, DataDraw]) -> PlanStudy:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError(f"{path}: every study is an object with a 'name', got {spec!r}")
    name = spec["name"]
    where = f"{path}: study {name!r}"
    if not name or name.startswith(".") or "/" in name or "\\" in name:
        raise ValueError(f"{where}: a name is one directory name (no '/', no leading '.')")
    _keys(where, spec, STUDY_KEYS)
    grid = _texts(where, spec.get("grid", []), "grid")
    try:
        axes = dict(parse_axes(list(grid)))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    preset = spec.get("preset")
    if preset is None and "preset" not in axes:
        raise ValueError(f"{where}: give its 'preset' (or a grid axis preset=P1,P2)")
    for p in ([preset] if preset is not None else []) + axes.get("preset", []):
        try:
            PRESETS.entry(p)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    draws = spec.get("data")
    if isinstance(draws, list):
        draws = _texts(where, draws, "data")
    elif draws is not None and not isinstance(draws, str):
        raise ValueError(f"{where}: 'data' is a draw name or a list of them, got {draws!r}")
    for d in ([] if draws is None else [draws] if isinstance(draws, str) else draws):
        if d not in data:
            raise ValueError(f"{where}: data {d!r} is not in the plan's 'data' (it holds: "
                             f"{', '.join(data) or 'nothing'})")
    if isinstance(draws, tuple) and "data_root" in axes:
        raise ValueError(f"{where}: its grid has a data_root axis and 'data' lists draws; "
                         "give one of them")
    sections = _texts(where, spec.get("sections", []), "sections")
    for s in sections:
        try:
            REPORTS.entry(s)
        except ValueError as err:
            raise ValueError(f"{where}: sections: {err}") from None
    return PlanStudy(name, str(spec.get("title", name)), preset, grid,
                     _texts(where, spec.get("sets", []), "sets"), draws, sections,
                     str(spec.get("caveat", "")))


def read_plan(path: str | Path) -> Plan:
    """The plan in ``path`` (module docstring), every name in it checked."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"plan file {str(path)!r} does not exist")
    spec = read_json(path)
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: a plan is a JSON object with 'studies', got "
                         f"{type(spec).__name__}")
    _keys(str(path), spec, PLAN_KEYS)
    if not isinstance(spec.get("data", {}), dict):
        raise ValueError(f"{path}: 'data' is an object of named draws")
    data = {name: _draw(path, name, d) for name, d in spec.get("data", {}).items()}
    studies = spec.get("studies")
    if not isinstance(studies, list) or not studies:
        raise ValueError(f"{path}: give 'studies', a non-empty list")
    parsed = tuple(_study(path, s, data) for s in studies)
    names = [s.name for s in parsed]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{path}: study name(s) {', '.join(map(repr, repeated))} given twice")
    text = {k: spec[k] for k in ("out", "data_dir", "page", "head", "appendix", "figures")
            if k in spec}
    for key, value in text.items():
        if not isinstance(value, str):
            raise ValueError(f"{path}: {key!r} must be a path (text), got {value!r}")
    return Plan(path, parsed, data, **text)


# ---------------------------------------------------------------------------------------------
# the page of a plan


def page_section(plan: Plan, entry: PlanStudy, out: str | Path, figures: Path,
                 page: Path) -> list[str]:
    """A study's part of the page: its heading, the command it is, its runs' status
    counts and training time, its caveat, and its ``sections`` plug-ins' lines (their
    images copied into ``figures`` and linked from ``page``)."""
    directory = Path(out) / entry.name
    lines = [f"## {entry.title}", ""]
    command = entry.command(plan, "DATA", "STUDIES")
    if not StudyDir(directory).has_study():
        return lines + [f"Not measured yet: `{command}` (`flarepp sweep --plan {plan.path} "
                        f"--only {entry.name}`).", ""]
    rep = report_sections(directory, entry.sections)
    counts = status_counts(rep.rows)
    lines += [f"`{command}`: {counts['done']} of {len(rep.rows)} runs done, {counts['failed']} "
              f"failed, {counts['pending']} pending; {training_hours(rep.rows):.1f} CPU-hours "
              "of training (one thread per run).", ""]
    if entry.caveat:
        lines += [f"*{entry.caveat}*", ""]
    section = list(rep.lines)
    while section and not section[0]:
        section = section[1:]
    for path in rep.paths.values():
        if path.suffix == ".png":
            target = figures / f"{entry.name}_{path.name}"
            atomic_write_bytes(target, path.read_bytes())
            link = os.path.relpath(target, page.parent)
            section = [line.replace(f"]({path.name})", f"]({link})") for line in section]
    # The plug-ins' own headings sit one level below the study's.
    return lines + [("#" + line) if line.startswith("## ") else line for line in section] + [""]


def write_page(plan: Plan, out: str | Path) -> Path:
    """The plan's page: its ``head``, every study's section (:func:`page_section`), its
    ``appendix``."""
    if plan.page is None:
        raise ValueError(f"{plan.path}: the plan names no 'page' to write")
    page, figures = plan.beside(plan.page), plan.beside(plan.figures)
    figures.mkdir(parents=True, exist_ok=True)
    lines = [plan.beside(plan.head).read_text().rstrip(), ""] if plan.head else []
    for entry in plan.studies:
        lines += page_section(plan, entry, out, figures, page)
    if plan.appendix:
        lines += [plan.beside(plan.appendix).read_text().rstrip(), ""]
    atomic_write_text(page, "\n".join(lines) + "\n")
    return page


__all__ = ["DataDraw", "Plan", "PlanStudy", "page_section", "read_plan", "write_page"]
