"""A trained run as the server sees it: the one adapter between the server and flarepp's
prediction API.

Shape letters: B samples, N points, G coordinate and F feature channels (I = G + F inputs),
K conditioning tokens of C features, O outputs.

:func:`load_run` is the only place the server touches the predictor. It loads a run through
the public API (what :func:`flarepp.load` returns: ``predict(points, features=,
conditions=, mask=, chunk_size=)`` in physical units, its ``layout`` and ``config``) and
reads what the run stored about its data (the channel layout its conversion recorded, from
which a new mesh's inputs are built). Checkpoints are read with ``torch.load(weights_only=
True)`` (:func:`flarepp.storage.checkpoint.read_checkpoint`), so a crafted file cannot run
code when the server loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from flarepp.data.convert import layout_spec
from flarepp.data.layout import ChannelLayout
from flarepp.data.spec import SpecError
from flarepp.distributed.streaming import streaming_refusal
from flarepp.inference.predictor import InputLayout, load_predictor
from flarepp.storage.checkpoint import read_checkpoint
from flarepp.storage.rundir import RunDir

SURFACE_TASK = "surface"      # inputs: a surface's cell centres and unit normals


@dataclass(frozen=True)
class ServedRun:
    """``predict`` (physical inputs in, fields ``[(B,) N, O]`` out), the run's input
    ``layout``, its ``task``, the channel layout its data was converted with (``channels``;
    None where the run stored none), the ``checkpoint`` it came from, and why its model
    cannot be streamed in chunks (``streaming``; None when it can: paper App. B)."""

    predict: Callable[..., np.ndarray]
    layout: InputLayout
    task: str
    channels: ChannelLayout | None
    checkpoint: Path
    streaming: str | None = None

    @property
    def coordinates(self) -> int:
        """G: the leading input channels a request gives as ``points``."""
        layout = self.layout
        return layout.channels if layout.coordinates is None else layout.coordinates

    def split_inputs(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """``(points [..., G], features [..., F] or None)`` of inputs ``x [..., I]``."""
        g = self.coordinates
        return x[..., :g], (x[..., g:] if x.shape[-1] > g else None)

    def mesh_support(self) -> str | None:
        """None when a mesh file's inputs can be built for this run, else why not."""
        if self.task == SURFACE_TASK:
            return None
        if self.channels is None:
            return (f"this {self.task!r} run stored no channel layout, so its inputs cannot "
                    "be built from a mesh; send its inputs as tensors")
        try:
            layout_spec(self.channels)
        except SpecError as err:
            return str(err)
        return None

    def describe(self) -> dict[str, Any]:
        """The run's layout as plain data (for the model's metadata)."""
        layout, channels = self.layout, self.channels
        association = "cell" if self.task == SURFACE_TASK else (
            channels.association if channels is not None else "point")
        return {"task": self.task, "coordinates": self.coordinates,
                "features": layout.channels - self.coordinates,
                "input_names": list(layout.names or ()),
                "conditions": None if layout.conditions is None else list(layout.conditions),
                "condition_names": list(layout.condition_names),
                "field_names": list(layout.field_names), "units": layout.units,
                "association": association, "mesh": self.mesh_support() or "supported",
                "streaming": self.streaming or "supported"}


def load_run(path: str | Path, *, device: str = "cpu") -> ServedRun:
    """The :class:`ServedRun` of a run directory (its reported checkpoint) or checkpoint
    file, on ``device`` (module docstring)."""
    predictor = load_predictor(path, device=device)
    path = Path(path)
    checkpoint = RunDir(path).reported_checkpoint() if path.is_dir() else path
    data = read_checkpoint(checkpoint).get("data", {})
    channels = ChannelLayout.from_dict(data["layout"]) if "layout" in data else None
    if channels is not None and predictor.layout.conditions is None:
        channels = channels.with_conditions([])        # the model takes none of them
    return ServedRun(predictor.predict, predictor.layout, predictor.config.task, channels,
                     checkpoint, streaming_refusal(predictor.model))


__all__ = ["SURFACE_TASK", "ServedRun", "load_run"]
