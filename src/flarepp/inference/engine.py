"""Running a task's model: device, precision, token sharding, streaming, evaluation.

The :class:`Engine` is the part of the trainer that ``flarepp eval`` reuses: it calls a
task's model under autocast on one device (training), predicts through the task's
:class:`~flarepp.inference.predictor.Predictor` (its normalisers, the context-parallel
token split of paper Appendix B, streaming in chunks), and evaluates a split with its
samples shared out over the data-parallel ranks, gathering every rank's per-sample records
before the task summarises them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from flarepp.device import autocast
from flarepp.distributed.encoder import global_sum
from flarepp.distributed.mesh import SINGLE, ParallelPlan
from flarepp.tasks.base import Batch, Task, gather_records
from flarepp.threads import ThreadTuner
from flarepp.inference.batching import eval_keys, make_loader, to_device, to_device_prefetched

from flarepp.inference.predictor import Predictor, predict_tokens, shard_tokens  # noqa: F401


class Engine:
    """How this process runs ``task``'s model: ``device``, ``precision`` and ``plan``."""

    def __init__(self, task: Task, device: torch.device, precision: str, *,
                 plan: ParallelPlan = SINGLE, chunk_size: int | None = None,
                 workers: int = 0) -> None:
        if plan.cp_group is not None and not task.token_keys:
            raise ValueError(f"context parallelism splits the tokens of a sample, but task "
                             f"{task.name!r} has no token axis to split")
        if chunk_size is not None and not task.token_keys:
            raise ValueError(f"streaming runs a sample's tokens in chunks, but task "
                             f"{task.name!r} has no token axis")
        self.task, self.device, self.precision = task, torch.device(device), precision
        self.plan, self.chunk_size, self.workers = plan, chunk_size, workers
        self.threads: ThreadTuner | None = None  # set: each prediction's forward is timed

    # -- token sharding ------------------------------------------------------------------
    def token_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the tokens of the context-parallel group (identity without one)."""
        return x if self.plan.cp_group is None else global_sum(x, self.plan.cp_group)

    def shard(self, batch: Batch) -> Batch:
        """This rank's contiguous token shard of every token entry of ``batch``."""
        return shard_tokens(batch, self.plan, self.task.token_keys)

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The task's forward on ``batch`` (already this rank's shard), under autocast."""
        with autocast(self.precision, self.device):
            return self.task.forward(model, batch)

    def predictor(self, model: nn.Module) -> Predictor:
        """``model`` with the task's normalisers, this engine's device, precision, token
        split and streaming, called through the task's forward."""
        maps = self.task.normalizers()
        return Predictor(model, inputs=maps.get("x"), outputs=maps.get("y"),
                         conditions=maps.get("conditions"), device=self.device,
                         precision=self.precision, plan=self.plan, chunk_size=self.chunk_size,
                         token_keys=self.task.token_keys, threads=self.threads,
                         forward=lambda b: self.task.forward(model, b))

    def predict(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Predictions for the whole of ``batch`` (token shards gathered, or streamed) in
        physical units (the task's outputs as they are for a task without output maps)."""
        return self.predictor(model).predict_batch(batch)

    def predict_cases(self, model: nn.Module, split: str, indices: list[int]
                      ) -> dict[int, np.ndarray]:
        """``{index: prediction [N, O]}`` (physical units) of ``model`` on samples of
        ``split`` (in eval mode; every rank takes part: shards, streams and gathers as
        :meth:`predict`)."""
        was_training = model.training
        model.eval()
        out = {}
        for index in indices:
            item = self.task.get(split, index, index, training=False)
            batch = to_device(self.task.collate([item]), self.device)
            out[index] = self.predict(model, batch)[0].float().cpu().numpy()
        model.train(was_training)
        return out

    # -- evaluation ----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str, batch_size: int
                 ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """``(metrics, records)`` of ``model`` on ``split``, the same on every rank."""
        was_training = model.training
        model.eval()
        keys = eval_keys(self.task.num_samples(split), batch_size, self.plan.dp_rank,
                         self.plan.dp_size)
        loader = make_loader(self.task, split, keys, training=False, workers=self.workers,
                             pin_memory=self.device.type == "cuda")
        parts = []
        for micro, _ in to_device_prefetched(loader, self.device):
            for batch in micro:
                parts.append(self.task.eval_records(self.predict(model, batch), batch))
        if self.plan.dp_group is not None:
            everyone: list[Any] = [None] * self.plan.dp_size
            dist.all_gather_object(everyone, parts, group=self.plan.dp_group)
            parts = [p for rank_parts in everyone for p in rank_parts]
        records = gather_records(parts)
        model.train(was_training)
        return self.task.summarize(split, records), records
