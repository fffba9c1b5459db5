"""Block-wise streaming inference against the unchunked forward: time, memory, exactness.

Shape letters: N tokens, K chunk size, C channels.

* :func:`stream_vs_unchunked`: one inference forward of a model on N random tokens,
  unchunked and through :func:`~flarepp.distributed.stream_forward` with each chunk size,
  in each precision asked for (``fp32``; ``bf16`` / ``fp16`` autocast the forward: 16-bit
  matrix products with FP32 accumulation), each in a fresh interpreter, in interleaved
  rounds (the order rotates every round, so a load that drifts on a shared machine hits
  every variant alike). Reported per round: wall and CPU time, peak memory and minor page
  faults; the ratio of each variant's time to the unchunked time of the first precision in
  the same round, and its median over the rounds.
* :func:`stream_large`: one streamed forward of a mesh too large for the unchunked one;
  :func:`stream_placements`: those forwards with the hidden state in memory and in a
  memory-mapped file (in core against out of core), in interleaved rounds.
* :func:`stream_exactness`: ``max |y_stream - y|`` against the unchunked forward.

Each timed record also holds ``queued_s``, the time the timing thread waited for a CPU
(Linux schedstat), and ``uncontended_s = time_s - queued_s``: with one thread, the time the
forward would have taken on cores of its own (its compute and its own waits for the disk),
which other jobs on a shared machine do not inflate.

Every measurement runs in a fresh interpreter (:mod:`flarepp.bench.fresh`) that first warms the
model up on a few thousand tokens, then times one forward under ``torch.no_grad``. Peak
memory is the growth of the resident set (CPU) or of allocated device memory (CUDA) above
the moment just before that forward (:class:`~flarepp.bench.memory.PeakMemory`); the model,
the inputs and the warm-up's retained memory are below it, the hidden state, the outputs and
the chunk's working set in it. The workers use the host allocator policy of the command
line (:mod:`flarepp.allocator`: freed memory kept for reuse) unless ``retain_memory`` is
off. Each record carries the load average (``os.getloadavg``) before and after, since other
jobs may share the cores.
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import time
from collections import OrderedDict
from typing import Any, Callable

import torch

from flarepp.bench.fresh import in_fresh_interpreter, queued_seconds
from flarepp.bench.memory import PeakMemory
from flarepp.device import autocast, resolve_device, synchronize
from flarepp.distributed import stream_forward, streaming
from flarepp.models import build_model

WARMUP_TOKENS = 4096


def _inputs(n_tokens: int, in_dim: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, n_tokens, in_dim, generator=torch.Generator().manual_seed(seed))


def _job_model(job: dict[str, Any]) -> tuple[torch.nn.Module, torch.Tensor, torch.device]:
    """``job``'s model (seed 0, on its device, in eval mode), its N random input tokens
    ``[1, N, in_dim]`` and the device, with the job's thread count set."""
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    device = resolve_device(job.get("device", "auto"))
    torch.manual_seed(0)
    model = build_model(**job["settings"]).to(device).eval()
    return model, _inputs(job["n_tokens"], job["settings"]["in_dim"]), device


def _measure(job: dict[str, Any]) -> dict[str, Any]:
    """One forward of ``job``'s model on its N tokens (``chunk_size`` None: unchunked), under
    the autocast of its ``precision``."""
    model, x, device = _job_model(job)
    chunk_size = job["chunk_size"]

    def forward(x_BNI: torch.Tensor, progress: bool = False) -> torch.Tensor:
        if chunk_size is None:
            return model(x_BNI.to(device)).cpu()
        return stream_forward(model, x_BNI, chunk_size=chunk_size, device=device,
                              hidden_on=job.get("hidden_on", "auto"),
                              memmap_dir=job.get("memmap_dir"), progress=progress)

    precision = job.get("precision", "fp32")
    limit = job.get("page_cache_bytes")
    with torch.no_grad(), autocast(precision, device), (
            page_cache_limit(limit) if limit else contextlib.nullcontext()):
        forward(x[:, :WARMUP_TOKENS])
        load_before = os.getloadavg()
        usage, io, queued = resource.getrusage(resource.RUSAGE_SELF), _io_bytes(), queued_seconds()
        with PeakMemory(device) as peak:
            start, cpu_start = time.perf_counter(), time.process_time()
            y = forward(x, job.get("progress", False))
            synchronize(device)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        queued = queued_seconds() - queued
    return {"n_tokens": job["n_tokens"], "chunk_size": chunk_size, "precision": precision,
            "hidden_on": job.get("hidden_on", "auto"), "page_cache_bytes": limit,
            "time_s": wall, "queued_s": queued, "uncontended_s": wall - queued,
            "cpu_time_s": cpu, "peak_bytes": peak.peak, "mem_method": peak.method,
            "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - usage.ru_minflt,
            "major_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt - usage.ru_majflt,
            **{f"disk_{k}": v - io[k] for k, v in _io_bytes().items()},
            "output_bytes": y.numel() * y.element_size(), "threads": torch.get_num_threads(),
            "device": str(device), "load_before": load_before, "load_after": os.getloadavg()}


