"""Rank-adaptive FLARE and FLARE++: latents that can be split without changing the function.

Shape letters: B batch, H heads, N tokens, M latents, D head width.

The talk ("FLARE + high order attention ideas", Aim 1(a)) proposes to grow the number of
latents M during training, the rank bound of FLARE's routing, while avoiding loss spikes.
Splitting a latent into copies cannot preserve FLARE's function by itself: the encode
(softmax over N) of a duplicated query gives a duplicated latent ``Z``, but in the decode
(softmax over M) the copies' equal logits each take ``e^l / (S + e^l)`` of the weight
instead of sharing ``e^l / S`` -- the denominator grows. A latent whose decode logit is
``-inf`` for every token would be neutral, but no query gives ``q . k = -inf`` for all k.

These mixers therefore carry a fixed per-latent **decode-logit offset** ``o [H, M]``
(a buffer, zero at construction):

    Y = softmax_M(s K Q^T + o) Z,      Z = softmax_N(s Q K^T) V        (per head)

A per-latent constant cancels in the encode's softmax over N, so only the decode sees it.
Splitting latent m into c identical copies with ``o' = o_m - log c`` each leaves
``sum_copies e^{l + o'} = e^{l + o_m}`` and every ``Z`` unchanged: the output is the same
function, to rounding (:mod:`flarepp.rank_growth`). With ``o = 0`` these are FLARE and
FLARE++ exactly; the parameter set (and Table 2's counts) are theirs.

The offset reaches the decode through the backend's ordinary ``decode`` call: keys gain a
constant column ``[K, 1]`` and queries ``[Q, o / s]``, so ``s [K, 1] . [Q, o / s] =
s K . Q + o``; the encode keeps the plain ``Q``, ``K``. The decode runs at head width
``D + 1`` (one more key column than FLARE's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flarepp.mixers.base import MixerConfig, check_tokens, zero_masked
from flarepp.mixers.flare import FLARE, FLAREPP, FLAREPPConfig
from flarepp.mixers.registry import MIXERS
from flarepp.ops.attention import default_scale


class _DecodeOffset:
    """The offset buffer and the decode that adds it (shared by both mixers: listed first
    among their bases, so its ``__init__`` adds the buffer after the mixer's own)."""

    #: the ``[H, M, D]`` parameters indexed by latent (what a split copies)
    latent_parameters: tuple[str, ...] = ()

    def __init__(self, config: MixerConfig) -> None:
        super().__init__(config)
        self.register_buffer("decode_logit_offset", torch.zeros(config.heads, config.latents))

    def checked_input(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``x`` checked against the mixer's width, its padded tokens zeroed."""
        check_tokens(x, mask, self.config.dim)
        return zero_masked(x, mask)

    def offset_decode(self, keys: torch.Tensor, queries: torch.Tensor, latents: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
        """``softmax_M(s K Q^T + o) Z``, ``[B, H, N, D]``, through ``backend.decode``."""
        s = default_scale(self.head_dim, self.config.attn_scale)
        B = queries.shape[0]
        offset = (self.decode_logit_offset / s).to(queries.dtype)                # [H, M]
        keys = F.pad(keys, (0, 1), value=1.0)
        queries = torch.cat([queries, offset[None, :, :, None].expand(B, -1, -1, 1)], dim=-1)
        return self.backend.decode(keys, queries, latents, mask, scale=s)


@MIXERS.register("flare-rank-adaptive",
                 doc="FLARE with per-latent decode offsets: M can grow without changing the function")
class RankAdaptiveFLARE(_DecodeOffset, FLARE):
    """FLARE (Table 2) with a decode-logit offset per latent (module doc)."""

    config_cls = MixerConfig
    latent_parameters = ("fixed_queries",)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.checked_input(x, mask)
        keys, values = self.split_projections(self.key_value_proj(x), 2)
        queries = self.latents_for(self.fixed_queries, x.shape[0])
        latents = self.backend.encode(queries, keys, values, mask, scale=self.config.attn_scale)
        y = self.offset_decode(keys, queries, latents, mask)
        return zero_masked(self.out_proj(self.merge_heads(y)), mask)


@MIXERS.register("flarepp-rank-adaptive",
                 doc="FLARE++ with per-latent decode offsets: M can grow without changing the function")
class RankAdaptiveFLAREPP(_DecodeOffset, FLAREPP):
    """FLARE++ (paper v2) with a decode-logit offset per latent. A latent is a synthesis
    seed ``Q~_m`` and a fixed query ``Q_f,m``: the per-head norms act row by row and the
    synthesized query ``Q_d,m`` depends on seed m alone, so copies of both give copies of
    the routing query ``Q_m``."""

    config_cls = FLAREPPConfig
    latent_parameters = ("synthesis_seeds", "fixed_queries")

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.checked_input(x, mask)
        synthesis_keys, keys, values = self.split_projections_BNHD(self.key_value_proj(x), 3)
        synthesis_keys = self.heads_first(self.synthesis_key_norm(synthesis_keys))
        keys = self.heads_first(self.routing_key_norm(keys))
        values = self.heads_first(values)
        queries = self.routing_queries(synthesis_keys, mask, x.shape[0])
        latents = self.backend.encode(queries, keys, values, mask, scale=self.config.attn_scale)
        y = self.offset_decode(keys, queries, latents, mask)
        return zero_masked(self.out_proj(self.merge_heads(y)), mask)
