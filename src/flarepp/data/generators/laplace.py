"""Harmonic fields in a box, written straight into a store: a dataset of any size.

Shape letters: n points of a sample, J modes.

Each sample is ``n`` points drawn uniformly in the unit cube and the field

    u(x, y, z) = sum_{j=1}^{J} a_j exp(-|k_j| z) cos(k_j . (x, y) + phi_j),

a solution of Laplace's equation ``u_xx + u_yy + u_zz = 0`` (each term's ``-|k_j|^2`` from
x and y cancels the ``+|k_j|^2`` from z), with ``J = 3`` modes of random wave vectors
``|k_j|`` in ``[pi, 4 pi]``, amplitudes ``a_j ~ N(0, 1) / j`` and phases ``phi_j`` uniform, by
the sample's own stream ``default_rng([seed, split, index])``. Inputs: the coordinates;
target: ``u``. Samples are generated and written one at a time (:class:`~flarepp.data.
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
LAYOUT = ChannelLayout(inputs=(ChannelGroup("coordinates", ("x", "y", "z"), "point positions"),),
                       targets=(ChannelGroup("u", ("u",), "harmonic field"),),
                       association="point", coordinates=3, dimensions=3)


def harmonic_sample(seed: int, split: int, index: int, points: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """``(coordinates [n, 3], u [n, 1])`` float32 of one sample (module docstring)."""
    rng = np.random.default_rng([seed, split, index])
    xyz = rng.random((points, 3))
    size = rng.uniform(*WAVENUMBERS, MODES)
    angle = rng.uniform(0, 2 * np.pi, MODES)
    k_J2 = size[:, None] * np.stack([np.cos(angle), np.sin(angle)], axis=1)
    amplitude = rng.standard_normal(MODES) / np.arange(1, MODES + 1)
    phase = rng.uniform(0, 2 * np.pi, MODES)
    u = np.zeros(points)
    for j in range(MODES):
        u += amplitude[j] * np.exp(-size[j] * xyz[:, 2]) * np.cos(xyz[:, :2] @ k_J2[j]
                                                                 + phase[j])
    return xyz.astype(np.float32), u[:, None].astype(np.float32)


def make_laplace_store(out: str | Path, *, n_train: int = 1000, n_test: int = 20,
                       resolution: int | None = 100_000, seed: int = 0, progress: bool = True,
                       overwrite: bool = False) -> list[Path]:
    """A store of ``n_train`` + ``n_test`` samples of ``resolution`` points each in ``out``;
    a killed generation resumes where it stopped. Returns the manifest's path."""
    points = 100_000 if resolution is None else int(resolution)
    if n_train < 1 or n_test < 1 or points < 2 or seed < 0:
        raise ValueError(f"laplace-store needs train, test >= 1, resolution >= 2 points and "
                         f"seed >= 0, got {n_train}, {n_test}, {points}, {seed}")
    identity = {"generator": "laplace-store", "seed": seed, "points": points,
                "n_train": n_train, "n_test": n_test}
    check_disk_room(Path(out), n_train + n_test, 16 * points, "laplace-store")  # xyz and u
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
                xyz, u = harmonic_sample(seed, code, index, points)
                meta = writer.write(name, {"coordinates": xyz, "u": u},
                                    {"source": source, "conditions": [],
                                     "layout": LAYOUT.to_dict()})
            metas[name] = meta
            splits[split].append(name)
        writer.finish(LAYOUT, splits, metas)
    return [Path(out) / MANIFEST]


__all__ = ["LAYOUT", "harmonic_sample", "make_laplace_store"]