MADV_PAGEOUT = 21
"""Linux >= 5.4 ``madvise``: reclaim a range's pages now (dirty ones written back first)."""


@contextlib.contextmanager
def page_cache_limit(limit_bytes: int):
    """Within the block, a memory-mapped hidden state of :func:`~flarepp.distributed.
    stream_forward` keeps at most ``limit_bytes`` resident, as a page cache of that size
    with least-recently-used eviction would: every chunk loaded, stored or read ahead is
    the most recent, and the least recent ones beyond the limit are paged out
    (``MADV_PAGEOUT``; their dirty pages written back first, ``msync``, which the kernel's
    flusher threads would mostly have done already: a pessimistic cost). It emulates a
    state larger than the memory a machine can give it, on a machine that has the memory,
    without taking it from other processes."""
    cls, recent = streaming._HiddenState, OrderedDict()
    methods = {name: getattr(cls, name) for name in ("load", "store", "prefetch")}

    def touched(state, sl) -> None:
        if state.mapping is None or sl is None:
            return
        recent.pop((sl.start, sl.stop), None)
        recent[(sl.start, sl.stop)] = state.file_ranges(sl)
        while sum(length for ranges in recent.values() for _, length in ranges) > limit_bytes:
            for start, length in recent.popitem(last=False)[1]:
                state.mapping.flush(start, length)      # dirty pages first written back
                state.mapping.madvise(MADV_PAGEOUT, start, length)

    def wrap(name):
        def method(self, sl, *args):
            out = methods[name](self, sl, *args)
            touched(self, sl)
            return out
        return method

    for name in methods:
        setattr(cls, name, wrap(name))
    try:
        yield
    finally:
        for name, method in methods.items():
            setattr(cls, name, method)


