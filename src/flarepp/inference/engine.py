"""Running a task's model: device, precision, token sharding, streaming, evaluation.

The :class:`Engine` is the part of the trainer that ``flarepp eval`` reuses: it calls a
task's model under autocast on one device, splits the token axis of a batch over the
context-parallel group (paper Appendix B) when there is one, optionally streams a whole
mesh in chunks (:func:`flarepp.distributed.stream_forward`), and evaluates a split with
its samples shared out over the data-parallel ranks, gathering every rank's per-sample
records before the task summarises them.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from flarepp.device import autocast
from flarepp.distributed.encoder import global_sum
from flarepp.distributed.mesh import SINGLE, ParallelPlan
from flarepp.distributed.parallel import gather_tokens, shard_slice
from flarepp.distributed.streaming import stream_forward
from flarepp.tasks.base import Batch, Task, gather_records
from flarepp.inference.batching import eval_keys, make_loader, to_device, to_device_prefetched


@torch.no_grad()
def predict_tokens(model: nn.Module, batch: Batch, *, device: torch.device,
                   chunk_size: int | None = None, group: Any = None,
                   forward: Callable[[Batch], torch.Tensor] | None = None,
                   hidden_on: str = "auto", memmap_dir: str | None = None,
                   progress: bool = False) -> torch.Tensor:
    """The one prediction path: ``model``'s output for every token of ``batch``.

    ``batch`` holds ``x`` ``[B, N, I]`` (and ``mask`` ``[B, N]``) already cut to this rank's
    token shard when ``group`` (the context-parallel group, paper Appendix B) is given.
    With ``chunk_size`` the tokens are streamed through ``device`` in chunks whose encoder
    partials merge by the log-sum-exp rule (:func:`~flarepp.distributed.stream_forward`);
    otherwise ``forward(batch)`` (default ``model(x, mask)``) runs on tensors already on
    ``device``. Under ``group`` every rank returns the gathered ``[B, N, O]``. Every
    strategy computes the same function as ``model(x, mask)``; autocast is the caller's.
    ``hidden_on``, ``memmap_dir`` and ``progress`` are :func:`~flarepp.distributed.
    stream_forward`'s: where a streamed mesh's hidden state lives, and a progress bar.
    """
    if chunk_size is not None:
        pred = stream_forward(model, batch["x"], batch.get("mask"), chunk_size=chunk_size,
                              device=device, group=group, hidden_on=hidden_on,
                              memmap_dir=memmap_dir, progress=progress)
    elif forward is not None:
        pred = forward(batch)
    else:
        mask = batch.get("mask")
        pred = model(batch["x"].to(device), mask=None if mask is None else mask.to(device))
    if group is not None:
        pred = gather_tokens(pred.to(device).contiguous(), group)
    return pred


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

    # -- token sharding ------------------------------------------------------------------
    def token_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the tokens of the context-parallel group (identity without one)."""
        return x if self.plan.cp_group is None else global_sum(x, self.plan.cp_group)

    def shard(self, batch: Batch) -> Batch:
        """This rank's contiguous token shard of every token entry of ``batch``."""
        if self.plan.cp_group is None:
            return batch
        rank, world = self.plan.cp_rank, self.plan.cp_size
        return {k: (v[:, shard_slice(v.shape[1], rank, world)]
                    if k in self.task.token_keys else v) for k, v in batch.items()}

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The task's forward on ``batch`` (already this rank's shard), under autocast."""
        with autocast(self.precision, self.device):
            return self.task.forward(model, batch)

    @torch.no_grad()
    def predict(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Predictions for the whole of ``batch`` (token shards gathered, or streamed)."""
        shard = self.shard(batch)
        with autocast(self.precision, self.device):
            return predict_tokens(model, shard, device=self.device, chunk_size=self.chunk_size,
                                  group=self.plan.cp_group,
                                  forward=lambda b: self.task.forward(model, b))

    def predict_cases(self, model: nn.Module, split: str, indices: list[int]
                      ) -> dict[int, np.ndarray]:
        """``{index: raw output [N, O]}`` of ``model`` on samples of ``split`` (in eval mode;
        every rank takes part: shards, streams and gathers as :meth:`predict`)."""
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
