"""GNOT: general neural operator transformer (Hao et al., 2023, Sec. 3) (Table 9).

Shape letters: B batch, N tokens (points), H heads, D head width, C channels, E experts.

* trunk (query points) ``X = MLP_q(pos)``; branch (input function) ``Y = MLP_f(x)``;
* B blocks of heterogeneous normalized attention with geometry-gated experts, each block
  reading a query stream ``X`` and an input stream ``Y``:

  ``U = X + CrossAttn(LN(X), LN(Y))``, ``U <- U + LN(sum_e g_e(pos) FFN1_e(U))``,
  ``U <- U + SelfAttn(LN(U))``,         ``U <- U + LN(sum_e g_e(pos) FFN2_e(U))``;

* head ``Linear -> GELU -> Linear``.

The wiring of the streams is the FLARE study's (``wiring="flare-study"``, the model behind
Table 1's GNOT row): every block's query is the fixed trunk embedding ``X``, and the input
stream is carried, ``Y <- U``, starting from the branch embedding. ``wiring="query-stream"``
is the GNOT release's: the branch ``Y`` is fixed and the query stream is carried,
``X <- U``.

Normalized (linear) attention, per head: ``q~ = softmax_D(q)``, ``k~ = softmax_D(k)``,
``z_t = q~_t + sum_i (q~_t . k~_i) v_i / sum_j (q~_t . k~_j)``, computed as
``q~ (k~^T V) / (q~ . sum_j k~_j) + q~`` in O(N D^2); output projection after. The added
``q~`` is the authors' (HaoZhongkai/GNOT ``models/mmgpt.py``, kept by the FLARE study and
the Neural-Solver-Library). The geometric gate ``g(pos) = softmax_E(GateNet(pos))`` (an MLP
``space_dim -> rC -> rC -> E``) mixes E expert FFNs ``C -> rC -> C`` per point: a soft
domain decomposition. The order of operations and the norm on the expert output follow the
authors' release. Every GELU is the exact one, as in both references. The FLARE study also
adds a learned vector to the branch output; it only reparameterises the branch MLP's output
bias, so it is left out (C parameters fewer).

``pos`` is the first ``space_dim`` input channels (all of them by default). Defaults are
the FLARE study's: C=128, H=8, B=8, MLP ratio 2, 3 experts (about 4.87M parameters; the
study reports 4.88M). Padding points are excluded from every key sum and get zero output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flarepp.mixers.base import check_tokens
from flarepp.models.backbone import ModelConfig, ResidualMLP, init_backbone_weights
from flarepp.models.latent import merge_heads, split_heads
from flarepp.ops import make_norm
from flarepp.validate import require_choice


GNOT_WIRINGS = ("flare-study", "query-stream")


@dataclass(kw_only=True)
class GNOTConfig(ModelConfig):
    """``experts``: E; ``space_dim``: how many leading input channels are coordinates
    (``None``: all ``in_dim``); ``mlp_ratio`` r of the experts and the gate network;
    ``norm`` the type of the five norms per block (LayerNorm in FP32, C.2); ``wiring``
    which stream the blocks carry (see the module docstring)."""

    arch = "gnot"
    positive = ModelConfig.positive + ("experts", "mlp_ratio")

    experts: int = 3
    mlp_ratio: float = 2.0
    space_dim: int | None = None
    wiring: str = "flare-study"

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice(self, "wiring", GNOT_WIRINGS, self.arch)
        if self.space_dim is not None and not 0 < self.space_dim <= self.in_dim:
            raise ValueError(f"gnot: space_dim must be in [1, in_dim={self.in_dim}], "
                             f"got {self.space_dim}")

    @property
    def coordinate_channels(self) -> int:
        return self.in_dim if self.space_dim is None else self.space_dim


class NormalizedAttention(nn.Module):
    """GNOT's normalized linear attention (queries from ``x``, keys/values from ``y``),
    with the softmaxed query added to its output."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query_proj = nn.Linear(dim, dim)
        self.key_proj = nn.Linear(dim, dim)
        self.value_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None
                ) -> torch.Tensor:
        q = split_heads(self.query_proj(x), self.heads).softmax(dim=-1)      # q~ [B,H,N,D]
        k = split_heads(self.key_proj(y), self.heads).softmax(dim=-1)        # k~
        v = split_heads(self.value_proj(y), self.heads)
        if mask is not None:                                                 # drop padding keys
            keep = mask[:, None, :, None].to(k.dtype)
            k, v = k * keep, v * keep
        context = k.transpose(-1, -2) @ v                                    # [B,H,D,D]
        normaliser = q @ k.sum(dim=2, keepdim=True).transpose(-1, -2)        # [B,H,N,1]
        z = (q @ context) / normaliser + q
        return self.out_proj(merge_heads(z))


