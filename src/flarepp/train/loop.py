"""The one training loop, for every task (paper Tables 7-8, C.2; the FLARE study's protocol).

AdamW, a one-cycle schedule stepped per batch, gradient clipping, an EMA of the weights,
FP32 by default or bf16/fp16 autocast on the run's device (with a gradient scaler for
fp16). Every evaluation scores both the raw (trained) weights and the EMA copy, and the
log, ``metrics.json`` and the figures carry both; ``eval_weights`` names the headline (raw,
as the FLARE study reports: :mod:`flarepp.inference.evaluate`), and the final predictions
are the headline weights'. What is learned, and how it is measured, comes from a
:class:`flarepp.tasks.Task`; this module owns the device, the precision, the parallel
layout, the optimiser state, checkpoints and logs.

Parallelism (:mod:`flarepp.distributed.mesh`): data-parallel ranks each take a share of
every global batch (``batch_size`` samples, the preset's) and ``DistributedDataParallel``
averages their gradients; context-parallel ranks split the tokens of the same samples and
sum their gradients (Appendix B). The loss of a step is the task's loss summed over the
global batch divided by its global count, so any layout gives the single-process step.
Global rank 0 alone writes files and calls the run's callbacks (trackers, a search's pruner:
:mod:`flarepp.train.callbacks`).

Reproducibility: seeded; on the CPU in FP32 a resumed run is bitwise identical to an
uninterrupted one (model, optimizer, scheduler, EMA, scaler and the RNG states are
checkpointed). A checkpoint loads on any device (a GPU run resumes on a CPU machine and
the other way round); the CUDA RNG state is restored where CUDA is used again.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from flarepp.data import DatasetSplits
from flarepp.device import grad_scaler, resolve_device, use_device
from flarepp.distributed.mesh import SINGLE, ParallelPlan
from flarepp.tasks import Task, build_task
from flarepp.inference.batching import (epoch_keys, global_batches, make_loader,
                                    steps_per_epoch, to_device_prefetched)
from flarepp.storage.checkpoint import (CheckpointError, checkpoint_epoch,
                                      checkpoints_newest_first, newest_readable_checkpoint,
                                      prune_checkpoints, remove_stale_temporaries,
                                      save_checkpoint)
from flarepp.storage.config import RunConfig
from flarepp.inference.engine import Engine
from flarepp.inference.execution import Execution
from flarepp.inference.evaluate import evaluate_weights, weight_metrics
from flarepp.train.ema import WeightAverage
from flarepp.train.optim import build_optimizer, build_scheduler, write_param_groups
from flarepp.data.fingerprint import check_same_data
from flarepp.storage.rundir import RunDir, RunLock, provenance
from flarepp.train.callbacks import Callbacks, TrainerCallback, TrainingPruned
from flarepp.train.checks import check_run_config
from flarepp.threads import SHARED_BY_RANKS, ThreadTuner, thread_budget


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

WEIGHTS_NAME = {"raw": "raw", "ema": "EMA"}
"""How a log line names the weights of ``eval_weights``."""


def checkpoint_path(out_dir: Path, epoch: int, step: int | None = None) -> Path:
    """``epoch_0003.pt`` after 3 epochs; ``epoch_0003_step_000012.pt`` 12 steps into the 4th
    (:meth:`RunDir.checkpoint`)."""
    return RunDir(out_dir).checkpoint(epoch, step)


def latest_checkpoint(out_dir: Path) -> Path | None:
    return RunDir(out_dir).latest_checkpoint()


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


def show_progress_bars(progress: bool) -> bool:
    """Bars on a terminal only; logs, CI and job schedulers get one line per epoch."""
    return progress and sys.stderr.isatty()


class Trainer:
    """One run: task, model, optimiser state on a device; ``fit()`` runs it to the end.

    ``parallel`` is the process's place in the ``("dp", "cp")`` mesh (default: one
    process); ``device`` overrides ``config.device``; ``task`` a prebuilt task (e.g. data
    shared by several runs), ``splits`` preloaded data for the default task.
    ``init_from`` (fine-tuning): a run directory or checkpoint whose weights (those it
    reports) start this run, with a new optimiser on this run's data; ``init_normalizers``
    ``keep`` takes its normalisers too, ``refit`` fits them on this run's data. It is
    recorded in the checkpoints, ``metrics.json`` and ``provenance.json``. ``callbacks``
    are called on the writer rank (:mod:`flarepp.train.callbacks`); ``plot`` draws the run's
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
        self.init_record: dict[str, Any] | None = None
        self.config = c = check_run_config(config)
        self.out_dir = Path(out_dir)
        self.run = RunDir(self.out_dir)
        self.plan = parallel
        self.is_writer = parallel.is_writer
        self.hooks = Callbacks(callbacks, is_writer=self.is_writer)
        self.plot = plot
        self.progress = progress and self.is_writer
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

    def _setup(self, resume: bool, data_root, splits, task, init_from, init_normalizers
               ) -> None:
        c, parallel = self.config, self.plan
        if self.is_writer:
            removed = remove_stale_temporaries(self.out_dir)
            if removed and self.progress:
                print(f"removed {len(removed)} temporary file(s) a killed write left in "
                      f"{str(self.out_dir)!r}", flush=True)
        found = newest_readable_checkpoint(self.out_dir) if resume else None
        if found is not None and found.path is None:
            reason = found.message() or f"there is no checkpoint in " \
                f"{str(self.run.checkpoint_dir)!r}"
            raise CheckpointError(f"--resume: {reason}")
        if found is not None and found.unreadable and self.progress:
            print(f"--resume: {found.message()}", flush=True)
        if not resume and checkpoints_newest_first(self.out_dir):
            raise ValueError(f"output directory {str(self.out_dir)!r} already holds a run; "
                             "pass --resume to continue it or choose another --out")
        if task is None:
            options = {} if splits is None else {"splits": splits}
            task = build_task(c, data_root or c.data_root, **options)
        self.task = task
        self.engine = Engine(task, Execution(self.device, c.precision, plan=parallel,
                                             chunk_size=c.eval_chunk_size),
                             workers=c.workers(self.device.type))

        torch.manual_seed(c.seed)
        self.model = task.build_model().to(self.device)
        if init_from is not None:
            if found is not None:
                raise ValueError("--init-from starts a new run from another run's weights; "
                                 f"{str(self.out_dir)!r} is resumed from its own checkpoint")
            self._init_from(Path(init_from), init_normalizers)
        self.ema = WeightAverage(self.model, c.ema_decay)
        self._wrap()
        self.optimizer = build_optimizer(self.model, c)
        self.latent_schedule = c.schedule()
        self.n_train = task.num_samples("train")
        self.steps_per_epoch = steps_per_epoch(self.n_train, c.batch_size)
        self.scheduler = build_scheduler(self.optimizer, c, c.epochs * self.steps_per_epoch)
        self.scaler = grad_scaler(c.precision, self.device)
        self.shuffle = torch.Generator().manual_seed(c.seed)
        self.epoch = 0
        self.history: list[dict[str, Any]] = []
        self.step_losses: list[float] = []
        self.threads: ThreadTuner | None = None  # measured on the first steps trained
        self._resume_progress: dict[str, Any] | None = None
        self._stop_signal: int | None = None
        if found is not None:
            self._restore(found.path, found.state)

    def _init_from(self, source: Path, normalizers: str) -> None:
        """Start from the weights ``source`` reports (fine-tuning), refusing another
        architecture in a sentence; ``normalizers`` ``keep``: its maps as well."""
        from flarepp.storage.checkpoint import read_checkpoint, rebuild_model
        path = RunDir(source).require_run().reported_checkpoint() if source.is_dir() else source
        if path is None:
            raise CheckpointError(f"--init-from {str(source)!r}: the run holds no checkpoint")
        state = read_checkpoint(path)
        theirs, mine = state["model_config"], self.model.config.to_dict()
        differ = sorted(k for k in theirs.keys() | mine.keys() if theirs.get(k) != mine.get(k))
        if differ:
            shown = ", ".join(f"{k} {theirs.get(k)!r} (this run: {mine.get(k)!r})"
                              for k in differ[:4])
            raise CheckpointError(f"--init-from {str(path)!r}: its model differs from this "
                                  f"run's in {shown}; fine-tuning starts from the same "
                                  "architecture (set the same model.* options)")
        self.model.load_state_dict(rebuild_model(state, path).state_dict())
        if normalizers == "keep":
            try:
                self.task.load_state_dict(state["normalizers"])
            except (KeyError, TypeError) as err:
                raise CheckpointError(f"--init-from {str(path)!r}: its normalisers do not fit "
                                      f"the {self.config.task!r} task ({err}); use "
                                      "--init-normalizers refit") from None
        self.init_record = {"checkpoint": str(path.resolve()), "epoch": int(state["epoch"]),
                            "weights": RunConfig.from_stored(state["config"]).eval_weights,
                            "normalizers": normalizers}

    def _wrap(self) -> None:
        """Compile, token-shard and data-parallel-wrap the model (again after it grew)."""
        c, parallel = self.config, self.plan
        if c.compile:
            from flarepp.models.backbone import compile_model
            compile_model(self.model)
        if parallel.cp_group is not None:
            from flarepp.distributed import context_parallel
            context_parallel(self.model, parallel.cp_group)
            context_parallel(self.ema.module, parallel.cp_group)
        self.train_model: torch.nn.Module = self.model
        if parallel.dp_group is not None:
            self.train_model = torch.nn.parallel.DistributedDataParallel(
                self.model, process_group=parallel.dp_group,
                device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def _grow(self, latents: int) -> None:
        """Grow the model, its optimiser state and the EMA copy to ``latents`` latents,
        keeping the function (:func:`flarepp.rank_growth.grow_latents`)."""
        from flarepp.rank_growth import grow_latents
        grow_latents(self.model, latents, self.optimizer)
        grow_latents(self.ema.module, latents)
        self._wrap()

    def close(self) -> None:
        """Release the run directory (idempotent)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # -- state ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        rng = {"torch": torch.get_rng_state(), "shuffle": self.shuffle.get_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "config": self.config.to_dict(), "model_config": self.model.config.to_dict(),
            "model": self.model.state_dict(), "ema": self.ema.module.state_dict(),
            "ema_state": self.ema.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
            "epoch": self.epoch, "history": self.history, "rng": rng,
            "task": self.config.task, "normalizers": self.task.state_dict(),
            "data": {**self.task.describe_data(), "identity": self.task.data_identity()},
            **({"init_from": self.init_record} if self.init_record else {}),
        }

    def _restore(self, path: Path, state: dict[str, Any]) -> None:
        stored = RunConfig.from_stored(state["config"]).identity()
        mine = self.config.identity()
        if stored != mine:
            changed = sorted(k for k in stored.keys() | mine.keys()
                             if stored.get(k) != mine.get(k))
            raise CheckpointError(f"checkpoint {str(path)!r} was written by a run with a "
                                  f"different config (differs in {changed}); resume with "
                                  "the same preset and --set options")
        identity = state.get("data", {}).get("identity")
        if identity:
            check_same_data(identity, self.task.data_identity())
        self.task.load_state_dict(state["normalizers"])
        grown = state["model_config"].get("latents")
        if self.latent_schedule is not None and grown != self.model.config.latents:
            self._grow(grown)  # the run had grown its latents: rebuild at that size
        self.model.load_state_dict(state["model"])
        self.ema.load_state_dict(state["ema_state"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"]["torch"])
        self.shuffle.set_state(state["rng"]["shuffle"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        self.epoch = int(state["epoch"])
        self.history = list(state["history"])
        self.init_record = state.get("init_from")
        self._resume_progress = state.get("epoch_progress")

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
            from flarepp.distributed import all_reduce_gradients
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
        bar = tqdm(to_device_prefetched(loader, self.device), total=len(keys),
                   initial=done, desc=f"epoch {self.epoch + 1}/{c.epochs}", leave=False,
                   disable=not (self.progress and show_progress_bars(True)))
        pending: list[torch.Tensor] = []
        if self.threads is None:
            self.threads = self._thread_tuner()
        for micro, weight in bar:
            with self.threads.step():
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
        path = checkpoint_path(self.out_dir, self.epoch,
                               None if progress is None else progress["step"])
        if self.is_writer:
            state = self.state()
            if progress is not None:
                state["epoch_progress"] = progress
            self._save_checkpoint(path, state)
        raise TrainingInterrupted(self._stop_signal or signal.SIGINT, path, self.out_dir)

    def _save_checkpoint(self, path: Path, state: dict[str, Any]) -> None:
        """Write a checkpoint, then apply the retention policy (``keep_checkpoints``: the
        newest K and the best by the recorded metric); the older ones are removed only
        after the new one is durable."""
        save_checkpoint(path, state)
        prune_checkpoints(self.out_dir, self.config.keep_checkpoints,
                          best=self._best_checkpoint())

    def _best_checkpoint(self) -> Path | None:
        """The end-of-epoch checkpoint on disk whose epoch has the best recorded metric
        (``<first eval split>_<headline>`` of the history; the newest of equals)."""
        key = f"{self.task.eval_splits[0]}_{self.task.headline}"
        scored = {r["epoch"]: r[key] for r in self.history
                  if key in r and np.isfinite(r[key])}
        candidates = [p for p in checkpoints_newest_first(self.out_dir)
                      if checkpoint_epoch(p)[1] is None and checkpoint_epoch(p)[0] in scored]
        if not candidates:
            return None
        sign = 1.0 if self.task.lower_is_better else -1.0
        return min(candidates, key=lambda p: sign * scored[checkpoint_epoch(p)[0]])

    def weights(self, name: str) -> torch.nn.Module:
        """The raw (trained) weights' model, or the EMA copy's (``"raw"`` / ``"ema"``)."""
        return {"raw": self.model, "ema": self.ema.module}[name]

    def evaluate(self, split: str) -> dict[str, dict[str, Any]]:
        """The task's metrics of ``split`` (with its ``_records``) for the raw weights and
        the EMA copy, ``{"raw": ..., "ema": ...}``; with ``ema_decay`` 0 the copy is the
        weights, evaluated once."""
        results = evaluate_weights(self.engine, split, self.task.eval_batch_size(),
                                   {w: self.weights(w) for w in ("raw", "ema")},
                                   same=self.config.ema_decay == 0)
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
        c = self.config
        headline = self.task.headline
        if self.is_writer:
            self.run.write_config(c)
            write_param_groups(self.out_dir, self.model, self.optimizer)
            self._rewrite_log()
            self.run.record_provenance(provenance(
                [self.device], parallel=self.plan.describe(), resumed_at_epoch=self.epoch,
                **({"init_from": self.init_record} if self.init_record else {})))
            self.hooks.run_start(c, self.out_dir, self.epoch)
        self.threads = self.threads or self._thread_tuner()
        recorded = None
        done_now = 0
        while self.epoch < c.epochs:
            latents = None
            if self.latent_schedule is not None:
                latents = self.latent_schedule.latents_at(self.epoch)
                if latents > self.model.config.latents:
                    self._grow(latents)
                    if self.progress:
                        print(f"epoch {self.epoch + 1}: latents grown to M = {latents}",
                              flush=True)
            loss = self.train_epoch()
            self.epoch += 1
            record = {"epoch": self.epoch, "train_loss": loss,
                      "lr": self.scheduler.get_last_lr()[0], "seconds": self._epoch_seconds,
                      "step_losses": list(self.step_losses)}
            if latents is not None:
                record["latents"] = latents
            record["threads"] = torch.get_num_threads()
            if self.is_writer and self.threads.choice not in (None, recorded):
                recorded = self.threads.choice
                self.run.amend_provenance({"threads": recorded.record()})
            split = self.task.eval_splits[0]
            key = f"{split}_{headline}"
            if self.epoch % c.eval_every == 0 or self.epoch == c.epochs:
                for name in dict.fromkeys((split, *self.hooks.splits)):
                    record.update(weight_metrics(name, headline, self.evaluate(name),
                                                 c.eval_weights, self.task.reported))
                record["eval_weights"] = c.eval_weights
            self.history.append(record)
            if self.is_writer:
                self.run.append_log(record)
            if self.progress:
                shown = ""
                if key in record:
                    other = "ema" if c.eval_weights == "raw" else "raw"
                    shown = (f"  {key.replace('_', ' ')} {record[key]:.4f} "
                             f"({WEIGHTS_NAME[c.eval_weights]} weights; "
                             f"{WEIGHTS_NAME[other]} {record[f'{key}_{other}']:.4f})")
                print(f"epoch {self.epoch:4d}/{c.epochs}  loss {loss:.4e}{shown}", flush=True)
            done_now += 1
            pruned = self._callback_stop(record)
            stopping = stop_after is not None and done_now >= stop_after
            if self.is_writer and (self.epoch % c.checkpoint_every == 0
                                   or self.epoch == c.epochs or stopping or pruned):
                self._save_checkpoint(checkpoint_path(self.out_dir, self.epoch), self.state())
            if pruned:
                raise TrainingPruned(self.epoch, pruned,
                                     checkpoint_path(self.out_dir, self.epoch))
            if self.epoch < c.epochs and self._stop_requested():
                self._interrupt(None)  # between epochs: the checkpoint is the epoch's
            if stopping and self.epoch < c.epochs:
                return None
        return self.finish()

    def _thread_tuner(self) -> ThreadTuner:
        """The run's intra-op threads, measured on its first steps (:mod:`flarepp.threads`);
        a multi-process run keeps the count its launcher gave each rank."""
        c = self.config
        steps = (c.epochs - self.epoch) * self.steps_per_epoch
        say = (lambda line: print(line, flush=True)) if self.progress else None
        return ThreadTuner(steps=steps, budget=thread_budget(self.engine.workers),
                           device=self.device, say=say,
                           skip=SHARED_BY_RANKS if self.plan.mesh is not None else None)

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

    def _rewrite_log(self) -> None:
        self.run.rewrite_log(self.history)

    def finish(self) -> dict[str, Any]:
        headline, chosen = self.task.headline, self.config.eval_weights
        results = {split: self.evaluate(split) for split in self.task.eval_splits}
        metrics: dict[str, Any] = {}
        for split, by_weights in results.items():
            metrics.update(weight_metrics(split, headline, by_weights, chosen,
                                          self.task.reported))
            if "zero_target_samples" in by_weights[chosen]:
                metrics[f"{split}_zero_target_samples"] = \
                    by_weights[chosen]["zero_target_samples"]
        metrics.update(self.task.baseline_metrics())
        metrics.update({
            "eval_weights": chosen,
            "epochs": self.epoch, "params": self.n_params(),
            "seconds": float(sum(r["seconds"] for r in self.history)),
            "preset": self.config.name, "dataset": self.config.dataset,
            "task": self.config.task, "mixer": self.config.model.get("mixer"),
            "precision": self.config.precision, "seed": self.config.seed,
            "device": str(self.device), "parallel": self.plan.describe(),
            "checkpoint": str(checkpoint_path(self.out_dir, self.epoch)),
            **({"init_from": self.init_record} if self.init_record else {}),
        })
        split = self.task.eval_splits[0]
        records = results[split][chosen]["_records"]
        cases = self.task.cases_to_predict(split, records)  # predicted on every rank
        extra = ({"predictions": self.engine.predict_cases(self.weights(chosen), split, cases)}
                 if cases else {})
        if self.is_writer:
            self.task.write_outputs(self.out_dir, split, records, **extra)
            self.run.write_metrics(metrics)
            figures = self.task.plot_run(self.out_dir, self.config.plot_cases) if self.plot \
                else []
            self.hooks.run_end(metrics, figures)
        return metrics


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
