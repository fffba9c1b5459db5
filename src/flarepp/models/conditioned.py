"""A surrogate conditioned on a set of tokens, with three ways to condition (``conditioned``).

Shape letters: B batch, N mesh points, I input channels per point, O outputs, K
conditioning tokens of F features each, C width.

``(x [B, N, I], c [B, K, F]) -> y [B, N, O]``: the backbone of
:mod:`flarepp.models.backbone` (input MLP, pre-norm blocks, output MLP) where ``c`` holds
what the mesh does not: time, parameters, summaries of earlier states (talk, Aim 1(b):
``(t, x, u_{t-k}, ..., u_t) -> u_{t+1}``). ``conditioning`` picks how ``c`` enters
(:data:`CONDITIONING`):

* ``cross`` (Cross FLARE, :mod:`flarepp.mixers.cross`): every token of ``c`` is embedded
  by a residual MLP ``F -> C``; in every block the mixer's encode gathers from the mesh
  tokens and the (normed) conditioning tokens together, ``O(2MN + MK)`` per block. Needs a
  mixer that takes conditioning tokens (``flare-cross``, ``flarepp-cross``).
* ``concat``: ``c`` flattened to ``K F`` numbers is appended to the inputs of every point,
  ``x'_n = [x_n, vec(c)]``, before the input MLP (the conditioning enters once, pointwise).
* ``adaln``: AdaLN-Zero as in the Diffusion Transformer (Peebles & Xie, 2023, Sec. 3.2):
  ``e = MLP(vec(c))`` ``[B, C]``; per block ``(shift, scale, gate) x 2 = Linear(SiLU(e))``,
  zero-initialised, and ``h + gate_1 mixer(norm(h) (1 + scale_1) + shift_1)``, then the
  same around the FFN. One conditioning vector per sample modulates every token alike
  (the talk's remark: it cannot attend to a sequence of conditioning tokens).

Streaming and token sharding (paper Appendix B): ``concat`` and ``adaln`` act on each point
alone outside the mixers' encodes (``vec(c)`` is the same for every point of a sample), so
the model streams in chunks and shards its tokens exactly (:meth:`ConditionedSurrogate.
streaming_plan`); ``cross`` does not: every encode gathers the conditioning tokens beside
the mesh's, and a chunk's or shard's partial encode would count them once per part
(:meth:`ConditionedSurrogate.streaming_refusal`).

Masks: ``mask [B, N]`` for points, ``conditioning_mask [B, K]`` for conditioning tokens
(True = real): masked conditioning tokens are left out of the Cross-FLARE encodes and
zeroed in ``vec(c)`` for the other two schemes.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flarepp.mixers import MIXERS, build_mixer
from flarepp.mixers.base import check_tokens
from flarepp.models.registry import MODELS
from flarepp.models.backbone import (BackboneConfig, Block, ResidualMLP, StreamingPlan,
                                     build_input_mlp, build_output_mlp, init_backbone_weights)
from flarepp.ops import make_norm
from flarepp.registry import Registry

CONDITIONING: Registry = Registry("conditioning scheme")


@dataclass(kw_only=True)
class ConditionedConfig(BackboneConfig):
    """Backbone settings plus the conditioning tokens' shape (``cond_tokens`` K of
    ``cond_dim`` F features, from the data) and the scheme (:data:`CONDITIONING`)."""

    arch = "conditioned"
    positive = BackboneConfig.positive + ("cond_dim", "cond_tokens")

    cond_dim: int
    cond_tokens: int
    conditioning: str = "cross"
    mixer: str = "flare-cross"
    mixer_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        scheme = CONDITIONING.get(self.conditioning)
        scheme.check(self)


class Conditioner(nn.Module, abc.ABC):
    """One way of conditioning: its own parameters, the input MLP's width, the blocks."""

    @classmethod
    def check(cls, config: ConditionedConfig) -> None:
        """Raise a ``ValueError`` naming the setting if ``config`` cannot use this scheme."""

    @staticmethod
    def input_width(config: ConditionedConfig) -> int:
        return config.in_dim

    @abc.abstractmethod
    def prepare(self, x_BNI: torch.Tensor, c_BKF: torch.Tensor,
                c_mask_BK: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        """``(inputs of the input MLP, what every block receives)``."""

    @abc.abstractmethod
    def make_block(self, config: ConditionedConfig) -> nn.Module:
        """One block; called as ``block(h, mask, context)``."""


def _flat(c_BKF: torch.Tensor, c_mask_BK: torch.Tensor | None) -> torch.Tensor:
    """``vec(c)`` with masked tokens' features zero, ``[B, K F]``."""
    if c_mask_BK is not None:
        c_BKF = c_BKF.masked_fill(~c_mask_BK[..., None], 0.0)
    return c_BKF.flatten(1)


def _mixer(config: ConditionedConfig) -> nn.Module:
    c = config
    return build_mixer(c.mixer, dim=c.dim, heads=c.heads, latents=c.latents, norm=c.norm,
                       attn_scale=c.attn_scale, **c.mixer_options)


class PlainBlock(Block):
    """The backbone's block, ignoring the context (the conditioning is in the inputs)."""

    def forward(self, h, mask=None, context=None):
        return super().forward(h, mask)


class CrossBlock(Block):
    """``h + mixer(norm(h), conditioning=norm_c(c))``, then ``h + FFN(norm(h))``."""

    def __init__(self, mixer: nn.Module, dim: int, norm: str, ffn_ratio: float, *,
                 gelu: str = "tanh") -> None:
        super().__init__(mixer, dim, norm, ffn_ratio, gelu=gelu)
        self.conditioning_norm = make_norm(norm, dim)

    def forward(self, h, mask=None, context=None):
        tokens, token_mask = context
        h = h + self.mixer(self.mixer_norm(h), mask, conditioning=self.conditioning_norm(tokens),
                           conditioning_mask=token_mask)
        return h + self.ffn(self.ffn_norm(h))


class ModulatedBlock(Block):
    """AdaLN-Zero: ``h + g1 mixer(n(h)(1 + s1) + b1)``, ``h + g2 FFN(n(h)(1 + s2) + b2)``
    with ``(b1, s1, g1, b2, s2, g2) = Linear(SiLU(e))``, the linear zero-initialised so
    every block starts as the identity."""

    def __init__(self, mixer: nn.Module, dim: int, norm: str, ffn_ratio: float, *,
                 gelu: str = "tanh") -> None:
        super().__init__(mixer, dim, norm, ffn_ratio, gelu=gelu)
        self.modulation = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)
        self.modulation._flarepp_custom_init = True

    def forward(self, h, mask=None, context=None):
        mods = self.modulation(nn.functional.silu(context))[:, None]   # [B, 1, 6C]
        shift1, scale1, gate1, shift2, scale2, gate2 = mods.chunk(6, dim=-1)
        h = h + gate1 * self.mixer(self.mixer_norm(h) * (1 + scale1) + shift1, mask=mask)
        return h + gate2 * self.ffn(self.ffn_norm(h) * (1 + scale2) + shift2)


