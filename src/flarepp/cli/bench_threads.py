"""``flarepp bench threads``: step time at each CPU thread count, and the count a run picks."""

from __future__ import annotations

import argparse
import os

from flarepp import threads
from flarepp.cli import at_least
from flarepp.cli.bench import bench_subparsers, sizes


def _bench_threads(args: argparse.Namespace) -> int:
    from flarepp.bench.threads import format_header, run_threads_bench  # (start-up time)
    counts = threads.candidates(threads.thread_budget())  # (attributes: tests replace them)
    print(f"one training step per case, {args.rounds} interleaved rounds, medians; "
          f"{threads.usable_cores()} usable core(s); load average {os.getloadavg()[0]:.2f}")
    print(format_header(counts))
    run_threads_bench(args.resolutions, args.n, rounds=args.rounds)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = bench_subparsers(sub).add_parser(
        "threads", help="training step time at each CPU thread count (darcy-tiny, the Table "
                        "7 surrogate) beside the count a run would choose")
    p.add_argument("--resolutions", type=lambda t: [int(r) for r in t.split(",")],
                   default=[22, 85], metavar="R1,R2", help="darcy-tiny grid sides")
    p.add_argument("--n", type=sizes, default=[16384],
                   help="points of the Table 7 surrogate, e.g. 16k")
    p.add_argument("--rounds", type=at_least(1), default=3,
                   help="interleaved rounds over the counts (the median is shown)")
    p.set_defaults(func=_bench_threads)
