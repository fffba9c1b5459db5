"""The one prediction path, for every caller: the trainer's evaluation and final cases,
``flarepp eval``, ``flarepp infer``, ``flarepp plot``, surface figures, :func:`flarepp.load`
and ``flarepp export``.

* :class:`Predictor` -- a trained model with its normalisers, precision, device and
  execution strategy: normalises, runs (:func:`predict_tokens`: plain, streamed in chunks,
  token-sharded, or both; paper Appendix B) and de-normalises, in one place.
* :class:`Engine` -- a task's model on a device in a precision: batches, evaluation of a
  split, predictions of whole cases, all through its :class:`Predictor`.
* :func:`load_predictor` -- the predictor of a run directory or a checkpoint.
* :func:`load_for_evaluation` / :func:`evaluate_checkpoint` -- a stored run, evaluated.
"""

from flarepp.inference.engine import Engine
from flarepp.inference.evaluate import (evaluate_checkpoint, load_for_evaluation,
                                        write_checkpoint_outputs)
from flarepp.inference.predictor import (InputLayout, Predictor, PredictorError,
                                         load_predictor, predict_tokens)

__all__ = ["Engine", "InputLayout", "Predictor", "PredictorError", "evaluate_checkpoint",
           "load_for_evaluation", "load_predictor", "predict_tokens",
           "write_checkpoint_outputs"]
