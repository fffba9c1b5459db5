"""A run directory: the one owner of its files, and who may write into it.

* :class:`RunDir` -- names every file of a run directory (its config, log, metrics,
  parameter groups, provenance, checkpoints, predictions, figures, and the ``failed.json`` /
  ``cost.json`` the study engine writes there) and is the one reader and writer of each; the
  stored config is always read through :meth:`RunConfig.from_stored`. No other module spells
  a run file's name (``tests/test_run_files.py`` scans the source).
* :func:`provenance` -- what produced a run: flarepp's version and git commit, Python, torch
  and CUDA versions, the devices, the host and the command line (``provenance.json``).
* :class:`RunLock` -- the lease on ``<run>/.lock`` held for the run's life, so two
  ``flarepp train`` processes, on one host or on two sharing the directory, cannot interleave
  one log and overwrite each other's checkpoints. It lives with every other lease in
  :mod:`flarepp.locks` (an exclusive create with a heartbeat, not a kernel lock, which
  shared filesystems do not keep coherent); a second process gets :class:`RunLocked`, naming
  the holder (pid, host, start time, command).

The fingerprint of the data a run was trained on belongs to the data layer
(:mod:`flarepp.data.fingerprint`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from flarepp.io import (append_line, atomic_write_json, atomic_write_text, fsync_directory,
                        UnreadableFile, read_json, read_json_lines)
from flarepp.locks import LOCK_NAME, LockHolder, RunLock, RunLocked
from flarepp.storage.config import RunConfig
from flarepp.version import __version__


CHECKPOINT_NAME = re.compile(r"epoch_(\d+)(?:_step_(\d+))?\.pt")
"""File names of the checkpoints in ``<run>/checkpoints``: ``epoch_<n>.pt`` after ``n``
epochs, ``epoch_<n>_step_<k>.pt`` ``k`` steps into epoch ``n + 1`` (an interrupted run)."""


class NotARunDirectory(FileNotFoundError):
    """A path that holds no flarepp run (no ``config.json`` and no checkpoint)."""


class RunDir:
    """The files of one run directory, named here and nowhere else.

    Names with ``{split}`` are per evaluated split (``test_predictions.npz``); figures are
    ``<stem>.png`` (:meth:`figure`). Readers raise a sentence naming the file; writers are
    atomic (:mod:`flarepp.io`), so a killed write leaves the previous file or none."""

    CONFIG = "config.json"
    LOG = "log.jsonl"
    METRICS = "metrics.json"
    PARAM_GROUPS = "param_groups.json"
    PROVENANCE = "provenance.json"
    FAILED = "failed.json"            # the study engine: a numerical failure (final)
    COST = "cost.json"                # the study engine: the separate timing run
    PRUNED = "pruned.json"            # the study engine: stopped by a search's pruner (final)
    TRACKING = "tracking.json"        # the experiment tracker's run this run logs to
    CHECKPOINTS = "checkpoints"
    LOCK = LOCK_NAME
    PREDICTIONS = "{split}_predictions.npz"        # fields: predictions of every sample
    PREDICTION_TABLE = "{split}_predictions.csv"   # sequence: one row per sample
    ACCURACY = "{split}_accuracy.json"             # sequence: metrics and confusion matrix
    BITS_PER_BYTE = "{split}_bits_per_byte.json"   # lm
    ROLLOUT = "{split}_rollout.npz"                # rollout: errors per step, a few rollouts
    SURFACE_CASE = "surface_case.npz"              # surface: the case of Figures 13-14
    SURFACE_ERRORS = "surface_errors.json"         # surface: every car's errors
    EXPORTED = "model.{format}"                    # flarepp export
    FIGURE = "{stem}.png"
    CURVES = "curves"                              # figure stems
    CASE_FIGURE = "case_{case:04d}_ch{channel}"
    ROLLOUT_ERROR_FIGURE = "rollout_error"
    ROLLOUT_CASES_FIGURE = "rollout_cases"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # -- names ---------------------------------------------------------------------------
    def file(self, name: str, **fields: Any) -> Path:
        """``path / name`` with ``{split}``-style fields filled in."""
        return self.path / name.format(**fields)

    @property
    def config_path(self) -> Path:
        return self.path / self.CONFIG

    @property
    def tensorboard_dir(self) -> Path:
        """TensorBoard's event files of a run tracked on its own (a study's runs log under
        ``<study>/tensorboard/<point>`` instead)."""
        return self.path / "tensorboard"

    @property
    def log_path(self) -> Path:
        return self.path / self.LOG

    @property
    def metrics_path(self) -> Path:
        return self.path / self.METRICS

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / self.CHECKPOINTS

    def predictions(self, split: str) -> Path:
        return self.file(self.PREDICTIONS, split=split)

    def exported(self, fmt: str) -> Path:
        """Where ``flarepp export --format fmt`` writes by default."""
        return self.file(self.EXPORTED, format=fmt)

    def figure(self, stem: str) -> Path:
        """A figure of the run: ``<stem>.png``."""
        return self.file(self.FIGURE, stem=stem)

    def case_figure(self, case: int, channel: int) -> Path:
        return self.figure(self.CASE_FIGURE.format(case=case, channel=channel))

    @property
    def curves(self) -> Path:
        return self.figure(self.CURVES)

    def record_of(self, path: str | Path) -> str | None:
        """The name of the run's own record that ``path`` is (its config, log, metrics,
        provenance, lease and the like, or a file under ``checkpoints/``), None for any
        other path (an export, a figure, a file elsewhere): what no output may replace."""
        path = Path(path).resolve()
        if path.parent == self.checkpoint_dir.resolve():
            return f"{self.CHECKPOINTS}/{path.name}"
        records = (self.CONFIG, self.LOG, self.METRICS, self.PARAM_GROUPS, self.PROVENANCE,
                   self.FAILED, self.COST, self.PRUNED, self.TRACKING, self.LOCK)
        return path.name if path.parent == self.path.resolve() and path.name in records \
            else None

    def is_run(self) -> bool:
        """Whether the directory holds a run (its config or a checkpoint)."""
        return self.config_path.is_file() or bool(self.checkpoints())

    def require_run(self) -> "RunDir":
        """This run directory, or :class:`NotARunDirectory` in a sentence."""
        if not self.path.is_dir():
            raise NotARunDirectory(f"{str(self.path)!r} does not exist: give a flarepp run "
                                   "directory or a checkpoint file")
        if not self.is_run():
            raise NotARunDirectory(f"{str(self.path)!r} is not a flarepp run directory (it "
                                   f"holds no {self.CONFIG} and no {self.CHECKPOINTS}/)")
        return self

    # -- config, metrics, log, parameter groups ------------------------------------------
    def read_config(self) -> RunConfig:
        """The stored config, read as stored (:meth:`RunConfig.from_stored`)."""
        return RunConfig.from_stored(self.read_config_dict())

    def read_config_dict(self) -> dict[str, Any]:
        """The stored ``config.json`` as a dict (sections as stored)."""
        if not self.config_path.is_file():
            raise NotARunDirectory(f"{str(self.config_path)!r} not found: is "
                                   f"{str(self.path)!r} a flarepp run directory?")
        return read_json(self.config_path)

    def write_config(self, config: RunConfig) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        return atomic_write_json(self.config_path, config.to_file())

    def has_metrics(self) -> bool:
        return self.metrics_path.is_file()

    def read_metrics(self) -> dict[str, Any]:
        if not self.metrics_path.is_file():
            raise NotARunDirectory(f"{str(self.metrics_path)!r} not found: "
                                   f"{str(self.path)!r} is not a finished flarepp run")
        metrics = read_json(self.metrics_path)
        if not isinstance(metrics, dict):
            raise UnreadableFile(f"{self.metrics_path}: holds a JSON "
                                 f"{type(metrics).__name__}, not the object of a run's metrics")
        return metrics

    def write_metrics(self, metrics: dict[str, Any]) -> Path:
        return atomic_write_json(self.metrics_path, metrics)

    def has_log(self) -> bool:
        return self.log_path.is_file()

    def read_log(self) -> list[dict[str, Any]]:
        """The records of ``log.jsonl`` (one per epoch)."""
        if not self.log_path.is_file():
            raise NotARunDirectory(f"{str(self.log_path)!r} not found: is "
                                   f"{str(self.path)!r} a flarepp run?")
        return read_json_lines(self.log_path)

    def append_log(self, record: dict[str, Any]) -> None:
        append_line(self.log_path, json.dumps(record))

    def rewrite_log(self, records: Iterable[dict[str, Any]]) -> Path:
        return atomic_write_text(self.log_path, "".join(json.dumps(r) + "\n" for r in records))

    def write_param_groups(self, groups: list[dict[str, Any]]) -> Path:
        return atomic_write_json(self.path / self.PARAM_GROUPS, {"groups": groups})

    def read_param_groups(self) -> list[dict[str, Any]]:
        return read_json(self.path / self.PARAM_GROUPS)["groups"]

    # -- provenance ------------------------------------------------------------------------
    def record_provenance(self, record: dict[str, Any]) -> Path:
        """Append ``record`` (:func:`provenance`) to ``provenance.json``: one entry per
        process that started or resumed the run."""
        path = self.path / self.PROVENANCE
        sessions = read_json(path)["sessions"] if path.is_file() else []
        return atomic_write_json(path, {"sessions": [*sessions, record]})

    def amend_provenance(self, facts: dict[str, Any]) -> Path:
        """Add ``facts`` to this process's entry of ``provenance.json`` (the last one),
        e.g. what was measured once the run started."""
        path = self.path / self.PROVENANCE
        sessions = read_json(path)["sessions"] if path.is_file() else [{}]
        return atomic_write_json(path, {"sessions": [*sessions[:-1],
                                                     {**sessions[-1], **facts}]})

    def read_provenance(self) -> list[dict[str, Any]]:
        path = self.path / self.PROVENANCE
        return read_json(path)["sessions"] if path.is_file() else []

    # -- what the study engine writes into a run directory ---------------------------------
    def write_failure(self, error: BaseException) -> Path:
        return atomic_write_json(self.path / self.FAILED,
                                 {"error": str(error), "type": type(error).__name__})

    def read_failure(self) -> dict[str, Any] | None:
        path = self.path / self.FAILED
        return read_json(path) if path.is_file() else None

    def write_pruned(self, reason: str, epoch: int) -> Path:
        return atomic_write_json(self.path / self.PRUNED, {"reason": reason, "epoch": epoch})

    def read_pruned(self) -> dict[str, Any] | None:
        path = self.path / self.PRUNED
        return read_json(path) if path.is_file() else None

    def write_tracking(self, record: dict[str, Any]) -> Path:
        return atomic_write_json(self.path / self.TRACKING, record)

    def read_tracking(self) -> dict[str, Any]:
        path = self.path / self.TRACKING
        return read_json(path) if path.is_file() else {}

    def has_cost(self) -> bool:
        return (self.path / self.COST).is_file()

    def write_cost(self, cost: dict[str, Any]) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        return atomic_write_json(self.path / self.COST, cost)

    def read_cost(self) -> dict[str, Any] | None:
        path = self.path / self.COST
        return read_json(path) if path.is_file() else None

    # -- checkpoints and their retention ---------------------------------------------------
    def checkpoint(self, epoch: int, step: int | None = None) -> Path:
        """``epoch_0003.pt`` after 3 epochs; ``epoch_0003_step_000012.pt`` 12 steps into the
        4th."""
        name = f"epoch_{epoch:04d}" + ("" if step is None else f"_step_{step:06d}")
        return self.checkpoint_dir / f"{name}.pt"

    def checkpoints(self) -> list[Path]:
        """The run's checkpoints, the most advanced (epochs, steps) first."""
        if not self.checkpoint_dir.is_dir():
            return []
        found = [((int(m.group(1)), int(m.group(2) or 0)), p)
                 for p in self.checkpoint_dir.iterdir()
                 if (m := CHECKPOINT_NAME.fullmatch(p.name)) and p.is_file()]
        return [p for _, p in sorted(found, reverse=True)]

    def latest_checkpoint(self) -> Path | None:
        found = self.checkpoints()
        return found[0] if found else None

    def prune_checkpoints(self, keep: int | None, *, best: Path | None = None) -> list[Path]:
        """Delete all but the ``keep`` newest checkpoints and ``best``; returns the deleted
        ones. ``keep`` None keeps every checkpoint.

        Call it only after the newest checkpoint was written (its write is durable when
        :func:`~flarepp.storage.checkpoint.save_checkpoint` returns), so that what
        ``--resume`` reads is never the one removed; it keeps at least one."""
        if keep is None:
            return []
        newest = self.checkpoints()
        kept = set(newest[:max(keep, 1)])
        if best is not None:
            kept.add(Path(best))
        removed = [path for path in newest if path not in kept]
        for path in removed:
            path.unlink(missing_ok=True)
        if removed:
            fsync_directory(self.checkpoint_dir)
        return removed

    def reported_checkpoint(self) -> Path | None:
        """The checkpoint whose weights a finished run reports (``metrics.json`` names it),
        else the newest checkpoint (None without one); always one in this directory: the
        path ``metrics.json`` stores is where the run was trained, so a copied run would
        otherwise read the original's file (and a moved one a file no longer there)."""
        if self.has_metrics():
            named = self.read_metrics().get("checkpoint")
            if named and (self.checkpoint_dir / Path(named).name).is_file():
                return self.checkpoint_dir / Path(named).name
        return self.latest_checkpoint()


