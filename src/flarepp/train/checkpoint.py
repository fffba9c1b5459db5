"""A run's checkpoints, owned by one object (torchtitan's ``components/checkpoint.py`` is the
shape): :class:`CheckpointManager`.

The trainer builds it once with the states it owns -- the model (the raw weights), the EMA
copy and its count, the optimiser, the learning-rate schedule, the gradient scaler, the
random streams (:class:`RNGState`: torch's, the shuffling generator's, CUDA's), the task's
normalisers -- and with ``header``, the trainer's own part stored at the checkpoint's top
level (the run config, the model config, the data's fingerprint, the epochs done and their
history, the position inside an interrupted epoch, an epoch whose evaluation has not run).
The manager alone

* **saves**: after checking that the run's lease is still this process's (a process whose
  lease another took over writes nothing more), atomically
  (:func:`flarepp.storage.checkpoint.save_checkpoint`);
* **keeps** ``keep_checkpoints``: the K newest and **the best** (the end-of-epoch checkpoint
  whose epoch has the best recorded metric), deleting older ones only after the new one is
  durable;
* **finds** the checkpoint to resume from: the newest readable one, naming and skipping
  those that do not read (:meth:`find`);
* **restores** every state, the header first (it refuses another run's checkpoint and sizes
  the model);
* **reads another run's weights** for fine-tuning (``--init-from``, :meth:`start_from`).

The trainer asks it and never touches a checkpoint file. File names are
:class:`~flarepp.storage.rundir.RunDir`'s; the format (unchanged by this owner) is
:mod:`flarepp.storage.checkpoint`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import numpy as np
import torch
from torch import nn

from flarepp.locks import Lease
from flarepp.storage.checkpoint import (CheckpointError, CheckpointSearch,
                                        newest_readable_checkpoint, read_checkpoint,
                                        rebuild_model, remove_stale_temporaries,
                                        save_checkpoint)
from flarepp.storage.config import RunConfig
from flarepp.storage.rundir import RunDir, checkpoint_epoch


class Stateful(Protocol):
    """What a checkpoint holds of an object: ``state_dict()`` and ``load_state_dict()``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class RNGState:
    """The random streams of a run: torch's CPU generator, the generator that shuffles the
    training split, and the CUDA generator of ``device`` where the run computes on CUDA (a
    checkpoint written on a GPU resumes on a CPU and the other way round)."""

    def __init__(self, shuffle: torch.Generator, device: torch.device) -> None:
        self.shuffle, self.device = shuffle, device

    def state_dict(self) -> dict[str, Any]:
        rng = {"torch": torch.get_rng_state(), "shuffle": self.shuffle.get_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return rng

    def load_state_dict(self, rng: dict[str, Any]) -> None:
        torch.set_rng_state(rng["torch"])
        self.shuffle.set_state(rng["shuffle"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)


class CheckpointManager:
    """The checkpoints of the run in ``run`` (module docstring).

    ``states``: name -> object, each stored under its name, restored in order after
    ``header`` (stored at the top level). ``config``: the run's; a checkpoint of a run that
    computes something else is refused. ``keep``: ``keep_checkpoints``. ``best``: the
    history key of the metric that picks the best checkpoint and whether lower is better.
    ``writer``: whether this process writes (one rank of several does). ``lease``: the
    run's lease, checked before every write."""

    def __init__(self, run: RunDir, states: Mapping[str, Stateful], *, header: Stateful,
                 config: RunConfig, keep: int | None, best: tuple[str, bool],
                 writer: bool = True, lease: Lease | None = None) -> None:
        self.run, self.states, self.header, self.config = run, dict(states), header, config
        self.keep, self.best_key, self.lower_is_better = keep, best[0], best[1]
        self.writer, self.lease = writer, lease
        self._scores: dict[int, float] = {}

    def path(self, epoch: int, step: int | None = None) -> Path:
        """``epoch_0003.pt`` after 3 epochs; ``epoch_0003_step_000012.pt`` 12 steps into the
        4th (:meth:`RunDir.checkpoint`)."""
        return self.run.checkpoint(epoch, step)

    def latest(self) -> Path | None:
        return self.run.latest_checkpoint()

    # -- saving -----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The checkpoint of now: the header's top level, then each state under its name."""
        return {**self.header.state_dict(),
                **{name: obj.state_dict() for name, obj in self.states.items()}}

    def save(self, step: int | None = None) -> Path:
        """Write the checkpoint of now (of the header's epoch; ``step`` steps into the next
        one when given) and apply the retention; returns its path. Only the writer writes;
        before it does, the lease is checked (lost: nothing is written)."""
        state = self.state()
        path = self.path(int(state["epoch"]), step)
        if not self.writer:
            return path
        if self.lease is not None:
            self.lease.verify()
        save_checkpoint(path, state)
        self._scores = {r["epoch"]: r[self.best_key] for r in state.get("history", [])
                        if self.best_key in r and np.isfinite(r[self.best_key])}
        self.run.prune_checkpoints(self.keep, best=self.best())
        return path

    def best(self) -> Path | None:
        """The end-of-epoch checkpoint on disk whose epoch has the best metric recorded so
        far (the newest of equals), or None."""
        candidates = [p for p in self.run.checkpoints()
                      if checkpoint_epoch(p)[1] is None and checkpoint_epoch(p)[0] in self._scores]
        if not candidates:
            return None
        sign = 1.0 if self.lower_is_better else -1.0
        return min(candidates, key=lambda p: sign * self._scores[checkpoint_epoch(p)[0]])

    # -- reading ----------------------------------------------------------------------------
    @staticmethod
    def find(run: RunDir, *, resume: bool, writer: bool,
             say: Callable[[str], None]) -> CheckpointSearch | None:
        """Before a run starts in ``run``: remove the temporaries a killed write left (the
        writer, holding the run's lease), then the newest readable checkpoint to resume from
        (``resume``; the unreadable newer ones are said and skipped), or None for a new run.
        A new run in a directory that holds checkpoints, or a resume with none that reads,
        is refused in a sentence."""
        if writer:
            removed = remove_stale_temporaries(run.path)
            if removed:
                say(f"removed {len(removed)} temporary file(s) a killed write left in "
                    f"{str(run.path)!r}")
        if not resume:
            if run.checkpoints():
                raise ValueError(f"output directory {str(run.path)!r} already holds a run; "
                                 "pass --resume to continue it or choose another --out")
            return None
        found = newest_readable_checkpoint(run.path)
        if found.path is None:
            reason = found.message() or f"there is no checkpoint in {str(run.checkpoint_dir)!r}"
            raise CheckpointError(f"--resume: {reason}")
        if found.unreadable:
            say(f"--resume: {found.message()}")
        return found

    def restore(self, found: CheckpointSearch) -> None:
        """Load ``found``'s state: refused in a sentence when it was written by a run of
        another config (runtime fields aside); the header first, then every state."""
        stored = RunConfig.from_stored(found.state["config"]).identity()
        mine = self.config.identity()
        if stored != mine:
            changed = sorted(k for k in stored.keys() | mine.keys()
                             if stored.get(k) != mine.get(k))
            raise CheckpointError(f"checkpoint {str(found.path)!r} was written by a run with "
                                  f"a different config (differs in {changed}); resume with "
                                  "the same preset and --set options")
        self.header.load_state_dict(found.state)
        for name, obj in self.states.items():
            obj.load_state_dict(found.state[name])

    @staticmethod
    def start_from(source: Path, model: nn.Module, normalizers: Stateful | None,
                   task_name: str) -> dict[str, Any]:
        """Fine-tuning's start (``--init-from``): load into ``model`` the weights ``source``
        (a run directory or a checkpoint) reports, refusing another architecture in a
        sentence, and its normalisers into ``normalizers`` unless None (refit); returns the
        record of where the run started, which its checkpoints and ``metrics.json`` keep."""
        path = RunDir(source).require_run().reported_checkpoint() if source.is_dir() else source
        if path is None:
            raise CheckpointError(f"--init-from {str(source)!r}: the run holds no checkpoint")
        state = read_checkpoint(path)
        theirs, mine = state["model_config"], model.config.to_dict()
        differ = sorted(k for k in theirs.keys() | mine.keys() if theirs.get(k) != mine.get(k))
        if differ:
            shown = ", ".join(f"{k} {theirs.get(k)!r} (this run: {mine.get(k)!r})"
                              for k in differ[:4])
            raise CheckpointError(f"--init-from {str(path)!r}: its model differs from this "
                                  f"run's in {shown}; fine-tuning starts from the same "
                                  "architecture (set the same model.* options)")
        model.load_state_dict(rebuild_model(state, path).state_dict())
        if normalizers is not None:
            try:
                normalizers.load_state_dict(state["normalizers"])
            except (KeyError, TypeError) as err:
                raise CheckpointError(f"--init-from {str(path)!r}: its normalisers do not fit "
                                      f"the {task_name!r} task ({err}); use "
                                      "--init-normalizers refit") from None
        return {"checkpoint": str(path.resolve()), "epoch": int(state["epoch"]),
                "weights": RunConfig.from_stored(state["config"]).eval_weights,
                "normalizers": "refit" if normalizers is None else "keep"}


def checkpoint_path(out_dir: str | Path, epoch: int, step: int | None = None) -> Path:
    """A run directory's checkpoint of ``epoch`` (``step`` steps into the next), by
    :meth:`RunDir.checkpoint`."""
    return RunDir(out_dir).checkpoint(epoch, step)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """A run directory's most advanced checkpoint (None without one)."""
    return RunDir(out_dir).latest_checkpoint()


__all__ = ["CheckpointManager", "RNGState", "Stateful", "checkpoint_path", "latest_checkpoint"]
