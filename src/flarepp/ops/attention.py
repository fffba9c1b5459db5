"""Token-latent attention primitives: ``encode``, ``encode_with_lse``, ``decode`` (paper 3.1, B.2-B.5).

Shape letters, used in names throughout: B batch, H heads, N tokens (mesh points),
M latents, D head width. A padding mask is ``[B, N]`` bool, True for real tokens.

With ``s`` the SDPA scale (``1/sqrt(D)`` unless given):

* ``encode(Q, K, V)``: ``Z = softmax_N(s Q K^T) V`` -- M latents gather N tokens. Masked
  tokens are excluded from the softmax; a row with no real token gives ``Z = 0``.
* ``encode_with_lse``: also ``L = log sum_n exp(s Q K^T)``, the row-wise log-sum-exp that
  lets partial encodes over token shards be merged exactly (:func:`merge_partials`); it is
  differentiable in both outputs (the local backward of B.5). A row with no real token
  gives ``L = -inf``, ``Z = 0``, never NaN.
* ``decode(K, Q, Z)``: ``Y = softmax_M(s K Q^T) Z`` -- each token reads the latents; masked
  tokens' outputs are zero.

Everything runs on fused kernels; the N x M score matrix is never materialised except by
the generic fallback of ``encode_with_lse`` where no LSE kernel is wired up (float64 on
CUDA, devices other than CPU and CUDA).

Mixers do not call these functions directly but through an :class:`AttentionBackend`
held in their ``backend`` attribute, so a different execution strategy (an explicit
reference in the tests, token sharding across ranks, streaming) is chosen once, from
outside the model, by :func:`set_backend`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flarepp.ops import _kernels


def default_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype SDPA runs in: autocast's when active, else the promotion of the inputs."""
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _cast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    dtype = _compute_dtype(*tensors)
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in tensors)


def _keyless_safe(mask_BN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key mask [B, 1, 1, N], has_key [B])`` with a sample that has no real token
    given every key instead, so that no kernel sees a row without a key: CUDA's
    memory-efficient kernel returns NaN there and its backward multiplies that NaN by the
    zero cotangent of the row, which the output's ``masked_fill`` does not stop. The
    caller zeroes such samples' outputs, which also zeroes their gradients."""
    has_key = mask_BN.any(dim=-1)
    return (mask_BN | ~has_key[:, None])[:, None, None, :], has_key


def encode(q_BHMD: torch.Tensor, k_BHND: torch.Tensor, v_BHND: torch.Tensor,
           mask_BN: torch.Tensor | None = None, *, scale: float | None = None) -> torch.Tensor:
    """``Z = softmax_N(s Q K^T) V`` over the real tokens; ``[B, H, M, D]``."""
    q, k, v = _cast(q_BHMD, k_BHND, v_BHND)
    s = default_scale(q.shape[-1], scale)
    if mask_BN is None:
        return F.scaled_dot_product_attention(q, k, v, scale=s)
    key_mask, has_key = _keyless_safe(mask_BN)
    z = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=s)
    return z.masked_fill(~has_key[:, None, None, None], 0.0)  # no real token: Z = 0


def decode(k_BHND: torch.Tensor, q_BHMD: torch.Tensor, z_BHMD: torch.Tensor,
           mask_BN: torch.Tensor | None = None, *, scale: float | None = None) -> torch.Tensor:
    """``Y = softmax_M(s K Q^T) Z``; masked tokens' rows are zero. ``[B, H, N, D]``."""
    k, q, z = _cast(k_BHND, q_BHMD, z_BHMD)
    s = default_scale(q.shape[-1], scale)
    y = F.scaled_dot_product_attention(k, q, z, scale=s)
    if mask_BN is not None:
        y = y.masked_fill(~mask_BN[:, None, :, None], 0.0)
    return y


