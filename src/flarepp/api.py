"""The Python API for a trained surrogate: ``flarepp.load``.

::

    import flarepp
    p = flarepp.load("runs/darcy-tiny")          # a run directory or a checkpoint file
    u = p.predict(points, features=a)            # [N, G] (+ [N, F]) -> [N, O], physical units
    u = p.predict(points_BNG, features=a_BNF, mask=mask_BN)   # a batch, padded

:func:`load` rebuilds the model from the checkpoint alone (a finished run's reported
checkpoint, else its newest) with the normalisers and the input layout the run stored, on
any device, and returns a :class:`~flarepp.inference.predictor.Predictor`, the pair a server
wraps:

* ``p.surrogate``: a :class:`~flarepp.models.surrogate.Surrogate`, an ``nn.Module`` whose
  ``forward(x [B, N, I], mask [B, N], conditioning [B, K, C])`` takes and returns physical
  units (the model with its maps as buffers: ``normalise``, ``denormalise``);
* ``p.execution``: an :class:`~flarepp.inference.execution.Execution`, the frozen setting
  of how it runs (device, precision, token sharding, streaming ``chunk_size``, hidden-state
  placement, progress, thread timing); ``dataclasses.replace`` changes one;
* ``p.layout``: an :class:`~flarepp.inference.predictor.InputLayout` (input channels, which
  are coordinates, their names, conditions, output field names and units) and
  ``p.config`` the run's config;
* ``p.predict(points, features=, conditions=, mask=, chunk_size=, batch_size=, as_torch=)``:
  NumPy or torch in, physical fields out, each wrong shape a sentence
  (:class:`~flarepp.inference.predictor.PredictorError`), through
  :func:`~flarepp.inference.execution.predict_tokens`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flarepp.inference.execution import Execution
from flarepp.inference.predictor import InputLayout, Predictor, PredictorError, load_predictor
from flarepp.models.surrogate import Surrogate


def load(path: str | Path, *, device: str | torch.device = "auto",
         precision: str | None = None, weights: str | None = None,
         chunk_size: int | None = None) -> Predictor:
    """The :class:`~flarepp.inference.predictor.Predictor` of a run directory or checkpoint
    (module docstring).

    ``device``: ``auto`` (CUDA when available), ``cpu``, ``cuda``, ``cuda:K``;
    ``precision``: ``fp32``, ``bf16`` or ``fp16`` autocast (default the run's);
    ``weights``: ``raw`` or ``ema`` (default those the run reports); ``chunk_size``: stream
    every mesh K points at a time (exact; also per call of ``predict``)."""
    return load_predictor(path, device=device, precision=precision, weights=weights,
                          chunk_size=chunk_size)


__all__ = ["Execution", "InputLayout", "Predictor", "PredictorError", "Surrogate", "load"]
