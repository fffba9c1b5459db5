"""``flarepp infer``: full-mesh predictions of a checkpoint, streamed and/or token-sharded."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from flarepp.cli import CLIError, at_least, check_output
from flarepp.device import DEVICE_HELP, PRECISION_HELP, PRECISIONS
from flarepp.distributed.streaming import HIDDEN_ON


def _inputs(args: argparse.Namespace, tm) -> tuple[np.ndarray, np.ndarray | None,
                                                  np.ndarray | None]:
    """``(x, y or None, mask or None)``: an inputs-only ``.npz`` (keys ``x``, ``mask``) or a
    split of the checkpoint's dataset read from ``--data``."""
    from flarepp.data import MeshSamples, load_dataset
    from flarepp.data.loaders import read_npz
    path = Path(args.data)
    if path.suffix == ".npz" and path.is_file():
        f = read_npz(path)
        if "x" in f and "y" not in f:
            x = np.asarray(f["x"], np.float32)
            mask = np.asarray(f["mask"], bool) if "mask" in f else None
            if x.ndim != 3 or (mask is not None and mask.shape != x.shape[:2]):
                raise CLIError(f"{path}: expected x [S, N, in] and optional mask [S, N], "
                               f"got x {list(x.shape)}"
                               + ("" if mask is None else f", mask {list(mask.shape)}"))
            return x, None, mask
    c = tm.config
    dataset = args.dataset or c.dataset
    options = c.dataset_options if dataset == c.dataset else {}
    splits = load_dataset(dataset, path, **options)
    samples = getattr(splits, args.split, None)
    if not isinstance(samples, MeshSamples):
        raise CLIError(f"--dataset {dataset!r} is not read as (x, y) samples on meshes (it "
                       f"holds {type(splits).__name__}), so a {c.task!r} checkpoint cannot "
                       "predict it; give a dataset of the fields task (e.g. darcy, "
                       "elasticity, npz)")
    return samples.x, samples.y, samples.mask


def _check_inputs(source: str, x: np.ndarray, y: np.ndarray | None,
                  mask: np.ndarray | None, tm) -> None:
    """Inputs and targets that fit the checkpoint's model, and finite inputs at every real
    point (a NaN input makes the whole sample's prediction NaN, which would be written
    without a word)."""
    from flarepp.data import DataError
    config = tm.model.config
    if x.shape[-1] != config.in_dim:
        raise CLIError(f"{source}: inputs have {x.shape[-1]} channels, the checkpoint's "
                       f"model takes {config.in_dim}")
    if y is not None and y.shape[-1] != config.out_dim:
        raise CLIError(f"{source}: targets have {y.shape[-1]} channels, the checkpoint's "
                       f"model predicts {config.out_dim}, so no error can be computed "
                       "against them")
    finite = np.isfinite(x).all(axis=-1)
    if mask is not None:
        finite |= ~mask
    if not finite.all():
        sample, point = (int(i[0]) for i in np.nonzero(~finite))
        raise DataError(f"{source}: the inputs x hold non-finite values (NaN or inf) at "
                        f"{int((~finite).sum())} point(s) of {int((~finite).any(axis=1).sum())} "
                        f"sample(s), first at sample {sample}, point {point}; their "
                        "predictions would be NaN")


def _write(path: Path, pred: np.ndarray, y: np.ndarray | None, mask: np.ndarray | None,
           how: str) -> None:
    import torch

    from flarepp.tasks.fields import relative_l2
    from flarepp.io import atomic_write_npz
    arrays = {"pred": pred}
    real = np.ones(pred.shape[:2], bool) if mask is None else mask
    bad = ~np.isfinite(pred).all(axis=-1) & real
    if bad.any():
        print(f"warning: {int(bad.any(axis=1).sum())} of {len(pred)} sample(s) have "
              "non-finite predictions (the model overflowed; try --device cpu or a checkpoint "
              "trained in fp32)", file=sys.stderr)
    if y is not None:
        m = None if mask is None else torch.from_numpy(mask)
        arrays["rel_l2"] = relative_l2(torch.from_numpy(pred), torch.from_numpy(y), m).numpy()
    if mask is not None:
        arrays["mask"] = mask
    atomic_write_npz(path, arrays)
    extra = (f"; mean relative L2 {100 * arrays['rel_l2'].mean():.3f}%"
             if "rel_l2" in arrays else "")
    print(f"wrote {path}: pred {list(pred.shape)} ({how}){extra}")


