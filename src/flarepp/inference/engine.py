"""Running a task's model: the trainer's forward, predictions and evaluation of a split.

The :class:`Engine` is the part of the trainer that ``flarepp eval`` reuses: it calls a
task's model under autocast on one device (training), predicts through
:func:`~flarepp.inference.execution.predict_tokens` under its
:class:`~flarepp.inference.execution.Execution` (the context-parallel token split of paper
Appendix B, streaming in chunks) and de-normalises through the task's
:class:`~flarepp.models.surrogate.Surrogate`, and evaluates a split with its samples shared
out over the data-parallel ranks, gathering every rank's per-sample records before the task
summarises them.

Evaluation in bounded memory: each sample is read once however many models are evaluated
(the raw weights and the EMA copy run on it in the same pass), an evaluation batch holds at
most :data:`EVAL_BATCH_POINTS` padded points (a split of large meshes is evaluated one
sample at a time, one of small ones in batches), a sample larger than the execution's
chunk streams through the exact streamed path, and the records keep per-sample numbers
only. Predictions a task writes (:meth:`~flarepp.tasks.Task.predictions_to_keep`) go to
disk one sample at a time (:class:`KeptPredictions`) and are read back one at a time.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
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

EVAL_BATCH_POINTS = 2**18
"""Padded points (samples x the longest) an evaluation batch may hold: a split's samples go
``Task.eval_batch_size()`` to a batch, fewer where they are larger, down to one."""


class KeptPredictions(Mapping[int, np.ndarray]):
    """Predictions of the samples ``indices`` of one evaluation, by the model named
    ``weights`` (``None``: the only one evaluated), written to a temporary folder in
    ``directory`` (default: the system's) one sample at a time as the pass reaches them and
    read back one at a time: ``{index: prediction [n, O]}`` at the sample's real points
    (physical units). ``close()`` (or leaving its ``with``) deletes the folder.

    With data-parallel ranks each keeps its own samples and :meth:`gather` brings every
    rank's to every rank (in memory: those predictions travel as objects)."""

    def __init__(self, indices: Sequence[int], weights: str | None = None, *,
                 directory: str | Path | None = None) -> None:
        self.wanted, self.weights = {int(i) for i in indices}, weights
        self._folder = Path(tempfile.mkdtemp(prefix=".predictions-", dir=directory))
        self._held: dict[int, np.ndarray] = {}   # gathered from other ranks

    def add(self, index: int, pred: np.ndarray) -> None:
        np.save(self._folder / f"{int(index)}.npy", np.ascontiguousarray(pred),
                allow_pickle=False)

    def _written(self) -> list[int]:
        return sorted(int(p.stem) for p in self._folder.glob("*.npy"))

    def __getitem__(self, index: int) -> np.ndarray:
        if index in self._held:
            return self._held[index]
        path = self._folder / f"{int(index)}.npy"
        if not path.is_file():
            raise KeyError(index)
        return np.load(path, allow_pickle=False)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted({*self._written(), *self._held}))

    def __len__(self) -> int:
        return len({*self._written(), *self._held})

    def gather(self, group: dist.ProcessGroup) -> None:
        """Every rank's kept predictions on every rank."""
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, {i: self[i] for i in self._written()}, group=group)
        for rank_part in everyone:
            self._held.update(rank_part)

    def close(self) -> None:
        shutil.rmtree(self._folder, ignore_errors=True)
        self._held = {}

    def __enter__(self) -> "KeptPredictions":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
    def evaluate(self, models: nn.Module | Mapping[str, nn.Module], split: str,
                 batch_size: int, *, indices: Sequence[int] | None = None,
                 keep: KeptPredictions | None = None) -> Any:
        """``(metrics, records)`` of a model on ``split``, the same on every rank; for a
        mapping of models ``{name: (metrics, records)}``, every model run on each sample
        in one pass over the data (each sample read once).

        ``indices``: the samples evaluated (default: every one); batches hold at most
        ``batch_size`` samples and :data:`EVAL_BATCH_POINTS` padded points
        (:meth:`~flarepp.tasks.Task.sample_sizes`). ``keep`` receives the predictions of
        its samples by its model (:class:`KeptPredictions`), written as they come."""
        single = isinstance(models, nn.Module)
        named = {"model": models} if single else dict(models)
        states = {name: model.training for name, model in named.items()}
        for model in named.values():
            model.eval()
        plan = self.execution.plan
        chosen = (np.arange(self.task.num_samples(split)) if indices is None
                  else np.asarray(indices, np.int64))
        keys = eval_keys(chosen, batch_size, plan.dp_rank, plan.dp_size,
                         sizes=self.task.sample_sizes(split), batch_points=EVAL_BATCH_POINTS)
        loader = make_loader(self.task, split, keys, training=False, workers=self.workers,
                             pin_memory=self.device.type == "cuda")
        surrogates = {name: self.task.surrogate(model).to(self.device)
                      for name, model in named.items()}
        kept_by = None if keep is None else (keep.weights if keep.weights in named
                                             else next(iter(named)))
        parts: dict[Any, list] = {name: [] for name in named}
        for micro, _ in to_device_prefetched(loader, self.device):
            for batch in micro:
                for name, surrogate in surrogates.items():
                    pred = self._predict(surrogate, batch)
                    parts[name].append(self.task.eval_records(pred, batch))
                    if keep is not None and name == kept_by:
                        self._keep(keep, pred, batch)
                    del pred
        if plan.dp_group is not None:
            for name in named:
                everyone: list[Any] = [None] * plan.dp_size
                dist.all_gather_object(everyone, parts[name], group=plan.dp_group)
                parts[name] = [p for rank_parts in everyone for p in rank_parts]
            if keep is not None:
                keep.gather(plan.dp_group)
        for name, model in named.items():
            model.train(states[name])
        results = {name: (self.task.summarize(split, records), records)
                   for name, records in ((n, gather_records(parts[n])) for n in named)}
        return results["model"] if single else results

    @staticmethod
    def _keep(keep: KeptPredictions, pred: torch.Tensor, batch: Batch) -> None:
        """The predictions of ``batch``'s samples that ``keep`` wants, at their real points."""
        mask = batch.get("mask")
        for row, index in enumerate(batch["index"].tolist()):
            if index in keep.wanted:
                sample = pred[row] if mask is None else pred[row][mask[row].to(pred.device)]
                keep.add(index, sample.float().cpu().numpy())


__all__ = ["EVAL_BATCH_POINTS", "Engine", "KeptPredictions"]
