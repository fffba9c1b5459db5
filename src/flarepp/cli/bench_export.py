"""``flarepp bench export``: exported-model inference, onnxruntime against PyTorch eager."""

from __future__ import annotations

import argparse

from flarepp.cli import at_least
from flarepp.cli.bench import bench_subparsers, sizes, write_figures


def _bench_export(args: argparse.Namespace) -> int:
    from flarepp.bench.export import DEFAULT_MODEL, bench_export  # (start-up time)
    rows = bench_export(args.n, rounds=args.rounds, batch=args.batch, run=args.run)
    print(f"model: {args.run or DEFAULT_MODEL}; FP32 on the CPU, {rows[0]['threads']} "
          f"thread(s); {args.rounds} interleaved rounds, medians")
    print("        N   eager [s]   onnxruntime [s]   eager / onnxruntime   max |diff|")
    for r in rows:
        print(f"{r['n']:9d} {r['eager_s']:11.4f} {r['onnxruntime_s']:17.4f} "
              f"{r['ratio']:21.2f}   {r['max_abs_diff']:.1e}")
    write_figures(args.json, rows)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = bench_subparsers(sub).add_parser(
        "export", help="exported (ONNX) inference under onnxruntime against PyTorch eager on "
                       "the CPU, same weights, interleaved rounds")
    p.add_argument("--n", type=sizes, default=[16384, 65536], help="points, e.g. 16k,64k")
    p.add_argument("--rounds", type=at_least(1), default=3)
    p.add_argument("--batch", type=at_least(1), default=1)
    p.add_argument("--run", help="a run directory or checkpoint (default: darcy-tiny's "
                                 "FLARE++ with random weights)")
    p.add_argument("--json", help="also write the rows here")
    p.set_defaults(func=_bench_export)
