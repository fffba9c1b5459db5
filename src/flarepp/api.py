"""The Python API for a trained surrogate: ``flarepp.load``.

::

    import flarepp
    p = flarepp.load("runs/darcy-tiny")          # a run directory or a checkpoint file
    u = p.predict(points, features=a)            # [N, G] (+ [N, F]) -> [N, O], physical units
    u = p.predict(points_BNG, features=a_BNF, mask=mask_BN)   # a batch, padded

:func:`load` rebuilds the model from the checkpoint alone (a finished run's reported
checkpoint, else its newest) with the normalisers and the input layout the run stored, on
any device; :meth:`~flarepp.inference.predictor.Predictor.predict` normalises, runs
(plain, or streamed with ``chunk_size``) and de-normalises in one place.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flarepp.inference.predictor import InputLayout, Predictor, PredictorError, load_predictor


def load(path: str | Path, *, device: str | torch.device = "auto",
         precision: str | None = None, weights: str | None = None,
         chunk_size: int | None = None) -> Predictor:
    """The :class:`~flarepp.inference.predictor.Predictor` of a run directory or checkpoint.

    ``device``: ``auto`` (CUDA when available), ``cpu``, ``cuda``, ``cuda:K``;
    ``precision``: ``fp32``, ``bf16`` or ``fp16`` autocast (default the run's);
    ``weights``: ``raw`` or ``ema`` (default those the run reports); ``chunk_size``: stream
    every mesh K points at a time (exact; also per call of ``predict``)."""
    return load_predictor(path, device=device, precision=precision, weights=weights,
                          chunk_size=chunk_size)


__all__ = ["InputLayout", "Predictor", "PredictorError", "load"]
