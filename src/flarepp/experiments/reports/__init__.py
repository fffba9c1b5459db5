"""Reports of a study: one typed row per point, one seed aggregation, plug-ins listed by name.

* :mod:`.rows` -- :class:`Row` (a point as every report sees it), :func:`collect` (a study
  directory -> rows), :func:`aggregate` (the one seed aggregation: mean, sample std with
  ddof 1, count), the status counts, ``results.csv`` written from rows and read back;
* :mod:`.common` -- the :class:`Report` a plug-in reads and adds to, cell formatting;
* the plug-ins: :mod:`.runs` (``runs``, ``seeds`` = Table 11, ``depth`` = Figure 4,
  ``precision`` = Figure 7), :mod:`.stats` (``selection`` on validation, ``paired``
  differences with 95% intervals, ``length``), :mod:`.curves` (``rollout`` error by step,
  ``growth`` of the latent budget), :mod:`.tables` (``table1`` = Table 1, ``lra`` = Table
  12), :mod:`.cost` (``cost`` = Figure 5);
* :mod:`.registry` -- :data:`REPORTS`, every plug-in listed by name in one place;
* :mod:`.writing` -- :func:`write_report` (``results.csv``, ``report.md``; its options, e.g.
  the axis ``paired`` compares), :func:`report_sections` (a few plug-ins alone, for a page
  of several studies) and :func:`paired_against` (the ``paired`` section over two studies'
  runs).
"""

from flarepp.experiments.reports.rows import (Group, Row, aggregate, collect, did_not_fit,
                                              read_results, status_counts, training_hours)
from flarepp.experiments.reports.common import Report, fmt, markdown, spread
from flarepp.experiments.reports.registry import REPORTS
from flarepp.experiments.reports.writing import paired_against, report_sections, write_report

__all__ = ["Group", "REPORTS", "Report", "Row", "aggregate", "collect", "did_not_fit", "fmt",
           "markdown", "paired_against", "read_results", "report_sections", "spread", "status_counts",
           "training_hours", "write_report"]
