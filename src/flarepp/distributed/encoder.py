"""The exact token-sharded encoder (paper Appendix B.2-B.5) and its collectives.

Shape letters: B batch, H heads, M latents, D head width, N tokens (N_r on rank r).

Rank r of a process group holds a shard ``K_r, V_r [B, H, N_r, D]`` of the keys and values
and the replicated queries ``Q [B, H, M, D]``. The fused local encode returns
``Z_r = softmax(s Q K_r^T) V_r`` and its row-wise log-sum-exp ``L_r`` (B.2, B.3); the exact
global encode is the merge (eq. 33)

    ``L = log sum_r exp(L_r)``,    ``Z = sum_r exp(L_r - L) Z_r``,

computed with two all-reduces of ``O(B H M (D + 1))`` each (a max for the shift, then the
sum of ``[w_r Z_r, w_r]`` with ``w_r = exp(L_r - max_r L_r)``), never with the tokens.

Backward (B.5). Differentiating the merge gives, with ``w_r = exp(L_r - L)``,

    ``dZ_r = w_r dZ``,    ``dL_r = w_r (dL + <dZ, Z_r - Z>_D)``,

where ``dZ``, ``dL`` are the *global* cotangents of the replicated ``Z``, ``L``: each
rank's decoder only sees its own tokens, so every rank holds a partial cotangent and the
merge's backward sums them over the group (eq. 39) before applying the formula. ``dZ_r`` and
``dL_r`` then go through the fused local backward of :func:`flarepp.ops.encode_with_lse`,
which takes the cotangents of both outputs, giving this rank's ``dK_r``, ``dV_r`` exactly
and its share of ``dQ = s sum_r dS_r K_r``.

Gradient convention. Every replicated tensor (``Q``, ``Z``, the parameters) carries on each
rank a *partial* cotangent whose sum over the group is the true one; token tensors carry
their true cotangent. The merge reduces ``dZ`` and ``dL`` because its local backward is
needed per rank; the query's share is *not* reduced inside the encoder: it flows on (into the
synthesis encode of FLARE++, whose own merge reduces it, or into the latent parameters), and
the replicated parameters' gradients are summed once after backward
(:func:`flarepp.distributed.all_reduce_gradients`). Reducing ``dQ`` here as well would count
the decoders' contributions to the query's cotangent (which are per-rank partials) once and
the encoder's R times; with this convention nothing is ever counted twice.
"""

from __future__ import annotations

import os
import zlib

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from flarepp.ops import encode_with_lse


DEBUG_CHECKS = "FLAREPP_DEBUG_CHECKS"
"""Environment switch (``1``) for the consistency checks that cost a host sync or a
collective per call: the ranks' agreement on the encoder's shapes, the streamed queries'
agreement across chunks. Off by default: they sit inside every forward pass."""


def debug_checks() -> bool:
    """Whether :data:`DEBUG_CHECKS` is on (read at each call, so a test can switch it)."""
    return os.environ.get(DEBUG_CHECKS, "0").strip().lower() in ("1", "true", "yes", "on")


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF


def check_same_across_ranks(values: list[int], group: dist.ProcessGroup, what: str,
                            device: torch.device) -> None:
    """Raise on every rank unless ``values`` is the same list on every rank of ``group``.

    One all-reduce (max of ``[v, -v]``) of a few integers; run it before a collective whose
    tensor sizes derive from ``values``, since gloo reduces mismatched sizes into garbage or
    hangs instead of failing.
    """
    local = torch.tensor(values, dtype=torch.int64, device=device)
    both = torch.cat([local, -local])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both[: len(values)], -both[len(values):]
    if not torch.equal(high, low):
        raise RuntimeError(
            f"context parallel: ranks disagree on {what}: this rank (group rank "
            f"{dist.get_rank(group)}) has {values}, the group's element-wise min is "
            f"{low.tolist()} and max {high.tolist()}. Every rank must run the same model "
            "config on the same batch of samples, split along the tokens only.")