def self_attention(q_BHND: torch.Tensor, k_BHND: torch.Tensor, v_BHND: torch.Tensor,
                   mask_BN: torch.Tensor | None = None, *, scale: float | None = None
                   ) -> torch.Tensor:
    """Full softmax attention among the real tokens (the quadratic reference mixer)."""
    q, k, v = _cast(q_BHND, k_BHND, v_BHND)
    s = default_scale(q.shape[-1], scale)
    if mask_BN is None:
        return F.scaled_dot_product_attention(q, k, v, scale=s)
    key_mask, _ = _keyless_safe(mask_BN)  # padded queries' rows are zeroed below
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=s)
    return y.masked_fill(~mask_BN[:, None, :, None], 0.0)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _heads_padded(t_BHXD: torch.Tensor, width: int, multiple: int,
                  column: torch.Tensor | float | None = None) -> torch.Tensor:
    """``t`` with its head width zero-padded to ``width``, ``column`` (if given) written in
    column ``D``; laid out ``[B, X, H, width]`` in memory, as the kernels' own outputs.

    Without padding or column, ``t`` itself when its layout already suits a kernel that
    needs strides and storage offset in multiples of ``multiple``: contiguous, or laid out
    ``[B, X, H, D]`` already (a mixer's projection viewed heads-first; no copy of the keys
    and values per encode).
    """
    B, H, X, D = t_BHXD.shape
    if width == D and column is None \
            and (t_BHXD.is_contiguous() or t_BHXD.transpose(1, 2).is_contiguous()) \
            and t_BHXD.storage_offset() % multiple == 0:
        return t_BHXD
    out = t_BHXD.new_zeros(B, X, H, width).transpose(1, 2)
    out[..., :D] = t_BHXD
    if column is not None:
        out[..., D] = column
    return out


def _head_widths(kernel: _kernels.LSEKernel, d: int, d_v: int) -> tuple[int, int]:
    """Head widths ``(query/key, value)`` that ``kernel`` accepts, padded from ``d, d_v``."""
    if kernel.equal_head_widths:
        d = d_v = max(d, d_v)
    return _round_up(d, kernel.head_multiple), _round_up(d_v, kernel.head_multiple)


def _key_bias(mask_BN: torch.Tensor, has_key_B: torch.Tensor, dtype: torch.dtype
              ) -> torch.Tensor:
    """Additive key bias ``[B, 1, 1, N]``: 0 for real tokens, -inf for padding.

    Rows are stored padded to :data:`_kernels.BIAS_ROW_MULTIPLE` elements (the layout the
    kernels accept, see :mod:`flarepp.ops._kernels`). A sample with no real token gets 0
    everywhere instead, so that no kernel sees a row without a key; its outputs are replaced
    by ``Z = 0``, ``L = -inf`` afterwards, which also makes its cotangents exactly zero.
    """
    B, N = mask_BN.shape
    width = _round_up(N, _kernels.BIAS_ROW_MULTIPLE)
    rows = torch.full((B, width), float("-inf"), dtype=dtype, device=mask_BN.device)
    rows[:, :N].masked_fill_(mask_BN | ~has_key_B[:, None], 0.0)
    return rows[:, None, None, :N]


