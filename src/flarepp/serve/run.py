"""A trained run as the server sees it: the one adapter between the server and flarepp's
prediction API.

Shape letters: B samples, N points, G coordinate and F feature channels (I = G + F inputs),
K conditioning tokens of C features, O outputs.

:func:`load_run` is the only place the server loads a run: through the public API (what
:func:`flarepp.load` returns, a ``Predictor``: ``predict(points, features=, conditions=,
mask=, chunk_size=, batch_size=)`` in physical units, its ``layout`` with the channel layout
its data was converted with, its ``config``); new meshes' inputs are built from it by
:func:`flarepp.inference.mesh_cases.mesh_cases`, as ``flarepp infer --mesh`` builds them.
Checkpoints are read with ``torch.load(weights_only=True)``
(:func:`flarepp.storage.checkpoint.read_checkpoint`), so a crafted file cannot run code
when the server loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flarepp.data.convert import layout_spec
from flarepp.data.spec import SpecError
from flarepp.distributed.streaming import streaming_refusal
from flarepp.inference.mesh_cases import run_layout
from flarepp.inference.predictor import InputLayout, Predictor, PredictorError, load_predictor

SURFACE_TASK = "surface"      # inputs: a surface's cell centres and unit normals


@dataclass(frozen=True)
class ServedRun:
    """A loaded run (``predictor``: what :func:`flarepp.load` returns) and why its model
    cannot be streamed in chunks (``streaming``; None when it can: paper App. B)."""

    predictor: Predictor
    streaming: str | None = None

    def predict(self, *args: Any, **kwargs: Any) -> np.ndarray:
        """Physical inputs in, fields ``[(B,) N, O]`` out (``Predictor.predict``)."""
        return self.predictor.predict(*args, **kwargs)

    @property
    def layout(self) -> InputLayout:
        return self.predictor.layout

    @property
    def task(self) -> str:
        return self.predictor.config.task

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
        try:
            layout_spec(run_layout(self.predictor))
        except (PredictorError, SpecError) as err:
            return str(err)
        return None

    def describe(self) -> dict[str, Any]:
        """The run's layout as plain data (for the model's metadata)."""
        layout, channels = self.layout, self.layout.data_layout
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
    return ServedRun(predictor, streaming_refusal(predictor.model))


__all__ = ["SURFACE_TASK", "ServedRun", "load_run"]
