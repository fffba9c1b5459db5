"""``flarepp bench cp``: context-parallel efficiency (Table 5) and streaming memory on CPU.

Adds ``cp`` under the shared ``flarepp bench`` command (:mod:`flarepp.cli.bench`).
"""

from __future__ import annotations

import argparse

from flarepp.cli.bench import add_model_arguments, bench_subparsers, counts, write_figures


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:9.1f}"


def _bench_cp(args: argparse.Namespace) -> int:
    from flarepp.bench.cp import context_parallel_scaling, streaming_memory  # (start-up time)
    settings = dict(mixer=args.mixer, in_dim=3, out_dim=1, dim=args.dim, heads=args.heads,
                    latents=args.latents, blocks=args.blocks)
    print(f"model {settings}; one thread per rank")
    result = {"settings": settings}
    if args.only in (None, "scaling"):
        rows = context_parallel_scaling(settings, args.n_tokens, args.ranks, steps=args.steps)
        result["scaling"] = {"n_tokens": args.n_tokens, "rows": rows}
        print(f"\ntraining step at N={args.n_tokens} (forward, backward, gradient all-reduce)")
        print("   R   step [s]   CPU/rank [s]   peak/rank [MiB]     E   E_cpu  E_mem")
        for r in rows:
            print(f"{r['ranks']:4d} {r['step_s']:10.3f} {r['cpu_s_per_rank']:14.3f} "
                  f"{_mib(r['peak_bytes_per_rank'])}         {r['E']:5.2f}  {r['E_cpu']:5.2f}"
                  f"  {r['E_mem']:5.2f}")
    if args.only in (None, "streaming"):
        rows = streaming_memory(settings, args.stream_n, args.chunk_size)
        result["streaming"] = rows
        print(f"\ninference peak memory, streamed in chunks of {args.chunk_size} vs unchunked")
        print("         N   streamed [MiB]   unchunked [MiB]")
        for r in rows:
            print(f"{r['n_tokens']:10d} {_mib(r['stream_peak_bytes'])}        "
                  f"{_mib(r['unchunked_peak_bytes'])}")
    write_figures(args.json, result)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = bench_subparsers(sub).add_parser(
        "cp", help="context-parallel scaling (Table 5) and streaming-inference memory on CPU")
    p.add_argument("--mixer", default="flarepp")
    add_model_arguments(p, dim=128, heads=8, latents=64, blocks=2)
    p.add_argument("--n-tokens", type=int, default=65536, help="mesh size for the scaling run")
    p.add_argument("--ranks", type=counts(1), default=[1, 2],
                   help="comma-separated rank counts; the first is the reference (default 1,2)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per rank count")
    p.add_argument("--stream-n", type=counts(1), default=[16384, 65536, 262144],
                   help="comma-separated N for the streaming-memory table")
    p.add_argument("--chunk-size", type=int, default=16384)
    p.add_argument("--only", choices=["scaling", "streaming"], help="run one of the two parts")
    p.add_argument("--json", help="also write the figures here")
    p.set_defaults(func=_bench_cp)