def _infer(args: argparse.Namespace) -> int:
    from flarepp.device import amp_dtype, peak_host_memory, resolve_device
    from flarepp.distributed import context_parallel
    from flarepp.distributed.mesh import launch
    from flarepp.inference.mesh import predict_mesh
    from flarepp.train import load_trained_model
    check_output(args.out, directory=False)
    if args.chunk_size is None and (args.hidden_on != "auto" or args.memmap_dir):
        raise CLIError("--hidden-on and --memmap-dir place a streamed mesh's hidden state: "
                       "they need --chunk-size")
    if args.memmap_dir and not Path(args.memmap_dir).is_dir():
        raise CLIError(f"--memmap-dir {args.memmap_dir}: no such directory")
    tm = load_trained_model(args.checkpoint)
    cases = _task_cases(args, tm)
    if cases is not None:
        return _infer_cases(args, tm, cases)
    x, y, mask = _inputs(args, tm)
    _check_inputs(str(args.data), x, y, mask, tm)
    device = resolve_device(args.device)
    model = tm.model.to(device)
    if args.compile:
        from flarepp.models.backbone import compile_model
        compile_model(model)
    options = dict(batch_size=args.batch_size, chunk_size=args.chunk_size, device=device,
                   amp_dtype=amp_dtype(args.precision or tm.config.precision),
                   hidden_on=args.hidden_on, memmap_dir=args.memmap_dir,
                   progress=args.chunk_size is not None and not args.context_parallel)
    how = f"chunks of {args.chunk_size}" if args.chunk_size else "one pass"
    if not args.context_parallel:
        start = time.perf_counter()
        pred = predict_mesh(model, x, mask, tm.x_norm, tm.y_norm, **options)
        _write(Path(args.out), pred, y, mask,
               f"{how}; {time.perf_counter() - start:.1f} s, peak host memory "
               f"{peak_host_memory() / 2**30:.2f} GiB")
        return 0
    with launch(device, context_parallel=0, timeout_s=args.timeout) as plan:
        with context_parallel(model, plan.cp_group) as cp:
            pred = predict_mesh(model, x, mask, tm.x_norm, tm.y_norm, cp=cp, **options)
        if plan.is_writer:
            _write(Path(args.out), pred, y, mask, f"{how}, {plan.cp_size} ranks")
    return 0


def _task_cases(args: argparse.Namespace, tm):
    """The checkpoint's task's own reader of ``--data`` when its samples are meshes of
    different sizes read one at a time (a task with ``inference_cases``: the surface task),
    else None (the fields task's loaders, or an ``.npz`` of inputs)."""
    from flarepp.tasks import TASKS
    task = TASKS.get(tm.config.task)
    if not hasattr(task, "inference_cases") or args.dataset \
            or Path(args.data).suffix == ".npz":
        return None
    return task.inference_cases(tm.config, args.data, args.split)


def _infer_cases(args: argparse.Namespace, tm, cases) -> int:
    """Case by case, each written to the ``.npz`` as it is predicted (:mod:`flarepp.tasks.
    surface`: ``predict_cases``, ``write_case_predictions``)."""
    from flarepp.device import amp_dtype, resolve_device
    from flarepp.distributed import context_parallel
    from flarepp.distributed.mesh import launch
    from flarepp.inference.surface import predict_cases, write_case_predictions
    device = resolve_device(args.device)
    model = tm.model.to(device)
    if args.compile:
        from flarepp.models.backbone import compile_model
        compile_model(model)
    how = f"chunks of {args.chunk_size}" if args.chunk_size else "one pass"
    options = dict(chunk_size=args.chunk_size, device=device, hidden_on=args.hidden_on,
                   memmap_dir=args.memmap_dir,
                   amp_dtype=amp_dtype(args.precision or tm.config.precision))

    def results(cp):
        for r in predict_cases(model, cases, tm.x_norm, tm.y_norm, cp=cp, **options):
            print(f"{r['name']}: {r['cells']} cells in {r['seconds']:.1f} s ({how}), nmse "
                  f"{r['nmse']:.4g}%, relative L2 {100 * r['rel_l2']:.3f}%, peak host memory "
                  f"so far {r['peak_gib']:.2f} GiB", flush=True)
            yield r

    if not args.context_parallel:
        done = write_case_predictions(Path(args.out), results(None))
    else:
        with launch(device, context_parallel=0, timeout_s=args.timeout) as plan:
            with context_parallel(model, plan.cp_group) as cp:
                if not plan.is_writer:
                    for _ in predict_cases(model, cases, tm.x_norm, tm.y_norm, cp=cp,
                                           **options):
                        pass
                    return 0
                done = write_case_predictions(Path(args.out), results(cp))
    print(f"wrote {args.out}: {len(done)} case(s), mean nmse "
          f"{sum(r['nmse'] for r in done) / max(len(done), 1):.4g}%")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("infer", help="predictions of a checkpoint on whole meshes "
                       "(streamed with --chunk-size, token-sharded with --context-parallel)")
    p.add_argument("checkpoint")
    p.add_argument("--data", required=True,
                   help="the checkpoint's dataset directory, or an .npz of inputs x [S, N, in] "
                        "(and mask [S, N]) without targets")
    p.add_argument("--out", required=True, help="output .npz: pred [S, N, out] "
                   "(de-normalised), rel_l2 [S] when targets are present, mask; for a "
                   "surface checkpoint pred_<run> [N, 4] per run, cases, rel_l2 and nmse")
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
    p.set_defaults(func=_infer)
