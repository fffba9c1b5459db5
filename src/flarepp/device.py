"""Devices and numeric precision: one place that turns a user's choice into torch objects.

``--device auto`` means ``cuda:LOCAL_RANK`` when CUDA is available (``LOCAL_RANK`` is set by
``torchrun``; 0 otherwise) and the CPU otherwise. Precision follows the paper (C.2): FP32
runs with no autocast; ``bf16`` / ``fp16`` runs autocast the forward to that dtype on the
model's device (FP16 with a gradient scaler, BF16 without).
"""

from __future__ import annotations

import contextlib
import os

import torch

HOST = torch.device("cpu")
"""The host: where checkpoints are staged when read (so a run saved on a GPU loads on a
machine without one, and the other way round) and where streamed hidden states may live."""
PRECISIONS = ("fp32", "bf16", "fp16")
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_HELP = ("run the model under this autocast instead of the checkpoint's own precision "
                  "(default): bf16 = BF16 matrix products with FP32 accumulation, faster "
                  "where the hardware has BF16 dot products; compare its metrics with fp32 "
                  "before relying on it (paper D.2)")
DEVICE_HELP = ("auto (cuda:LOCAL_RANK when CUDA is available, else cpu), cpu, cuda or "
               "cuda:K")


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """``"auto"``/``None`` -> ``cuda:LOCAL_RANK`` or the CPU; ``"cuda"`` -> ``cuda:LOCAL_RANK``.

    Raises ``ValueError`` with a sentence for a device that does not exist here.
    """
    if isinstance(spec, torch.device):
        spec = str(spec)
    spec = (spec or "auto").strip().lower()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if spec == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() \
            else HOST  # the fallback of auto
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"unknown device {spec!r}; expected {DEVICE_HELP}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} was asked for but CUDA is not available on this "
                             "machine (torch.cuda.is_available() is False); use --device cpu")
        index = local_rank if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: this machine has {torch.cuda.device_count()} "
                             f"CUDA device(s)")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f"device type {device.type!r} is not supported; expected {DEVICE_HELP}")
    return device


def use_device(device: torch.device) -> None:
    """Make ``device`` the current CUDA device (nothing to do on the CPU).

    Allocations without an index, cuBLAS/cuDNN handles, ``torch.cuda.synchronize()`` and
    NCCL all use the current device: a single process on ``cuda:K``, K > 0, that never set
    it would also create a context and allocate on ``cuda:0``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def amp_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (``None`` for FP32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return AMP_DTYPES.get(precision)


def autocast(precision: str, device: torch.device | str = "cpu"):
    """Autocast to ``precision`` on ``device``'s type; a no-op context for FP32."""
    dtype = amp_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device | str) -> torch.amp.GradScaler:
    """A gradient scaler on ``device``'s type, enabled for FP16 only."""
    return torch.amp.GradScaler(torch.device(device).type, enabled=precision == "fp16")


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels on ``device`` (timing); nothing to wait for on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def available_memory(device: torch.device | str = HOST) -> int:
    """Bytes a new allocation may take on ``device``: free device memory on CUDA, the host's
    ``MemAvailable`` (free memory plus reclaimable caches) on Linux, free pages elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def peak_host_memory() -> int:
    """This process's peak resident memory in bytes so far (``getrusage``'s ``ru_maxrss``;
    pages of memory-mapped files that were resident count in it)."""
    import resource
    import sys
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
