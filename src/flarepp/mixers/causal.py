"""Causal (decoder) FLARE, causal FLARE++ and causal full attention with a KV cache.

Shape letters: B batch, H heads, N tokens, M latents, D head width, C = H*D channels,
J chunks of T tokens (the parallel form's chunk length).

**Causal FLARE** (talk "FLARE + high order attention ideas", Aim 2: "Next-token prediction
with FLARE"). Per head, with ``s`` the SDPA scale, learned latent queries ``q_m``, keys
``k_t = x_t W_K`` and values ``v_t = x_t W_V``, the routing score of token t for latent m
is ``a[t, m] = s q_m . k_t`` (FLARE's encode and decode use the same scores, transposed).
Token t routes only through latents built from tokens ``u <= t``:

    L_t[m] = log sum_{u<=t} exp a[u, m]                       (log-normaliser)
    Z_t[m] = sum_{u<=t} exp(a[u, m] - L_t[m]) v_u             (latent m after token t)
    y_t    = sum_m softmax_M(a[t, :])_m Z_t[m]                 (decode with prefix latents)

This is the online softmax of the talk's recurrence ``Z_t = online_softmax(Z_{t-1}, k_t,
v_t)``: per latent a running maximum, a denominator and a weighted sum of values (with
``L_t`` = maximum + log denominator), and one step is the log-sum-exp merge of the FLARE++
paper's Appendix B, eq. 33, applied to the partial state of a single token. Two forms
compute it:

* the recurrent form (:meth:`CausalFLARE.step`) keeps that state, ``B H M (D + 2)``
  numbers per layer whatever the sequence length, and costs ``O(H M D)`` per token;
* the parallel (training) form (:func:`causal_flare`) splits the sequence into J chunks
  of T tokens. Each chunk's partial state ``(Z_c, L_c)`` is an encode over its own tokens;
  an inclusive scan over chunks with the eq. 33 merge (log-depth, Hillis-Steele) gives
  the state ``(Z_pre, L_pre)`` before every chunk; within a chunk, token t reads
  ``exp(L_pre - L_t) Z_pre`` (the earlier chunks) plus the exact causal part
  ``sum_{u in chunk, u<=t} P[t, u] v_u`` with ``P[t, u] = sum_m softmax_M(a[t])_m
  exp(a[u, m] - L_t[m])``, a T x T matrix per chunk computed as a ``[T, M] x [M, T]``
  product. No N x N matrix is formed. Work ``O(N M (D + T) + N T D)``; activation memory
  ``O(N M + N T + (N / T) M D log2(N / T))`` per head (scores, within-chunk matrices and
  the scan's chunk states).

Numerics of the within-chunk product: ``exp(a[u, m] - L_t[m])`` is split as
``exp(mu_m - L_t[m]) * exp(a[u, m] - mu_m)`` with ``mu_m`` the chunk's largest score, which
is exact as long as ``mu_m - L_t[m]`` stays below half the exponent range of the compute
dtype (44 in float32, 354 in float64): then nothing overflows and what underflows is below
``e^-43`` of the result. A chunk where a latent's score rises by more than that within the
chunk is recomputed exactly in log space (``[T, T, M]`` for that chunk only). The core
runs in float32 (float64 for float64 inputs), also under autocast.

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

import math
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

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------
# The online-softmax state and its merge (Appendix B, eq. 33)
# ----------------------------------------------------------------------------------------

@dataclass
class LatentState:
    """The encode state of M latents per head after a prefix, as the talk's online softmax
    keeps it: the running maximum ``mu [B, H, M]`` of the scores, the denominator
    ``l = sum_u exp(a_u - mu) [B, H, M]`` and the weighted sum of values
    ``acc = sum_u exp(a_u - mu) v_u [B, H, M, D]``. Then ``Z = acc / l`` and
    ``L = mu + log l``. An empty prefix is ``mu = -inf, l = 0, acc = 0``.

    (Kept unnormalised because a step then only adds to ``l`` and ``acc`` while the
    maximum holds: storing ``(Z, L)`` instead loses ``|L| eps`` of relative precision
    per token through ``exp(L - L')``, which adds up over a long generation.)
    """

    running_max: torch.Tensor     # mu   [B, H, M]
    denominator: torch.Tensor     # l    [B, H, M]
    weighted_sum: torch.Tensor    # acc  [B, H, M, D]

    @classmethod
    def empty(cls, batch: int, heads: int, latents: int, head_dim: int, *,
              device: torch.device | None = None, dtype: torch.dtype = torch.float32
              ) -> "LatentState":
        return cls(torch.full((batch, heads, latents), NEG_INF, device=device, dtype=dtype),
                   torch.zeros(batch, heads, latents, device=device, dtype=dtype),
                   torch.zeros(batch, heads, latents, head_dim, device=device, dtype=dtype))

    @classmethod
    def from_normalised(cls, latents: torch.Tensor, log_normaliser: torch.Tensor
                        ) -> "LatentState":
        """From ``(Z, L)`` (the parallel form's merge result): ``mu = L``, ``l = 1``."""
        finite = torch.isfinite(log_normaliser)
        return cls(log_normaliser, finite.to(latents.dtype), latents)

    @property
    def latents(self) -> torch.Tensor:
        """``Z = acc / l`` (0 for an empty prefix), ``[B, H, M, D]``."""
        den = self.denominator.unsqueeze(-1)
        return torch.where(den > 0, self.weighted_sum / torch.where(den > 0, den, 1.0), 0.0)

    @property
    def log_normaliser(self) -> torch.Tensor:
        """``L = mu + log l`` (``-inf`` for an empty prefix), ``[B, H, M]``."""
        return self.running_max + torch.log(self.denominator)

    def tensors(self) -> list[torch.Tensor]:
        return [self.running_max, self.denominator, self.weighted_sum]


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _exp_minus(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``exp(x - ref)`` that is 0 (not NaN) where ``ref = -inf``; gradients stay finite."""
    return torch.where(torch.isfinite(ref), torch.exp(x - _finite_or_zero(ref)),
                       torch.zeros_like(x))


def log_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``log(exp a + exp b)`` for inputs that may be ``-inf``, with NaN-free gradients
    (``torch.logaddexp`` returns NaN gradients when both inputs are ``-inf``)."""
    ref = _finite_or_zero(torch.maximum(a, b).detach())
    total = torch.exp(a - ref) + torch.exp(b - ref)
    positive = total > 0
    out = ref + torch.log(torch.where(positive, total, torch.ones_like(total)))
    return torch.where(positive, out, torch.full_like(out, NEG_INF))


def merge_states(z_a: torch.Tensor, l_a: torch.Tensor, z_b: torch.Tensor, l_b: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial encodes over disjoint token sets (Appendix B, eq. 33):
    ``L = log(e^{L_a} + e^{L_b})``, ``Z = e^{L_a - L} Z_a + e^{L_b - L} Z_b``.

    Same values as :func:`flarepp.ops.merge_partials` on two partials; unlike it, the
    backward pass stays finite when both partials are empty (``L = -inf``), which happens
    here for chunks of padding.
    """
    log_norm = log_add(l_a, l_b)
    w_a = _exp_minus(l_a, log_norm).unsqueeze(-1)
    w_b = _exp_minus(l_b, log_norm).unsqueeze(-1)
    return w_a * z_a + w_b * z_b, log_norm


def online_softmax_step(state: LatentState, scores_BHM: torch.Tensor,
                        values_BHD: torch.Tensor) -> LatentState:
    """One token enters every latent (the talk's ``Z_t = online_softmax(Z_{t-1}, k_t, v_t)``):
    ``mu' = max(mu, a)``, ``l' = l e^{mu - mu'} + e^{a - mu'}``,
    ``acc' = acc e^{mu - mu'} + e^{a - mu'} v`` -- eq. 33 for the partial state of one token."""
    running_max = torch.maximum(state.running_max, scores_BHM)
    rescale = _exp_minus(state.running_max, running_max)    # 0 for an empty prefix
    weight = torch.exp(scores_BHM - running_max)
    return LatentState(running_max, state.denominator * rescale + weight,
                       state.weighted_sum * rescale.unsqueeze(-1)
                       + weight.unsqueeze(-1) * values_BHD.unsqueeze(-2))


# ----------------------------------------------------------------------------------------
# The chunked parallel form
# ----------------------------------------------------------------------------------------

def _inclusive_scan(z_BHJMD: torch.Tensor, l_BHJM: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix merge over the chunk axis J in ``ceil(log2 J)`` rounds (Hillis-Steele)."""
    step = 1
    while step < z_BHJMD.shape[2]:
        z_m, l_m = merge_states(z_BHJMD[:, :, :-step], l_BHJM[:, :, :-step],
                                z_BHJMD[:, :, step:], l_BHJM[:, :, step:])
        z_BHJMD = torch.cat([z_BHJMD[:, :, :step], z_m], dim=2)
        l_BHJM = torch.cat([l_BHJM[:, :, :step], l_m], dim=2)
        step *= 2
    return z_BHJMD, l_BHJM


def _safe_span(dtype: torch.dtype) -> float:
    """Largest ``mu - L_t`` for which the split ``exp(mu - L) * exp(a - mu)`` is exact."""
    return 0.5 * math.log(torch.finfo(dtype).max)


@dataclass
class _Chunked:
    """What both read-outs share, per chunk: scores, running log-normalisers, prefixes."""

    scores: torch.Tensor        # a       [B, H, J, T, M], -inf at masked tokens
    real: torch.Tensor          # real    [B, 1, J, T, 1]
    chunk_max: torch.Tensor     # mu      [B, H, J, 1, M] (no gradient; a reference)
    weights: torch.Tensor       # exp(a - mu)             [B, H, J, T, M]
    log_norm: torch.Tensor      # L_t     [B, H, J, T, M]
    prefix_weight: torch.Tensor  # exp(L_pre - L_t)       [B, H, J, T, M]
    prefix: torch.Tensor        # Z_pre   [B, H, J, M, D]
    values: torch.Tensor        # v       [B, H, J, T, D]
    final: LatentState          # the state after the last token
    unsafe: torch.Tensor        # [B, H, J] chunks that need the log-space within-chunk part


def _chunk(t_BHNX: torch.Tensor, chunk: int, fill: float = 0.0) -> torch.Tensor:
    B, H, N, X = t_BHNX.shape
    pad = -N % chunk
    if pad:
        t_BHNX = F.pad(t_BHNX, (0, 0, 0, pad), value=fill)
    return t_BHNX.reshape(B, H, (N + pad) // chunk, chunk, X)


def _prepare(scores_BHNM: torch.Tensor, values_BHND: torch.Tensor,
             real_BN: torch.Tensor, chunk: int) -> _Chunked:
    B, H, N, M = scores_BHNM.shape
    pad = -N % chunk
    real = F.pad(real_BN, (0, pad), value=False).view(B, 1, -1, chunk, 1)
    a = _chunk(scores_BHNM, chunk).masked_fill(~real, NEG_INF)           # [B,H,J,T,M]
    v = _chunk(values_BHND, chunk)                                       # [B,H,J,T,D]
    mu = _finite_or_zero(a.detach().amax(dim=3, keepdim=True))           # [B,H,J,1,M]
    e = torch.exp(a - mu)                                                # masked -> 0
    den = e.sum(dim=3)                                                   # [B,H,J,M]
    has = den > 0
    safe_den = torch.where(has, den, torch.ones_like(den))
    l_c = torch.where(has, mu.squeeze(3) + torch.log(safe_den), torch.full_like(den, NEG_INF))
    z_c = torch.einsum("bhjtm,bhjtd->bhjmd", e, v) / safe_den.unsqueeze(-1)
    z_incl, l_incl = _inclusive_scan(z_c, l_c)
    z_pre = torch.cat([torch.zeros_like(z_incl[:, :, :1]), z_incl[:, :, :-1]], dim=2)
    l_pre = torch.cat([torch.full_like(l_incl[:, :, :1], NEG_INF), l_incl[:, :, :-1]], dim=2)
    # Running log-normaliser within each chunk. logcumsumexp has NaN gradients at -inf
    # inputs, so masked scores enter as the most negative finite number and positions
    # before the chunk's first real token are set to -inf afterwards.
    lowest = torch.finfo(a.dtype).min
    within = torch.logcumsumexp(a.masked_fill(~real, lowest), dim=3)
    seen = real.cumsum(dim=3) > 0
    within = torch.where(seen, within, torch.full_like(within, NEG_INF))
    log_norm = log_add(l_pre.unsqueeze(3), within)                       # L_t
    prefix_weight = _exp_minus(l_pre.unsqueeze(3), log_norm)
    span = torch.where(real & torch.isfinite(log_norm), mu - log_norm.detach(),
                       torch.full_like(log_norm, NEG_INF))
    unsafe = span.amax(dim=(3, 4)) > _safe_span(a.dtype)
    final = LatentState.from_normalised(z_incl[:, :, -1], l_incl[:, :, -1])
    return _Chunked(a, real, mu, e, log_norm, prefix_weight, z_pre, v, final, unsafe)


def _log_space_weights(c: _Chunked, rows: torch.Tensor) -> torch.Tensor:
    """``W[u, t, s, m] = exp(a[s, m] - L_t[m])`` for ``s <= t`` in the selected chunks
    (flattened ``B*H*J`` indices ``rows``); exact whatever the score range. ``[U, T, T, M]``."""
    T, M = c.scores.shape[-2:]
    a = c.scores.reshape(-1, T, M)[rows]                                  # [U, T(s), M]
    log_norm = c.log_norm.reshape(-1, T, M)[rows]                         # [U, T(t), M]
    causal = torch.ones(T, T, dtype=torch.bool, device=a.device).tril()
    # -inf before the exponent: a later token's exp(a[s] - L_t) may overflow, and an
    # overflow masked afterwards would still turn its zero gradient into NaN.
    a = a.unsqueeze(1).masked_fill(~causal[None, :, :, None], NEG_INF)    # [U, t, s, M]
    return _exp_minus(a, log_norm.unsqueeze(2))


def _replace_chunks(full: torch.Tensor, rows: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``full [B, H, J, ...]`` with the flattened chunks ``rows`` replaced (differentiable)."""
    shape = full.shape
    return full.reshape(-1, *shape[3:]).index_copy(0, rows, exact).reshape(shape)


def _no_autocast(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False)


def _core_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _real_mask(mask_BN: torch.Tensor | None, scores_BHNM: torch.Tensor) -> torch.Tensor:
    if mask_BN is None:
        return torch.ones(scores_BHNM.shape[0], scores_BHNM.shape[2], dtype=torch.bool,
                          device=scores_BHNM.device)
    return mask_BN


def causal_flare(scores_BHNM: torch.Tensor, values_BHND: torch.Tensor,
                 mask_BN: torch.Tensor | None = None, *, chunk_size: int = 64
                 ) -> tuple[torch.Tensor, LatentState]:
    """Causal FLARE's parallel form: ``y_t = sum_m softmax_M(a[t])_m Z_t[m]`` (module doc).

    ``scores_BHNM`` are the routing scores ``a`` (scale included), ``values_BHND`` the
    values. Returns ``y [B, H, N, D]`` (zero at masked tokens) and the state after the
    last token, from which :func:`online_softmax_step` continues.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    B, H, N, M = scores_BHNM.shape
    dtype = _core_dtype(scores_BHNM, values_BHND)
    with _no_autocast(scores_BHNM.device):
        a, v = scores_BHNM.to(dtype), values_BHND.to(dtype)
        real = _real_mask(mask_BN, a)
        c = _prepare(a, v, real, chunk_size)
        decode_w = torch.softmax(_chunk(a, chunk_size), dim=-1)          # [B,H,J,T,M]
        # earlier chunks: sum_m w[t, m] exp(L_pre - L_t) Z_pre[m]
        y = torch.einsum("bhjtm,bhjmd->bhjtd", decode_w * c.prefix_weight, c.prefix)
        # this chunk: P[t, u] = sum_m w[t, m] exp(mu - L_t) exp(a[u] - mu), u <= t
        lead = decode_w * torch.exp(torch.clamp(c.chunk_max - c.log_norm, max=_safe_span(dtype)))
        routing = torch.einsum("bhjtm,bhjum->bhjtu", lead, c.weights)
        T = routing.shape[-1]
        causal = torch.ones(T, T, dtype=torch.bool, device=a.device).tril()
        routing = routing.masked_fill(~causal, 0.0)
        if c.unsafe.any():
            rows = c.unsafe.flatten().nonzero().squeeze(1)
            exact = torch.einsum("utm,utsm->uts",
                                 decode_w.reshape(-1, T, M)[rows], _log_space_weights(c, rows))
            routing = _replace_chunks(routing, rows, exact)
        y = y + routing @ c.values
        y = y.reshape(B, H, -1, y.shape[-1])[:, :, :N]
        y = y * real[:, None, :, None]
    return y, c.final


def causal_latent_projection(scores_BHNM: torch.Tensor, values_BHND: torch.Tensor,
                             readers_BHND: torch.Tensor, mask_BN: torch.Tensor | None = None,
                             *, chunk_size: int = 64) -> tuple[torch.Tensor, LatentState]:
    """``r[t, m] = Z_t[m] . r_t``: every prefix latent read by the token's own vector.

    With the synthesis scores, synthesis keys as values and the routing keys as readers
    this is causal FLARE++'s ``Q_d(t)[m] . k_t`` without forming the per-token queries
    ``[N, M, D]``. Returns ``r [B, H, N, M]`` and the state after the last token.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    B, H, N, M = scores_BHNM.shape
    dtype = _core_dtype(scores_BHNM, values_BHND, readers_BHND)
    with _no_autocast(scores_BHNM.device):
        a, v, k = scores_BHNM.to(dtype), values_BHND.to(dtype), readers_BHND.to(dtype)
        real = _real_mask(mask_BN, a)
        c = _prepare(a, v, real, chunk_size)
        readers = _chunk(k, chunk_size)                                   # [B,H,J,T,D]
        r = c.prefix_weight * torch.einsum("bhjmd,bhjtd->bhjtm", c.prefix, readers)
        T = readers.shape[3]
        causal = torch.ones(T, T, dtype=torch.bool, device=a.device).tril()
        gram = torch.einsum("bhjtd,bhjud->bhjtu", readers, c.values).masked_fill(~causal, 0.0)
        lead = torch.exp(torch.clamp(c.chunk_max - c.log_norm, max=_safe_span(dtype)))
        within = lead * (gram @ c.weights)                                # [B,H,J,T,M]
        if c.unsafe.any():
            rows = c.unsafe.flatten().nonzero().squeeze(1)
            exact = torch.einsum("utsm,uts->utm", _log_space_weights(c, rows),
                                 gram.reshape(-1, T, T)[rows])
            within = _replace_chunks(within, rows, exact)
        r = (r + within).reshape(B, H, -1, M)[:, :, :N]
    return r, c.final


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
class CausalFLAREPPConfig(FLAREPPConfig):
    chunk_size: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")


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
        return _core_dtype(next(self.parameters()))


@MIXERS.register("flare-causal",
                 doc="causal FLARE: prefix latents by online softmax, O(H M D) decoding state")
class CausalFLARE(_CausalMixer):
    """Causal FLARE with FLARE's parameters (``3C^2 + MC``): ``K = X W_K``, ``V = X W_V``,
    learned ``Q_f [H, M, D]``, ``a = s K Q_f^T``, then :func:`causal_flare`, ``Y W_O``."""

    config_cls = CausalFLAREConfig

    def __init__(self, config: CausalFLAREConfig) -> None:
        super().__init__(config)
        c = config
        self.fixed_queries = init_latents((c.heads, c.latents, c.head_dim), std=0.1)
        self.key_value_proj = near_identity_linear(c.dim, 2)                 # [W_K | W_V]
        self.out_proj = near_identity_linear(c.dim)

    @property
    def scale(self) -> float:
        return default_scale(self.head_dim, self.config.attn_scale)

    def _parallel(self, x: torch.Tensor, mask: torch.Tensor | None
                  ) -> tuple[torch.Tensor, CausalFLAREState]:
        check_tokens(x, mask, self.config.dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        keys, values = self.split_projections(self.key_value_proj(x), 2)    # [B,H,N,D]
        with _no_autocast(x.device):
            dtype = _core_dtype(keys)
            scores = self.scale * torch.einsum("bhnd,hmd->bhnm", keys.to(dtype),
                                               self.fixed_queries.to(dtype))
        y, state = causal_flare(scores, values, mask, chunk_size=self.config.chunk_size)
        out = zero_masked(self.out_proj(self.merge_heads(y).to(x.dtype)), mask)
        return out, CausalFLAREState(state)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self._parallel(x, mask)[0]

    def prefill(self, x: torch.Tensor, mask: torch.Tensor | None = None, *,
                capacity: int | None = None) -> tuple[torch.Tensor, CausalFLAREState]:
        """The parallel form and the state after the last real token (``capacity`` unused:
        the state does not grow)."""
        return self._parallel(x, mask)

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
        with _no_autocast(x_t.device):
            dtype = state.encode.weighted_sum.dtype
            keys, values = keys.to(dtype), values.to(dtype)
            scores = self.scale * torch.einsum("bhd,hmd->bhm", keys,
                                               self.fixed_queries.to(dtype))
            encode = online_softmax_step(state.encode, scores, values)
            y = torch.einsum("bhm,bhmd->bhd", torch.softmax(scores, dim=-1), encode.latents)
        return self.out_proj(y.reshape(B, -1).to(x_t.dtype)), CausalFLAREState(encode)


@MIXERS.register("flarepp-causal",
                 doc="causal FLARE++: per-token synthesized queries from the prefix, O(H M D) state")
class CausalFLAREPP(_CausalMixer):
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

    @property
    def scale(self) -> float:
        return default_scale(self.head_dim, self.config.attn_scale)

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
        check_tokens(x, mask, self.config.dim)
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        synthesis_keys, keys, values = (self.heads_first(t) for t in self._projections(x))
        s, T = self.scale, self.config.chunk_size
        with _no_autocast(x.device):
            dtype = _core_dtype(keys)
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

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self._parallel(x, mask)[0]

    def prefill(self, x: torch.Tensor, mask: torch.Tensor | None = None, *,
                capacity: int | None = None) -> tuple[torch.Tensor, CausalFLAREState]:
        """The parallel form and the state after the last real token (``capacity`` unused:
        the state does not grow)."""
        return self._parallel(x, mask)

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
        with _no_autocast(x_t.device):
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
