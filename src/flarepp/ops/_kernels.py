"""Private ATen attention kernels that expose the row-wise log-sum-exp, one per device type.

Every private ``torch.ops.aten`` call in flarepp lives in this module, so a PyTorch upgrade
that renames one touches one file. Shape letters: B batch, H heads, M query rows (latents),
N keys (tokens), D head width of queries and keys, Dv head width of values.

A :class:`LSEKernel` is the pair (forward, backward) of one fused kernel, reduced to a common
calling convention; :func:`flarepp.ops.attention.encode_with_lse` builds its inputs and its
two-cotangent backward (paper B.5) on top of it, identically for every device, so the only
device-specific code is the two small functions per kernel below.

Calling convention (what a caller must hand in, so that every kernel here accepts it):

* ``q [B, H, M, D]``, ``k [B, H, N, D]``, ``v [B, H, N, Dv]``: last dim contiguous, head
  widths multiples of ``head_multiple`` and, where ``equal_head_widths``, ``D = Dv`` (pad exactly: zero columns in ``q`` and ``k`` leave
  the scores unchanged, zero columns in ``v`` give zero output columns), strides and storage
  offsets multiples of it;
* ``bias``: ``None`` or an additive ``[B, H, M, N]`` tensor of ``q``'s dtype, 0 or -inf,
  last dim contiguous, other strides multiples of 16 (broadcast dims have stride 0), each row
  stored with room up to a multiple of 16 elements (the memory-efficient kernel loads it in
  16-byte vectors); PyTorch's own SDPA hands it the same layout (``preprocess_mask`` in
  ``aten/src/ATen/native/transformers/attention.cpp``). No row may be entirely -inf: the
  kernels disagree there (the CPU kernel returns 0 and a log-sum-exp of 0, the
  memory-efficient one divides by a zero sum);
* ``forward(q, k, v, bias, scale) -> (out [B, H, M, Dv], lse [B, H, M'], saved)``, ``lse``
  float32 (float64 for float64 inputs), ``M' >= M`` (rows past M are padding; slice them);
  ``saved`` is a tuple of tensors to hand back to the backward;
* ``backward(dout, q, k, v, bias, out, lse, saved, scale) -> (dq, dk, dv)``, the
  output-only backward: with ``P = exp(scale q k^T + bias - lse)`` and
  ``c = rowsum(dout * out)``, ``dS = P * (dout v^T - c)``, ``dq = scale dS k``,
  ``dk = scale dS^T q``, ``dv = P^T dout``. ``out`` must be laid out as ``[B, M, H, Dv]``
  in memory (viewed as ``[B, H, M, Dv]``), as the forward returns it: the memory-efficient
  backward reads it with row stride ``H * Dv``. ``lse`` is the forward's, padding included.

CPU (checked on torch 2.13): ``_scaled_dot_product_flash_attention_for_cpu`` and its
``_backward``; any head width (the backward wants the same for q, k and v) and dtype;
``lse`` float32 for 16-bit inputs.

CUDA: ``_scaled_dot_product_efficient_attention(q, k, v, bias, compute_log_sumexp=True,
dropout_p=0.0, is_causal=False, scale=s)`` and its ``_backward`` (the calls of NVIDIA
PhysicsNeMo's ``ReplicatedQSDPA``/``RingSDPA``, ``domain_parallel/shard_utils/
attention_patches.py``). Its ``lse`` has ``ceil(M / 32) * 32`` rows, the padding filled
with +inf (``kernel_forward.h``); float32, float16 and bfloat16 only; head widths padded to
multiples of 8 (the 16-bit kernels' 128-bit alignment, which covers float32's 4). The
dispatcher's bias rules (``check_supported`` in ``kernel_forward.h``, shape and stride checks
in ``attention_backward.cu``) are those listed above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

_aten = torch.ops.aten

BIAS_ROW_MULTIPLE = 16
"""Additive biases are stored in rows padded to this many elements (see the module doc)."""


@dataclass(frozen=True)
class LSEKernel:
    """A fused attention kernel returning the log-sum-exp, in the module's convention."""

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    head_multiple: int
    equal_head_widths: bool
    dtypes: tuple[torch.dtype, ...]


# ----------------------------------------------------------------------------- CPU

def _cpu_flash_forward(q, k, v, bias, scale):
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    return out, lse, ()


def _cpu_flash_backward(dout, q, k, v, bias, out, lse, saved, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=scale)


CPU_FLASH = LSEKernel(name="cpu-flash", forward=_cpu_flash_forward,
                      backward=_cpu_flash_backward, head_multiple=1, equal_head_widths=True,
                      dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16))


# ----------------------------------------------------------------------------- CUDA

def _cuda_efficient_forward(q, k, v, bias, scale):
    out, lse, philox_seed, philox_offset = _aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, False, scale=scale)
    return out, lse, (philox_seed, philox_offset)


def _cuda_efficient_backward(dout, q, k, v, bias, out, lse, saved, scale):
    philox_seed, philox_offset = saved
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, lse, philox_seed, philox_offset, 0.0,
        [True, True, True, False], False, scale=scale)
    return dq, dk, dv


CUDA_MEMORY_EFFICIENT = LSEKernel(name="cuda-memory-efficient", forward=_cuda_efficient_forward,
                                  backward=_cuda_efficient_backward, head_multiple=8,
                                  equal_head_widths=False,
                                  dtypes=(torch.float32, torch.bfloat16, torch.float16))


LSE_KERNELS: dict[str, LSEKernel] = {"cpu": CPU_FLASH, "cuda": CUDA_MEMORY_EFFICIENT}
"""The fused log-sum-exp kernel of each device type."""


def lse_kernel(device: torch.device, dtype: torch.dtype) -> LSEKernel | None:
    """The fused kernel for ``device`` and ``dtype``, or ``None`` where none is wired up
    (e.g. float64 on CUDA, which the memory-efficient kernel does not run)."""
    kernel = LSE_KERNELS.get(torch.device(device).type)
    return kernel if kernel is not None and dtype in kernel.dtypes else None
