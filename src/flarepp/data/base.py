"""In-memory mesh datasets: the contract between loaders, generators and the trainer.

Shape letters: S samples, N points (tokens) per sample, I input and O output channels,
G coordinate dimensions. Meshes of different N are padded to a common N with a mask.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class DataError(ValueError):
    """Bad or missing data; the message names the file, the key and what was expected."""


@dataclass
class MeshSamples:
    """``S`` samples as float32 arrays.

    ``x [S, N, I]`` inputs, ``y [S, N, O]`` targets, ``mask [S, N]`` bool (True = real point)
    or ``None`` when every sample has all N points, ``coords [S, N, G]`` point positions for
    plots (``None``: use the first G input channels), ``grid_shape`` the ``(n1, n2)``
    row-major layout of the N points of a structured mesh, or ``None`` for point clouds.
    """

    x: np.ndarray
    y: np.ndarray
    mask: np.ndarray | None = None
    coords: np.ndarray | None = None
    grid_shape: tuple[int, int] | None = None

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def n_points(self) -> int:
        return int(self.x.shape[1])

    def validate(self, source: str) -> "MeshSamples":
        """Check shapes, dtypes and finiteness; ``source`` names the file(s) in errors."""
        if self.x.ndim != 3:
            raise DataError(f"{source}: x must be [S, N, in], got shape {list(self.x.shape)}")
        if self.y.ndim != 3:
            raise DataError(f"{source}: y must be [S, N, out], got shape {list(self.y.shape)}")
        if self.x.shape[:2] != self.y.shape[:2]:
            raise DataError(f"{source}: x {list(self.x.shape)} and y {list(self.y.shape)} "
                            "disagree on samples or points [S, N]")
        if self.mask is not None:
            if self.mask.shape != self.x.shape[:2]:
                raise DataError(f"{source}: mask must be [S, N] = {list(self.x.shape[:2])}, "
                                f"got {list(self.mask.shape)}")
            self.mask = self.mask.astype(bool)
            if not self.mask.any(axis=1).all():
                bad = int(np.flatnonzero(~self.mask.any(axis=1))[0])
                raise DataError(f"{source}: sample {bad} has no real point (mask all False)")
        valid = np.ones(self.x.shape[:2], bool) if self.mask is None else self.mask
        for key in ("x", "y"):
            arr = getattr(self, key)
            if not np.isfinite(arr[valid]).all():
                s, n = np.argwhere(~np.isfinite(arr) & valid[..., None])[0][:2]
                raise DataError(f"{source}: {key} holds NaN or inf (first at sample {s}, "
                                f"point {n})")
        if self.coords is not None and self.coords.shape[:2] != self.x.shape[:2]:
            raise DataError(f"{source}: coords must be [S, N, dims] matching x, got "
                            f"{list(self.coords.shape)}")
        if self.grid_shape is not None and int(np.prod(self.grid_shape)) != self.n_points:
            raise DataError(f"{source}: grid {self.grid_shape} does not hold N={self.n_points}")
        self.x = np.ascontiguousarray(self.x, dtype=np.float32)
        self.y = np.ascontiguousarray(self.y, dtype=np.float32)
        return self

    def subset(self, index: Any) -> "MeshSamples":
        pick = (lambda a: None if a is None else a[index])
        return MeshSamples(self.x[index], self.y[index], pick(self.mask), pick(self.coords),
                           self.grid_shape)


VALIDATION_SEED = 0
"""The seed of the permutation that picks the validation samples (:func:`validation_indices`):
fixed, so the split depends on the data alone, never on a run's seed."""