def run_checkpoint(path: str | Path) -> Path:
    """The checkpoint ``path`` names: a run directory's reported checkpoint
    (:meth:`RunDir.reported_checkpoint`) or a checkpoint file itself; a path that is
    neither, or a run without a checkpoint yet, is :class:`NotARunDirectory` in a sentence.
    What ``infer``, ``eval``, ``export`` and :func:`flarepp.load` accept."""
    path = Path(path)
    if path.is_dir():
        found = RunDir(path).require_run().reported_checkpoint()
        if found is None:
            raise NotARunDirectory(f"run directory {str(path)!r} holds no checkpoint yet")
        return found
    if not path.exists():
        raise NotARunDirectory(f"{str(path)!r} does not exist: give a flarepp run directory "
                               "or a checkpoint file")
    return path


def owning_run(checkpoint: str | Path) -> RunDir:
    """The run directory a checkpoint file belongs to: the run whose ``checkpoints/`` holds
    it, else (a checkpoint copied elsewhere) the folder it is in."""
    checkpoint = Path(checkpoint)
    folder = checkpoint.parent
    if folder.name == RunDir.CHECKPOINTS and RunDir(folder.parent).is_run():
        return RunDir(folder.parent)
    return RunDir(folder)


def checkpoint_epoch(path: str | Path) -> tuple[int, int | None]:
    """``(epochs, step)`` of a checkpoint file name (``step`` None at an epoch's end)."""
    match = CHECKPOINT_NAME.fullmatch(Path(path).name)
    if match is None:
        raise ValueError(f"{str(path)!r} is not a checkpoint file name (epoch_<n>.pt)")
    return int(match.group(1)), None if match.group(2) is None else int(match.group(2))


