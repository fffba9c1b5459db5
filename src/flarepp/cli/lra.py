"""``flarepp lra train|compare|data``: Long Range Arena (paper Sec. 4.3, D.5, Table 12).

``train`` runs one task with one mixer through the one trainer (checkpoints, logs, lock,
signals, ``--resume`` as ``flarepp train``); ``compare`` trains tasks x mixers x seeds and
writes a Table 12-like accuracy table; ``data`` makes and checks the data
(:mod:`flarepp.cli.lra_data`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flarepp.cli import CLIError, check_output
from flarepp.cli.lra_data import add_data_commands
from flarepp.cli.sweep import execute
from flarepp.cli.train import add_run_arguments, fit_run
from flarepp.data.generators import how_to_get
from flarepp.device import DEVICE_HELP, resolve_device
from flarepp.distributed.mesh import launch
from flarepp.experiments.studies import lra_point_config, lra_study
from flarepp.tasks import build_task
from flarepp.tasks.sequence import load_sequence_data
from flarepp.train import Trainer
from flarepp.train.lra_benchmarks import LRA_BENCHMARKS


def _limits(items: list[str]) -> dict[str, int]:
    limits = {}
    for item in items:
        split, sep, count = item.partition("=")
        if not sep or not count.isdigit() or int(count) < 1:
            raise CLIError(f"--limit expects SPLIT=COUNT with a positive count, got {item!r}")
        limits[split] = int(count)
    return limits


def _train(args: argparse.Namespace) -> int:
    options = dict(steps=args.steps, split_limits=_limits(args.limit), data_root=args.data)
    overrides = list(args.set or []) + ([f"device={args.device}"] if args.device else [])
    nominal = lra_point_config(args.task, args.mixer, args.seed, args.size,
                               overrides=overrides, **options)
    if not Path(nominal.data_root).exists():
        size = f"--size {args.size}"
        raise CLIError(f"data folder {nominal.data_root!r} does not exist (give --data, or "
                       f"{how_to_get(nominal.dataset, nominal.data_root, size)})")
    out = check_output(args.out or f"runs/{nominal.name}-seed{args.seed}", directory=True)
    data = load_sequence_data(nominal, nominal.data_root)
    config = lra_point_config(args.task, args.mixer, args.seed, args.size,
                              overrides=overrides, train_samples=len(data.splits["train"]),
                              **options)
    device = resolve_device(config.device)
    with launch(device, data_parallel=args.data_parallel) as plan:
        trainer = Trainer(config, out, resume=args.resume, progress=not args.quiet,
                          parallel=plan, device=device,
                          task=build_task(config, config.data_root, data=data))
        metrics = fit_run(trainer, args, out, f"{config.name} ({config.precision}, "
                          f"{config.epochs} epochs of {trainer.steps_per_epoch} steps) on "
                          f"{device}, {plan.describe()}")
        if metrics is None:
            return 0
        trainer.task.plot_run(out, config.plot_cases)
    chance = trainer.task.summarize("test", {})["chance"]
    print(json.dumps(metrics, indent=2))
    print(f"test_accuracy: {100 * metrics['test_accuracy']:.2f}%   (chance 1/K = "
          f"{100 * chance:.2f}%; run directory: {out})")
    return 0


def _data_roots(items: list[str]) -> dict[str, str]:
    roots = {}
    for item in items:
        task, sep, path = item.partition("=")
        if not sep or not path:
            raise CLIError(f"--data expects TASK=DIR, got {item!r}")
        roots[task] = path
    return roots


def _compare(args: argparse.Namespace) -> int:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    mixers = [m.strip() for m in args.mixers.split(",") if m.strip()]
    if args.steps is not None and args.steps < 1:
        raise CLIError(f"--steps must be positive, got {args.steps}")
    check_output(args.out, directory=True)
    study = lra_study(tasks, mixers, seeds=args.seeds, size=args.size,
                      data_roots=_data_roots(args.data), steps=args.steps,
                      split_limits=_limits(args.limit), overrides=args.set or [])
    code = execute(study, args.out, quiet=args.quiet,
                   runtime=[f"device={args.device}"] if args.device else None)
    table = Path(args.out) / "table.md"
    if table.exists():
        print(table.read_text())
    return code


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("lra", help="Long Range Arena (paper Sec. 4.3)")
    actions = parser.add_subparsers(dest="lra_command", metavar="ACTION", required=True)
    tasks = ", ".join(LRA_BENCHMARKS.names())

    t = actions.add_parser("train", help="train one LRA task with one mixer")
    t.add_argument("task", choices=LRA_BENCHMARKS.names(), metavar="TASK", help=tasks)
    t.add_argument("--mixer", default="flarepp", help="registered mixer (default flarepp)")
    t.add_argument("--seed", type=int, default=0)
    add_run_arguments(t, out_help="run directory (default runs/lra-TASK[-tiny][-MIXER]-seedK)",
                      data_parallel_help="under torchrun: split every batch over the ranks "
                                         "(DDP)")
    t.add_argument("--data", help="data folder (default: the config's data_root)")

    c = actions.add_parser("compare", help="tasks x mixers x seeds, a Table 12-like table")
    c.add_argument("--tasks", default="listops,pathfinder32,image", help=f"comma-separated: "
                   f"{tasks}")
    c.add_argument("--mixers", default="flarepp,flare,attention,linear-attention,performer",
                   help="comma-separated registered mixers")
    c.add_argument("--seeds", type=int, default=3, help="seeds per task and mixer")
    c.add_argument("--out", default="runs/lra-compare", help="output directory")
    c.add_argument("--data", action="append", default=[], metavar="TASK=DIR",
                   help="data folder of a task (repeatable; default: its config's data_root)")
    c.add_argument("--quiet", action="store_true", help="no per-run lines")
    for p in (t, c):
        p.add_argument("--size", choices=("tiny", "paper"), default="tiny",
                       help="the task table's CPU-sized (default) or paper settings")
        p.add_argument("--steps", type=int, help="optimizer steps instead of the table's "
                       "(rounded up to whole epochs)")
        p.add_argument("--limit", action="append", default=[], metavar="SPLIT=COUNT",
                       help="use at most COUNT samples of a split (repeatable)")
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a config field, e.g. --set model.latents=16")
        p.add_argument("--device", help=f"{DEVICE_HELP} (default: the config's, auto)")
    t.set_defaults(func=_train)
    c.set_defaults(func=_compare)
    add_data_commands(actions)