def validation_indices(n: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(kept, held_out)``: sorted indices of ``n`` training samples, ``held_out`` the
    ``ceil(fraction n)`` first of a permutation seeded by :data:`VALIDATION_SEED`.

    The same ``n`` and ``fraction`` give the same split in every run and on every data
    draw; a permutation rather than the file's last samples, so a file ordered by some
    parameter does not hold out one end of it."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"a validation fraction must be in (0, 1), got {fraction}")
    held = math.ceil(fraction * n)
    if held >= n:
        raise DataError(f"val_fraction={fraction} of {n} training samples holds out {held}, "
                        "leaving none to train on; use a smaller val_fraction")
    order = np.random.default_rng(VALIDATION_SEED).permutation(n)
    return np.sort(order[held:]), np.sort(order[:held])


@dataclass
class DatasetSplits:
    """A benchmark's train and test splits plus what plots need to label fields; ``val``
    a validation split carved from the training data (:meth:`carve_validation`), or None."""

    name: str
    train: MeshSamples
    test: MeshSamples
    field_names: list[str] = field(default_factory=lambda: ["u"])
    units: str = "dimensionless"
    source: str = ""
    val: MeshSamples | None = None

    def carve_validation(self, fraction: float) -> "DatasetSplits":
        """These splits with the training samples :func:`validation_indices` holds out
        moved from ``train`` to ``val``."""
        if self.val is not None:
            raise DataError(f"{self.source or self.name}: a validation split is carved "
                            "once, and these splits have one")
        kept, held = validation_indices(len(self.train), fraction)
        return dataclasses.replace(self, train=self.train.subset(kept),
                                   val=self.train.subset(held))

    @property
    def in_dim(self) -> int:
        return int(self.train.x.shape[-1])

    @property
    def out_dim(self) -> int:
        return int(self.train.y.shape[-1])

    def validate(self) -> "DatasetSplits":
        self.train.validate(f"{self.source or self.name} (train split)")
        self.test.validate(f"{self.source or self.name} (test split)")
        for key, a, b in (("inputs", self.train.x, self.test.x),
                          ("outputs", self.train.y, self.test.y)):
            if a.shape[-1] != b.shape[-1]:
                raise DataError(f"{self.source or self.name}: train and test {key} have "
                                f"{a.shape[-1]} and {b.shape[-1]} channels")
        return self


class DataWarning(UserWarning):
    """Data that can be used but probably not as meant (a constant channel, an outlier)."""


CONSTANT_RTOL = 1e-6
"""A channel is constant when its std is at most this fraction of its |mean| (0 for 0)."""
OUTLIER_Z = 10.0
"""Normalised values beyond this many training standard deviations are reported."""


@dataclass
class Normalizer:
    """One mean and std per channel, fitted on real points of the training split only.

    ``z = (a - mean) / std``. A channel that is constant over the training points
    (``std <= CONSTANT_RTOL * |mean|``, float32 rounding included) gets ``std = 1``: it is
    centred, not scaled, so an unseen shift of 0.5 stays 0.5 instead of growing to
    ``0.5 / 1e-8``; :meth:`fit` warns naming the channel.
    """

    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, arr_SNK: np.ndarray, mask_SN: np.ndarray | None = None, *,
            what: str = "") -> "Normalizer":
        """Fit on ``arr [S, N, K]`` at the points where ``mask [S, N]`` is True; ``what``
        ("input", "output") names the channels in the warning about constant ones."""
        flat = arr_SNK.reshape(-1, arr_SNK.shape[-1])
        if mask_SN is not None:
            flat = flat[mask_SN.reshape(-1)]
        flat = flat.astype(np.float64)
        mean, std = flat.mean(0), flat.std(0)
        constant = std <= CONSTANT_RTOL * np.abs(mean)
        for k in np.flatnonzero(constant):
            label = f"{what} channel" if what else "channel"
            warnings.warn(f"{label} {k} is constant ({mean[k]:.6g}) over the training points; "
                          "it is centred but not scaled (std taken as 1), so it carries no "
                          "information the model can learn from", DataWarning, stacklevel=2)
        std = np.where(constant, 1.0, std)
        return cls(mean.astype(np.float32), std.astype(np.float32))

    def check_range(self, arr_SNK: np.ndarray, mask_SN: np.ndarray | None = None,
                    what: str = "data", *, limit: float = OUTLIER_Z,
                    channels: list[int] | None = None) -> dict[int, float]:
        """``{channel: max |z|}`` for channels whose normalised values at real points exceed
        ``limit`` training standard deviations; warns naming them ({} and silent if none).

        Inputs that far outside the training range are extrapolation: the prediction there
        is not covered by the reported test error. ``channels`` gives the channel numbers to
        report (default ``0, 1, ...``) when this normaliser covers a subset of a sample's.
        """
        flat = np.asarray(arr_SNK).reshape(-1, arr_SNK.shape[-1])
        if mask_SN is not None:
            flat = flat[np.asarray(mask_SN).reshape(-1)]
        if flat.size == 0:
            return {}
        z = np.abs((flat.astype(np.float64) - self.mean) / self.std).max(0)
        names = list(range(flat.shape[-1])) if channels is None else list(channels)
        far = {int(names[k]): float(z[k]) for k in np.flatnonzero(z > limit)}
        if far:
            listed = ", ".join(f"channel {k} reaches |z| = {v:.1f}" for k, v in far.items())
            warnings.warn(f"{what}: {listed} (training std units, limit {limit:g}); these "
                          "values lie far outside the training range, so predictions there "
                          "are extrapolations", DataWarning, stacklevel=2)
        return far

    def encode(self, a):
        return (a - self._like(self.mean, a)) / self._like(self.std, a)

    def decode(self, a):
        return a * self._like(self.std, a) + self._like(self.mean, a)

    def _like(self, stat: np.ndarray, a):
        """``stat`` as a tensor of ``a``'s dtype and device, made once per (dtype, device):
        on a GPU a fresh copy from host memory in every loss would also wait for the
        device's queued work."""
        if isinstance(a, np.ndarray):
            return stat
        import torch
        cache = self.__dict__.setdefault("_tensors", {})
        key = (id(stat), a.dtype, a.device, type(a))
        if key not in cache:
            cache[key] = (stat, torch.as_tensor(stat, dtype=a.dtype, device=a.device))
        return cache[key][1]

    def __getstate__(self) -> dict:  # device tensors stay out of pickles (loader workers)
        return {k: v for k, v in self.__dict__.items() if k != "_tensors"}

    def state_dict(self) -> dict[str, list[float]]:
        return {"mean": self.mean.tolist(), "std": self.std.tolist()}

    @classmethod
    def from_state_dict(cls, state: dict[str, list[float]]) -> "Normalizer":
        return cls(np.asarray(state["mean"], np.float32), np.asarray(state["std"], np.float32))