class _FusedEncodeWithLSE(torch.autograd.Function):
    """Fused encode returning ``(Z, L)``; backward takes the cotangents of both (B.5).

    The local backward of B.5 is ``dS = P * (dZ V^T - c + dL)`` with ``c = rowsum(dZ * Z)``.
    The kernels' output-only backward computes ``P * (dZ' V'^T - rowsum(dZ' * Z'))``;
    padding the value width by one column, ``V' = [V, 1]``, ``Z' = [Z, 0]``,
    ``dZ' = [dZ, dL]``, turns that into exactly the expression above, so one kernel call
    serves both cotangents. Head widths a kernel does not accept are padded with zero
    columns (exact: they add nothing to the scores, and give output columns that are sliced
    off); the kernel's log-sum-exp rows past M are padding and are sliced off too.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias_B11N, scale, kernel):
        B, H, M, D = q.shape
        N, Dv = k.shape[-2], v.shape[-1]
        width, width_v = _head_widths(kernel, D, Dv)
        bias = None if bias_B11N is None else bias_B11N.expand(B, H, M, N)
        m = kernel.head_multiple
        out, lse, saved = kernel.forward(_heads_padded(q, width, m), _heads_padded(k, width, m),
                                         _heads_padded(v, width_v, m), bias, scale)
        ctx.save_for_backward(q, k, v, bias_B11N, out, lse, *saved)
        ctx.scale, ctx.kernel = scale, kernel
        # An unused output's cotangent stays None instead of a tensor of zeros, so a caller
        # that never uses L gets the output-only backward without the extra value column.
        ctx.set_materialize_grads(False)
        return out[..., :Dv], lse[..., :M]

    @staticmethod
    def backward(ctx, dz, dlse):
        q, k, v, bias_B11N, out, lse, *saved = ctx.saved_tensors
        kernel, m = ctx.kernel, ctx.kernel.head_multiple
        B, H, M, D = q.shape
        N, Dv = k.shape[-2], v.shape[-1]
        bias = None if bias_B11N is None else bias_B11N.expand(B, H, M, N)
        z = out[..., :Dv]
        if dz is None:
            dz = torch.zeros_like(z)
        if dlse is None:  # the output-only backward, with the forward's widths
            width, width_v = _head_widths(kernel, D, Dv)
            v_p, out_p, dz_p = _heads_padded(v, width_v, m), out, _heads_padded(dz, width_v, m)
        else:  # V' = [V, 1], Z' = [Z, 0], dZ' = [dZ, dL]
            width, width_v = _head_widths(kernel, D, Dv + 1)
            v_p = _heads_padded(v, width_v, m, column=1.0)
            out_p = _heads_padded(z, width_v, m)
            dz, dlse, unscale = _fp16_safe_cotangents(dz, dlse)
            dz_p = _heads_padded(dz, width_v, m, column=dlse.to(dz.dtype))
        dq, dk, dv = kernel.backward(dz_p, _heads_padded(q, width, m), _heads_padded(k, width, m),
                                     v_p, bias, out_p, lse, tuple(saved), ctx.scale)
        if dlse is not None and unscale is not None:
            dq, dk, dv = dq * unscale, dk * unscale, dv * unscale
        return dq[..., :D], dk[..., :D], dv[..., :Dv], None, None, None


_FP16_COTANGENT_PEAK = 2.0 ** 14
"""Largest magnitude the float16 cotangent ``dZ' = [dZ, dL]`` is scaled down to."""


