"""``flarepp sweep``: a grid of runs over config keys, and ``flarepp sweep report DIR``."""

from __future__ import annotations

import argparse

from flarepp.cli import CLIError


def _sweep(args: argparse.Namespace) -> int:
    from flarepp.experiments.sweep import (SweepSpec, open_sweep, parse_axes, run_sweep,
                                           write_report)
    if args.preset == "report":
        if not args.directory:
            raise CLIError("usage: flarepp sweep report DIR")
        paths = write_report(args.directory)
        print("\n".join(str(p) for p in paths.values()))
        return 0
    if args.directory:
        raise CLIError(f"unexpected argument {args.directory!r} (a sweep takes PRESET "
                       "--grid ... --out DIR; a report: flarepp sweep report DIR)")
    if args.out is None:
        raise CLIError("give --out DIR (the sweep's directory)")
    if args.preset is None:
        if args.grid or args.set or args.data:
            raise CLIError("--grid, --set and --data describe a new sweep: give its PRESET")
        spec = open_sweep(args.out, None)
    else:
        from flarepp.train import get_preset
        if not args.grid:
            raise CLIError("give --grid KEY=V1,V2 ... (e.g. --grid seed=0,1,2)")
        base = get_preset(args.preset, args.set or [])
        data = args.data or base.data_root
        spec = open_sweep(args.out, SweepSpec(base, parse_axes(args.grid), str(data)))
    done = run_sweep(spec, args.out, log=(lambda _: None) if args.quiet else print)
    print(f"this process: {len(done['finished'])} finished, {len(done['failed'])} failed, "
          f"{len(done['skipped'])} held by other processes")
    if args.report:
        paths = write_report(args.out)
        print("\n".join(str(p) for p in paths.values()))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="train a grid of runs over config keys (resumable, "
                                     "shareable by several processes); `sweep report DIR` "
                                     "writes its tables and figures")
    p.add_argument("preset", nargs="?", metavar="PRESET|report",
                   help="the base preset (omit to continue the sweep in --out), or `report`")
    p.add_argument("directory", nargs="?", metavar="DIR", help="the sweep to report on")
    p.add_argument("--grid", nargs="+", metavar="KEY=V1,V2",
                   help="axes of the grid, e.g. model.mixer=flare,flarepp model.blocks=2,4 "
                        "seed=0,1,2 precision=fp32,fp16 (any --set key)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override the preset for every point (repeatable)")
    p.add_argument("--data", help="dataset directory (default: the preset's data_root)")
    p.add_argument("--out", help="the sweep's directory (one run directory per point)")
    p.add_argument("--report", action="store_true",
                   help="write the report when this process is done")
    p.add_argument("--quiet", action="store_true", help="no per-point lines")
    p.set_defaults(func=_sweep)
