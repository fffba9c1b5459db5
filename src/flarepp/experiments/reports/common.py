"""What every report plug-in shares: the :class:`Report` it reads and adds to, and the
formatting of its cells, tables and figures."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flarepp.experiments.engine import Study, finite
from flarepp.experiments.reports.rows import Row


@dataclass
class Report:
    """What a plug-in sees and adds to: the study, its rows, its directory, the Markdown
    lines of ``report.md`` and the paths written; ``options`` are what the report was asked
    (``flarepp sweep report --pair``: the axis ``paired`` compares; ``labels``: labels the
    rows carry beyond the study's, e.g. ``study`` for the runs of two studies)."""

    study: Study
    rows: list[Row]
    out_dir: Path
    lines: list[str] = field(default_factory=list)
    paths: dict[str, Path] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> list[Row]:
        return [r for r in self.rows if r.status == "done"]

    @property
    def label_keys(self) -> list[str]:
        return [*self.study.points[0].labels, *self.options.get("labels", ())]

    def metric_name(self) -> str:
        return "/".join(sorted({r.metric for r in self.rows}))


def spread(mean: float, std: float, scale: float = 1.0, digits: str = ".4g") -> str:
    """``mean ± std`` (just the mean for one run), both times ``scale``."""
    if math.isnan(mean):
        return "-"
    text = format(scale * mean, digits)
    return text if math.isnan(std) else f"{text} ± {format(scale * std, digits)}"


def markdown(header: list[str], body: list[list[Any]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in body])


def fmt(value: Any, spec: str = ".4g") -> str:
    return format(value, spec) if finite(value) else "-"


def figure_module():
    """``matplotlib.pyplot`` on the file-only Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


__all__ = ["Report", "figure_module", "fmt", "markdown", "spread"]
