"""Context-parallel scaling (paper Table 5) and streaming-inference memory, measured on CPU.

* :func:`context_parallel_scaling`: one training step (forward, backward, gradient
  all-reduce) of a FLARE-family model on a mesh of N tokens, split over R = 1, 2, ... local
  gloo ranks, one thread each. Reported per R: the median step time ``T_R``, the per-rank
  peak memory ``P_R`` (growth of the resident set during the steps), and the paper's two
  efficiencies ``E = T_1 / (R T_R)`` and ``E_mem = P_1 / (R P_R)``; also ``E_cpu``, the
  same ratio for the busiest rank's process CPU time, which measures how the work divides
  even when other jobs share the cores (wall-clock ``E`` then mostly measures the sharing).
* :func:`streaming_memory`: peak memory of :func:`~flarepp.distributed.stream_forward` at a
  fixed chunk size against N, next to the unchunked forward's.

Peak memory is the kernel's high-water mark of this process's resident set (``VmHWM``),
reset right before the measured work (``/proc/self/clear_refs``), minus the resident set at
that moment. Every measurement runs in a fresh interpreter with glibc's mmap threshold
pinned at 128 KiB (``MALLOC_MMAP_THRESHOLD_``), so every tensor buffer is mapped on
allocation and unmapped on free and the resident set follows the live tensors; with glibc's
adaptive threshold, heap fragmentation moves the figure by tens of MiB from run to run.
Linux only.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from flarepp.bench.memory import peak_rss_since, reset_peak_rss
from flarepp.distributed import context_parallel, run_on_ranks, stream_forward
from flarepp.models import build_model

_MMAP_KEY, _MMAP_BYTES = "MALLOC_MMAP_THRESHOLD_", "131072"


@contextlib.contextmanager
def _pinned_mmap_threshold():
    """Set ``MALLOC_MMAP_THRESHOLD_`` for processes started inside the block."""
    before = os.environ.get(_MMAP_KEY)
    os.environ[_MMAP_KEY] = _MMAP_BYTES
    try:
        yield
    finally:
        if before is None:
            del os.environ[_MMAP_KEY]
        else:
            os.environ[_MMAP_KEY] = before


def _model(settings: dict[str, Any]) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(**settings)


def _scaling_rank(group, settings: dict[str, Any], n_tokens: int, batch: int, steps: int
                  ) -> dict[str, float]:
    import torch.distributed as dist

    model = _model(settings)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, n_tokens, settings["in_dim"], generator=g)
    w = torch.randn(batch, n_tokens, settings["out_dim"], generator=g)
    with context_parallel(model, group) as cp:
        x_r, w_r = cp.shard(x).contiguous(), cp.shard(w).contiguous()
        del x, w
        times, cpu_times = [], []
        base = reset_peak_rss()
        for _ in range(steps + 1):  # the first step warms up and is not timed
            dist.barrier(group)
            start, cpu_start = time.perf_counter(), time.process_time()
            model.zero_grad(set_to_none=True)
            (model(x_r) * w_r).sum().backward()
            cp.all_reduce_gradients()
            dist.barrier(group)
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        peak = peak_rss_since(base)
    return {"step_s": statistics.median(times[1:]), "cpu_s": statistics.median(cpu_times[1:]),
            "peak_bytes": peak}


def context_parallel_scaling(settings: dict[str, Any], n_tokens: int, ranks: list[int], *,
                             batch: int = 1, steps: int = 3) -> list[dict[str, Any]]:
    """Table 5's ``E`` and ``E_mem`` for each R in ``ranks`` (the first is the reference)."""
    rows = []
    for world in ranks:
        with _pinned_mmap_threshold():  # the ranks inherit it (see the module docstring)
            per_rank = run_on_ranks(_scaling_rank, world, settings, n_tokens, batch, steps,
                                    timeout_s=3600, collective_timeout_s=600)
        rows.append({"ranks": world,
                     "step_s": max(r["step_s"] for r in per_rank),
                     "cpu_s_per_rank": max(r["cpu_s"] for r in per_rank),
                     "peak_bytes_per_rank": max(r["peak_bytes"] for r in per_rank)})
    ref = rows[0]
    for row in rows:
        scale = row["ranks"] / ref["ranks"]
        row["E"] = ref["step_s"] / (scale * row["step_s"])
        row["E_cpu"] = ref["cpu_s_per_rank"] / (scale * row["cpu_s_per_rank"])
        row["E_mem"] = ref["peak_bytes_per_rank"] / (scale * row["peak_bytes_per_rank"])
    return rows


def _memory_probe(settings: dict[str, Any], n_tokens: int,
                  chunk_sizes: list[int | None]) -> None:
    """Run in a fresh interpreter: one forward per entry of ``chunk_sizes`` (``None``:
    unchunked), in order, each with the high-water mark reset; print the peaks as JSON."""
    torch.set_num_threads(1)
    model = _model(settings).eval()
    x = torch.randn(1, n_tokens, settings["in_dim"], generator=torch.Generator().manual_seed(1))
    rows = []
    for chunk_size in chunk_sizes:
        base = reset_peak_rss()
        with torch.no_grad():
            y = (model(x) if chunk_size is None
                 else stream_forward(model, x, chunk_size=chunk_size))
        rows.append({"n_tokens": n_tokens, "chunk_size": chunk_size,
                     "peak_bytes": peak_rss_since(base),
                     "output_bytes": y.numel() * y.element_size()})
        del y
    print(json.dumps(rows))


def measure_forward_memory(settings: dict[str, Any], n_tokens: int,
                           chunk_sizes: list[int | None]) -> list[dict[str, Any]]:
    """Peak memory of forwards (streamed with each chunk size, ``None``: unchunked) over
    ``n_tokens`` in one fresh interpreter; measure a streamed run before an unchunked one,
    whose freed memory could otherwise be reused unseen."""
    code = ("import json, sys; from flarepp.bench.cp import _memory_probe; "
            "_memory_probe(json.loads(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(settings), str(n_tokens),
                           json.dumps(chunk_sizes)], capture_output=True, text=True,
                          timeout=1800, env={**os.environ, _MMAP_KEY: _MMAP_BYTES})
    if done.returncode != 0:
        raise RuntimeError(f"memory probe (N={n_tokens}, chunks={chunk_sizes}) failed:\n"
                           f"{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def streaming_memory(settings: dict[str, Any], n_tokens: list[int], chunk_size: int, *,
                     unchunked: bool = True) -> list[dict[str, Any]]:
    """Streaming (and, if ``unchunked``, plain) forward peak memory for each N."""
    rows = []
    for n in n_tokens:  # one interpreter per measurement: nothing freed earlier is reused
        row = {"n_tokens": n, "chunk_size": chunk_size, "stream_peak_bytes":
               measure_forward_memory(settings, n, [chunk_size])[0]["peak_bytes"]}
        if unchunked:
            row["unchunked_peak_bytes"] = measure_forward_memory(settings, n,
                                                                 [None])[0]["peak_bytes"]
        rows.append(row)
    return rows
