"""``flarepp data make NAME --out DIR ...``, ``flarepp data convert SOURCE --out STORE ...``
and ``flarepp data check {STORE | NAME PATH}``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flarepp.cli import CLIError, at_least, say
from flarepp.data import load_dataset
from flarepp.data.convert import convert
from flarepp.data.generators import GENERATORS
from flarepp.data.spec import load_spec
from flarepp.data.store import MeshStore
from flarepp.device import available_memory
from flarepp.values import parse_assignments


def _make(args: argparse.Namespace) -> int:
    entry = GENERATORS.entry(args.dataset)
    resolution = entry.defaults.get("resolution") if args.resolution is None else args.resolution
    try:
        paths = entry.obj(args.out, n_train=args.train, n_test=args.test, resolution=resolution,
                          seed=args.seed, progress=not args.quiet, overwrite=args.overwrite)
    except (ModuleNotFoundError, FileExistsError) as err:
        raise CLIError(str(err)) from err
    except (MemoryError, ValueError) as err:
        if isinstance(err, ValueError) and not str(err).startswith("array is too big"):
            raise  # only numpy's refusal of an array larger than any address space
        need = getattr(err, "_total_size", None)   # numpy's _ArrayMemoryError knows it
        what = (f"an array of {need / 2**30:.1f} GiB" if need
                else f"an array of more than {2**63 / 2**30:.3g} GiB (more than a 64-bit "
                     "address space holds)" if isinstance(err, ValueError)
                else "more memory than is available")
        raise MemoryError(f"{args.dataset} at --resolution {resolution} needs {what}, and "
                          f"{available_memory() / 2**30:.1f} GiB is available; choose a "
                          "smaller --resolution (or fewer --train/--test samples)") from None
    for path in paths:
        print(f"wrote {path}")
    if args.dataset in NEXT_STEP:
        print(NEXT_STEP[args.dataset].format(out=args.out))
        return 0
    options = f"n_train={args.train}, n_test={args.test}"
    if args.dataset == "darcy":
        options += f", resolution={resolution}"
    print(f"load with flarepp.data.load_dataset({args.dataset!r}, {str(args.out)!r}, {options})")
    return 0


NEXT_STEP = {
    "elasticity-mesh": "convert with: flarepp data convert {out} --out {out}-store --targets "
                       "von_mises --conditions load --test-pattern 'test/*'",
    "laplace-store": "train with: flarepp train store-tiny --data {out}",
    "surface-flow": "train with: flarepp train drivaerml-tiny --data {out}   (task 'surface', "
                    "dataset 'drivaerml' with the split file {out}/split.json)",
}
"""What to run on a generator's files, where it is not ``flarepp.data.load_dataset``."""


def _check(args: argparse.Namespace) -> int:
    if args.path is None or args.dataset == "store":
        root = Path(args.path or args.dataset)
        if not root.is_dir():
            raise CLIError(f"usage: flarepp data check STORE, or flarepp data check NAME PATH "
                           f"({str(root)!r} is not a directory)")
        store = MeshStore(root)
        print("\n".join(store.describe()))
        store.check(full=args.verify)
        how = ("every byte compared" if args.verify
               else "sizes; sampled digests where times differ")
        print(f"every array is as written ({how})")
        return 0
    options = parse_assignments(args.option, "--option")
    splits = load_dataset(args.dataset, args.path, **options)
    for split in ("train", "test"):
        samples = getattr(splits, split)
        mask = "none" if samples.mask is None else f"{int(samples.mask.sum())} real points"
        print(f"{split}: x {list(samples.x.shape)}, y {list(samples.y.shape)}, mask {mask}, "
              f"grid {samples.grid_shape}")
    print(f"field {splits.field_names} [{splits.units}] from {splits.source}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    flags = {"association": args.association, "geometry": _names(args.geometry),
             "inputs": _names(args.inputs), "targets": _names(args.targets),
             "conditions": _names(args.conditions), "condition_table": args.condition_table,
             "format": args.format, "pattern": args.pattern,
             "split": {k: v for k, v in (("test", args.test_pattern),
                                         ("test_fraction", args.test_fraction)) if v is not None}
             or None}
    spec = load_spec(args.spec, flags)
    report = convert(args.source, args.out, spec, overwrite=args.overwrite,
                     progress=not args.quiet)
    for warning in report.warnings:
        print(f"flarepp data convert: warning: {warning}", file=sys.stderr)
    rate = report.rows / report.seconds if report.seconds > 0 and report.read else 0.0
    say(f"converted {report.read} case(s) ({report.reused} finished earlier), "
        f"{report.rows} {spec.association}s in {report.seconds:.1f} s ({rate:,.0f} "
        f"{spec.association}s/s) into {args.out}")
    say("\n".join(report.store.describe()))
    say(f"train with: flarepp train store-tiny --data {args.out}"
        + ("   (conditions: store-conditioned-tiny)" if spec.conditions else ""))
    return 0


