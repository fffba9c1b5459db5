"""The training loop of the paper's protocol (Tables 7-8, C.2; FACTS.md section 3).

AdamW, a one-cycle schedule stepped per batch, gradient clipping, an EMA of the weights
(the reported test error is the EMA model's), FP32 by default or bf16/fp16 autocast (with
a gradient scaler for fp16). The loss is the MSE of the normalised outputs over real
points. Seeded; on CPU in FP32 a resumed run is bitwise identical to an uninterrupted one
(model, optimizer, scheduler, EMA, scaler and both RNG states are checkpointed).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from tqdm.auto import tqdm

from flarepp.data import DatasetSplits, MeshSamples, Normalizer, load_dataset
from flarepp.models import build_model
from flarepp.train.checkpoint import (CheckpointError, atomic_write, read_checkpoint,
                                      save_checkpoint)
from flarepp.train.config import RunConfig
from flarepp.train.evaluate import batches, evaluate

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device_type: str = "cpu"):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=_AUTOCAST[precision])


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2) + "\n"))


def checkpoint_path(out_dir: Path, epoch: int) -> Path:
    return out_dir / "checkpoints" / f"epoch_{epoch:04d}.pt"


def latest_checkpoint(out_dir: Path) -> Path | None:
    found = sorted((out_dir / "checkpoints").glob("epoch_*.pt"))
    return found[-1] if found else None


def masked_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None,
               group=None):
    """MSE over real points; with a context-parallel ``group``, this rank's share of it
    (local squared errors over the global point count: the shares sum to the loss)."""
    err = (pred.float() - target).square()
    if group is None:
        if mask is None:
            return err.mean()
        return (err * mask[..., None]).sum() / (mask.sum() * target.shape[-1])
    if mask is not None:
        err = err * mask[..., None]
    count = torch.tensor(float(err.numel() if mask is None else mask.sum() * target.shape[-1]),
                         device=err.device)
    torch.distributed.all_reduce(count, group=group)
    return err.sum() / count


def normalised(samples: MeshSamples, x_norm: Normalizer, y_norm: Normalizer) -> MeshSamples:
    out = samples.subset(slice(None))
    out.x, out.y = x_norm.encode(samples.x), y_norm.encode(samples.y)
    if samples.mask is not None:  # keep padding at exactly zero
        out.x, out.y = out.x * samples.mask[..., None], out.y * samples.mask[..., None]
    return out


class Trainer:
    """One run: data, model, optimiser state; ``fit()`` runs it to the end."""

    def __init__(self, config: RunConfig, out_dir: str | Path, *,
                 data_root: str | Path | None = None, resume: bool = False,
                 progress: bool = True, splits: DatasetSplits | None = None,
                 cp_group=None) -> None:
        self.config = c = config
        self.out_dir = Path(out_dir)
        # Context parallelism (App. B): every rank holds the whole batch and trains on its
        # token shard; group rank 0 alone writes files.
        self.is_writer = cp_group is None or torch.distributed.get_rank(cp_group) == 0
        self.progress = progress and self.is_writer
        last = latest_checkpoint(self.out_dir) if resume else None
        if resume and last is None:
            raise CheckpointError(f"--resume: no checkpoint in {str(self.out_dir / 'checkpoints')!r}")
        if not resume and (self.out_dir / "checkpoints").exists() and any(
                (self.out_dir / "checkpoints").iterdir()):
            raise ValueError(f"output directory {str(self.out_dir)!r} already holds a run; "
                             "pass --resume to continue it or choose another --out")
        self.data_root = Path(data_root or c.data_root)
        self.splits = splits or load_dataset(c.dataset, self.data_root, **c.dataset_options)
        self.x_norm = Normalizer.fit(self.splits.train.x, self.splits.train.mask)
        self.y_norm = Normalizer.fit(self.splits.train.y, self.splits.train.mask)
        self.train_data = normalised(self.splits.train, self.x_norm, self.y_norm)

        torch.manual_seed(c.seed)
        self.model = build_model(in_dim=self.splits.in_dim, out_dim=self.splits.out_dim,
                                 **c.model_kwargs())
        self.ema = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(c.ema_decay),
                                 use_buffers=True)
        self.cp = None  # the EMA copy above stays unsharded: evaluation runs on every rank
        if cp_group is not None:
            from flarepp.distributed import context_parallel
            self.cp = context_parallel(self.model, cp_group)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr, betas=c.betas,
                                           eps=c.eps, weight_decay=c.weight_decay)
        self.steps_per_epoch = math.ceil(len(self.splits.train) / c.batch_size)
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(
            self.optimizer, max_lr=c.lr, total_steps=c.epochs * self.steps_per_epoch,
            pct_start=c.pct_start, anneal_strategy="cos", div_factor=c.div_factor,
            final_div_factor=c.final_div_factor, cycle_momentum=False)
        self.scaler = torch.amp.GradScaler("cpu", enabled=c.precision == "fp16")
        self.shuffle = torch.Generator().manual_seed(c.seed)
        self.epoch = 0
        self.history: list[dict[str, Any]] = []
        if last is not None:
            self._restore(last)

    # -- state ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(), "model_config": self.model.config.to_dict(),
            "model": self.model.state_dict(), "ema": self.ema.module.state_dict(),
            "ema_state": self.ema.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
            "epoch": self.epoch, "history": self.history,
            "rng": {"torch": torch.get_rng_state(), "shuffle": self.shuffle.get_state()},
            "normalizers": {"x": self.x_norm.state_dict(), "y": self.y_norm.state_dict()},
            "data": {"dataset": self.config.dataset, "field_names": self.splits.field_names,
                     "units": self.splits.units},
        }

    def _restore(self, path: Path) -> None:
        state = read_checkpoint(path)
        if state["config"] != self.config.to_dict():
            changed = sorted(k for k in state["config"]
                             if state["config"][k] != self.config.to_dict().get(k))
            raise CheckpointError(f"checkpoint {str(path)!r} was written by a run with a "
                                  f"different config (differs in {changed}); resume with "
                                  "the same preset and --set options")
        self.model.load_state_dict(state["model"])
        self.ema.load_state_dict(state["ema_state"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"]["torch"])
        self.shuffle.set_state(state["rng"]["shuffle"])
        self.epoch = int(state["epoch"])
        self.history = list(state["history"])

    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # -- loop ----------------------------------------------------------------------------
    def train_epoch(self) -> float:
        c, model = self.config, self.model
        model.train()
        order = torch.randperm(len(self.train_data), generator=self.shuffle).numpy()
        total, count = 0.0, 0
        bar = tqdm(batches(self.train_data, c.batch_size, order), total=self.steps_per_epoch,
                   desc=f"epoch {self.epoch + 1}/{c.epochs}", leave=False,
                   disable=not self.progress)
        for _, x, y, mask in bar:
            if self.cp is not None:
                x, y, mask = self.cp.shard(x), self.cp.shard(y), self.cp.shard(mask)
            with autocast(c.precision):
                pred = model(x, mask=mask)
            loss = masked_mse(pred, y, mask, None if self.cp is None else self.cp.group)
            shown = loss.detach()
            if self.cp is not None:  # the whole mesh's loss, the same on every rank
                shown = shown.clone()
                torch.distributed.all_reduce(shown, group=self.cp.group)
            if not torch.isfinite(shown):
                raise FloatingPointError(f"loss became {shown.item()} at epoch "
                                         f"{self.epoch + 1}; try --precision fp32 or a lower lr")
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            if self.cp is not None:
                self.cp.all_reduce_gradients()  # every rank: the unsharded gradient
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.scheduler.step()
            self.ema.update_parameters(model)
            total += shown.item() * x.shape[0]
            count += x.shape[0]
            bar.set_postfix(loss=f"{shown.item():.3e}")
        return total / max(count, 1)

    def evaluate(self, samples: MeshSamples) -> dict:
        return evaluate(self.ema.module, samples, self.x_norm, self.y_norm,
                        batch_size=max(self.config.batch_size, 4),
                        precision=self.config.precision)

    def fit(self, stop_after: int | None = None) -> dict[str, Any] | None:
        """Train to ``config.epochs``; ``stop_after`` ends early after that many epochs of
        this call (the run can be resumed). Returns the final metrics, or None if stopped."""
        c = self.config
        if self.is_writer:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            write_json(self.out_dir / "config.json", c.to_dict())
            self._rewrite_log()
        done_now = 0
        while self.epoch < c.epochs:
            start = time.perf_counter()
            loss = self.train_epoch()
            self.epoch += 1
            record = {"epoch": self.epoch, "train_loss": loss,
                      "lr": self.scheduler.get_last_lr()[0],
                      "seconds": time.perf_counter() - start}
            if self.epoch % c.eval_every == 0 or self.epoch == c.epochs:
                record["test_rel_l2"] = self.evaluate(self.splits.test)["rel_l2"]
            self.history.append(record)
            if self.is_writer:
                with open(self.out_dir / "log.jsonl", "a") as log:
                    log.write(json.dumps(record) + "\n")
            if self.progress:
                extra = (f"  test rel L2 {record['test_rel_l2']:.4f}"
                         if "test_rel_l2" in record else "")
                print(f"epoch {self.epoch:4d}/{c.epochs}  loss {loss:.4e}{extra}", flush=True)
            if self.is_writer and (self.epoch % c.checkpoint_every == 0
                                   or self.epoch == c.epochs):
                save_checkpoint(checkpoint_path(self.out_dir, self.epoch), self.state())
            done_now += 1
            if stop_after is not None and done_now >= stop_after and self.epoch < c.epochs:
                return None
        return self.finish()

    def _rewrite_log(self) -> None:
        lines = "".join(json.dumps(r) + "\n" for r in self.history)
        atomic_write(self.out_dir / "log.jsonl", lambda tmp: Path(tmp).write_text(lines))

    def finish(self) -> dict[str, Any]:
        test = self.evaluate(self.splits.test)
        train = self.evaluate(self.splits.train)
        metrics = {
            "test_rel_l2": test["rel_l2"], "train_rel_l2": train["rel_l2"],
            "epochs": self.epoch, "params": self.n_params(),
            "seconds": float(sum(r["seconds"] for r in self.history)),
            "preset": self.config.name, "dataset": self.config.dataset,
            "mixer": self.config.model.get("mixer"), "precision": self.config.precision,
            "seed": self.config.seed,
            "checkpoint": str(checkpoint_path(self.out_dir, self.epoch)),
        }
        if self.is_writer:
            save_predictions(self.out_dir / "test_predictions.npz", self.splits, test)
            write_json(self.out_dir / "metrics.json", metrics)
        return metrics


def save_predictions(path: Path, splits: DatasetSplits, result: dict) -> None:
    test = splits.test
    coords = test.coords if test.coords is not None else test.x[..., :2]
    arrays = {"pred": result["pred"], "true": test.y, "coords": coords,
              "rel_l2": np.asarray(result["per_sample"]),
              "field_names": np.asarray(splits.field_names), "units": np.asarray(splits.units)}
    if test.mask is not None:
        arrays["mask"] = test.mask
    if test.grid_shape is not None:
        arrays["grid_shape"] = np.asarray(test.grid_shape)

    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)
    atomic_write(path, write)


def train(config: RunConfig, out_dir: str | Path, *, data_root: str | Path | None = None,
          resume: bool = False, progress: bool = True, stop_after: int | None = None,
          cp_group=None) -> dict[str, Any] | None:
    """Train ``config`` into ``out_dir``; returns ``metrics.json``'s content. ``cp_group``:
    split every mesh's points over this process group (context parallelism, App. B)."""
    trainer = Trainer(config, out_dir, data_root=data_root, resume=resume, progress=progress,
                      cp_group=cp_group)
    return trainer.fit(stop_after=stop_after)
