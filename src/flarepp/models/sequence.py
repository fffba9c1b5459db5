"""Sequence classification on Long Range Arena (paper Section 4.3 and D.5, Table 12).

Shape letters: B batch, N tokens, C width, W pooled width (C, or C times the number of
tower features), K classes, V vocabulary.

The FLARE study's LRA model (its ``lra/models/wrapper.py``) around any registered mixer::

    h_0 = Embed(tokens)                                   [B, N, C]   (CLS token prepended)
    h_l = Block_l(h_{l-1} + P, mask),  l = 1..L           P: positional embedding [N, C]
    z   = Pool(FinalNorm(h_L), mask)                      [B, C]
    logits = Head(Norm(z))                                [B, K]

* the positional embedding ``P`` is added **before every block**, as the reference does
  (not once at the input); ``learned`` is a table of ``max_length`` vectors (the
  reference's default ``abs``), ``sinusoidal`` the fixed sin/cos table of Vaswani et al.
  times a learned scalar that starts at ``C**-0.5`` (the reference's ``sin``);
* blocks are the backbone's pre-norm residual blocks
  ``h + mixer(norm(h), mask)``, then ``h + FFN(norm(h))`` with a GELU FFN of hidden width
  ``ffn_ratio * C`` (the reference's MLP ratio);
* pooling over the real tokens only: ``mean`` and ``max`` (then the final norm before
  pooling and a second norm after it, as in the reference), or ``cls``: a learned token
  prepended to the sequence whose output is the summary (no norm, as in the reference);
* head: ``mlp`` = ``Linear(W, W) -> GELU -> Linear(W, K)`` (the reference's head for Text,
  Image and Pathfinder) or ``linear`` = ``Linear(W, K)`` (its head for ListOps, Retrieval);
* two towers (Retrieval, the AAN matching task): both documents go through the same
  encoder (shared weights), are pooled to ``u`` and ``v``, and combined by ``concat``
  ``[u, v]`` (the reference) or ``lra`` ``[u, v, u * v, u - v]`` (the LRA paper's dual
  encoder, Tay et al. 2021) before the head.

Padding never reaches a logit: masked tokens are zeroed after the embedding, every mixer
ignores them (the mixer contract), the FFN and norms act per token, and pooling reads real
tokens only. The reference instead pools over its fixed-length padding as if it were text.
Each sequence must hold at least one real token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from flarepp.mixers import build_mixer
from flarepp.models.backbone import Block, SequenceStackConfig, init_backbone_weights
from flarepp.ops import make_norm

# -- positional embeddings: h + P[:N] ------------------------------------------------------

class NoPositions(nn.Module):
    """No positional embedding (the mixer alone must supply any order information)."""

    def __init__(self, max_positions: int, dim: int) -> None:
        super().__init__()

    def forward(self, h_BNC: torch.Tensor) -> torch.Tensor:
        return h_BNC


class LearnedPositions(nn.Module):
    """``h + P[:N]`` with ``P [max_positions, C]`` learned, initialised ``N(0, 0.02^2)``."""

    def __init__(self, max_positions: int, dim: int) -> None:
        super().__init__()
        self.table = nn.Embedding(max_positions, dim)
        nn.init.normal_(self.table.weight, std=0.02)

    def forward(self, h_BNC: torch.Tensor) -> torch.Tensor:
        return h_BNC + self.table.weight[: h_BNC.shape[1]].to(h_BNC.dtype)


class SinusoidalPositions(nn.Module):
    """``h + s P[:N]``: ``P[n, 2i] = sin(n w_i)``, ``P[n, 2i+1] = cos(n w_i)``,
    ``w_i = 10000^(-2i/C)`` (Vaswani et al. 2017), ``s`` learned from ``C**-0.5``."""

    def __init__(self, max_positions: int, dim: int) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"sinusoidal positions need an even width, got dim={dim}")
        position = torch.arange(max_positions, dtype=torch.float64)[:, None]
        frequency = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64)
                              * (-math.log(10000.0) / dim))
        table = torch.zeros(max_positions, dim, dtype=torch.float64)
        table[:, 0::2] = torch.sin(position * frequency)
        table[:, 1::2] = torch.cos(position * frequency)
        self.register_buffer("table", table.float(), persistent=False)
        self.scale = nn.Parameter(torch.tensor(dim ** -0.5))

    def forward(self, h_BNC: torch.Tensor) -> torch.Tensor:
        return h_BNC + (self.scale * self.table[: h_BNC.shape[1]]).to(h_BNC.dtype)


POSITIONAL: dict[str, type[nn.Module]] = {
    "learned": LearnedPositions,
    "sinusoidal": SinusoidalPositions,
    "none": NoPositions,
}


# -- pooling over real tokens --------------------------------------------------------------

def masked_mean(h_BNC: torch.Tensor, mask_BN: torch.Tensor | None) -> torch.Tensor:
    """``sum_n m_n h_n / sum_n m_n`` (plain mean without a mask)."""
    if mask_BN is None:
        return h_BNC.mean(dim=1)
    weight_BN1 = mask_BN[..., None].to(h_BNC.dtype)
    return (h_BNC * weight_BN1).sum(dim=1) / weight_BN1.sum(dim=1)


def masked_max(h_BNC: torch.Tensor, mask_BN: torch.Tensor | None) -> torch.Tensor:
    """Channel-wise max over the real tokens."""
    if mask_BN is not None:
        h_BNC = h_BNC.masked_fill(~mask_BN[..., None], float("-inf"))
    return h_BNC.amax(dim=1)


def first_token(h_BNC: torch.Tensor, mask_BN: torch.Tensor | None) -> torch.Tensor:
    """The output at position 0: the prepended CLS token."""
    return h_BNC[:, 0]


@dataclass(frozen=True)
class Pooling:
    """A pooling rule: its reduction, whether it needs a CLS token, whether it is normed
    (the reference norms before and after mean/max pooling and never around CLS)."""

    reduce: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    prepends_cls: bool
    normed: bool


POOLINGS: dict[str, Pooling] = {
    "mean": Pooling(masked_mean, prepends_cls=False, normed=True),
    "max": Pooling(masked_max, prepends_cls=False, normed=True),
    "cls": Pooling(first_token, prepends_cls=True, normed=False),
}


# -- two-tower combination and heads ------------------------------------------------------

def concat_towers(u_BC: torch.Tensor, v_BC: torch.Tensor) -> torch.Tensor:
    """``[u, v]``, the FLARE study's Retrieval combination."""
    return torch.cat([u_BC, v_BC], dim=-1)