def _names(text: str | None) -> list[str] | None:
    return None if text is None else [t.strip() for t in text.split(",") if t.strip()]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("data", help="make or check datasets")
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    make = sub.add_parser("make", help="generate a PDE dataset in a public benchmark layout")
    make.add_argument("dataset", choices=GENERATORS.names())
    make.add_argument("--out", required=True, help="directory for the files")
    make.add_argument("--train", type=at_least(1), default=1000, help="training samples")
    make.add_argument("--test", type=at_least(1), default=200, help="test samples")
    make.add_argument("--resolution", type=at_least(1), default=None,
                      help="darcy: grid points per side (default 85); surface-flow: cells "
                           "per surface (default 5000); advection-diffusion: grid points per "
                           "side (default 32); laplace-store: points per sample (default "
                           "100000); elasticity: fixed at 972 points")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--overwrite", action="store_true", help="replace existing files")
    make.add_argument("--quiet", action="store_true", help="no progress bar")
    make.set_defaults(func=_make)

    convert = sub.add_parser("convert", help="convert solver output files (VTU, VTP, OpenFOAM, "
                             "EnSight, Gmsh, ...) into a store (docs/data.md)")
    convert.add_argument("source", help="directory of case files, or one file")
    convert.add_argument("--out", required=True, help="the store's directory")
    convert.add_argument("--spec", help="a TOML spec (flags below win over its keys)")
    convert.add_argument("--association", choices=["point", "cell"])
    convert.add_argument("--geometry", help="computed leading inputs, e.g. coordinates,normals")
    convert.add_argument("--inputs", help="comma-separated input arrays")
    convert.add_argument("--targets", help="comma-separated target arrays")
    convert.add_argument("--conditions", help="comma-separated per-case conditions")
    convert.add_argument("--condition-table", help="CSV or JSON of conditions by case")
    convert.add_argument("--format", help="the mesh format to read (default: from suffixes)")
    convert.add_argument("--pattern", help="glob of the case files under SOURCE")
    convert.add_argument("--test-pattern", help="glob of the case names that are test cases")
    convert.add_argument("--test-fraction", type=float, help="a random share of test cases")
    convert.add_argument("--overwrite", action="store_true",
                         help="replace a store made from another spec or source")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(func=_convert)

    check = sub.add_parser("check", help="describe a store (STORE), or load a registered "
                           "dataset and print its shapes (NAME PATH)")
    check.add_argument("dataset", metavar="STORE|NAME",
                       help="a store directory, or a registered dataset name (darcy, npz, ...)")
    check.add_argument("path", nargs="?", help="the dataset's directory or file")
    check.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                       help="loader option, e.g. n_train=400 (repeatable)")
    check.add_argument("--verify", action="store_true",
                       help="a store: compare every byte with its recorded SHA-256")
    check.set_defaults(func=_check)
