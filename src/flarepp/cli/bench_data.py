"""``flarepp bench data``: conversion throughput and the loader's share of a training step.

Adds ``data`` under the shared ``flarepp bench`` command (:mod:`flarepp.cli.bench`); the
measurements are :mod:`flarepp.bench.data`'s.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from flarepp.cli import at_least
from flarepp.cli.bench import bench_subparsers, counts, write_figures
from flarepp.data.generators.laplace import make_laplace_store


def _or_none(parse):
    """An argparse ``type``: ``none`` is the empty list, anything else ``parse``'s."""
    return lambda text: [] if text.strip() == "none" else parse(text)


def _cell_types(text: str) -> list[str]:
    from flarepp.bench.data import CELL_TYPES  # (start-up time)
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in (*CELL_TYPES, "mixed")]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown cell type(s) {unknown or text!r}; known: "
                                         f"{', '.join([*CELL_TYPES, 'mixed'])}")
    return names


def _bench_data(args: argparse.Namespace) -> int:
    from flarepp.bench.data import conversion_by_cell_type, conversion_throughput  # (start-up)
    print(f"load average {os.getloadavg()}", flush=True)
    result: dict = {}
    if args.cases:
        result["conversion"] = conversion_throughput(args.cases, args.cells)
        for association, r in result["conversion"].items():
            print(f"convert {r['cases']} VTU files, data at {association}s: {r['rows']} rows "
                  f"in {r['seconds']:.2f} s = {r['rows_per_s']:,.0f} {association}s/s",
                  flush=True)
    if args.cell_types:
        result["cell_types"] = conversion_by_cell_type(args.cell_types, args.cells,
                                                       rounds=args.rounds)
        for r in result["cell_types"]:
            print(f"convert {r['cells']:,} {r['cell_type']} cells: {r['seconds']:.2f} s = "
                  f"{r['us_per_cell']:.2f} us/cell ({r['uncontended_us_per_cell']:.2f} without "
                  f"waiting for a CPU); peak memory {r['peak_bytes'] / 2**20:,.0f} "
                  f"MiB (VTU file {r['file_bytes'] / 2**20:,.0f} MiB, stored arrays "
                  f"{r['array_bytes'] / 2**20:,.0f} MiB)", flush=True)
    if args.workers:
        result["loader"] = _loader_shares(args)
    write_figures(args.json, result)
    return 0


def _loader_shares(args: argparse.Namespace) -> list[dict]:
    from flarepp.bench.data import loader_share  # (start-up time)
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store
        if store is None:
            store = Path(tmp) / "store"
            make_laplace_store(store, n_train=args.samples, n_test=4, resolution=args.points,
                               progress=False)
        shares = []
        for workers in args.workers:
            r = loader_share(store, preset=args.preset, workers=workers, steps=args.steps,
                             points_per_step=args.points_per_step)
            shares.append(r)
            print(f"{args.preset}, {workers} loader worker(s): waiting for batches "
                  f"{100 * r['loader_share']:.2f}% of step time over {r['steps']} steps "
                  f"({r['wait_s']:.3f} s of {r['wait_s'] + r['step_s']:.3f} s; first batch "
                  f"{r['first_wait_s']:.2f} s)", flush=True)
    return shares


def register(sub: argparse._SubParsersAction) -> None:
    p = bench_subparsers(sub).add_parser(
        "data", help="conversion throughput (rows/s) and the loader's share of step time",
        description="Converts generated VTU files (cells/s, points/s), then trains steps of "
                    "a store-backed fields task and reports the share of step time spent "
                    "waiting for batches, per loader worker count.")
    p.add_argument("--cases", type=at_least(0), default=8,
                   help="VTU files to convert (0: skip the conversion)")
    p.add_argument("--cells", type=at_least(6), default=50_000,
                   help="cells per file (tetrahedra for --cases, else of each --cell-types)")
    p.add_argument("--cell-types", type=_cell_types, default=None,
                   help="convert one file of --cells cells per cell type, comma-separated "
                        "(tetra, hexahedron, wedge, pyramid, mixed), each in a fresh process: "
                        "time per cell and peak memory")
    p.add_argument("--rounds", type=at_least(1), default=1,
                   help="interleaved rounds of --cell-types (medians reported)")
    p.add_argument("--store", help="a store to train on (default: a generated laplace-store "
                                   "of --samples samples of --points points)")
    p.add_argument("--samples", type=at_least(1), default=64)
    p.add_argument("--points", type=at_least(2), default=972,
                   help="points per generated sample (default 972, elasticity-tiny's)")
    p.add_argument("--preset", default="store-tiny")
    p.add_argument("--workers", type=_or_none(counts(0)), default=[0, 2],
                   help="loader worker counts, comma-separated (default 0,2; none: skip the "
                        "loader measurement)")
    p.add_argument("--steps", type=at_least(1), default=40, help="timed steps per count")
    p.add_argument("--points-per-step", type=at_least(1), default=None,
                   help="train on random subsets of this many points per sample")
    p.add_argument("--json", help="write the measurements here")
    p.set_defaults(func=_bench_data)
