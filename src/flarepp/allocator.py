"""The host allocator policy of flarepp's compute processes: keep freed memory for reuse.

By default glibc's malloc serves every allocation above its mmap threshold (adaptive, at
most 32 MiB on 64-bit Linux) with a fresh ``mmap`` and unmaps it when it is freed, and it
returns the free top of its heap to the kernel above 128 KiB (``mallopt(3)``). A training
step allocates and frees the same large activations every step, so every step faults in and
zeroes its pages again (page faults per step and the step times with and without this
policy are measured in the README's allocator section). PyTorch's CUDA caching allocator
keeps freed device memory for the same reason.

:func:`retain_freed_memory` tells glibc, in the running process, through ``mallopt``:
``M_MMAP_MAX = 0`` (no mmap'd chunks: large blocks come from the heap and are reused after
``free``) and ``M_TRIM_THRESHOLD = -1`` (never give the top of the heap back). The other
candidates, jemalloc and tcmalloc, replace malloc only when preloaded (``LD_PRELOAD``) before
the interpreter starts, so they would need a re-exec of every command and a library few
machines have; ``mallopt`` needs nothing installed and acts at once.

The cost is peak memory: freed memory stays in the process, so its resident set stays at its
high-water mark, heap fragmentation included, instead of falling between steps (CPU time
saved per step against peak memory added: the README's allocator section).

``flarepp train``, ``eval``, ``infer``, ``bench``, ``demo`` and ``compare`` apply
:func:`apply_policy` at start (:func:`flarepp.cli.main`); the benchmark's worker processes
apply it themselves. ``FLAREPP_RETAIN_MEMORY=0`` (or ``false``, ``no``, ``off``) switches it
off and is inherited by child processes. Where the C library is not glibc (musl, macOS)
nothing is changed; the reason is logged at debug level (logger ``flarepp.allocator``) and
returned in the :class:`AllocatorPolicy`.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
from dataclasses import dataclass
from typing import Mapping

ENV_VAR = "FLAREPP_RETAIN_MEMORY"
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# mallopt parameters, from glibc's <malloc.h>
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
RETAIN_SETTINGS = {"M_MMAP_MAX": (M_MMAP_MAX, 0), "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, -1)}
"""``name: (mallopt parameter, value)``; -1 as the trim threshold disables trimming."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AllocatorPolicy:
    """What :func:`apply_policy` did: ``retained`` is whether freed memory is now kept."""

    retained: bool
    detail: str

    def __str__(self) -> str:
        return ("retain" if self.retained else "system") + f" ({self.detail})"


def retain_memory_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``FLAREPP_RETAIN_MEMORY`` asks for the policy (unset: yes)."""
    value = environ.get(ENV_VAR, "1").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"environment variable {ENV_VAR}={environ[ENV_VAR]!r}: expected one of "
                     f"{', '.join(_ON + _OFF)}")


def child_environment(retain: bool, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A copy of ``environ`` whose ``FLAREPP_RETAIN_MEMORY`` asks a child for ``retain``."""
    return {**environ, ENV_VAR: "1" if retain else "0"}


def _glibc() -> ctypes.CDLL | None:
    """The running process's C library if it is glibc, else ``None``."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:  # no dynamic C library to open (e.g. Windows)
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def retain_freed_memory() -> AllocatorPolicy:
    """Tell glibc's malloc to keep freed memory (see the module docstring); a no-op with
    the reason in the result where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return AllocatorPolicy(False, "not glibc: mallopt unavailable, allocator unchanged")
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    version = libc.gnu_get_libc_version().decode()
    for name, (param, value) in RETAIN_SETTINGS.items():
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            return AllocatorPolicy(False, f"glibc {version} refused mallopt({name}, {value})")
    settings = ", ".join(f"{name}={value}" for name, (_, value) in RETAIN_SETTINGS.items())
    return AllocatorPolicy(True, f"glibc {version} mallopt {settings}")


SYSTEM_SETTINGS = {"M_MMAP_MAX": (M_MMAP_MAX, 65536), "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD,
                                                                          128 * 1024)}
"""glibc's defaults (``mallopt(3)``): large blocks mmap'd and unmapped when freed, the free
top of the heap given back above 128 KiB."""


RETURNED = "freed memory returned to the system (glibc's defaults, malloc_trim)"


