"""``flarepp demo``: make Darcy data if absent, train ``darcy-tiny`` FLARE++, plot."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from flarepp.cli import add_threads_argument
from flarepp.data.generators.darcy import make_darcy
from flarepp.storage.rundir import RunDir
from flarepp.tasks import plot_run_dir
from flarepp.train import get_preset, train
from flarepp.train.callbacks import WEIGHTS_NAME


def _demo(args: argparse.Namespace) -> int:

    data = Path(args.data)
    if not any(data.glob("piececonst_r*_N*_smooth1.mat")):
        print(f"generating Darcy data in {data} (200 train / 100 test, 85 x 85, FNO recipe)")
        make_darcy(data, n_train=200, n_test=100, resolution=85, seed=0)
    config = get_preset("darcy-tiny", args.set or [])
    out = Path(args.out or time.strftime("runs/demo-%Y%m%d-%H%M%S"))
    print(f"training {config.name} ({config.model['mixer']}, {config.epochs} epochs) into {out}")
    metrics = train(config, out, data_root=data, progress=not args.quiet)
    figures = plot_run_dir(out, cases=config.plot_cases)
    weights = metrics["eval_weights"]   # the headline's; the other weights' beside it
    other = "ema" if weights == "raw" else "raw"
    print(f"\ntest relative L2 ({WEIGHTS_NAME[weights]} weights): "
          f"{100 * metrics['test_rel_l2']:.2f}%  train: {100 * metrics['train_rel_l2']:.2f}%  "
          f"({WEIGHTS_NAME[other]} weights: test "
          f"{100 * metrics[f'test_rel_l2_{other}']:.2f}%, train "
          f"{100 * metrics[f'train_rel_l2_{other}']:.2f}%)  params: {metrics['params']:,}  "
          f"time: {metrics['seconds']:.0f} s")
    print(f"metrics: {RunDir(out).metrics_path}")
    print("figures: " + ", ".join(str(p) for p in figures))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="generate Darcy data, train darcy-tiny FLARE++, plot")
    p.add_argument("--data", default="data/darcy")
    p.add_argument("--out", help="run directory (default: runs/demo-TIMESTAMP)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE")
    p.add_argument("--quiet", action="store_true")
    add_threads_argument(p)
    p.set_defaults(func=_demo)
