"""Shared pieces of the token mixers: the config, input checks and projection init.

Every mixer is called as ``mixer(x, mask=None)`` with ``x: [B, N, C]`` and
``mask: [B, N]`` bool (True = real token) and returns ``[B, N, C]``; outputs at masked
tokens are zero and never influence real tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from flarepp.ops import FUSED, AttentionBackend
from flarepp.ops.norms import NORM_TYPES


@dataclass(kw_only=True)
class MixerConfig:
    """Settings shared by every mixer (paper Table 7: C=128, H=8, D=C/H=16).

    ``latents`` is M (latent queries, slices, latent tokens...); ``norm`` the run's norm
    type (``layernorm`` for FP32 runs, ``rmsnorm`` for mixed precision, C.2);
    ``attn_scale`` the SDPA scale, ``None`` meaning ``1/sqrt(D)`` (the FLARE study used 1.0).
    """

    dim: int = 128
    heads: int = 8
    latents: int = 64
    norm: str = "layernorm"
    attn_scale: float | None = None

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.heads <= 0 or self.latents <= 0:
            raise ValueError(f"dim, heads and latents must be positive, got {self}")
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} must be divisible by heads={self.heads}")
        if self.norm not in NORM_TYPES:
            raise ValueError(f"unknown norm {self.norm!r}; known norms: {', '.join(NORM_TYPES)}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def to_dict(self) -> dict:
        return asdict(self)


class Mixer(nn.Module):
    """Base class: holds the config and the attention backend (see ``flarepp.ops``)."""

    config_cls = MixerConfig

    def __init__(self, config: MixerConfig) -> None:
        super().__init__()
        self.config = config
        self.backend: AttentionBackend = FUSED

    @property
    def heads(self) -> int:
        return self.config.heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def split_heads(self, x_BNC: torch.Tensor) -> torch.Tensor:
        """``[B, N, H*D] -> [B, H, N, D]`` (a view)."""
        B, N, _ = x_BNC.shape
        return x_BNC.view(B, N, self.heads, -1).transpose(1, 2)

    def split_projections(self, x_BNkC: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
        """The output of ``k`` stacked projections, ``[B, N, k*C]``, as ``k`` per-head
        ``[B, H, N, D]`` views (no copy)."""
        return tuple(self.heads_first(t) for t in self.split_projections_BNHD(x_BNkC, k))

    def split_projections_BNHD(self, x_BNkC: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
        """``[B, N, k*C]`` as ``k`` views ``[B, N, H, D]`` in the layout the GEMM wrote.

        Split along the channel dim, so that the backward pass concatenates the ``k``
        gradients straight into ``[B, N, k*C]`` (one copy); ``unbind`` of a permuted view
        would stack them and then copy again to undo the permutation. A per-head norm
        over D applied here, before :meth:`heads_first`, reads rows of D contiguous
        numbers and needs no transposing copy, forward or backward.
        """
        B, N, width = x_BNkC.shape
        if width != k * self.config.dim:
            raise ValueError(f"expected {k} stacked projections of width {self.config.dim}, "
                             f"i.e. [B, N, {k * self.config.dim}], got {list(x_BNkC.shape)}")
        return tuple(t.view(B, N, self.heads, self.head_dim)
                     for t in x_BNkC.split(self.config.dim, dim=-1))

    @staticmethod
    def heads_first(x_BNHD: torch.Tensor) -> torch.Tensor:
        """``[B, N, H, D] -> [B, H, N, D]`` (a view; the fused SDPA kernels take it as is)."""
        return x_BNHD.transpose(1, 2)

    def merge_heads(self, y_BHND: torch.Tensor) -> torch.Tensor:
        """``[B, H, N, D] -> [B, N, H*D]``."""
        B, H, N, D = y_BHND.shape
        return y_BHND.transpose(1, 2).reshape(B, N, H * D)

    def latents_for(self, latents_HMD: torch.Tensor, batch: int) -> torch.Tensor:
        """A learned ``[H, M, D]`` tensor expanded (as a view) to ``[B, H, M, D]``."""
        return latents_HMD.unsqueeze(0).expand(batch, -1, -1, -1)


def check_tokens(x: torch.Tensor, mask: torch.Tensor | None, width: int, *,
                 what: str = "x") -> None:
    """Raise a ``ValueError`` that says what was expected for a bad ``x`` or ``mask``."""
    if x.dim() != 3 or x.shape[-1] != width:
        raise ValueError(f"{what} must have shape [B, N, {width}], got {list(x.shape)}")
    if mask is None:
        return
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (True = real token), got {mask.dtype}")
    if mask.shape != x.shape[:2]:
        raise ValueError(f"mask must have shape [B, N] = {list(x.shape[:2])} to match {what}, "
                         f"got {list(mask.shape)}")


def zero_masked(y_BNC: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Outputs at masked tokens are exactly zero (output biases would leak otherwise)."""
    return y_BNC if mask is None else y_BNC.masked_fill(~mask[..., None], 0.0)


def near_identity_linear(dim: int, copies: int = 1, *, bias: bool = True,
                         std: float = 0.02) -> nn.Linear:
    """``copies`` stacked ``C x C`` projections, each ``W = I + dW`` (paper A.5).

    ``dW ~ TruncNormal(0, std)`` truncated at two standard deviations; biases start at 0.
    Stacking lets one GEMM compute several projections of the same input.
    """
    layer = nn.Linear(dim, copies * dim, bias=bias)
    with torch.no_grad():
        nn.init.trunc_normal_(layer.weight, mean=0.0, std=std, a=-2 * std, b=2 * std)
        for i in range(copies):
            layer.weight[i * dim:(i + 1) * dim].add_(torch.eye(dim))
        if bias:
            layer.bias.zero_()
    layer._flarepp_custom_init = True  # the backbone's default init leaves it alone
    return layer


def init_latents(shape: tuple[int, ...], std: float = 0.02) -> nn.Parameter:
    """Learned latent queries or seeds, ``N(0, std^2)`` as in the reference implementation."""
    return nn.Parameter(torch.randn(*shape) * std)
