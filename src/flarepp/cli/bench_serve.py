"""``flarepp bench serve``: ``flarepp serve`` under load on this machine (loopback only);
the measurements are :mod:`flarepp.bench.serve`'s."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from flarepp.cli import CLIError, at_least
from flarepp.cli.bench import bench_subparsers, counts, write_figures
from flarepp.experiments.reports.common import fmt, markdown


def _bench_serve(args: argparse.Namespace) -> int:
    from flarepp.bench.serve import (ServeBenchConfig, batching_ceiling,  # (start-up time)
                                     goals, run_serve_bench)
    if 1 not in args.clients:
        raise CLIError("--clients must include 1 (the latency goal compares with one client)")
    config = ServeBenchConfig(run=args.run, clients=tuple(args.clients), points=args.points,
                              requests=args.requests, seconds=args.seconds,
                              max_batch=args.max_batch, large_points=args.large_points,
                              chunk_size=args.chunk_size, protocol=args.protocol,
                              server_threads=args.server_threads)
    print(f"load average {os.getloadavg()}; {os.cpu_count()} CPUs; clients over "
          f"{args.protocol}, {args.points}-point meshes; server threads "
          f"{args.server_threads or 'its own choice'}", flush=True)
    result = run_serve_bench(config)
    print("\n" + "\n".join(markdown(
        ["server", "clients", "answered", "req/s", "p50 ms", "p99 ms", "peak MiB", "errors",
         "wrong"],
        [[r["mode"], r["clients"], r["answered"], fmt(r["throughput"], ".1f"),
          fmt(r["p50_ms"], ".1f"), fmt(r["p99_ms"], ".1f"), fmt(r["peak_mib"], ".0f"),
          r["errors"], r["wrong"]] for r in result["load"]])))
    print("\nwhere a request's time goes (per answered request; forward ms: wall time in the "
          "model's forwards, which run on one thread):")
    print("\n".join(markdown(
        ["server", "clients", "server CPU ms", "of it event loop ms", "forward ms",
         "requests per forward", "client CPU ms"],
        [[r["mode"], r["clients"], fmt(r["server_cpu_ms"], ".1f"), fmt(r["loop_cpu_ms"], ".1f"),
          fmt(r["forward_ms"], ".1f"), fmt(r["per_forward"], ".1f"),
          fmt(r["client_cpu_ms"], ".1f")] for r in result["load"]])))
    most, limit = batching_ceiling(result)
    print(f"batching's ceiling at {most} clients: (server + client) CPU per request, unbatched "
          f"/ batched = {limit:.2f} (the most batching can raise throughput where the CPU "
          "bounds it)")
    large = result["large"]
    print(f"\n{large['points']} points over gRPC, streamed in chunks of {large['chunk_size']}: "
          f"{large['seconds']:.1f} s, max |served - flarepp infer| / scale "
          f"{large['deviation']:.1e}; server peak {large['peak_mib_before']:.0f} MiB before, "
          f"{large['peak_mib_after']:.0f} MiB after (the answer alone "
          f"{large['answer_mib']:.0f} MiB)")
    print("\n" + "\n".join(markdown(["bad request", "answer", "server alive after"],
                                    [[b["request"], b["answer"], b["alive"]]
                                     for b in result["bad"]])))
    met = goals(result)
    print("\n" + "\n".join(markdown(["goal", "measured", "met"],
                                    [[g, fmt(v, ".3g"), ok] for g, v, ok in met])))
    write_figures(args.json, {**result, "goals": met})
    return 0


HELP = "flarepp serve under load: throughput, latency, memory, errors"
DESCRIPTION = ("Starts `flarepp serve` twice on loopback ports (batched and unbatched), sends "
               "1K-point meshes from 1, 4, 16 concurrent clients (each answer checked), one "
               "1M-point mesh (compared with `flarepp infer`) and one bad request of each "
               "class. Without --run it trains store-tiny for one epoch on elasticity "
               "meshes first.")


def register(sub: argparse._SubParsersAction) -> None:
    p = bench_subparsers(sub).add_parser("serve", help=HELP, description=DESCRIPTION)
    p.add_argument("--run", help="an unconditioned run directory (default: one made here)")
    p.add_argument("--clients", type=counts(1), default=[1, 4, 16],
                   help="concurrent client counts (default 1,4,16; must include 1)")
    p.add_argument("--points", type=at_least(2), default=1024, help="points per mesh")
    p.add_argument("--requests", type=at_least(1), default=320,
                   help="requests per phase, shared among its clients (default 320)")
    p.add_argument("--seconds", type=float, default=60.0,
                   help="seconds per phase at most (default 60)")
    p.add_argument("--max-batch", type=at_least(2), default=16,
                   help="the batched server's --max-batch (default 16)")
    p.add_argument("--large-points", type=at_least(2), default=1 << 20,
                   help="points of the large mesh (default 1048576)")
    p.add_argument("--chunk-size", type=at_least(1), default=1 << 16,
                   help="the servers' --chunk-size and flarepp infer's (default 65536)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc",
                   help="the load clients' protocol (default grpc)")
    p.add_argument("--server-threads", type=at_least(1), default=None,
                   help="the servers' CPU threads (--threads; default: their own choice)")
    p.add_argument("--json", type=Path, help="also write every measurement here")
    p.set_defaults(func=_bench_serve)
