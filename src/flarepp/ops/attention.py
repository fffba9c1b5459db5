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
the generic fallback of ``encode_with_lse`` on devices without a wired-up LSE kernel.

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


def _key_mask(mask_BN: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask_BN is None else mask_BN[:, None, None, :]


def encode(q_BHMD: torch.Tensor, k_BHND: torch.Tensor, v_BHND: torch.Tensor,
           mask_BN: torch.Tensor | None = None, *, scale: float | None = None) -> torch.Tensor:
    """``Z = softmax_N(s Q K^T) V`` over the real tokens; ``[B, H, M, D]``."""
    q, k, v = _cast(q_BHMD, k_BHND, v_BHND)
    s = default_scale(q.shape[-1], scale)
    z = F.scaled_dot_product_attention(q, k, v, attn_mask=_key_mask(mask_BN), scale=s)
    if mask_BN is not None:  # a sample with no real token: Z = 0 on every backend
        z = z.masked_fill(~mask_BN.any(dim=-1)[:, None, None, None], 0.0)
    return z


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
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=_key_mask(mask_BN), scale=s)
    if mask_BN is not None:
        y = y.masked_fill(~mask_BN[:, None, :, None], 0.0)
    return y


class _FusedEncodeWithLSE(torch.autograd.Function):
    """Fused encode returning ``(Z, L)``; backward takes the cotangents of both (B.5).

    The local backward of B.5 is ``dS = P * (dZ V^T - c + dL)`` with ``c = rowsum(dZ * Z)``.
    The fused output-only backward computes ``P * (dZ' V'^T - rowsum(dZ' * Z'))``; padding
    the head width by one column, ``Q' = [Q, 0]``, ``K' = [K, 0]``, ``V' = [V, 1]``,
    ``Z' = [Z, 0]``, ``dZ' = [dZ, dL]``, leaves the scores unchanged and turns that into
    exactly the expression above, so one kernel call serves both cotangents.
    """

    @staticmethod
    def forward(ctx, q, k, v, additive_mask, scale):
        out, lse = _kernels.lse_attention_forward(q, k, v, additive_mask, scale)
        ctx.save_for_backward(q, k, v, out, lse, additive_mask)
        ctx.scale = scale
        ctx.has_mask = additive_mask is not None
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, additive_mask = ctx.saved_tensors
        if not ctx.has_mask:
            additive_mask = None
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is None:
            dq, dk, dv = _kernels.lse_attention_backward(
                dout, q, k, v, out, lse, additive_mask, ctx.scale)
        else:
            # Rows whose keys are all masked carry L = -inf upstream and a zero cotangent.
            dlse = torch.nan_to_num(dlse, nan=0.0, posinf=0.0, neginf=0.0)

            def pad(t, value):
                return F.pad(t, (0, 1), value=value)

            dq, dk, dv = _kernels.lse_attention_backward(
                torch.cat([dout, dlse.unsqueeze(-1).to(dout.dtype)], dim=-1),
                pad(q, 0.0), pad(k, 0.0), pad(v, 1.0), pad(out, 0.0), lse,
                additive_mask, ctx.scale)
            dq, dk, dv = dq[..., :-1], dk[..., :-1], dv[..., :-1]
        return dq, dk, dv, None, None


def _explicit_encode_with_lse(q, k, v, mask_BN, scale):
    """Generic fallback: materialises the scores (used where no LSE kernel is wired up)."""
    scores = scale * torch.matmul(q, k.transpose(-1, -2)).float()
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
    empty shard, a fully padded sample) give ``Z = 0`` and ``L = -inf``.
    """
    q, k, v = _cast(q_BHMD, k_BHND, v_BHND)
    s = default_scale(q.shape[-1], scale)
    B, H, M, D = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if k.shape[-2] == 0:
        z = q.new_zeros(B, H, M, v.shape[-1]) + 0.0 * (q.sum() + k.sum() + v.sum())
        return z, torch.full((B, H, M), float("-inf"), dtype=lse_dtype, device=q.device)
    if _kernels.has_lse_kernel(q.device):
        additive = None
        if mask_BN is not None:
            additive = torch.zeros(mask_BN.shape, dtype=q.dtype, device=q.device)
            additive = additive.masked_fill(~mask_BN, float("-inf"))[:, None, None, :]
        z, lse = _FusedEncodeWithLSE.apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                           additive, s)
    else:
        z, lse = _explicit_encode_with_lse(q, k, v, mask_BN, s)
    lse = lse.to(lse_dtype)
    if mask_BN is not None:
        has_key = mask_BN.any(dim=-1)[:, None, None]
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

    def decode(self, k, q, z, mask=None, *, scale=None):
        return decode(k, q, z, mask, scale=scale)

    def self_attention(self, q, k, v, mask=None, *, scale=None):
        return self_attention(q, k, v, mask, scale=scale)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class FusedBackend(AttentionBackend):
    name = "fused"


FUSED = FusedBackend()


def set_backend(module: nn.Module, backend: AttentionBackend) -> nn.Module:
    """Route every mixer inside ``module`` through ``backend``; returns ``module``."""
    for sub in module.modules():
        if hasattr(sub, "backend") and isinstance(sub.backend, AttentionBackend):
            sub.backend = backend
    return module
