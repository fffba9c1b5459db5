"""``flarepp data make NAME --out DIR ...`` and ``flarepp data check NAME PATH``."""

from __future__ import annotations

import argparse

from flarepp.cli import CLIError, parse_scalar


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _make(args: argparse.Namespace) -> int:
    from flarepp.data.generators import GENERATORS
    entry = GENERATORS.entry(args.dataset)
    resolution = entry.defaults.get("resolution") if args.resolution is None else args.resolution
    try:
        paths = entry.obj(args.out, n_train=args.train, n_test=args.test, resolution=resolution,
                          seed=args.seed, progress=not args.quiet, overwrite=args.overwrite)
    except (ModuleNotFoundError, FileExistsError) as err:
        raise CLIError(str(err)) from err
    except MemoryError as err:
        from flarepp.device import available_memory
        need = getattr(err, "_total_size", None)   # numpy's _ArrayMemoryError knows it
        what = (f"an array of {need / 2**30:.1f} GiB" if need
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
    "surface-flow": "train with: flarepp train drivaerml-tiny --data {out}   (task 'surface', "
                    "dataset 'drivaerml' with the split file {out}/split.json)",
}
"""What to run on a generator's files, where it is not ``flarepp.data.load_dataset``."""


def _check(args: argparse.Namespace) -> int:
    from flarepp.data import load_dataset
    options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            raise CLIError(f"--option expects key=value, got {item!r}")
        options[key] = parse_scalar(value)
    splits = load_dataset(args.dataset, args.path, **options)
    for split in ("train", "test"):
        samples = getattr(splits, split)
        mask = "none" if samples.mask is None else f"{int(samples.mask.sum())} real points"
        print(f"{split}: x {list(samples.x.shape)}, y {list(samples.y.shape)}, mask {mask}, "
              f"grid {samples.grid_shape}")
    print(f"field {splits.field_names} [{splits.units}] from {splits.source}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from flarepp.data.generators import GENERATORS
    parser = subparsers.add_parser("data", help="make or check datasets")
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    make = sub.add_parser("make", help="generate a PDE dataset in a public benchmark layout")
    make.add_argument("dataset", choices=GENERATORS.names())
    make.add_argument("--out", required=True, help="directory for the files")
    make.add_argument("--train", type=_positive, default=1000, help="training samples")
    make.add_argument("--test", type=_positive, default=200, help="test samples")
    make.add_argument("--resolution", type=_positive, default=None,
                      help="darcy: grid points per side (default 85); surface-flow: cells "
                           "per surface (default 5000); advection-diffusion: grid points per "
                           "side (default 32); elasticity: fixed at 972 points")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--overwrite", action="store_true", help="replace existing files")
    make.add_argument("--quiet", action="store_true", help="no progress bar")
    make.set_defaults(func=_make)

    check = sub.add_parser("check", help="load a dataset and print its shapes")
    check.add_argument("dataset", help="registered dataset name (elasticity, darcy, npz, ...)")
    check.add_argument("path", help="data directory or file")
    check.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                       help="loader option, e.g. n_train=400 (repeatable)")
    check.set_defaults(func=_check)
