"""``flarepp bench stream``: block-wise streaming inference vs the unchunked forward.

Adds ``stream`` under the shared ``flarepp bench`` command (:mod:`flarepp.cli.bench`); the
measurements are :mod:`flarepp.bench.streaming`'s.
"""

from __future__ import annotations

import argparse
import os

from flarepp.bench.scaling import parse_size
from flarepp.cli.bench import add_model_arguments, bench_subparsers, write_figures
from flarepp.device import PRECISIONS
from flarepp.distributed.streaming import HIDDEN_ON


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value


def _sizes(text: str) -> list[int]:
    return [_size(t) for t in text.split(",") if t.strip()]


def _precisions(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in names if t not in PRECISIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"precisions are {', '.join(PRECISIONS)}, got {text!r}")
    return names


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:10.1f}"


def _bench_stream(args: argparse.Namespace) -> int:
    from flarepp.bench import streaming  # (start-up time)
    settings = dict(mixer=args.mixer, in_dim=args.in_dim, out_dim=args.out_dim, dim=args.dim,
                    heads=args.heads, latents=args.latents, blocks=args.blocks)
    common = dict(threads=args.threads, device=args.device,
                  retain_memory=not args.system_malloc)
    print(f"model {settings}; load average {os.getloadavg()}")
    result: dict = {"settings": settings}
    if args.n:
        def show(r):
            print(f"  round {r['round']} chunk {r['chunk_size'] or 'none'} {r['precision']}: "
                  f"{r['time_s']:.2f} s "
                  f"({r['cpu_time_s']:.2f} s CPU), peak {_mib(r['peak_bytes']).strip()} MiB, "
                  f"load {r['load_before'][0]:.1f}", flush=True)

        out = streaming.stream_vs_unchunked(settings, args.n, args.chunk_size,
                                            rounds=args.rounds, on_record=show,
                                            precisions=args.precision, **common)
        result["compare"] = out
        print(f"\nN={args.n}, {args.rounds} interleaved rounds; hidden state "
              f"{_mib(out['hidden_bytes']).strip()} MiB")
        print(f"time ratio: to the unchunked forward in {args.precision[0]}, same round")
        print("     chunk precision  time [s]  CPU [s]  peak [MiB]  faults   time ratio (rounds)")
        for row in out["summary"]:
            ratios = ", ".join(f"{r:.2f}" for r in row["time_ratios"])
            print(f"{row['chunk_size'] or 'none':>10} {row['precision']:>9} {row['time_s']:9.2f} "
                  f"{row['cpu_time_s']:8.2f} {_mib(row['peak_bytes'])} "
                  f"{row['minor_faults']:8.0f}   {row['time_ratio']:.2f} ({ratios})")
        print("load average per record: " + "; ".join(
            f"{r['chunk_size'] or 'none'}: {r['load_before'][0]:.1f}->{r['load_after'][0]:.1f}"
            for r in out["records"]))
    if args.exact_n:
        rec = streaming.stream_exactness(settings, args.exact_n, args.chunk_size[0], **common)
        result["exactness"] = rec
        print(f"\nexactness at N={args.exact_n}, chunk {rec['chunk_size']} ({rec['dtype']}): "
              f"max |stream - unchunked| = {rec['max_abs_diff']:.3e} "
              f"(max |y| = {rec['max_abs_output']:.3e}); against the float64 streamed "
              f"forward: streamed {rec['streamed_vs_float64']:.3e}, unchunked "
              f"{rec['unchunked_vs_float64']:.3e}")
    if args.large_n and len(args.hidden_on) > 1:
        result["placements"] = _placements(streaming, settings, args, common)
    elif args.large_n:
        rec = streaming.stream_large(settings, args.large_n, args.chunk_size[0],
                                     hidden_on=args.hidden_on[0],
                                     precision=args.precision[0],
                                     memmap_dir=args.memmap_dir,
                                     page_cache_bytes=args.page_cache, **common)
        result["large"] = rec
        print(f"\nstreamed N={args.large_n} in chunks of {rec['chunk_size']}: "
              f"{rec['time_s']:.1f} s ({rec['cpu_time_s']:.1f} s CPU), peak "
              f"{_mib(rec['peak_bytes']).strip()} MiB (hidden state "
              f"{_mib(rec['hidden_bytes']).strip()} MiB), {rec['precision']}, "
              f"{rec['minor_faults']} minor faults; "
              f"load {rec['load_before'][0]:.1f} -> {rec['load_after'][0]:.1f}; "
              f"allocator {rec['malloc']}")
    write_figures(args.json, result)
    return 0


