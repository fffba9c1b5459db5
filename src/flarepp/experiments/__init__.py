"""Experiments on the core library: one engine (:mod:`.engine`: a point source -> claimed
points -> train a point -> events, in one loop, :func:`~.engine.run_study`), the studies the
commands start (:mod:`.studies`), the adaptive search, a point source of that loop
(:mod:`.search`), the launchers of its workers (:mod:`.launch`), plans of several studies
and their page (:mod:`.plan`), and the reports (:mod:`.reports`: typed rows, the one seed
aggregation, plug-ins listed by name); the Table 1 models (:mod:`.comparison`). A study's
directory belongs to :class:`~flarepp.storage.studydir.StudyDir`."""

from flarepp.experiments.comparison import (COMPARISON_MODELS, PAPER_SETTINGS, TABLE1_ORDER,
                                            build_comparison_model, comparison_model_kwargs,
                                            count_parameters, parameter_table)
from flarepp.experiments.engine import (Point, Study, StudyConflict, StudyInterrupted,
                                        create_study, open_study, run_study)

__all__ = ["COMPARISON_MODELS", "PAPER_SETTINGS", "TABLE1_ORDER", "Point", "Study",
           "StudyConflict", "StudyInterrupted", "build_comparison_model",
           "comparison_model_kwargs", "count_parameters", "create_study", "open_study",
           "parameter_table", "run_study"]
