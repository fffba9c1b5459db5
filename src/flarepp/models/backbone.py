"""The shared residual surrogate backbone (paper Table 7; FLARE study's input/output MLPs).

``x [B, N, in] -> in_proj -> B x [x + mixer(norm(x)); x + FFN(norm(x))] -> norm -> out_proj``

* ``in_proj``: residual MLP ``in -> C`` with ``io_layers`` hidden residual ``C x C`` layers;
* ``out_proj``: a norm, then a residual MLP ``C -> out`` with ``io_layers`` hidden layers;
* FFN: ``Linear(C, rC) -> GELU -> Linear(rC, C)`` with ``r = ffn_ratio = 2.0``;
* norms: LayerNorm for FP32 runs, RMSNorm for mixed precision (C.2).

GELU is the tanh approximation and plain linears start at ``N(0, 0.02^2)`` with zero bias,
as in the reference implementation; mixer projections keep their near-identity init.

Options of the same backbone (:class:`BackboneConfig`) give the skeleton of the Transolver
family (NVIDIA PhysicsNeMo's ``Transolver`` and its FLARE models): ``input_mlp="wide"``
(``in -> 2C -> C`` without a residual), ``output_mlp="linear"`` (the norm, then one Linear)
and ``gelu="none"`` (the exact GELU); the architecture ``transolver-backbone`` registers
them together (:mod:`flarepp.models`).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import nn

from flarepp.validate import require_choice, require_positive
from flarepp.mixers import Mixer, build_mixer
from flarepp.mixers.base import check_tokens
from flarepp.ops import make_norm


class ResidualMLP(nn.Module):
    """``fc_in -> GELU``, ``hidden_layers`` x ``(h + GELU(fc(h)))``, ``fc_out``.

    ``gelu`` is the GELU's ``approximate`` argument: ``"tanh"`` (the FLARE study's backbone)
    or ``"none"`` (the exact GELU of the LNO and GNOT releases). ``input_residual`` adds the input to the first layer's output (needs ``in == hidden``);
    ``output_residual`` adds the last hidden state to ``fc_out``'s output (``hidden == out``).
    """

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, hidden_layers: int, *,
                 input_residual: bool = False, output_residual: bool = False,
                 gelu: str = "tanh") -> None:
        super().__init__()
        self.fc_in = nn.Linear(in_dim, hidden_dim)
        self.hidden = nn.ModuleList(nn.Linear(hidden_dim, hidden_dim)
                                    for _ in range(hidden_layers))
        self.fc_out = nn.Linear(hidden_dim, out_dim)
        self.act = nn.GELU(approximate=gelu)
        self.input_residual = input_residual and in_dim == hidden_dim
        self.output_residual = output_residual and hidden_dim == out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc_in(x))
        if self.input_residual:
            h = x + h
        for layer in self.hidden:
            h = h + self.act(layer(h))
        out = self.fc_out(h)
        return h + out if self.output_residual else out


class Block(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))``, then ``x + FFN(norm(x))``; the
    FFN's GELU is ``gelu`` (``approximate``: ``"tanh"`` or ``"none"``, the exact one)."""

    def __init__(self, mixer: Mixer, dim: int, norm: str, ffn_ratio: float, *,
                 gelu: str = "tanh") -> None:
        super().__init__()
        hidden = int(dim * ffn_ratio)
        self.mixer_norm = make_norm(norm, dim)
        self.mixer = mixer
        self.ffn_norm = make_norm(norm, dim)
        self.ffn = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate=gelu),
                                 nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x), mask=mask)
        return x + self.ffn(self.ffn_norm(x))


@dataclass(kw_only=True)
class StackConfig:
    """Settings every architecture shares (Table 7: C=128, H=8; Table 8: B blocks).

    A subclass names its architecture in ``arch`` (the :data:`~flarepp.models.MODELS` key
    that ``to_dict`` writes and ``model_from_config`` reads back) and may extend
    ``positive``, the fields that must be positive numbers. ``dim`` must divide into
    ``heads`` heads of width D = C / H.
    """

    arch: ClassVar[str] = ""
    positive: ClassVar[tuple[str, ...]] = ("dim", "heads", "blocks")

    dim: int = 128
    heads: int = 8
    blocks: int = 8
    norm: str = "layernorm"

    def __post_init__(self) -> None:
        require_positive(self, self.positive, self.arch)
        if self.dim % self.heads:
            raise ValueError(f"{self.arch}: dim={self.dim} must be divisible by "
                             f"heads={self.heads}")

    def to_dict(self) -> dict[str, Any]:
        return {"arch": self.arch, **asdict(self)}


