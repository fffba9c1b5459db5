"""The CUDA code paths, run on a CPU-only build with fake CUDA tensors (tests/fake_cuda/).

flarepp's CUDA branches (the memory-efficient log-sum-exp kernel behind ``encode_with_lse``,
CUDA autocast in every mixer, context parallelism and streaming with CUDA tensors, the
trainer on ``cuda``) are executed here with real autograd and real CUDA autocast on tensors
that carry shapes, dtypes and strides but no data. Every call of the CUDA efficient-attention
kernel, forward and backward, goes through a checker of that kernel's input rules
(:class:`fake_cuda.EfficientAttentionRules`): a failure names the rule the wrapper broke.

What this tier cannot see: numbers (every result is a fake tensor; kernel numerics are
checked against float64 by tests/test_cuda.py on a GPU, and by the CPU emulation in
tests/test_kernels_cpu_emulation.py), which fused kernel F.scaled_dot_product_attention picks
on a GPU (it runs its math decomposition here), NCCL, CUDA streams and memory, Inductor on
CUDA. Mixers whose control flow depends on tensor values (``abupt``'s anchor selection and
the causal scans' chunking read data) cannot run on fake tensors and are listed in
VALUE_DEPENDENT with the reason.

Skipped, with the reason, where no C++ compiler (or ninja) is available to build the
extension, and on CUDA builds of torch. Shape letters: B batch, H heads, M latents, N tokens,
D head width, C channels.
"""

from __future__ import annotations

import pytest
import torch

import fake_cuda
from fake_cuda import EfficientAttentionRules, KernelRuleError
from flarepp.ops import _kernels
from flarepp.ops.attention import _encode_with_lse, default_scale, encode_with_lse

