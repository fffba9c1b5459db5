"""``flarepp infer``'s one flow: read cases, check them against the run's model, predict
each through the :class:`~flarepp.inference.predictor.Predictor` (its surrogate under its
execution), write them as they come.

Shape letters: S samples, N points (or cells), I input and O output channels, K
conditioning tokens of C conditions.

A **case** is what is predicted and written together: every sample of an ``.npz`` (``x [S,
N, I]``, optional targets ``y``, ``mask``, ``conditions [S, C]`` or ``[S, K, C]``) or a
fields dataset's split (one unnamed case, written as ``pred [S, N, O]``, ``rel_l2 [S]`` and
``mask``), or one named case per sample of a store (a converted mesh, with its
conditions), per car surface of the surface task, or per new mesh file (``--mesh``, its
inputs built as the run's store was converted: :mod:`flarepp.inference.mesh_inputs`;
``--geometry``: a surface alone), written as ``pred_<name> [N, O]`` as it is predicted, one
in memory at a time, then ``cases``, ``cells`` (rows: points or cells), ``seconds``,
``rel_l2`` and, for the surface task, its metric ``nmse``.

**Checked against the run** (:func:`check_case`, :func:`check_store`): channel counts,
finite inputs and conditions; for a store, its channel layout against the one the run
stored: the same inputs (names, sources, unit scales) at the same rows (points or cells)
and the run's conditions by name and scale, else a sentence; targets of another field or
scale are left out with a warning (no error is computed against them).

**On the mesh** (:func:`write_on_mesh`, ``flarepp infer --write-mesh DIR``): each sample's
prediction ``pred_<field>``, and with targets ``true_<field>`` and ``error_<field>`` (pred -
true), as point or cell arrays of its source mesh (a store's sample remembers its file,
which must still be the file it converted; a car its ``.vtp``; a new mesh its file),
written as ``DIR/<name>.vtu`` or ``.vtp`` beside a picture ``DIR/<name>.png`` of the
fields on that mesh (a planar mesh's cells, a surface or a cut-away of a volume:
:func:`~flarepp.plots3d.plot_mesh_fields`), ``<name>``
the case's name as a relative path (``test/Re.1e5`` is ``DIR/test/Re.1e5.vtu``: distinct
names give distinct files, :func:`flarepp.io.confined` keeps them in ``DIR``); samples
without a source mesh (generated or ``.npz`` data) become point clouds (``.vtp``) at their
coordinates.
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
from flarepp.data import convert
from flarepp.data.layout import ChannelGroup
from flarepp.data.loaders import read_npz, read_user_samples
from flarepp.data.meshes import (cell_geometry, format_of, mesh_suffix, point_cloud,
                                 read_mesh, write_fields)
from flarepp.data.store import StoreSamples
from flarepp.device import peak_host_memory
from flarepp.inference.predictor import Predictor, PredictorError
from flarepp.io import atomic_write, confined
from flarepp.locks import file_safe
from flarepp.plots3d import plot_mesh_fields
from flarepp.tasks import TASKS
from flarepp.tasks.surface import METRIC_SCALE, integrated_forces

NPZ_KEYS = ("x", "y", "mask", "conditions", "coords", "grid_shape", "field_names", "units")
"""The keys of an ``.npz`` of cases (``flarepp infer --data X.npz``); the last four (a
dataset file's plot and label keys) are read past."""


@dataclass
class Case:
    """Samples predicted together: ``name`` (a store sample, car or mesh file; None for a
    split's samples), physical inputs ``x``, targets ``y`` (None without), ``mask`` (None:
    every point is real), per-sample ``conditions [S, C]`` or ``[S, K, C]``, the ``source``
    mesh file its rows are the points or cells (``association``) of, with what the store
    recorded of that file (``recorded``: sizes and digests when it was converted), and cell
    ``areas [N]`` of a surface."""

    name: str | None
    x: np.ndarray
    y: np.ndarray | None = None
    mask: np.ndarray | None = None
    conditions: np.ndarray | None = None
    source: str | None = None
    association: str = "point"
    areas: np.ndarray | None = None
    recorded: dict[str, Any] | None = None


def read_cases(predictor: Predictor, data: str | Path, *, split: str = "test",
               dataset: str | None = None) -> Iterator[Case]:
    """The cases of ``data``: an ``.npz`` file (every sample, :func:`npz_case`), the run's
    task's own cases (the surface task: one car at a time) or a split of a fields dataset
    (the run's, or ``dataset``; a store's split checked by :func:`check_store`)."""
    config = predictor.config
    path = Path(data)
    if path.suffix == ".npz" and path.is_file() and dataset is None:
        yield npz_case(path)
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
        yield from store_cases(*check_store(predictor, samples, str(path)))
        return
    if not isinstance(samples, MeshSamples):
        raise PredictorError(f"--dataset {name!r} is not read as (x, y) samples on meshes (it "
                             f"holds {type(splits).__name__}), so a {config.task!r} "
                             "checkpoint cannot predict it; give a dataset of the fields "
                             "task (e.g. darcy, elasticity, npz)")
    takes = predictor.layout is not None and predictor.layout.conditions is not None
    yield Case(None, samples.x, samples.y, samples.mask, samples.conditions if takes else None)


def npz_case(path: Path) -> Case:
    """Every sample of an ``.npz`` as one case, never a split of it: ``x [S, N, I]`` with
    optional ``y [S, N, O]``, ``mask [S, N]`` and ``conditions [S, C]`` or ``[S, K, C]``
    (:data:`NPZ_KEYS`), or the per-sample keys ``x_0, y_0, ...`` of meshes of different
    sizes (padded, with a mask)."""
    f = read_npz(path)  # an archive of objects or of nothing is a sentence
    if "x" not in f:
        if "x_0" in f:
            samples, _, _ = read_user_samples(path)
            return Case(None, samples.x, samples.y, samples.mask)
        raise PredictorError(f"{path}: no key 'x' (inputs x [S, N, in]) and no per-sample "
                             f"keys x_0, y_0, ...; found {sorted(f)}")
    unknown = sorted(set(f) - set(NPZ_KEYS))
    if unknown:
        raise PredictorError(f"{path}: unexpected key(s) {unknown}; an .npz of cases holds "
                             "x [S, N, in] and optionally y [S, N, out], mask [S, N], "
                             "conditions [S, C] or [S, K, C]")
    x = np.asarray(f["x"], np.float32)
    arrays = {key: np.asarray(f[key], bool if key == "mask" else np.float32)
              for key in ("y", "mask", "conditions") if key in f}
    want = {"y": "[S, N, out]", "mask": "[S, N]", "conditions": "[S, C] or [S, K, C]"}
    fits = {"y": lambda a: a.ndim == 3 and a.shape[:2] == x.shape[:2],
            "mask": lambda a: a.shape == x.shape[:2],
            "conditions": lambda a: a.ndim in (2, 3) and len(a) == len(x)}
    for key, array in arrays.items():
        if x.ndim != 3 or not fits[key](array):
            raise PredictorError(f"{path}: expected x [S, N, in] and {key} {want[key]}, got "
                                 f"x {list(x.shape)} and {key} {list(array.shape)}")
    if x.ndim != 3:
        raise PredictorError(f"{path}: expected x [S, N, in], got x {list(x.shape)}")
    return Case(None, x, arrays.get("y"), arrays.get("mask"), arrays.get("conditions"))


def store_cases(samples: StoreSamples, targets: bool = True) -> Iterator[Case]:
    """One case per sample of a store's split, read when its turn comes (never padded), with
    its conditions, its targets (unless ``targets`` is False, or the store has none) and
    its source mesh file (and what the store recorded of it)."""
    association, conditions = samples.store.layout.association, samples.conditions
    targets = targets and bool(samples.out_dim)
    for i, name in enumerate(samples.names):
        x, y = samples.sample(i) if targets else (samples.sample(i)[0], None)
        source = samples.source_of(i)
        recorded = source if isinstance(source, dict) else None
        yield Case(name, x[None], None if y is None else y[None], None,
                   None if conditions is None else conditions[i:i + 1],
                   source.get("case") if recorded else source, association,
                   recorded=recorded)


def geometry_case(path: str | Path, name: str | None = None, *,
                  max_rows: int | None = None) -> Case:
    """A surface geometry alone (STL, VTP, ... any format :func:`~flarepp.data.meshes.
    read_mesh` reads) as the surface task's inputs: each cell's centre and unit normal
    (:func:`~flarepp.data.meshes.cell_geometry`, as the DrivAerML reader computes them), its
    area kept for the integrated force; named ``name`` (default the file's stem);
    ``max_rows`` bounds its points and cells (:func:`~flarepp.data.meshes.read_mesh`)."""
    path = Path(path)
    cells = cell_geometry(read_mesh(path, max_rows=max_rows), path)
    if cells.dimension != 2:
        raise DataError(f"{path}: its cells are {cells.dimension}-D; a geometry for the "
                        "surface task is a surface of triangles, quads or polygons")
    x = np.concatenate([cells.centres, cells.normals], axis=1).astype(np.float32)[None]
    return Case(name or path.stem, x, source=str(path), association="cell",
                areas=cells.measures)


# ---------------------------------------------------------------------------------------------
# checks against the run

def _shown(group: ChannelGroup) -> str:
    return (f"{group.name} [{', '.join(group.channels)}] from {group.source or '?'}"
            f" x{group.scale:g}" + (f" in {group.units}" if group.units else ""))


def check_store(predictor: Predictor, samples: StoreSamples, source: str
                ) -> tuple[StoreSamples, bool]:
    """``(samples with the run's conditions, by name in its order; whether their targets
    are the run's)``, after the store's channel layout is checked against the one the run
    stored: the same rows (points or cells), inputs (names, sources, unit scales) and
    conditions, each difference a :class:`PredictorError`; targets of other channels or
    scales are left out with a warning. Only names are checked for a run that stored no
    layout."""
    run, data = predictor.layout.data_layout, samples.store.layout
    names = list(predictor.layout.condition_names)
    missing = [n for n in names if n not in data.condition_names]
    if missing:
        raise PredictorError(f"{source}: the run's model is conditioned on {missing}, which "
                             f"the store does not hold (its conditions: "
                             f"{data.condition_names or 'none'})")
    samples = StoreSamples(samples.store, samples.names,
                           samples.store.condition_columns(names))
    if run is None:
        return samples, True
    if data.association != run.association:
        raise PredictorError(f"{source}: the store's rows are its meshes' {data.association}s, "
                             f"the run trained on {run.association}s: its predictions there "
                             "would mean nothing")
    problems = [(what, [_shown(g) for g in theirs], [_shown(g) for g in ours])
                for what, theirs, ours in (
                    ("inputs", data.inputs, run.inputs),
                    ("conditions", data.with_conditions(names).conditions, run.conditions))
                if theirs != ours]
    if problems:
        what, theirs, ours = problems[0]
        raise PredictorError(f"{source}: the store's {what} are {'; '.join(theirs)}, the "
                             f"run's are {'; '.join(ours)} (another array, scale or units): "
                             "convert the data with the run's spec")
    if data.targets != run.targets and samples.out_dim:
        print(f"warning: {source}: the store's targets are "
              f"{'; '.join(_shown(g) for g in data.targets)}, the run predicts "
              f"{'; '.join(_shown(g) for g in run.targets)}: no error is computed against "
              "them", file=sys.stderr)
        return samples, False
    return samples, True


def check_case(source: str, case: Case, predictor: Predictor) -> None:
    """Inputs and targets that fit the run's model, finite inputs at every real point and
    finite conditions of the model's shape (a NaN input or condition makes the whole
    sample's prediction NaN, which would be written without a word)."""
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
    _check_conditions(source, case, predictor)


def _check_conditions(source: str, case: Case, predictor: Predictor) -> None:
    wanted = predictor.layout.conditions if predictor.layout is not None else None
    given = case.conditions
    if wanted is None:
        if given is not None:
            raise PredictorError(f"{source}: gives conditions, but this run's model takes "
                                 "none (it is not a conditioned architecture)")
        return
    if given is None:
        names = ", ".join(predictor.layout.condition_names) or "unnamed"
        raise PredictorError(f"{source}: this run's model is conditioned on {wanted[1]} "
                             f"condition(s) per sample ({names}), but the data gives none "
                             "(an .npz gives them as conditions [S, C])")
    shape = given.shape[1:] if given.ndim == 3 else (1, given.shape[-1])
    if tuple(shape) != tuple(wanted):
        raise PredictorError(f"{source}: conditions of {list(given.shape)}, the run's model "
                             f"takes [S, {wanted[0]}, {wanted[1]}] ([S, {wanted[1]}] for one "
                             "token)")
    if not np.isfinite(given).all():
        raise PredictorError(f"{source}: the conditions hold NaN or inf (first in sample "
                             f"{int(np.argwhere(~np.isfinite(given))[0][0])}); every "
                             "prediction of that sample would be NaN")


# ---------------------------------------------------------------------------------------------
# predicting

def predict_cases(predictor: Predictor, cases: Iterable[Case], *, source: str = "",
                  batch_size: int = 1) -> Iterator[dict[str, Any]]:
    """Each case checked and predicted, one at a time: ``name``, ``pred`` (physical, zero at
    padding), ``mask``, ``cells`` (real rows: points or cells), wall ``seconds``,
    ``peak_gib`` (this process's peak resident memory so far), and against targets
    ``rel_l2`` per sample (``||pred - y|| / ||y||`` over real rows and channels, float64)
    and, for the surface task, its metric ``nmse`` (100 x the MSE of the channels
    standardised by the run's output map)."""
    takes = predictor.layout is not None and predictor.layout.conditions is not None
    surface = getattr(predictor.config, "task", None) == "surface"
    for case in cases:
        check_case(source or str(case.name), case, predictor)
        conditions = None
        if takes:
            conditions = (case.conditions if case.conditions.ndim == 3
                          else case.conditions[:, None, :])
        start = time.perf_counter()
        pred = predictor.predict_arrays(case.x, case.mask, conditions, batch_size=batch_size)
        result = {"name": case.name, "pred": pred, "mask": case.mask, "case": case,
                  "seconds": time.perf_counter() - start,
                  "cells": int(pred.shape[0] * pred.shape[1] if case.mask is None
                               else case.mask.sum())}
        if case.areas is not None and pred.shape[-1] == 4:  # a surface: its predicted force
            fields, normals = (torch.from_numpy(a[:1]).double() for a in (pred, case.x[..., 3:6]))
            result["force"] = integrated_forces(fields, normals,
                                                torch.from_numpy(case.areas[None])).numpy()[0]
        if case.y is not None:
            result.update(_errors(predictor, case, pred, surface))
        result["peak_gib"] = peak_host_memory() / 2 ** 30
        yield result


def _errors(predictor: Predictor, case: Case, pred: np.ndarray, surface: bool
            ) -> dict[str, Any]:
    real = (np.ones(pred.shape[:2], bool) if case.mask is None else case.mask)
    err = (pred.astype(np.float64) - case.y) * real[..., None]
    ref = np.asarray(case.y, np.float64) * real[..., None]
    out = {"rel_l2": np.sqrt(np.square(err).sum((1, 2)) / np.square(ref).sum((1, 2)))}
    if surface:
        scale = predictor.surrogate.output_scale.double().cpu().numpy()
        out["nmse"] = METRIC_SCALE * float(np.mean(np.square(err[real] / scale)))
    return out


def write_predictions(path: str | Path, results: Iterable[dict[str, Any]]) -> list[dict]:
    """Write the cases into the ``.npz`` at ``path`` as they arrive, atomically (module
    docstring: one unnamed case as ``pred``, ``rel_l2``, ``mask``; named cases as
    ``pred_<name>`` and the per-case numbers). Returns the per-case numbers (no arrays; a
    result's ``samples``: how many it held)."""
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
                done.append({**{k: v for k, v in r.items() if k not in ("pred", "mask", "case")},
                             "samples": len(r["pred"])})
            named = [r for r in done if r["name"] is not None]
            if named:
                array(archive, "cases", [r["name"] for r in named])
                for key in ("cells", "seconds", "nmse", "rel_l2"):
                    if all(key in r for r in named):
                        array(archive, key, [float(np.mean(r[key])) if key == "rel_l2"
                                             else r[key] for r in named])
    atomic_write(path, write)
    return done


# ---------------------------------------------------------------------------------------------
# on the mesh

def source_changed(recorded: dict[str, Any]) -> str | None:
    """Why the source mesh a store recorded (``meta.json``'s ``source``: every file's size,
    time and sampled digest when it was converted) is no longer that file, or None: a file
    of another size or content (its time alone may differ: a copy keeps the content)."""
    path = Path(recorded["case"])
    fmt = format_of(path)
    if fmt is None:
        return None
    now = convert.Case(path.stem, path, fmt).identity()["files"]
    then = {f[0]: (f[1], f[3]) for f in recorded.get("files", [])}
    for name, size, _, digest in now:
        if then.get(name, (size, digest)) != (size, digest):
            return (f"{path.parent / name} is not the file the store converted (its size or "
                    "content changed since, so the store's rows need not be its points or "
                    "cells any more)")
    return None


class _Targets:
    """The files one ``--write-mesh`` writes, each claimed once: a second case that would
    write the same file, or a file where another case needs a folder, is refused."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.files, self.folders = out_dir, {}, {}

    def claim(self, name: str, suffix: str) -> Path:
        confined(self.out_dir, name, what="case name")   # '.', '..', '/x', 'a//b': refused
        path = confined(self.out_dir, name + suffix, what="case name")
        folders = list(path.relative_to(self.out_dir).parents)[:-1]
        clash = self.files.get(path) or self.folders.get(path) or next(
            (self.files[self.out_dir / f] for f in folders if self.out_dir / f in self.files),
            None)
        if clash is not None:
            raise DataError(f"--write-mesh: cases {clash!r} and {name!r} would both write "
                            f"{path}; give the cases distinct names")
        self.files[path] = name
        self.folders.update({self.out_dir / f: name for f in folders})
        return path


def _picture(path: Path, draw) -> Path:
    """A picture written to a temporary beside ``path`` and renamed over it: a link at
    ``path`` is replaced, never followed."""
    def write(tmp: Path) -> None:
        named = Path(f"{tmp}.png")   # the format is chosen by the suffix, which tmp lacks
        try:
            draw(named)
            named.replace(tmp)
        finally:
            named.unlink(missing_ok=True)
    return atomic_write(path, write)


def _source_mesh(case: Case, stem: str, centres: np.ndarray):
    """``(mesh, association)`` the sample is written onto: its source mesh, as the store
    converted it (else a sentence), or a point cloud at its coordinates where it has none
    (a warning where it had one that is gone)."""
    if case.source is not None and Path(case.source).is_file():
        changed = None if case.recorded is None else source_changed(case.recorded)
        if changed is not None:
            raise DataError(f"--write-mesh {stem}: {changed}; convert the store again, or "
                            "leave --write-mesh out")
        return read_mesh(case.source), case.association
    if case.source is not None:
        print(f"warning: {case.source}: the source mesh is gone; {stem} is "
              "written as a point cloud", file=sys.stderr)
    return point_cloud(centres), "point"


def write_on_mesh(out_dir: str | Path, results: Iterable[dict[str, Any]],
                  predictor: Predictor) -> Iterator[dict[str, Any]]:
    """Each result of :func:`predict_cases` passed on after its samples are written onto
    their meshes in ``out_dir`` (module docstring), with ``meshes``: the files written."""
    layout = predictor.layout
    names = [file_safe(n) for n in (layout.field_names if layout else ())]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = _Targets(out_dir)
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
            mesh, association = _source_mesh(case, stem, centres)
            target = targets.claim(stem, mesh_suffix(mesh))
            if case.source is not None and Path(case.source).resolve() == target.resolve():
                raise DataError(f"--write-mesh: {target} is case {stem!r}'s own source mesh, "
                                "which the prediction would replace; give another folder")
            picture = targets.claim(stem, ".png")
            path = write_fields(mesh, arrays, association, target.with_name(target.stem),
                                where=case.source or stem)
            error = "" if "rel_l2" not in r else f": relative L2 {100 * r['rel_l2'][s]:.2f}%"
            _picture(picture, lambda named: plot_mesh_fields(
                named, mesh, association, p, t, list(fields), layout.units if layout else "",
                f"{stem}{error}"))
            written += [path, picture]
        yield {**r, "meshes": written}


__all__ = ["Case", "NPZ_KEYS", "check_case", "check_store", "geometry_case", "npz_case",
           "predict_cases", "read_cases", "source_changed", "store_cases", "write_on_mesh",
           "write_predictions"]
