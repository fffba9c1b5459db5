"""A data set larger than memory: generate it straight into a store, train one epoch of the
fields task on it, and measure the run's peak resident memory against the data's size.

    python scripts/large_data.py --out /work/bigdata/laplace --gb 8 [--build-only]

1. The store: at least ``--gb`` GB (10^9 bytes) of samples of ``--points`` points (default
   1.5M) with ``--fields`` harmonic target fields each (default 37: with the 3 coordinates,
   40 float32 channels, 240 MB a sample, like a CFD case's many output arrays), ``--test``
   of them test samples, by :func:`flarepp.data.generators.laplace.make_laplace_store` (one
   sample in memory at a time, each written atomically; a killed build resumes where it
   stopped); the time it took and its size are printed, and ``--build-only`` stops there.
2. ``flarepp train store-tiny`` trains exactly one epoch on it (``--stop-after 1`` of a
   2-epoch run, so no final evaluation of every training point), each step a random
   subset of ``--points-per-step`` points per sample, with ``--workers`` loader processes.
3. While it runs, the resident memory (VmRSS, and PSS) of the training process and its
   loader workers is sampled every 0.2 s from /proc; the peak of their RSS sum (an upper
   bound: shared library pages count once per process) is compared with the data's size.
   It passes (exit 0) when the peak is under a third of the data: a run whose statistics
   pass, batches and model held in memory what they read would need more.

Resident memory counts the pages of memory-mapped files a process has touched while they
are mapped; the store's samples are mapped only while one is read, so what stays resident
is the model, the optimiser, a few batches and the interpreter.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

CHANNEL_BYTES = 4                # float32


def process_tree_memory(pid: int) -> tuple[int, int]:
    """``(RSS, PSS)`` in bytes summed over ``pid`` and every descendant (Linux /proc). The
    RSS sum counts pages shared by the processes (the libraries every loader worker maps)
    once per process: an upper bound; PSS shares them out."""
    rss, pss, stack = 0, 0, [pid]
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1]) * 1024
            with open(f"/proc/{current}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
            with open(f"/proc/{current}/task/{current}/children") as f:
                stack.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return rss, pss


def store_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in store.rglob("*.npy"))


def build_store(out: Path, gb: float, points: int, fields: int, test: int) -> tuple[int, float]:
    """The store of at least ``gb`` GB (module docstring): ``(train samples, seconds)``."""
    from flarepp.data.generators.laplace import make_laplace_store
    sample = points * (3 + fields) * CHANNEL_BYTES
    n_train = max(1, math.ceil(gb * 1e9 / sample) - test)
    print(f"store {out}: {n_train} + {test} samples of {points:,} points and {fields} fields "
          f"({sample / 1e6:.0f} MB each, {(n_train + test) * sample / 1e9:.2f} GB)", flush=True)
    started = time.perf_counter()
    make_laplace_store(out, n_train=n_train, n_test=test, resolution=points, fields=fields)
    return n_train, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the store (several GB: not the repo)")
    parser.add_argument("--gb", type=float, default=8.0,
                        help="size of the store, GB = 10^9 bytes (default 8)")
    parser.add_argument("--points", type=int, default=1_500_000, help="points per sample")
    parser.add_argument("--fields", type=int, default=37, help="target fields per point")
    parser.add_argument("--test", type=int, default=4, help="test samples")
    parser.add_argument("--build-only", action="store_true", help="build the store, no run")
    parser.add_argument("--points-per-step", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--run", help="run directory (default OUT-run)")
    parser.add_argument("--set", action="append", default=[], help="more train --set")
    args = parser.parse_args()
    out = Path(args.out)
    flarepp = [sys.executable, "-m", "flarepp"]
    n_train, seconds = build_store(out, args.gb, args.points, args.fields, args.test)
    size = store_bytes(out)
    print(f"built in {seconds:.0f} s: {size / 1e9:.2f} GB of samples in {out}", flush=True)
    if args.build_only:
        return 0
    run = Path(args.run or f"{out}-run")
    command = [*flarepp, "train", "store-tiny", "--data", str(out), "--out", str(run),
               "--set", "epochs=2", "--stop-after", "1", "--set", "eval_every=2",
               "--set", f"dataset_options.points_per_step={args.points_per_step}",
               "--workers", str(args.workers), "--quiet"]
    for item in args.set:
        command += ["--set", item]
    print(" ".join(command), flush=True)
    started = time.perf_counter()
    child = subprocess.Popen(command)
    peak = [0, 0]

    def sample() -> None:
        while child.poll() is None:
            rss, pss = process_tree_memory(child.pid)
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
            time.sleep(0.2)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    code = child.wait()
    watcher.join()
    seconds = time.perf_counter() - started
    result = {"store": str(out), "data_bytes": size, "data_gib": size / 2 ** 30,
              "train_samples": n_train, "points": args.points,
              "points_per_step": args.points_per_step, "workers": args.workers,
              "peak_rss_bytes": peak[0], "peak_rss_gib": peak[0] / 2 ** 30,
              "peak_pss_gib": peak[1] / 2 ** 30,
              "ratio": peak[0] / size, "seconds": seconds, "exit_code": code}
    print(json.dumps(result, indent=2))
    if code != 0:
        print(f"the training run failed (exit {code})", file=sys.stderr)
        return 1
    verdict = "under" if peak[0] < size / 3 else "NOT under"
    print(f"one epoch on {size / 2 ** 30:.2f} GiB of samples with a peak resident memory of "
          f"{peak[0] / 2 ** 30:.2f} GiB ({100 * peak[0] / size:.1f}% of the data): {verdict} "
          "a third of the data's size")
    return 0 if peak[0] < size / 3 else 1


if __name__ == "__main__":
    sys.exit(main())