@dataclass(kw_only=True)
class ModelConfig(StackConfig):
    """A point-cloud architecture: ``in_dim`` input and ``out_dim`` output channels per
    point."""

    positive = ("in_dim", "out_dim", *StackConfig.positive)

    in_dim: int
    out_dim: int


@dataclass(kw_only=True)
class SequenceStackConfig(StackConfig):
    """A stack of pre-norm blocks around a registered ``mixer`` (with ``latents``,
    ``attn_scale`` and ``mixer_options``) and a GELU FFN of ratio ``ffn_ratio``, over token
    sequences: the decoder LM and the LRA classifier."""

    positive = (*StackConfig.positive, "latents", "ffn_ratio")

    mixer: str = "flarepp"
    latents: int = 64
    ffn_ratio: float = 2.0
    attn_scale: float | None = None
    mixer_options: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class LatentModelConfig(ModelConfig):
    """An architecture with a budget of M latents (queries, inducing points, modes) and
    SDPA calls of scale ``attn_scale`` (``None``: ``1/sqrt(D)``)."""

    positive = ModelConfig.positive + ("latents",)

    latents: int = 64
    attn_scale: float | None = None


INPUT_MLPS = ("residual", "wide")
OUTPUT_MLPS = ("residual", "linear")
GELUS = ("tanh", "none")


@dataclass(kw_only=True)
class BackboneConfig(LatentModelConfig):
    """The residual backbone's block and input/output MLP settings (Table 7): FFN ratio
    ``ffn_ratio`` and ``io_layers`` hidden residual layers per input/output MLP.

    ``input_mlp``: ``residual`` (Table 7: ``in -> C``, ``io_layers`` hidden residual
    ``C x C`` layers, the last hidden state added to the output) or ``wide`` (the Transolver
    family's preprocessing: ``in -> 2C -> C`` with ``io_layers`` hidden residual ``2C x 2C``
    layers and no residual around the output); ``output_mlp``: ``residual`` (Table 7) or
    ``linear`` (one ``Linear(C, out)`` after the final norm; ``io_layers`` does not apply
    to it); ``gelu``: the ``approximate`` of every GELU in the input and output MLPs and
    the FFNs, ``tanh`` (the FLARE study's) or ``none`` (the exact GELU).
    """

    positive = LatentModelConfig.positive + ("ffn_ratio",)

    ffn_ratio: float = 2.0
    io_layers: int = 2
    input_mlp: str = "residual"
    output_mlp: str = "residual"
    gelu: str = "tanh"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, choices in (("input_mlp", INPUT_MLPS), ("output_mlp", OUTPUT_MLPS),
                              ("gelu", GELUS)):
            require_choice(self, name, choices, self.arch)


def build_input_mlp(c: BackboneConfig, in_dim: int) -> nn.Module:
    """The input MLP ``[.., in_dim] -> [.., C]`` that ``c.input_mlp`` names."""
    if c.input_mlp == "wide":
        return ResidualMLP(in_dim, 2 * c.dim, c.dim, c.io_layers, gelu=c.gelu)
    return ResidualMLP(in_dim, c.dim, c.dim, c.io_layers, output_residual=True, gelu=c.gelu)


def build_output_mlp(c: BackboneConfig) -> nn.Module:
    """The output MLP ``[.., C] -> [.., out]`` (after the final norm) ``c.output_mlp``
    names."""
    if c.output_mlp == "linear":
        return nn.Linear(c.dim, c.out_dim)
    return ResidualMLP(c.dim, c.dim, c.out_dim, c.io_layers, input_residual=True, gelu=c.gelu)


@dataclass(kw_only=True)
class SurrogateConfig(BackboneConfig):
    """Backbone settings; defaults are the paper's (Tables 7-8, Elasticity)."""

    arch = "surrogate"

    mixer: str = "flarepp"
    mixer_options: dict[str, Any] = field(default_factory=dict)


def init_backbone_weights(module: nn.Module) -> None:
    """Reference-implementation init for plain linears and norms."""
    for m in module.modules():
        if isinstance(m, nn.Linear) and not getattr(m, "_flarepp_custom_init", False):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            if m.weight is not None:
                nn.init.ones_(m.weight)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


@dataclass(frozen=True)
class StreamingPlan:
    """A model's forward as token-pointwise stages around its residual blocks.

    ``y = head(h_L)``, ``(h_{l+1}, p_{l+1}) = blocks[l](h_l, mask, p_l)``,
    ``h_0 = embed(x, mask)``, ``p_0 = initial_carry(B)``: ``embed`` and ``head`` act on each
    token alone; a block mixes tokens only through its mixers' ``backend.encode``; ``p`` is
    state that is the same for every token (``None`` for the backbone, Luna's packed stream
    ``[B, M, C]``) and that a block updates from its encodes alone. Under that contract
    :func:`flarepp.distributed.stream_forward` runs the forward block by block over token
    chunks, exactly.
    """

    embed: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    blocks: Sequence[Callable[[torch.Tensor, torch.Tensor | None, Any],
                              tuple[torch.Tensor, Any]]]
    head: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    initial_carry: Callable[[int], Any] = lambda batch: None