_REASON = fake_cuda.unavailable_reason()
pytestmark = [pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
              pytest.mark.xdist_group("fake_cuda")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def _built():
    """Build (or load from the cache) the extension once; a build error is a failure."""
    fake_cuda.load()


def _inputs(B, H, M, N, D, dtype, *, masked, keyless=False):
    q, k, v = (torch.randn(*s, device="cuda", dtype=dtype).requires_grad_(True)
               for s in ((B, H, M, D), (B, H, N, D), (B, H, N, D)))
    mask = None
    if masked:
        mask = torch.ones(B, N, dtype=torch.bool, device="cuda")
        if keyless:
            mask[-1] = False
    return q, k, v, mask


def test_fake_cuda_installs_and_uninstalls():
    """Inside: CUDA tensors, CUDA autocast active, autograd on them; outside: the CPU build
    again (no accelerator), so the rest of the worker's tests see what they always saw."""
    with fake_cuda.fake_cuda():
        x = torch.randn(3, 4, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = x @ x.T
        assert y.device.type == "cuda" and y.dtype == torch.bfloat16
        (g,) = torch.autograd.grad(y.float().sum(), x)
        assert g.device.type == "cuda" and g.shape == x.shape
    assert torch._C._get_accelerator().type == "cpu"
    assert not torch.cuda.is_available()


def test_checker_rejects_what_the_kernel_rejects():
    """The checker is only worth its name if it refuses what the kernel refuses: a head
    width not a multiple of 8, a compact [B, 1, 1, N] bias, unpadded bias rows, a sliced
    log-sum-exp, an output in [B, H, M, D] memory layout."""
    aten = torch.ops.aten
    with fake_cuda.fake_cuda(), EfficientAttentionRules():
        q, k, v = (torch.randn(2, 2, 5, 13, device="cuda") for _ in range(3))
        with pytest.raises(KernelRuleError, match="head width 13"):
            aten._scaled_dot_product_efficient_attention(q, k, v, None, True)
        q, k, v = (torch.randn(2, 2, x, 16, device="cuda") for x in (5, 20, 20))
        with pytest.raises(KernelRuleError, match="wrong shape"):
            aten._scaled_dot_product_efficient_attention(q, k, v, torch.zeros(2, 1, 1, 20,
                                                                              device="cuda"), True)
        rows = torch.zeros(2, 24, device="cuda")[:, None, None, :20].expand(2, 2, 5, 20)
        with pytest.raises(KernelRuleError, match="padded to 16"):
            aten._scaled_dot_product_efficient_attention(q, k, v, rows, True)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None,
                                                                              True)
        assert lse.shape == (2, 2, 32)
        with pytest.raises(KernelRuleError, match="padded one"):
            aten._scaled_dot_product_efficient_attention_backward(
                out, q, k, v, None, out, lse[..., :5], seed, offset, 0.0,
                [True, True, True, False], False)
        with pytest.raises(KernelRuleError, match="laid out"):
            aten._scaled_dot_product_efficient_attention_backward(
                out, q, k, v, None, out.contiguous(), lse, seed, offset, 0.0,
                [True, True, True, False], False)


CASES = {  # (B, H, M, N, D): the awkward sizes of the issue
    "D13-M37-N45": (2, 3, 37, 45, 13),   # D not a multiple of 8, M not of 32, N not of 16
    "D16-M32-N1": (2, 2, 32, 1, 16),     # a single token
    "D64-M1-N33": (1, 2, 1, 33, 64),     # one latent, the next kernel tier's width
    "D5-M64-N16": (3, 1, 64, 16, 5),     # one head
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("used", ["both", "z", "lse"])
def test_cuda_encode_with_lse_keeps_the_kernel_rules(dtype, case, masked, used):
    """encode_with_lse on CUDA runs the efficient-attention kernel, forward and backward,
    within its input rules, for every cotangent combination; Z and the gradients come back
    in the input dtype, L in float32; the backward runs once, with the dL value column
    (v widened to round_up(D + 1, 8)) only when L is used."""
    B, H, M, N, D = CASES[case]
    with fake_cuda.fake_cuda(), EfficientAttentionRules() as rules:
        q, k, v, mask = _inputs(B, H, M, N, D, dtype, masked=masked, keyless=masked)
        assert _kernels.lse_kernel(q.device, dtype) is _kernels.CUDA_MEMORY_EFFICIENT
        z, lse = encode_with_lse(q, k, v, mask)
        assert z.shape == (B, H, M, D) and z.dtype == dtype and z.device.type == "cuda"
        assert lse.shape == (B, H, M) and lse.dtype == torch.float32
        outputs = {"both": (z.float().sum() + lse.sum(),), "z": (z.float().sum(),),
                   "lse": (lse.sum(),)}[used]
        grads = torch.autograd.grad(outputs, (q, k, v), allow_unused=True)
        assert rules.count("forward") == 1 and rules.count("backward") == 1
        (_, backward), = [c for c in rules.calls if c[0] == "backward"]
        pad = -(-D // 8) * 8
        widened = -(-(D + 1) // 8) * 8
        assert backward["v"][-1] == (pad if used == "z" else widened), backward
        for g, t in zip(grads, (q, k, v)):
            if g is not None:
                assert g.shape == t.shape and g.dtype == dtype and g.device.type == "cuda"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_encode_with_lse_under_autocast(dtype):
    """Called with float32 inputs inside CUDA autocast (as the mixers do), the kernel sees
    the autocast dtype; gradients come back float32 to the float32 leaves."""
    with fake_cuda.fake_cuda(), EfficientAttentionRules() as rules:
        q, k, v, mask = _inputs(2, 2, 8, 40, 16, torch.float32, masked=True)
        with torch.autocast("cuda", dtype=dtype):
            z, lse = encode_with_lse(q, k, v, mask)
        grads = torch.autograd.grad(z.float().sum() + lse.sum(), (q, k, v))
        assert all(call["dtype"] == dtype for _, call in rules.calls)
        assert all(g.dtype == torch.float32 for g in grads)


def test_cuda_float64_takes_the_explicit_path():
    """float64 on CUDA has no fused kernel: the explicit fallback runs, in float64."""
    with fake_cuda.fake_cuda(), EfficientAttentionRules() as rules:
        q, k, v, mask = _inputs(2, 2, 8, 40, 16, torch.float64, masked=True)
        z, lse = encode_with_lse(q, k, v, mask)
        assert z.dtype == lse.dtype == torch.float64 and rules.calls == []
        torch.autograd.grad(z.sum() + lse.sum(), (q, k, v))


# ----------------------------------------------------------------------------- mixers

from flarepp.mixers import MIXERS  # noqa: E402

import flarepp  # noqa: E402

VALUE_DEPENDENT = {}
"""Mixers that cannot run on fake tensors: their control flow reads tensor values."""

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _surrogate(name, precision):
    torch.manual_seed(0)
    norm = "layernorm" if precision == "fp32" else "rmsnorm"
    model = flarepp.build_model(mixer=name, in_dim=3, out_dim=2, blocks=2, dim=32, heads=2,
                                latents=8, norm=norm)
    mixer = model.blocks[0].mixer
    if getattr(mixer, "stochastic_in_training", False):
        model.eval()
    return model, getattr(mixer, "supports_mask", True)


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", MIXERS.names())
def test_every_mixer_in_the_surrogate_on_cuda(name, precision):
    """The surrogate around each registered mixer, built on CUDA, forward and backward under CUDA autocast (fp32: none) with a padding mask: output on
    CUDA in the autocast dtype's reach, every parameter gets a CUDA float32 gradient, and
    every efficient-attention call keeps the kernel's rules. A failure here is a
    CUDA-only shape, dtype, device or autocast defect in that mixer."""
    if name in VALUE_DEPENDENT:
        pytest.skip(VALUE_DEPENDENT[name])
    dtype = PRECISIONS[precision]
    with fake_cuda.fake_cuda(), EfficientAttentionRules():
        with torch.device("cuda"):
            model, masks = _surrogate(name, precision)
        x = torch.randn(2, 40, 3, device="cuda")
        mask = torch.ones(2, 40, dtype=torch.bool, device="cuda") if masks else None
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            y = model(x, mask=mask)
        assert y.device.type == "cuda" and y.shape == (2, 40, 2)
        y.float().square().mean().backward()
        for pname, p in model.named_parameters():
            if p.requires_grad:
                assert p.grad is not None, f"{pname} got no gradient"
                assert p.grad.device.type == "cuda" and p.grad.dtype == torch.float32, pname
