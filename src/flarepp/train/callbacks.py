"""Hooks into the one trainer: what a tracker or a pruner sees of a run, how it stops one, and
the trainer's own parts that are callbacks (rank growth, thread tuning, the console).

A :class:`TrainerCallback` is handed to :class:`~flarepp.train.Trainer` (``callbacks=[...]``)
and called on the writer rank (global rank 0) alone -- or on every rank where it sets
``every_rank`` (a callback that changes what every rank computes) -- at these moments:

* ``on_setup(trainer)`` -- the trainer is built (model, optimiser, task), before a resumed
  state is restored; ``on_restore(state)`` -- a checkpoint's state is about to be loaded;
* ``on_run_start(config, run_dir, epoch)`` -- after ``config.json`` is written; ``epoch`` is
  the number of epochs already done (0 for a new run, more for a resumed one);
* ``on_epoch_start(epoch)`` -- before the epoch's first step (``epoch`` counts from 0);
  ``step()`` -- a context around every training step;
* ``on_epoch_trained(epoch, record)`` -- the epoch is trained, before its checkpoint and its
  evaluation; may add to ``record`` (its line of ``log.jsonl``);
* ``on_epoch_end(epoch, record)`` -- after the epoch's line of ``log.jsonl`` (``record`` is
  that line); returning a sentence asks the run to stop there: the trainer checkpoints the
  epoch and raises :class:`TrainingPruned` (every rank stops after the same epoch);
* ``on_run_end(metrics, figures)`` -- after ``metrics.json``: its content and the run's
  figures (drawn when the trainer is asked to plot, else none);
* ``on_run_stopped(outcome)`` -- the run ended without metrics: ``"pruned"``,
  ``"interrupted"`` (a signal; it resumes) or ``"failed"`` (an exception, re-raised);
* ``on_close()`` -- the trainer is closed (after a run or without one): give back what the
  callback changed in the process.

A callback's ``splits`` are splits it needs evaluated at every evaluation epoch besides the
task's first evaluation split (a pruner watching a validation split): their metrics join
the epoch's record and ``log.jsonl``. They are evaluated on every rank, so every rank must
be given the same callbacks. Only callbacks with ``may_stop`` can stop a run.

The trainer's own callbacks: :class:`ProgressLog` (the one owner of the console: lines,
progress bars, one line per epoch), :class:`RankGrowth` (rank-adaptive FLARE's latent
growth, :mod:`flarepp.rank_growth`) and :class:`ThreadTuning` (the CPU threads timed on the
run's steps, :mod:`flarepp.threads`, put back when the trainer closes).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, ClassVar, ContextManager, Sequence

import torch
from tqdm.auto import tqdm

from flarepp.rank_growth import LatentSchedule
from flarepp.storage.config import RunConfig
from flarepp.threads import SHARED_BY_RANKS, ThreadTuner, thread_budget

OUTCOMES = ("pruned", "interrupted", "failed")
"""How a run can end without metrics (:meth:`TrainerCallback.on_run_stopped`)."""


class TrainerCallback:
    """A hook object of the trainer; every method does nothing unless overridden."""

    splits: tuple[str, ...] = ()
    every_rank: ClassVar[bool] = False
    may_stop: ClassVar[bool] = True

    def on_setup(self, trainer: Any) -> None:
        """The trainer is built (before a resumed state is restored)."""

    def on_restore(self, state: dict[str, Any]) -> None:
        """A checkpoint's ``state`` is about to be loaded into the trainer."""

    def on_run_start(self, config: RunConfig, run_dir: Path, epoch: int) -> None:
        """The run starts (``epoch`` epochs already done)."""

    def on_epoch_start(self, epoch: int) -> None:
        """Epoch ``epoch`` (from 0) is about to be trained."""

    def step(self) -> ContextManager[None]:
        """A context around one training step."""
        return contextlib.nullcontext()

    def on_epoch_trained(self, epoch: int, record: dict[str, Any]) -> None:
        """Epoch ``epoch`` (from 1) is trained; ``record`` may be added to."""

    def on_epoch_end(self, epoch: int, record: dict[str, Any]) -> str | None:
        """An epoch ended with ``record`` (its ``log.jsonl`` line); a sentence stops the run."""
        return None

    def on_run_end(self, metrics: dict[str, Any], figures: list[Path]) -> None:
        """The run finished: ``metrics.json``'s content and the figures drawn."""

    def on_run_stopped(self, outcome: str) -> None:
        """The run ended without metrics (one of :data:`OUTCOMES`)."""

    def on_close(self) -> None:
        """The trainer is closed: give back what was changed in the process."""