class GatedExperts(nn.Module):
    """``sum_e g_e FFN_e(x)`` with the gate ``g [B, N, E]`` given."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            for _ in range(experts))

    def forward(self, x: torch.Tensor, gate_BNE: torch.Tensor) -> torch.Tensor:
        out = torch.stack([expert(x) for expert in self.experts], dim=-1)   # [B,N,C,E]
        return (out * gate_BNE.unsqueeze(2)).sum(dim=-1)


class GNOTBlock(nn.Module):
    def __init__(self, c: GNOTConfig) -> None:
        super().__init__()
        hidden = int(c.dim * c.mlp_ratio)
        self.cross_query_norm = make_norm(c.norm, c.dim)
        self.cross_input_norm = make_norm(c.norm, c.dim)
        self.cross_attn = NormalizedAttention(c.dim, c.heads)
        self.experts1 = GatedExperts(c.dim, hidden, c.experts)
        self.experts1_norm = make_norm(c.norm, c.dim)
        self.self_norm = make_norm(c.norm, c.dim)
        self.self_attn = NormalizedAttention(c.dim, c.heads)
        self.experts2 = GatedExperts(c.dim, hidden, c.experts)
        self.experts2_norm = make_norm(c.norm, c.dim)
        self.gate_net = nn.Sequential(
            nn.Linear(c.coordinate_channels, hidden), nn.GELU(),
            nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, c.experts))

    def forward(self, x: torch.Tensor, y: torch.Tensor, pos: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        gate = torch.softmax(self.gate_net(pos), dim=-1)                     # [B, N, E]
        x = x + self.cross_attn(self.cross_query_norm(x), self.cross_input_norm(y), mask)
        x = x + self.experts1_norm(self.experts1(x, gate))
        h = self.self_norm(x)
        x = x + self.self_attn(h, h, mask)
        return x + self.experts2_norm(self.experts2(x, gate))


class GNOT(nn.Module):
    """``[B, N, in_dim] -> [B, N, out_dim]``."""

    config_cls = GNOTConfig

    def __init__(self, config: GNOTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.query_mlp = ResidualMLP(c.coordinate_channels, 2 * c.dim, c.dim, 0,   # trunk
                                     gelu="none")
        self.input_mlp = ResidualMLP(c.in_dim, 2 * c.dim, c.dim, 0, gelu="none")    # branch
        self.blocks = nn.ModuleList(GNOTBlock(c) for _ in range(c.blocks))
        self.head = nn.Sequential(nn.Linear(c.dim, 2 * c.dim), nn.GELU(),
                                  nn.Linear(2 * c.dim, c.out_dim))
        init_backbone_weights(self)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_tokens(x, mask, self.config.in_dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        pos = x[..., :self.config.coordinate_channels]
        trunk, stream = self.query_mlp(pos), self.input_mlp(x)                  # [B, N, C]
        for block in self.blocks:
            if self.config.wiring == "flare-study":
                stream = block(trunk, stream, pos, mask)
            else:
                trunk = block(trunk, stream, pos, mask)
        out = self.head(stream if self.config.wiring == "flare-study" else trunk)
        return out if mask is None else out.masked_fill(~mask[..., None], 0.0)
