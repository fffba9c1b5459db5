"""How a model runs, apart from what it is: the one execution setting and the one prediction
path.

Shape letters: B samples, N points, I input and O output channels, K conditioning tokens of
C features.

:class:`Execution` is one frozen setting: the device, the precision, token sharding over a
context-parallel group, streaming in chunks (with where a streamed sample's hidden state
lives and a progress bar) and the timing that chooses the CPU threads.
:func:`predict_tokens` runs a module under it, the only place that chooses between a plain
forward, block-wise streaming and a token-sharded forward with its gather (paper Appendix
B). The module is a :class:`~flarepp.models.surrogate.Surrogate` (physical units in and
out) or a bare model (its own units: a task's batches, normalised by its data pipeline);
both are called alike, ``module(x, mask=mask, conditioning=c)``.
``dataclasses.replace(execution, chunk_size=K)`` runs the same module another way.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from flarepp.device import HOST, amp_dtype, autocast
from flarepp.distributed.mesh import SINGLE, ParallelPlan
from flarepp.distributed.parallel import gather_tokens, shard_slice
from flarepp.distributed.streaming import HIDDEN_ON, stream_forward, streaming_refusal
from flarepp.tasks.base import Batch
from flarepp.threads import ThreadTuner


STREAM_ABOVE = 65536
"""Points of a sample evaluated or predicted whole when no chunk is asked for: a larger one
streams in chunks of :data:`STREAM_CHUNK`, exactly (``Execution(stream_above=...)``; the
trainer's and ``flarepp eval``'s evaluation, ``flarepp infer``, ``--write-mesh`` and
``flarepp.load``). A mesh below it is no slower whole, and its activations are small."""

STREAM_CHUNK = 16384
"""The chunk a sample above ``stream_above`` streams in: 16K points keep a pass's working
set in the CPU's caches (600K points of ``store-tiny``'s model: 23-26 s in chunks of 16K,
30 s of 8K, 33-35 s of 32K or 64K and whole, one thread)."""


@dataclass(frozen=True)
class Execution:
    """How a model runs: on ``device`` (a ``torch.device`` or its name;
    :func:`flarepp.device.resolve_device` turns ``auto`` into one), under the autocast of
    ``precision`` (``fp32``,
    ``bf16``, ``fp16``); token-sharded over the context-parallel group of ``plan`` (every
    rank runs its contiguous shard of each sample's tokens and gets all of them back; the
    model must be wrapped by :func:`~flarepp.distributed.context_parallel` on every rank);
    streamed ``chunk_size`` tokens at a time (exact), or, with ``chunk_size`` unset, only a
    sample of more than ``stream_above`` tokens, in chunks of :data:`STREAM_CHUNK` (a
    model that cannot stream then runs whole: :func:`chunk_for`); a streamed sample's
    hidden state placed by ``hidden_on`` (``auto``, ``device``, ``host``, ``memmap``, in
    ``memmap_dir``) with a ``progress`` bar (:func:`~flarepp.distributed.stream_forward`); ``threads``
    times each forward to choose the CPU threads (:mod:`flarepp.threads`)."""

    device: torch.device = HOST
    precision: str = "fp32"
    plan: ParallelPlan = SINGLE
    chunk_size: int | None = None
    stream_above: int | None = None
    hidden_on: str = "auto"
    memmap_dir: str | None = None
    progress: bool = False
    threads: ThreadTuner | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", torch.device(self.device))
        amp_dtype(self.precision)  # refuses an unknown precision, naming the known ones
        for name in ("chunk_size", "stream_above"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive number of tokens, got {value}")
        if self.hidden_on not in HIDDEN_ON:
            raise ValueError(f"hidden_on must be one of {', '.join(HIDDEN_ON)}, got "
                             f"{self.hidden_on!r}")

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The autocast of the precision on the device, the forward timed for the thread
        choice when ``threads`` is set."""
        timed = self.threads.step() if self.threads is not None else contextlib.nullcontext()
        with timed, autocast(self.precision, self.device):
            yield


@torch.no_grad()
def predict_tokens(module: nn.Module, batch: Batch, execution: Execution) -> torch.Tensor:
    """The one prediction path: ``module``'s output ``[B, N, O]`` for every token of
    ``batch`` under ``execution``.

    ``batch`` holds ``x [B, N, I]``, optionally ``mask [B, N]`` (True at real points) and
    ``conditioning [B, K, C]``, every token of each sample, on the host or the device.
    Plain, they move to the device and run as ``module(x, mask=, conditioning=)``;
    streamed (:func:`chunk_for`), the tokens pass through the device in chunks whose
    encoder partials merge by the log-sum-exp rule (a model with conditioning tokens
    streams where its scheme is exact, :func:`~flarepp.distributed.streaming_refusal`);
    token-sharded, each rank runs its contiguous shard and every rank returns the gathered
    output. Every way computes ``module(x, mask)``.
    """
    x, mask, conditioning = batch["x"], batch.get("mask"), batch.get("conditioning")
    plan = execution.plan
    if plan.cp_group is not None:
        part = shard_slice(x.shape[1], plan.cp_rank, plan.cp_size)
        x, mask = x[:, part], None if mask is None else mask[:, part]
    with execution.running():
        y = _forward(module, x, mask, conditioning, execution)
    if plan.cp_group is not None:
        y = gather_tokens(y.to(execution.device).contiguous(), plan.cp_group)
    return y


def _forward(module: nn.Module, x: torch.Tensor, mask: torch.Tensor | None,
             conditioning: torch.Tensor | None, execution: Execution) -> torch.Tensor:
    """This rank's tokens through ``module``, plain or streamed."""
    device = execution.device
    chunk = chunk_for(module, x.shape[1], conditioning, execution)
    if chunk is not None:
        extra = {} if conditioning is None else {"conditioning": conditioning.to(device)}
        return stream_forward(module, x, mask, chunk_size=chunk, device=device,
                              group=execution.plan.cp_group, hidden_on=execution.hidden_on,
                              memmap_dir=execution.memmap_dir, progress=execution.progress,
                              **extra)
    extra = {} if conditioning is None else {"conditioning": conditioning.to(device)}
    return module(x.to(device), mask=None if mask is None else mask.to(device), **extra)


def chunk_for(module: nn.Module, tokens: int, conditioning: torch.Tensor | None,
              execution: Execution) -> int | None:
    """The chunk ``predict_tokens`` streams ``tokens`` tokens of ``module`` in, or None for a
    plain forward: ``execution.chunk_size`` when set; else :data:`STREAM_CHUNK` (at most
    ``stream_above``) for a sample larger than ``stream_above`` whose model can stream
    (:func:`~flarepp.distributed.streaming_refusal`, with its ``conditioning`` tokens where
    it has them)."""
    if execution.chunk_size is not None:
        return execution.chunk_size
    above = execution.stream_above
    if above is None or tokens <= above or streaming_refusal(
            module, conditioned=conditioning is not None) is not None:
        return None
    return min(above, STREAM_CHUNK)


__all__ = ["STREAM_ABOVE", "STREAM_CHUNK", "Execution", "chunk_for", "predict_tokens"]