def _placements(streaming, settings: dict, args: argparse.Namespace, common: dict) -> dict:
    """--large-n with several --hidden-on: each in interleaved rounds, times and ratios."""
    def show(r):
        print(f"  round {r['round']} hidden state {r['hidden_on']}: {r['time_s']:.1f} s "
              f"({r['cpu_time_s']:.1f} s CPU, {r['uncontended_s']:.1f} s without waiting for "
              f"a CPU), peak {_mib(r['peak_bytes']).strip()} MiB, "
              f"{r['minor_faults']} minor / {r['major_faults']} major faults, disk read "
              f"{_mib(r.get('disk_read_bytes', 0)).strip()} MiB, written "
              f"{_mib(r.get('disk_write_bytes', 0)).strip()} MiB, load {r['load_before'][0]:.1f} -> "
              f"{r['load_after'][0]:.1f}", flush=True)

    out = streaming.stream_placements(settings, args.large_n, args.chunk_size[0],
                                      args.hidden_on, rounds=args.rounds, on_record=show,
                                      precision=args.precision[0],
                                      memmap_dir=args.memmap_dir,
                                      page_cache_bytes=args.page_cache, **common)
    cache = "" if not args.page_cache else f", page cache {_mib(args.page_cache).strip()} MiB"
    print(f"\nN={args.large_n}, chunks of {args.chunk_size[0]}, {args.precision[0]}, hidden "
          f"state {_mib(out['hidden_bytes']).strip()} MiB{cache}, {args.rounds} interleaved "
          "rounds")
    for row in out["summary"]:
        for key, what in (("time_s", "wall"), ("uncontended_s", "without waiting for a CPU"),
                          ("cpu_time_s", "CPU")):
            ratios = ", ".join(f"{r:.3f}" for r in row[f"{key}_ratios"])
            print(f"  {row['hidden_on']:>7} {what}: median {row[key]:.1f} s = "
                  f"{1e6 * row[key] / out['n_tokens']:.2f} us/token; / {args.hidden_on[0]} "
                  f"{row[f'{key}_ratio']:.3f} ({ratios})")
    return out


def _placements_arg(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names or any(n not in HIDDEN_ON for n in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated {', '.join(HIDDEN_ON)}, "
                                         f"got {text!r}")
    return names


def register(sub: argparse._SubParsersAction) -> None:
    p = bench_subparsers(sub).add_parser(
        "stream", help="block-wise streaming inference: time, peak memory and exactness "
                       "against the unchunked forward",
        description="Each measurement is one forward in a fresh interpreter. --n: unchunked "
                    "vs streamed at each --chunk-size, in interleaved rounds; --exact-n: "
                    "max |streamed - unchunked|; --large-n: one streamed forward alone.")
    p.add_argument("--mixer", default="flarepp")
    p.add_argument("--in-dim", type=int, default=6)
    p.add_argument("--out-dim", type=int, default=4)
    add_model_arguments(p, dim=128, heads=8, latents=64, blocks=8)
    p.add_argument("--n", type=_size, default=None,
                   help="tokens for the timed comparison (k = 1024, M = 1048576), e.g. 256k")
    p.add_argument("--chunk-size", type=_sizes, default=[16384],
                   help="comma-separated chunk sizes; the first serves --exact-n and --large-n")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--exact-n", type=_size, default=None, help="tokens for the exactness check")
    p.add_argument("--large-n", type=_size, default=None,
                   help="tokens for one streamed forward alone (e.g. 8800000)")
    p.add_argument("--hidden-on", type=_placements_arg, default=["auto"],
                   help="where --large-n keeps the hidden state (auto, device, host, memmap; "
                        "default auto); several, comma-separated (e.g. host,memmap: in core "
                        "against out of core), are compared in --rounds interleaved rounds")
    p.add_argument("--page-cache", type=_size, default=None,
                   help="emulate a page cache of this many bytes (k, M: binary) for a memory-mapped "
                        "hidden state: least recently used chunks beyond it are paged out "
                        "(Linux >= 5.4), as on a machine with less memory than the state")
    p.add_argument("--memmap-dir", default=None,
                   help="directory of the memory-mapped hidden state (default the system's "
                        "temporary directory)")
    p.add_argument("--precision", type=_precisions, default=("fp32",),
                   help="comma-separated: fp32, bf16 (autocast: BF16 products, FP32 "
                        "accumulation), fp16; --n times each (ratios against the first); "
                        "--large-n runs the first")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default torch's)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:K")
    p.add_argument("--system-malloc", action="store_true",
                   help="CPU: glibc's default allocator in the workers instead of the "
                        "retained-memory policy of flarepp.allocator")
    p.add_argument("--json", help="also write every record here")
    p.set_defaults(func=_bench_stream)
