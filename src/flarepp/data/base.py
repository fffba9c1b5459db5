"""Mesh datasets: the contract between loaders, generators, the store and the trainer.

Shape letters: S samples, N points (tokens) per sample, I input and O output channels,
G coordinate dimensions, K conditions per sample. In memory (:class:`MeshSamples`), meshes
of different N are padded to a common N with a mask; a store's samples
(:class:`flarepp.data.store.StoreSamples`) are read one at a time and never padded. Both
answer the same questions (``sample``, ``point_counts``, ``fit_statistics``, ``subset``),
so a task reads either alike.

Statistics (:class:`ChannelStatistics`): per-channel count, mean, population std, min and
max in float64, either of a whole array (:meth:`ChannelStatistics.of_array`) or streamed
over chunks with the pairwise update of Chan, Golub & LeVeque (1979)
(:class:`RunningMoments`), which equals the whole-array value to rounding.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from flarepp.data.fingerprint import data_fingerprint
from flarepp.data.layout import ChannelLayout, plain_layout


class DataError(ValueError):
    """Bad or missing data; the message names the file, the key and what was expected."""


def merge_moments(count_a: int, mean_a: np.ndarray, m2_a: np.ndarray, chunk_K: np.ndarray
                  ) -> tuple[int, np.ndarray, np.ndarray]:
    """Add the rows of ``chunk_K`` to running float64 (count, mean, sum of squared
    deviations): the pairwise update of Chan, Golub & LeVeque (1979)."""
    chunk = np.asarray(chunk_K, dtype=np.float64)
    count_b = len(chunk)
    if count_b == 0:
        return count_a, mean_a, m2_a
    mean_b = chunk.mean(axis=0)
    m2_b = ((chunk - mean_b) ** 2).sum(axis=0)
    count = count_a + count_b
    delta = mean_b - mean_a
    return (count, mean_a + delta * (count_b / count),
            m2_a + m2_b + delta ** 2 * (count_a * count_b / count))


@dataclass
class ChannelStatistics:
    """Per-channel ``count`` of values, ``mean``, population ``std`` (ddof 0), ``low`` and
    ``high`` (min and max), float64 arrays ``[K]``."""

    count: int
    mean: np.ndarray
    std: np.ndarray
    low: np.ndarray
    high: np.ndarray

    @classmethod
    def of_array(cls, arr_SNK: np.ndarray, mask_SN: np.ndarray | None = None
                 ) -> "ChannelStatistics":
        """Of ``arr [..., K]`` at the points where ``mask`` is True, in one float64 array."""
        flat = np.asarray(arr_SNK).reshape(-1, arr_SNK.shape[-1])
        if mask_SN is not None:
            flat = flat[np.asarray(mask_SN).reshape(-1)]
        flat = flat.astype(np.float64)
        return cls(len(flat), flat.mean(0), flat.std(0), flat.min(0), flat.max(0))

    def select(self, channels: list[int]) -> "ChannelStatistics":
        return ChannelStatistics(self.count, self.mean[channels], self.std[channels],
                                 self.low[channels], self.high[channels])


class RunningMoments:
    """:class:`ChannelStatistics` of rows added chunk by chunk (:func:`merge_moments`, in
    float64): memory is one chunk, whatever the number of rows."""

    def __init__(self, channels: int) -> None:
        self.count, self.mean, self.m2 = 0, np.zeros(channels), np.zeros(channels)
        self.low, self.high = np.full(channels, np.inf), np.full(channels, -np.inf)

    def add(self, chunk_nK: np.ndarray) -> None:
        if len(chunk_nK) == 0:
            return
        chunk = np.asarray(chunk_nK, dtype=np.float64)
        self.count, self.mean, self.m2 = merge_moments(self.count, self.mean, self.m2, chunk)
        self.low = np.minimum(self.low, chunk.min(axis=0))
        self.high = np.maximum(self.high, chunk.max(axis=0))

    def result(self, what: str = "data") -> ChannelStatistics:
        if self.count == 0:
            raise DataError(f"{what}: no values to compute statistics from")
        return ChannelStatistics(self.count, self.mean.copy(), np.sqrt(self.m2 / self.count),
                                 self.low.copy(), self.high.copy())


@dataclass
class SplitStatistics:
    """What a task fits on its training split in one pass: inputs ``x``, targets ``y``,
    ``conditions`` (None without), and the samples whose target is zero everywhere."""

    x: ChannelStatistics
    y: ChannelStatistics
    conditions: ChannelStatistics | None
    zero_targets: list[int]


def subset_points(n_points: int, size: int, seed: int) -> np.ndarray:
    """``size`` distinct point indices out of ``n_points``, uniform without replacement,
    drawn by ``default_rng(seed)``, in increasing order (the set is what is drawn; the
    order only makes memory-mapped reads sequential). ``size >= n_points`` gives every
    point."""
    if size >= n_points:
        return np.arange(n_points)
    return np.sort(np.random.default_rng(seed).choice(n_points, size=size, replace=False))


@dataclass
class MeshSamples:
    """``S`` samples as float32 arrays.

    ``x [S, N, I]`` inputs, ``y [S, N, O]`` targets, ``mask [S, N]`` bool (True = real point)
    or ``None`` when every sample has all N points, ``coords [S, N, G]`` point positions for
    plots (``None``: use the first G input channels), ``grid_shape`` the ``(n1, n2)``
    row-major layout of the N points of a structured mesh, or ``None`` for point clouds;
    ``conditions [S, K]`` per-sample global conditions, or ``None``.
    """

    x: np.ndarray
    y: np.ndarray
    mask: np.ndarray | None = None
    coords: np.ndarray | None = None
    grid_shape: tuple[int, int] | None = None
    conditions: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def n_points(self) -> int:
        return int(self.x.shape[1])

    @property
    def in_dim(self) -> int:
        return int(self.x.shape[-1])

    @property
    def out_dim(self) -> int:
        return int(self.y.shape[-1])

    def point_counts(self) -> np.ndarray:
        """Real points of every sample, ``[S]``."""
        if self.mask is None:
            return np.full(len(self), self.n_points, np.int64)
        return self.mask.sum(axis=1).astype(np.int64)

    def sample(self, index: int, points: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """``(x [n, I], y [n, O])`` at sample ``index``'s real points (padding dropped), or
        at ``points``, indices into those real points."""
        x, y = self.x[index], self.y[index]
        if self.mask is not None:
            real = self.mask[index]
            x, y = x[real], y[real]
        if points is not None:
            x, y = x[points], y[points]
        return x, y

    def fit_statistics(self) -> SplitStatistics:
        """Statistics of the real points, each array in one float64 pass."""
        real = np.ones(self.y.shape[:2], bool) if self.mask is None else self.mask
        squares = (np.square(self.y, dtype=np.float64) * real[..., None]).sum((1, 2))
        return SplitStatistics(
            ChannelStatistics.of_array(self.x, self.mask),
            ChannelStatistics.of_array(self.y, self.mask),
            None if self.conditions is None else ChannelStatistics.of_array(self.conditions),
            [int(i) for i in np.flatnonzero(squares == 0)])

    def padded_arrays(self) -> dict[str, np.ndarray]:
        """What the fields task writes beside padded predictions: ``true [S, N, O]``,
        ``coords`` (the first two inputs without ``coords``), ``real [S, N]`` and, when
        present, ``mask`` and ``grid_shape``."""
        arrays = {"true": self.y, "coords": self.coords if self.coords is not None
                  else self.x[..., :2],
                  "real": np.ones(self.y.shape[:2], bool) if self.mask is None else self.mask}
        if self.mask is not None:
            arrays["mask"] = self.mask
        if self.grid_shape is not None:
            arrays["grid_shape"] = np.asarray(self.grid_shape)
        return arrays

    def fingerprint(self, path: Any) -> dict[str, Any]:
        """:func:`flarepp.data.fingerprint.data_fingerprint` of these arrays."""
        return data_fingerprint(self, path)

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
        if self.conditions is not None:
            if self.conditions.shape[:1] != self.x.shape[:1] or self.conditions.ndim != 2:
                raise DataError(f"{source}: conditions must be [S, K] with S = "
                                f"{self.x.shape[0]}, got {list(self.conditions.shape)}")
            if not np.isfinite(self.conditions).all():
                s = int(np.argwhere(~np.isfinite(self.conditions))[0][0])
                raise DataError(f"{source}: conditions hold NaN or inf (first at sample {s})")
            self.conditions = np.ascontiguousarray(self.conditions, dtype=np.float32)
        self.x = np.ascontiguousarray(self.x, dtype=np.float32)
        self.y = np.ascontiguousarray(self.y, dtype=np.float32)
        return self

    def subset(self, index: Any) -> "MeshSamples":
        pick = (lambda a: None if a is None else a[index])
        return MeshSamples(self.x[index], self.y[index], pick(self.mask), pick(self.coords),
                           self.grid_shape, pick(self.conditions))


VALIDATION_SEED = 0
"""The seed of the permutation that picks the validation samples (:func:`validation_indices`):
fixed, so the split depends on the data alone, never on a run's seed."""


