"""Checkpoints: written atomically, read without running code, enough to rebuild the model.

A checkpoint is a ``torch.save`` dict with ``format_version``, ``config`` (RunConfig),
``model_config``, ``model`` and ``ema`` state dicts, ``optimizer``, ``scheduler``,
``scaler``, ``epoch``, ``rng`` (torch CPU RNG and the shuffling generator),
``normalizers`` (x and y), ``history`` (one record per epoch) and ``data`` (field names).

Every value is plain data -- tensors, numbers, strings, ``None``, lists, tuples, dicts,
``torch.Size`` / ``dtype`` / ``device`` -- so checkpoints are read with
``torch.load(..., weights_only=True)``, which refuses to unpickle anything else: a crafted
``.pt`` whose pickle would call a function (create a file, start a process) is rejected
before the call. :func:`save_checkpoint` converts numpy scalars and arrays and paths to
plain data and refuses any other object, naming its key, so a checkpoint flarepp writes is
always one it can read back.
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from flarepp.data import Normalizer
from flarepp.device import HOST
from flarepp.io import atomic_write, is_temporary
from flarepp.models import Surrogate, model_from_config
from flarepp.models.causal_lm import CausalLM
from flarepp.storage.config import RunConfig, stored_version
from flarepp.storage.rundir import CHECKPOINT_NAME, RunDir, checkpoint_epoch

FORMAT_VERSION = 1
REQUIRED = ("format_version", "config", "model_config", "model", "ema", "epoch",
            "normalizers")

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.Size,
          torch.dtype, torch.device)


class CheckpointError(ValueError):
    """An unreadable, corrupt, unsafe or incompatible checkpoint."""


def portable_state(state: Any, key: str = "state") -> Any:
    """``state`` with numpy values as Python numbers / tensors and paths as strings.

    Raises :class:`CheckpointError` naming the key of any other kind of object, since
    ``torch.load(weights_only=True)`` could not read it back.
    """
    if isinstance(state, np.generic):  # before _PLAIN: np.float64 subclasses float
        return state.item()
    if isinstance(state, _PLAIN):
        return state
    if isinstance(state, np.ndarray):
        return torch.from_numpy(np.array(state))
    if isinstance(state, os.PathLike):
        return os.fspath(state)
    if isinstance(state, dict):
        items = ((k, portable_state(v, f"{key}.{k}")) for k, v in state.items())
        return OrderedDict(items) if isinstance(state, OrderedDict) else dict(items)
    if isinstance(state, (list, tuple)):
        items = [portable_state(v, f"{key}[{i}]") for i, v in enumerate(state)]
        return items if isinstance(state, list) else tuple(items)
    raise CheckpointError(f"checkpoint {key} holds a {type(state).__module__}."
                          f"{type(state).__qualname__}, which a checkpoint read with "
                          "weights_only=True cannot hold; store tensors, numbers, strings, "
                          "lists or dicts")


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` plus the format version atomically (:func:`flarepp.io.atomic_write`).

    A failed write (a full disk, a file-size limit) leaves the previous checkpoints and no
    temporary, and raises :class:`CheckpointError` naming the file and the free space:
    torch reports such a failure as a bare ``RuntimeError`` about its zip writer."""
    portable = portable_state({"format_version": FORMAT_VERSION, **state})
    try:
        atomic_write(path, lambda tmp: torch.save(portable, tmp))
    except (RuntimeError, OSError) as err:
        path = Path(path)
        try:
            free = f"{shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free"
        except OSError:
            free = "free space unknown"
        reason = err.strerror if isinstance(err, OSError) and err.strerror else \
            str(err).splitlines()[0]
        raise CheckpointError(f"could not write checkpoint {str(path)!r} ({reason}; "
                              f"{free} on its file system): a full disk or a file-size limit "
                              "does this; the earlier checkpoints are intact, so free space "
                              "and continue with --resume") from None


def _load(path: Path) -> Any:
    """``torch.load(weights_only=True)`` with every failure as a sentence about ``path``."""
    name = repr(str(path))
    if path.is_dir():
        raise CheckpointError(f"checkpoint {name} is a directory; give a checkpoint file "
                              "(a run directory's are in its checkpoint folder)")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {name} does not exist")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {name} is empty (0 bytes): its write was "
                              "interrupted or the file was truncated")
    try:
        with warnings.catch_warnings():
            # torch's note on a foreign file's pickle protocol adds nothing to the error below
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location=HOST, weights_only=True)
    except pickle.UnpicklingError as err:
        refused = "weights only" in str(err).lower() or "weights_only" in str(err)
        kind = _pickle_kind(path, str(err)) if refused else "code"
        if kind == "bytes":
            raise CheckpointError(f"checkpoint {name} is corrupt or not a checkpoint: its "
                                  "bytes are neither a torch archive nor a valid pickle "
                                  "(random or overwritten data, or another file "
                                  "format)") from None
        if kind == "data":
            raise CheckpointError(f"checkpoint {name} is a pickle in a form torch's safe "
                                  "loader does not read; it was not written by flarepp "
                                  "(flarepp writes torch archives)") from None
        if refused:
            raise CheckpointError(
                f"checkpoint {name} was refused: it holds Python objects other than tensors "
                "and plain data, and unpickling them could run arbitrary code; flarepp "
                "checkpoints hold none, so this file was not written by flarepp") from None
        raise CheckpointError(f"checkpoint {name} is corrupt or truncated "
                              f"(UnpicklingError: {err})") from None
    except Exception as err:  # torch raises many types for a truncated or foreign file
        raise CheckpointError(f"checkpoint {name} is corrupt, truncated or not a flarepp "
                              f"checkpoint ({type(err).__name__}: {err})") from None


