"""``flarepp bench SUBCOMMAND``: benchmarks, one sub-subcommand each.

``bench`` only groups them. A benchmark adds itself with :func:`bench_subparsers`, from any
module of :mod:`flarepp.cli` that defines ``register(subparsers)`` (modules register in name
order, so this one, which creates ``bench``, comes first)::

    def register(sub):
        p = bench_subparsers(sub).add_parser("cp", help="...")
        p.add_argument(...)
        p.set_defaults(func=_bench_cp)

The benchmark modules themselves (:mod:`flarepp.bench`'s ``cp``, ``data``, ``export``,
``serve``, ``streaming``, ``threads``) are imported by the handlers, not here: every
``flarepp`` command builds the whole parser, and they would add about 60 ms to its start
(``python -X importtime -m flarepp --help``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from flarepp.bench.reference import REFERENCE_MIXER
from flarepp.bench.scaling import (ScalingConfig, failed_points, format_table, parse_sizes,
                                   ratios, run_scaling, write_outputs)
from flarepp.cli import at_least
from flarepp.device import DEVICE_HELP
from flarepp.io import atomic_write_json

BENCH_DEST = "bench"
ALLOCATOR_SWITCH = "FLAREPP_RETAIN_MEMORY=0 switches it off"


def bench_subparsers(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The sub-subparsers of ``flarepp bench``, creating the ``bench`` command if needed."""
    bench = sub.choices.get("bench")
    if bench is None:
        bench = sub.add_parser("bench", help="benchmarks (see `flarepp bench -h`)",
                               description="Benchmarks, one sub-command each.")
        return bench.add_subparsers(dest=BENCH_DEST, metavar="BENCH", required=True)
    for action in bench._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise RuntimeError("`flarepp bench` exists but takes no sub-commands")


def counts(low: int):
    """An argparse ``type``: comma-separated integers, each ``>= low`` (a usage error
    naming the text otherwise)."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated counts, got "
                                             f"{text!r}") from None
        if not values or min(values) < low:
            raise argparse.ArgumentTypeError(f"expected counts >= {low}, got {text!r}")
        return values
    return parse


def sizes(text: str) -> list[int]:
    """An argparse ``type``: comma-separated token counts, ``k = 1024``, ``M = 1048576``
    (:func:`~flarepp.bench.scaling.parse_sizes`; a usage error naming the text otherwise)."""
    try:
        return parse_sizes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_model_arguments(p: argparse.ArgumentParser, *, dim: int, heads: int, latents: int,
                        blocks: int) -> None:
    """``--dim``, ``--heads``, ``--latents``, ``--blocks``: the size of the benchmarked
    model, with this benchmark's defaults."""
    p.add_argument("--dim", type=at_least(1), default=dim, help="channels C")
    p.add_argument("--heads", type=at_least(1), default=heads, help="heads H")
    p.add_argument("--latents", type=at_least(1), default=latents, help="latents M")
    p.add_argument("--blocks", type=at_least(1), default=blocks)


def write_figures(path: str | Path | None, figures: Any) -> None:
    """A benchmark's ``--json``: write ``figures`` to ``path`` (atomically) and say so;
    nothing when no path was given."""
    if path:
        atomic_write_json(Path(path), figures)
        print(f"wrote {path}")


def _rounds(row: dict) -> str:
    """The median of the per-round ratios and the rounds' own, where there are rounds."""
    if "time_ratio_rounds" not in row:
        return ""
    each = ", ".join(f"{x:.3f}" for x in row["round_ratios"])
    return f"   per round: median {row['time_ratio_rounds']:.3f} ({each})"