def _io_bytes() -> dict[str, int]:
    """Bytes this process has had read from and written to storage (``/proc/self/io``:
    page-cache misses and write-back, not reads the cache served); {} off Linux."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
    except OSError:
        return {}
    return {"read_bytes": int(fields["read_bytes"]), "write_bytes": int(fields["write_bytes"])}


def _exactness(job: dict[str, Any]) -> dict[str, Any]:
    """Streamed and unchunked outputs of one input, compared in this process, and each
    against a float64 copy of the model streamed (exact to rounding, see the tests): both
    float32 forwards sum softmax weights over N tokens in float32, so their difference is
    set by rounding, which the float64 reference shows on each side."""
    model, x, device = _job_model(job)
    with torch.no_grad():
        streamed = stream_forward(model, x, chunk_size=job["chunk_size"], device=device)
        unchunked = model(x.to(device)).cpu()
        reference = None
        if job.get("float64_reference", True):
            reference = stream_forward(model.double(), x.double(), chunk_size=job["chunk_size"],
                                       device=device)
    diff = (streamed - unchunked).abs()
    out = {"n_tokens": job["n_tokens"], "chunk_size": job["chunk_size"],
           "dtype": str(unchunked.dtype), "max_abs_diff": diff.max().item(),
           "max_abs_output": unchunked.abs().max().item(), "mean_abs_diff": diff.mean().item()}
    if reference is not None:
        out["streamed_vs_float64"] = (streamed.double() - reference).abs().max().item()
        out["unchunked_vs_float64"] = (unchunked.double() - reference).abs().max().item()
    return out


def _in_fresh_interpreter(job: dict[str, Any], *, retain_memory: bool,
                          timeout_s: float) -> dict[str, Any]:
    """Run ``job`` (``kind`` ``measure`` or ``exactness``) in a fresh interpreter
    (:mod:`flarepp.bench.fresh`)."""
    target = {"measure": "_measure", "exactness": "_exactness"}[job["kind"]]
    return in_fresh_interpreter({**job, "job": f"{__name__}:{target}"},
                                what=f"{job['kind']} job (N={job['n_tokens']}, chunk "
                                     f"{job['chunk_size']})",
                                retain_memory=retain_memory, timeout_s=timeout_s)


def stream_vs_unchunked(settings: dict[str, Any], n_tokens: int, chunk_sizes: list[int], *,
                        rounds: int = 3, threads: int | None = None, device: str = "auto",
                        retain_memory: bool = True, timeout_s: float = 3600,
                        precisions: tuple[str, ...] = ("fp32",),
                        on_record: Callable[[dict[str, Any]], None] | None = None
                        ) -> dict[str, Any]:
    """Unchunked vs streamed forwards in each of ``precisions`` (see the module docstring);
    ``records`` holds every measurement, ``summary`` per chunk size and precision the median
    time, peak memory and ratio. ``on_record`` is called with each record as it is
    measured."""
    variants = [(chunk, precision) for precision in precisions
                for chunk in (None, *chunk_sizes)]
    base = (None, precisions[0])
    records = []
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for chunk_size, precision in order:
            job = {"kind": "measure", "settings": settings, "n_tokens": n_tokens,
                   "chunk_size": chunk_size, "threads": threads, "device": device,
                   "precision": precision}
            records.append({"round": r, **_in_fresh_interpreter(
                job, retain_memory=retain_memory, timeout_s=timeout_s)})
            if on_record is not None:
                on_record(records[-1])
    by_round = {(rec["round"], rec["chunk_size"], rec["precision"]): rec for rec in records}
    summary = []
    for chunk_size, precision in variants:
        mine = [rec for rec in records
                if (rec["chunk_size"], rec["precision"]) == (chunk_size, precision)]
        row = {"chunk_size": chunk_size, "precision": precision,
               "time_s": statistics.median(rec["time_s"] for rec in mine),
               "cpu_time_s": statistics.median(rec["cpu_time_s"] for rec in mine),
               "peak_bytes": max(rec["peak_bytes"] for rec in mine),
               "minor_faults": statistics.median(rec["minor_faults"] for rec in mine)}
        ratios = [by_round[(r, chunk_size, precision)]["time_s"]
                  / by_round[(r, *base)]["time_s"] for r in range(rounds)]
        row["time_ratios"] = ratios
        row["time_ratio"] = statistics.median(ratios)
        row["cpu_time_ratio"] = statistics.median(
            by_round[(r, chunk_size, precision)]["cpu_time_s"]
            / by_round[(r, *base)]["cpu_time_s"] for r in range(rounds))
        summary.append(row)
    hidden_bytes = n_tokens * settings["dim"] * 4  # float32 h [1, N, C]
    return {"settings": settings, "n_tokens": n_tokens, "rounds": rounds,
            "precisions": list(precisions), "hidden_bytes": hidden_bytes, "records": records, "summary": summary}


def stream_large(settings: dict[str, Any], n_tokens: int, chunk_size: int, *,
                 threads: int | None = None, device: str = "auto", hidden_on: str = "auto",
                 retain_memory: bool = True, progress: bool = True, precision: str = "fp32",
                 memmap_dir: str | None = None, page_cache_bytes: int | None = None,
                 timeout_s: float = 4 * 3600) -> dict[str, Any]:
    """One streamed forward on ``n_tokens`` random tokens: time and peak memory (with
    ``page_cache_bytes``, a memory-mapped state under :func:`page_cache_limit`)."""
    job = {"kind": "measure", "settings": settings, "n_tokens": n_tokens,
           "chunk_size": chunk_size, "threads": threads, "device": device,
           "hidden_on": hidden_on, "progress": progress, "precision": precision,
           "memmap_dir": memmap_dir, "page_cache_bytes": page_cache_bytes}
    record = _in_fresh_interpreter(job, retain_memory=retain_memory, timeout_s=timeout_s)
    width = 2 if precision in ("bf16", "fp16") else 4
    return {**record, "hidden_bytes": n_tokens * settings["dim"] * width}


def stream_placements(settings: dict[str, Any], n_tokens: int, chunk_size: int,
                      placements: list[str], *, rounds: int = 3,
                      on_record: Callable[[dict[str, Any]], None] | None = None,
                      **options: Any) -> dict[str, Any]:
    """:func:`stream_large` with the hidden state at each of ``placements`` (e.g. ``host``
    against ``memmap``: in core against out of core), in interleaved rounds (the first
    placement leads in even rounds, the order turns in odd ones); per placement the median
    wall, uncontended and CPU time, and the median over rounds of each over the first
    placement's in the same round."""
    records = []
    for r in range(rounds):
        for hidden_on in (placements if r % 2 == 0 else placements[::-1]):
            records.append({"round": r, **stream_large(settings, n_tokens, chunk_size,
                                                       hidden_on=hidden_on, progress=False,
                                                       **options)})
            if on_record is not None:
                on_record(records[-1])
    summary = []
    for h in placements:
        row = {"hidden_on": h}
        for key in ("time_s", "uncontended_s", "cpu_time_s"):
            of = {rec["round"]: rec[key] for rec in records if rec["hidden_on"] == h}
            first = {rec["round"]: rec[key] for rec in records
                     if rec["hidden_on"] == placements[0]}
            row[key] = statistics.median(of.values())
            row[f"{key}_ratios"] = [of[r] / first[r] for r in range(rounds)]
            row[f"{key}_ratio"] = statistics.median(row[f"{key}_ratios"])
        row["us_per_token"] = 1e6 * row["time_s"] / n_tokens
        row["uncontended_us_per_token"] = 1e6 * row["uncontended_s"] / n_tokens
        summary.append(row)
    return {"records": records, "summary": summary, "n_tokens": n_tokens,
            "hidden_bytes": records[0]["hidden_bytes"]}


def stream_exactness(settings: dict[str, Any], n_tokens: int, chunk_size: int, *,
                     threads: int | None = None, device: str = "auto",
                     retain_memory: bool = True, float64_reference: bool = True,
                     timeout_s: float = 3600) -> dict[str, Any]:
    """``max |y_stream - y|`` on ``n_tokens`` random tokens (float32), and with
    ``float64_reference`` each one's distance to the float64 streamed forward."""
    job = {"kind": "exactness", "settings": settings, "n_tokens": n_tokens,
           "chunk_size": chunk_size, "threads": threads, "device": device,
           "float64_reference": float64_reference}
    return _in_fresh_interpreter(job, retain_memory=retain_memory, timeout_s=timeout_s)
