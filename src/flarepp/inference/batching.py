"""From sample indices to device batches: global batches, rank shares, micro-batches, prefetch.

* **Global batches.** Every data-parallel rank sees the same epoch order (one seeded
  permutation) and cuts it into the same global batches of ``batch_size`` samples; rank
  ``r`` of ``R`` takes the ``r``-th contiguous share of each global batch (sizes differ by at
  most one). The union over ranks is exactly the single-process batch, so with the
  trainer's loss convention (sum over the global batch / its count) the gradients equal a
  single-process run's. A rank whose share of a short last batch is empty takes the
  batch's first sample with weight 0: it runs the same collectives and adds nothing.
* **Micro-batches.** Samples of different sizes (meshes of different N) are padded to a
  common length inside a batch. A batch is split into micro-batches whose padded size
  (samples x longest) stays within the batch's real token count, largest first, and the
  trainer accumulates their gradients: memory follows the real tokens, never the padding
  (one 200K-point mesh among 60-point ones trains as that mesh alone plus a small
  micro-batch of the others). Batches of equal sizes stay whole.
* **Prefetch.** A ``torch.utils.data.DataLoader`` reads and collates batches (in worker
  processes when ``workers > 0``, into pinned memory when the device is CUDA), and
  :func:`to_device_prefetched` issues the next batch's non-blocking host-to-device copies
  before the current batch is computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from flarepp.tasks.base import Task


@dataclass(frozen=True)
class ItemKey:
    """What a loader worker needs to read one sample."""

    index: int
    seed: int
    weight: float = 1.0


def global_batches(order: np.ndarray, batch_size: int) -> list[np.ndarray]:
    return [order[s:s + batch_size] for s in range(0, len(order), batch_size)]


def rank_share(batch: np.ndarray, rank: int, world: int) -> tuple[np.ndarray, float]:
    """Rank ``rank``'s contiguous share of a global batch and its weight (0: a stand-in)."""
    base, extra = divmod(len(batch), world)
    start = rank * base + min(rank, extra)
    share = batch[start:start + base + (rank < extra)]
    if len(share) == 0:
        return batch[:1], 0.0
    return share, 1.0


def micro_batches(sizes: list[int]) -> list[list[int]]:
    """Positions of a batch grouped so that ``len(group) * max(size)`` never exceeds the
    batch's total size (its real tokens); equal sizes give one group, in order."""
    if len(set(sizes)) <= 1:
        return [list(range(len(sizes)))]
    budget = sum(sizes)
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * sizes[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class _TaskItems(Dataset):
    def __init__(self, task: Task, split: str, training: bool) -> None:
        self.task, self.split, self.training = task, split, training

    def __len__(self) -> int:
        return self.task.num_samples(self.split)

    def __getitem__(self, key: ItemKey) -> tuple[dict, float]:
        return self.task.get(self.split, key.index, key.seed, training=self.training), key.weight


class _Collate:
    """Items -> ``(micro-batches, weight)``; picklable for worker processes."""

    def __init__(self, task: Task) -> None:
        self.task = task

    def __call__(self, items: list[tuple[dict, float]]) -> tuple[list[dict], float]:
        samples = [it for it, _ in items]
        groups = micro_batches([self.task.item_size(it) for it in samples])
        return [self.task.collate([samples[i] for i in g]) for g in groups], items[0][1]


def make_loader(task: Task, split: str, keys: list[list[ItemKey]], *, training: bool,
                workers: int, pin_memory: bool) -> DataLoader:
    """A loader yielding ``(micro-batches, weight)`` for the given per-batch item keys.

    Its own generator keeps the global torch RNG untouched (the DataLoader would otherwise
    draw a worker seed from it), so a run's random stream does not depend on the loader.
    """
    return DataLoader(_TaskItems(task, split, training), batch_sampler=keys,
                      collate_fn=_Collate(task), num_workers=workers, pin_memory=pin_memory,
                      generator=torch.Generator(), persistent_workers=False,
                      prefetch_factor=2 if workers > 0 else None)


def epoch_keys(order: np.ndarray, batch_size: int, rank: int, world: int, seed: int
               ) -> list[list[ItemKey]]:
    """This rank's item keys for every global batch of an epoch order.

    ``seed`` is the epoch's base seed; sample ``i`` gets ``seed + i`` for its own random
    draws (e.g. a sub-sample of a surface), the same on every rank and worker.
    """
    keys = []
    for batch in global_batches(order, batch_size):
        share, weight = rank_share(batch, rank, world)
        keys.append([ItemKey(int(i), int(seed + i), weight) for i in share])
    return keys


def eval_keys(indices: Any, batch_size: int, rank: int, world: int, *,
              sizes: np.ndarray | None = None, batch_points: int | None = None
              ) -> list[list[ItemKey]]:
    """A strided share of the sample ``indices`` (an array, or a count: ``range``) for rank
    ``rank``, in batches (may be empty) of at most ``batch_size`` samples and, with the
    split's ``sizes`` (tokens of every sample), at most ``batch_points`` padded tokens
    (samples x the longest; a larger sample alone)."""
    indices = np.arange(indices) if np.ndim(indices) == 0 else np.asarray(indices)
    mine = indices[rank::world]
    batches: list[list[ItemKey]] = []
    longest = 0
    for i in mine:
        n = 0 if sizes is None or batch_points is None else int(sizes[i])
        if batches and len(batches[-1]) < batch_size and (
                (len(batches[-1]) + 1) * max(longest, n) <= (batch_points or 0) or not n):
            batches[-1].append(ItemKey(int(i), int(i)))
            longest = max(longest, n)
        else:
            batches.append([ItemKey(int(i), int(i))])
            longest = n
    return batches


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors of a (nested) batch on ``device``; copies from pinned memory do not block."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=batch.is_pinned())
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def to_device_prefetched(loader, device: torch.device) -> Iterator:
    """Iterate ``loader`` with the next batch's host-to-device copy issued ahead of time."""
    it = iter(loader)
    try:
        ahead = to_device(next(it), device)
    except StopIteration:
        return
    for batch in it:
        current, ahead = ahead, to_device(batch, device)
        yield current
    yield ahead


def steps_per_epoch(n_samples: int, batch_size: int) -> int:
    return math.ceil(n_samples / batch_size)
