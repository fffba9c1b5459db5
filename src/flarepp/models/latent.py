"""Pieces the complete architectures share: head views and the latent self-attention block.

Shape letters: B batch, L a sequence (tokens or latents), H heads, D head width, C = H D.

:class:`LatentSelfAttentionBlock` is the pre-norm transformer block that PerceiverIO runs on
its M latents (Jaegle et al., 2021a) and LNO on its R latent modes (Wang & Wang, 2024):

    ``Z <- Z + MHSA(LN(Z)) W_O``,   ``Z <- Z + MLP(LN(Z))``,   ``MLP = Linear, GELU, Linear``

with one stacked ``[W_Q | W_K | W_V]`` projection. The two architectures differ only in
whether that projection has a bias (LNO: yes; PerceiverIO, as in the FLARE study: no) and
in the GELU (exact in LNO, the tanh approximation in PerceiverIO's backbone).
"""

from __future__ import annotations

import torch
from torch import nn

from flarepp.ops import FUSED, AttentionBackend, make_norm


def split_heads(t_BLC: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, L, H*D] -> [B, H, L, D]`` (a view)."""
    B, L, C = t_BLC.shape
    return t_BLC.view(B, L, heads, C // heads).transpose(1, 2)


def merge_heads(t_BHLD: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, D] -> [B, L, H*D]``."""
    B, H, L, D = t_BHLD.shape
    return t_BHLD.transpose(1, 2).reshape(B, L, H * D)


class LatentSelfAttentionBlock(nn.Module):
    """``Z + MHSA(norm(Z))``, then ``Z + MLP(norm(Z))`` over a latent array ``[B, L, C]``.

    The attention runs through ``backend.self_attention`` without a mask: every latent is
    real. ``qkv_bias`` and ``gelu`` ("none" exact, "tanh" approximate) select LNO's or
    PerceiverIO's variant; the parameter names are the same for both.
    """

    def __init__(self, dim: int, heads: int, norm: str, mlp_ratio: float, *,
                 qkv_bias: bool, gelu: str, attn_scale: float | None = None) -> None:
        super().__init__()
        self.heads, self.attn_scale = heads, attn_scale
        self.backend: AttentionBackend = FUSED
        self.attn_norm = make_norm(norm, dim)
        self.qkv_proj = nn.Linear(dim, 3 * dim, bias=qkv_bias)          # [W_Q | W_K | W_V]
        self.out_proj = nn.Linear(dim, dim)                             # W_O
        self.mlp_norm = make_norm(norm, dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate=gelu),
                                 nn.Linear(hidden, dim))

    def forward(self, z_BLC: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(t, self.heads)
                   for t in self.qkv_proj(self.attn_norm(z_BLC)).chunk(3, dim=-1))
        y = self.backend.self_attention(q, k, v, None, scale=self.attn_scale)  # [B, H, L, D]
        z_BLC = z_BLC + self.out_proj(merge_heads(y))
        return z_BLC + self.mlp(self.mlp_norm(z_BLC))
