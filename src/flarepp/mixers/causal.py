"""Causal (decoder) FLARE, causal FLARE++ and causal full attention with a KV cache.

Shape letters: B batch, H heads, N tokens, M latents, D head width, C = H*D channels,
J chunks of T tokens (the parallel form's chunk length).

**Causal FLARE** (talk "FLARE + high order attention ideas", Aim 2: "Next-token prediction
with FLARE"): token t routes only through latents built from tokens ``u <= t``; the math,
its recurrent and chunked parallel forms and their numerics are those of the scan kernels
in :mod:`flarepp.ops.causal` (:func:`~flarepp.ops.causal.causal_flare`), which the
mixers below call.

**Causal FLARE++.** FLARE++ (paper v2, Table 2) synthesizes the routing queries from the
whole input: ``Q_d = SDPA(N_a(Q~), K~, K~)``, ``Q = N_0(Q_f) + sigmoid(gamma) Q_d``. Made
causal, token t may only use a query synthesized from tokens ``<= t``:
``Q_d(t)[m] = sum_{u<=t} softmax_{u<=t}(s N_a(Q~_m) . K~_u) K~_u`` -- the same online
softmax with the synthesis keys as values, an ``O(M D)`` state. The routing queries are
then per token, ``q_m(t) = N_0(Q_f)_m + sigmoid(gamma) Q_d(t)[m]``. The exact causal
analogue of FLARE++'s encode would weigh every earlier token u by the *current* query,
``exp(s q_m(t) . k_u)``; when ``q_m(t)`` changes, the weights of all earlier tokens change,
so no state smaller than the keys themselves can carry the sum (a KV cache, ``O(N)``
state, ``O(N^2 M D)`` training work). What is exact and recurrent is to score each token
with the queries of its own time, ``a[t, m] = s q_m(t) . k_t``: the encode state then
gathers token u with the weight it had when it arrived, and the decode of token t uses
``q(t)`` -- both only through tokens ``<= t``. That is the mixer implemented here
(``flarepp-causal``): the synthesis is one more causal scan (its read-out
``Q_d(t)[m] . k_t`` is the same chunked algorithm with the routing keys as readers,
:func:`causal_latent_projection`), after which the scores ``a`` go through causal FLARE.
Its state is twice FLARE's: the synthesis state (whose normalised sum is ``Q_d``) and the
encode state. It is a causal variant, not FLARE++'s non-causal function restricted to a
prefix.

**Causal attention** (``attention-causal``) is the quadratic reference: fused SDPA with
a causal mask in training, and a KV cache in decoding (``2 B H t D`` numbers after t
tokens, ``O(t D)`` work per token).

Positions: none of these mixers adds a positional encoding; causal masking alone tells a
decoder the order (Haviv et al., 2022, "Transformer Language Models without Positional
Encodings Still Learn Positional Information").

Masks: ``mask [B, N]`` (True = real token) removes masked tokens from every state, so any
mask is exact (right padding in particular: padded tokens never reach real ones); masked
tokens' outputs are zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flarepp.mixers.base import (Mixer, MixerConfig, check_tokens, init_latents,
                                 near_identity_linear, zero_masked)
from flarepp.mixers.flare import FLAREPPConfig
from flarepp.mixers.registry import MIXERS
from flarepp.ops import HeadNorm
from flarepp.ops.attention import default_scale
from flarepp.ops.causal import (LatentState, causal_flare, causal_latent_projection, core_dtype,
                                no_autocast, online_softmax_step)

# ----------------------------------------------------------------------------------------
# Mixers
# ----------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class CausalFLAREConfig(MixerConfig):
    """``chunk_size``: T of the parallel form (the output does not depend on it)."""

    chunk_size: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")


@dataclass(kw_only=True)
class CausalFLAREPPConfig(CausalFLAREConfig, FLAREPPConfig):
    """FLARE++'s settings and the parallel form's ``chunk_size`` (checked as causal FLARE's)."""


@dataclass
class CausalFLAREState:
    """Decoding state of one causal FLARE layer: the encode state, plus the synthesis
    state for causal FLARE++. Its size does not depend on the number of tokens seen."""

    encode: LatentState
    synthesis: LatentState | None = None

    def tensors(self) -> list[torch.Tensor]:
        extra = [] if self.synthesis is None else self.synthesis.tensors()
        return self.encode.tensors() + extra


class _CausalMixer(Mixer):
    """What the causal mixers share: order matters, and a decoding API.

    ``prefill(x, mask) -> (y, state)`` runs the parallel form and returns the state after
    the last real token; ``step(x_t [B, C], state) -> (y_t [B, C], state)`` appends one
    token; ``initial_state(batch)`` is the state of an empty prefix.
    """

    causal = True
    permutation_equivariant = False
    supports_mask = True

    def _check_step(self, x_t: torch.Tensor) -> None:
        if x_t.dim() != 2 or x_t.shape[-1] != self.config.dim:
            raise ValueError(f"step takes one token per sequence, x_t of shape "
                             f"[B, {self.config.dim}], got {list(x_t.shape)}")

    def _state_dtype(self) -> torch.dtype:
        return core_dtype(next(self.parameters()))


class _CausalLatentMixer(_CausalMixer):
    """What causal FLARE and FLARE++ share: one parallel form, ``_parallel(x, mask) ->
    (y, state)`` on the checked input with its padded tokens zeroed, serves the forward and
    the prefill; ``s`` is the attention scale."""

    @property
    def scale(self) -> float:
        return default_scale(self.head_dim, self.config.attn_scale)

    def _parallel(self, x: torch.Tensor, mask: torch.Tensor | None
                  ) -> tuple[torch.Tensor, CausalFLAREState]:
        """The parallel form of the subclass (causal FLARE, causal FLARE++), abstract here."""
        raise NotImplementedError(f"{type(self).__name__} derives from _CausalLatentMixer "
                                  "but defines no _parallel (its parallel form)")

    def _checked_parallel(self, x: torch.Tensor, mask: torch.Tensor | None
                          ) -> tuple[torch.Tensor, CausalFLAREState]:
        check_tokens(x, mask, self.config.dim)
        return self._parallel(zero_masked(x, mask), mask)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self._checked_parallel(x, mask)[0]

    def prefill(self, x: torch.Tensor, mask: torch.Tensor | None = None, *,
                capacity: int | None = None) -> tuple[torch.Tensor, CausalFLAREState]:
        """The parallel form and the state after the last real token (``capacity`` unused:
        the state does not grow)."""
        return self._checked_parallel(x, mask)


@MIXERS.register("flare-causal",
                 doc="causal FLARE: prefix latents by online softmax, O(H M D) decoding state")
class CausalFLARE(_CausalLatentMixer):
    """Causal FLARE with FLARE's parameters (``3C^2 + MC``): ``K = X W_K``, ``V = X W_V``,
    learned ``Q_f [H, M, D]``, ``a = s K Q_f^T``, then :func:`causal_flare`, ``Y W_O``."""

    config_cls = CausalFLAREConfig

    def __init__(self, config: CausalFLAREConfig) -> None:
        super().__init__(config)
        c = config
        self.fixed_queries = init_latents((c.heads, c.latents, c.head_dim), std=0.1)
        self.key_value_proj = near_identity_linear(c.dim, 2)                 # [W_K | W_V]
        self.out_proj = near_identity_linear(c.dim)

    def _parallel(self, x: torch.Tensor, mask: torch.Tensor | None
                  ) -> tuple[torch.Tensor, CausalFLAREState]:
        keys, values = self.split_projections(self.key_value_proj(x), 2)    # [B,H,N,D]
        with no_autocast(x.device):
            dtype = core_dtype(keys)
            scores = self.scale * torch.einsum("bhnd,hmd->bhnm", keys.to(dtype),
                                               self.fixed_queries.to(dtype))
        y, state = causal_flare(scores, values, mask, chunk_size=self.config.chunk_size)
        out = zero_masked(self.out_proj(self.merge_heads(y).to(x.dtype)), mask)
        return out, CausalFLAREState(state)

    def initial_state(self, batch: int, *, capacity: int | None = None) -> CausalFLAREState:
        """The empty-prefix state; ``capacity`` is accepted for API symmetry and unused."""
        c, p = self.config, self.fixed_queries
        return CausalFLAREState(LatentState.empty(batch, c.heads, c.latents, c.head_dim,
                                                  device=p.device, dtype=self._state_dtype()))

    def step(self, x_t: torch.Tensor, state: CausalFLAREState
             ) -> tuple[torch.Tensor, CausalFLAREState]:
        self._check_step(x_t)
        B = x_t.shape[0]
        keys, values = self.key_value_proj(x_t).view(B, 2, self.heads, self.head_dim).unbind(1)
        with no_autocast(x_t.device):
            dtype = state.encode.weighted_sum.dtype
            keys, values = keys.to(dtype), values.to(dtype)
            scores = self.scale * torch.einsum("bhd,hmd->bhm", keys,
                                               self.fixed_queries.to(dtype))
            encode = online_softmax_step(state.encode, scores, values)
            y = torch.einsum("bhm,bhmd->bhd", torch.softmax(scores, dim=-1), encode.latents)
        return self.out_proj(y.reshape(B, -1).to(x_t.dtype)), CausalFLAREState(encode)


@MIXERS.register("flarepp-causal",
                 doc="causal FLARE++: per-token synthesized queries from the prefix, O(H M D) state")
class CausalFLAREPP(_CausalLatentMixer):
    """Causal FLARE++ (module doc): FLARE++'s parameters (``4C^2 + 2MC + H``), norms and
    FP32 gated sum; the synthesis and the encode are both causal online softmaxes."""

    config_cls = CausalFLAREPPConfig

    def __init__(self, config: CausalFLAREPPConfig) -> None:
        super().__init__(config)
        c = config
        self.synthesis_seeds = init_latents((c.heads, c.latents, c.head_dim))  # Q~ [H, M, D]
        self.fixed_queries = init_latents((c.heads, c.latents, c.head_dim))    # Q_f [H, M, D]
        self.gate_logit = nn.Parameter(torch.full((c.heads,), float(c.gate_logit_init)))
        self.key_value_proj = near_identity_linear(c.dim, 3)                # [W~_K | W_K | W_V]
        self.out_proj = near_identity_linear(c.dim)
        self.seed_norm = HeadNorm(c.norm, c.head_dim, affine=True)            # N_a
        self.synthesis_key_norm = HeadNorm(c.norm, c.head_dim, affine=False)  # N_0
        self.fixed_query_norm = HeadNorm(c.norm, c.head_dim, affine=False)    # N_0
        self.routing_key_norm = HeadNorm(c.norm, c.head_dim, affine=True)     # N_a

    def _latent_queries(self, dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``N_a(Q~)``, ``N_0(Q_f)`` ``[H, M, D]`` and ``sigmoid(gamma)`` ``[H]`` in ``dtype``."""
        seeds = self.seed_norm(self.synthesis_seeds).to(dtype)
        fixed = self.fixed_query_norm(self.fixed_queries).to(dtype)
        return seeds, fixed, torch.sigmoid(self.gate_logit.to(dtype))

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        synthesis_keys, keys, values = self.split_projections_BNHD(self.key_value_proj(x), 3)
        return (self.synthesis_key_norm(synthesis_keys), self.routing_key_norm(keys), values)

    def _parallel(self, x: torch.Tensor, mask: torch.Tensor | None
                  ) -> tuple[torch.Tensor, CausalFLAREState]:
        synthesis_keys, keys, values = (self.heads_first(t) for t in self._projections(x))
        s, T = self.scale, self.config.chunk_size
        with no_autocast(x.device):
            dtype = core_dtype(keys)
            synthesis_keys, keys = synthesis_keys.to(dtype), keys.to(dtype)
            seeds, fixed, gate = self._latent_queries(dtype)
            synthesis_scores = s * torch.einsum("bhnd,hmd->bhnm", synthesis_keys, seeds)
            # Q_d(t)[m] . k_t, then a[t, m] = s (N_0(Q_f)_m + g Q_d(t)[m]) . k_t in FP32+
            read, synthesis = causal_latent_projection(synthesis_scores, synthesis_keys, keys,
                                                       mask, chunk_size=T)
            scores = s * (torch.einsum("bhnd,hmd->bhnm", keys, fixed)
                          + gate.view(1, -1, 1, 1) * read)
        y, encode = causal_flare(scores, values, mask, chunk_size=T)
        out = zero_masked(self.out_proj(self.merge_heads(y).to(x.dtype)), mask)
        return out, CausalFLAREState(encode, synthesis)

    def initial_state(self, batch: int, *, capacity: int | None = None) -> CausalFLAREState:
        """The empty-prefix state; ``capacity`` is accepted for API symmetry and unused."""
        c, p = self.config, self.fixed_queries
        args = (batch, c.heads, c.latents, c.head_dim)
        kw = dict(device=p.device, dtype=self._state_dtype())
        return CausalFLAREState(LatentState.empty(*args, **kw), LatentState.empty(*args, **kw))

    def step(self, x_t: torch.Tensor, state: CausalFLAREState
             ) -> tuple[torch.Tensor, CausalFLAREState]:
        self._check_step(x_t)
        if state.synthesis is None:
            raise ValueError("flarepp-causal needs a state with a synthesis part; build it "
                             "with initial_state() or prefill()")
        B = x_t.shape[0]
        synthesis_keys, keys, values = (t.squeeze(1) for t in self._projections(x_t[:, None]))
        s = self.scale
        with no_autocast(x_t.device):
            dtype = state.encode.weighted_sum.dtype
            synthesis_keys, keys, values = (t.to(dtype) for t in (synthesis_keys, keys, values))
            seeds, fixed, gate = self._latent_queries(dtype)
            synthesis = online_softmax_step(
                state.synthesis, s * torch.einsum("bhd,hmd->bhm", synthesis_keys, seeds),
                synthesis_keys)
            queries = fixed + gate.view(1, -1, 1, 1) * synthesis.latents        # q(t) [B,H,M,D]
            scores = s * torch.einsum("bhd,bhmd->bhm", keys, queries)
            encode = online_softmax_step(state.encode, scores, values)
            y = torch.einsum("bhm,bhmd->bhd", torch.softmax(scores, dim=-1), encode.latents)
        return (self.out_proj(y.reshape(B, -1).to(x_t.dtype)),
                CausalFLAREState(encode, synthesis))


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, ``[B, H, capacity, D]``, of which the
    first ``length`` slots are filled; ``valid [B, capacity]`` marks real tokens (a padded
    prompt leaves holes). Grows by doubling when full; ``2 B H length D`` numbers in use.
    ``step`` writes the new token into the cache it is given and returns it (or, when the
    cache was full, a copy of twice the capacity)."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    length: int

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys[:, :, :self.length], self.values[:, :, :self.length],
                self.valid[:, :self.length]]


@MIXERS.register("attention-causal",
                 doc="causal full attention (fused SDPA), KV cache for decoding, O(N^2)")
class CausalSelfAttention(_CausalMixer):
    """The quadratic reference decoder: ``Y_h = softmax(s Q_h K_h^T + causal) V_h``;
    projections as in ``attention`` (``[Q | K | V]`` without bias, biased output)."""

    def __init__(self, config: MixerConfig) -> None:
        super().__init__(config)
        self.qkv_proj = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out_proj = nn.Linear(config.dim, config.dim)

    def _attend(self, x: torch.Tensor, mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The mixer's output and its keys and values ``[B, H, N, D]``."""
        check_tokens(x, mask, self.config.dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        q, k, v = self.split_projections(self.qkv_proj(x), 3)
        s, N = self.config.attn_scale, x.shape[1]
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s)
        else:
            # A token sees the real tokens before it, and itself (so no row is empty; a
            # masked token's output is zeroed below). O(N^2) like the attention itself.
            eye = torch.eye(N, dtype=torch.bool, device=x.device)
            allowed = torch.ones(N, N, dtype=torch.bool, device=x.device).tril()
            allowed = allowed & (mask[:, None, None, :] | eye)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=s)
        return zero_masked(self.out_proj(self.merge_heads(y)), mask), k, v

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self._attend(x, mask)[0]

    def prefill(self, x: torch.Tensor, mask: torch.Tensor | None = None, *,
                capacity: int | None = None) -> tuple[torch.Tensor, KVCache]:
        """The parallel form and a cache holding the prompt (room for ``capacity``)."""
        out, k, v = self._attend(x, mask)
        N = x.shape[1]
        cache = self.initial_state(x.shape[0], capacity=max(N, capacity or 0))
        cache.keys[:, :, :N] = k.detach().to(cache.keys.dtype)
        cache.values[:, :, :N] = v.detach().to(cache.values.dtype)
        cache.valid[:, :N] = True if mask is None else mask
        cache.length = N
        return out, cache

    def initial_state(self, batch: int, *, capacity: int | None = None) -> KVCache:
        c, p = self.config, self.qkv_proj.weight
        cap = max(1, capacity or 0)
        shape = (batch, c.heads, cap, c.head_dim)
        return KVCache(p.new_zeros(shape), p.new_zeros(shape),
                       torch.zeros(batch, cap, dtype=torch.bool, device=p.device), 0)

    def step(self, x_t: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, KVCache]:
        self._check_step(x_t)
        B, n = x_t.shape[0], cache.length
        q, k, v = self.qkv_proj(x_t).view(B, 3, self.heads, 1, self.head_dim).unbind(1)
        if n == cache.keys.shape[2]:                       # full: double the capacity
            cache = KVCache(torch.cat([cache.keys, torch.zeros_like(cache.keys)], dim=2),
                            torch.cat([cache.values, torch.zeros_like(cache.values)], dim=2),
                            torch.cat([cache.valid, torch.zeros_like(cache.valid)], dim=1), n)
        cache.keys[:, :, n:n + 1] = k.to(cache.keys.dtype)
        cache.values[:, :, n:n + 1] = v.to(cache.values.dtype)
        cache.valid[:, n] = True
        cache.length = n + 1
        y = F.scaled_dot_product_attention(
            q, cache.keys[:, :, :n + 1].to(q.dtype), cache.values[:, :, :n + 1].to(q.dtype),
            attn_mask=cache.valid[:, None, None, :n + 1], scale=self.config.attn_scale)
        return self.out_proj(y.reshape(B, -1)), cache
