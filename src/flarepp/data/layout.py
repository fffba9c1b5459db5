"""The channel layout of a dataset: what each input, target and condition channel is.

A model sees ``x [N, I]`` per sample and predicts ``y [N, O]``, optionally with per-sample
conditions ``c [K]``. The layout names those channels, groups them by the array they came
from (``coordinates`` (x, y, z), ``U`` (U_x, U_y, U_z), ...), says which leading input
channels are spatial coordinates, where the values live (``point`` or ``cell``), and the
unit scale applied when they were stored. A store records it in its manifest
(:mod:`flarepp.data.store`); the fields task stores it in every checkpoint, so a predictor
can assemble inputs from a mesh, and predictions can be written back onto it, from the
description alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ASSOCIATIONS = ("point", "cell")
"""Where a sample's values live: at the mesh's points or at its cells (centres)."""


@dataclass(frozen=True)
class ChannelGroup:
    """Consecutive channels from one source: ``name`` as stored, its ``channels`` (one name
    each), ``source`` (the array in the files, or the geometry computed: ``cell centres``,
    ...), the ``scale`` its values were multiplied by when stored, and their ``units``."""

    name: str
    channels: tuple[str, ...]
    source: str = ""
    scale: float = 1.0
    units: str = ""

    @property
    def width(self) -> int:
        return len(self.channels)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["channels"] = list(self.channels)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ChannelGroup":
        return cls(**{**d, "channels": tuple(d["channels"])})


def channel_names(name: str, width: int) -> tuple[str, ...]:
    """``(name,)`` for one channel, ``name_x, name_y[, name_z]`` for 2 or 3 (a vector),
    ``name_0, name_1, ...`` otherwise."""
    if width == 1:
        return (name,)
    if width in (2, 3):
        return tuple(f"{name}_{axis}" for axis in "xyz"[:width])
    return tuple(f"{name}_{k}" for k in range(width))


@dataclass(frozen=True)
class ChannelLayout:
    """Inputs, targets and conditions of a dataset, in the order the model sees them.

    ``coordinates``: how many leading input channels are spatial coordinates (point
    positions, or cell centres when ``association`` is ``cell``); 0 when unknown or none.
    ``dimensions``: the spatial dimension of those coordinates."""

    inputs: tuple[ChannelGroup, ...]
    targets: tuple[ChannelGroup, ...]
    conditions: tuple[ChannelGroup, ...] = ()
    association: str = "point"
    coordinates: int = 0
    dimensions: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def input_channels(self) -> list[str]:
        return [c for g in self.inputs for c in g.channels]

    @property
    def target_channels(self) -> list[str]:
        return [c for g in self.targets for c in g.channels]

    @property
    def condition_names(self) -> list[str]:
        return [c for g in self.conditions for c in g.channels]

    def with_conditions(self, names: list[str]) -> "ChannelLayout":
        """This layout keeping only the conditions named (in the given order)."""
        groups = {g.name: g for g in self.conditions}
        return ChannelLayout(self.inputs, self.targets, tuple(groups[n] for n in names),
                             self.association, self.coordinates, self.dimensions,
                             dict(self.extra))

    def to_dict(self) -> dict[str, Any]:
        return {"association": self.association, "dimensions": self.dimensions,
                "coordinates": self.coordinates,
                "inputs": [g.to_dict() for g in self.inputs],
                "targets": [g.to_dict() for g in self.targets],
                "conditions": [g.to_dict() for g in self.conditions],
                "input_channels": self.input_channels,
                "target_channels": self.target_channels,
                "condition_names": self.condition_names, **self.extra}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ChannelLayout":
        derived = {"input_channels", "target_channels", "condition_names"}
        known = {"association", "dimensions", "coordinates", "inputs", "targets",
                 "conditions"}
        return cls(inputs=tuple(ChannelGroup.from_dict(g) for g in d["inputs"]),
                   targets=tuple(ChannelGroup.from_dict(g) for g in d["targets"]),
                   conditions=tuple(ChannelGroup.from_dict(g) for g in d.get("conditions", [])),
                   association=d.get("association", "point"),
                   coordinates=int(d.get("coordinates", 0)),
                   dimensions=int(d.get("dimensions", 0)),
                   extra={k: v for k, v in d.items() if k not in known | derived})


def plain_layout(in_dim: int, field_names: list[str], coordinates: int,
                 units: str = "") -> ChannelLayout:
    """The layout of an in-memory benchmark or ``npz`` dataset: its first ``coordinates``
    inputs are the point positions (``x, y[, z]``), the others ``input_k``; the targets are
    its field names."""
    dims = coordinates if 0 < coordinates <= 3 else 0
    groups = []
    if dims:
        groups.append(ChannelGroup("coordinates", tuple("xyz"[:dims]), "point positions"))
    if in_dim > dims:
        groups.append(ChannelGroup("inputs", tuple(f"input_{k}" for k in range(dims, in_dim))))
    targets = (ChannelGroup("targets", tuple(field_names), units=units),)
    return ChannelLayout(tuple(groups), targets, association="point", coordinates=dims,
                         dimensions=dims)


__all__ = ["ASSOCIATIONS", "ChannelGroup", "ChannelLayout", "channel_names", "plain_layout"]
