"""Running a task's model: the trainer's forward, predictions and evaluation of a split.

The :class:`Engine` is the part of the trainer that ``flarepp eval`` reuses: it calls a
task's model under autocast on one device (training), predicts through
:func:`~flarepp.inference.execution.predict_tokens` under its
:class:`~flarepp.inference.execution.Execution` (the context-parallel token split of paper
Appendix B, streaming in chunks) and de-normalises through the task's
:class:`~flarepp.models.surrogate.Surrogate`, and evaluates a split with its samples shared
out over the data-parallel ranks, gathering every rank's per-sample records before the task
summarises them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from flarepp.device import autocast
from flarepp.distributed.encoder import global_sum
from flarepp.distributed.parallel import shard_slice
from flarepp.inference.batching import eval_keys, make_loader, to_device, to_device_prefetched
from flarepp.inference.execution import Execution, predict_tokens
from flarepp.models.surrogate import Surrogate
from flarepp.tasks.base import Batch, Task, gather_records


class Engine:
    """How this process runs ``task``'s model: its ``execution`` (device, precision, token
    split, streaming, thread timing) and ``workers`` loader processes for evaluation."""

    def __init__(self, task: Task, execution: Execution, *, workers: int = 0) -> None:
        if execution.plan.cp_group is not None and not task.token_keys:
            raise ValueError(f"context parallelism splits the tokens of a sample, but task "
                             f"{task.name!r} has no token axis to split")
        if execution.chunk_size is not None and not task.token_keys:
            raise ValueError(f"streaming runs a sample's tokens in chunks, but task "
                             f"{task.name!r} has no token axis")
        self.task, self.execution, self.workers = task, execution, workers

    @property
    def device(self) -> torch.device:
        return self.execution.device

    # -- training ------------------------------------------------------------------------
    def token_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the tokens of the context-parallel group (identity without one)."""
        group = self.execution.plan.cp_group
        return x if group is None else global_sum(x, group)

    def shard(self, batch: Batch) -> Batch:
        """This rank's contiguous token shard of every token entry of ``batch`` (the batch
        itself without a context-parallel group)."""
        plan = self.execution.plan
        if plan.cp_group is None:
            return batch
        return {k: (v[:, shard_slice(v.shape[1], plan.cp_rank, plan.cp_size)]
                    if k in self.task.token_keys else v) for k, v in batch.items()}

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The task's forward on ``batch`` (already this rank's shard), under autocast."""
        with autocast(self.execution.precision, self.device):
            return self.task.forward(model, batch)

    # -- predictions ---------------------------------------------------------------------
    def predict(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Predictions for the whole of ``batch`` (token shards gathered, or streamed) in
        physical units (the task's outputs as they are for a task without output maps)."""
        return self._predict(self.task.surrogate(model).to(self.device), batch)

    def _predict(self, surrogate: Surrogate, batch: Batch) -> torch.Tensor:
        """The model of ``surrogate`` on a task batch (its inputs normalised by the task's
        data pipeline), de-normalised by the surrogate; a task without a token axis
        predicts through its own forward."""
        if self.task.token_keys:
            y = predict_tokens(surrogate.model, self.task.model_inputs(batch), self.execution)
        else:
            with torch.no_grad(), self.execution.running():
                y = self.task.forward(surrogate.model, batch)
        return surrogate.denormalise(y, batch.get("mask"))

    def predict_cases(self, model: nn.Module, split: str, indices: list[int]
                      ) -> dict[int, np.ndarray]:
        """``{index: prediction [N, O]}`` (physical units) of ``model`` on samples of
        ``split`` (in eval mode; every rank takes part: shards, streams and gathers as
        :meth:`predict`)."""
        was_training = model.training
        model.eval()
        surrogate = self.task.surrogate(model).to(self.device)
        out = {}
        for index in indices:
            item = self.task.get(split, index, index, training=False)
            batch = to_device(self.task.collate([item]), self.device)
            out[index] = self._predict(surrogate, batch)[0].float().cpu().numpy()
        model.train(was_training)
        return out

    # -- evaluation ----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str, batch_size: int
                 ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """``(metrics, records)`` of ``model`` on ``split``, the same on every rank."""
        was_training = model.training
        model.eval()
        plan = self.execution.plan
        keys = eval_keys(self.task.num_samples(split), batch_size, plan.dp_rank, plan.dp_size)
        loader = make_loader(self.task, split, keys, training=False, workers=self.workers,
                             pin_memory=self.device.type == "cuda")
        surrogate = self.task.surrogate(model).to(self.device)
        parts = []
        for micro, _ in to_device_prefetched(loader, self.device):
            for batch in micro:
                parts.append(self.task.eval_records(self._predict(surrogate, batch), batch))
        if plan.dp_group is not None:
            everyone: list[Any] = [None] * plan.dp_size
            dist.all_gather_object(everyone, parts, group=plan.dp_group)
            parts = [p for rank_parts in everyone for p in rank_parts]
        records = gather_records(parts)
        model.train(was_training)
        return self.task.summarize(split, records), records


__all__ = ["Engine"]
