"""Full multi-head self-attention, the quadratic reference mixer (paper Sec. 3.1).

``Y_h = softmax(s Q_h K_h^T) V_h`` over all real tokens with fused SDPA, ``s = 1/sqrt(D)``;
``[Q | K | V] = X W_QKV`` without bias and an output projection with bias, as in the
reference implementation (the parameter counts of Table 10 depend on this).
"""

from __future__ import annotations

import torch
from torch import nn

from flarepp.mixers.base import Mixer, MixerConfig, check_tokens, zero_masked
from flarepp.mixers.registry import MIXERS


@MIXERS.register("attention", doc="full multi-head self-attention (fused SDPA), O(N^2)")
class SelfAttention(Mixer):
    """Quadratic-cost reference; ``latents`` is accepted and ignored."""

    def __init__(self, config: MixerConfig) -> None:
        super().__init__(config)
        self.qkv_proj = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out_proj = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_tokens(x, mask, self.config.dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        q, k, v = self.split_projections(self.qkv_proj(x), 3)
        y = self.backend.self_attention(q, k, v, mask, scale=self.config.attn_scale)
        return zero_masked(self.out_proj(self.merge_heads(y)), mask)
