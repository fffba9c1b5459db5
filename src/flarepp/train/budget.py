"""A run's memory budget: what it may take, what it will take, and the sizes chosen within it.

The budget is the resident memory in bytes that a run -- its process and its loader workers,
summed -- may take: ``memory_budget_gib`` (``flarepp train --memory-budget GiB``), else the
tightest limit set on the process (:func:`limit_budget`: the cgroup's memory limit, v2
``memory.max`` or v1 ``memory.limit_in_bytes``, or ``RLIMIT_AS`` / ``RLIMIT_DATA``: what the
process holds now plus the headroom the limit leaves, an address-space limit's at
:data:`ADDRESS_SPACE_RESIDENT`, :func:`flarepp.device.memory_bounds`),
else none and nothing is planned. Within it the trainer chooses, once, before training
starts (:class:`MemoryPlan`, called from the trainer's setup):

* ``dataset_options.points_per_step`` -- only where the user left it unset, the data is a
  store and a training step on whole samples does not fit: the largest power of two that
  fits (on ``--resume``, the value the run trained with);
* ``eval_chunk_size`` -- where unset: the engine's default (a mesh whole up to
  ``STREAM_ABOVE`` points, streamed in ``STREAM_CHUNK`` above) if that fits, else the
  largest power of two (at most :data:`CHUNK_MAX`) whose streamed evaluation fits, with the
  hidden state in a memory-mapped file where it does not fit in memory
  (``hidden_on="memmap"``);
* ``loader_workers`` -- where automatic (-1): the most of the device's default count that
  fit.

It says what it chose in one console line (:meth:`MemoryPlan.line`) and records it in
``metrics.json`` and ``provenance.json`` (``memory_plan``, :meth:`MemoryPlan.record`); a
budget too small for one training step (or for the evaluation of the widest mesh at the
smallest chunk) is :class:`MemoryBudgetTooSmall`, one sentence naming the budget, the
estimate and the options that change it, before any training.

The estimate (bytes, float32 ``F = 4``; C the residual width, L the blocks, I and O the
input and output channels, B samples of n points)::

    peak      = held + max(step, evaluation) + workers
    held      = the process's resident memory once the data is read and the model built
                (interpreter, torch, what the statistics pass left, the weights) + 4 x the
                parameters' bytes (gradients, AdamW's two moments, the EMA copy)
    step      = B n F (TRAIN_WIDTHS L C + I + 3 O)           activations kept for backward
    evaluation, whole     = B n F (EVAL_WIDTHS C + I + 3 O)  one block's no-grad activations
    evaluation, streamed  = hidden_state_bytes(B, n, C)      (host, or 0 when memory-mapped)
                            + B n F (I + 3 O) + B K F EVAL_WIDTHS C
    workers   = W (held + 2 B n F (I + O))   a forked worker's resident set counts the
                                             trainer's pages again, and 2 prefetched batches

with n the widest sample of the split (``points_per_step`` for training steps), B the
``batch_size`` (a step) or the samples of an evaluation batch (at most
``EVAL_BATCH_POINTS`` padded points: one large mesh at a time), K the chunk (unset: a mesh
above ``STREAM_ABOVE`` points streams in chunks of ``STREAM_CHUNK``). ``I + 3 O``: inputs,
targets, predictions and one temporary of the metric. The widths are floats per point,
per block, in units of C, measured on the ``store-tiny`` preset (FLARE++, C = 64, L = 3,
H M = 2 C; docs/data.md, "Larger than memory"): its peak resident memory (``/usr/bin/time
-v``, one epoch, no evaluation) grew by 19.7 and 20.5 KB per point of a batch from
``points_per_step`` 4096 to 32768 and to 131072, and ``TRAIN_WIDTHS`` = 27 gives 21.2 KB;
one streamed forward of a 400,000-point sample (:class:`flarepp.bench.memory.PeakMemory`)
peaked at 300 and 206 MiB at chunks of 65,536 and 16,384 points against 282 and 186 MiB
by the streamed formula (``EVAL_WIDTHS`` = 8: the 94 MiB between them is 7.9 C floats a
point); two loader workers added 1.22 GiB to the summed resident memory of 0.70 GiB
without them. The hidden state's bytes are the streaming driver's own
(:func:`flarepp.distributed.streaming.hidden_state_bytes`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flarepp.allocator import RETURNED, format_bytes, return_freed_memory
from flarepp.data.store import MANIFEST, MeshStore
from flarepp.device import HOST, memory_bounds
from flarepp.distributed.streaming import hidden_state_bytes, streaming_refusal
from flarepp.inference.engine import EVAL_BATCH_POINTS
from flarepp.inference.execution import STREAM_ABOVE, STREAM_CHUNK
from flarepp.storage.config import RunConfig, field_default, model_config_class
from flarepp.train.checks import dataset_takes

GIB = 2 ** 30
FLOAT_BYTES = 4
TRAIN_WIDTHS = 27
"""Floats per point, block and residual channel that a training step keeps for backward
(with H M = 2 C attention weights per encode, as in the presets)."""
EVAL_WIDTHS = 8
"""Floats per point and residual channel alive at once in a no-grad block."""
PARAMETER_COPIES = 5
"""Weights, gradients, AdamW's two moments and the EMA copy."""
PREFETCH = 2
"""Batches each loader worker holds (``flarepp.inference.batching.make_loader``)."""
ADDRESS_SPACE_RESIDENT = 0.9
"""Resident bytes per byte of address space that a run's allocations take after its setup:
under ``RLIMIT_AS`` (``prlimit --as``) the budget counts the limit's headroom at this rate.
Measured: ``store-tiny`` under ``prlimit --as=3GiB`` grew from 0.32 GiB resident / 0.92 GiB
mapped at its setup to 2.2 GiB / 3 GiB when an evaluation's allocation was refused."""
CHUNK_MAX = 2 ** 20
CHUNK_MIN = 2 ** 10
POINTS_MIN = 2 ** 8
"""The smallest chunk and training subset the plan chooses; below them a budget is refused."""