def _pickle_kind(path: Path, message: str) -> str:
    """What a file ``torch.load(weights_only=True)`` refused holds: ``"code"`` when it names
    a Python callable or class (what a crafted pickle needs to run code), ``"data"`` for a
    pickle of plain values in a protocol torch's loader refuses, ``"bytes"`` for anything
    that is no pickle (random or overwritten bytes).

    torch names the refused global in its message for a torch archive; a bare pickle, which
    torch may refuse at its first unsupported opcode before any global, is listed with
    :mod:`pickletools`, which executes nothing."""
    import pickletools
    if "global" in message.lower():
        return "code"
    try:
        with open(path, "rb") as f:
            names = {op.name for op, _, _ in pickletools.genops(f)}
    except Exception:  # pickletools raises ValueError and others on bytes that are no pickle
        return "bytes"
    return "code" if names & {"GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "REDUCE"} else "data"


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load and validate; a clear :class:`CheckpointError` for anything unusable."""
    path = Path(path)
    state = _load(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {str(path)!r} is not a flarepp checkpoint (it "
                              f"holds a {type(state).__name__}, not a dict)")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} lacks {missing}")
    if state["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {str(path)!r} has format version "
                              f"{state['format_version']}; this flarepp reads "
                              f"version {FORMAT_VERSION}")
    try:
        stored_version(state["config"])
    except ValueError as err:
        raise CheckpointError(f"checkpoint {str(path)!r}: its run config's {err}") from None
    return state


# ---------------------------------------------------------------------------------------------
# a run directory's checkpoints

def checkpoints_newest_first(out_dir: str | Path) -> list[Path]:
    """A run directory's checkpoints, the most advanced (epochs, steps) first
    (:meth:`RunDir.checkpoints`)."""
    return RunDir(out_dir).checkpoints()


@dataclass
class CheckpointSearch:
    """The result of :func:`newest_readable_checkpoint`.

    ``path`` / ``state``: the newest checkpoint that reads (``None`` if none does);
    ``unreadable``: the newer ones skipped on the way, each with the reason.
    """

    path: Path | None
    state: dict[str, Any] | None
    unreadable: list[tuple[Path, str]] = field(default_factory=list)

    def message(self) -> str:
        """One sentence per skipped checkpoint and what is used instead ("" if none)."""
        if not self.unreadable:
            return ""
        skipped = "; ".join(reason for _, reason in self.unreadable)
        if self.path is None:
            return f"no checkpoint reads: {skipped}"
        return f"{skipped}; resuming from the newest readable one, {str(self.path)!r}"


def newest_readable_checkpoint(out_dir: str | Path) -> CheckpointSearch:
    """Walk ``out_dir``'s checkpoints newest first and stop at the first that reads.

    A truncated latest checkpoint (a crash during its write on a file system without
    atomic rename, a full disk, a copy cut short) then costs the epochs since the previous
    one instead of the whole run. Incompatible versions are skipped the same way.
    """
    unreadable: list[tuple[Path, str]] = []
    for path in checkpoints_newest_first(out_dir):
        try:
            return CheckpointSearch(path, read_checkpoint(path), unreadable)
        except CheckpointError as err:
            unreadable.append((path, str(err)))
    return CheckpointSearch(None, None, unreadable)


def remove_stale_temporaries(out_dir: str | Path) -> list[Path]:
    """Delete the temporaries that killed atomic writes left in ``out_dir``; returns them.

    Matches :func:`flarepp.io.is_temporary` (``.<name>.<pid>.<random>.tmp``, and the
    ``.<name>.<8 characters>.tmp`` of earlier flarepp versions) anywhere below ``out_dir``.
    Call it while holding the run's :class:`~flarepp.storage.rundir.RunLock`: no other writer
    may be working in the directory then, so every temporary is stale.
    """
    removed: list[Path] = []
    root = Path(out_dir)
    if not root.is_dir():
        return removed
    for folder, _, names in os.walk(root):
        for name in sorted(names):
            path = Path(folder) / name
            if is_temporary(name) and path.is_file() and not path.is_symlink():
                path.unlink()
                removed.append(path)
    return removed


# ---------------------------------------------------------------------------------------------
# inference

@dataclass
class TrainedModel:
    """What inference needs: the model (by default the weights the run reports),
    normalizers and the run config."""

    model: nn.Module
    config: RunConfig
    x_norm: Normalizer
    y_norm: Normalizer
    epoch: int
    field_names: list[str]
    units: str


def rebuild_model(state: dict[str, Any], path: str | Path, *, ema: bool | None = None,
                  dtype: torch.dtype | None = None) -> nn.Module:
    """The one way to rebuild a trained model: its architecture from the checkpoint's
    ``model_config`` alone, then its EMA or live (raw) weights, in eval mode on the CPU.
    ``ema=None`` takes the weights whose errors the run reports (``eval_weights`` of its
    config; EMA for runs stored before that field existed). ``dtype`` (default the model's
    float32) is set before the weights are loaded, so weights stored wider (an imported
    run's float64) are kept."""
    if ema is None:
        ema = RunConfig.from_stored(state["config"]).eval_weights == "ema"
    model = model_from_config(state["model_config"])
    if dtype is not None:
        model = model.to(dtype)
    try:
        model.load_state_dict(state["ema"] if ema else state["model"])
    except RuntimeError as err:
        raise CheckpointError(f"checkpoint {str(path)!r}: weights do not fit its model "
                              f"config ({err})") from None
    return model.eval()


def mesh_normalizers(state: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """The stored normalisers of a model that maps mesh points to fields (``x``, ``y``, and
    ``c``, the conditions', when stored); a sentence for a run of another task (lm, sequence,
    rollout: they store none)."""
    norms = state["normalizers"]
    if not (isinstance(norms, dict) and "x" in norms and "y" in norms):
        config = state["config"] if isinstance(state["config"], dict) else {}
        task = config.get("task", "fields")
        raise CheckpointError(
            f"checkpoint {str(path)!r} is a run of the {task!r} task, whose model does not "
            "map mesh points to fields (it stores no input and output normalisers); score "
            "it with `flarepp eval`" + (", sample from it with `flarepp generate`"
                                        if task == "lm" else ""))
    return norms


MAP_ROLES = {"x": "inputs", "y": "outputs", "c": "conditions"}
"""A run's normalisers by their stored name (``normalizers`` of a checkpoint, a task's
``state_dict``) and the :class:`~flarepp.models.surrogate.Surrogate` map each becomes."""


def unit_maps(normalizers: Mapping[str, Normalizer]) -> dict[str, tuple[np.ndarray, ...]]:
    """The :class:`~flarepp.models.surrogate.Surrogate` maps of a run's normalisers:
    ``{"inputs": (mean_x, std_x), "outputs": (mean_y, std_y), "conditions": (mean_c,
    std_c)}`` for those of ``x``, ``y``, ``c`` given (:data:`MAP_ROLES`; others left out)."""
    return {MAP_ROLES[name]: (norm.mean, norm.std) for name, norm in normalizers.items()
            if name in MAP_ROLES}


def rebuild_surrogate(state: dict[str, Any], path: str | Path, *, ema: bool | None = None
                      ) -> Surrogate:
    """A trained model in physical units: :func:`rebuild_model` with the checkpoint's
    stored normalisers as its maps (:func:`unit_maps`); a sentence for a run of a task that
    stores none (:func:`mesh_normalizers`). The checkpoint is read as stored: the same
    normalisers evaluation and training used."""
    stored = mesh_normalizers(state, path)
    model = rebuild_model(state, path, ema=ema)
    return Surrogate(model, **unit_maps({name: Normalizer.from_state_dict(stored[name])
                                         for name in MAP_ROLES if name in stored}))


def load_trained_model(path: str | Path, *, ema: bool | None = None) -> TrainedModel:
    """Rebuild the model from a checkpoint alone (by default with the weights the run
    reports, :func:`rebuild_model`)."""
    state = read_checkpoint(path)
    mesh_normalizers(state, path)
    model = rebuild_model(state, path, ema=ema)
    data = state.get("data", {})
    return TrainedModel(model, RunConfig.from_stored(state["config"]),
                        Normalizer.from_state_dict(state["normalizers"]["x"]),
                        Normalizer.from_state_dict(state["normalizers"]["y"]),
                        int(state["epoch"]), data.get("field_names", ["u"]),
                        data.get("units", ""))


def load_causal_lm(path: str | Path, *, device: torch.device, ema: bool | None = None
                   ) -> nn.Module:
    """The token decoder of a checkpoint (by default with the weights the run reports,
    :func:`rebuild_model`), on ``device``, eval mode."""
    state = read_checkpoint(path)
    model = rebuild_model(state, path, ema=ema)
    if not isinstance(model, CausalLM) or not model.takes_tokens:
        raise CheckpointError(f"checkpoint {str(path)!r} holds a "
                              f"{state['model_config'].get('arch')!r} model; generation needs "
                              "a causal-lm over tokens (e.g. a run of the lm-tiny preset)")
    return model.to(device)


__all__ = ["CHECKPOINT_NAME", "CheckpointError", "CheckpointSearch", "FORMAT_VERSION",
           "MAP_ROLES", "TrainedModel", "atomic_write", "checkpoints_newest_first",
           "load_causal_lm", "load_trained_model", "mesh_normalizers", "rebuild_model",
           "rebuild_surrogate", "unit_maps", "newest_readable_checkpoint", "portable_state",
           "read_checkpoint", "remove_stale_temporaries", "save_checkpoint",
           "checkpoint_epoch"]
