"""Causal FLARE's scan kernels: weight-free, for the causal mixers of
:mod:`flarepp.mixers.causal`.

Shape letters: B batch, H heads, N tokens, M latents, D head width, J chunks of T tokens
(the parallel form's chunk length).

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


def no_autocast(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False)


def core_dtype(*tensors: torch.Tensor) -> torch.dtype:
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
    dtype = core_dtype(scores_BHNM, values_BHND)
    with no_autocast(scores_BHNM.device):
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
    dtype = core_dtype(scores_BHNM, values_BHND, readers_BHND)
    with no_autocast(scores_BHNM.device):
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
