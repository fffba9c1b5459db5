"""Luna in the shared backbone, with its packed stream carried across blocks (Table 1 row).

``build_model(arch="luna", in_dim=..., out_dim=...)``: the backbone of Table 7 (same input
and output projections, pre-norm blocks, FFN) whose mixers are Luna layers
(:mod:`flarepp.mixers.luna`), plus Luna's packed stream: a learned ``P_0 [M, C]``
(``N(0, 1/C)``) and, per block,

    ``Y_X, Y_P = LunaAttn(norm(X), norm_P(P))``,  ``X <- X + Y_X``,  ``P <- P + Y_P``,
    ``X <- X + FFN(norm(X))``

(Ma et al., 2021, Sec. 3.2, in the pre-norm form of the shared backbone; the packed stream
has no FFN, as in Luna). With C=128, H=8, M=64, B=8 this is 1.57M parameters (Table 10).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import nn

from flarepp.models.backbone import StreamingPlan, SurrogateConfig, SurrogateModel


@dataclass(kw_only=True)
class LunaSurrogateConfig(SurrogateConfig):
    """The backbone settings (Tables 7-8); the mixer is always ``"luna"``."""

    arch = "luna"

    mixer: str = "luna"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mixer != "luna":
            raise ValueError(f"arch 'luna' always uses the 'luna' mixer, got mixer={self.mixer!r}")


class LunaSurrogate(SurrogateModel):
    """The shared residual backbone with Luna layers and a carried packed stream."""

    config_cls = LunaSurrogateConfig

    def __init__(self, config: LunaSurrogateConfig) -> None:
        options = {**config.mixer_options, "learned_packed": False}
        super().__init__(dataclasses.replace(config, mixer_options=options))
        self.packed_init = nn.Parameter(torch.randn(config.latents, config.dim)
                                        * config.dim ** -0.5)            # P_0 [M, C]

    def initial_packed(self, batch: int) -> torch.Tensor:
        """``P_0`` expanded over the batch: ``[B, M, C]``."""
        return self.packed_init.unsqueeze(0).expand(batch, -1, -1)

    @staticmethod
    def luna_block(block: nn.Module, h: torch.Tensor, mask: torch.Tensor | None,
                   packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One block on the tokens ``h [B, N, C]`` and the packed stream ``[B, M, C]``."""
        luna = block.mixer
        y, packed_context = luna.pack_unpack(block.mixer_norm(h), luna.packed_norm(packed),
                                             mask)
        h = h + y
        h = h + block.ffn(block.ffn_norm(h))
        return h, packed + packed_context

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(x, mask)                                            # [B, N, C]
        packed = self.initial_packed(x.shape[0])                           # [B, M, C]
        for block in self.blocks:
            h, packed = self.luna_block(block, h, mask, packed)
        return self.head(h, mask)

    def streaming_plan(self) -> StreamingPlan:
        """The packed stream is the carry: replicated, updated by the encodes alone."""
        return StreamingPlan(embed=self.embed, head=self.head,
                             blocks=[functools.partial(self.luna_block, b) for b in self.blocks],
                             initial_carry=self.initial_packed)
