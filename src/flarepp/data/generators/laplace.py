"""Harmonic fields in a box, written straight into a store: a dataset of any size.

Shape letters: n points of a sample, J modes.

Each sample is ``n`` points drawn uniformly in the unit cube and the field

    u(x, y, z) = sum_{j=1}^{J} a_j exp(-|k_j| z) cos(k_j . (x, y) + phi_j),

a solution of Laplace's equation ``u_xx + u_yy + u_zz = 0`` (each term's ``-|k_j|^2`` from
x and y cancels the ``+|k_j|^2`` from z), with ``J = 3`` modes of random wave vectors
``|k_j|`` in ``[pi, 4 pi]``, amplitudes ``a_j ~ N(0, 1) / j`` and phases ``phi_j`` uniform, by
the sample's own stream ``default_rng([seed, split, index])``. Inputs: the coordinates;
target: ``u``, or with ``fields = F > 1`` the targets ``u_1 .. u_F``, each such a field
(``u_1`` is ``u``; ``u_f`` draws its modes from ``default_rng([seed, split, index, f])``):
samples as wide as a CFD case's many output arrays. Samples are generated and written one at a time (:class:`~flarepp.data.
store.StoreWriter`: atomic, resumable), so memory is one sample whatever the store's size:
the data set for a run larger than memory (``scripts/large_data.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from flarepp.data.generators._io import check_disk_room
from flarepp.data.layout import ChannelGroup, ChannelLayout
from flarepp.data.store import MANIFEST, StoreWriter

MODES = 3
WAVENUMBERS = (np.pi, 4 * np.pi)
def laplace_layout(fields: int = 1) -> ChannelLayout:
    """The store's channels: coordinates in, ``u`` (or ``u_1 .. u_F``) out."""
    names = ("u",) if fields == 1 else tuple(f"u_{f}" for f in range(1, fields + 1))
    return ChannelLayout(inputs=(ChannelGroup("coordinates", ("x", "y", "z"),
                                              "point positions"),),
                         targets=(ChannelGroup("u", names, "harmonic field"),),
                         association="point", coordinates=3, dimensions=3)


LAYOUT = laplace_layout(1)


def harmonic_sample(seed: int, split: int, index: int, points: int, fields: int = 1
                    ) -> tuple[np.ndarray, np.ndarray]:
    """``(coordinates [n, 3], u [n, fields])`` float32 of one sample (module docstring)."""
    rng = np.random.default_rng([seed, split, index])
    xyz = rng.random((points, 3))
    u = np.empty((points, fields), np.float32)
    u[:, 0] = _harmonic(rng, xyz)
    xyz32 = xyz.astype(np.float32)
    for f in range(1, fields):
        u[:, f] = _harmonic(np.random.default_rng([seed, split, index, f]), xyz32)
    return xyz32, u


def _harmonic(rng: np.random.Generator, xyz: np.ndarray) -> np.ndarray:
    """``u`` at the points ``xyz [n, 3]`` from ``MODES`` modes drawn from ``rng``, in the
    points' precision (``u_1`` in float64 as ``u`` always was; the other fields in the
    float32 the store keeps, 4x faster)."""
    size = rng.uniform(*WAVENUMBERS, MODES)
    angle = rng.uniform(0, 2 * np.pi, MODES)
    k_J2 = size[:, None] * np.stack([np.cos(angle), np.sin(angle)], axis=1)
    amplitude = rng.standard_normal(MODES) / np.arange(1, MODES + 1)
    phase = rng.uniform(0, 2 * np.pi, MODES)
    dtype = xyz.dtype.type
    u = np.zeros(len(xyz), xyz.dtype)
    for j in range(MODES):
        u += dtype(amplitude[j]) * np.exp(dtype(-size[j]) * xyz[:, 2]) * np.cos(
            xyz[:, :2] @ k_J2[j].astype(xyz.dtype) + dtype(phase[j]))
    return u


def make_laplace_store(out: str | Path, *, n_train: int = 1000, n_test: int = 20,
                       resolution: int | None = 100_000, seed: int = 0, progress: bool = True,
                       overwrite: bool = False, fields: int = 1) -> list[Path]:
    """A store of ``n_train`` + ``n_test`` samples of ``resolution`` points each in ``out``,
    each with ``fields`` target fields; a killed generation resumes where it stopped.
    Returns the manifest's path."""
    points = 100_000 if resolution is None else int(resolution)
    if n_train < 1 or n_test < 1 or points < 2 or seed < 0 or fields < 1:
        raise ValueError(f"laplace-store needs train, test >= 1, resolution >= 2 points, "
                         f"seed >= 0 and fields >= 1, got {n_train}, {n_test}, {points}, "
                         f"{seed}, {fields}")
    identity = {"generator": "laplace-store", "seed": seed, "points": points,
                "n_train": n_train, "n_test": n_test, **({"fields": fields} if fields > 1
                                                           else {})}
    check_disk_room(Path(out), n_train + n_test, 4 * (3 + fields) * points, "laplace-store")
    layout = laplace_layout(fields)
    jobs = [("train", 0, i) for i in range(n_train)] + [("test", 1, i) for i in range(n_test)]
    metas, splits = {}, {"train": [], "test": []}
    with StoreWriter(out, identity, overwrite=overwrite) as writer:
        for split, code, index in tqdm(jobs, desc="laplace-store", unit="sample",
                                       disable=not progress):
            name = f"{split}/sample_{index:06d}"
            source = {"generator": "laplace-store", "seed": seed, "split": split,
                      "index": index}
            meta = writer.finished(name, source)
            if meta is None:
                xyz, u = harmonic_sample(seed, code, index, points, fields)
                meta = writer.write(name, {"coordinates": xyz, "u": u},
                                    {"source": source, "conditions": [],
                                     "layout": layout.to_dict()})
            metas[name] = meta
            splits[split].append(name)
        writer.finish(layout, splits, metas)
    return [Path(out) / MANIFEST]


__all__ = ["LAYOUT", "harmonic_sample", "laplace_layout", "make_laplace_store"]
