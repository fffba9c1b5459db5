"""The CUDA log-sum-exp encode, everything but the kernel itself, checked on the CPU.

``encode_with_lse`` on CUDA runs ``aten._scaled_dot_product_efficient_attention`` and its
backward (:data:`flarepp.ops._kernels.CUDA_MEMORY_EFFICIENT`), which have no CPU kernel.
Everything around them -- head-width padding, the additive key bias and its row layout, the
slicing of the padded log-sum-exp, the extra value column that carries dL (B.5), the
autograd wiring, keyless samples -- is the same code on every device. Here it runs with
:data:`EMULATED_EFFICIENT`, explicit math with the CUDA kernel's calling convention that
also *rejects* what the CUDA kernel rejects (misaligned head widths and strides, a bias of
the wrong shape, dtype or row layout, an output in the wrong memory layout, an unpadded
log-sum-exp), returns what it returns (log-sum-exp rows padded to a multiple of 32 with +inf,
outputs laid out [B, M, H, D]) and gives NaN where its output is unspecified (a row whose
keys are all masked). The real op's argument binding is checked on the ``meta`` device,
where PyTorch registers shape functions for it.

The emulation differs from the kernel in one way, on purpose: it also runs float64 (the
kernel runs float32, float16 and bfloat16), so the wrapper is checked against the float64
explicit reference to 1e-10. Shape letters: B batch, H heads, M latents, N tokens, D width.
"""

from __future__ import annotations

import math

import pytest
import torch

from flarepp.ops import _kernels
from flarepp.ops.attention import _encode_with_lse, default_scale, encode_with_lse
from fake_cuda import LSE_ROWS, check_backward_layout, check_layout, require
from reference import explicit_encode_lse

TOL = dict(rtol=1e-10, atol=1e-10)


