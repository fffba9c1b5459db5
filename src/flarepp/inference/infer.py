"""``flarepp infer``'s one flow: read cases, check them against the run's model, predict
each through the :class:`~flarepp.inference.predictor.Predictor` (its surrogate under its
execution), write them as they come.

Shape letters: S samples, N points, I input and O output channels.

A **case** is what is predicted and written together: the samples ``x [S, N, I]`` of a
fields dataset split or an ``.npz`` of inputs (one unnamed case, written as ``pred [S, N,
O]``, ``rel_l2 [S]`` and ``mask``), or one named case per sample of a store (a converted
mesh, with its conditions), per car surface of the surface task, or per geometry file
(``--geometry``: cell centres and normals of a surface alone): written as ``pred_<name> [N,
O]`` as it is predicted, one in memory at a time, then ``cases``, ``cells``, ``seconds``,
``nmse`` and ``rel_l2``.

**On the mesh** (:func:`write_on_mesh`, ``flarepp infer --write-mesh DIR``): each sample's
prediction ``pred_<field>``, and with targets ``true_<field>`` and ``error_<field>`` (pred -
true), as point or cell arrays of its source mesh (a store's sample remembers its file; a
car its ``.vtp``; a geometry its file), written as ``DIR/<name>.vtu`` or ``.vtp`` beside a
picture ``DIR/<name>.png``; samples without a source mesh (generated or ``.npz`` data)
become point clouds (``.vtp``) at their coordinates.
"""

from __future__ import annotations

import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from flarepp.data import DataError, MeshSamples, load_dataset
from flarepp.data.loaders import read_npz
from flarepp.data.meshes import cell_geometry, point_cloud, read_mesh, write_fields
from flarepp.data.store import StoreSamples
from flarepp.device import peak_host_memory
from flarepp.inference.predictor import Predictor, PredictorError
from flarepp.io import atomic_write
from flarepp.plots import plot_fields
from flarepp.storage.locks import file_safe
from flarepp.tasks import TASKS
from flarepp.tasks.surface import METRIC_SCALE, integrated_forces


@dataclass
class Case:
    """Samples predicted together: ``name`` (a store sample, car or geometry; None for a
    split's samples), physical inputs ``x``, targets ``y`` (None without), ``mask`` (None:
    every point is real), per-sample ``conditions [S, K]``, the ``source`` mesh file its rows
    are the points or cells (``association``) of, and cell ``areas [N]`` of a surface."""

    name: str | None
    x: np.ndarray
    y: np.ndarray | None = None
    mask: np.ndarray | None = None
    conditions: np.ndarray | None = None
    source: str | None = None
    association: str = "point"
    areas: np.ndarray | None = None


def read_cases(predictor: Predictor, data: str | Path, *, split: str = "test",
               dataset: str | None = None) -> Iterator[Case]:
    """The cases of ``data``: an ``.npz`` of inputs (``x [S, N, I]``, optional ``mask``),
    the run's task's own cases (the surface task: one car at a time) or a split of a fields
    dataset (the run's, or ``dataset``)."""
    config = predictor.config
    path = Path(data)
    if path.suffix == ".npz" and path.is_file():
        f = read_npz(path)  # an archive of objects or of nothing is a sentence
        if "x" in f and "y" not in f:
            x = np.asarray(f["x"], np.float32)
            mask = np.asarray(f["mask"], bool) if "mask" in f else None
            if x.ndim != 3 or (mask is not None and mask.shape != x.shape[:2]):
                raise PredictorError(
                    f"{path}: expected x [S, N, in] and optional mask [S, N], got x "
                    f"{list(x.shape)}" + ("" if mask is None else f", mask {list(mask.shape)}"))
            yield Case(None, x, None, mask)
            return
    own = (None if dataset or path.suffix == ".npz"
           else TASKS.get(config.task).inference_cases(config, data, split))
    if own is not None:
        for name, x, y, source in own:
            yield Case(name, x, y, source=source, association="cell")
        return
    name = dataset or config.dataset
    options = config.dataset_options if name == config.dataset else {}
    splits = load_dataset(name, path, **options)
    samples = getattr(splits, split, None)
    if isinstance(samples, StoreSamples):
        yield from store_cases(samples)
        return
    if not isinstance(samples, MeshSamples):
        raise PredictorError(f"--dataset {name!r} is not read as (x, y) samples on meshes (it "
                             f"holds {type(splits).__name__}), so a {config.task!r} "
                             "checkpoint cannot predict it; give a dataset of the fields "
                             "task (e.g. darcy, elasticity, npz)")
    yield Case(None, samples.x, samples.y, samples.mask, samples.conditions)


