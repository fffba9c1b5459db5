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

for _name, _plugin, _doc in (
        ("runs", runs.runs_report,
         "every point: status, the task's test (train) metric, raw and EMA, error"),
        ("seeds", runs.seeds_report,
         "Table 11: mean ± sample std over seeds of every other combination"),
        ("depth", runs.depth_report,
         "Figure 4: the metric against depth B, a line per latent budget M, a panel per mixer"),
        ("precision", runs.precision_report,
         "Figure 7: 16-bit over FP32 metric per mixer and depth"),
        ("selection", stats.selection_report,
         "a setting chosen on the validation split: the mean over mixers of each mixer's "
         "mean over seeds and draws"),
        ("paired", stats.paired_report,
         "per mixer (or the values of any axis: --pair KEY) mean ± std; their paired "
         "differences over (seed, data draw) with a 95% t interval"),
        ("length", stats.length_report,
         "the metric against training length (an epochs axis): per mixer, mean ± std over "
         "seeds and draws, raw and EMA"),
        ("rollout", curves.rollout_report,
         "the error against rollout step: mean over seeds with the seeds' band"),
        ("growth", curves.growth_report,
         "rank growth (a latent_schedule axis): curves, epochs to a target, the loss around "
         "each growth beside the fixed initial M"),
        ("table1", tables.table1_report, "Table 1: models x datasets, test relative L2 in %"),
        ("lra", tables.lra_report, "Table 12: mixers x LRA tasks, test accuracy in %, the average"),
        ("cost", cost.cost_report,
         "Figure 5: the metric against training cost, the Pareto front, FLARE++ over FLARE at "
         "matched (B, M)"),
        ("search", search.search_report,
         "an adaptive search: every trial's state, point and value; the best trial")):
    REPORTS.add(_name, _plugin, doc=_doc)

__all__ = ["REPORTS"]
