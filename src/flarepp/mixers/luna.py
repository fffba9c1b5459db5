"""Luna: linear unified nested attention (Ma et al., 2021, Sec. 3) as a token mixer.

Shape letters: B batch, N tokens, M packed (latent) tokens, H heads, D head width.

A Luna layer carries a second sequence, the packed sequence ``P [M, C]``, next to the
tokens ``X``. Its nested attention is two softmax attentions:

* pack   ``Y_P = Attn(P W_pq, X W_pk, X W_pv)``       -- M packed queries gather the N tokens
* unpack ``Y_X = Attn(X W_q, Y_P W_k, Y_P W_v) W_o``   -- each token reads the packed context

so the cost is O(N M). Each projection is a ``C x C`` linear map with bias; ``Y_P`` has no
output projection (as in the Luna release). Across layers the packed stream is updated as
``P <- P + Y_P`` and fed to the next layer (pre-norm, like the shared backbone): the packed
content of one layer is the next layer's query. :class:`flarepp.models.luna.LunaSurrogate`
(``build_model(arch="luna")``) threads that stream through the shared backbone; it is the
Luna of Table 1 and Table 10.

Used as a stand-alone mixer (``build_mixer("luna")`` or ``build_model(mixer="luna")``),
each layer owns a learned packed sequence ``P`` (``learned_packed=True``, ``N(0, 1/C)``
as in Luna) and nothing is carried between layers. Pack uses ``self.backend.encode`` (the
packed queries gather the real tokens; padding is excluded) and unpack
``self.backend.decode`` (tokens read the packed context; padding rows are zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flarepp.mixers.base import Mixer, MixerConfig, check_tokens
from flarepp.mixers.registry import MIXERS
from flarepp.ops import make_norm


@dataclass(kw_only=True)
class LunaConfig(MixerConfig):
    """``learned_packed``: this layer owns its packed sequence ``P`` (stand-alone use);
    ``False`` when a model supplies the carried packed stream (``arch="luna"``)."""

    learned_packed: bool = True


@MIXERS.register("luna", doc="Luna (Ma et al., 2021): pack/unpack nested attention, "
                 "M packed tokens")
class LunaAttention(Mixer):
    """Luna's nested attention; :meth:`pack_unpack` is the two-stream layer."""

    config_cls = LunaConfig
    token_shardable = True  # pack = one encode per block; unpack = a local decode (B.4)

    def __init__(self, config: LunaConfig) -> None:
        super().__init__(config)
        C = config.dim
        self.packed_query_proj = nn.Linear(C, C)          # W_pq
        self.token_key_value_proj = nn.Linear(C, 2 * C)   # [W_pk | W_pv]
        self.query_proj = nn.Linear(C, C)                 # W_q
        self.packed_key_value_proj = nn.Linear(C, 2 * C)  # [W_k | W_v] of the packed context
        self.out_proj = nn.Linear(C, C)                   # W_o
        self.packed_norm = make_norm(config.norm, C)      # pre-norm of the packed stream
        self.packed_seed = (nn.Parameter(torch.randn(config.latents, C) * C ** -0.5)
                            if config.learned_packed else None)

    def pack_unpack(self, x: torch.Tensor, packed: torch.Tensor,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Y_X W_o [B, N, C], Y_P [B, M, C])`` for normed tokens ``x`` and normed
        packed sequence ``packed``; padding tokens' ``Y_X`` rows are zero."""
        check_tokens(x, mask, self.config.dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        s = self.config.attn_scale
        packed_queries = self.split_heads(self.packed_query_proj(packed))      # [B,H,M,D]
        keys, values = self.split_projections(self.token_key_value_proj(x), 2)  # [B,H,N,D]
        packed_context = self.merge_heads(                                      # Y_P [B,M,C]
            self.backend.encode(packed_queries, keys, values, mask, scale=s))
        queries = self.split_heads(self.query_proj(x))                          # [B,H,N,D]
        ctx_keys, ctx_values = self.split_projections(
            self.packed_key_value_proj(packed_context), 2)                      # [B,H,M,D]
        y = self.backend.decode(queries, ctx_keys, ctx_values, mask, scale=s)
        y = self.out_proj(self.merge_heads(y))
        if mask is not None:
            y = y.masked_fill(~mask[..., None], 0.0)
        return y, packed_context

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed_seed is None:
            raise ValueError("this Luna layer was built with learned_packed=False: it takes "
                             "the carried packed stream from its model; call "
                             "pack_unpack(x, packed, mask) or use build_model(arch='luna')")
        packed = self.packed_norm(self.packed_seed).unsqueeze(0).expand(x.shape[0], -1, -1)
        y, _ = self.pack_unpack(x, packed, mask)
        return y