@CONDITIONING.register("cross", doc="Cross FLARE: conditioning tokens in every block's encode")
class CrossConditioner(Conditioner):
    def __init__(self, config: ConditionedConfig) -> None:
        super().__init__()
        self.token_embed = ResidualMLP(config.cond_dim, config.dim, config.dim,
                                       config.io_layers, output_residual=True,
                                       gelu=config.gelu)

    @classmethod
    def check(cls, config):
        if not getattr(MIXERS.get(config.mixer), "takes_conditioning", False):
            known = [n for n in MIXERS.names()
                     if getattr(MIXERS.get(n), "takes_conditioning", False)]
            raise ValueError(f"conditioned: conditioning='cross' needs a mixer that takes "
                             f"conditioning tokens ({', '.join(known)}), got {config.mixer!r}")

    def prepare(self, x_BNI, c_BKF, c_mask_BK):
        tokens = self.token_embed(c_BKF)
        if c_mask_BK is not None:
            tokens = tokens.masked_fill(~c_mask_BK[..., None], 0.0)
        return x_BNI, (tokens, c_mask_BK)

    def make_block(self, config):
        return CrossBlock(_mixer(config), config.dim, config.norm, config.ffn_ratio,
                          gelu=config.gelu)


@CONDITIONING.register("concat", doc="vec(c) appended to the inputs of every point")
class ConcatConditioner(Conditioner):
    def __init__(self, config: ConditionedConfig) -> None:
        super().__init__()

    @staticmethod
    def input_width(config):
        return config.in_dim + config.cond_tokens * config.cond_dim

    def prepare(self, x_BNI, c_BKF, c_mask_BK):
        flat = _flat(c_BKF, c_mask_BK).to(x_BNI.dtype)
        return torch.cat([x_BNI, flat[:, None].expand(-1, x_BNI.shape[1], -1)], dim=-1), None

    def make_block(self, config):
        return PlainBlock(_mixer(config), config.dim, config.norm, config.ffn_ratio,
                          gelu=config.gelu)


@CONDITIONING.register("adaln", doc="AdaLN-Zero modulation of every block by MLP(vec(c))")
class AdaLNConditioner(Conditioner):
    def __init__(self, config: ConditionedConfig) -> None:
        super().__init__()
        self.vector_embed = ResidualMLP(config.cond_tokens * config.cond_dim, config.dim,
                                        config.dim, config.io_layers, output_residual=True,
                                        gelu=config.gelu)

    def prepare(self, x_BNI, c_BKF, c_mask_BK):
        return x_BNI, self.vector_embed(_flat(c_BKF, c_mask_BK))

    def make_block(self, config):
        return ModulatedBlock(_mixer(config), config.dim, config.norm, config.ffn_ratio,
                              gelu=config.gelu)