class TrainingPruned(Exception):
    """A callback stopped the run after ``epoch`` (e.g. a pruner); its state is checkpointed
    in ``checkpoint`` and the run can be resumed, but the one who stopped it decides that."""

    def __init__(self, epoch: int, reason: str, checkpoint: Path) -> None:
        self.epoch, self.reason, self.checkpoint = epoch, reason, checkpoint
        super().__init__(f"stopped after epoch {epoch}: {reason}; its state is in "
                         f"{str(checkpoint)!r}")


class Callbacks:
    """The callbacks of one process, called in order: all of them on the writer rank, those
    with ``every_rank`` elsewhere (every callback's ``splits`` are kept on every rank)."""

    def __init__(self, callbacks: Sequence[TrainerCallback], *, is_writer: bool) -> None:
        given = list(callbacks)
        self.given = any(cb.may_stop for cb in given)
        self.splits = tuple(dict.fromkeys(s for cb in given for s in cb.splits))
        self.callbacks = [cb for cb in given if is_writer or cb.every_rank]
        self._stepping = [cb for cb in self.callbacks
                          if type(cb).step is not TrainerCallback.step]

    def setup(self, trainer: Any) -> None:
        for cb in self.callbacks:
            cb.on_setup(trainer)

    def restore(self, state: dict[str, Any]) -> None:
        for cb in self.callbacks:
            cb.on_restore(state)

    def run_start(self, config: RunConfig, run_dir: Path, epoch: int) -> None:
        for cb in self.callbacks:
            cb.on_run_start(config, run_dir, epoch)

    def epoch_start(self, epoch: int) -> None:
        for cb in self.callbacks:
            cb.on_epoch_start(epoch)

    def step(self) -> ContextManager[None]:
        """The callbacks' contexts around one training step (none: a null context)."""
        if len(self._stepping) == 1:
            return self._stepping[0].step()
        stack = contextlib.ExitStack()
        for cb in self._stepping:
            stack.enter_context(cb.step())
        return stack

    def epoch_trained(self, epoch: int, record: dict[str, Any]) -> None:
        for cb in self.callbacks:
            cb.on_epoch_trained(epoch, record)

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

    def close(self) -> None:
        for cb in self.callbacks:
            cb.on_close()


# ---------------------------------------------------------------------------------------------
# the trainer's own callbacks

WEIGHTS_NAME = {"raw": "raw", "ema": "EMA"}
"""How a console line names the weights of ``eval_weights``."""


