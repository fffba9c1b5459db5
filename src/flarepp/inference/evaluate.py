"""Evaluating a checkpoint on any device: the task's metric of its raw and its EMA weights
on each split, the run's ``eval_weights`` naming the headline.

The model is rebuilt from the checkpoint alone, the task from the checkpoint's run config
(reading the data from ``data_root``, by default the data the run trained on), and the
task's normalisers are the checkpoint's (a model is always evaluated with the statistics it
was trained with).

Which weights are reported: the FLARE study writes its errors (``rel_error.json``, the
``RelL2Callback`` of ``pdebench/callbacks.py`` in github.com/vpuri3/FLARE.py) from the raw
weights; ``mlutils/trainer.py`` (``Trainer.statistics``) copies the EMA shadow into the
model only to log the ``*_ema`` losses beside the raw ones, then restores the raw weights.
flarepp evaluates both and stores both (:func:`weight_metrics`); ``eval_weights`` names the
headline, ``raw`` by default, ``ema`` for runs stored before the field existed (they
reported the EMA weights). The two agree after a full one-cycle run and differ in short
ones, whose EMA copy still weighs the early weights.
"""

from __future__ import annotations

from collections import ChainMap
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from flarepp.device import resolve_device
from flarepp.distributed import context_parallel
from flarepp.distributed.mesh import SINGLE, ParallelPlan
from flarepp.inference.engine import Engine, KeptPredictions
from flarepp.inference.execution import STREAM_ABOVE, Execution
from flarepp.storage.checkpoint import read_checkpoint, rebuild_model
from flarepp.storage.config import EVAL_WEIGHTS, RunConfig
from flarepp.tasks import Task, build_task
from flarepp.threads import SHARED_BY_RANKS, ThreadTuner, thread_budget


def run_data(state: dict[str, Any], config: RunConfig) -> str:
    """The data a checkpoint's run trained on: the recorded path if it still exists, else
    the config's ``data_root``."""
    recorded = state.get("data", {}).get("identity", {}).get("path")
    return recorded if recorded and Path(recorded).exists() else config.data_root


