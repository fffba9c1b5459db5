"""Devices and numeric precision: one place that turns a user's choice into torch objects.

``--device auto`` means ``cuda:LOCAL_RANK`` when CUDA is available (``LOCAL_RANK`` is set by
``torchrun``; 0 otherwise) and the CPU otherwise. Precision follows the paper (C.2): FP32
runs with no autocast; ``bf16`` / ``fp16`` runs autocast the forward to that dtype on the
model's device (FP16 with a gradient scaler, BF16 without).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

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
    """Bytes a new allocation may take on ``device``: free device memory on CUDA; on the
    host the tightest of :func:`memory_bounds` (free memory, the process's address-space and
    data limits, its cgroup's memory limit)."""
    return min(memory_bounds(device).values())


def memory_bounds(device: torch.device | str = HOST, *,
                  cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
                  proc: str | os.PathLike = "/proc") -> dict[str, int]:
    """Each bound on a new allocation on ``device`` that applies here, in bytes, keyed by
    what it is (for messages that name the one that binds).

    CUDA: the device's free memory. The host: ``MemAvailable`` (free memory plus
    reclaimable caches; free pages without ``/proc``), and where set, ``RLIMIT_AS`` /
    ``RLIMIT_DATA`` less the process's ``VmSize`` / ``VmData`` (what the kernel checks each
    mapping against), and the memory limit of its cgroup or of an ancestor cgroup less that
    cgroup's usage net of inactive file pages, which the kernel reclaims before it refuses
    (v2 ``memory.max``, v1 ``memory.limit_in_bytes``; :func:`cgroup_memory_bound`).
    ``cgroup_root`` and ``proc`` are where those file systems are mounted."""
    device = torch.device(device)
    if device.type == "cuda":
        return {"free device memory": int(torch.cuda.mem_get_info(device)[0])}
    proc = Path(proc)
    status = _status_bytes(proc / "self" / "status")
    bounds = {}
    if "MemAvailable" in (meminfo := _status_bytes(proc / "meminfo")):
        bounds["free memory (MemAvailable)"] = meminfo["MemAvailable"]
    else:
        bounds["free memory"] = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    import resource
    for name, used in (("RLIMIT_AS", "VmSize"), ("RLIMIT_DATA", "VmData")):
        soft = resource.getrlimit(getattr(resource, name))[0]
        if soft != resource.RLIM_INFINITY:
            bounds[f"the {'address-space' if name == 'RLIMIT_AS' else 'data'} limit "
                   f"({name} {soft})"] = max(soft - status.get(used, 0), 0)
    try:
        membership = (proc / "self" / "cgroup").read_text()
    except OSError:
        membership = ""
    cgroup = cgroup_memory_bound(cgroup_root, membership)
    if cgroup is not None:
        bounds[cgroup[0]] = cgroup[1]
    return bounds


UNLIMITED = 1 << 60
"""A cgroup v1 memory limit this large is no limit (v1 writes ``LONG_MAX`` rounded to a
page, v2 writes ``max``)."""


def cgroup_memory_bound(root: str | os.PathLike, membership: str) -> tuple[str, int] | None:
    """``(what, bytes)`` of the tightest cgroup memory limit on this process, or None.

    ``membership`` is ``/proc/self/cgroup``'s text (``hierarchy:controllers:path`` lines:
    ``0::path`` for cgroup v2, ``N:...memory...:path`` for v1's memory controller);
    ``root`` is where the hierarchies are mounted (v2 at ``root``, v1's memory controller at
    ``root/memory``). The cgroup's directory and each ancestor's up to ``root`` is read; a
    limit bounds what its whole subtree uses, so the headroom is ``limit - (usage - inactive
    file pages)`` there, the smallest over the ancestry."""
    best: tuple[str, int] | None = None
    for v2, folder in cgroup_folders(root, membership, "memory", ("memory",)):
        files = (("memory.max", "memory.current", "inactive_file") if v2 else
                 ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
        headroom = _cgroup_headroom(folder, *files)
        if headroom is not None and (best is None or headroom < best[1]):
            best = (f"the cgroup memory limit ({folder / files[0]})", headroom)
    return best


def cgroup_folders(root: str | os.PathLike, membership: str, controller: str,
                   v1_mounts: tuple[str, ...]) -> Iterator[tuple[bool, Path]]:
    """``(is_v2, folder)`` of this process's cgroup and each ancestor up to the mount, in
    the v2 hierarchy (at ``root``) and in v1's hierarchy of ``controller`` (at the first of
    ``root/v1_mounts`` that exists). ``membership`` is ``/proc/self/cgroup``'s text
    (``hierarchy:controllers:path`` lines); a cgroup outside the mount's view (a namespace
    shows it as ``/../..``) reads the mount's root."""
    root = Path(root)
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        v2 = hierarchy == "0" and controllers == ""
        if v2:
            base = root
        elif controller in controllers.split(","):
            base = next((root / m for m in v1_mounts if (root / m).is_dir()),
                        root / v1_mounts[0])
        else:
            continue
        relative = Path(path.strip().lstrip("/"))
        folder = base if ".." in relative.parts else base / relative
        while True:
            yield v2, folder
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent


def _cgroup_headroom(folder: Path, limit_file: str, usage_file: str,
                     inactive_key: str) -> int | None:
    try:
        limit = (folder / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= UNLIMITED:
            return None
        usage = int((folder / usage_file).read_text())
    except (OSError, ValueError):
        return None
    try:
        stat = dict(line.split(" ", 1) for line in (folder / "memory.stat").read_text()
                    .splitlines() if " " in line)
        inactive = int(stat.get(inactive_key, 0))
    except (OSError, ValueError):  # no statistics: count all usage as taken (the safe side)
        inactive = 0
    return max(int(limit) - max(usage - inactive, 0), 0)


def _status_bytes(path: Path) -> dict[str, int]:
    """The ``Key: N kB`` lines of ``/proc/meminfo`` or ``/proc/self/status``, in bytes."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields = value.split()
        if len(fields) == 2 and fields[1] == "kB" and fields[0].isdigit():
            out[key] = int(fields[0]) * 1024
    return out


def peak_host_memory() -> int:
    """This process's peak resident memory in bytes so far (``getrusage``'s ``ru_maxrss``;
    pages of memory-mapped files that were resident count in it)."""
    import resource
    import sys
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
