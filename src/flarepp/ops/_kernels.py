"""Private ATen attention kernels that expose the row-wise log-sum-exp.

Every private ``torch.ops.aten`` call in flarepp lives in this module, so a PyTorch upgrade
that renames one touches one file. Shapes: q [B, H, M, D], k and v [B, H, N, D],
additive mask [B, 1, 1, N] (0 or -inf, q's dtype), out [B, H, M, D], lse [B, H, M].

CPU (checked on torch 2.13): ``_scaled_dot_product_flash_attention_for_cpu`` returns
``(out, lse)`` with ``lse`` in float32 for 16-bit inputs; its backward is the separate
``..._backward`` op. A row whose keys are all masked comes back as ``out = 0``, ``lse = 0``;
callers fix ``lse`` to ``-inf`` themselves.
"""

from __future__ import annotations

import torch

_aten = torch.ops.aten


def has_lse_kernel(device: torch.device) -> bool:
    """Whether a fused kernel returning the log-sum-exp is wired up for ``device``."""
    return device.type == "cpu" and hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu")


def lse_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          additive_mask: torch.Tensor | None, scale: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``softmax(scale q k^T + mask) v`` and its row-wise log-sum-exp."""
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=additive_mask, scale=scale)
    return out, lse


def lse_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                           additive_mask: torch.Tensor | None, scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v given the cotangent of ``out`` (the output-only backward).

    The kernel recomputes ``P = exp(scale q k^T + mask - lse)`` and uses
    ``c = rowsum(grad_out * out)``; :func:`flarepp.ops.attention.encode_with_lse` feeds it
    padded inputs to add the log-sum-exp cotangent (paper B.5).
    """
    grad_out = grad_out.contiguous()
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, False, attn_mask=additive_mask, scale=scale)
