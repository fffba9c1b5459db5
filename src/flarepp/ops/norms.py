"""Block norms and per-head norms (paper A.3, C.2).

FP32 runs use LayerNorm and mixed-precision runs RMSNorm, for the block norms and the
per-head norms alike. A per-head norm acts on the head width D and is shared by the heads:
``N_a`` carries a learned scale (D parameters, plus a D-vector bias for LayerNorm),
``N_0`` carries none.
"""

from __future__ import annotations

import torch
from torch import nn

NORM_TYPES = ("layernorm", "rmsnorm")


def make_norm(kind: str, width: int, *, affine: bool = True) -> nn.Module:
    """A LayerNorm or RMSNorm over the last dimension of size ``width``."""
    if kind == "layernorm":
        return nn.LayerNorm(width, elementwise_affine=affine)
    if kind == "rmsnorm":
        return nn.RMSNorm(width, eps=1e-6, elementwise_affine=affine)
    raise ValueError(f"unknown norm {kind!r}; known norms: {', '.join(NORM_TYPES)}")


class HeadNorm(nn.Module):
    """``N_a`` (``affine=True``) or ``N_0`` (``affine=False``) over the head width D."""

    def __init__(self, kind: str, head_dim: int, *, affine: bool) -> None:
        super().__init__()
        self.norm = make_norm(kind, head_dim, affine=affine)

    def forward(self, x_BHnD: torch.Tensor) -> torch.Tensor:
        return self.norm(x_BHnD)
