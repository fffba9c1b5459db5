"""``flarepp infer``'s one flow: read cases, check them against the run's model, predict
each through the :class:`~flarepp.inference.predictor.Predictor`, write them as they come.

Shape letters: S samples, N points, I input and O output channels.

A **case** is what is predicted and written together: the samples ``x [S, N, I]`` of a
fields dataset split or an ``.npz`` of inputs (one unnamed case, written as ``pred [S, N,
O]``, ``rel_l2 [S]`` and ``mask``), or one whole car surface of the surface task (one named
case per car, written as ``pred_<car> [N, 4]`` as it is predicted, one car in memory at a
time, then ``cases``, ``cells``, ``seconds``, ``nmse`` and ``rel_l2``).
"""

from __future__ import annotations

import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from flarepp.data import DataError, MeshSamples, load_dataset
from flarepp.data.loaders import read_npz
from flarepp.device import peak_host_memory
from flarepp.io import atomic_write
from flarepp.inference.predictor import Predictor, PredictorError
from flarepp.tasks import TASKS
from flarepp.tasks.surface import METRIC_SCALE


@dataclass
class Case:
    """Samples predicted together: ``name`` (a car; None for a split's samples), physical
    inputs ``x``, targets ``y`` (None without), ``mask`` (None: every point is real)."""

    name: str | None
    x: np.ndarray
    y: np.ndarray | None = None
    mask: np.ndarray | None = None


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
    task = TASKS.get(config.task)
    if hasattr(task, "inference_cases") and not dataset and path.suffix != ".npz":
        for name, x, y in task.inference_cases(config, data, split):
            yield Case(name, x, y)
        return
    name = dataset or config.dataset
    options = config.dataset_options if name == config.dataset else {}
    splits = load_dataset(name, path, **options)
    samples = getattr(splits, split, None)
    if not isinstance(samples, MeshSamples):
        raise PredictorError(f"--dataset {name!r} is not read as (x, y) samples on meshes (it "
                             f"holds {type(splits).__name__}), so a {config.task!r} "
                             "checkpoint cannot predict it; give a dataset of the fields "
                             "task (e.g. darcy, elasticity, npz)")
    yield Case(None, samples.x, samples.y, samples.mask)


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
    for case in cases:
        check_case(source or str(case.name), case, predictor)
        start = time.perf_counter()
        pred = predictor.predict_arrays(case.x, case.mask, batch_size=batch_size)
        result = {"name": case.name, "pred": pred, "mask": case.mask,
                  "seconds": time.perf_counter() - start,
                  "cells": int(pred.shape[0] * pred.shape[1] if case.mask is None
                               else case.mask.sum())}
        if case.y is not None:
            real = (np.ones(pred.shape[:2], bool) if case.mask is None else case.mask)
            err = (pred.astype(np.float64) - case.y) * real[..., None]
            ref = np.asarray(case.y, np.float64) * real[..., None]
            rel = np.sqrt(np.square(err).sum((1, 2)) / np.square(ref).sum((1, 2)))
            standardised = err[real] / predictor.outputs.std.astype(np.float64)
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
                done.append({k: v for k, v in r.items() if k not in ("pred", "mask")})
            named = [r for r in done if r["name"] is not None]
            if named:
                array(archive, "cases", [r["name"] for r in named])
                for key in ("cells", "seconds", "nmse", "rel_l2"):
                    if all(key in r for r in named):
                        array(archive, key, [float(np.mean(r[key])) if key == "rel_l2"
                                             else r[key] for r in named])
    atomic_write(path, write)
    return done


__all__ = ["Case", "check_case", "predict_cases", "read_cases", "write_predictions"]
