"""Hooks into the one trainer: what a tracker or a pruner sees of a run, and how it stops one.

A :class:`TrainerCallback` is handed to :class:`~flarepp.train.Trainer` (``callbacks=[...]``)
and called on the writer rank (global rank 0) alone, at four moments of
:meth:`~flarepp.train.Trainer.fit`:

* ``on_run_start(config, run_dir, epoch)`` -- after ``config.json`` is written; ``epoch`` is
  the number of epochs already done (0 for a new run, more for a resumed one);
* ``on_epoch_end(epoch, record)`` -- after the epoch's line of ``log.jsonl`` (``record`` is
  that line); returning a sentence asks the run to stop there: the trainer checkpoints the
  epoch and raises :class:`TrainingPruned` (every rank stops after the same epoch);
* ``on_run_end(metrics, figures)`` -- after ``metrics.json``: its content and the run's
  figures (drawn when the trainer is asked to plot, else none);
* ``on_run_stopped(outcome)`` -- the run ended without metrics: ``"pruned"``,
  ``"interrupted"`` (a signal; it resumes) or ``"failed"`` (an exception, re-raised).

A callback's ``splits`` are splits it needs evaluated at every evaluation epoch besides the
task's first evaluation split (a pruner watching a validation split): their metrics join
the epoch's record and ``log.jsonl``. They are evaluated on every rank, so every rank must
be given the same callbacks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from flarepp.storage.config import RunConfig

OUTCOMES = ("pruned", "interrupted", "failed")
"""How a run can end without metrics (:meth:`TrainerCallback.on_run_stopped`)."""


class TrainerCallback:
    """A hook object of the trainer; every method does nothing unless overridden."""

    splits: tuple[str, ...] = ()

    def on_run_start(self, config: RunConfig, run_dir: Path, epoch: int) -> None:
        """The run starts (``epoch`` epochs already done)."""

    def on_epoch_end(self, epoch: int, record: dict[str, Any]) -> str | None:
        """An epoch ended with ``record`` (its ``log.jsonl`` line); a sentence stops the run."""
        return None

    def on_run_end(self, metrics: dict[str, Any], figures: list[Path]) -> None:
        """The run finished: ``metrics.json``'s content and the figures drawn."""

    def on_run_stopped(self, outcome: str) -> None:
        """The run ended without metrics (one of :data:`OUTCOMES`)."""


class TrainingPruned(Exception):
    """A callback stopped the run after ``epoch`` (e.g. a pruner); its state is checkpointed
    in ``checkpoint`` and the run can be resumed, but the one who stopped it decides that."""

    def __init__(self, epoch: int, reason: str, checkpoint: Path) -> None:
        self.epoch, self.reason, self.checkpoint = epoch, reason, checkpoint
        super().__init__(f"stopped after epoch {epoch}: {reason}; its state is in "
                         f"{str(checkpoint)!r}")


class Callbacks:
    """The callbacks of one process, called in order: all of them on the writer rank, none
    elsewhere (their ``splits`` are kept on every rank)."""

    def __init__(self, callbacks: Sequence[TrainerCallback], *, is_writer: bool) -> None:
        given = list(callbacks)
        self.given = bool(given)
        self.splits = tuple(dict.fromkeys(s for cb in given for s in cb.splits))
        self.callbacks = given if is_writer else []

    def run_start(self, config: RunConfig, run_dir: Path, epoch: int) -> None:
        for cb in self.callbacks:
            cb.on_run_start(config, run_dir, epoch)

    def epoch_end(self, epoch: int, record: dict[str, Any]) -> str | None:
        """The first sentence of a callback that asks the run to stop (all are called)."""
        reasons = [cb.on_epoch_end(epoch, record) for cb in self.callbacks]
        return next((r for r in reasons if r), None)

    def run_end(self, metrics: dict[str, Any], figures: list[Path]) -> None:
        for cb in self.callbacks:
            cb.on_run_end(metrics, figures)

    def run_stopped(self, outcome: str) -> None:
        for cb in self.callbacks:
            cb.on_run_stopped(outcome)


__all__ = ["Callbacks", "OUTCOMES", "TrainerCallback", "TrainingPruned"]
