"""A study's report: ``results.csv`` and ``report.md`` from the plug-ins it names
(:data:`~.registry.REPORTS`), and the sections of a few plug-ins alone (how a page of
several studies quotes them)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from flarepp.experiments.reports.common import Report
from flarepp.experiments.reports.registry import REPORTS
from flarepp.experiments.reports.rows import collect, results_text
from flarepp.experiments.studies import SWEEP_REPORTS
from flarepp.io import atomic_write_text
from flarepp.locks import file_safe
from flarepp.storage.studydir import StudyDir

TITLES = {"sweep": "Sweep", "compare": "Comparison", "lra": "LRA comparison",
          "pareto": "Error against training cost", "search": "Search"}


def plugins_of(study) -> list[str]:
    """The plug-ins a study's report runs: those it names, and for a sweep those a sweep
    runs now (a sweep started before a plug-in existed gets it; it writes nothing where it
    does not apply)."""
    return list(dict.fromkeys([*study.reports, *(SWEEP_REPORTS if study.kind == "sweep"
                                                 else ())]))


def write_report(out_dir: str | Path, options: dict[str, Any] | None = None) -> dict[str, Path]:
    """``results.csv``, ``report.md`` and what the study's plug-ins write, in ``out_dir``
    (``options``: :attr:`Report.options`, e.g. the axis ``paired`` compares)."""
    out_dir = Path(out_dir)
    rep = _run_plugins(out_dir, ["runs"], options)
    study, rows = rep.study, rep.rows
    rep.paths.update(csv=StudyDir(out_dir).results_path,
                     markdown=StudyDir(out_dir).report_path)
    for name in [n for n in plugins_of(study) if n != "runs"]:
        REPORTS.get(name)(rep)
    atomic_write_text(rep.paths["csv"], results_text(rows, rep.label_keys))
    head = [f"# {TITLES.get(study.kind, study.kind)}: {out_dir.name}", "",
            f"Continue with `{study.continue_with}`; data: "
            + ", ".join(sorted({f"`{p.config.data_root}`" for p in study.points})) + "."]
    if study.kind == "sweep":
        head += ["", f"Preset `{study.info.get('preset')}`; grid: " + ", ".join(
            f"`{k}` = {', '.join(v)}" for k, v in study.info.get("axes", [])) + "."]
    atomic_write_text(rep.paths["markdown"], "\n".join(head + [""] + rep.lines) + "\n")
    return rep.paths


def report_sections(out_dir: str | Path, names: list[str] | tuple[str, ...]) -> Report:
    """The study of ``out_dir`` with the plug-ins ``names`` alone run on it (their files
    written there, as :func:`write_report` would): its ``lines`` and ``paths``, and its
    ``rows`` for whatever else a page states, read once."""
    return _run_plugins(Path(out_dir), names)


def _run_plugins(out_dir: Path, names: list[str] | tuple[str, ...],
                 options: dict[str, Any] | None = None) -> Report:
    """The study of ``out_dir`` read once, and the plug-ins ``names`` run on it in order."""
    study, rows = collect(out_dir)
    rep = Report(study, rows, out_dir, options=dict(options or {}))
    for name in names:
        REPORTS.get(name)(rep)
    return rep


def paired_against(out_dir: str | Path, other: str | Path,
                   pair: tuple[str, list[str] | None] | None = None) -> Report:
    """The ``paired`` section over the runs of two studies (``flarepp sweep report DIR
    --against OTHER``: the same runs trained by two versions of the code, or with two
    options): every row labelled ``study`` with its directory's name, and by default the
    two studies compared (A: ``other``) per mixer and setting, paired by seed and data draw;
    ``pair`` compares another axis. Its table goes to ``paired-<other>.csv`` in
    ``out_dir``; nothing else is written."""
    out_dir, other = Path(out_dir), Path(other)
    names = [str(other), str(out_dir)] if other.name == out_dir.name else [other.name,
                                                                          out_dir.name]
    study, rows = collect(out_dir)
    theirs = collect(other)[1]
    labelled = [dataclasses.replace(r, labels={**r.labels, "study": name})
                for name, mine in zip(names, (theirs, rows)) for r in mine]
    rep = Report(study, labelled, out_dir, options={
        "pair": pair or ("study", names), "labels": ["study"],
        "paired_file": f"paired-{file_safe(other.name)}.csv"})
    REPORTS.get("paired")(rep)
    return rep


__all__ = ["TITLES", "paired_against", "plugins_of", "report_sections", "write_report"]