@MODELS.register("conditioned", doc="backbone conditioned on tokens: Cross FLARE, input "
                                   "concatenation or AdaLN-Zero (transient PDE rollouts)")
class ConditionedSurrogate(nn.Module):
    """``(x [B, N, in_dim], conditioning [B, K, cond_dim]) -> [B, N, out_dim]`` (module doc)."""

    config_cls = ConditionedConfig
    input_kind = "conditioned"  # takes conditioning tokens: not the [B, N, in] contract
    # pointwise outside the mixers' encodes for concat and adaln; cross's mixers
    # (flare-cross, flarepp-cross) declare themselves not shardable (module docstring)
    token_shardable = True

    def __init__(self, config: ConditionedConfig) -> None:
        super().__init__()
        self.config = c = config
        scheme = CONDITIONING.get(c.conditioning)
        self.conditioner = scheme(c)
        self.in_proj = build_input_mlp(c, scheme.input_width(c))
        self.blocks = nn.ModuleList(self.conditioner.make_block(c) for _ in range(c.blocks))
        self.out_norm = make_norm(c.norm, c.dim)
        self.out_proj = build_output_mlp(c)
        init_backbone_weights(self)

    def _check(self, x: torch.Tensor, mask: torch.Tensor | None,
               conditioning: torch.Tensor | None,
               conditioning_mask: torch.Tensor | None) -> None:
        c = self.config
        check_tokens(x, mask, c.in_dim)
        expected = [x.shape[0], c.cond_tokens, c.cond_dim]
        if conditioning is None:
            raise ValueError(f"conditioned: this model takes conditioning tokens [B, K, F] = "
                             f"{expected} (e.g. each sample's conditions) and none were given; "
                             "pass them (conditioning=...)")
        if list(conditioning.shape) != expected:
            raise ValueError(f"conditioned: conditioning must have shape [B, K, F] = "
                             f"{expected}, got {list(conditioning.shape)}")
        if conditioning_mask is not None and conditioning_mask.shape != conditioning.shape[:2]:
            raise ValueError(f"conditioning_mask must have shape {expected[:2]}, got "
                             f"{list(conditioning_mask.shape)}")

    def _embed(self, x: torch.Tensor, mask: torch.Tensor | None, conditioning: torch.Tensor,
               conditioning_mask: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        """``(h_0 [B, N, C], the blocks' context)``, padding zeroed first."""
        self._check(x, mask, conditioning, conditioning_mask)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        inputs, context = self.conditioner.prepare(x, conditioning.to(x.dtype),
                                                   conditioning_mask)
        return self.in_proj(inputs), context

    def _head(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        y = self.out_proj(self.out_norm(h))
        return y if mask is None else y.masked_fill(~mask[..., None], 0.0)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *,
                conditioning: torch.Tensor | None = None,
                conditioning_mask: torch.Tensor | None = None) -> torch.Tensor:
        h, context = self._embed(x, mask, conditioning, conditioning_mask)
        for block in self.blocks:
            h = block(h, mask, context)
        return self._head(h, mask)

    def streaming_refusal(self) -> str | None:
        """Why this model cannot stream or shard its tokens exactly (``cross``), or None."""
        if self.config.conditioning != "cross":
            return None
        return ("conditioning='cross' gathers the conditioning tokens in every encode beside "
                "the mesh's, and the partial encode of each chunk or token shard would count "
                "them once per part, so the model runs whole (the concat and adaln schemes "
                "stream exactly)")

    def streaming_plan(self, conditioning: torch.Tensor | None = None,
                       conditioning_mask: torch.Tensor | None = None) -> StreamingPlan:
        """This forward on the samples of ``conditioning [B, K, F]`` as a
        :class:`~flarepp.models.backbone.StreamingPlan`: ``embed`` prepares each chunk's
        points with the conditions (``concat``: ``[x_n, vec(c)]``), every block gets the
        same context (``adaln``: ``MLP(vec(c))``, computed once); refused for ``cross``."""
        refusal = self.streaming_refusal()
        if refusal is not None:
            raise ValueError(f"conditioned: {refusal}")
        if conditioning is None:
            raise ValueError("conditioned: streaming this model needs its conditioning "
                             "tokens [B, K, F] (conditioning=...)")
        no_points = conditioning.new_zeros((conditioning.shape[0], 0, self.config.in_dim))
        context = self.conditioner.prepare(no_points, conditioning, conditioning_mask)[1]

        def embed(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
            return self._embed(x, mask, conditioning, conditioning_mask)[0]

        def block(layer: nn.Module, h: torch.Tensor, mask: torch.Tensor | None,
                  carry: Any) -> tuple[torch.Tensor, Any]:
            return layer(h, mask, context), carry

        return StreamingPlan(embed=embed, head=self._head,
                             blocks=[functools.partial(block, b) for b in self.blocks])


__all__ = ["CONDITIONING", "ConditionedConfig", "ConditionedSurrogate", "Conditioner"]
