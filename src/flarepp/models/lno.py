"""Latent Neural Operator (Wang & Wang, 2024, Sec. 3) as a complete architecture (Table 9).

Shape letters: B batch, N tokens (points), R latent modes, H heads, C channels.

LNO works in a latent space of R modes reached by *Physics-Cross-Attention* (PhCA), whose
attention weights are produced by an MLP of the embedded positions rather than by query-key
products:

* trunk ``T = MLP_t(x)`` (query positions) and branch ``U = MLP_b(x)`` (input function);
* mode scores ``S = MLP_a(T)`` ``[N, R]``; encode with ``softmax`` over the N points,
  ``Z_r = sum_i softmax_i(S_ir) U_i``;
* B latent blocks ``Z <- Z + MHSA(LN(Z))``, ``Z <- Z + MLP(LN(Z))`` (MLP ratio 2);
* decode with ``softmax`` over the R modes, ``Y_i = sum_r softmax_r(S_ir) Z_r``, then
  ``MLP_o``.

The encoder and decoder share ``MLP_a`` (one projector, two softmax axes). Each MLP is
``Linear -> GELU``, ``projector_layers`` residual ``C x C`` GELU layers, ``Linear``, with
the exact (erf) GELU throughout, as in the LNO release and the FLARE study's copy of it.
Here query and input points coincide, so trunk and branch both read the full input x.
Defaults are the FLARE study's: C=128, H=8, R=256 modes, B=4 latent blocks (8 on Airfoil
and Pipe), ``projector_layers=2``; on Elasticity C=192 and ``projector_layers=3``.
Padding points get no encode weight and zero output. The latent self-attention goes
through ``backend.self_attention``; PhCA's MLP scores do not fit a query-key kernel and are
computed explicitly (an ``[B, N, R]`` tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flarepp.mixers.base import check_tokens
from flarepp.models.backbone import LatentModelConfig, ResidualMLP
from flarepp.models.latent import LatentSelfAttentionBlock


@dataclass(kw_only=True)
class LNOConfig(LatentModelConfig):
    """``latents``: the number R of latent modes; ``blocks``: latent attention blocks;
    ``projector_layers``: hidden residual layers of each MLP (LNO's ``n_layer``)."""

    arch = "lno"
    positive = LatentModelConfig.positive + ("mlp_ratio",)

    blocks: int = 4
    latents: int = 256
    projector_layers: int = 2
    mlp_ratio: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.projector_layers < 0:
            raise ValueError(f"lno: projector_layers must be >= 0, got {self.projector_layers}")


class LNO(nn.Module):
    """``[B, N, in_dim] -> [B, N, out_dim]`` through R latent modes (PhCA)."""

    config_cls = LNOConfig

    def __init__(self, config: LNOConfig) -> None:
        super().__init__()
        self.config = c = config
        L = c.projector_layers
        self.trunk = ResidualMLP(c.in_dim, c.dim, c.dim, L, gelu="none")
        self.branch = ResidualMLP(c.in_dim, c.dim, c.dim, L, gelu="none")
        self.mode_projector = ResidualMLP(c.dim, c.dim, c.latents, L, gelu="none")  # MLP_a
        # LNO's latent blocks: Q, K, V with bias and the exact GELU.
        self.blocks = nn.ModuleList(
            LatentSelfAttentionBlock(c.dim, c.heads, c.norm, c.mlp_ratio, qkv_bias=True,
                                     gelu="none", attn_scale=c.attn_scale)
            for _ in range(c.blocks))
        self.out_mlp = ResidualMLP(c.dim, c.dim, c.out_dim, L, gelu="none")
        # PyTorch's default initialisation, as in the FLARE study's LNO: the mode scores must
        # differ across modes from the start, or every mode encodes the same mean.

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_tokens(x, mask, self.config.in_dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        scores = self.mode_projector(self.trunk(x))                             # [B, N, R]
        if scores.dtype in (torch.float16, torch.bfloat16):  # softmax in float32
            scores = scores.float()
        if mask is not None:
            scores_enc = scores.masked_fill(~mask[..., None], float("-inf"))
        else:
            scores_enc = scores
        encode_w = torch.softmax(scores_enc, dim=1)                             # over N
        decode_w = torch.softmax(scores, dim=2)                                 # over R
        values = self.branch(x)                                                 # [B, N, C]
        z = torch.einsum("bnr,bnc->brc", encode_w.to(values.dtype), values)     # [B, R, C]
        for block in self.blocks:
            z = block(z)
        y = self.out_mlp(torch.einsum("bnr,brc->bnc", decode_w.to(z.dtype), z))
        return y if mask is None else y.masked_fill(~mask[..., None], 0.0)
