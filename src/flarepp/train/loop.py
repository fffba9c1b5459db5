"""The one training loop, for every task (paper Tables 7-8, C.2; the FLARE study's protocol).

AdamW, a one-cycle schedule stepped per batch, gradient clipping, an EMA of the weights,
FP32 by default or bf16/fp16 autocast on the run's device (with a gradient scaler for
fp16). Every evaluation scores both the raw (trained) weights and the EMA copy, and the
log, ``metrics.json`` and the figures carry both; ``eval_weights`` names the headline (raw,
as the FLARE study reports: :mod:`flarepp.inference.evaluate`), and the final predictions
are the headline weights'. What is learned, and how it is measured, comes from a
:class:`flarepp.tasks.Task`; this module owns the device, the precision, the parallel
layout, the optimiser state and the order of a run. Its checkpoints are the
:class:`~flarepp.train.checkpoint.CheckpointManager`'s; the console, rank growth and
thread tuning are callbacks (:mod:`flarepp.train.callbacks`); the config is checked once,
by :func:`~flarepp.train.checks.validate`, when the trainer is made.

Nothing is lost at the end of an epoch: its checkpoint (when one is due) is written before
any evaluation, holding the epoch's record as not yet evaluated; a resumed run evaluates it
again and does not train the epoch again. A failed allocation in any stage (a training
step, data loading, the validation, the end-of-run evaluation) is one sentence
(:mod:`flarepp.train.stages`) naming the stage, the bytes asked for and the option that
bounds the stage, and the run continues from its last checkpoint.

Parallelism (:mod:`flarepp.distributed.mesh`): data-parallel ranks each take a share of
every global batch (``batch_size`` samples, the preset's) and ``DistributedDataParallel``
averages their gradients; context-parallel ranks split the tokens of the same samples and
sum their gradients (Appendix B). The loss of a step is the task's loss summed over the
global batch divided by its global count, so any layout gives the single-process step.
Global rank 0 alone writes files and calls the run's callbacks (trackers, a search's pruner:
:mod:`flarepp.train.callbacks`), except those that change what every rank computes.

Reproducibility: seeded; on the CPU in FP32 a resumed run is bitwise identical to an
uninterrupted one (model, optimizer, scheduler, EMA, scaler and the RNG states are
checkpointed). A checkpoint loads on any device (a GPU run resumes on a CPU machine and
the other way round); the CUDA RNG state is restored where CUDA is used again.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections import ChainMap
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from flarepp.data import DatasetSplits
from flarepp.data.fingerprint import check_same_data
from flarepp.device import grad_scaler, resolve_device, use_device
from flarepp.distributed import all_reduce_gradients, context_parallel
from flarepp.distributed.mesh import SINGLE, ParallelPlan
from flarepp.inference.batching import (epoch_keys, global_batches, make_loader,
                                        steps_per_epoch, to_device_prefetched)
from flarepp.inference.engine import Engine, KeptPredictions
from flarepp.inference.execution import STREAM_ABOVE, Execution
from flarepp.inference.evaluate import (evaluate_weights, final_eval_record, final_eval_sets,
                                        weight_metrics)
from flarepp.models.backbone import compile_model
from flarepp.rank_growth import grow_latents
from flarepp.storage.checkpoint import CheckpointError
from flarepp.storage.config import RunConfig
from flarepp.storage.rundir import RunDir, RunLock, provenance
from flarepp.tasks import Task, build_task
from flarepp.train.callbacks import (Callbacks, ProgressLog, RankGrowth, ThreadTuning,
                                     TrainerCallback, TrainingPruned)
from flarepp.train.budget import MemoryPlan
from flarepp.train.checkpoint import CheckpointManager, RNGState
from flarepp.train.checks import validate
from flarepp.train.ema import WeightAverage
from flarepp.train.optim import build_optimizer, build_scheduler, write_param_groups
from flarepp.train.stages import each_within, memory_sentence, within


HOST_SYNC_EVERY = 16
"""Training steps between the host's looks at the device (and, with several ranks, the
collectives that serve only bookkeeping): the step losses (progress bar, the non-finite
check), and on several ranks the all-reduce of the stop flag. Every step in between is
queued without waiting for the device; a single process still stops right after the step
in which a signal arrived (its flag is a host variable)."""

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2")
                     if hasattr(signal, name))
"""Signals that stop training after the current step with a checkpoint: Ctrl-C, SIGTERM, and
the user signals a scheduler sends before a time limit or preemption (SLURM's ``--signal``;
submitit's is SIGUSR2)."""

INIT_NORMALIZERS = ("keep", "refit")
"""``--init-normalizers``: a fine-tuned run keeps its source's normalisers or refits them."""

class TrainingInterrupted(Exception):
    """SIGINT or SIGTERM stopped training after a step; a checkpoint to resume from exists.

    ``exit_code`` is the shell's convention for the signal (130 for SIGINT, 143 for SIGTERM).
    """

    def __init__(self, signum: int, checkpoint: Path | None, out_dir: Path) -> None:
        self.signum, self.checkpoint, self.out_dir = signum, checkpoint, out_dir
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        where = (f"; its state is in {str(checkpoint)!r}" if checkpoint is not None
                 else "")
        super().__init__(f"training stopped by {name}{where}; continue with the same "
                         f"command and --resume --out {out_dir}")


def epoch_seed(seed: int, epoch: int) -> int:
    """Base seed of an epoch's per-sample random draws (not taken from any RNG stream)."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


class TrainState:
    """The trainer's own part of its checkpoints, stored at their top level: the run config
    and the model's, the task and its data (field names, fingerprint), the epochs done and
    their records (``history``), the run a fine-tuning started from (``init_from``), the
    position inside an interrupted epoch (``epoch_progress``) and an epoch trained but not
    yet evaluated (``epoch_record``). Loading it refuses other data and grows the model to
    the size the checkpoint holds (through the callbacks' ``on_restore``)."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        state = {"config": t.config.to_dict(), "model_config": t.model.config.to_dict(),
                 "epoch": t.epoch, "history": t.history, "task": t.config.task,
                 "data": {**t.task.describe_data(), "identity": t.task.data_identity()}}
        for key, value in (("init_from", t.init_record), ("epoch_progress", t._position),
                           ("epoch_record", t._pending)):
            if value:
                state[key] = value
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        t = self.trainer
        identity = state.get("data", {}).get("identity")
        if identity:
            check_same_data(identity, t.task.data_identity())
        t.hooks.restore(state)
        t.epoch, t.history = int(state["epoch"]), list(state["history"])
        t.init_record = state.get("init_from")
        t._resume_progress = state.get("epoch_progress")
        t._pending = state.get("epoch_record")


class Trainer:
    """One run: task, model, optimiser state on a device; ``fit()`` runs it to the end.

    ``config`` is validated here (:func:`~flarepp.train.checks.validate`). ``parallel`` is
    the process's place in the ``("dp", "cp")`` mesh (default: one process); ``device``
    overrides ``config.device``; ``task`` a prebuilt task (e.g. data shared by several
    runs), ``splits`` preloaded data for the default task. ``init_from`` (fine-tuning): a
    run directory or checkpoint whose weights (those it reports) start this run, with a new
    optimiser on this run's data; ``init_normalizers`` ``keep`` takes its normalisers too,
    ``refit`` fits them on this run's data. It is recorded in the checkpoints,
    ``metrics.json`` and ``provenance.json``. ``callbacks`` are called on the writer rank
    (:mod:`flarepp.train.callbacks`) after the trainer's own; ``plot`` draws the run's
    figures at its end (``plot_cases`` cases), which ``on_run_end`` receives.
    """

    def __init__(self, config: RunConfig, out_dir: str | Path, *,
                 data_root: str | Path | None = None, resume: bool = False,
                 progress: bool = True, splits: DatasetSplits | None = None,
                 task: Task | None = None, parallel: ParallelPlan = SINGLE,
                 device: str | torch.device | None = None,
                 init_from: str | Path | None = None, init_normalizers: str = "keep",
                 callbacks: Sequence[TrainerCallback] = (), plot: bool = False) -> None:
        if init_normalizers not in INIT_NORMALIZERS:
            raise ValueError(f"init_normalizers must be one of {', '.join(INIT_NORMALIZERS)}, "
                             f"got {init_normalizers!r}")
        self.config = c = validate(config)
        self.out_dir = Path(out_dir)
        self.run = RunDir(self.out_dir)
        self.plan = parallel
        self.is_writer = parallel.is_writer
        self.log = ProgressLog(progress and self.is_writer)
        schedule = c.schedule()
        self.hooks = Callbacks([self.log, *([RankGrowth(schedule)] if schedule else []),
                                ThreadTuning(), *callbacks], is_writer=self.is_writer)
        self.plot = plot
        self.device = resolve_device(device if device is not None else c.device)
        use_device(self.device)
        # The writer holds the run directory for the run's life: a second process on the
        # same --out fails here, before any work, naming the holder.
        self.lock = RunLock(self.out_dir).acquire() if self.is_writer else None
        try:
            self._setup(resume, data_root, splits, task, init_from, init_normalizers)
        except BaseException:
            self.close()
            raise

    def say(self, line: str) -> None:
        """A line on the run's console (:class:`~flarepp.train.callbacks.ProgressLog`)."""
        self.log.say(line)

    def _setup(self, resume: bool, data_root, splits, task, init_from, init_normalizers
               ) -> None:
        c = self.config
        found = CheckpointManager.find(self.run, resume=resume, writer=self.is_writer,
                                       say=self.say)
        if init_from is not None and found is not None:
            raise ValueError("--init-from starts a new run from another run's weights; "
                             f"{str(self.out_dir)!r} is resumed from its own checkpoint")
        self.memory = MemoryPlan.discover(c, data_root or c.data_root)
        if self.memory is not None:  # points_per_step is the data's: chosen before it is read
            self.memory.return_freed_memory()
            stored = None if found is None else RunConfig.from_stored(found.state["config"])
            self.config = c = self.memory.plan_training(c, stored,
                                                        choose=task is None and splits is None)
        if task is None:
            task = build_task(c, data_root or c.data_root,
                              **({} if splits is None else {"splits": splits}))
        self.task = task
        torch.manual_seed(c.seed)
        self.model = task.build_model().to(self.device)
        hidden_on = "auto"
        if self.memory is not None:
            self.config = c = self.memory.plan_evaluation(c, self.model, task.eval_batch_size(),
                                                          self.device)
            hidden_on = self.memory.hidden_on
            self.say(self.memory.line(c))
        self.engine = Engine(task, Execution(self.device, c.precision, plan=self.plan,
                                             chunk_size=c.eval_chunk_size,
                                             stream_above=STREAM_ABOVE, hidden_on=hidden_on),
                             workers=c.workers(self.device.type))
        self.init_record = None if init_from is None else CheckpointManager.start_from(
            Path(init_from), self.model, task if init_normalizers == "keep" else None, c.task)
        self.ema = WeightAverage(self.model, c.ema_decay)
        self._wrap()
        self.optimizer = build_optimizer(self.model, c)
        self.n_train = task.num_samples("train")
        self.steps_per_epoch = steps_per_epoch(self.n_train, c.batch_size)
        self.scheduler = build_scheduler(self.optimizer, c, c.epochs * self.steps_per_epoch)
        self.scaler = grad_scaler(c.precision, self.device)
        self.shuffle = torch.Generator().manual_seed(c.seed)
        self.epoch, self.history, self.step_losses = 0, [], []
        self._resume_progress: dict[str, Any] | None = None
        self._position: dict[str, Any] | None = None   # where an interrupted epoch stopped
        self._pending: dict[str, Any] | None = None    # an epoch trained, not yet evaluated
        self._stop_signal: int | None = None
        self.checkpoints = self.checkpoint_manager()
        self.hooks.setup(self)
        if found is not None:
            self.checkpoints.restore(found)

    def checkpoint_manager(self) -> CheckpointManager:
        """The owner of the run's checkpoints, built with the states the trainer holds."""
        task = self.task
        states = {"model": self.model, "ema": self.ema.module, "ema_state": self.ema,
                  "optimizer": self.optimizer, "scheduler": self.scheduler,
                  "scaler": self.scaler, "rng": RNGState(self.shuffle, self.device),
                  "normalizers": task}
        return CheckpointManager(self.run, states, header=TrainState(self), config=self.config,
                                 keep=self.config.keep_checkpoints,
                                 best=(f"{task.eval_splits[0]}_{task.headline}",
                                       task.lower_is_better),
                                 writer=self.is_writer, lease=self.lock)

    def _wrap(self) -> None:
        """Compile, token-shard and data-parallel-wrap the model (again after it grew)."""
        c, parallel = self.config, self.plan
        if c.compile:
            compile_model(self.model)
        if parallel.cp_group is not None:
            context_parallel(self.model, parallel.cp_group)
            context_parallel(self.ema.module, parallel.cp_group)
        self.train_model: torch.nn.Module = self.model
        if parallel.dp_group is not None:
            self.train_model = torch.nn.parallel.DistributedDataParallel(
                self.model, process_group=parallel.dp_group,
                device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def _grow(self, latents: int) -> None:
        """Grow the model, its optimiser state and the EMA copy to ``latents`` latents,
        keeping the function (:func:`flarepp.rank_growth.grow_latents`; when is the
        :class:`~flarepp.train.callbacks.RankGrowth` callback's choice)."""
        grow_latents(self.model, latents, self.optimizer)
        grow_latents(self.ema.module, latents)
        self._wrap()

    def close(self) -> None:
        """Give back what the run changed in the process (its callbacks' ``on_close``: the
        CPU threads) and release the run directory (idempotent)."""
        self.hooks.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def state(self) -> dict[str, Any]:
        """The checkpoint of now (:meth:`CheckpointManager.state`)."""
        return self.checkpoints.state()

    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # -- one step ------------------------------------------------------------------------
    def _global_count(self, micro: list[dict], weight: float) -> torch.Tensor:
        """The loss normaliser of the whole global batch (all micro-batches and dp ranks)."""
        count = sum(self.task.loss_count(b, self.engine.token_sum) for b in micro)
        if weight != 1.0:
            count = count * weight
        if self.plan.dp_group is not None:
            count = count.float().clone()
            dist.all_reduce(count, group=self.plan.dp_group)
        return count

    def train_step(self, micro: list[dict], weight: float) -> torch.Tensor:
        """Forward and backward of one global batch (this rank's micro-batches), one
        optimiser step; returns this rank's share of the global batch's loss, a detached
        device tensor (no host sync; :meth:`_flush_losses` sums the shares over the data
        parallel ranks and reads them, every :data:`HOST_SYNC_EVERY` steps)."""
        c, plan = self.config, self.plan
        micro = [self.engine.shard(batch) for batch in micro]
        count = self._global_count(micro, weight)
        # DDP averages gradients over dp ranks; a context-parallel loss is replicated on
        # the cp ranks, whose gradients are summed: both undone by one factor.
        factor = plan.dp_size / plan.cp_size
        self.optimizer.zero_grad(set_to_none=True)
        total = None
        for j, batch in enumerate(micro):
            sync = (self.train_model.no_sync() if plan.dp_group is not None
                    and j < len(micro) - 1 else contextlib.nullcontext())
            with sync:
                pred = self.engine.forward(self.train_model, batch)
                part = self.task.loss(pred, batch, self.engine.token_sum)
                if weight != 1.0:
                    part = part * weight
                loss = part / count
                self.scaler.scale(loss if factor == 1 else loss * factor).backward()
            total = loss.detach() if total is None else total + loss.detach()
        if plan.cp_group is not None:
            all_reduce_gradients(self.model, plan.cp_group)  # the unsharded gradient
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.ema.update_parameters(self.model)
        return total

    def _flush_losses(self, pending: list[torch.Tensor], bar) -> None:
        """Read the queued step losses (one host sync; one all-reduce over the data
        parallel ranks, which flush at the same steps) into ``self.step_losses``."""
        if not pending:
            return
        shares = torch.stack([t.float() for t in pending])
        if self.plan.dp_group is not None:
            dist.all_reduce(shares, group=self.plan.dp_group)
        values = shares.tolist()
        pending.clear()
        for value in values:
            self.step_losses.append(value)
            if not np.isfinite(value):
                raise FloatingPointError(
                    f"loss became {value} at epoch {self.epoch + 1}, step "
                    f"{len(self.step_losses)}; try --precision fp32 or a lower lr")
        bar.set_postfix(loss=f"{values[-1]:.3e}")

    def train_epoch(self) -> float:
        """One pass over the training split (the rest of it after a mid-epoch resume).

        Raises :class:`TrainingInterrupted` after the current step when SIGINT or SIGTERM
        arrived, having written a checkpoint from which the epoch resumes exactly.
        """
        c, plan = self.config, self.plan
        self.train_model.train()
        progress, self._resume_progress = self._resume_progress, None
        if progress is not None:  # the same order as the interrupted epoch's
            self.shuffle.set_state(progress["shuffle"])
        epoch_start_shuffle = self.shuffle.get_state()
        order = torch.randperm(self.n_train, generator=self.shuffle).numpy()
        keys = epoch_keys(order, c.batch_size, plan.dp_rank, plan.dp_size,
                          epoch_seed(c.seed, self.epoch))
        sizes = [len(b) for b in global_batches(order, c.batch_size)]
        done = 0 if progress is None else int(progress["step"])
        self.step_losses = [] if progress is None else list(progress["losses"])
        self._epoch_seconds = 0.0 if progress is None else float(progress["seconds"])
        started = time.perf_counter()
        loader = make_loader(self.task, "train", keys[done:], training=True,
                             workers=self.engine.workers,
                             pin_memory=self.device.type == "cuda")
        bar = self.log.bar(to_device_prefetched(loader, self.device), total=len(keys),
                           initial=done, desc=f"epoch {self.epoch + 1}/{c.epochs}")
        pending: list[torch.Tensor] = []
        for micro, weight in each_within(bar, self._out_of_memory("data loading")):
            with self._stage("training step"), self.hooks.step():
                pending.append(self.train_step(micro, weight))
            step = len(self.step_losses) + len(pending)
            at_sync = step % HOST_SYNC_EVERY == 0
            if at_sync:
                self._flush_losses(pending, bar)
            if step < len(keys) and self._stop_requested(collective=at_sync):
                self._flush_losses(pending, bar)
                bar.close()
                seconds = self._epoch_seconds + time.perf_counter() - started
                self._interrupt({"step": len(self.step_losses), "shuffle": epoch_start_shuffle,
                                 "losses": self.step_losses, "seconds": seconds})
        self._flush_losses(pending, bar)
        self._epoch_seconds += time.perf_counter() - started
        return sum(loss * n for loss, n in zip(self.step_losses, sizes)) / max(sum(sizes), 1)

    # -- failed allocations --------------------------------------------------------------
    def _stage(self, stage: str) -> contextlib.AbstractContextManager[None]:
        """Within: a failed allocation is one sentence naming ``stage`` and its epoch, the
        bytes asked for, the options that bound it and the checkpoint the run continues
        from (:mod:`flarepp.train.stages`)."""
        return within(self._out_of_memory(stage))

    def _out_of_memory(self, stage: str) -> Callable[[BaseException], str]:
        return lambda err: memory_sentence(stage, err, self.config, self.epoch,
                                           self.checkpoints.latest())

    # -- signals -------------------------------------------------------------------------
    @contextlib.contextmanager
    def stop_on_signals(self):
        """While active, the :data:`STOP_SIGNALS` ask training to stop after the current step
        (a second signal acts at once, as it would without this)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {}

        def request_stop(signum, frame):
            self._stop_signal = signum
            signal.signal(signum, previous[signum])

        for sig in STOP_SIGNALS:
            previous[sig] = signal.signal(sig, request_stop)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop_requested(self, collective: bool = True) -> bool:
        """Whether any rank was signalled (every rank stops after the same step).

        With several ranks the flags are all-reduced, a collective and a host sync, so
        only where ``collective`` (every :data:`HOST_SYNC_EVERY` steps and between epochs:
        the same steps on every rank); otherwise no rank stops here."""
        flag = 0 if self._stop_signal is None else self._stop_signal
        if self.plan.mesh is not None:
            if not collective:
                return False
            t = torch.full((1,), flag, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = int(t.item())
            self._stop_signal = flag or None
        return flag != 0

    def _interrupt(self, progress: dict[str, Any] | None) -> None:
        """Write the state to resume from (mid-epoch when ``progress``) and stop."""
        self._position = progress
        try:
            path = self.checkpoints.save(None if progress is None else progress["step"])
        finally:
            self._position = None
        raise TrainingInterrupted(self._stop_signal or signal.SIGINT, path, self.out_dir)

    def weights(self, name: str) -> torch.nn.Module:
        """The raw (trained) weights' model, or the EMA copy's (``"raw"`` / ``"ema"``)."""
        return {"raw": self.model, "ema": self.ema.module}[name]

    def evaluate(self, split: str, *, indices: np.ndarray | None = None,
                 keep: KeptPredictions | None = None) -> dict[str, dict[str, Any]]:
        """The task's metrics of ``split`` (its samples ``indices``, default every one; with
        its ``_records``) for the raw weights and the EMA copy, ``{"raw": ..., "ema":
        ...}``, both run on each sample in one pass; with ``ema_decay`` 0 the copy is the
        weights, evaluated once. ``keep``: predictions kept from the pass
        (:meth:`~flarepp.inference.engine.Engine.evaluate`)."""
        results = evaluate_weights(self.engine, split, self.task.eval_batch_size(),
                                   {w: self.weights(w) for w in ("raw", "ema")},
                                   same=self.config.ema_decay == 0, indices=indices,
                                   keep=keep)
        return {w: {**metrics, "_records": records}
                for w, (metrics, records) in results.items()}

    # -- the run -------------------------------------------------------------------------
    def fit(self, stop_after: int | None = None) -> dict[str, Any] | None:
        """Train to ``config.epochs``; ``stop_after`` ends early after that many epochs of
        this call (the run can be resumed). Returns the final metrics, or None if stopped."""
        try:
            with self.stop_on_signals():
                return self._fit(stop_after)
        except BaseException as err:
            self.hooks.run_stopped(
                "pruned" if isinstance(err, TrainingPruned) else "interrupted"
                if isinstance(err, (TrainingInterrupted, KeyboardInterrupt)) else "failed")
            raise
        finally:
            self.close()

    def _fit(self, stop_after: int | None) -> dict[str, Any] | None:
        self._start_run()
        if self._pending is not None:  # resumed before the evaluation of its last epoch
            self._end_epoch(self._pending, stopping=False, saved=True)
        done_now = 0
        while self.epoch < self.config.epochs:
            self.hooks.epoch_start(self.epoch)
            loss = self.train_epoch()
            self.epoch += 1
            done_now += 1
            record = {"epoch": self.epoch, "train_loss": loss,
                      "lr": self.scheduler.get_last_lr()[0], "seconds": self._epoch_seconds,
                      "step_losses": list(self.step_losses)}
            self.hooks.epoch_trained(self.epoch, record)
            if self._end_epoch(record, stopping=stop_after is not None
                               and done_now >= stop_after):
                return None
        return self.finish()

    def _start_run(self) -> None:
        """The run's files as it starts (or resumes), then the callbacks' ``on_run_start``."""
        if self.is_writer:
            self.run.write_config(self.config)
            write_param_groups(self.out_dir, self.model, self.optimizer)
            self.run.rewrite_log(self.history)
            self.run.record_provenance(provenance(
                [self.device], parallel=self.plan.describe(), resumed_at_epoch=self.epoch,
                **({"init_from": self.init_record} if self.init_record else {}),
                **({"memory_plan": self.memory.record()} if self.memory else {})))
        self.hooks.run_start(self.config, self.out_dir, self.epoch)

    def _end_epoch(self, record: dict[str, Any], *, stopping: bool, saved: bool = False
                   ) -> bool:
        """An epoch's end, in the order that loses nothing: its checkpoint when one is due,
        before any evaluation (holding ``record`` as not yet evaluated, unless ``saved``
        already); the evaluation; the log line and the callbacks; the checkpoint again,
        complete, where no later one will supersede it (the run stops, is pruned or ends
        here). Returns whether the run stops now (``stopping``, before its last epoch)."""
        c = self.config
        last = self.epoch == c.epochs
        evaluated = self.epoch % c.eval_every == 0 or last
        due = self.epoch % c.checkpoint_every == 0 or last or stopping
        if due and not saved:
            self._save(pending=record if evaluated else None)
        if evaluated:
            with self._stage("validation"):
                record.update(self._evaluate_epoch())
        self.history.append(record)
        self._append_log(record)
        pruned = self._callback_stop(record)
        if pruned or (evaluated and (due or saved) and (stopping or last)):
            self._save()
        if pruned:
            raise TrainingPruned(self.epoch, pruned, self.checkpoints.path(self.epoch))
        if not last and self._stop_requested():
            self._interrupt(None)  # between epochs: the checkpoint is the epoch's
        return stopping and not last

    def _save(self, pending: dict[str, Any] | None = None) -> Path:
        """The epoch's checkpoint; ``pending``: its record, not yet evaluated."""
        self._pending = pending
        try:
            return self.checkpoints.save()
        finally:
            self._pending = None

    def _evaluate_epoch(self) -> dict[str, Any]:
        """The headline metrics of the first evaluation split and of those the callbacks
        ask for, both weights (:func:`weight_metrics`)."""
        c, task = self.config, self.task
        metrics: dict[str, Any] = {}
        for name in dict.fromkeys((task.eval_splits[0], *self.hooks.splits)):
            metrics.update(weight_metrics(name, task.headline, self.evaluate(name),
                                          c.eval_weights, task.reported))
        return {**metrics, "eval_weights": c.eval_weights}

    def _append_log(self, record: dict[str, Any]) -> None:
        """The epoch's line of ``log.jsonl``, written only while the run's lease is still
        this process's (:meth:`flarepp.storage.locks.Lease.verify`)."""
        if self.is_writer:
            self.lock.verify()
            self.run.append_log(record)

    def _callback_stop(self, record: dict[str, Any]) -> str | None:
        """Whether a callback asks to stop after this epoch (its sentence); with several
        ranks the writer's answer reaches every rank (one all-reduce, only where callbacks
        were given)."""
        reason = self.hooks.epoch_end(self.epoch, record)
        if self.plan.mesh is not None and self.hooks.given:
            flag = torch.full((1,), float(reason is not None), device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and reason is None:
                reason = "a callback of the writer rank stopped the run"
        return reason

    def finish(self) -> dict[str, Any]:
        """The end-of-run evaluation (both weights in one pass over each split): the test
        split and the other evaluation splits whole, the training samples
        ``final_eval_train`` chooses (said on the console, recorded in ``metrics.json``);
        then the cases the task draws, its output files from the predictions kept from
        that pass, ``metrics.json``, the figures; returns the metrics."""
        task, chosen = self.task, self.config.eval_weights
        headline, split = task.headline, task.eval_splits[0]
        sets = final_eval_sets(task, self.config.final_eval_train, task.eval_splits)
        self.say("end-of-run evaluation: " + "; ".join(which for _, which in sets.values()))
        directory = self.out_dir if self.is_writer else None
        with self._stage("end-of-run evaluation"), KeptPredictions(
                task.predictions_to_keep(split), chosen, directory=directory) as kept:
            results = {name: self.evaluate(name, indices=indices,
                                           keep=kept if name == split else None)
                       for name, (indices, _) in sets.items()
                       if indices is None or len(indices)}
            records = results[split][chosen]["_records"]
            cases = task.cases_to_predict(split, records)  # predicted on every rank
            predictions = ChainMap(self.engine.predict_cases(self.weights(chosen), split,
                                                             cases) if cases else {}, kept)
            metrics: dict[str, Any] = {}
            for name, by_weights in results.items():
                metrics.update(weight_metrics(name, headline, by_weights, chosen,
                                              task.reported))
            if "train" in sets:
                metrics["final_eval_train"] = final_eval_record(
                    self.config.final_eval_train, *sets["train"], task.num_samples("train"))
            metrics.update(task.baseline_metrics())
            metrics.update(self._run_facts())
            if self.is_writer:
                task.write_outputs(self.out_dir, split, records,
                                   **({"predictions": predictions} if predictions else {}))
        if self.is_writer:
            self.run.write_metrics(metrics)
            figures = task.plot_run(self.out_dir, self.config.plot_cases) if self.plot else []
            self.hooks.run_end(metrics, figures)
        return metrics

    def _run_facts(self) -> dict[str, Any]:
        """What ``metrics.json`` says of the run beside its metrics."""
        c = self.config
        return {"eval_weights": c.eval_weights, "epochs": self.epoch,
                "params": self.n_params(),
                "seconds": float(sum(r["seconds"] for r in self.history)),
                "preset": c.name, "dataset": c.dataset, "task": c.task,
                "mixer": c.model.get("mixer"), "precision": c.precision, "seed": c.seed,
                "device": str(self.device), "parallel": self.plan.describe(),
                "checkpoint": str(self.checkpoints.path(self.epoch)),
                **({"init_from": self.init_record} if self.init_record else {}),
                **({"memory_plan": self.memory.record()} if self.memory else {})}


def train(config: RunConfig, out_dir: str | Path, *, data_root: str | Path | None = None,
          resume: bool = False, progress: bool = True, stop_after: int | None = None,
          parallel: ParallelPlan = SINGLE, device: str | torch.device | None = None,
          init_from: str | Path | None = None, init_normalizers: str = "keep",
          callbacks: Sequence[TrainerCallback] = ()) -> dict[str, Any] | None:
    """Train ``config`` into ``out_dir``; returns ``metrics.json``'s content."""
    trainer = Trainer(config, out_dir, data_root=data_root, resume=resume, progress=progress,
                      parallel=parallel, device=device, init_from=init_from,
                      init_normalizers=init_normalizers, callbacks=callbacks)
    return trainer.fit(stop_after=stop_after)