def _acc(t):
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def _bmhk(t):
    """Laid out [B, M, H, D] in memory, viewed [B, H, M, D], as the kernel returns."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _scores(q, k, bias, scale):
    s = scale * _acc(q) @ _acc(k).transpose(-1, -2)
    return s if bias is None else s + _acc(bias)


def emulated_forward(q, k, v, bias, scale):
    check_layout(q, k, v, bias)
    B, H, M, _ = q.shape
    s = _scores(q, k, bias, scale)
    lse = torch.logsumexp(s, dim=-1)  # -inf on a row whose keys are all masked
    out = torch.exp(s - lse.unsqueeze(-1)) @ _acc(v)  # NaN there: unspecified
    lse_padded = torch.full((B, H, math.ceil(M / LSE_ROWS) * LSE_ROWS), float("inf"),
                            dtype=lse.dtype)
    lse_padded[..., :M] = lse
    seed_offset = (torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64))
    return _bmhk(out.to(q.dtype)), lse_padded, seed_offset


def emulated_backward(dout, q, k, v, bias, out, lse, saved, scale):
    check_backward_layout(q, k, v, bias, dout, out, lse)
    M = q.shape[2]
    require(len(saved) == 2 and all(t.dtype == torch.int64 for t in saved),
            "philox seed and offset must be handed back")
    p = torch.exp(_scores(q, k, bias, scale) - lse[..., :M].unsqueeze(-1))
    dout, out = _acc(dout), _acc(out)
    ds = p * (dout @ _acc(v).transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    dq, dk, dv = scale * ds @ _acc(k), scale * ds.transpose(-1, -2) @ _acc(q), \
        p.transpose(-1, -2) @ dout
    return tuple(_bmhk(g.to(q.dtype)) for g in (dq, dk, dv))


EMULATED_EFFICIENT = _kernels.LSEKernel(
    name="emulated-cuda-memory-efficient", forward=emulated_forward,
    backward=emulated_backward, head_multiple=_kernels.CUDA_MEMORY_EFFICIENT.head_multiple,
    equal_head_widths=_kernels.CUDA_MEMORY_EFFICIENT.equal_head_widths,
    dtypes=(torch.float64,) + _kernels.CUDA_MEMORY_EFFICIENT.dtypes)


def _inputs(B=2, H=3, M=37, N=45, D=13, *, masked=True, keyless_sample=False, seed=1,
            dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def mk(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).to(device).requires_grad_(True)

    mask = None
    if masked:
        mask = torch.rand(B, N, generator=g) > 0.3
        mask[:, 0] = True
        if keyless_sample:
            mask[-1] = False
        mask = mask.to(device)
    return mk(B, H, M, D), mk(B, H, N, D), mk(B, H, N, D), mask


def _both_cotangent_grads(z, lse, inputs, seed=2):
    g = torch.Generator().manual_seed(seed)
    cz = torch.randn(z.shape, generator=g, dtype=torch.float64).to(z.dtype)
    cl = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    finite = torch.isfinite(lse)
    loss = (z * cz).sum() + torch.where(finite, lse * cl, torch.zeros_like(lse)).sum()
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("D", [8, 13, 16])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("scale", [None, 1.0])
def test_emulated_kernel_path_matches_float64_reference(D, masked, scale):
    """Outputs and the gradients from both cotangents (dZ and dL, B.5) against the explicit
    float64 reference, with M = 37 (log-sum-exp padding to 64 sliced off), N = 45 (bias rows
    padded to 48), head widths that need padding to 16 (13) and that do not (8, 16). A
    failure in the gradient points at the extra value column of _FusedEncodeWithLSE; a
    RuntimeError from the emulation names the kernel rule the wrapper broke."""
    q, k, v, mask = _inputs(D=D, masked=masked)
    s = default_scale(D, scale)
    z, lse = _encode_with_lse(q, k, v, mask, s, EMULATED_EFFICIENT)
    zr, lr = explicit_encode_lse(q, k, v, mask, scale=scale)
    torch.testing.assert_close(z, zr, **TOL)
    torch.testing.assert_close(lse, lr, **TOL)
    got = _both_cotangent_grads(z, lse, (q, k, v))
    want = _both_cotangent_grads(zr, lr, (q, k, v))
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("used", ["z", "lse"])
def test_emulated_kernel_path_with_one_cotangent(used):
    """Only Z used (the output-only backward, no extra column) or only L used (dZ = 0)."""
    q, k, v, mask = _inputs(D=12)
    z, lse = _encode_with_lse(q, k, v, mask, default_scale(12, None), EMULATED_EFFICIENT)
    zr, lr = explicit_encode_lse(q, k, v, mask)
    out, ref = (z, zr) if used == "z" else (lse, lr)
    cot = torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out)
    got = torch.autograd.grad(out, (q, k, v), cot)
    want = torch.autograd.grad(ref, (q, k, v), cot, allow_unused=True)  # L has no dV
    for a, b, t in zip(got, want, (q, k, v)):
        torch.testing.assert_close(a, torch.zeros_like(t) if b is None else b, **TOL)


def test_emulated_kernel_path_keyless_sample_and_empty_shard():
    """A sample with no real token gives Z = 0, L = -inf and exactly zero gradients; the
    emulated kernel returns NaN for a row whose keys are all masked, so a wrapper that
    handed it one would fail here (NaN in Z's backward). An empty shard (N = 0) never calls
    the kernel and gives the same."""
    q, k, v, mask = _inputs(keyless_sample=True)
    z, lse = _encode_with_lse(q, k, v, mask, default_scale(13, None), EMULATED_EFFICIENT)
    zr, lr = explicit_encode_lse(q, k, v, mask)
    assert torch.isneginf(lse[-1]).all() and (z[-1] == 0).all()
    torch.testing.assert_close(z, zr, **TOL)
    torch.testing.assert_close(lse, lr, **TOL)
    got = _both_cotangent_grads(z, lse, (q, k, v))
    want = _both_cotangent_grads(zr, lr, (q, k, v))
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **TOL)
    assert all((g[-1] == 0).all() for g in got)

    q, k, v, _ = _inputs(N=0, masked=False)
    z0, l0 = _encode_with_lse(q, k, v, None, 0.5, EMULATED_EFFICIENT)
    assert torch.isneginf(l0).all() and (z0 == 0).all()
    assert all(g is not None and (g == 0).all()
               for g in torch.autograd.grad(z0.sum(), (q, k, v), allow_unused=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_emulated_kernel_path_low_precision(dtype):
    """The kernel's own dtypes: L comes back float32, Z in the input dtype, and both agree
    with the float64 reference to the dtype's rounding (a failure at 16 bits that passes in
    float32 points at the dL column being rounded to the input dtype)."""
    q, k, v, mask = _inputs(D=16, dtype=dtype)
    z, lse = _encode_with_lse(q, k, v, mask, default_scale(16, None), EMULATED_EFFICIENT)
    assert z.dtype == dtype and lse.dtype == torch.float32
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    zr, lr = explicit_encode_lse(q64, k64, v64, mask)
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(z.double(), zr, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), lr, rtol=tol, atol=tol)
    got = _both_cotangent_grads(z, lse, (q, k, v))
    want = _both_cotangent_grads(zr, lr, (q64, k64, v64))
    for a, b in zip(got, want):
        scale = max(1.0, b.abs().max().item())
        assert (a.double() - b).abs().max().item() <= 4 * tol * scale


def test_emulation_rejects_what_the_kernel_rejects():
    """The emulation is only a meaningful stand-in if it refuses the inputs the CUDA kernel
    refuses: unpadded head widths, a compact [B, 1, 1, N] bias, a bias with unpadded rows,
    an output in [B, H, M, D] layout, a sliced log-sum-exp."""
    B, H, M, N, D = 2, 2, 5, 20, 13
    q, k, v = torch.randn(B, H, M, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    with pytest.raises(RuntimeError, match="head width 13"):
        emulated_forward(q, k, v, None, 0.3)
    q, k, v = (torch.nn.functional.pad(t, (0, 3)) for t in (q, k, v))
    compact = torch.zeros(B, 1, 1, N)
    with pytest.raises(RuntimeError, match="wrong shape"):
        emulated_forward(q, k, v, compact, 0.3)
    with pytest.raises(RuntimeError, match="aligned"):  # row stride 20
        emulated_forward(q, k, v, compact.expand(B, H, M, N), 0.3)
    rows = torch.zeros(B, 24)  # row stride aligned, but the last row ends at 44 < 48
    with pytest.raises(RuntimeError, match="padded to 16"):
        emulated_forward(q, k, v, rows[:, None, None, :N].expand(B, H, M, N), 0.3)
    bias = torch.zeros(B, 32)[:, None, None, :N].expand(B, H, M, N)
    out, lse, saved = emulated_forward(q, k, v, bias, 0.3)
    assert lse.shape == (B, H, 32) and torch.isposinf(lse[..., M:]).all()
    with pytest.raises(RuntimeError, match="laid out"):
        emulated_backward(out, q, k, v, bias, out.contiguous(), lse, saved, 0.3)
    with pytest.raises(RuntimeError, match="padded one"):
        emulated_backward(out, q, k, v, bias, out, lse[..., :M], saved, 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_kernel_calls_bind_on_the_meta_device(dtype, masked):
    """The real CUDA op calls of _kernels.CUDA_MEMORY_EFFICIENT, forward and both-cotangent
    backward, through the same wrapper, on meta tensors: a failure means an argument the op
    schema does not accept, or shapes and dtypes that differ from what the wrapper expects
    (checked on torch's registered shape functions, not on the kernel)."""
    q, k, v, mask = _inputs(D=13, dtype=dtype, device="meta", masked=masked)
    z, lse = _encode_with_lse(q, k, v, mask, 0.25, _kernels.CUDA_MEMORY_EFFICIENT)
    assert z.shape == (2, 3, 37, 13) and z.dtype == dtype
    assert lse.shape == (2, 3, 37) and lse.dtype == torch.float32
    grads = torch.autograd.grad((z.float().sum() + lse.sum()), (q, k, v))
    assert [tuple(g.shape) for g in grads] == [tuple(t.shape) for t in (q, k, v)]
    assert all(g.dtype == dtype for g in grads)


def test_kernel_registry_per_device_and_dtype():
    """CPU always has its flash kernel; CUDA the memory-efficient one, except in float64,
    which falls back to the explicit encode (stated in the README)."""
    assert _kernels.lse_kernel(torch.device("cpu"), torch.float64) is _kernels.CPU_FLASH
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert _kernels.lse_kernel(torch.device("cuda", 1), dtype) \
            is _kernels.CUDA_MEMORY_EFFICIENT
    assert _kernels.lse_kernel(torch.device("cuda"), torch.float64) is None
    assert _kernels.lse_kernel(torch.device("meta"), torch.float32) is None


def test_cpu_path_runs_the_cpu_kernel_with_the_same_wrapper():
    """The public encode_with_lse on the CPU is the wrapper above with the CPU flash kernel
    (its backward needs equal head widths: the dL column is added to Q and K as zeros)."""
    q, k, v, mask = _inputs(D=5, keyless_sample=True)
    z, lse = encode_with_lse(q, k, v, mask)
    zr, lr = explicit_encode_lse(q, k, v, mask)
    torch.testing.assert_close(z, zr, **TOL)
    torch.testing.assert_close(lse, lr, **TOL)
    for a, b in zip(_both_cotangent_grads(z, lse, (q, k, v)),
                    _both_cotangent_grads(zr, lr, (q, k, v))):
        torch.testing.assert_close(a, b, **TOL)


def test_float64_explicit_fallback_is_float64_accurate():
    """The explicit fallback (float64 on CUDA: no fused kernel runs float64) matches the
    float64 reference to 1e-12 on Z, L and the gradients of both cotangents. A failure of
    order 1e-7 means its scores or log-sum-exp were formed in float32."""
    q, k, v, mask = _inputs(D=13, keyless_sample=True)
    z, lse = _encode_with_lse(q, k, v, mask, default_scale(13, None), None)
    zr, lr = explicit_encode_lse(q, k, v, mask)
    assert z.dtype == lse.dtype == torch.float64
    tight = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z, zr, **tight)
    torch.testing.assert_close(lse, lr, **tight)
    for a, b in zip(_both_cotangent_grads(z, lse, (q, k, v)),
                    _both_cotangent_grads(zr, lr, (q, k, v))):
        torch.testing.assert_close(a, b, **tight)


