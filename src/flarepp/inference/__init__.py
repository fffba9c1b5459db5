"""The one prediction path, for every caller: the trainer's evaluation and final cases,
``flarepp eval``, ``flarepp infer``, ``flarepp plot`` and surface streaming.

* :func:`predict_tokens` -- a model's output for every token of a batch: plain, streamed in
  chunks, token-sharded over a context-parallel group, or both (paper Appendix B).
* :class:`Engine` -- a task's model on a device in a precision: batches, evaluation of a
  split, predictions of whole cases, all through :func:`predict_tokens`.
* :func:`predict_mesh` -- de-normalised predictions for raw arrays (``flarepp infer``).
* :func:`load_for_evaluation` / :func:`evaluate_checkpoint` -- a stored run, evaluated.
"""

from flarepp.inference.engine import Engine, predict_tokens
from flarepp.inference.evaluate import (evaluate_checkpoint, load_for_evaluation,
                                        write_checkpoint_outputs)
from flarepp.inference.mesh import predict_mesh

__all__ = ["Engine", "evaluate_checkpoint", "load_for_evaluation", "predict_mesh",
           "predict_tokens", "write_checkpoint_outputs"]