def _scaling(args: argparse.Namespace) -> int:
    mixers = [m.strip() for m in args.mixers.split(",") if m.strip()]
    if args.reference_repo and REFERENCE_MIXER not in mixers:
        mixers.append(REFERENCE_MIXER)
    config = ScalingConfig(
        mixers=mixers, sizes=args.n, reference_repo=args.reference_repo,
        batch=args.batch, dim=args.dim, heads=args.heads, blocks=args.blocks,
        latents=args.latents, dtype=args.dtype, device=args.device, repeats=args.repeats,
        warmup=args.warmup, time_budget_s=args.time_budget, threads=args.threads,
        compile=args.compile, rounds=args.rounds, total_budget_s=args.total_budget)
    print(f"device {config.device}; CPU workers keep freed memory: {config.retain_memory} "
          f"({ALLOCATOR_SWITCH})")
    result = run_scaling(config)
    print("\n" + format_table(result["records"]))
    rows = ratios(result["records"])
    if rows:
        print("\nFLARE++ / FLARE:      N   step time   (CPU time)   peak memory")
        for r in rows:
            cpu = f"{r['cpu_time_ratio']:8.3f}" if r["cpu_time_ratio"] else "       -"
            print(f"{r['n']:>26d}   {r['time_ratio']:9.3f}   {cpu}   {r['mem_ratio']:11.3f}"
                  + _rounds(r))
    for mixer in ("flare", "flarepp"):
        rows = ratios(result["records"], REFERENCE_MIXER, mixer)
        if rows:
            print(f"\nFLARE study's FLAREModel / flarepp {mixer}:  N   step time   (CPU time)")
            for r in rows:
                cpu = f"{r['cpu_time_ratio']:8.3f}" if r["cpu_time_ratio"] else "       -"
                print(f"{r['n']:>40d}   {r['time_ratio']:9.3f}   {cpu}" + _rounds(r))
    if args.json:
        paths = write_outputs(result, Path(args.json))
        print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    failed = failed_points(result["records"])
    for r in failed:
        print(f"FAILED {r['mixer']} N={r['n']}: {r['status']}", file=sys.stderr)
    return 1 if failed else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = bench_subparsers(sub).add_parser(
        "scaling", help="step time and peak memory of complete models against N (Figure 6)",
        description="Forward+backward step time (median after warm-up) and peak memory of "
                    "complete models against the token count N, with achieved FLOP/s. CPU "
                    "points run in fresh worker processes that keep freed memory for reuse "
                    f"(flarepp.allocator; {ALLOCATOR_SWITCH}).")
    p.add_argument("--mixers", default="attention,flare,flarepp",
                   help="comma-separated registered mixers (default attention,flare,flarepp)")
    p.add_argument("--n", type=sizes, default=sizes("1k,4k,16k"),
                   help="comma-separated token counts, k = 1024, M = 1048576 (default 1k,4k,16k)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="fp32 (LayerNorm) or autocast to bf16/fp16 (RMSNorm), paper C.2")
    p.add_argument("--device", default="auto", help=DEVICE_HELP + " (default auto)")
    p.add_argument("--batch", type=at_least(1), default=8)
    add_model_arguments(p, dim=128, heads=8, latents=64, blocks=8)
    p.add_argument("--repeats", type=at_least(1), default=5, help="timed steps per point")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--rounds", type=at_least(1), default=1,
                   help="measure each point this many times, round-robin over the mixers, "
                        "and pool the steps (for a shared, noisy machine)")
    p.add_argument("--time-budget", type=float, default=600.0, metavar="S",
                   help="skip a point whose steps (one round) are estimated to take longer "
                        "(default 600)")
    p.add_argument("--total-budget", type=float, default=None, metavar="S",
                   help="skip the points that would end the whole sweep past S seconds")
    p.add_argument("--threads", type=at_least(1), default=None,
                   help="CPU threads per measurement (default: torch's default)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each block (flarepp.compile_model); compile time is "
                        "spent in the warm-up step")
    p.add_argument("--reference-repo", metavar="PATH", default=None,
                   help="a clone of the FLARE study's code (GitHub vpuri3/FLARE.py): also "
                        "time its own FLAREModel at the same settings, as mixer "
                        "'flare-study' (imported from PATH at run time; needs einops)")
    p.add_argument("--json", metavar="OUT.json",
                   help="write records here, with OUT.csv and OUT.png beside it")
    p.set_defaults(func=_scaling)
