"""Fake CUDA on a CPU-only PyTorch build: CUDA tensors without data, real autograd and autocast.

:func:`fake_cuda` loads ``fake_cuda.cpp`` (built once per torch version with
``torch.utils.cpp_extension`` into ``~/.cache/flarepp/``), which registers PyTorch's own
``c10::impl::FakeGuardImpl<CUDA>`` as the CUDA device guard and CUDA hooks that report one
available device, and enters ``FakeTensorMode``: every ``device="cuda"`` tensor created
inside is a fake tensor (shape, dtype, strides, storage size; no data), every op runs on its
meta shape function, and autograd and CUDA autocast run for real. On leaving, the hooks and
the guard are removed again, so the rest of the process is the CPU build it was.

:class:`EfficientAttentionRules`, a dispatch mode, checks every call of
``aten._scaled_dot_product_efficient_attention`` and its backward against that kernel's input
rules, as PyTorch states them for the memory-efficient (xFormers-derived) kernel:
``check_supported`` in ``kernel_forward.h`` and ``kernel_backward.h`` (under
``aten/src/ATen/native/transformers/cuda/mem_eff_attention/``) (strides and data pointers aligned to 128 bits, the last dim of
every input contiguous, an additive bias of the query's dtype and the full ``[B, H, M, N]``
shape, aligned strides), and the backward's wrapper in ``attention_backward.cu`` (``out``
read with row stride ``H * Dv``, i.e. laid out ``[B, M, H, Dv]``; the forward's
log-sum-exp, padded to a multiple of 32 rows). The bias rows must be stored up to a multiple
of 16 elements, as PyTorch's SDPA pads them (``preprocess_mask`` in ``attention.cpp``):
the kernel loads them in 16-byte vectors. 128-bit alignment is checked as 8 elements for
every dtype (the 16-bit kernels' rule; float32 needs 4), the stricter of the two.

What fake CUDA cannot see: any number a kernel computes (only shapes, dtypes, strides and
autograd wiring are real), which fused kernel ``F.scaled_dot_product_attention`` would pick
on a GPU (its CUDA selector is not in a CPU build: it runs its math decomposition here),
NCCL, CUDA streams and events, memory, and Inductor's CUDA code generation.

Shape letters: B batch, H heads, M query rows, N keys, D head width.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SOURCE = Path(__file__).with_name("fake_cuda.cpp")
ALIGN = 8  # 128 bits in 16-bit elements
LSE_ROWS = 32  # the forward's log-sum-exp rows are padded to a multiple of this
BIAS_ROW = 16  # bias rows are read in 16-element vectors

_aten = torch.ops.aten
_LIB: ctypes.CDLL | None = None


def _ninja_on_path() -> None:
    """Put this interpreter's ``bin`` (where the ``ninja`` wheel of the ``test`` extra
    installs its binary) on ``PATH``, behind any system ``ninja``."""
    scripts = os.path.dirname(sys.executable)
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + scripts


def unavailable_reason() -> str | None:
    """Why fake CUDA cannot be built here, or ``None`` when it can."""
    _ninja_on_path()
    if torch.cuda.is_available() or torch.backends.cuda.is_built():
        return "this torch is built with CUDA: the fake-CUDA tier is for CPU-only builds"
    from torch.utils import cpp_extension
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not on PATH) to build tests/fake_cuda/fake_cuda.cpp"
    if not cpp_extension.is_ninja_available():
        return "torch.utils.cpp_extension needs ninja to build tests/fake_cuda/fake_cuda.cpp"
    return None


def build_directory() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    path = root / "flarepp" / f"fake_cuda-torch{torch.__version__.replace('+', '-')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load() -> ctypes.CDLL:
    """Build (once per torch version; cached) and load the library."""
    global _LIB
    if _LIB is None:
        from torch.utils import cpp_extension
        _ninja_on_path()
        path = cpp_extension.load("flarepp_fake_cuda", [str(SOURCE)],
                                  build_directory=str(build_directory()),
                                  is_python_module=False, verbose=False)
        _LIB = ctypes.CDLL(path)
    return _LIB


@contextlib.contextmanager
def fake_cuda() -> Iterator[Any]:
    """Fake CUDA installed and ``FakeTensorMode`` entered; yields the mode.

    Autograd runs on the calling thread (the engine's per-device threads may have been
    sized before CUDA existed). The Python-level ``torch.cuda`` queries that autocast
    consults (``amp_definitely_not_available``, ``is_bf16_supported``) and
    ``torch.cuda.is_available`` answer as on a GPU machine with one device.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    lib = load()
    if not lib.flarepp_fake_cuda_install():
        raise RuntimeError("a real CUDA library is present: fake CUDA not installed")
    amp_common = torch.cuda.amp.common
    saved = (amp_common.amp_definitely_not_available, torch.cuda.is_bf16_supported,
             torch.cuda.is_available, torch.cuda.device_count)
    amp_common.amp_definitely_not_available = lambda: False
    torch.cuda.is_bf16_supported = lambda *a, **k: True
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    try:
        with torch.autograd.set_multithreading_enabled(False), FakeTensorMode() as mode, \
                _HostToDevice(mode):
            yield mode
    finally:
        (amp_common.amp_definitely_not_available, torch.cuda.is_bf16_supported,
         torch.cuda.is_available, torch.cuda.device_count) = saved
        lib.flarepp_fake_cuda_uninstall()


