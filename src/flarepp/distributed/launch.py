"""Run a function on R local processes joined in a process group (tests, CPU benchmarks).

``run_on_ranks(fn, R, *args)`` starts R fresh interpreters (``spawn``), joins them in a
process group through a file store in a temporary directory (no port to pick), calls
``fn(group, *args)`` on each and returns the R results in rank order. A rank that raises,
dies or overruns ``timeout_s`` makes it raise :class:`RankFailure` naming the rank and its
traceback or exit code; the remaining processes are then terminated. Under ``torchrun`` use
:func:`flarepp.distributed.mesh.launch` instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_lib
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist


class RankFailure(RuntimeError):
    """One or more ranks of :func:`run_on_ranks` raised, died or timed out."""


def _worker(rank: int, world_size: int, store: str, backend: str, collective_timeout_s: float,
            threads: int, fn: Callable, args: tuple, results: Any) -> None:
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout_s))
        payload = pickle.dumps(fn(dist.group.WORLD, *args))
        results.put((rank, True, payload))
    except BaseException:  # reported to the parent, which raises RankFailure
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn: Callable, world_size: int, *args: Any, backend: str = "gloo",
                 timeout_s: float = 120.0, collective_timeout_s: float = 30.0,
                 threads: int = 1) -> list[Any]:
    """``[fn(group, *args) on rank r for r in range(world_size)]``; ``fn`` must be picklable
    (a module-level function) and return picklable values."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="flarepp-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, world_size, store, backend, collective_timeout_s,
                                   threads, fn, args, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        received: dict[int, tuple[bool, Any]] = {}
        while len(received) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, payload = results.get(timeout=0.1)
                received[rank] = (ok, payload)
            except queue_lib.Empty:
                if not any(p.is_alive() for p in procs) and results.empty():
                    break
        for p in procs:
            p.join(max(0.0, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                p.terminate()
                p.join()
    problems = []
    for r, p in enumerate(procs):
        if r not in received:
            state = ("timed out" if time.monotonic() >= deadline
                     else f"exited with code {p.exitcode} without a result")
            problems.append(f"rank {r} {state}")
        elif not received[r][0]:
            problems.append(f"rank {r} raised:\n{received[r][1]}")
    if problems:
        raise RankFailure(f"{len(problems)} of {world_size} ranks failed:\n"
                          + "\n".join(problems))
    return [pickle.loads(received[r][1]) for r in range(world_size)]
