"""The stages of a run and the memory they take: a failed allocation is one sentence.

A run allocates in four stages -- a training step, the data loading that feeds it, the
validation after an epoch and the end-of-run evaluation -- each bounded by options of the
run config (:data:`STAGE_BOUNDS`). Within :func:`within`, an allocation that fails
(torch's host allocator, CUDA's ``OutOfMemoryError``, numpy's ``MemoryError``:
:func:`flarepp.allocator.is_allocation_failure`) becomes
:class:`~flarepp.allocator.OutOfMemory`, whose message (:func:`memory_sentence`) names the
stage and its epoch, the bytes asked for, the options that bound the stage with their
values, and the checkpoint the run continues from with ``--resume``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from flarepp.allocator import OutOfMemory, format_bytes, is_allocation_failure, requested_bytes
from flarepp.inference.execution import STREAM_ABOVE
from flarepp.storage.config import RunConfig
from flarepp.train.checks import dataset_takes

STAGE_BOUNDS: dict[str, tuple[str, ...]] = {
    "training step": ("batch_size", "dataset_options.points_per_step"),
    "data loading": ("dataset_options.points_per_step", "batch_size", "loader_workers"),
    "validation": ("eval_chunk_size", "batch_size"),
    "end-of-run evaluation": ("eval_chunk_size", "batch_size"),
}
"""The options that bound the memory of each stage (an option of the dataset is named only
where the run's dataset takes it: ``points_per_step`` is a store's)."""

UNSET = {"eval_chunk_size": f"unset: a mesh whole up to {STREAM_ABOVE} points, streamed above",
         "dataset_options.points_per_step": "unset: every point of a sample"}


@contextlib.contextmanager
def within(sentence: Callable[[BaseException], str]) -> Iterator[None]:
    """A failed allocation inside becomes :class:`OutOfMemory` with ``sentence(error)``."""
    try:
        yield
    except Exception as err:
        if isinstance(err, OutOfMemory) or not is_allocation_failure(err):
            raise
        raise OutOfMemory(sentence(err)) from err


def each_within(items: Iterable[Any], sentence: Callable[[BaseException], str]
                ) -> Iterator[Any]:
    """``items``, each one fetched :func:`within` (the data loading of an epoch)."""
    source, end = iter(items), object()
    while True:
        with within(sentence):
            item = next(source, end)
        if item is end:
            return
        yield item


def memory_sentence(stage: str, err: BaseException, config: RunConfig, epoch: int,
                    latest: Path | None) -> str:
    """The one sentence of a failed allocation in ``stage`` (a key of :data:`STAGE_BOUNDS`)
    with ``epoch`` epochs done; ``latest`` is the checkpoint the run continues from."""
    what = {"training step": f"a training step of epoch {epoch + 1}",
            "data loading": f"the data loading of epoch {epoch + 1}",
            "validation": f"the validation after epoch {epoch}",
            "end-of-run evaluation": "the end-of-run evaluation"}[stage]
    asked = requested_bytes(err)
    size = f"an allocation of {format_bytes(asked)}" if asked else "an allocation"
    bounds = []
    for option in STAGE_BOUNDS[stage]:
        section, _, key = option.rpartition(".")
        if section and not dataset_takes(config, key):
            continue
        value = (config.dataset_options if section else vars(config)).get(key)
        bounds.append(f"{option} (now {UNSET.get(option, 'unset') if value is None else value})")
    then = (f"the run continues from {str(latest)!r} with the same command and --resume"
            if latest is not None else "no checkpoint was written yet, so the run starts again")
    return f"out of memory in {what} ({size} failed): bound it with {' or '.join(bounds)}; {then}"


__all__ = ["STAGE_BOUNDS", "each_within", "memory_sentence", "within"]
