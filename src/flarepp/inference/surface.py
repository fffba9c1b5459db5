"""Whole car surfaces through the one prediction path: ``flarepp infer`` on every car of a
split, and one car predicted again by finished runs for a side-by-side figure (Figures 13-14).

Shape letters: N cells, I = 6 inputs (cell centre, unit normal), O = 4 outputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
from torch import nn

from flarepp.data import DataError, Normalizer
from flarepp.io import atomic_write
from flarepp.inference.engine import Engine
from flarepp.inference.evaluate import load_for_evaluation
from flarepp.inference.mesh import predict_mesh
from flarepp.plots3d import CASE_FILE, model_label
from flarepp.tasks.surface import METRIC_SCALE


def predict_cases(model: nn.Module, cases: Iterable[tuple[str, np.ndarray, np.ndarray]],
                  x_norm: Normalizer, y_norm: Normalizer, **options: Any
                  ) -> Iterator[dict[str, Any]]:
    """Predict whole surfaces one at a time (``cases`` as :meth:`SurfaceTask.inference_cases`
    yields them; ``options`` those of :func:`~flarepp.inference.mesh.predict_mesh`:
    ``chunk_size`` streams, ``cp`` shards). Per case: ``name``, ``pred [N, 4]`` in physical
    units, ``cells``, wall ``seconds``, ``nmse`` (100 x the MSE of the channels standardised
    by ``y_norm``), ``rel_l2`` over all channels, and ``peak_gib``, this process's peak
    resident memory so far."""
    import time

    from flarepp.device import peak_host_memory

    for name, x_1NI, y_1NO in cases:
        start = time.perf_counter()
        pred = predict_mesh(model, x_1NI, None, x_norm, y_norm, batch_size=1, **options)[0]
        seconds = time.perf_counter() - start
        truth = np.asarray(y_1NO[0], np.float64)
        err = pred.astype(np.float64) - truth
        yield {"name": name, "pred": pred.astype(np.float32), "cells": int(pred.shape[0]),
               "seconds": seconds,
               "nmse": METRIC_SCALE * float(np.mean(np.square(err / y_norm.std.astype(
                   np.float64)))),
               "rel_l2": float(np.linalg.norm(err) / max(np.linalg.norm(truth), 1e-300)),
               "peak_gib": peak_host_memory() / 2 ** 30}


def write_case_predictions(path: Path, results: Iterable[dict[str, Any]]) -> list[dict]:
    """Write ``pred_<name>`` per case into the ``.npz`` at ``path`` as the cases arrive (one
    case in memory at a time), then ``cases``, ``cells``, ``seconds``, ``nmse`` and
    ``rel_l2``; atomically. Returns the per-case numbers."""
    import zipfile
    done: list[dict[str, Any]] = []

    def write(tmp):
        with zipfile.ZipFile(tmp, "w", allowZip64=True) as archive:
            for r in results:
                with archive.open(f"pred_{r['name']}.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, r["pred"])
                done.append({k: v for k, v in r.items() if k != "pred"})
            for key in ("name", "cells", "seconds", "nmse", "rel_l2"):
                with archive.open(f"{'cases' if key == 'name' else key}.npy", "w") as f:
                    np.lib.format.write_array(f, np.asarray([r[key] for r in done]))
    atomic_write(path, write)
    return done


def predict_car(run_dir: Path, car: str, *, chunk_size: int | None = None,
                     device: str = "auto") -> tuple[np.ndarray, np.ndarray, Path]:
    """``(prediction, reference, .vtp)`` of test car ``car`` by a finished run's final
    model (the weights the run reports, ``eval_weights``), in m^2/s^2 (streamed in chunks
    of ``chunk_size`` cells when given)."""
    from flarepp.inference.batching import to_device
    checkpoint = json.loads((Path(run_dir) / "metrics.json").read_text())["checkpoint"]
    model, task, config, _ = load_for_evaluation(checkpoint, device=device)
    runs = task.data.cars("test")
    if car not in runs:
        raise DataError(f"{car} is not a test run of {task.data.surfaces.split_file}")
    index = runs.index(car)
    engine = Engine(task, next(model.parameters()).device, config.precision,
                    chunk_size=chunk_size)
    batch = to_device(task.collate([task.get("test", index, index)]), engine.device)
    raw = engine.predict(model, batch)[0].float().cpu().numpy()
    run = task.data.surfaces.load(car)
    return (task.y_norm.decode(raw).astype(np.float32), np.asarray(run.fields, np.float32),
            run.source)


def plot_runs_together(run_dirs: Sequence[str | Path], out_dir: str | Path, *,
                       chunk_size: int | None = None, device: str = "auto",
                       backend: str = "auto") -> list[Path]:
    """Figures 13-14 with several finished runs' predictions of one car (e.g. FLARE and
    FLARE++): the car the last run saved (the median-error car of the first 10 by its
    errors); a run that saved another car predicts this one again from its checkpoint."""
    from flarepp.plots3d import plot_surface_case
    runs = [Path(d) for d in run_dirs]
    with np.load(runs[-1] / CASE_FILE) as case:
        chosen, truth = str(case["run"]), case["truth"]
        source = Path(str(case["source"]))
    predictions: dict[str, np.ndarray] = {}
    for directory in runs:
        config = json.loads((directory / "config.json").read_text())
        label = model_label(config)
        if label in predictions:
            label += f", seed {config.get('seed')} ({directory.name})"
        with np.load(directory / CASE_FILE) as case:
            saved = str(case["run"]) == chosen
            pred = case["pred"] if saved else None
        if pred is None:
            pred, _, _ = predict_car(directory, chosen, chunk_size=chunk_size,
                                          device=device)
        predictions[label] = pred
    return plot_surface_case(source, truth, predictions, out_dir, case_name=chosen,
                             backend=backend)


__all__ = ["plot_runs_together", "predict_cases", "predict_car", "write_case_predictions"]
