"""``flarepp lra data make listops|pathfinder --out DIR`` and ``flarepp lra data check``.

``make`` writes a generated set in the LRA release format; sizes default to the release's
(``--size tiny`` takes the CPU sizes of the task table), explicit flags override them.
``check`` reads any registered LRA dataset and prints its splits, lengths and labels.
The ``lra`` command group (:mod:`flarepp.cli.lra`) attaches these through
:func:`add_data_commands`.
"""

from __future__ import annotations

import argparse

import numpy as np

from flarepp.cli import CLIError, at_least
from flarepp.data.lra import LRA_DATASETS, LRA_GENERATORS, load_lra
from flarepp.data.lra.pathfinder import DIFFICULTIES
from flarepp.train.lra_benchmarks import LRA_BENCHMARKS
from flarepp.values import parse_assignments

_TASK_OF = {"listops": "listops", "pathfinder": "pathfinder32"}
_FLAGS = {"listops": ("n_train", "n_val", "n_test", "min_length", "max_length", "max_depth",
                      "max_args"),
          "pathfinder": ("count", "difficulty")}


def _make(args: argparse.Namespace) -> int:
    options = dict(LRA_BENCHMARKS.get(_TASK_OF[args.generator]).tiny_make) \
        if args.size == "tiny" else {}
    options.update({k: getattr(args, k) for k in _FLAGS[args.generator]
                    if getattr(args, k) is not None})
    try:
        paths = LRA_GENERATORS.get(args.generator)(args.out, seed=args.seed,
                                                   progress=not args.quiet,
                                                   overwrite=args.overwrite, **options)
    except FileExistsError as err:
        raise CLIError(str(err)) from err
    for path in paths:
        print(f"wrote {path}")
    load = ", difficulty=" + repr(options["difficulty"]) if "difficulty" in options else ""
    print(f"load with flarepp.data.lra.load_lra({args.generator!r}, {str(args.out)!r}{load})")
    return 0


def _check(args: argparse.Namespace) -> int:
    options = parse_assignments(args.option, "--option")
    data = load_lra(args.dataset, args.path, **options)
    print(f"{data.task} from {data.source}: vocabulary {data.vocab_size}, "
          f"{data.num_classes} classes, max length {data.max_length}")
    for name, split in data.splits.items():
        lengths = np.concatenate([d.lengths for d in split.documents])
        share = np.bincount(split.labels, minlength=data.num_classes) / len(split)
        print(f"{name}: {len(split)} samples x {len(split.documents)} document(s); tokens "
              f"min {lengths.min()} median {int(np.median(lengths))} max {lengths.max()}; "
              f"label shares {np.round(share, 3).tolist()}")
    return 0


def add_data_commands(lra_actions: argparse._SubParsersAction) -> None:
    """Add ``data make`` and ``data check`` to the ``lra`` command group."""
    data = lra_actions.add_parser("data", help="make or check Long Range Arena data")
    actions = data.add_subparsers(dest="lra_data_command", metavar="ACTION", required=True)
    make = actions.add_parser("make", help="generate ListOps or Pathfinder in LRA's format")
    generators = make.add_subparsers(dest="generator", metavar="GENERATOR", required=True)
    for name, helps in (("listops", "ListOps TSVs basic_{train,val,test}.tsv"),
                        ("pathfinder", "Pathfinder-32 imgs/ and metadata/ folders")):
        sub = generators.add_parser(name, help=helps)
        sub.add_argument("--out", required=True, help="output folder")
        sub.add_argument("--size", choices=("paper", "tiny"), default="paper",
                         help="release sizes (default) or the task table's CPU sizes")
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument("--overwrite", action="store_true", help="replace existing files")
        sub.add_argument("--quiet", action="store_true", help="no progress bar")
        sub.set_defaults(func=_make)
    listops = generators.choices["listops"]
    for flag, what in (("n-train", "training"), ("n-val", "validation"), ("n-test", "test")):
        listops.add_argument(f"--{flag}", type=at_least(1), help=f"{what} expressions")
    listops.add_argument("--min-length", type=at_least(0),
                         help="keep lengths > this (LRA: 500)")
    listops.add_argument("--max-length", type=at_least(2),
                         help="keep lengths < this (LRA: 2000)")
    listops.add_argument("--max-depth", type=at_least(1), help="tree depth limit (LRA: 10)")
    listops.add_argument("--max-args", type=at_least(2),
                         help="arguments per operator (LRA: 10)")
    pathfinder = generators.choices["pathfinder"]
    pathfinder.add_argument("--count", type=at_least(1), help="images (default 10000)")
    pathfinder.add_argument("--difficulty", choices=list(DIFFICULTIES),
                            help="contour length 6, 9 or 14 (default: 14, LRA's hard set)")

    check = actions.add_parser("check", help="read an LRA dataset and print its statistics")
    check.add_argument("dataset", choices=LRA_DATASETS.names())
    check.add_argument("path", nargs="?", default=None, help="data folder")
    check.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                       help="reader option, e.g. task=listops or difficulty=curv_baseline")
    check.set_defaults(func=_check)