def store_cases(samples: StoreSamples) -> Iterator[Case]:
    """One case per sample of a store's split, read when its turn comes (never padded), with
    its conditions and source mesh file."""
    association, conditions = samples.store.layout.association, samples.conditions
    for i, name in enumerate(samples.names):
        x, y = samples.sample(i)
        source = samples.source_of(i)
        yield Case(name, x[None], y[None] if y.shape[1] else None, None,
                   None if conditions is None else conditions[i:i + 1],
                   source.get("case") if isinstance(source, dict) else source, association)


def geometry_case(path: str | Path) -> Case:
    """A surface geometry alone (STL, VTP, ... any format :func:`~flarepp.data.meshes.
    read_mesh` reads) as the surface task's inputs: each cell's centre and unit normal
    (:func:`~flarepp.data.meshes.cell_geometry`, as the DrivAerML reader computes them), its
    area kept for the integrated force."""
    path = Path(path)
    cells = cell_geometry(read_mesh(path), path)
    if cells.dimension != 2:
        raise DataError(f"{path}: its cells are {cells.dimension}-D; a geometry for the "
                        "surface task is a surface of triangles, quads or polygons")
    x = np.concatenate([cells.centres, cells.normals], axis=1).astype(np.float32)[None]
    return Case(path.stem, x, source=str(path), association="cell", areas=cells.measures)


def check_case(source: str, case: Case, predictor: Predictor) -> None:
    """Inputs and targets that fit the run's model, and finite inputs at every real point
    (a NaN input makes the whole sample's prediction NaN, which would be written without a
    word)."""
    config = predictor.model.config
    if case.x.shape[-1] != config.in_dim:
        raise PredictorError(f"{source}: inputs have {case.x.shape[-1]} channels, the "
                             f"checkpoint's model takes {config.in_dim}")
    if case.y is not None and case.y.shape[-1] != config.out_dim:
        raise PredictorError(f"{source}: targets have {case.y.shape[-1]} channels, the "
                             f"checkpoint's model predicts {config.out_dim}, so no error can "
                             "be computed against them")
    finite = np.isfinite(case.x).all(axis=-1)
    if case.mask is not None:
        finite |= ~case.mask
    if not finite.all():
        sample, point = (int(i[0]) for i in np.nonzero(~finite))
        raise DataError(f"{source}: the inputs x hold non-finite values (NaN or inf) at "
                        f"{int((~finite).sum())} point(s) of {int((~finite).any(axis=1).sum())} "
                        f"sample(s), first at sample {sample}, point {point}; their "
                        "predictions would be NaN")


def predict_cases(predictor: Predictor, cases: Iterable[Case], *, source: str = "",
                  batch_size: int = 1) -> Iterator[dict[str, Any]]:
    """Each case checked and predicted, one at a time: ``name``, ``pred`` (physical, zero at
    padding), ``mask``, ``cells`` (real points), wall ``seconds``, ``peak_gib`` (this
    process's peak resident memory so far), and against targets ``rel_l2`` per sample
    (``||pred - y|| / ||y||`` over real points and channels, float64) and ``nmse`` (100 x
    the MSE of the channels standardised by the run's output map)."""
    takes = predictor.layout is not None and predictor.layout.conditions is not None
    for case in cases:
        check_case(source or str(case.name), case, predictor)
        if takes and case.conditions is None:
            raise PredictorError(f"{source or case.name}: this run's model is conditioned on "
                                 "per-sample conditions, but the data gives none")
        start = time.perf_counter()
        pred = predictor.predict_arrays(case.x, case.mask, None if not takes
                                        else case.conditions[:, None, :],
                                        batch_size=batch_size)
        result = {"name": case.name, "pred": pred, "mask": case.mask, "case": case,
                  "seconds": time.perf_counter() - start,
                  "cells": int(pred.shape[0] * pred.shape[1] if case.mask is None
                               else case.mask.sum())}
        if case.areas is not None and pred.shape[-1] == 4:  # a surface: its predicted force
            fields, normals = (torch.from_numpy(a[:1]).double() for a in (pred, case.x[..., 3:6]))
            result["force"] = integrated_forces(fields, normals,
                                                torch.from_numpy(case.areas[None])).numpy()[0]
        if case.y is not None:
            real = (np.ones(pred.shape[:2], bool) if case.mask is None else case.mask)
            err = (pred.astype(np.float64) - case.y) * real[..., None]
            ref = np.asarray(case.y, np.float64) * real[..., None]
            rel = np.sqrt(np.square(err).sum((1, 2)) / np.square(ref).sum((1, 2)))
            scale = predictor.surrogate.output_scale.double().cpu().numpy()
            standardised = err[real] / scale
            result.update(rel_l2=rel, nmse=METRIC_SCALE * float(np.mean(np.square(standardised))))
        result["peak_gib"] = peak_host_memory() / 2 ** 30
        yield result