def lra_towers(u_BC: torch.Tensor, v_BC: torch.Tensor) -> torch.Tensor:
    """``[u, v, u * v, u - v]``, the LRA paper's dual-encoder combination."""
    return torch.cat([u_BC, v_BC, u_BC * v_BC, u_BC - v_BC], dim=-1)


TOWER_COMBINES: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], int]] = {
    "concat": (concat_towers, 2),
    "lra": (lra_towers, 4),
}


def mlp_head(width: int, classes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, classes))


def linear_head(width: int, classes: int) -> nn.Module:
    return nn.Linear(width, classes)


HEADS: dict[str, Callable[[int, int], nn.Module]] = {"mlp": mlp_head, "linear": linear_head}


def _require_choice(kind: str, value: str, choices: dict) -> None:
    if value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; known {kind}s: {', '.join(sorted(choices))}")


@dataclass(kw_only=True)
class SequenceClassifierConfig(SequenceStackConfig):
    """Settings of :class:`SequenceClassifier`; ``max_length`` bounds N per document
    (without the CLS token), ``ffn_ratio`` is the reference's MLP ratio."""

    arch = "sequence-classifier"
    positive = (*SequenceStackConfig.positive, "vocab_size", "max_length")

    vocab_size: int
    num_classes: int
    max_length: int
    blocks: int = 4
    latents: int = 128
    ffn_ratio: float = 4.0
    pooling: str = "mean"
    positional: str = "learned"
    head: str = "mlp"
    two_tower: bool = False
    tower_combine: str = "concat"
    embedding_dropout: float = 0.0
    head_dropout: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_classes < 2:
            raise ValueError(f"sequence-classifier: num_classes must be >= 2, "
                             f"got {self.num_classes}")
        _require_choice("pooling", self.pooling, POOLINGS)
        _require_choice("positional embedding", self.positional, POSITIONAL)
        _require_choice("head", self.head, HEADS)
        _require_choice("tower combination", self.tower_combine, TOWER_COMBINES)


def check_token_ids(tokens: torch.Tensor, mask: torch.Tensor | None, max_length: int,
                    what: str = "tokens") -> None:
    """Raise a ``ValueError`` that says what was expected for bad ``tokens`` or ``mask``."""
    if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{what} must be integer token ids [B, N] (int64 or int32), got "
                         f"{tokens.dtype} of shape {list(tokens.shape)}")
    if tokens.shape[1] > max_length:
        raise ValueError(f"{what} has N={tokens.shape[1]} tokens but the model was built for "
                         f"max_length={max_length}")
    if mask is None:
        return
    if mask.dtype != torch.bool or mask.shape != tokens.shape:
        raise ValueError(f"mask of {what} must be bool [B, N] = {list(tokens.shape)} "
                         f"(True = real token), got {mask.dtype} {list(mask.shape)}")


