"""Experiments built on the core library: the Table 1 comparison (``flarepp compare``)."""

from flarepp.experiments.comparison import (COMPARISON_MODELS, PAPER_SETTINGS, TABLE1_ORDER,
                                            build_comparison_model, comparison_model_kwargs,
                                            count_parameters, parameter_table)
from flarepp.experiments.compare import run_comparison, summarize, write_outputs

__all__ = ["COMPARISON_MODELS", "PAPER_SETTINGS", "TABLE1_ORDER", "build_comparison_model",
           "comparison_model_kwargs", "count_parameters", "parameter_table", "run_comparison",
           "summarize", "write_outputs"]
