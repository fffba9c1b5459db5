"""Checkpoints: written atomically, versioned, enough to rebuild and evaluate the model.

A checkpoint is a ``torch.save`` dict with ``format_version``, ``config`` (RunConfig),
``model_config``, ``model`` and ``ema`` state dicts, ``optimizer``, ``scheduler``,
``scaler``, ``epoch``, ``rng`` (torch CPU RNG and the shuffling generator),
``normalizers`` (x and y), ``history`` (one record per epoch) and ``data`` (field names).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flarepp.data import Normalizer
from flarepp.models import model_from_config
from flarepp.train.config import RunConfig

FORMAT_VERSION = 1
REQUIRED = ("format_version", "config", "model_config", "model", "ema", "epoch",
            "normalizers")


class CheckpointError(ValueError):
    """An unreadable, corrupt or incompatible checkpoint."""


def atomic_write(path: Path, write) -> None:
    """Write via ``write(tmp_path)`` to a temporary file beside ``path``, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    atomic_write(path, lambda tmp: torch.save({"format_version": FORMAT_VERSION, **state}, tmp))


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load and validate; a clear :class:`CheckpointError` for anything unusable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # torch raises many types for a truncated or foreign file
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt or not a flarepp "
                              f"checkpoint ({type(err).__name__}: {err})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {str(path)!r} is not a flarepp checkpoint")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} lacks {missing}")
    if state["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {str(path)!r} has format version "
                              f"{state['format_version']}; this flarepp reads "
                              f"version {FORMAT_VERSION}")
    return state


@dataclass
class TrainedModel:
    """What inference needs: the model (EMA weights), normalizers and the run config."""

    model: nn.Module
    config: RunConfig
    x_norm: Normalizer
    y_norm: Normalizer
    epoch: int
    field_names: list[str]
    units: str


def load_trained_model(path: str | Path, *, ema: bool = True) -> TrainedModel:
    """Rebuild the model from a checkpoint alone (EMA weights by default)."""
    state = read_checkpoint(path)
    model = model_from_config(state["model_config"])
    weights = state["ema"] if ema else state["model"]
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        raise CheckpointError(f"checkpoint {str(path)!r}: weights do not fit its model "
                              f"config ({err})") from None
    model.eval()
    data = state.get("data", {})
    return TrainedModel(model, RunConfig.from_dict(state["config"]),
                        Normalizer.from_state_dict(state["normalizers"]["x"]),
                        Normalizer.from_state_dict(state["normalizers"]["y"]),
                        int(state["epoch"]), data.get("field_names", ["u"]),
                        data.get("units", ""))
