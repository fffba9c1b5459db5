"""One measurement in a fresh interpreter: the benchmarks' worker.

Peak memory and the first-touch cost of memory are only meaningful in a process that did
nothing else before (memory freed earlier can be reused without raising the resident set),
so each measurement runs as ``python -c "...worker_main()" JOB``: ``JOB`` is a JSON object
whose ``"job"`` names the function ``"module:function"`` that takes the job and returns a
JSON-able record; the record is the last line the worker prints. The worker applies the
host allocator policy of the parent's command line (:mod:`flarepp.allocator`) unless
``retain_memory`` is off.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from typing import Any

from flarepp import allocator


def worker_main() -> None:
    """Entry point of the fresh interpreter: run the JSON job in ``argv[1]``, print a JSON
    record as the last line of stdout."""
    policy = allocator.apply_policy()
    job = json.loads(sys.argv[1])
    module, function = job["job"].split(":")
    record = getattr(importlib.import_module(module), function)(job)
    print(json.dumps({**record, "malloc": str(policy)}))


def queued_seconds() -> float:
    """Seconds the calling thread has waited, runnable, for a CPU (``/proc/thread-self/
    schedstat``; 0 where there is none). On a shared machine ``wall - queued`` of a
    one-thread measurement is its time had no other process wanted the cores: its compute
    plus its own waits (disk reads, page faults, write-back throttling)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except OSError:
        return 0.0


def in_fresh_interpreter(job: dict[str, Any], *, what: str, retain_memory: bool = True,
                         timeout_s: float = 3600) -> dict[str, Any]:
    """Run ``job`` through :func:`worker_main`; its stderr (progress bars) passes through.
    ``what`` names the job in the error raised when it fails or runs past ``timeout_s``."""
    code = "from flarepp.bench.fresh import worker_main; worker_main()"
    try:
        done = subprocess.run([sys.executable, "-c", code, json.dumps(job)],
                              env=allocator.child_environment(retain_memory),
                              stdout=subprocess.PIPE, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} ran past {timeout_s:.0f} s") from None
    if done.returncode != 0:
        hint = " (killed: likely out of memory)" if done.returncode == -9 else ""
        raise RuntimeError(f"{what} failed with exit code {done.returncode}{hint}; its "
                           "traceback is above")
    return json.loads(done.stdout.strip().splitlines()[-1])


__all__ = ["in_fresh_interpreter", "queued_seconds", "worker_main"]