class MemoryBudgetTooSmall(ValueError):
    """The stated (or limited) budget cannot hold one training step or the evaluation."""


def limit_budget(*, cgroup_root: str | Path = "/sys/fs/cgroup",
                 proc: str | Path = "/proc") -> tuple[int, str] | None:
    """``(bytes, what)`` of the tightest memory limit set on this process (module
    docstring), or None where only the machine's free memory bounds it: the resident memory
    the process holds now plus the headroom the limit leaves (an address-space or data
    limit's at :data:`ADDRESS_SPACE_RESIDENT`: mapped is not resident)."""
    bounds = {what: headroom for what, headroom in
              memory_bounds(HOST, cgroup_root=cgroup_root, proc=proc).items()
              if not what.startswith("free memory")}
    if not bounds:
        return None
    resident = {what: headroom * (ADDRESS_SPACE_RESIDENT if "RLIMIT" in what else 1)
                for what, headroom in bounds.items()}
    what, headroom = min(resident.items(), key=lambda item: item[1])
    return resident_bytes(proc) + int(headroom), what


def resident_bytes(proc: str | Path = "/proc") -> int:
    """This process's resident memory now (``VmRSS``), 0 where ``/proc`` does not say."""
    try:
        for line in (Path(proc) / "self" / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


@dataclass
class DataExtent:
    """What the estimate needs of the data: the widest sample of the training split and of
    the evaluated splits, and the input and output channels per point."""

    train_points: int
    eval_points: int
    in_dim: int
    out_dim: int

    @classmethod
    def of_store(cls, config: RunConfig, root: Path) -> "DataExtent | None":
        """From a store's manifest (nothing read but it), for the ``fields`` task whose
        items the estimate counts; None otherwise (data held in memory as read, another
        task's items: nothing to plan but the workers)."""
        if config.task != "fields" or not (root / MANIFEST).is_file():
            return None
        store = MeshStore(root)
        options = config.dataset_options
        widest = {}
        for split in ("train", "test", "val"):
            if not store.splits.get(split):
                continue
            samples = store.split(split, count=options.get(f"n_{split}"), conditions=[])
            widest[split] = samples.n_points
            dims = samples.in_dim, samples.out_dim
        return cls(widest.get("train", 0), max(widest.values(), default=0), *dims)


@dataclass
class MemoryPlan:
    """The budget, the run's estimate and what was chosen (module docstring)."""

    budget: int
    source: str
    extent: DataExtent | None
    held: int
    chosen: dict[str, Any] = field(default_factory=dict)
    estimate: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    hidden_on: str = "auto"

    # -- discovery -----------------------------------------------------------------------
    @classmethod
    def discover(cls, config: RunConfig, data_root: str | Path) -> "MemoryPlan | None":
        """The plan of ``config`` on the data at ``data_root``, or None without a budget."""
        if config.memory_budget_gib is not None:
            budget, source = int(config.memory_budget_gib * GIB), "--memory-budget"
        else:
            limit = limit_budget()
            if limit is None:
                return None
            budget, source = limit
        return cls(budget, source, DataExtent.of_store(config, Path(data_root)),
                   resident_bytes())

    # -- the estimate --------------------------------------------------------------------
    @staticmethod
    def widths(config: RunConfig) -> tuple[int, int]:
        """``(C, L)``: the model's residual width and blocks."""
        kwargs = config.model_kwargs()
        cls = model_config_class(kwargs.get("arch", "surrogate"))
        dim, blocks = (kwargs.get(k, field_default(cls, k)) for k in ("dim", "blocks"))
        return int(dim or 0), int(blocks or 1)

    def step_bytes(self, config: RunConfig, points: int) -> int:
        dim, blocks = self.widths(config)
        e = self.extent
        return config.batch_size * points * FLOAT_BYTES * (
            TRAIN_WIDTHS * blocks * dim + e.in_dim + 3 * e.out_dim)

    def evaluation_bytes(self, config: RunConfig, samples: int, chunk: int | None,
                         hidden_on: str = "auto", *, streams: bool = True) -> int:
        """The evaluation's bytes (module docstring) of a batch of ``samples`` of the widest
        mesh, cut as the engine cuts it (at most ``EVAL_BATCH_POINTS`` padded points, one
        large mesh at a time), in chunks of ``chunk`` points; an unset ``chunk`` streams a
        mesh above ``STREAM_ABOVE`` points in chunks of ``STREAM_CHUNK`` where the model
        ``streams`` (:func:`flarepp.inference.execution.chunk_for`)."""
        dim, _ = self.widths(config)
        e = self.extent
        points = e.eval_points
        # the engine's batches hold at most EVAL_BATCH_POINTS padded points (one large mesh)
        samples = max(1, min(samples, EVAL_BATCH_POINTS // max(points, 1)))
        arrays = samples * points * FLOAT_BYTES * (e.in_dim + 3 * e.out_dim)
        if chunk is None and streams and points > STREAM_ABOVE:
            chunk = STREAM_CHUNK        # an unset chunk streams a mesh above STREAM_ABOVE
        if chunk is None:
            return arrays + samples * points * FLOAT_BYTES * EVAL_WIDTHS * dim
        hidden = 0 if hidden_on == "memmap" else hidden_state_bytes(samples, points, dim)
        return arrays + hidden + samples * min(chunk, points) * FLOAT_BYTES * EVAL_WIDTHS * dim

    def worker_bytes(self, config: RunConfig, workers: int, points: int) -> int:
        """A forked loader worker's resident set counts the pages of the trainer it maps
        (``held``: what /proc's sum over the processes counts) and its prefetched batches."""
        e = self.extent
        batch = config.batch_size * points * FLOAT_BYTES * (e.in_dim + e.out_dim) if e else 0
        return workers * (self.held + PREFETCH * batch)

    def _train_points(self, config: RunConfig) -> int:
        chosen = config.dataset_options.get("points_per_step")
        return min(chosen, self.extent.train_points) if chosen else self.extent.train_points

    # -- the choices ---------------------------------------------------------------------
    def plan_training(self, config: RunConfig, stored: RunConfig | None = None, *,
                      choose: bool = True) -> RunConfig:
        """``config`` with ``points_per_step`` chosen where it is unset, the data is a
        store, whole samples do not fit and ``choose`` (the data is not read yet);
        ``stored``: the config a resumed run trained with, whose value it keeps. Refuses a
        budget too small for one step."""
        if self.extent is None:
            return config
        options = config.dataset_options
        if choose and options.get("points_per_step") is None and dataset_takes(
                config, "points_per_step"):
            kept = None if stored is None else stored.dataset_options.get("points_per_step")
            points = kept or self._fitting_points(config)
            if points is not None and points < self.extent.train_points:
                config = dataclasses.replace(
                    config, dataset_options={**options, "points_per_step": points})
                self.chosen["dataset_options.points_per_step"] = points
        self._check_step(config)
        return config

    def _check_step(self, config: RunConfig, workers: int = 0) -> None:
        step = self.step_bytes(config, self._train_points(config))
        if self.held + self._workers_bytes(config, workers) + step > self.budget:
            bounds = ["batch_size"] + (["dataset_options.points_per_step"]
                                       if dataset_takes(config, "points_per_step") else [])
            raise MemoryBudgetTooSmall(self._refusal(
                f"one training step ({config.batch_size} x {self._train_points(config):,} "
                f"points: {format_bytes(step)})", step, bounds, config, workers))
        self.estimate["step"] = step

    def _fitting_points(self, config: RunConfig) -> int | None:
        """The largest power of two of points per sample whose step fits (or whole samples)."""
        whole = self.extent.train_points
        if self.held + self.step_bytes(config, whole) <= self.budget:
            return None
        per_point = self.step_bytes(config, 1)
        room = max(self.budget - self.held, 0) // max(per_point, 1)
        return max(POINTS_MIN, 2 ** int(math.log2(room))) if room >= 1 else POINTS_MIN

    def plan_evaluation(self, config: RunConfig, model: nn.Module, eval_samples: int,
                        device: torch.device) -> RunConfig:
        """``config`` with ``eval_chunk_size`` and ``loader_workers`` chosen where the user
        left them to the run (the evaluation first: automatic workers take what it leaves),
        and :attr:`hidden_on`, where a streamed evaluation keeps its hidden state; refuses a
        budget too small for a step or for the widest mesh at :data:`CHUNK_MIN` beside the
        workers the user gave."""
        # now with the data's statistics pass and the model (whose copies come next)
        self.held = max(self.held, resident_bytes()) + (PARAMETER_COPIES - 1) * sum(
            p.numel() * p.element_size() for p in model.parameters())
        given = max(config.loader_workers, 0)
        if self.extent is not None:
            self._check_step(config, given)   # again, with the model's state held
            config = self._choose_chunk(config, model, eval_samples, given)
        return self._choose_workers(config, device)

    def _workers_bytes(self, config: RunConfig, workers: int) -> int:
        points = self._train_points(config) if self.extent is not None else 0
        return self.worker_bytes(config, workers, points)

    def _choose_chunk(self, config: RunConfig, model: nn.Module, samples: int,
                      workers: int) -> RunConfig:
        room = self.budget - self.held - self._workers_bytes(config, workers)
        chunk = config.eval_chunk_size
        refusal = streaming_refusal(model)
        streams = refusal is None
        if chunk is None and self.evaluation_bytes(config, samples, None,
                                                   streams=streams) > room:
            if refusal is not None:
                self.notes.append("evaluated whole: the model cannot stream")
            else:
                chunk = next((k for k in _powers_of_two(CHUNK_MAX, CHUNK_MIN)
                              if k < self.extent.eval_points
                              and self.evaluation_bytes(config, samples, k) <= room), CHUNK_MIN)
                config = dataclasses.replace(config, eval_chunk_size=chunk)
                self.chosen["eval_chunk_size"] = chunk
        if chunk is not None and self.evaluation_bytes(config, samples, chunk) > room:
            self.hidden_on = "memmap"
            self.chosen["hidden_on"] = self.hidden_on
        need = self.evaluation_bytes(config, samples, chunk, self.hidden_on, streams=streams)
        if need > room and refusal is None:
            bounds = ["eval_chunk_size"] if chunk is not None else ["eval_chunk_size",
                                                                     "batch_size"]
            raise MemoryBudgetTooSmall(self._refusal(
                f"the evaluation of the widest mesh ({samples} x {self.extent.eval_points:,} "
                f"points{'' if chunk is None else f' in chunks of {chunk:,}'}: "
                f"{format_bytes(need)})", need, bounds, config, workers))
        self.estimate["evaluation"] = need
        return config

    def _choose_workers(self, config: RunConfig, device: torch.device) -> RunConfig:
        stage = max(self.estimate.values(), default=0)
        workers = config.workers(device.type)
        if config.loader_workers == -1:
            while workers > 0 and (self.held + stage + self._workers_bytes(config, workers)
                                   > self.budget):
                workers -= 1
            config = dataclasses.replace(config, loader_workers=workers)
            self.chosen["loader_workers"] = workers
        self.estimate["workers"] = self._workers_bytes(config, workers)
        return config

    # -- what it says --------------------------------------------------------------------
    def peak(self) -> int:
        stages = [v for k, v in self.estimate.items() if k != "workers"]
        return self.held + max(stages, default=0) + self.estimate.get("workers", 0)

    def _refusal(self, what: str, need: int, bounds: list[str], config: RunConfig,
                 workers: int) -> str:
        beside = f"the {format_bytes(self.held)} the process holds"
        if workers:
            beside += (f" and the {format_bytes(self._workers_bytes(config, workers))} of its "
                       f"{workers} loader worker{'s' if workers > 1 else ''}")
            bounds = [*bounds, "loader_workers"]
        total = self.held + self._workers_bytes(config, workers) + need
        return (f"the memory budget of {format_bytes(self.budget)} ({self.source}) is too "
                f"small for {what}: the estimate is {format_bytes(total)} with {beside}; "
                f"raise --memory-budget (memory_budget_gib) or lower {' or '.join(bounds)}")

    def return_freed_memory(self) -> None:
        """Under a budget the process gives freed memory back to the system
        (:func:`flarepp.allocator.return_freed_memory`: the allocator's reuse of a training
        step's blocks, which holds the heap at its high-water mark, is worth less than the
        room the evaluation needs); said in the plan's notes where it changed anything."""
        policy = return_freed_memory()
        if policy.detail == RETURNED:
            self.notes.append("freed memory returned to the system")

    def line(self, config: RunConfig) -> str:
        """The console line: the budget, the estimated peak, every size and its origin."""
        sizes = []
        for key, unset in (("dataset_options.points_per_step", "whole samples"),
                           ("eval_chunk_size", f"unset: a mesh whole up to {STREAM_ABOVE:,} points, "
                                              f"streamed in {STREAM_CHUNK:,} above"),
                           ("loader_workers", None)):
            section, _, name = key.rpartition(".")
            if section and not dataset_takes(config, name):
                continue
            value = (config.dataset_options if section else vars(config)).get(name)
            shown = unset if value is None else f"{value:,}" if isinstance(value, int) else value
            origin = "chosen" if key in self.chosen else "default" if value is None else "given"
            sizes.append(f"{key}={shown} ({origin})")
        if "hidden_on" in self.chosen:
            sizes.append("the streamed hidden state in a memory-mapped file")
        data = "" if self.extent is not None else "; the data is not a store: only the " \
            "loader workers are planned"
        return (f"memory budget {format_bytes(self.budget)} ({self.source}): estimated peak "
                f"{format_bytes(self.peak())}; {', '.join(sizes + self.notes)}{data}")

    def record(self) -> dict[str, Any]:
        """``memory_plan`` of ``metrics.json`` and ``provenance.json``."""
        return {"budget_bytes": self.budget, "source": self.source,
                "estimated_peak_bytes": self.peak(), "held_bytes": self.held,
                "estimate_bytes": dict(self.estimate), "chosen": dict(self.chosen),
                **({"notes": list(self.notes)} if self.notes else {})}


def _powers_of_two(high: int, low: int):
    k = high
    while k >= low:
        yield k
        k //= 2


__all__ = ["CHUNK_MAX", "CHUNK_MIN", "DataExtent", "EVAL_WIDTHS", "MemoryBudgetTooSmall",
           "MemoryPlan", "TRAIN_WIDTHS", "limit_budget", "resident_bytes"]
