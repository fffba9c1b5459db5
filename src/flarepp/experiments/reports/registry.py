"""The report plug-ins by name, listed here one by one (nothing registers itself by being
imported): what a study's ``reports`` name and ``--plan`` sections quote. A plug-in takes
the :class:`~.common.Report` of a study, adds its Markdown lines and files, and writes
nothing where it does not apply (one depth, no 16-bit runs, no rollouts)."""

from __future__ import annotations

from typing import Callable

from flarepp.experiments.reports import cost, curves, runs, search, stats, tables
from flarepp.experiments.reports.common import Report
from flarepp.registry import Registry

REPORTS: Registry[Callable[[Report], None]] = Registry("report")
REPORTS.add("runs", runs.runs_report,
            doc="every point: status, the task's test (train) metric, raw and EMA, error")
REPORTS.add("seeds", runs.seeds_report,
            doc="Table 11: mean ± sample std over seeds of every other combination")
REPORTS.add("depth", runs.depth_report,
            doc="Figure 4: the metric against depth B, a line per latent budget M, a panel "
                "per mixer")
REPORTS.add("precision", runs.precision_report,
            doc="Figure 7: 16-bit over FP32 metric per mixer and depth")
REPORTS.add("selection", stats.selection_report,
            doc="a setting chosen on the validation split: the mean over mixers of each "
                "mixer's mean over seeds and draws")
REPORTS.add("paired", stats.paired_report,
            doc="per mixer mean ± std; paired differences of mixers over (seed, data draw) "
                "with a 95% t interval")
REPORTS.add("length", stats.length_report,
            doc="the metric against training length (an epochs axis): per mixer, mean ± std "
                "over seeds and draws, raw and EMA")
REPORTS.add("rollout", curves.rollout_report,
            doc="the error against rollout step: mean over seeds with the seeds' band")
REPORTS.add("growth", curves.growth_report,
            doc="rank growth (a latent_schedule axis): curves, epochs to a target, the loss "
                "around each growth beside the fixed initial M")
REPORTS.add("table1", tables.table1_report,
            doc="Table 1: models x datasets, test relative L2 in %")
REPORTS.add("lra", tables.lra_report,
            doc="Table 12: mixers x LRA tasks, test accuracy in %, the average")
REPORTS.add("cost", cost.cost_report,
            doc="Figure 5: the metric against training cost, the Pareto front, FLARE++ over "
                "FLARE at matched (B, M)")
REPORTS.add("search", search.search_report,
            doc="an adaptive search: every trial's state, point and value; the best trial")

__all__ = ["REPORTS"]