def write_predictions(path: str | Path, results: Iterable[dict[str, Any]]) -> list[dict]:
    """Write the cases into the ``.npz`` at ``path`` as they arrive, atomically (module
    docstring: one unnamed case as ``pred``, ``rel_l2``, ``mask``; named cases as
    ``pred_<name>`` and the per-case numbers). Returns the per-case numbers (no arrays)."""
    done: list[dict[str, Any]] = []

    def array(archive: zipfile.ZipFile, key: str, value: Any) -> None:
        with archive.open(f"{key}.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array(f, np.asarray(value))

    def write(tmp):
        with zipfile.ZipFile(tmp, "w", allowZip64=True) as archive:
            for r in results:
                if r["name"] is None:
                    array(archive, "pred", r["pred"])
                    for key in ("rel_l2", "mask"):
                        if r.get(key) is not None:
                            array(archive, key, r[key])
                else:
                    array(archive, f"pred_{r['name']}", r["pred"][0])
                done.append({k: v for k, v in r.items() if k not in ("pred", "mask", "case")})
            named = [r for r in done if r["name"] is not None]
            if named:
                array(archive, "cases", [r["name"] for r in named])
                for key in ("cells", "seconds", "nmse", "rel_l2"):
                    if all(key in r for r in named):
                        array(archive, key, [float(np.mean(r[key])) if key == "rel_l2"
                                             else r[key] for r in named])
    atomic_write(path, write)
    return done


def write_on_mesh(out_dir: str | Path, results: Iterable[dict[str, Any]],
                  predictor: Predictor) -> Iterator[dict[str, Any]]:
    """Each result of :func:`predict_cases` passed on after its samples are written onto
    their meshes in ``out_dir`` (module docstring), with ``meshes``: the files written."""
    layout = predictor.layout
    names = [file_safe(n) for n in (layout.field_names if layout else ())]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    coordinates = layout.coordinates if layout else None
    for r in results:
        case: Case = r["case"]
        pred, written = r["pred"], []
        fields = names if len(names) == pred.shape[-1] else [f"y{k}" for k in
                                                               range(pred.shape[-1])]
        for s in range(pred.shape[0]):
            stem = case.name if case.name is not None and pred.shape[0] == 1 else (
                f"{case.name or 'sample'}_{s:04d}")
            real = slice(None) if case.mask is None else case.mask[s]
            p = pred[s][real]
            t = None if case.y is None else np.asarray(case.y[s][real], np.float32)
            arrays = {f"pred_{f}": p[:, k] for k, f in enumerate(fields)}
            if t is not None:
                arrays.update({f"true_{f}": t[:, k] for k, f in enumerate(fields)})
                arrays.update({f"error_{f}": p[:, k] - t[:, k] for k, f in enumerate(fields)})
            x = case.x[s][real]
            centres = x[:, :coordinates or min(3, x.shape[1])]  # points, or cell centres
            if case.source is not None and Path(case.source).is_file():
                mesh, association = read_mesh(case.source), case.association
            else:
                if case.source is not None:
                    print(f"warning: {case.source}: the source mesh is gone; {stem} is "
                          "written as a point cloud", file=sys.stderr)
                mesh, association = point_cloud(centres), "point"
            path = write_fields(mesh, arrays, association, out_dir / file_safe(stem),
                                where=case.source or stem)
            error = "" if "rel_l2" not in r else f": relative L2 {100 * r['rel_l2'][s]:.2f}%"
            picture = plot_fields(path.with_suffix(".png"), centres, p, t, list(fields),
                                  layout.units if layout else "", f"{stem}{error}")
            written += [path, picture]
        yield {**r, "meshes": written}


__all__ = ["Case", "check_case", "geometry_case", "predict_cases", "read_cases", "store_cases",
           "write_on_mesh", "write_predictions"]
