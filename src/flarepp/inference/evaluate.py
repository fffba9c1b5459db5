"""Evaluating a checkpoint on any device: the task's metric of its EMA model on each split.

The model is rebuilt from the checkpoint alone, the task from the checkpoint's run config
(reading the data from ``data_root``, by default the data the run trained on), and the
task's normalisers are the checkpoint's (a model is always evaluated with the statistics it
was trained with).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flarepp.device import resolve_device
from flarepp.distributed.mesh import SINGLE, ParallelPlan
from flarepp.tasks import Task, build_task
from flarepp.storage.checkpoint import read_checkpoint, rebuild_model
from flarepp.storage.config import RunConfig
from flarepp.inference.engine import Engine


def run_data(state: dict[str, Any], config: RunConfig) -> str:
    """The data a checkpoint's run trained on: the recorded path if it still exists, else
    the config's ``data_root``."""
    recorded = state.get("data", {}).get("identity", {}).get("path")
    return recorded if recorded and Path(recorded).exists() else config.data_root


def load_for_evaluation(path: str | Path, *, data_root: str | Path | None = None,
                        device: str | torch.device | None = "auto", ema: bool = True
                        ) -> tuple[torch.nn.Module, Task, RunConfig, dict[str, Any]]:
    """``(model on device, task with the checkpoint's normalisers, config, state)``."""
    state = read_checkpoint(path)
    config = RunConfig.from_stored(state["config"])
    model = rebuild_model(state, path, ema=ema)
    task = build_task(config, data_root if data_root is not None else run_data(state, config))
    task.check_model(state["model_config"])
    task.load_state_dict(state["normalizers"])
    return model.to(resolve_device(device)).eval(), task, config, state


def evaluate_checkpoint(path: str | Path, *, data_root: str | Path | None = None,
                        device: str | torch.device | None = "auto",
                        chunk_size: int | None = None, parallel: ParallelPlan = SINGLE,
                        splits: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Metrics of a checkpoint's EMA model, keyed as in ``metrics.json``."""
    model, task, config, state = load_for_evaluation(path, data_root=data_root,
                                                     device=device)
    device = next(model.parameters()).device
    engine = Engine(task, device, config.precision, plan=parallel, chunk_size=chunk_size,
                    workers=config.workers(device.type))
    if parallel.cp_group is not None:
        from flarepp.distributed import context_parallel
        context_parallel(model, parallel.cp_group)
    metrics: dict[str, Any] = {}
    for split in splits or task.eval_splits:
        result, _ = engine.evaluate(model, split, task.eval_batch_size())
        metrics[f"{split}_{task.headline}"] = result[task.headline]
        if "zero_target_samples" in result:
            metrics[f"{split}_zero_target_samples"] = result["zero_target_samples"]
    metrics.update({"epochs": int(state["epoch"]),
                    "params": sum(p.numel() for p in model.parameters()),
                    "device": str(device), "checkpoint": str(path)})
    return metrics


def write_checkpoint_outputs(path: str | Path, out_dir: str | Path, *,
                             data_root: str | Path | None = None,
                             device: str | torch.device | None = "auto",
                             chunk_size: int | None = None) -> dict[str, Any]:
    """Evaluate a checkpoint's EMA model on the task's first evaluation split and write the
    files a finished run leaves for its figures (``Task.write_outputs``: test predictions,
    the figure's case) into ``out_dir``; returns that split's metrics. ``flarepp plot``
    uses it for a run stopped before its end."""
    model, task, config, _state = load_for_evaluation(path, data_root=data_root,
                                                      device=device)
    device = next(model.parameters()).device
    engine = Engine(task, device, config.precision, chunk_size=chunk_size,
                    workers=config.workers(device.type))
    split = task.eval_splits[0]
    result, records = engine.evaluate(model, split, task.eval_batch_size())
    predictions = engine.predict_cases(model, split, task.cases_to_predict(split, records))
    extra = {"predictions": predictions} if predictions else {}
    task.write_outputs(Path(out_dir), split, records, **extra)
    return {f"{split}_{task.headline}": result[task.headline]}


__all__ = ["evaluate_checkpoint", "load_for_evaluation",
           "write_checkpoint_outputs"]
