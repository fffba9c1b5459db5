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

``--evaluate`` (issue 38's benchmark) runs instead one whole epoch of ``store-tiny`` with
``--points-per-step`` points per step *and its evaluations* (the validation after the epoch
and the end-of-run evaluation) on the store, under an address-space limit of ``--as-limit``
GiB (``RLIMIT_AS``, set in the child as ``prlimit --as`` does; 0: none), and prints, from the
same sampling of the trainer and its loader workers, the peak resident memory (the whole
run; before the epoch's checkpoint, training; from it to ``metrics.json``, evaluation; after
it, the run's end; no case figures are drawn: ``plot_cases=0``), the training
wall time (``log.jsonl``'s ``seconds``), the wall times of setup and training (to the
epoch's checkpoint, written before any evaluation), of the validation (to ``log.jsonl``'s
line) and of the end-of-run evaluation (to ``metrics.json``), and the exit status::

    python scripts/large_data.py --out /work/bigdata/laplace --evaluate --as-limit 3

A store already complete is not built again (the build resumes and finds every sample), so
``--evaluate`` measures any store ``--out`` names that this script built; ``--store-only``
skips the build step for a store made otherwise (``flarepp data convert``).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
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


class WatchedRun:
    """A child command run under an optional address-space limit, its process tree's
    resident memory sampled every 0.2 s, and the moments the run directory's files appear:
    ``checkpoint`` (the first epoch's, before any evaluation), ``log`` (``log.jsonl``'s
    line, after the validation) and ``metrics`` (``metrics.json``, after the end-of-run
    evaluation), in seconds from the start."""

    def __init__(self, command: list[str], run: Path, as_limit: int | None) -> None:
        self.command, self.run, self.as_limit = command, run, as_limit
        self.peak = {"rss": 0, "pss": 0, "rss_training": 0, "rss_evaluation": 0,
                     "rss_after": 0}
        self.moments: dict[str, float] = {}

    def _limit(self) -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_AS, (self.as_limit, self.as_limit))

    def _mark(self, started: float) -> None:
        files = {"checkpoint": self.run / "checkpoints" / "epoch_0001.pt",
                 "log": self.run / "log.jsonl", "metrics": self.run / "metrics.json"}
        for name, path in files.items():
            if name not in self.moments and path.is_file() and path.stat().st_size > 0:
                self.moments[name] = time.perf_counter() - started

    def wait(self) -> tuple[int, float]:
        """``(exit status, wall seconds)``."""
        print(" ".join(self.command), flush=True)
        started = time.perf_counter()
        child = subprocess.Popen(self.command,
                                 preexec_fn=self._limit if self.as_limit else None)

        def sample() -> None:
            while child.poll() is None:
                rss, pss = process_tree_memory(child.pid)
                self._mark(started)
                phase = ("rss_after" if "metrics" in self.moments else "rss_evaluation"
                         if "checkpoint" in self.moments else "rss_training")
                for key, value in (("rss", rss), ("pss", pss), (phase, rss)):
                    self.peak[key] = max(self.peak[key], value)
                time.sleep(0.2)

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        code = child.wait()
        watcher.join()
        self._mark(started)
        return code, time.perf_counter() - started


def train_command(store: Path, run: Path, args: argparse.Namespace, *extra: str) -> list[str]:
    """``flarepp train store-tiny`` on ``store`` with the script's options and ``--set``s."""
    command = [sys.executable, "-m", "flarepp", "train", "store-tiny", "--data", str(store),
               "--out", str(run), *extra,
               "--set", f"dataset_options.points_per_step={args.points_per_step}",
               "--workers", str(args.workers)]
    for item in args.set:
        command += ["--set", item]
    return command


def evaluate_run(store: Path, run: Path, args: argparse.Namespace) -> int:
    """``--evaluate``: one epoch and its evaluations under the limit (module docstring)."""
    as_limit = int(args.as_limit * 2 ** 30) if args.as_limit else None
    extra = ["--set", "epochs=1", "--set", "plot_cases=0"] + (
        ["--memory-budget", str(args.memory_budget)] if args.memory_budget else [])
    watched = WatchedRun(train_command(store, run, args, *extra), run, as_limit)
    code, seconds = watched.wait()
    at = watched.moments
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()] \
        if (run / "log.jsonl").is_file() else []
    metrics = json.loads((run / "metrics.json").read_text()) \
        if (run / "metrics.json").is_file() else {}
    gib = 2 ** 30
    result = {"store": str(store), "data_gib": store_bytes(store) / gib,
              "as_limit_gib": args.as_limit or None, "points_per_step": args.points_per_step,
              "workers": args.workers, "exit_code": code, "wall_seconds": seconds,
              "peak_rss_gib": watched.peak["rss"] / gib, "peak_pss_gib": watched.peak["pss"] / gib,
              "peak_rss_training_gib": watched.peak["rss_training"] / gib,
              "peak_rss_evaluation_gib": watched.peak["rss_evaluation"] / gib,
              "peak_rss_after_metrics_gib": watched.peak["rss_after"] / gib,
              "training_seconds": log[0]["seconds"] if log else None,
              "setup_and_training_wall_seconds": at.get("checkpoint"),
              "validation_wall_seconds": (at["log"] - at["checkpoint"]
                                          if {"log", "checkpoint"} <= at.keys() else None),
              "end_of_run_evaluation_wall_seconds": (at["metrics"] - at["log"]
                                                     if {"metrics", "log"} <= at.keys() else None),
              "evaluation_wall_seconds": (at["metrics"] - at["checkpoint"]
                                          if {"metrics", "checkpoint"} <= at.keys() else None),
              "memory_plan": metrics.get("memory_plan")}
    print(json.dumps(result, indent=2))
    shown = _seconds
    print(f"exit {code}: peak RSS {result['peak_rss_gib']:.2f} GiB (training "
          f"{result['peak_rss_training_gib']:.2f}, evaluation "
          f"{result['peak_rss_evaluation_gib']:.2f}) under "
          f"{'no limit' if not as_limit else f'--as {args.as_limit:g} GiB'}; training "
          f"{shown(result['training_seconds'])}, evaluation "
          f"{shown(result['evaluation_wall_seconds'])} (validation "
          f"{shown(result['validation_wall_seconds'])}, end of run "
          f"{shown(result['end_of_run_evaluation_wall_seconds'])})")
    return 0 if code == 0 else 1


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the store (several GB: not the repo)")
    parser.add_argument("--gb", type=float, default=8.0,
                        help="size of the store, GB = 10^9 bytes (default 8)")
    parser.add_argument("--points", type=int, default=1_500_000, help="points per sample")
    parser.add_argument("--fields", type=int, default=37, help="target fields per point")
    parser.add_argument("--test", type=int, default=4, help="test samples")
    parser.add_argument("--build-only", action="store_true", help="build the store, no run")
    parser.add_argument("--store-only", action="store_true",
                        help="--out is a store made otherwise: do not build")
    parser.add_argument("--points-per-step", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--run", help="run directory (default OUT-run)")
    parser.add_argument("--set", action="append", default=[], help="more train --set")
    parser.add_argument("--evaluate", action="store_true",
                        help="one epoch with its evaluations, timed and measured (docstring)")
    parser.add_argument("--as-limit", type=float, default=3.0, metavar="GiB",
                        help="--evaluate: the child's address-space limit (0: none)")
    parser.add_argument("--memory-budget", type=float, metavar="GiB",
                        help="--evaluate: flarepp train --memory-budget")
    args = parser.parse_args()
    out = Path(args.out)
    if not args.store_only:
        n_train, seconds = build_store(out, args.gb, args.points, args.fields, args.test)
        print(f"built in {seconds:.0f} s: {store_bytes(out) / 1e9:.2f} GB of samples in {out}",
              flush=True)
    if args.build_only:
        return 0
    run = Path(args.run or f"{out}-run")
    if args.evaluate:
        return evaluate_run(out, run, args)
    size = store_bytes(out)
    watched = WatchedRun(train_command(out, run, args, "--set", "epochs=2", "--stop-after",
                                       "1", "--set", "eval_every=2", "--quiet"), run, None)
    code, seconds = watched.wait()
    peak = watched.peak["rss"]
    result = {"store": str(out), "data_bytes": size, "data_gib": size / 2 ** 30,
              "points": args.points, "points_per_step": args.points_per_step,
              "workers": args.workers, "peak_rss_bytes": peak, "peak_rss_gib": peak / 2 ** 30,
              "peak_pss_gib": watched.peak["pss"] / 2 ** 30,
              "ratio": peak / size, "seconds": seconds, "exit_code": code}
    print(json.dumps(result, indent=2))
    if code != 0:
        print(f"the training run failed (exit {code})", file=sys.stderr)
        return 1
    verdict = "under" if peak < size / 3 else "NOT under"
    print(f"one epoch on {size / 2 ** 30:.2f} GiB of samples with a peak resident memory of "
          f"{peak / 2 ** 30:.2f} GiB ({100 * peak / size:.1f}% of the data): {verdict} "
          "a third of the data's size")
    return 0 if peak < size / 3 else 1


if __name__ == "__main__":
    sys.exit(main())