def return_freed_memory() -> AllocatorPolicy:
    """Undo :func:`retain_freed_memory` in the running process: glibc's defaults again
    (:data:`SYSTEM_SETTINGS`) and ``malloc_trim(0)``, so that what was freed (a training
    step's activations, kept at their high-water mark under the retain policy, fragmented
    among the heap's blocks) goes back to the system. A run under a memory budget calls it
    (:mod:`flarepp.train.budget`): under an address-space or cgroup limit, a heap held at the
    training step's high-water mark leaves no room for the evaluation's differently sized
    blocks. A no-op, with the reason, where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return AllocatorPolicy(False, "not glibc: mallopt unavailable, allocator unchanged")
    for name, (param, value) in SYSTEM_SETTINGS.items():
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            return AllocatorPolicy(True, f"glibc refused mallopt({name}, {value})")
    libc.malloc_trim(ctypes.c_size_t(0))
    return AllocatorPolicy(False, RETURNED)


def apply_policy(environ: Mapping[str, str] = os.environ) -> AllocatorPolicy:
    """:func:`retain_freed_memory` unless ``FLAREPP_RETAIN_MEMORY`` switches it off."""
    if retain_memory_requested(environ):
        policy = retain_freed_memory()
    else:
        policy = AllocatorPolicy(False, f"switched off by {ENV_VAR}={environ[ENV_VAR]}")
    log.debug("host allocator: %s", policy)
    return policy


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def malloc_stats() -> dict[str, int] | None:
    """glibc's ``mallinfo2()``: ``heap_bytes`` (``arena``, obtained by brk), ``mmapped_bytes``
    (``hblkhd``, in mmap'd chunks), ``in_use_bytes`` and ``free_bytes`` of the heap; ``None``
    without glibc >= 2.33. With the policy applied, ``mmapped_bytes`` stays near zero."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {"heap_bytes": info.arena, "mmapped_bytes": info.hblkhd,
            "in_use_bytes": info.uordblks, "free_bytes": info.fordblks}


# ---------------------------------------------------------------------------------------------
# failed allocations

class OutOfMemory(MemoryError):
    """An allocation failed in a stage of a run; the message is one sentence naming the stage,
    the bytes asked for, the option that bounds the stage and how the run continues."""


_FAILED_ALLOCATION = ("can't allocate memory", "cannot allocate memory", "out of memory",
                      "unable to allocate")
"""What the allocators say: torch's host allocator (``DefaultCPUAllocator: can't allocate
memory: you tried to allocate N bytes``), CUDA's (``CUDA out of memory. Tried to allocate
2.00 GiB``, :class:`torch.OutOfMemoryError`), numpy's (``Unable to allocate 468. MiB for an
array with shape ...``), and the kernel's ``ENOMEM``."""

_UNITS = {"b": 1, "bytes": 1, **{f"{p}ib": 2 ** (10 * k) for k, p in enumerate("kmgtpe", 1)},
          **{f"{p}b": 10 ** (3 * k) for k, p in enumerate("kmgtpe", 1)}}
_ASKED = re.compile(r"allocate\s+([0-9]+(?:\.[0-9]*)?)\s*(bytes|[KMGTPE]i?B|B)\b", re.IGNORECASE)


def is_allocation_failure(err: BaseException) -> bool:
    """Whether ``err`` is a failed memory allocation (any of :data:`_FAILED_ALLOCATION`, a
    ``MemoryError``, an ``OSError`` with ``ENOMEM``), also when a loader worker re-raised it
    in another type."""
    if isinstance(err, MemoryError):
        return True
    if isinstance(err, OSError) and err.errno == errno.ENOMEM:
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(m in text for m in _FAILED_ALLOCATION)


def requested_bytes(err: BaseException) -> int | None:
    """The bytes the failed allocation asked for, read from the allocator's message (None
    where it does not say)."""
    match = _ASKED.search(str(err))
    if match is None:
        return None
    return int(float(match[1]) * _UNITS[match[2].lower()])


def format_bytes(count: int) -> str:
    """``490733568`` -> ``"468 MiB"``: the largest binary unit below the count."""
    for k in range(6, 0, -1):
        unit, size = f"{'KMGTPE'[k - 1]}iB", 2 ** (10 * k)
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count} bytes"


__all__ = ["ENV_VAR", "RETURNED", "AllocatorPolicy", "OutOfMemory", "apply_policy",
           "child_environment", "return_freed_memory",
           "format_bytes", "is_allocation_failure", "malloc_stats", "requested_bytes",
           "retain_freed_memory", "retain_memory_requested"]
