"""Data benchmarks: conversion throughput and the loader's share of a training step.

* **Conversion** (:func:`conversion_throughput`): ``cases`` generated volume meshes (VTU
  files of ``cells`` tetrahedra each, a cell and a point array) converted by
  :func:`flarepp.data.convert.convert` with data at the cells (centres and volumes
  computed) and at the points; rows written per second of the conversion's wall time.
* **Conversion by cell type** (:func:`conversion_by_cell_type`): one VTU file of about
  ``cells`` cells of one VTK cell type (tetrahedra, hexahedra, wedges, pyramids, or a mix
  of the four), made by VTK's ``vtkCellTypeSource`` with jittered points, converted with
  data at the cells (centres, volumes, a cell array) in a fresh interpreter per file and
  round: wall time per cell, and the same without the time spent waiting for a CPU
  (:func:`~flarepp.bench.fresh.queued_seconds`: what other jobs on a shared machine add),
  and the peak of the resident set above the interpreter's (:mod:`flarepp.bench.memory`),
  beside the bytes of the arrays the case gives the store.
* **Loader share** (:func:`loader_share`): the trainer's own step
  (:meth:`flarepp.train.Trainer.train_step`) on a store-backed fields task, fed by the
  trainer's loader (:func:`flarepp.inference.batching.make_loader`, ``workers`` processes);
  per step the time the loop waits for its next batch and the time of the step itself.
  The share is ``wait / (wait + step)`` over the steps after the first (the first also
  waits for the workers to start, reported apart).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from flarepp.bench.fresh import in_fresh_interpreter, queued_seconds
from flarepp.bench.memory import peak_rss_since, reset_peak_rss
from flarepp.data.convert import convert
from flarepp.data.spec import parse_spec


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


CELL_TYPES = {"tetra": 10, "hexahedron": 12, "wedge": 13, "pyramid": 14}
"""VTK cell type ids of the volume cells :func:`cell_type_mesh` makes ("mixed": all four)."""


def cell_type_mesh(cell_type: str, cells: int, seed: int = 0):
    """A VTK unstructured grid of about ``cells`` cells of ``cell_type`` (a key of
    :data:`CELL_TYPES`, or ``"mixed"``: a quarter of each, side by side), a box of
    ``vtkCellTypeSource`` blocks whose points are jittered by up to a tenth of a block,
    with a point array ``T`` and a cell array ``p``."""
    import pyvista as pv
    from vtkmodules.vtkFiltersSources import vtkCellTypeSource
    if cell_type == "mixed":
        parts = [cell_type_mesh(t, max(1, cells // 4), seed + k).translate((1.5 * k, 0, 0))
                 for k, t in enumerate(CELL_TYPES)]
        return pv.merge(parts, merge_points=False)
    if cell_type not in CELL_TYPES:
        raise ValueError(f"unknown cell type {cell_type!r}; known: "
                         f"{', '.join([*CELL_TYPES, 'mixed'])}")
    source = vtkCellTypeSource()
    source.SetCellType(CELL_TYPES[cell_type])
    source.SetBlocksDimensions(1, 1, 1)
    source.Update()
    per_block = source.GetOutput().GetNumberOfCells()
    side = max(1, round((cells / per_block) ** (1 / 3)))
    source.SetBlocksDimensions(side, side, side)
    source.Update()
    mesh = pv.wrap(source.GetOutput()).scale(1 / side)
    rng = np.random.default_rng(seed)
    mesh.points = np.asarray(mesh.points) + rng.uniform(-0.1 / side, 0.1 / side,
                                                        mesh.points.shape)
    mesh.point_data["T"] = np.sin(3 * mesh.points[:, 0])
    mesh.cell_data["p"] = rng.standard_normal(mesh.n_cells)
    return mesh


def _convert_one(job: dict[str, Any]) -> dict[str, Any]:
    """Convert the file ``job["path"]`` (data at cells) into a store in ``job["out"]``:
    wall time, the peak resident set above the one before, the arrays' bytes."""
    import pyvista  # noqa: F401  (the readers' import is not the conversion's cost)
    spec = parse_spec({"association": "cell", "geometry": ["coordinates", "volumes"],
                       "targets": ["p"]})
    shutil.rmtree(job["out"], ignore_errors=True)      # no case of an earlier round reused
    baseline, queued = reset_peak_rss(), queued_seconds()
    started = time.perf_counter()
    report = convert(job["path"], job["out"], spec, overwrite=True, progress=False)
    seconds = time.perf_counter() - started
    peak, queued = peak_rss_since(baseline), queued_seconds() - queued
    arrays = sum(p.stat().st_size for p in Path(job["out"]).rglob("*.npy"))
    return {"cells": report.rows, "seconds": seconds, "uncontended_s": seconds - queued,
            "peak_bytes": peak, "array_bytes": arrays, "baseline_bytes": baseline}


def conversion_by_cell_type(cell_types: list[str], cells: int = 1_000_000, *, rounds: int = 1,
                            work_dir: str | None = None) -> list[dict[str, Any]]:
    """Per cell type (module docstring), the median over ``rounds`` (interleaved: every
    round converts every file once) of the wall seconds and microseconds per cell, the
    largest peak memory, the file's and the stored arrays' bytes."""
    import statistics

    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        files = {}
        for cell_type in cell_types:
            files[cell_type] = Path(tmp) / f"{cell_type}.vtu"
            cell_type_mesh(cell_type, cells).save(files[cell_type])
        records: dict[str, list[dict[str, Any]]] = {t: [] for t in cell_types}
        for _ in range(rounds):
            for cell_type, path in files.items():
                job = {"job": f"{__name__}:_convert_one", "path": str(path),
                       "out": str(Path(tmp) / "store")}
                records[cell_type].append(in_fresh_interpreter(
                    job, what=f"converting {cell_type} cells"))
        out = []
        for cell_type, mine in records.items():
            seconds = statistics.median(r["seconds"] for r in mine)
            uncontended = statistics.median(r["uncontended_s"] for r in mine)
            out.append({"cell_type": cell_type, "cells": mine[0]["cells"], "seconds": seconds,
                        "us_per_cell": 1e6 * seconds / mine[0]["cells"],
                        "uncontended_s": uncontended,
                        "uncontended_us_per_cell": 1e6 * uncontended / mine[0]["cells"],
                        "peak_bytes": max(r["peak_bytes"] for r in mine),
                        "array_bytes": mine[0]["array_bytes"],
                        "file_bytes": files[cell_type].stat().st_size,
                        "rounds": [r["seconds"] for r in mine]})
    return out


def loader_share(store: str | Path, *, preset: str = "store-tiny", workers: int = 0,
                 steps: int = 40, points_per_step: int | None = None,
                 overrides: list[str] | None = None) -> dict[str, Any]:
    """Wait and step times of ``steps`` training steps of ``preset`` on ``store`` with
    ``workers`` loader processes (module docstring)."""
    import torch

    # here, not at the top: the conversion workers, which import this module, need no trainer
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


__all__ = ["CELL_TYPES", "cell_type_mesh", "conversion_by_cell_type", "conversion_throughput",
           "loader_share", "volume_cases"]
