"""FLARE, FLARE++, simplified FLARE++ and FLARE++ v1 (paper Table 2, Appendix A).

Per head h, with X the (pre-normed) block input, every projection a plain linear map
initialised near the identity (A.5), and N_a / N_0 per-head norms over D with / without a
learned scale:

* FLARE: ``K = X W_K``, ``V = X W_V``, learned ``Q_f``; ``Z = SDPA(Q_f, K, V)``,
  ``Y = SDPA(K, Q_f, Z)``, output ``Y W_O``. Parameters ``3C^2 + MC``.
* FLARE++ (v2, the default): synthesis keys ``K~ = N_0(X W~_K)`` shared as synthesis
  values; ``Q_d = SDPA(N_a(Q~), K~, K~)``; routing query
  ``Q = N_0(Q_f) + sigmoid(gamma_h) Q_d`` summed in FP32, ``gamma_h`` initialised at 0.25;
  routing keys ``K = N_a(X W_K)``; then FLARE's encode/decode with Q. ``4C^2 + 2MC + H``.
* Simplified FLARE++ (A.8): ``Q = SDPA(N_a(Q~), N_a(X W~_K), X W~_V)``; no fixed query,
  no gate, no routing-key norm. ``5C^2 + MC``.
* FLARE++ v1 (paper v1, Sec. 3): as simplified but without any norm.

The induced token-to-token routing matrix ``softmax_M(s K Q^T) softmax_N(s Q K^T)`` has
rank at most M per head; it is never formed: three (FLARE: two) fused SDPA calls apply it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
from torch import nn

from flarepp.mixers.base import (Mixer, MixerConfig, check_tokens, init_latents,
                                 near_identity_linear, zero_masked)
from flarepp.mixers.registry import MIXERS
from flarepp.ops import HeadNorm


class LowRankRouting(Mixer, abc.ABC):
    """What the FLARE family shares: ``Y_h = SDPA(K_h, Q_h, SDPA(Q_h, K_h, V_h))``, ``Y W_O``.

    A subclass owns ``key_value_proj`` (its ``k`` stacked ``C x C`` input projections) and
    ``out_proj`` (``W_O``), and says how the tokens become the routing queries
    ``Q [B, H, M, D]`` (:meth:`route_queries`) and the routing keys and values
    ``K, V [B, H, N, D]`` (:meth:`keys_and_values`); the encode
    (``Z = softmax_N(s Q K^T) V``) and decode (``Y = softmax_M(s K Q^T) Z``), the masking and
    the output projection are the same for every member.

    Projections are computed on demand from rows of ``key_value_proj`` (:meth:`project`),
    and an encode that the backend already holds
    (:meth:`~flarepp.ops.AttentionBackend.held_encode`: the later passes of block-wise
    streaming) has its keys and values skipped: such a pass projects only what its own
    encode and the decode read.
    """

    key_value_proj: nn.Linear
    out_proj: nn.Linear

    @abc.abstractmethod
    def route_queries(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``Q [B, H, M, D]`` for the (masked) tokens ``x [B, N, C]``."""

    @abc.abstractmethod
    def keys_and_values(self, x: torch.Tensor, *, values: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(K, V)`` ``[B, H, N, D]``; ``V`` is ``None`` unless ``values``."""

    def project(self, x_BNC: torch.Tensor, first: int, count: int = 1) -> torch.Tensor:
        """Stacked projections ``first .. first + count - 1`` of ``key_value_proj`` in one
        GEMM, ``[B, N, count * C]``."""
        C, weight, bias = self.config.dim, self.key_value_proj.weight, self.key_value_proj.bias
        rows = slice(first * C, (first + count) * C)
        return nn.functional.linear(x_BNC, weight[rows], None if bias is None else bias[rows])

    def route(self, x: torch.Tensor, mask: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(Q, K, Z)``: routing queries and keys and the encode ``Z [B, H, M, D]``; the
        values are projected only when the backend does not already hold ``Z``."""
        queries = self.route_queries(x, mask)
        latents = self.backend.held_encode(queries)
        keys, values = self.keys_and_values(x, values=latents is None)
        if latents is None:
            latents = self.backend.encode(queries, keys, values, mask,
                                          scale=self.config.attn_scale)
        return queries, keys, latents

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_tokens(x, mask, self.config.dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        queries, keys, latents = self.route(x, mask)                            # Z [B,H,M,D]
        y = self.decode_tokens(keys, queries, latents, mask)                    # [B,H,N,D]
        return zero_masked(self.out_proj(self.merge_heads(y)), mask)

    def decode_tokens(self, keys: torch.Tensor, queries: torch.Tensor, latents: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
        """``Y = softmax_M(s K Q^T) Z`` through the backend (a variant may change the
        decode logits here, e.g. a per-latent offset)."""
        return self.backend.decode(keys, queries, latents, mask, scale=self.config.attn_scale)


@MIXERS.register("flare", doc="FLARE: fixed learned routing queries (Table 2, column FLARE)")
class FLARE(LowRankRouting):
    """Fixed-query low-rank attention: ``Y_h = SDPA(K_h, Q_h, SDPA(Q_h, K_h, V_h))``."""

    token_shardable = True  # one encode per block (B.4)

    def __init__(self, config: MixerConfig) -> None:
        super().__init__(config)
        c = config
        # Q_f [H, M, D] ~ N(0, 0.1^2) as in the FLARE study's public code (vpuri3/FLARE.py);
        # FLARE++ keeps its reference implementation's N(0, 0.02^2) for Q_f and the seeds.
        self.fixed_queries = init_latents((c.heads, c.latents, c.head_dim), std=0.1)
        self.key_value_proj = near_identity_linear(c.dim, 2)                 # [W_K | W_V]
        self.out_proj = near_identity_linear(c.dim)                          # W_O

    def route_queries(self, x, mask):
        return self.latents_for(self.fixed_queries, x.shape[0])

    def keys_and_values(self, x, *, values):
        if not values:
            return self.split_projections(self.project(x, 0), 1)[0], None
        # [W_K | W_V] in one GEMM, split as views: the training path.
        return self.split_projections(self.project(x, 0, 2), 2)


GATE_SUMS = ("float32-or-wider", "float32")


@dataclass(kw_only=True)
class FLAREPPConfig(MixerConfig):
    """FLARE++ settings beyond the shared ones: the gate logits' initial value (A.4) and
    the precision of the gated sum ``N_0(Q_f) + sigmoid(gamma) Q_d``: ``float32-or-wider``
    (flarepp's: FP32 under autocast, the compute dtype when wider) or ``float32`` (the
    FLARE authors' code, github.com/vpuri3/FLARE.py ``FLAREPPMixer``: rounded to FP32
    whatever the dtype, which an imported model keeps to compute their function exactly in
    float64)."""

    gate_logit_init: float = 0.25
    gate_sum: str = "float32-or-wider"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gate_sum not in GATE_SUMS:
            raise ValueError(f"gate_sum must be one of {', '.join(GATE_SUMS)}, got "
                             f"{self.gate_sum!r}")


@MIXERS.register("flarepp", doc="FLARE++: attention-synthesized routing queries (Table 2)")
class FLAREPP(LowRankRouting):
    """FLARE++ (paper v2): routing queries synthesized from the input by one extra encode.

    ``Q_h(X) = N_0(Q_f,h) + sigmoid(gamma_h) SDPA(N_a(Q~_h), K~_h, K~_h)`` with
    ``K~_h = N_0(X W~_K,h)`` (A.1, A.3, A.4, A.6); the gated sum is accumulated in FP32
    even under autocast, then used in FLARE's encode and decode with ``K_h = N_a(X W_K,h)``.
    """

    config_cls = FLAREPPConfig
    token_shardable = True  # two encodes per block: synthesis, then gather

    def __init__(self, config: FLAREPPConfig) -> None:
        super().__init__(config)
        c = config
        self.synthesis_seeds = init_latents((c.heads, c.latents, c.head_dim))  # Q~ [H, M, D]
        self.fixed_queries = init_latents((c.heads, c.latents, c.head_dim))    # Q_f [H, M, D]
        self.gate_logit = nn.Parameter(torch.full((c.heads,), float(c.gate_logit_init)))
        # The synthesis keys', routing keys' and values' projections: [W~_K | W_K | W_V].
        self.key_value_proj = near_identity_linear(c.dim, 3)
        self.out_proj = near_identity_linear(c.dim)
        self.seed_norm = HeadNorm(c.norm, c.head_dim, affine=True)            # N_a
        self.synthesis_key_norm = HeadNorm(c.norm, c.head_dim, affine=False)  # N_0
        self.fixed_query_norm = HeadNorm(c.norm, c.head_dim, affine=False)    # N_0
        self.routing_key_norm = HeadNorm(c.norm, c.head_dim, affine=True)     # N_a

    def routing_queries(self, synthesis_keys: torch.Tensor, mask: torch.Tensor | None,
                        batch: int) -> torch.Tensor:
        """``Q = N_0(Q_f) + sigmoid(gamma) Q_d`` in FP32, returned in the compute dtype."""
        seeds = self.normed_seeds(batch)
        return self.gated_queries(self.backend.encode(seeds, synthesis_keys, synthesis_keys,
                                                      mask, scale=self.config.attn_scale))

    def normed_seeds(self, batch: int) -> torch.Tensor:
        """``N_a(Q~)`` ``[B, H, M, D]``."""
        # N_a acts per latent, so normalising the [H, M, D] seeds once and then expanding
        # over the batch is the same map as normalising the expanded copies.
        return self.latents_for(self.seed_norm(self.synthesis_seeds), batch)

    def gated_queries(self, synthesized: torch.Tensor) -> torch.Tensor:
        """``N_0(Q_f) + sigmoid(gamma) Q_d`` summed in FP32 (or wider, ``gate_sum``), in
        ``Q_d``'s dtype."""
        fixed = self.fixed_query_norm(self.fixed_queries)                          # [H, M, D]
        if self.config.gate_sum == "float32":   # the authors' rounding (FLAREPPConfig)
            acc = torch.float32
            gate = torch.sigmoid(self.gate_logit).to(acc)
        else:
            acc = torch.promote_types(self.gate_logit.dtype, torch.float32)  # FP32 or wider
            gate = torch.sigmoid(self.gate_logit.to(acc))
        gate = gate.view(1, -1, 1, 1)
        queries = fixed.to(acc).unsqueeze(0) + gate * synthesized.to(acc)
        return queries.to(synthesized.dtype)

    def route(self, x, mask):
        if not torch.is_grad_enabled():  # inference, streaming: projections on demand
            return super().route(x, mask)
        # Training: [W~_K | W_K | W_V] in one GEMM, whose backward is one GEMM too; at 2
        # threads this measured faster than three separate projections.
        synthesis_keys, keys, values = self.split_projections_BNHD(self.project(x, 0, 3), 3)
        synthesis_keys = self.heads_first(self.synthesis_key_norm(synthesis_keys))
        queries = self.routing_queries(synthesis_keys, mask, x.shape[0])
        keys = self.heads_first(self.routing_key_norm(keys))
        latents = self.backend.encode(queries, keys, self.heads_first(values), mask,
                                      scale=self.config.attn_scale)
        return queries, keys, latents

    def route_queries(self, x, mask):
        seeds = self.normed_seeds(x.shape[0])
        synthesized = self.backend.held_encode(seeds)                               # Q_d
        if synthesized is None:
            synthesis_keys = self.heads_first(self.synthesis_key_norm(self._heads(x, 0)))
            synthesized = self.backend.encode(seeds, synthesis_keys, synthesis_keys, mask,
                                              scale=self.config.attn_scale)
        return self.gated_queries(synthesized)

    def keys_and_values(self, x, *, values):
        keys = self.heads_first(self.routing_key_norm(self._heads(x, 1)))
        return keys, (self.heads_first(self._heads(x, 2)) if values else None)

    def _heads(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Projection ``index`` alone, ``[B, N, H, D]`` contiguous: the per-head norms act
        on D alone, so they read the GEMM's rows without a copy (forward or backward)."""
        (projected,) = self.split_projections_BNHD(self.project(x, index), 1)
        return projected


@dataclass(kw_only=True)
class SynthesizedQueryConfig(MixerConfig):
    """``normalize_synthesis``: N_a on the seeds and synthesis keys (A.8) or no norm (v1)."""

    normalize_synthesis: bool = True


class SynthesizedQueryFLARE(LowRankRouting):
    """Routing queries are the synthesized ones alone, with separate synthesis K and V.

    ``Q_h(X) = SDPA(N(Q~_h), N(X W~_K,h), X W~_V,h)``, where N is N_a for simplified
    FLARE++ (A.8) and the identity for FLARE++ v1; routing keys and values are FLARE's.
    """

    config_cls = SynthesizedQueryConfig
    token_shardable = True  # two encodes per block

    def __init__(self, config: SynthesizedQueryConfig) -> None:
        super().__init__(config)
        c = config
        self.synthesis_seeds = init_latents((c.heads, c.latents, c.head_dim))
        # [W~_K | W~_V | W_K | W_V], stacked.
        self.key_value_proj = near_identity_linear(c.dim, 4)
        self.out_proj = near_identity_linear(c.dim)
        if c.normalize_synthesis:
            self.seed_norm = HeadNorm(c.norm, c.head_dim, affine=True)
            self.synthesis_key_norm = HeadNorm(c.norm, c.head_dim, affine=True)
        else:
            self.seed_norm = nn.Identity()
            self.synthesis_key_norm = nn.Identity()

    def route_queries(self, x, mask):
        seeds = self.seed_norm(self.latents_for(self.synthesis_seeds, x.shape[0]))
        queries = self.backend.held_encode(seeds)
        if queries is None:
            synthesis_keys, synthesis_values = self.split_projections_BNHD(
                self.project(x, 0, 2), 2)
            queries = self.backend.encode(
                seeds, self.heads_first(self.synthesis_key_norm(synthesis_keys)),
                self.heads_first(synthesis_values), mask, scale=self.config.attn_scale)
        return queries

    def keys_and_values(self, x, *, values):
        if not values:
            return self.split_projections(self.project(x, 2), 1)[0], None
        return self.split_projections(self.project(x, 2, 2), 2)


MIXERS.add("flarepp-simple", SynthesizedQueryFLARE, defaults={"normalize_synthesis": True},
           doc="simplified FLARE++ (A.8): synthesized queries only, N_a on seeds and keys")
MIXERS.add("flarepp-v1", SynthesizedQueryFLARE, defaults={"normalize_synthesis": False},
           doc="FLARE++ v1: separate synthesis keys and values, no norms, no gate")