def _recording(kernel, widths):
    """``kernel`` with the value head width of every backward call appended to ``widths``."""
    def backward(dout, q, k, v, *rest):
        widths.append(v.shape[-1])
        return kernel.backward(dout, q, k, v, *rest)
    return _kernels.LSEKernel(name=kernel.name + "-recording", forward=kernel.forward,
                              backward=backward, head_multiple=kernel.head_multiple,
                              equal_head_widths=kernel.equal_head_widths, dtypes=kernel.dtypes)


@pytest.mark.parametrize("D", [16, 64])
def test_unused_lse_takes_the_output_only_backward(D):
    """When only Z reaches the loss, the backward must run the kernel at the forward's
    value width (D = 16 -> 16, not 24; D = 64 -> 64, not 72): autograd hands a None
    cotangent for the unused L only when materialised gradients are off. A width of
    round_up(D + 1, 8) here means the extra dL column is back on every backward."""
    widths = []
    kernel = _recording(EMULATED_EFFICIENT, widths)
    q, k, v, mask = _inputs(D=D, M=8, N=20)
    z, _ = _encode_with_lse(q, k, v, mask, default_scale(D, None), kernel)
    got = torch.autograd.grad(z.sum(), (q, k, v))
    assert widths == [D]
    zr, _ = explicit_encode_lse(q, k, v, mask)
    for a, b in zip(got, torch.autograd.grad(zr.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, **TOL)
    widths.clear()
    z, lse = _encode_with_lse(q, k, v, mask, default_scale(D, None), kernel)
    torch.autograd.grad(z.sum() + lse.sum(), (q, k, v))
    assert widths == [D + 8]  # both used: the dL column, padded to the next multiple of 8


def test_fp16_dl_column_survives_a_loss_scale():
    """float16 with a GradScaler-sized cotangent on L (2^16 x O(1), above float16's 65504):
    the gradients stay finite and match the float64 reference. Non-finite gradients here
    mean the float32 dL was cast to float16 unscaled (the scaler would then skip every
    step that uses L, i.e. every context-parallel or streamed fp16 step)."""
    q, k, v, mask = _inputs(D=16, M=8, N=24, dtype=torch.float16)
    z, lse = _encode_with_lse(q, k, v, mask, default_scale(16, None), EMULATED_EFFICIENT)
    g = torch.Generator().manual_seed(3)
    cz = torch.randn(z.shape, generator=g, dtype=torch.float64)
    cl = 2.0 ** 16 * torch.randn(lse.shape, generator=g, dtype=torch.float64)
    assert cl.abs().max() > 65504
    got = torch.autograd.grad((z, lse), (q, k, v), (cz.half(), cl.float()))
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    zr, lr = explicit_encode_lse(q64, k64, v64, mask)
    want = torch.autograd.grad((zr, lr), (q64, k64, v64), (cz, cl))
    for name, a, b in zip("qkv", got, want):
        assert torch.isfinite(a).all(), f"d{name} is not finite"
        assert b.abs().max() < 60000  # the true gradient fits float16
        err = (a.double() - b).abs().max().item()
        assert err <= 1e-2 * max(1.0, b.abs().max().item()), f"d{name}: error {err:.3g}"