def validation_indices(n: int, fraction: float, option: str = "val_fraction"
                       ) -> tuple[np.ndarray, np.ndarray]:
    """``(kept, held_out)``: sorted indices of ``n`` training samples, ``held_out`` the
    ``ceil(fraction n)`` first of a permutation seeded by :data:`VALIDATION_SEED`.

    The same ``n`` and ``fraction`` give the same split in every run and on every data
    draw; a permutation rather than the file's last samples, so a file ordered by some
    parameter does not hold out one end of it. ``option`` names the fraction in errors
    (a store's ``test_fraction`` is drawn the same way)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"{option} must be in (0, 1), got {fraction}")
    held = math.ceil(fraction * n)
    if held >= n:
        raise DataError(f"{option}={fraction} of {n} samples holds out {held}, leaving none "
                        f"to train on; use a smaller {option}")
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
    layout: ChannelLayout | None = None
    points_per_step: int | None = None

    def channel_layout(self) -> ChannelLayout:
        """The data's :class:`~flarepp.data.layout.ChannelLayout`: the one it was read with
        (a store's), or that of an in-memory dataset: its leading ``coords``-wide inputs
        are point positions (none known without ``coords``), its targets its field names."""
        if self.layout is not None:
            return self.layout
        coords = self.train.coords
        return plain_layout(self.in_dim, list(self.field_names),
                            0 if coords is None else int(coords.shape[-1]), self.units)

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
        return self.train.in_dim

    @property
    def out_dim(self) -> int:
        return self.train.out_dim

    def validate(self) -> "DatasetSplits":
        self.train.validate(f"{self.source or self.name} (train split)")
        self.test.validate(f"{self.source or self.name} (test split)")
        for key, a, b in (("inputs", self.train.in_dim, self.test.in_dim),
                          ("outputs", self.train.out_dim, self.test.out_dim)):
            if a != b:
                raise DataError(f"{self.source or self.name}: train and test {key} have "
                                f"{a} and {b} channels")
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
        return cls.from_statistics(ChannelStatistics.of_array(arr_SNK, mask_SN), what=what)

    @classmethod
    def from_statistics(cls, stats: ChannelStatistics, *, what: str = "",
                        names: list[str] | None = None) -> "Normalizer":
        """The standardisation of :class:`ChannelStatistics` (whole-array or streamed);
        ``names`` label the channels in the warning (default their numbers)."""
        mean, std = stats.mean, stats.std
        constant = std <= CONSTANT_RTOL * np.abs(mean)
        for k in np.flatnonzero(constant):
            label = f"{what} channel" if what else "channel"
            shown = k if names is None else repr(names[k])
            warnings.warn(f"{label} {shown} is constant ({mean[k]:.6g}) over the training "
                          "points; it is centred but not scaled (std taken as 1), so it "
                          "carries no information the model can learn from", DataWarning,
                          stacklevel=3)
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
        return self.check_statistics(ChannelStatistics.of_array(flat), what, limit=limit,
                                     channels=channels)

    def check_statistics(self, stats: ChannelStatistics, what: str = "data", *,
                         limit: float = OUTLIER_Z, channels: list[int] | None = None
                         ) -> dict[int, float]:
        """:meth:`check_range` from the data's :class:`ChannelStatistics` (its min and max
        give the largest ``|z|``), so a split read one sample at a time is checked alike."""
        mean, std = self.mean.astype(np.float64), self.std.astype(np.float64)
        z = np.maximum(np.abs((stats.low - mean) / std), np.abs((stats.high - mean) / std))
        names = list(range(len(z))) if channels is None else list(channels)
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