def _carry_through(block: nn.Module, h: torch.Tensor, mask: torch.Tensor | None,
                   carry: Any) -> tuple[torch.Tensor, Any]:
    return block(h, mask), carry


class SurrogateModel(nn.Module):
    """Residual surrogate ``[B, N, in_dim] -> [B, N, out_dim]`` around one mixer type."""

    config_cls = SurrogateConfig
    token_shardable = True  # pointwise io MLPs, norms and FFNs around the mixers (B.4)

    def __init__(self, config: SurrogateConfig) -> None:
        super().__init__()
        self.config = c = config
        self.in_proj = build_input_mlp(c, c.in_dim)
        self.blocks = nn.ModuleList(self.make_block() for _ in range(c.blocks))
        for index, block in enumerate(self.blocks):   # a mixer that draws noise per block
            if hasattr(getattr(block, "mixer", None), "noise_stream"):
                block.mixer.noise_stream = index
        self.out_norm = make_norm(c.norm, c.dim)
        self.out_proj = build_output_mlp(c)
        init_backbone_weights(self)

    def make_block(self) -> nn.Module:
        """One residual block; architectures that replace the block override this."""
        c = self.config
        mixer = build_mixer(c.mixer, dim=c.dim, heads=c.heads, latents=c.latents, norm=c.norm,
                            attn_scale=c.attn_scale, **c.mixer_options)
        return Block(mixer, c.dim, c.norm, c.ffn_ratio, gelu=c.gelu)

    def embed(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``in_proj`` of the inputs, padding zeroed first: ``[B, N, in] -> [B, N, C]``."""
        check_tokens(x, mask, self.config.in_dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        return self.in_proj(x)

    def head(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``out_proj(norm(h))``, zero at padding: ``[B, N, C] -> [B, N, out]``."""
        y = self.out_proj(self.out_norm(h))
        if mask is not None:
            y = y.masked_fill(~mask[..., None], 0.0)
        return y

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(x, mask)
        for block in self.blocks:
            h = block(h, mask)
        return self.head(h, mask)

    def streaming_plan(self) -> StreamingPlan:
        """This forward as a :class:`StreamingPlan` (a subclass that changes the forward
        overrides this too)."""
        return StreamingPlan(embed=self.embed, head=self.head,
                             blocks=[functools.partial(_carry_through, b) for b in self.blocks])


TRANSOLVER_BACKBONE = dict(input_mlp="wide", output_mlp="linear", gelu="none", io_layers=0,
                           dim=256, blocks=4, latents=32, ffn_ratio=4.0, mixer="flare",
                           attn_scale=1.0)
"""The Transolver family's skeleton and NVIDIA PhysicsNeMo's FLARE model's defaults
(``physicsnemo.models.flare.FLARE``, release 2.2): input MLP ``in -> 2C -> C``, FFN ratio 4
with the exact GELU, the final norm and one Linear, the FLARE mixer with SDPA scale 1,
C = 256, 4 blocks, M = 32: the registered defaults of ``transolver-backbone``."""


@dataclass(kw_only=True)
class TransolverBackboneConfig(SurrogateConfig):
    """:class:`SurrogateConfig` under the name ``transolver-backbone``, whose registered
    defaults are :data:`TRANSOLVER_BACKBONE`."""

    arch = "transolver-backbone"


class TransolverBackbone(SurrogateModel):
    """:class:`SurrogateModel` built from a :class:`TransolverBackboneConfig`."""

    config_cls = TransolverBackboneConfig


def compile_model(model: nn.Module, **compile_options: Any) -> nn.Module:
    """``torch.compile`` a model in place, one residual block at a time; returns ``model``.

    Every element of a ``ModuleList`` child (the blocks) and every other direct child (the
    input and output MLPs, the final norm) is compiled on its own: the blocks share their
    code, so one compiled graph serves all of them and compile time does not grow with
    depth. Parameters, state dict and math are unchanged; inductor only fuses the
    execution (the pointwise work around the GEMMs and SDPA calls, the per-head norms).
    ``compile_options`` go to ``torch.compile`` (e.g. ``mode="max-autotune"``). On CPU
    inductor needs a C++ compiler; the first step then takes minutes.
    """
    for child in model.children():
        for unit in (child if isinstance(child, nn.ModuleList) else [child]):
            unit.compile(**compile_options)
    return model