class _MergeAcrossRanks(torch.autograd.Function):
    """``(Z_r, L_r) -> (Z, L)`` over ``group`` (eq. 33); backward as in the module docstring."""

    @staticmethod
    def forward(ctx, z_r, l_r, group, check_shapes):
        if check_shapes:
            check_same_across_ranks(
                [*z_r.shape, _dtype_code(z_r.dtype), _dtype_code(l_r.dtype)], group,
                "the encoder's latent shape [B, H, M, D] and dtypes", z_r.device)
        acc = l_r.dtype  # float32 for 16-bit inputs, float64 for float64
        # Collectives see storage order: every buffer must be contiguous, since the fused
        # kernel's L may be strided differently from an empty shard's.
        shift = l_r.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        weight = torch.exp(l_r - shift)  # 0 where L_r = -inf, at most 1
        packed = torch.cat([weight.unsqueeze(-1) * z_r.to(acc), weight.unsqueeze(-1)],
                           dim=-1).contiguous()
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        total = packed[..., -1]
        lse = shift + torch.log(total)  # -inf exactly where every rank had -inf
        z = packed[..., :-1] / torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)
        ctx.save_for_backward(z_r, l_r, z, lse)
        ctx.group = group
        return z.to(z_r.dtype), lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dz, dlse):
        z_r, l_r, z, lse = ctx.saved_tensors
        acc = l_r.dtype
        packed = torch.cat([dz.to(acc), dlse.to(acc).unsqueeze(-1)], dim=-1).contiguous()
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=ctx.group)  # eq. 39
        dz_full, dlse_full = packed[..., :-1], packed[..., -1]
        finite = torch.isfinite(lse)
        weight = torch.exp(l_r - torch.where(finite, lse, torch.zeros_like(lse)))
        weight = torch.where(finite, weight, torch.zeros_like(weight))
        dz_r = weight.unsqueeze(-1) * dz_full
        dl_r = weight * (dlse_full + (dz_full * (z_r.to(acc) - z)).sum(dim=-1))
        return dz_r.to(z_r.dtype), dl_r.to(l_r.dtype), None, None


def merge_across_ranks(z_r_BHMD: torch.Tensor, lse_r_BHM: torch.Tensor,
                       group: dist.ProcessGroup, *, check_shapes: bool | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact, differentiable merge of per-rank partial encodes ``(Z_r, L_r)`` (eq. 33).

    ``check_shapes`` (default: :func:`debug_checks`) first all-reduces the shapes and
    dtypes and compares them on the host."""
    check = debug_checks() if check_shapes is None else check_shapes
    return _MergeAcrossRanks.apply(z_r_BHMD, lse_r_BHM, group, check)


def distributed_encode_with_lse(q_BHMD: torch.Tensor, k_BHND: torch.Tensor,
                                v_BHND: torch.Tensor, mask_BN: torch.Tensor | None = None, *,
                                group: dist.ProcessGroup, scale: float | None = None,
                                check_shapes: bool | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact encode over the union of every rank's tokens: ``(Z, L)``, replicated.

    ``k``, ``v`` and ``mask`` hold this rank's tokens (``N_r`` may differ across ranks and
    may be 0); ``q`` must be the same on every rank. A row with no real key on any rank
    gives ``Z = 0``, ``L = -inf``. ``check_shapes`` (default: on under
    :data:`DEBUG_CHECKS`) adds one tiny all-reduce and a host sync that turn a shape or
    dtype mismatch between ranks into an error instead of a wrong result or a hang.
    """
    z_r, lse_r = encode_with_lse(q_BHMD, k_BHND, v_BHND, mask_BN, scale=scale)
    return merge_across_ranks(z_r, lse_r, group, check_shapes=check_shapes)


class _GlobalSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def global_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``sum_r x_r``, replicated, differentiable under the partial-cotangent convention.

    Its backward sums the per-rank cotangents. A loss built from it is the same on every
    rank, so each rank must back-propagate ``loss / world_size`` (the ranks' shares of the
    replicated loss add up to one); e.g. a per-sample relative L2 over a sharded mesh is
    ``sqrt(global_sum(sum_n |e|^2)) / sqrt(global_sum(sum_n |y|^2))``.
    """
    return _GlobalSum.apply(x, group)
