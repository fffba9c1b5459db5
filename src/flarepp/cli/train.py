"""``flarepp train``, ``flarepp eval``, ``flarepp plot`` and ``flarepp presets``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flarepp.cli import CLIError, add_threads_argument, at_least, check_output
from flarepp.cli.tracking import add_tracking_arguments, track_settings
from flarepp.data.generators import how_to_get
from flarepp.data.store import MANIFEST
from flarepp.device import DEVICE_HELP, PRECISION_HELP, PRECISIONS, resolve_device
from flarepp.distributed.mesh import launch
from flarepp.inference.evaluate import write_checkpoint_outputs
from flarepp.io import atomic_write_json
from flarepp.storage.checkpoint import CheckpointError, newest_readable_checkpoint
from flarepp.storage.config import RunConfig
from flarepp.storage.rundir import RunDir, run_checkpoint
from flarepp.tasks import plot_run_dir
from flarepp.train import (PRESETS, Trainer, apply_overrides, evaluate_checkpoint, get_preset,
                           validate)
from flarepp.train.loop import INIT_NORMALIZERS


def _train(args: argparse.Namespace) -> int:
    track = track_settings(args)
    overrides = list(args.set or [])
    for key in ("precision", "device"):
        if getattr(args, key):
            overrides.append(f"{key}={getattr(args, key)}")
    if args.compile:
        overrides.append("compile=True")
    if args.workers is not None:
        overrides.append(f"loader_workers={args.workers}")
    if args.memory_budget is not None:
        overrides.append(f"memory_budget_gib={args.memory_budget}")
    config = _run_config(args, overrides)
    data = Path(args.data or config.data_root)
    if not data.exists():
        raise CLIError(f"data directory {str(data)!r} does not exist (give --data, or "
                       f"{how_to_get(config.dataset, str(data))})")
    out = check_output(args.out or f"runs/{config.name}", directory=True)
    if args.init_from and args.resume:
        raise CLIError("--init-from starts a new run from another run's weights; --resume "
                       "continues this run from its own checkpoint: give one of them")
    device = resolve_device(config.device)
    with launch(device, data_parallel=args.data_parallel,
                context_parallel=args.context_parallel) as plan:
        trainer = Trainer(config, out, data_root=data, resume=args.resume,
                          progress=not args.quiet, parallel=plan, device=device, plot=True,
                          init_from=args.init_from, init_normalizers=args.init_normalizers,
                          callbacks=track.callbacks(out, out.name) if track else ())
        metrics = fit_run(trainer, args, out, f"{config.name} ({config.model.get('mixer')}, "
                          f"{config.precision}) on {device}, {plan.describe()}")
        if metrics is None:
            return 0
    headline = f"test_{trainer.task.headline}"
    print(json.dumps(metrics, indent=2))
    print(f"{headline}: {metrics[headline]:.6g}   (run directory: {out})")
    return 0


def fit_run(trainer: Trainer, args: argparse.Namespace, out: Path, what: str) -> dict | None:
    """Train to the end or to ``--stop-after``, saying ``training WHAT into OUT`` first
    (unless ``--quiet``). The final metrics, or None where the command has nothing more to
    report: on a rank that does not write, or for a run stopped early (said, with the
    command that continues it)."""
    if trainer.is_writer and not args.quiet:
        print(f"training {what}, into {out}", flush=True)
    metrics = trainer.fit(stop_after=args.stop_after)
    if trainer.is_writer and metrics is None:
        print(f"stopped after {args.stop_after} epoch(s); continue with --resume --out {out}")
    return metrics if trainer.is_writer else None


def add_run_arguments(p: argparse.ArgumentParser, *, out_help: str,
                      data_parallel_help: str) -> None:
    """The options of a command that trains one run into its directory (``train``, ``lra
    train``): ``--out``, ``--resume``, ``--stop-after``, ``--quiet``, ``--data-parallel``
    (what :func:`fit_run` reads)."""
    p.add_argument("--out", help=out_help)
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--stop-after", type=at_least(1), metavar="EPOCHS",
                   help="stop after this many epochs (resume later with --resume)")
    p.add_argument("--quiet", action="store_true", help="no progress bars or epoch lines")
    p.add_argument("--data-parallel", action="store_true", help=data_parallel_help)


def _run_config(args: argparse.Namespace, overrides: list[str]):
    """The run's config, checked before any data is read: a preset, a run's own
    ``config.json`` (``--config``), or the ``npz`` preset for ``--data`` alone."""
    if args.config and args.preset:
        raise CLIError("give a preset or --config, not both")
    if args.config:
        path = Path(args.config)
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise CLIError(f"--config {str(path)!r}: cannot read a run config ({err})") from None
        if not isinstance(stored, dict):
            raise CLIError(f"--config {str(path)!r}: expected a JSON object (a run's "
                           f"{RunDir.CONFIG})")
        # A run directory's own config was stored by a run (an unversioned one trained the
        # legacy protocol); any other file is a user's, with today's defaults.
        run = RunDir(path.parent)
        read = RunConfig.from_stored if run.checkpoint_dir.is_dir() else RunConfig.from_dict
        try:
            return apply_overrides(read(stored), overrides)
        except ValueError as err:
            raise CLIError(f"--config {str(path)!r}: {err}") from None
    if args.preset is None and not args.data:
        raise CLIError(f"give a preset (see `flarepp presets`), --config RUN/{RunDir.CONFIG}, "
                       "or --data YOUR.npz")
    own = "store-tiny" if args.data and (Path(args.data) / MANIFEST).is_file() else "npz"
    return get_preset(args.preset or own, overrides)


def _eval(args: argparse.Namespace) -> int:
    if args.json:
        check_output(args.json, directory=False, option="--json")
    checkpoint = run_checkpoint(args.checkpoint)   # a run directory: its reported one
    metrics = evaluate_checkpoint(checkpoint, data_root=args.data, device=args.device,
                                  chunk_size=args.chunk_size, precision=args.precision,
                                  say=lambda line: print(line, file=sys.stderr),
                                  check=validate)
    if args.json:
        atomic_write_json(Path(args.json), metrics)
    print(json.dumps(metrics, indent=2))
    return 0


def check_own_checkpoint(run, path: Path, state: dict) -> None:
    """Refuse to predict ``run``'s outputs from a checkpoint another run wrote (copied into
    its ``checkpoints/``): its stored config must compute what ``run``'s stored config does
    (runtime fields and the data's path aside)."""
    mine, its = ({k: v for k, v in c.identity().items() if k != "data_root"}
                 for c in (run.read_config(), RunConfig.from_stored(state["config"])))
    keys = sorted(k for k in mine.keys() | its.keys() if mine.get(k) != its.get(k))
    if keys:
        raise CheckpointError(f"{str(path)!r} is not {str(run.path)!r}'s checkpoint: its "
                              f"{', '.join(keys)} differ from the run's config "
                              f"({run.config_path}); nothing is predicted from it")


def _plot(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if RunDir(run_dir).config_path.is_file() and not RunDir(run_dir).has_metrics():
        # A run stopped before its end has no final outputs: predict them from its newest
        # readable checkpoint (the only step of `plot` that runs a model, on --device).
        found = newest_readable_checkpoint(run_dir)
        if found.path is None:
            raise CLIError(f"{str(run_dir)!r} has no finished outputs and no readable "
                           "checkpoint to predict them from")
        check_own_checkpoint(RunDir(run_dir), found.path, found.state)
        metrics = write_checkpoint_outputs(found.path, run_dir, device=args.device,
                                           chunk_size=args.chunk_size)
        shown = ", ".join(f"{k} {v:.6g}" for k, v in metrics.items())
        print(f"{run_dir} is unfinished: predicted its outputs from {found.path} ({shown})",
              file=sys.stderr)
    for path in plot_run_dir(run_dir, cases=args.cases):
        print(path)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    _register_train(sub)
    e = sub.add_parser("eval", help="metrics of a checkpoint (raw and EMA weights) on its data")
    e.add_argument("checkpoint", help="a checkpoint, or a run directory (its reported one)")
    e.add_argument("--data", help="dataset directory (default: the run's)")
    e.add_argument("--json", help=f"write the metrics here (same keys as {RunDir.METRICS})")
    e.add_argument("--device", default="auto", help=DEVICE_HELP)
    e.add_argument("--chunk-size", type=at_least(1), metavar="K",
                   help="stream each mesh through the model K points at a time (exact)")
    e.add_argument("--precision", choices=PRECISIONS, help=PRECISION_HELP)
    add_threads_argument(e)
    e.set_defaults(func=_eval)

    g = sub.add_parser("plot", help="prediction and curve figures of a run directory")
    g.add_argument("run_dir")
    g.add_argument("--cases", type=at_least(0), default=3,
                   help="prediction figures to draw (default 3)")
    g.add_argument("--device", default="auto",
                   help=DEVICE_HELP + "; used only for a run stopped before its end, whose "
                   "test outputs are predicted from its newest checkpoint first")
    g.add_argument("--chunk-size", type=at_least(1), default=None, metavar="K",
                   help="with such a run: stream each sample K tokens at a time")
    g.set_defaults(func=_plot)

    s = sub.add_parser("presets", help="list the training presets")
    s.set_defaults(func=lambda a: print("\n".join(
        f"{n:22s} {PRESETS.entry(n).doc}" for n in PRESETS.names())) or 0)


def _register_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a preset (see `flarepp presets`)")
    p.add_argument("preset", nargs="?",
                   help=f"one of: {', '.join(PRESETS.names())} (default with --data alone: "
                        "store-tiny for a store, npz for your own .npz)")
    p.add_argument("--config", metavar="CONFIG_JSON",
                   help=f"train the config a run wrote (RUN/{RunDir.CONFIG}) instead of a "
                        "preset")
    p.add_argument("--data", help="dataset directory (default: the preset's data_root)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config field, e.g. --set model.latents=32 (repeatable)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", help=f"where to train: {DEVICE_HELP} (default: the config's, "
                                    "auto)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every block (off by default; the first steps compile)")
    p.add_argument("--workers", type=at_least(0), metavar="W",
                   help="data-loader worker processes (default: 2 on CUDA, 0 on the CPU)")
    p.add_argument("--memory-budget", type=float, metavar="GiB",
                   help="resident memory the run and its loader workers may take: it chooses "
                        "eval_chunk_size, loader_workers and an unset points_per_step within "
                        "it and says so (default: the cgroup's or the address-space limit "
                        "where one is set; flarepp.train.budget)")
    add_run_arguments(p, out_help="run directory (default: runs/PRESET)",
                      data_parallel_help="under torchrun: split every global batch over the "
                      "ranks (DistributedDataParallel); with --context-parallel K, over groups "
                      "of K ranks")
    p.add_argument("--init-from", metavar="RUN",
                   help="fine-tune: start from this run's weights (a run directory or a "
                        "checkpoint; the same architecture) with a new optimiser on --data; "
                        "give about a third of the preset's lr (README: Fine-tuning)")
    p.add_argument("--init-normalizers", choices=INIT_NORMALIZERS, default="keep",
                   help="with --init-from: keep its input/output normalisers (default) or "
                        "refit them on this run's training data")
    p.add_argument("--context-parallel", type=at_least(0), nargs="?", const=0,
                   metavar="K",
                   help="under torchrun: split every mesh's points over K ranks (default: "
                        "all ranks), paper Appendix B")
    add_tracking_arguments(p)
    add_threads_argument(p)
    p.set_defaults(func=_train)
