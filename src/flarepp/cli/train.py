"""``flarepp train``, ``flarepp eval`` and ``flarepp plot``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flarepp.cli import CLIError


def _train(args: argparse.Namespace) -> int:
    from flarepp.plots import plot_run
    from flarepp.train import get_preset, train
    overrides = list(args.set or [])
    if args.precision:
        overrides.append(f"precision={args.precision}")
    config = get_preset(args.preset, overrides)
    data = Path(args.data or config.data_root)
    if not data.exists():
        raise CLIError(f"data directory {str(data)!r} does not exist (give --data, or make "
                       f"data with `flarepp data make {config.dataset} --out {data}`)")
    out = Path(args.out or f"runs/{config.name}")
    if args.context_parallel:  # under torchrun: every rank trains on its share of the points
        from flarepp.distributed import torchrun_process_group
        with torchrun_process_group() as group:
            metrics = train(config, out, data_root=data, resume=args.resume,
                            progress=not args.quiet, stop_after=args.stop_after,
                            cp_group=group)
            if group.rank() != 0:
                return 0
    else:
        metrics = train(config, out, data_root=data, resume=args.resume,
                        progress=not args.quiet, stop_after=args.stop_after)
    if metrics is None:
        print(f"stopped after {args.stop_after} epoch(s); continue with --resume --out {out}")
        return 0
    plot_run(out, cases=config.plot_cases)
    print(json.dumps(metrics, indent=2))
    print(f"test relative L2: {100 * metrics['test_rel_l2']:.3f}%   (run directory: {out})")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from flarepp.data import load_dataset
    from flarepp.train import evaluate, load_trained_model
    from flarepp.train.loop import write_json
    tm = load_trained_model(args.checkpoint)
    c = tm.config
    splits = load_dataset(c.dataset, args.data or c.data_root, **c.dataset_options)
    test = evaluate(tm.model, splits.test, tm.x_norm, tm.y_norm, max(c.batch_size, 4),
                    c.precision)
    train = evaluate(tm.model, splits.train, tm.x_norm, tm.y_norm, max(c.batch_size, 4),
                     c.precision)
    metrics = {"test_rel_l2": test["rel_l2"], "train_rel_l2": train["rel_l2"],
               "epochs": tm.epoch, "params": sum(p.numel() for p in tm.model.parameters()),
               "checkpoint": str(args.checkpoint)}
    if args.json:
        write_json(Path(args.json), metrics)
    print(json.dumps(metrics, indent=2))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from flarepp.plots import plot_run
    for path in plot_run(args.run_dir, cases=args.cases):
        print(path)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from flarepp.train import PRESETS
    p = sub.add_parser("train", help="train a preset (see `flarepp presets`)")
    p.add_argument("preset", help=f"one of: {', '.join(PRESETS.names())}")
    p.add_argument("--data", help="dataset directory (default: the preset's data_root)")
    p.add_argument("--out", help="run directory (default: runs/PRESET)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config field, e.g. --set model.latents=32 (repeatable)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--stop-after", type=int, metavar="EPOCHS",
                   help="stop after this many epochs (resume later with --resume)")
    p.add_argument("--quiet", action="store_true", help="no progress bars or epoch lines")
    p.add_argument("--context-parallel", action="store_true",
                   help="split every mesh's points over the ranks of a torchrun launch "
                        "(torchrun --nproc-per-node R -m flarepp train ...)")
    p.set_defaults(func=_train)

    e = sub.add_parser("eval", help="test metric of a checkpoint (EMA weights)")
    e.add_argument("checkpoint")
    e.add_argument("--data", help="dataset directory (default: the run's)")
    e.add_argument("--json", help="write the metrics here (same keys as metrics.json)")
    e.set_defaults(func=_eval)

    g = sub.add_parser("plot", help="prediction and curve figures of a run directory")
    g.add_argument("run_dir")
    g.add_argument("--cases", type=int, default=3)
    g.set_defaults(func=_plot)

    s = sub.add_parser("presets", help="list the training presets")
    s.set_defaults(func=lambda a: print("\n".join(
        f"{n:22s} {PRESETS.entry(n).doc}" for n in PRESETS.names())) or 0)