class SequenceClassifier(nn.Module):
    """Token ids ``[B, N]`` (and a mask) -> class logits ``[B, K]``; see the module doc.

    ``forward(tokens, mask=None, tokens_1=None, mask_1=None)``: the ``_1`` arguments are
    the second document of a two-tower model (Retrieval) and are required exactly then.
    """

    config_cls = SequenceClassifierConfig
    input_kind = "tokens"  # not a point cloud: the [B, N, in] model contract does not apply
    permutation_equivariant = False

    def __init__(self, config: SequenceClassifierConfig) -> None:
        super().__init__()
        self.config = c = config
        self.pooling = POOLINGS[c.pooling]
        positions = c.max_length + int(self.pooling.prepends_cls)
        self.token_embedding = nn.Embedding(c.vocab_size, c.dim)
        self.embedding_dropout = nn.Dropout(c.embedding_dropout)
        self.cls_token = (nn.Parameter(torch.zeros(c.dim)) if self.pooling.prepends_cls
                          else None)
        self.positions = POSITIONAL[c.positional](positions, c.dim)
        self.blocks = nn.ModuleList(self.make_block() for _ in range(c.blocks))
        self.final_norm = make_norm(c.norm, c.dim) if self.pooling.normed else nn.Identity()
        combine, factor = TOWER_COMBINES[c.tower_combine]
        self.combine = combine if c.two_tower else None
        width = c.dim * (factor if c.two_tower else 1)
        self.head_dropout = nn.Dropout(c.head_dropout)
        self.pooled_norm = make_norm(c.norm, width) if self.pooling.normed else nn.Identity()
        self.head = HEADS[c.head](width, c.num_classes)
        init_backbone_weights(self)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        if self.cls_token is not None:
            nn.init.trunc_normal_(self.cls_token, std=0.02)

    def make_block(self) -> nn.Module:
        c = self.config
        mixer = build_mixer(c.mixer, dim=c.dim, heads=c.heads, latents=c.latents, norm=c.norm,
                            attn_scale=c.attn_scale, **c.mixer_options)
        return Block(mixer, c.dim, c.norm, c.ffn_ratio)

    def encode(self, tokens: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """One tower: token ids ``[B, N]`` -> pooled summary ``[B, C]``."""
        h_BNC = self.embedding_dropout(self.token_embedding(tokens))
        if mask is not None:
            h_BNC = h_BNC.masked_fill(~mask[..., None], 0.0)
        if self.cls_token is not None:
            B = h_BNC.shape[0]
            cls_B1C = self.cls_token.to(h_BNC.dtype).expand(B, 1, -1)
            h_BNC = torch.cat([cls_B1C, h_BNC], dim=1)
            if mask is not None:
                mask = torch.cat([mask.new_ones(B, 1), mask], dim=1)
        for block in self.blocks:
            h_BNC = block(self.positions(h_BNC), mask)
        return self.pooling.reduce(self.final_norm(h_BNC), mask)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None,
                tokens_1: torch.Tensor | None = None,
                mask_1: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        check_token_ids(tokens, mask, c.max_length)
        if c.two_tower != (tokens_1 is not None):
            raise ValueError("a two-tower model takes both documents (tokens, tokens_1); a "
                             f"one-tower model only tokens (two_tower={c.two_tower})")
        if tokens_1 is None:
            if mask_1 is not None:
                raise ValueError("mask_1 given without tokens_1")
            z_BW = self.encode(tokens, mask)
        else:
            check_token_ids(tokens_1, mask_1, c.max_length, what="tokens_1")
            if tokens_1.shape[0] != tokens.shape[0]:
                raise ValueError(f"the two documents disagree on the batch size: "
                                 f"{tokens.shape[0]} vs {tokens_1.shape[0]}")
            z_BW = self.combine(*self.encode_pair(tokens, mask, tokens_1, mask_1))
        return self.head(self.pooled_norm(self.head_dropout(z_BW)))

    def encode_pair(self, tokens: torch.Tensor, mask: torch.Tensor | None,
                    tokens_1: torch.Tensor, mask_1: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both documents through the shared encoder in one call: padded to a common N
        and stacked along the batch, ``[2B, N]`` -> ``u, v [B, C]``."""
        B = tokens.shape[0]
        n = max(tokens.shape[1], tokens_1.shape[1])
        both, masks = [], []
        for ids, m in ((tokens, mask), (tokens_1, mask_1)):
            if m is None:
                m = torch.ones_like(ids, dtype=torch.bool)
            pad = n - ids.shape[1]
            both.append(nn.functional.pad(ids, (0, pad)))
            masks.append(nn.functional.pad(m, (0, pad), value=False))
        z_2BC = self.encode(torch.cat(both), torch.cat(masks))
        return z_2BC[:B], z_2BC[B:]


__all__ = [
    "POOLINGS",
    "POSITIONAL",
    "TOWER_COMBINES",
    "SequenceClassifier",
    "SequenceClassifierConfig",
]
