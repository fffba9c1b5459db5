"""The paper's metric: per-sample relative L2 on de-normalised outputs (FACTS.md 3).

``rel_l2(s) = ||y_hat_s - y_s|| / ||y_s||`` over the real points and all channels of
sample s; the reported test error is its mean over the test samples (a fraction).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from flarepp.data import MeshSamples, Normalizer


def batches(samples: MeshSamples, batch_size: int, order: np.ndarray | None = None):
    """Yield ``(index, x, y, mask)`` torch batches; ``mask`` is None for full meshes."""
    order = np.arange(len(samples)) if order is None else order
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        mask = None if samples.mask is None else torch.from_numpy(samples.mask[idx])
        yield idx, torch.from_numpy(samples.x[idx]), torch.from_numpy(samples.y[idx]), mask


def relative_l2(pred_BNO: torch.Tensor, true_BNO: torch.Tensor,
                mask_BN: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample ``||pred - true|| / ||true||`` over real points and channels, ``[B]``."""
    err = (pred_BNO - true_BNO).double().square()
    ref = true_BNO.double().square()
    if mask_BN is not None:
        err = err * mask_BN[..., None]
        ref = ref * mask_BN[..., None]
    return (err.sum((1, 2)) / ref.sum((1, 2)).clamp_min(1e-300)).sqrt()


@torch.no_grad()
def predict(model: nn.Module, samples: MeshSamples, x_norm: Normalizer, y_norm: Normalizer,
            batch_size: int = 4, precision: str = "fp32") -> np.ndarray:
    """De-normalised predictions ``[S, N, O]`` (zeros at masked points)."""
    from flarepp.train.loop import autocast
    model.eval()
    out = []
    for _, x, _, mask in batches(samples, batch_size):
        with autocast(precision):
            pred = model(x_norm.encode(x), mask=mask)
        pred = y_norm.decode(pred.float())
        if mask is not None:
            pred = pred * mask[..., None]
        out.append(pred.numpy())
    return np.concatenate(out, axis=0)


def evaluate(model: nn.Module, samples: MeshSamples, x_norm: Normalizer, y_norm: Normalizer,
             batch_size: int = 4, precision: str = "fp32") -> dict:
    """``{"rel_l2": mean, "per_sample": [...]}`` on de-normalised outputs."""
    pred = predict(model, samples, x_norm, y_norm, batch_size, precision)
    mask = None if samples.mask is None else torch.from_numpy(samples.mask)
    per = relative_l2(torch.from_numpy(pred), torch.from_numpy(samples.y), mask).numpy()
    return {"rel_l2": float(per.mean()), "per_sample": per.tolist(), "pred": pred}
