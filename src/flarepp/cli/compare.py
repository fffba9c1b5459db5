"""``flarepp compare``: train the Table 1 models under one protocol and tabulate them."""

from __future__ import annotations

import argparse
from pathlib import Path

from flarepp.cli import CLIError
from flarepp.cli.sweep import execute
from flarepp.experiments import TABLE1_ORDER
from flarepp.experiments.comparison import PAPER_SETTINGS
from flarepp.experiments.studies import compare_study


def _names(text: str, known: list[str], what: str) -> list[str]:
    names = known if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise CLIError(f"unknown {what}(s) {unknown or [text]}; known: {', '.join(known)} "
                       "(or 'all')")
    return names


def _compare(args: argparse.Namespace) -> int:
    models = _names(args.models, TABLE1_ORDER, "model")
    datasets = _names(args.datasets, list(PAPER_SETTINGS), "dataset")
    if args.epochs is not None and args.epochs <= 0:
        raise CLIError(f"--epochs must be positive, got {args.epochs}")
    study = compare_study(models, datasets, epochs=args.epochs, seeds=args.seeds,
                          scale=args.scale, data_root=args.data_root, overrides=args.set or [])
    code = execute(study, args.out, quiet=args.quiet)
    table = Path(args.out) / "table.md"
    if table.exists():
        print(table.read_text())
    return code


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="train Table 1's models under one protocol and "
                                       "write a comparison table and chart")
    p.add_argument("--models", default="all",
                   help="comma-separated Table 1 models (flare,flarepp,transolver,...) or all")
    p.add_argument("--datasets", default="darcy",
                   help="comma-separated datasets (darcy,elasticity,...) or all")
    p.add_argument("--epochs", type=int, help="epochs per run (default: the preset's)")
    p.add_argument("--seeds", type=int, default=1, help="seeds per model (mean and spread)")
    p.add_argument("--scale", choices=["tiny", "paper"], default="tiny",
                   help="tiny: the CPU-sized DATASET-tiny presets; paper: Tables 7-8")
    p.add_argument("--data-root", help="directory holding one folder per dataset "
                                       "(default: each preset's data_root)")
    p.add_argument("--out", default="runs/compare", help="output directory")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override every preset, e.g. --set dataset_options.n_train=50")
    p.add_argument("--quiet", action="store_true", help="no per-run lines")
    p.set_defaults(func=_compare)
