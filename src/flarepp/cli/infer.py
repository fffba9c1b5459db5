"""``flarepp infer``: full-mesh predictions of a run, streamed and/or token-sharded, of a
dataset, a store, an ``.npz`` or new mesh files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from flarepp.cli import CLIError, add_threads_argument, at_least, check_output, say
from flarepp.device import DEVICE_HELP, PRECISION_HELP, PRECISIONS
from flarepp.distributed import context_parallel
from flarepp.distributed.mesh import launch
from flarepp.distributed.streaming import HIDDEN_ON
from flarepp.inference.infer import (Case, predict_cases, read_cases, write_on_mesh,
                                     write_predictions)
from flarepp.inference.mesh_cases import mesh_cases
from flarepp.inference.predictor import Predictor, load_predictor
from flarepp.models.backbone import compile_model
from flarepp.threads import SHARED_BY_RANKS, ThreadTuner


def _check_options(args: argparse.Namespace) -> None:
    check_output(args.out, directory=False)
    if sum(a is not None for a in (args.data, args.mesh, args.geometry)) != 1:
        raise CLIError("give the cases to predict: --data (a dataset, store or .npz), --mesh "
                       "FILE or DIR (new meshes) or --geometry FILE (a surface alone), one of "
                       "them")
    if (args.condition or args.conditions) and args.data is not None:
        raise CLIError("--condition and --conditions go with --mesh or --geometry; --data "
                       "brings its own conditions")
    if args.condition and args.conditions:
        raise CLIError("give conditions as --condition NAME=VALUE or as a table "
                       "(--conditions FILE), not both")
    if args.write_mesh:
        check_output(args.write_mesh, directory=True, option="--write-mesh")
    if args.chunk_size is None and (args.hidden_on != "auto" or args.memmap_dir):
        raise CLIError("--hidden-on and --memmap-dir place a streamed mesh's hidden state: "
                       "they need --chunk-size")
    if args.memmap_dir and not Path(args.memmap_dir).is_dir():
        raise CLIError(f"--memmap-dir {args.memmap_dir}: no such directory")


def _predictor(args: argparse.Namespace) -> Predictor:
    """The run's predictor under the command's execution: streaming and its hidden state,
    a progress bar, the forwards timed to choose the threads, compiled blocks."""
    predictor = load_predictor(args.checkpoint, device=args.device, precision=args.precision)
    streamed = args.chunk_size is not None
    threads = ThreadTuner(device=predictor.execution.device,
                          say=lambda line: print(line, file=sys.stderr),
                          skip="not measured: one streamed pass" if streamed else
                          SHARED_BY_RANKS if args.context_parallel else None)
    predictor = predictor.with_execution(
        chunk_size=args.chunk_size, hidden_on=args.hidden_on, memmap_dir=args.memmap_dir,
        progress=streamed and not args.context_parallel, threads=threads)
    if args.compile:
        compile_model(predictor.model)
    return predictor


def _conditions(pairs: list[str] | None) -> dict[str, float]:
    """``--condition NAME=VALUE`` (repeatable) as ``{name: value}``."""
    out: dict[str, float] = {}
    for pair in pairs or ():
        name, eq, value = pair.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not eq or not name or number is None:
            raise CLIError(f"--condition {pair!r}: expected NAME=VALUE with a number")
        if name in out:
            raise CLIError(f"--condition {name!r} is given twice")
        out[name] = number
    return out


def _cases(args: argparse.Namespace, predictor: Predictor) -> Iterator[Case]:
    if args.data is not None:
        return read_cases(predictor, args.data, split=args.split, dataset=args.dataset)
    return mesh_cases(predictor, args.mesh or args.geometry,
                      conditions=_conditions(args.condition), table=args.conditions,
                      geometry=args.geometry is not None)


def _shown(results: Iterable[dict[str, Any]], how: str) -> Iterator[dict[str, Any]]:
    """Each result passed on after its line: shape, rows (points or cells), seconds,
    errors (the surface task's nmse named as what it is), the force, peak memory, the
    meshes written; a warning for non-finite predictions."""
    for r in results:
        bad = ~np.isfinite(r["pred"]).all(axis=-1) & (True if r["mask"] is None else r["mask"])
        if bad.any():
            print(f"warning: {int(bad.any(axis=1).sum())} of {len(r['pred'])} sample(s) "
                  "have non-finite predictions (the model overflowed; try --device cpu "
                  "or a checkpoint trained in fp32)", file=sys.stderr)
        error = ("" if "rel_l2" not in r else f", mean relative L2 "
                 f"{100 * np.mean(r['rel_l2']):.3f}%" + (
                     "" if "nmse" not in r else f", nmse {r['nmse']:.4g}% (100 x the MSE of "
                     "the fields standardised by the run's statistics)"))
        force = ("" if "force" not in r else ", predicted force [" + ", ".join(
            f"{f:.4g}" for f in r["force"]) + "] (sum of (-p n + tau) A)")
        rows = "cells" if r["case"].association == "cell" else "points"
        say(f"{r['name'] or 'pred'} {list(r['pred'].shape)}: {r['cells']} {rows} in "
            f"{r['seconds']:.1f} s ({how}){error}{force}; peak host memory so far "
            f"{r['peak_gib']:.2f} GiB")
        for path in r.get("meshes", ()):
            say(f"  wrote {path}")
        yield r


def _written(args: argparse.Namespace, predictor: Predictor,
             results: Iterable[dict[str, Any]], how: str) -> list[dict]:
    if args.write_mesh:
        results = write_on_mesh(args.write_mesh, results, predictor)
    return write_predictions(args.out, _shown(results, how))


def _infer(args: argparse.Namespace) -> int:
    _check_options(args)
    predictor = _predictor(args)
    cases = _cases(args, predictor)
    how = f"chunks of {args.chunk_size}" if args.chunk_size else "one pass"
    source = str(args.data or args.mesh or args.geometry)
    if not args.context_parallel:
        done = _written(args, predictor, predict_cases(
            predictor, cases, source=source, batch_size=args.batch_size), how)
    else:
        with launch(predictor.execution.device, context_parallel=0,
                    timeout_s=args.timeout) as plan:
            with context_parallel(predictor.model, plan.cp_group):
                results = predict_cases(predictor.with_execution(plan=plan), cases,
                                        source=source, batch_size=args.batch_size)
                if not plan.is_writer:
                    for _ in results:
                        pass
                    return 0
                done = _written(args, predictor, results, how)
    say(f"wrote {args.out}: {sum(r['samples'] for r in done)} case(s) ({how})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("infer", help="predictions of a run on whole meshes (streamed with "
                       "--chunk-size, token-sharded with --context-parallel)")
    p.add_argument("checkpoint", help="a run directory (its reported checkpoint) or a "
                   "checkpoint file")
    p.add_argument("--data",
                   help="the checkpoint's dataset directory or store (its --split), or an "
                        ".npz: every sample of x [S, N, in], with optional y [S, N, out], "
                        "mask [S, N] and conditions [S, C] or [S, K, C]")
    p.add_argument("--mesh", metavar="FILE_OR_DIR",
                   help="new meshes (any format `data convert` reads, or a folder of them): "
                        "the inputs built from each as the run's store was converted (the "
                        "surface task: cell centres and normals)")
    p.add_argument("--geometry", metavar="FILE",
                   help="a surface alone (STL, VTP, ...): for a run whose inputs are a "
                        "surface's cell centres and normals (the surface task, or a store "
                        "converted with just those)")
    p.add_argument("--condition", action="append", metavar="NAME=VALUE",
                   help="with --mesh / --geometry: a condition of a conditioned run, by its "
                        "name, in the run's units (repeatable; default: the mesh's field "
                        "data)")
    p.add_argument("--conditions", metavar="TABLE",
                   help="with --mesh / --geometry: a condition table as `data convert` "
                        "reads it (CSV with a 'case' column, or JSON), a row per mesh")
    p.add_argument("--write-mesh", metavar="DIR",
                   help="also write each sample's pred_/true_/error_<field> arrays onto its "
                        "source mesh (DIR/<name>.vtu or .vtp, <name> the case's name with "
                        "its folders; a point cloud where the data has no mesh) with a "
                        "picture DIR/<name>.png")
    p.add_argument("--out", required=True, help="output .npz: pred [S, N, out] "
                   "(de-normalised), rel_l2 [S] when targets are present, mask; for named "
                   "cases (store samples, cars, meshes) pred_<name> [N, out] each, cases, "
                   "cells (rows), seconds, rel_l2, and the surface task's nmse")
    p.add_argument("--split", choices=["test", "train"], default="test")
    p.add_argument("--dataset", help="read --data with this registered loader instead of the "
                   "checkpoint's (e.g. npz)")
    p.add_argument("--chunk-size", type=at_least(1), metavar="K",
                   help="exact streaming: run K points at a time (memory set by K, not N)")
    p.add_argument("--hidden-on", choices=HIDDEN_ON, default="auto",
                   help="with --chunk-size: where the hidden state [B, N, C] lives between "
                        "blocks: device, host memory, or a memory-mapped file (memmap); "
                        "auto takes the first that holds it in half the free memory")
    p.add_argument("--memmap-dir", metavar="DIR",
                   help="directory for the memory-mapped hidden state (default the system's "
                        "temporary directory); its space is reserved first and the file is "
                        "deleted once mapped")
    p.add_argument("--context-parallel", action="store_true",
                   help="split every mesh's points over the ranks of a torchrun launch")
    p.add_argument("--batch-size", type=at_least(1), default=1, help="samples per forward")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every block (the first forward compiles)")
    p.add_argument("--precision", choices=PRECISIONS, help=PRECISION_HELP)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds before a stuck collective fails (--context-parallel)")
    add_threads_argument(p)
    p.set_defaults(func=_infer)