def weight_metrics(split: str, headline: str, by_weights: dict[str, dict[str, Any]],
                   eval_weights: str, reported: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keys a run reports for ``split``: ``{split}_{headline}`` (the ``eval_weights``
    weights' value), ``{split}_{headline}_raw`` and ``{split}_{headline}_ema``, from the
    task's metrics of each weights (``by_weights["raw"]``, ``by_weights["ema"]``), and
    ``{split}_{name}`` of the ``eval_weights`` weights for each name in ``reported``."""
    key = f"{split}_{headline}"
    chosen = by_weights[eval_weights]
    return {key: chosen[headline],
            **{f"{key}_{w}": by_weights[w][headline] for w in EVAL_WEIGHTS},
            **{f"{split}_{name}": chosen[name] for name in reported if name in chosen}}


FINAL_EVAL_TRAIN_POINTS = 2**23
"""Points of the training split the end of a run evaluates under ``final_eval_train=auto``:
every training sample when the split holds no more, else an evenly spaced subsample of
about that many points (a store of 1M-point meshes: 8 of them)."""


def final_eval_samples(option: str | int, sizes: np.ndarray | None, count: int
                       ) -> tuple[np.ndarray | None, str]:
    """The training samples the end-of-run evaluation covers under ``final_eval_train``
    ``option`` (``all``, ``none``, ``auto`` or a count), of a split of ``count`` samples of
    ``sizes`` points (None: unknown): ``(indices or None for every one, a phrase saying
    which)``. A subsample is evenly spaced over the split (the same on every run)."""
    total = None if sizes is None else int(np.sum(sizes))
    if option == "none":
        return np.zeros(0, np.int64), "train not evaluated (final_eval_train=none)"
    if option == "auto":
        if total is None or total <= FINAL_EVAL_TRAIN_POINTS:
            return None, f"train: all {count} samples (final_eval_train=auto)"
        wanted = max(1, int(count * FINAL_EVAL_TRAIN_POINTS / total))
        why = f"final_eval_train=auto: the split holds {total / 1e6:.1f}M points"
    elif option == "all" or int(option) >= count:
        return None, f"train: all {count} samples (final_eval_train={option})"
    else:
        wanted, why = int(option), f"final_eval_train={option}"
    chosen = np.unique(np.linspace(0, count - 1, wanted).round().astype(np.int64))
    return chosen, f"train: {len(chosen)} of {count} samples, evenly spaced ({why})"


def final_eval_sets(task: Task, option: str | int, splits: tuple[str, ...]
                    ) -> dict[str, tuple[np.ndarray | None, str]]:
    """``{split: (indices or None for every one, a phrase saying which)}`` of the samples an
    end-of-run evaluation covers: every sample of each split, the training split's chosen
    by ``final_eval_train`` ``option`` (:func:`final_eval_samples`)."""
    sets = {name: (None, f"{name}: all {task.num_samples(name)} samples") for name in splits}
    if "train" in sets:
        sets["train"] = final_eval_samples(option, task.sample_sizes("train"),
                                           task.num_samples("train"))
    return sets


def evaluate_weights(engine: Engine, split: str, batch_size: int,
                     models: dict[str, torch.nn.Module], *, same: bool = False,
                     indices: np.ndarray | None = None, keep: KeptPredictions | None = None
                     ) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """``{"raw": (metrics, records), "ema": (...)}`` of ``models["raw"]`` and
    ``models["ema"]`` on ``split`` (its samples ``indices``, default every one), both run
    on each sample in one pass over the data. ``same``: the EMA copy is the raw weights
    (``ema_decay`` 0), evaluated once. ``keep``: as :meth:`Engine.evaluate`'s."""
    names = ("raw",) if same else ("raw", "ema")
    results = engine.evaluate({w: models[w] for w in names}, split, batch_size,
                              indices=indices, keep=keep)
    return {"raw": results["raw"], "ema": results["raw" if same else "ema"]}


def load_for_evaluation(path: str | Path, *, data_root: str | Path | None = None,
                        device: str | torch.device | None = "auto", ema: bool | None = None,
                        check: Callable[[RunConfig], Any] | None = None
                        ) -> tuple[torch.nn.Module, Task, RunConfig, dict[str, Any]]:
    """``(model on device, task with the checkpoint's normalisers, config, state)``; the
    model's weights are the EMA ones, the raw ones, or (``ema=None``) those the run reports
    (:func:`flarepp.storage.checkpoint.rebuild_model`). ``check``: the entry point's check
    of the stored config (``flarepp eval``: :func:`flarepp.train.validate`), before any
    data is read."""
    state = read_checkpoint(path)
    config = RunConfig.from_stored(state["config"])
    if check is not None:
        check(config)
    model = rebuild_model(state, path, ema=ema)
    task = build_task(config, data_root if data_root is not None else run_data(state, config))
    task.check_model(state["model_config"])
    task.load_state_dict(state["normalizers"])
    return model.to(resolve_device(device)).eval(), task, config, state


def evaluate_checkpoint(path: str | Path, *, data_root: str | Path | None = None,
                        device: str | torch.device | None = "auto",
                        chunk_size: int | None = None, parallel: ParallelPlan = SINGLE,
                        splits: tuple[str, ...] | None = None,
                        precision: str | None = None,
                        say: Callable[[str], None] | None = None,
                        check: Callable[[RunConfig], Any] | None = None) -> dict[str, Any]:
    """Metrics of a checkpoint's raw and EMA weights, keyed as in ``metrics.json``
    (:func:`weight_metrics`; the headline is the run's ``eval_weights``), and the CPU
    threads it ran with (``threads``: timed on its first forwards, :mod:`flarepp.threads`;
    ``say`` receives the line that names them).

    ``precision`` (``fp32``, ``bf16``, ``fp16``) runs the model under that autocast instead
    of the run's own (``config.precision``): e.g. an FP32-trained model evaluated with BF16
    matrix products, FP32 accumulation (paper D.2 measures 16-bit inference against FP32);
    the metrics name the precision they were computed in. ``check``: as
    :func:`load_for_evaluation`'s. The thread count it times is put back at the end.

    Both weights run on each sample in one pass over a split, a large sample streamed
    (:data:`~flarepp.inference.execution.STREAM_ABOVE`, or ``chunk_size``); the training
    split is the samples the run's ``final_eval_train`` chooses (:func:`final_eval_samples`,
    recorded as ``final_eval_train``), as at the end of the run."""
    model, task, config, state = load_for_evaluation(path, data_root=data_root,
                                                     device=device, ema=False, check=check)
    device = next(model.parameters()).device
    models = {"raw": model, "ema": rebuild_model(state, path, ema=True).to(device)}
    precision = precision or config.precision
    workers = config.workers(device.type)
    chosen = final_eval_sets(task, config.final_eval_train, splits or task.eval_splits)
    forwards = sum(-(-(task.num_samples(split) if indices is None else len(indices))
                     // task.eval_batch_size()) for split, (indices, _) in chosen.items()
                   ) * (1 if config.ema_decay == 0 else 2)
    threads = ThreadTuner(steps=forwards, budget=thread_budget(workers), device=device,
                          say=say, skip=SHARED_BY_RANKS if parallel.mesh is not None else None)
    engine = Engine(task, Execution(device, precision, plan=parallel, chunk_size=chunk_size,
                                    stream_above=STREAM_ABOVE, threads=threads),
                    workers=workers)
    if parallel.cp_group is not None:
        for each in models.values():
            context_parallel(each, parallel.cp_group)
    metrics: dict[str, Any] = {}
    with threads:  # the thread count it times is put back at the end
        for split, (indices, _) in chosen.items():
            if indices is None or len(indices):   # final_eval_train=none: no train metrics
                results = evaluate_weights(engine, split, task.eval_batch_size(), models,
                                           same=config.ema_decay == 0, indices=indices)
                metrics.update(weight_metrics(split, task.headline,
                                              {w: r for w, (r, _) in results.items()},
                                              config.eval_weights, task.reported))
    if "train" in chosen:
        metrics["final_eval_train"] = final_eval_record(config.final_eval_train,
                                                        *chosen["train"],
                                                        task.num_samples("train"))
    metrics.update({"eval_weights": config.eval_weights, "precision": precision,
                    "epochs": int(state["epoch"]),
                    "params": sum(p.numel() for p in model.parameters()),
                    "device": str(device), "checkpoint": str(path),
                    "threads": threads.choice.record() if threads.choice
                    else {"threads": torch.get_num_threads(), "how": "being measured"}})
    return metrics


def final_eval_record(option: str | int, indices: np.ndarray | None, which: str,
                      count: int) -> dict[str, Any]:
    """What ``metrics.json`` says of the training samples evaluated at the end
    (:func:`final_eval_samples`): the option, how many of how many, the phrase."""
    return {"option": option, "evaluated": count if indices is None else int(len(indices)),
            "samples": count, "which": which}


def write_checkpoint_outputs(path: str | Path, out_dir: str | Path, *,
                             data_root: str | Path | None = None,
                             device: str | torch.device | None = "auto",
                             chunk_size: int | None = None) -> dict[str, Any]:
    """Evaluate a checkpoint's headline weights (the run's ``eval_weights``) on the task's
    first evaluation split and write the files a finished run leaves for its figures
    (``Task.write_outputs``: test predictions, the figure's case) into ``out_dir``; returns
    that split's headline metric. ``flarepp plot`` uses it for a run stopped before its
    end. One pass over the split, one sample's prediction in memory at a time (the ones
    written are kept on disk, :class:`~flarepp.inference.engine.KeptPredictions`)."""
    model, task, config, _state = load_for_evaluation(path, data_root=data_root,
                                                      device=device)
    device = next(model.parameters()).device
    engine = Engine(task, Execution(device, config.precision, chunk_size=chunk_size,
                                    stream_above=STREAM_ABOVE),
                    workers=config.workers(device.type))
    split = task.eval_splits[0]
    with KeptPredictions(task.predictions_to_keep(split), directory=out_dir) as kept:
        result, records = engine.evaluate(model, split, task.eval_batch_size(), keep=kept)
        cases = engine.predict_cases(model, split, task.cases_to_predict(split, records))
        predictions = ChainMap(cases, kept)
        extra = {"predictions": predictions} if predictions else {}
        task.write_outputs(Path(out_dir), split, records, **extra)
    return {f"{split}_{task.headline}": result[task.headline]}


__all__ = ["FINAL_EVAL_TRAIN_POINTS", "evaluate_checkpoint", "evaluate_weights",
           "final_eval_record", "final_eval_samples", "final_eval_sets", "load_for_evaluation",
           "weight_metrics", "write_checkpoint_outputs"]
