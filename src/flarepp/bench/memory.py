"""Peak-memory probes for benchmarks: resident set on CPU (Linux), allocator on CUDA.

CPU: the kernel keeps the resident set's high-water mark (``VmHWM`` in
``/proc/self/status``); writing ``5`` to ``/proc/self/clear_refs`` resets it to the current
resident set (Linux >= 4.0). :func:`reset_peak_rss` does that and returns the resident set
at that moment, the baseline; :func:`peak_rss_since` is the high-water mark since, minus the
baseline. Memory freed earlier in the same process can be reused without raising the
resident set, so a measurement is only meaningful in a fresh interpreter, started for it.

CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the
memory allocated at that moment.
"""

from __future__ import annotations

import torch


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/self/status has no {key}; the CPU peak-memory probe needs Linux")


def reset_peak_rss() -> int:
    """Reset the resident-set high-water mark; returns the current resident set in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as err:
        raise RuntimeError(f"cannot reset the peak resident set through /proc/self/clear_refs "
                           f"({err}); the CPU peak-memory probe needs Linux >= 4.0") from err
    return _status_bytes("VmRSS")


def peak_rss_since(baseline: int) -> int:
    """Bytes by which the resident set peaked above ``baseline`` since :func:`reset_peak_rss`."""
    return _status_bytes("VmHWM") - baseline


class PeakMemory:
    """``with PeakMemory(device) as pm: ...``; then ``pm.baseline`` and ``pm.peak`` (bytes
    above the baseline) and ``pm.method`` (how it was measured)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = 0
        self.peak = 0
        self.method = ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                       else "VmHWM - VmRSS after /proc/self/clear_refs")

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
        else:
            self.baseline = reset_peak_rss()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.baseline
        else:
            self.peak = peak_rss_since(self.baseline)