def _fp16_safe_cotangents(dz: torch.Tensor, dlse: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dZ / g, dL / g, g)`` for float16 ``dZ``, ``g`` a power of two; else ``(dZ, dL, None)``.

    ``dL`` arrives in float32 and becomes a float16 column of ``dZ'``: under a loss scale
    (``GradScaler`` starts at 2^16) it overflows float16's 65504 although ``dQ`` and
    ``dK`` would not. The kernel's backward is linear in ``dZ'``, so it runs on
    ``dZ' / g`` and its gradients are multiplied by ``g`` (exact for a power of two, at
    most 2^15 so that float16 holds it). ``g`` stays a device tensor: no host sync.
    """
    if dz.dtype != torch.float16:
        return dz, dlse, None
    peak = torch.maximum(dlse.detach().abs().amax().float(), dz.detach().abs().amax().float())
    g = torch.exp2(torch.ceil(torch.log2(peak / _FP16_COTANGENT_PEAK)).clamp(0.0, 15.0))
    return dz / g, dlse / g, g


def _explicit_encode_with_lse(q, k, v, mask_BN, scale):
    """Generic fallback: materialises the scores (used where no LSE kernel is wired up).

    Scores and log-sum-exp are float64 for float64 inputs (CUDA's float64 path), float32
    otherwise."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = scale * torch.matmul(q, k.transpose(-1, -2)).to(acc)
    if mask_BN is not None:
        scores = scores.masked_fill(~mask_BN[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(scores.dtype).min))
    return torch.matmul(probs.to(v.dtype), v), lse


def encode_with_lse(q_BHMD: torch.Tensor, k_BHND: torch.Tensor, v_BHND: torch.Tensor,
                    mask_BN: torch.Tensor | None = None, *, scale: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Z, L)``: the encode of :func:`encode` and its row-wise log-sum-exp ``[B, H, M]``.

    ``L`` is float32 for 16-bit inputs (float64 for float64). Rows with no real key (an
    empty shard, a fully padded sample) give ``Z = 0`` and ``L = -inf``. Runs the fused
    kernel of the device (:func:`flarepp.ops._kernels.lse_kernel`: CPU flash attention, the
    CUDA memory-efficient kernel), which never forms the N x M scores; devices and dtypes
    without one (float64 on CUDA) use an explicit fallback that does.
    """
    q, k, v = _cast(q_BHMD, k_BHND, v_BHND)
    return _encode_with_lse(q, k, v, mask_BN, default_scale(q.shape[-1], scale),
                            _kernels.lse_kernel(q.device, q.dtype))


def _encode_with_lse(q, k, v, mask_BN, s: float, kernel: _kernels.LSEKernel | None):
    """:func:`encode_with_lse` on cast inputs with ``kernel`` (``None``: the explicit
    fallback); the tests hand in a CPU emulation of the CUDA kernel here."""
    B, H, M, D = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if k.shape[-2] == 0:
        z = q.new_zeros(B, H, M, v.shape[-1]) + 0.0 * (q.sum() + k.sum() + v.sum())
        return z, torch.full((B, H, M), float("-inf"), dtype=lse_dtype, device=q.device)
    has_key = None if mask_BN is None else mask_BN.any(dim=-1)
    if kernel is not None:
        bias = None if mask_BN is None else _key_bias(mask_BN, has_key, q.dtype)
        z, lse = _FusedEncodeWithLSE.apply(q, k, v, bias, s, kernel)
    else:
        z, lse = _explicit_encode_with_lse(q, k, v, mask_BN, s)
    lse = lse.to(lse_dtype)
    if mask_BN is not None:
        has_key = has_key[:, None, None]
        lse = torch.where(has_key, lse, torch.full_like(lse, float("-inf")))
        z = torch.where(has_key[..., None], z, torch.zeros_like(z))
    return z, lse


def merge_partials(z_RBHMD: torch.Tensor, lse_RBHM: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partial encodes over disjoint token sets (paper eq. 33).

    ``L = logsumexp_r L_r``, ``Z = sum_r exp(L_r - L) Z_r``. Partials with ``L_r = -inf``
    weigh zero; if every partial is ``-inf`` the result is ``Z = 0``, ``L = -inf``.
    """
    lse = torch.logsumexp(lse_RBHM, dim=0)
    finite = torch.isfinite(lse)
    safe_lse = torch.where(finite, lse, torch.zeros_like(lse))
    weights = torch.exp(lse_RBHM - safe_lse)
    weights = torch.where(finite.expand_as(weights), weights, torch.zeros_like(weights))
    z = (weights.unsqueeze(-1).to(z_RBHMD.dtype) * z_RBHMD).sum(dim=0)
    return z, lse


class AttentionBackend:
    """How a mixer executes its attention calls; swapped from outside the model.

    The default :data:`FUSED` runs the fused functions of this module. A subclass may
    override any method, e.g. a token-sharded ``encode`` that merges partials across ranks.
    """

    name = "fused"

    def encode(self, q, k, v, mask=None, *, scale=None):
        return encode(q, k, v, mask, scale=scale)

    def held_encode(self, q):
        """The result of the mixer's next encode if this backend already holds it, else
        ``None`` (the default: nothing is held).

        A backend that returns latents here counts the call as that encode, and the mixer
        skips computing the encode's keys and values: block-wise streaming holds an encode
        finished in an earlier pass over the chunks, so a later pass projects only what its
        own encode and the decode read (:class:`flarepp.distributed.StreamingBackend`).
        """
        return None

    def decode(self, k, q, z, mask=None, *, scale=None):
        return decode(k, q, z, mask, scale=scale)

    def self_attention(self, q, k, v, mask=None, *, scale=None):
        return self_attention(q, k, v, mask, scale=scale)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class FusedBackend(AttentionBackend):
    name = "fused"


FUSED = FusedBackend()


def set_backend(module: nn.Module, backend: AttentionBackend
                ) -> list[tuple[nn.Module, AttentionBackend]]:
    """Route every mixer inside ``module`` through ``backend``.

    Returns the ``(submodule, previous backend)`` pairs it replaced, so the caller can put
    them back (``flarepp.distributed.shardable.restore_backends``).
    """
    replaced = []
    for sub in module.modules():
        if isinstance(getattr(sub, "backend", None), AttentionBackend):
            replaced.append((sub, sub.backend))
            sub.backend = backend
    return replaced
