"""Set Transformer as a complete architecture: an ISAB replaces each block (Table 9).

Shape letters: B batch, N tokens, M inducing points, H heads, D head width, C channels.

Lee et al. (2019, Sec. 3): the multihead attention block

    ``MAB(X, Y) = LN(H + rFF(H))``,  ``H = LN(X W_q + Multihead(X W_q, Y W_k, Y W_v))``

with ``rFF(H) = act(H W_o + b_o)`` a row-wise feed-forward layer and the softmax scale
``1/sqrt(C)`` (the width of all heads together, not of one head), both as in the authors'
release; the residual takes the projected queries and the heads are concatenated without a
further output matrix, as there too. ``act`` is the exact GELU by default: the paper runs
Set Transformer itself (Table 9, "None" deviating from Tables 7-8, whose feed-forward
networks are GELU MLPs), and the FLARE code that Table 10 counts uses the exact GELU in the
MAB; ``row_ff_act="relu"`` gives the ReLU of Lee et al.'s release. A given ``attn_scale``
replaces ``1/sqrt(C)``. The induced set attention block, with M learned inducing points
``I [M, C]`` (Xavier-uniform init):

    ``ISAB(X) = MAB(X, MAB(I, X))``  -- two cross-attention MABs, each with its own
    projections, residuals, norms and row-wise feed-forward layer.

The model keeps the shared backbone's input/output projections (Table 7) and wraps each
ISAB in its pre-norm block: ``X <- X + ISAB(LN(X))``, ``X <- X + FFN(LN(X))`` (FFN ratio 2).
``MAB(I, X)`` uses ``backend.encode`` (inducing points gather the real tokens);
``MAB(X, H)`` uses ``backend.decode`` (tokens read the M summaries). Masked tokens never
reach a real token and their outputs are zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from flarepp.models.backbone import BackboneConfig, SurrogateModel
from flarepp.models.latent import merge_heads, split_heads
from flarepp.ops import FUSED, AttentionBackend, make_norm
from flarepp.validate import require_choice


ROW_FF_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


@dataclass(kw_only=True)
class SetTransformerConfig(BackboneConfig):
    """Tables 7-8 settings; ``latents`` is the number M of inducing points per ISAB;
    ``row_ff_act`` the MAB's row-wise activation, ``gelu`` (exact) or ``relu``."""

    arch = "set-transformer"

    row_ff_act: str = "gelu"

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice(self, "row_ff_act", ROW_FF_ACTIVATIONS, self.arch)


class MAB(nn.Module):
    """``MAB(X, Y)`` of Lee et al. (2019); ``queries_are_tokens`` picks the primitive."""

    def __init__(self, dim: int, heads: int, norm: str, attn_scale: float | None,
                 row_ff_act: str) -> None:
        super().__init__()
        self.heads = heads
        self.attn_scale = 1.0 / math.sqrt(dim) if attn_scale is None else attn_scale
        self.backend: AttentionBackend = FUSED
        self.query_proj = nn.Linear(dim, dim)              # W_q
        self.key_value_proj = nn.Linear(dim, 2 * dim)      # [W_k | W_v]
        self.row_ff = nn.Linear(dim, dim)                  # rFF
        self.attn_norm = make_norm(norm, dim)
        self.out_norm = make_norm(norm, dim)
        self.act = ROW_FF_ACTIVATIONS[row_ff_act]()

    def forward(self, queries: torch.Tensor, keys_values: torch.Tensor,
                mask: torch.Tensor | None, *, queries_are_tokens: bool) -> torch.Tensor:
        q = self.query_proj(queries)                                    # [B, L, C]
        k, v = self.key_value_proj(keys_values).chunk(2, dim=-1)
        qh, kh, vh = (split_heads(t, self.heads) for t in (q, k, v))
        if queries_are_tokens:   # tokens read the inducing summaries; padding rows zero
            a = self.backend.decode(qh, kh, vh, mask, scale=self.attn_scale)
        else:                    # inducing points gather the real tokens
            a = self.backend.encode(qh, kh, vh, mask, scale=self.attn_scale)
        h = self.attn_norm(q + merge_heads(a))
        return self.out_norm(h + self.act(self.row_ff(h)))


class ISAB(nn.Module):
    """``ISAB(X) = MAB(X, MAB(I, X))`` with ``I [M, C]`` learned inducing points."""

    def __init__(self, c: SetTransformerConfig) -> None:
        super().__init__()
        self.inducing_points = nn.Parameter(torch.empty(c.latents, c.dim))
        nn.init.xavier_uniform_(self.inducing_points)
        self.gather = MAB(c.dim, c.heads, c.norm, c.attn_scale, c.row_ff_act)    # MAB(I, X)
        self.scatter = MAB(c.dim, c.heads, c.norm, c.attn_scale, c.row_ff_act)   # MAB(X, H)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        inducing = self.inducing_points.unsqueeze(0).expand(x.shape[0], -1, -1)
        summaries = self.gather(inducing, x, mask, queries_are_tokens=False)   # [B, M, C]
        return self.scatter(x, summaries, mask, queries_are_tokens=True)       # [B, N, C]


class SetAttentionBlock(nn.Module):
    """Pre-norm block: ``x + ISAB(norm(x))``, then ``x + FFN(norm(x))``."""

    def __init__(self, c: SetTransformerConfig) -> None:
        super().__init__()
        hidden = int(c.dim * c.ffn_ratio)
        self.isab_norm = make_norm(c.norm, c.dim)
        self.isab = ISAB(c)
        self.ffn_norm = make_norm(c.norm, c.dim)
        self.ffn = nn.Sequential(nn.Linear(c.dim, hidden), nn.GELU(approximate=c.gelu),
                                 nn.Linear(hidden, c.dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.isab(self.isab_norm(x), mask)
        return x + self.ffn(self.ffn_norm(x))


class SetTransformer(SurrogateModel):
    """``[B, N, in_dim] -> [B, N, out_dim]``: the shared backbone with B ISAB blocks."""

    config_cls = SetTransformerConfig
    token_shardable = False  # the backbone's flag is not inherited: no sharded parity test

    def make_block(self) -> nn.Module:
        return SetAttentionBlock(self.config)
