"""A study's report: ``results.csv`` and ``report.md`` from every registered plug-in.

The plug-ins live in :mod:`.reports` (runs, Table 11 seeds, Figure 4 depth, Figure 7
precision), :mod:`.report_cost` (Figure 5), :mod:`.report_tables` (Tables 1 and 12),
:mod:`.report_stats` (a setting chosen on validation, paired differences of mixers) and
:mod:`.report_search` (an adaptive search's trials);
importing them here is what registers them all in :data:`~.reports.REPORTS`.
"""

from __future__ import annotations

from pathlib import Path

from flarepp.experiments import (report_cost, report_search, report_stats,  # noqa: F401
                                 report_tables)  # (register)
from flarepp.experiments.reports import REPORTS, Report, collect, csv_text
from flarepp.io import atomic_write_text


def write_report(out_dir: str | Path) -> dict[str, Path]:
    """``results.csv``, ``report.md`` and what the study's plug-ins write, in ``out_dir``."""
    out_dir = Path(out_dir)
    rep = _run_plugins(out_dir, ["runs"])
    study, rows = rep.study, rep.rows
    rep.paths.update(csv=out_dir / "results.csv", markdown=out_dir / "report.md")
    metrics = list(dict.fromkeys(f"test_{r['metric']}" for r in rows))
    fields = list(dict.fromkeys(
        [*rep.label_keys, *metrics, "status", "error", "mixer", "blocks", "latents",
         "precision", "seed", "sdpa_scale", "metric", "value", "train_value", "params",
         "seconds", "epochs", "device", "point"]))
    for name in [n for n in study.reports if n != "runs"]:
        REPORTS.get(name)(rep)
    fields = list(dict.fromkeys(fields + [k for r in rows for k in r]))  # plug-ins' columns
    atomic_write_text(rep.paths["csv"], csv_text(
        [fields] + [["" if r.get(k) is None else r.get(k) for k in fields] for r in rows]))
    title = {"sweep": "Sweep", "compare": "Comparison", "lra": "LRA comparison",
             "pareto": "Error against training cost",
             "search": "Search"}.get(study.kind, study.kind)
    head = [f"# {title}: {out_dir.name}", "",
            f"Continue with `{study.continue_with}`; data: "
            + ", ".join(sorted({f"`{p.config.data_root}`" for p in study.points})) + "."]
    if study.kind == "sweep":
        head += ["", f"Preset `{study.info.get('preset')}`; grid: " + ", ".join(
            f"`{k}` = {', '.join(v)}" for k, v in study.info.get("axes", [])) + "."]
    atomic_write_text(rep.paths["markdown"], "\n".join(head + [""] + rep.lines) + "\n")
    return rep.paths


def report_sections(out_dir: str | Path, names: list[str] | tuple[str, ...]
                    ) -> tuple[list[str], dict[str, Path]]:
    """The Markdown lines and the files of the plug-ins ``names`` alone on the study of
    ``out_dir`` (written there, as :func:`write_report` would): how a page that gathers
    several studies (docs/results.md, ``scripts/results.py``) quotes their reports without
    aggregating again."""
    rep = _run_plugins(Path(out_dir), names)
    return rep.lines, rep.paths


def _run_plugins(out_dir: Path, names: list[str] | tuple[str, ...]) -> Report:
    """The study of ``out_dir`` read once, and the plug-ins ``names`` run on it in order."""
    study, rows = collect(out_dir)
    rep = Report(study, rows, out_dir)
    for name in names:
        REPORTS.get(name)(rep)
    return rep


__all__ = ["report_sections", "write_report"]
