"""Data benchmarks: conversion throughput and the loader's share of a training step.

* **Conversion** (:func:`conversion_throughput`): ``cases`` generated volume meshes (VTU
  files of ``cells`` tetrahedra each, a cell and a point array) converted by
  :func:`flarepp.data.convert.convert` with data at the cells (centres and volumes
  computed) and at the points; rows written per second of the conversion's wall time.
* **Loader share** (:func:`loader_share`): the trainer's own step
  (:meth:`flarepp.train.Trainer.train_step`) on a store-backed fields task, fed by the
  trainer's loader (:func:`flarepp.inference.batching.make_loader`, ``workers`` processes);
  per step the time the loop waits for its next batch and the time of the step itself.
  The share is ``wait / (wait + step)`` over the steps after the first (the first also
  waits for the workers to start, reported apart).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def volume_cases(folder: Path, cases: int, cells: int, seed: int = 0) -> list[Path]:
    """``cases`` VTU files of about ``cells`` tetrahedra (a jittered box split into
    tetrahedra), a point array ``T`` and a cell array ``p``."""
    import pyvista as pv
    side = max(2, round((cells / 6) ** (1 / 3)))       # 6 tetrahedra per voxel
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(cases):
        mesh = pv.ImageData(dimensions=(side + 1,) * 3, spacing=(1 / side,) * 3)
        mesh = mesh.triangulate().cast_to_unstructured_grid()
        mesh.points = np.asarray(mesh.points) + rng.uniform(-0.1 / side, 0.1 / side,
                                                            mesh.points.shape)
        mesh.point_data["T"] = np.sin(3 * mesh.points[:, 0]) * (i + 1)
        mesh.cell_data["p"] = rng.standard_normal(mesh.n_cells)
        paths.append(folder / f"case_{i:03d}.vtu")
        mesh.save(paths[-1])
    return paths


def conversion_throughput(cases: int = 8, cells: int = 50_000, work_dir: str | None = None
                          ) -> dict[str, Any]:
    """Rows per second of converting ``cases`` VTU files, at cells and at points."""
    from flarepp.data.convert import convert
    from flarepp.data.spec import parse_spec
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        source = Path(tmp) / "cases"
        volume_cases(source, cases, cells)
        out = {}
        for association, spec in (
                ("cell", {"association": "cell", "geometry": ["coordinates", "volumes"],
                          "targets": ["p"]}),
                ("point", {"association": "point", "targets": ["T"]})):
            report = convert(source, Path(tmp) / f"store-{association}", parse_spec(spec),
                             progress=False)
            out[association] = {"cases": cases, "rows": report.rows,
                                "seconds": report.seconds,
                                "rows_per_s": report.rows / report.seconds}
    return out


def loader_share(store: str | Path, *, preset: str = "store-tiny", workers: int = 0,
                 steps: int = 40, points_per_step: int | None = None,
                 overrides: list[str] | None = None) -> dict[str, Any]:
    """Wait and step times of ``steps`` training steps of ``preset`` on ``store`` with
    ``workers`` loader processes (module docstring)."""
    import torch

    from flarepp.inference.batching import epoch_keys, make_loader
    from flarepp.train import Trainer, get_preset
    sets = [f"loader_workers={workers}", "device=cpu", *(overrides or [])]
    if points_per_step is not None:
        sets.append(f"dataset_options.points_per_step={points_per_step}")
    config = get_preset(preset, sets)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(config, run_dir, data_root=store, progress=False)
        try:
            task = trainer.task
            n = task.num_samples("train")
            batches = []
            while len(batches) < steps + 1:
                order = torch.randperm(n, generator=trainer.shuffle).numpy()
                batches += epoch_keys(order, config.batch_size, 0, 1, len(batches))
            loader = make_loader(task, "train", batches[:steps + 1], training=True,
                                 workers=workers, pin_memory=False)
            waits, computes = [], []
            it = iter(loader)
            for _ in range(steps + 1):
                started = time.perf_counter()
                micro, weight = next(it)
                ready = time.perf_counter()
                trainer.train_step(micro, weight).item()        # the step, to its end
                waits.append(ready - started)
                computes.append(time.perf_counter() - ready)
        finally:
            trainer.close()
    wait, compute = float(np.sum(waits[1:])), float(np.sum(computes[1:]))
    return {"workers": workers, "steps": steps, "first_wait_s": waits[0], "wait_s": wait,
            "step_s": compute, "loader_share": wait / (wait + compute),
            "points_per_step": points_per_step, "preset": preset}


__all__ = ["conversion_throughput", "loader_share", "volume_cases"]