class _HostToDevice(TorchDispatchMode):
    """Host data copied to fake CUDA becomes a fake tensor without a value.

    FakeTensorMode keeps the value of one-element tensors (a "constant") and of tensors made
    from host data outside it, and runs ops on those for real: a copy of one to CUDA would
    then allocate on the real, absent device. An op that targets CUDA here gets such inputs
    as plain fake tensors instead (the values are never needed: nothing is computed).
    """

    def __init__(self, fake_mode) -> None:
        super().__init__()
        self.fake_mode = fake_mode

    def _plain(self, t):
        from torch._subclasses.fake_tensor import FakeTensor
        if not isinstance(t, torch.Tensor):
            return t
        if isinstance(t, FakeTensor):
            if t.constant is None:
                return t
            t = t.constant
        with torch._C._DisableTorchDispatch():  # a fresh copy: the converter memoises
            t = t.clone()
        return self.fake_mode.fake_tensor_converter.from_real_tensor(self.fake_mode, t,
                                                                      make_constant=False)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            args = tuple(self._plain(a) for a in args)
        return func(*args, **kwargs)


def to_fake_cuda(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every parameter and buffer replaced, in place, by a fake CUDA tensor
    of the same shape, dtype and ``requires_grad`` (shared tensors stay shared). Call inside
    :func:`fake_cuda` on a module built outside it (initialisers read values, which fake
    tensors do not have); ``Module.to`` cannot swap real tensors for fake ones."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device="cuda")
            made[id(t)] = (torch.nn.Parameter(new, requires_grad=t.requires_grad)
                           if parameter else new)
        return made[id(t)]

    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = fake(p, True)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = fake(b, False)
    return module


# ----------------------------------------------------------------------------- kernel rules

class KernelRuleError(RuntimeError):
    """An input the CUDA memory-efficient attention kernel would reject."""


def require(cond: bool, what: str) -> None:
    """Raise :class:`KernelRuleError` saying ``what`` unless ``cond``."""
    if not cond:
        raise KernelRuleError(f"efficient attention would reject this: {what}")


def require_qkv(q, k, v, bias) -> None:
    require(q.device.type == "cuda", f"inputs on {q.device}, not CUDA")
    require(q.dtype in (torch.float32, torch.float16, torch.bfloat16),
           f"dtype {q.dtype} (float32, float16 and bfloat16 only)")
    check_layout(q, k, v, bias)


def check_layout(q, k, v, bias) -> None:
    """The kernel's shape, stride, alignment and bias-padding rules for ``q [B, H, M, D]``,
    ``k, v [B, H, N, D]`` and an additive ``bias [B, H, M, N]``, whatever the device and
    dtype (PyTorch's ``check_supported`` in ``mem_eff_attention/kernel_forward.h`` and the
    backward wrapper in ``attention_backward.cu``); also what the CPU emulation in
    tests/test_kernels_cpu_emulation.py enforces."""
    require(q.dim() == k.dim() == v.dim() == 4, "q, k, v must be 4-D [B, H, X, D]")
    B, H, M, D = q.shape
    N = k.shape[2]
    require(k.shape[:2] == v.shape[:2] == (B, H) and v.shape[2] == N, "q, k, v shapes disagree")
    require(k.shape[3] == D, "q and k need the same head width")
    require(q.dtype == k.dtype == v.dtype, "q, k, v dtypes differ")
    for name, t in (("query", q), ("key", k), ("value", v)):
        require(t.stride(-1) == 1, f"{name}: last dim must be contiguous")
        require(t.shape[-1] % ALIGN == 0, f"{name}: head width {t.shape[-1]} is not a "
                                          f"multiple of {ALIGN}")
        require(all(s % ALIGN == 0 for s in t.stride()[:3]),
               f"{name} is not correctly aligned (strides {t.stride()})")
        require(t.storage_offset() % ALIGN == 0, f"{name}: misaligned data pointer")
    if bias is not None:
        require(bias.dtype == q.dtype, "invalid dtype for bias - should match query's dtype")
        require(tuple(bias.shape) == (B, H, M, N), f"attn_bias: wrong shape {tuple(bias.shape)}")
        require(bias.stride(3) == 1, "attn_bias: last dimension must be contiguous")
        require(all(s % ALIGN == 0 for s in bias.stride()[:3]),
               f"attn_bias is not correctly aligned (strides {bias.stride()})")
        require(bias.storage_offset() % ALIGN == 0, "attn_bias: misaligned data pointer")
        last_row = bias.storage_offset() + sum((n - 1) * s for n, s in
                                               zip(bias.shape[:3], bias.stride()[:3]))
        stored = bias.untyped_storage().nbytes() // bias.element_size()
        require(last_row + math.ceil(N / BIAS_ROW) * BIAS_ROW <= stored,
               "attn_bias rows are not padded to 16 elements")


def check_backward_layout(q, k, v, bias, grad_out, out, lse) -> None:
    """:func:`check_layout`, and the backward's own rules: ``grad_out`` and ``out`` of
    shape ``[B, H, M, Dv]`` with ``out`` laid out ``[B, M, H, Dv]`` in memory, and the
    forward's log-sum-exp padded to a multiple of ``LSE_ROWS`` rows."""
    check_layout(q, k, v, bias)
    B, H, M, _ = q.shape
    Dv = v.shape[-1]
    require(tuple(grad_out.shape) == tuple(out.shape) == (B, H, M, Dv),
            f"grad_out {tuple(grad_out.shape)} / out {tuple(out.shape)} shapes")
    require(out.stride(-1) == 1 and out.stride(2) == H * Dv and out.stride(1) == Dv,
            f"out must be laid out [B, M, H, Dv] in memory (row stride H * Dv), "
            f"strides {out.stride()}")
    require(tuple(lse.shape) == (B, H, math.ceil(M / LSE_ROWS) * LSE_ROWS),
            f"logsumexp must be the forward's padded one, got {tuple(lse.shape)}")


class EfficientAttentionRules(TorchDispatchMode):
    """Checks every efficient-attention call against the kernel's rules; records each call.

    ``calls`` holds ``(kind, shapes)`` per call: ``("forward", {...})`` or
    ``("backward", {...})`` with the head widths of q and v, so a test can also tell which
    backward path ran (the extra dL column widens v).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._scaled_dot_product_efficient_attention.default:
            self._forward(*args, **kwargs)
        elif func is _aten._scaled_dot_product_efficient_attention_backward.default:
            self._backward(*args, **kwargs)
        return func(*args, **kwargs)

    def _forward(self, q, k, v, bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                 *, scale=None):
        require_qkv(q, k, v, bias)
        require(compute_log_sumexp, "compute_log_sumexp must be True to get L")
        self.calls.append(("forward", {"q": tuple(q.shape), "v": tuple(v.shape),
                                       "dtype": q.dtype, "bias": bias is not None}))

    def _backward(self, grad_out, q, k, v, bias, out, lse, philox_seed, philox_offset,
                  dropout_p, grad_input_mask, is_causal=False, *, scale=None):
        require_qkv(q, k, v, bias)
        check_backward_layout(q, k, v, bias, grad_out, out, lse)
        require(grad_out.dtype == out.dtype == q.dtype, "grad_out / out dtype")
        require(lse.dtype == torch.float32, f"logsumexp dtype {lse.dtype}")
        require(dropout_p == 0.0, "no dropout")
        self.calls.append(("backward", {"q": tuple(q.shape), "v": tuple(v.shape),
                                        "dtype": q.dtype, "bias": bias is not None}))

    def count(self, kind: str) -> int:
        return sum(1 for k, _ in self.calls if k == kind)
