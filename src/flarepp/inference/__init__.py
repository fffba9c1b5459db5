"""The one prediction path, for every caller: the trainer's evaluation and final cases,
``flarepp eval``, ``flarepp infer``, ``flarepp plot``, surface figures, :func:`flarepp.load`
and ``flarepp export``.

* :class:`Execution` -- how a model runs (device, precision, token sharding, streaming,
  thread timing), one frozen setting; :func:`predict_tokens` runs a model or a
  :class:`~flarepp.models.surrogate.Surrogate` under it (plain, streamed in chunks,
  token-sharded, or both; paper Appendix B).
* :class:`Predictor` -- a run's surrogate (physical units in and out) with its execution,
  input layout and config: what :func:`load_predictor` and :func:`flarepp.load` return.
* :class:`Engine` -- a task's model under an execution: the trainer's forward, evaluation
  of a split, predictions of whole cases, de-normalised by the task's surrogate.
* :func:`load_for_evaluation` / :func:`evaluate_checkpoint` -- a stored run, evaluated.
"""

from flarepp.inference.engine import Engine
from flarepp.inference.evaluate import (evaluate_checkpoint, load_for_evaluation,
                                        write_checkpoint_outputs)
from flarepp.inference.execution import Execution, predict_tokens
from flarepp.inference.predictor import InputLayout, Predictor, PredictorError, load_predictor

__all__ = ["Engine", "Execution", "InputLayout", "Predictor", "PredictorError",
           "evaluate_checkpoint", "load_for_evaluation", "load_predictor", "predict_tokens",
           "write_checkpoint_outputs"]