class ProgressLog(TrainerCallback):
    """The one owner of a run's console output (writer rank, ``enabled`` when the run shows
    progress): lines said by the trainer and its callbacks (:meth:`say`), progress bars on a
    terminal only (:meth:`bar`: logs, CI and job schedulers get no redraws), and one line per
    epoch with its loss and the headline metric of both weights."""

    may_stop = False

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.epochs, self.eval_weights, self.key = 0, "raw", ""

    def on_setup(self, trainer: Any) -> None:
        self.epochs, self.eval_weights = trainer.config.epochs, trainer.config.eval_weights
        self.key = f"{trainer.task.eval_splits[0]}_{trainer.task.headline}"

    def say(self, line: str) -> None:
        if self.enabled:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def bar(self, iterable: Any, *, total: int, initial: int, desc: str) -> tqdm:
        """A tqdm bar over ``iterable``, drawn only on a terminal."""
        return tqdm(iterable, total=total, initial=initial, desc=desc, leave=False,
                    disable=not (self.enabled and sys.stderr.isatty()))

    def on_epoch_end(self, epoch: int, record: dict[str, Any]) -> None:
        shown = ""
        if self.key in record:
            chosen = self.eval_weights
            other = "ema" if chosen == "raw" else "raw"
            shown = (f"  {self.key.replace('_', ' ')} {record[self.key]:.4f} "
                     f"({WEIGHTS_NAME[chosen]} weights; "
                     f"{WEIGHTS_NAME[other]} {record[f'{self.key}_{other}']:.4f})")
        self.say(f"epoch {epoch:4d}/{self.epochs}  loss {record['train_loss']:.4e}{shown}")
        return None


class RankGrowth(TrainerCallback):
    """Rank-adaptive FLARE (:mod:`flarepp.rank_growth`): on every rank, the model grows to
    the latents ``schedule`` gives at the start of each epoch (the trainer's ``_grow``: model,
    optimiser state and EMA copy, keeping the function), and a resumed run first grows to
    the size its checkpoint holds; each epoch's record carries its M (``latents``)."""

    every_rank, may_stop = True, False

    def __init__(self, schedule: LatentSchedule) -> None:
        self.schedule = schedule
        self.trainer: Any = None

    def on_setup(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_restore(self, state: dict[str, Any]) -> None:
        grown = state["model_config"].get("latents")
        if grown != self.trainer.model.config.latents:
            self.trainer._grow(grown)  # the run had grown its latents: that size is stored

    def on_epoch_start(self, epoch: int) -> None:
        latents = self.schedule.latents_at(epoch)
        if latents > self.trainer.model.config.latents:
            self.trainer._grow(latents)
            self.trainer.say(f"epoch {epoch + 1}: latents grown to M = {latents}")

    def on_epoch_trained(self, epoch: int, record: dict[str, Any]) -> None:
        record["latents"] = self.schedule.latents_at(epoch - 1)


class ThreadTuning(TrainerCallback):
    """The run's CPU intra-op threads, timed on its own first steps on every rank
    (:class:`flarepp.threads.ThreadTuner`; a run of several ranks keeps the count its
    launcher gave each). Each epoch's record carries the count (``threads``), the writer
    records the choice in ``provenance.json``, and the count the process had is put back when
    the trainer closes: the choice is the run's only."""

    every_rank, may_stop = True, False

    def __init__(self) -> None:
        self.trainer: Any = None
        self.tuner: ThreadTuner | None = None
        self.recorded: Any = None

    def on_setup(self, trainer: Any) -> None:
        self.trainer = trainer

    def _tuner(self) -> ThreadTuner:
        if self.tuner is None:
            t = self.trainer
            self.tuner = ThreadTuner(
                steps=(t.config.epochs - t.epoch) * t.steps_per_epoch,
                budget=thread_budget(t.engine.workers), device=t.device, say=t.say,
                skip=SHARED_BY_RANKS if t.plan.mesh is not None else None)
        return self.tuner

    def on_run_start(self, config: RunConfig, run_dir: Path, epoch: int) -> None:
        self._tuner()

    def step(self) -> ContextManager[None]:
        return self._tuner().step()

    def on_epoch_trained(self, epoch: int, record: dict[str, Any]) -> None:
        record["threads"] = torch.get_num_threads()
        choice = self._tuner().choice
        if self.trainer.is_writer and choice not in (None, self.recorded):
            self.recorded = choice
            self.trainer.run.amend_provenance({"threads": choice.record()})

    def on_close(self) -> None:
        if self.tuner is not None:
            self.tuner.restore()


__all__ = ["Callbacks", "OUTCOMES", "ProgressLog", "RankGrowth", "ThreadTuning",
           "TrainerCallback", "TrainingPruned", "WEIGHTS_NAME"]
