"""Full-mesh inference of a trained model: plain, streamed in chunks, token-sharded, or both.

Shape letters: S samples, N points, I input and O output channels.

The model sees normalised inputs and produces normalised outputs; this returns
de-normalised predictions with zeros at padding, the same as the trainer's evaluation, for
any of the exact execution strategies of this package: ``chunk_size`` streams each sample
through the model (:func:`~flarepp.distributed.stream_forward`), ``cp`` splits its points
over a process group (:func:`~flarepp.distributed.context_parallel`), and both together
stream each rank's shard. Every strategy computes the same function as ``model(x, mask)``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import nn

from flarepp.data import Normalizer
from flarepp.distributed.parallel import ContextParallel
from flarepp.inference.engine import predict_tokens


@torch.no_grad()
def predict_mesh(model: nn.Module, x_SNI: np.ndarray, mask_SN: np.ndarray | None,
                 x_norm: Normalizer, y_norm: Normalizer, *, batch_size: int = 1,
                 chunk_size: int | None = None, cp: ContextParallel | None = None,
                 amp_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, hidden_on: str = "auto",
                 memmap_dir: str | None = None, progress: bool = False) -> np.ndarray:
    """De-normalised predictions ``[S, N, O]``; under ``cp`` every rank returns all of them.

    ``amp_dtype`` runs the model under autocast (bf16/fp16 checkpoints); inputs stay on the
    host and only the chunk (or shard) being computed is moved to ``device`` (default: the
    model's). ``hidden_on``, ``memmap_dir``, ``progress``: where a streamed sample's hidden
    state lives and a progress bar (:func:`~flarepp.inference.engine.predict_tokens`).
    """
    model.eval()
    device = torch.device(device) if device is not None else next(model.parameters()).device
    outputs = []
    for start in range(0, x_SNI.shape[0], batch_size):
        x = torch.from_numpy(np.ascontiguousarray(x_norm.encode(x_SNI[start:start + batch_size]),
                                                  dtype=np.float32))
        mask = None
        if mask_SN is not None:
            mask = torch.from_numpy(np.asarray(mask_SN[start:start + batch_size], dtype=bool))
            x = x * mask[..., None]  # padding stays exactly zero, as in training
        if cp is not None:
            x, mask = cp.shard(x), cp.shard(mask)
        batch = {"x": x} if mask is None else {"x": x, "mask": mask}
        amp = (torch.autocast(torch.device(device).type, dtype=amp_dtype)
               if amp_dtype is not None else contextlib.nullcontext())
        with amp:
            y = predict_tokens(model, batch, device=device, chunk_size=chunk_size,
                               group=None if cp is None else cp.group, hidden_on=hidden_on,
                               memmap_dir=memmap_dir, progress=progress)
        y = y.float().cpu()
        if cp is not None:
            mask = None if mask_SN is None else torch.from_numpy(
                np.asarray(mask_SN[start:start + batch_size], dtype=bool))
        y = y_norm.decode(y)
        if mask is not None:
            y = y * mask[..., None]
        outputs.append(y.numpy())
    return np.concatenate(outputs, axis=0)