# ---------------------------------------------------------------------------------------------
# provenance

def git_commit(path: Path) -> dict[str, Any]:
    """``{"commit", "dirty"}`` of the git checkout holding ``path`` (both None when it is in
    none, or git is not installed: an installed wheel is no checkout)."""
    import subprocess
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(path), *args], capture_output=True,
                                  text=True, timeout=10, check=True).stdout.strip()
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", "."))
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def device_names(devices: Iterable[Any]) -> list[str]:
    """``"cuda:0 (NVIDIA H100 80GB HBM3)"``, ``"cpu (AMD EPYC ...)"`` per device."""
    import platform

    import torch
    names = []
    for device in devices:
        device = torch.device(device)
        if device.type == "cuda":
            names.append(f"{device} ({torch.cuda.get_device_name(device)})")
            continue
        model = platform.processor() or platform.machine()
        with contextlib.suppress(OSError):  # Linux names the CPU model in /proc/cpuinfo
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        names.append(f"{device} ({model}, {os.cpu_count()} logical cores)")
    return names


def provenance(devices: Iterable[Any] = ("cpu",), **extra: Any) -> dict[str, Any]:
    """What produced a run (a record of ``provenance.json``): flarepp's version and git
    commit (None outside a checkout), Python, torch and CUDA versions (CUDA None on a CPU
    build), the devices, the host, the command line and the time; ``extra`` adds facts
    (the parallel layout, the run a fine-tuning started from)."""
    import platform

    import torch

    here = Path(__file__).resolve().parents[1]
    return {"flarepp": __version__, "git": git_commit(here),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "devices": device_names(devices),
            "host": socket.gethostname(), "command": shlex.join(sys.orig_argv),
            "pid": os.getpid(), "time": time.strftime("%Y-%m-%d %H:%M:%S %z"), **extra}


__all__ = ["CHECKPOINT_NAME", "LOCK_NAME", "LockHolder", "NotARunDirectory", "RunDir", "RunLock",
           "RunLocked", "checkpoint_epoch", "device_names", "git_commit", "owning_run",
           "provenance", "run_checkpoint"]
