"""One car predicted again by finished runs for a side-by-side figure (Figures 13-14),
through the one prediction path (``flarepp drivaerml figures``).

Shape letters: N cells, I = 6 inputs (cell centre, unit normal), O = 4 outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from flarepp.data import DataError
from flarepp.inference.batching import to_device
from flarepp.inference.engine import Engine
from flarepp.inference.evaluate import load_for_evaluation
from flarepp.inference.execution import Execution
from flarepp.plots3d import CASE_FILE, model_label, plot_surface_case
from flarepp.storage.rundir import NotARunDirectory, RunDir


def predict_car(run_dir: Path, car: str, *, chunk_size: int | None = None,
                device: str = "auto") -> tuple[np.ndarray, np.ndarray, Path]:
    """``(prediction, reference, .vtp)`` of test car ``car`` by a finished run's final
    model (the weights the run reports, ``eval_weights``), in m^2/s^2 (streamed in chunks
    of ``chunk_size`` cells when given)."""
    checkpoint = RunDir(run_dir).reported_checkpoint()
    if checkpoint is None:
        raise NotARunDirectory(f"{str(run_dir)!r} holds no checkpoint to predict {car} with")
    model, task, config, _ = load_for_evaluation(checkpoint, device=device)
    runs = task.data.cars("test")
    if car not in runs:
        raise DataError(f"{car} is not a test run of {task.data.surfaces.split_file}")
    index = runs.index(car)
    engine = Engine(task, Execution(next(model.parameters()).device, config.precision,
                                    chunk_size=chunk_size))
    batch = to_device(task.collate([task.get("test", index, index)]), engine.device)
    pred = engine.predict(model, batch)[0].float().cpu().numpy()
    run = task.data.surfaces.load(car)
    return pred.astype(np.float32), np.asarray(run.fields, np.float32), run.source


def plot_runs_together(run_dirs: Sequence[str | Path], out_dir: str | Path, *,
                       chunk_size: int | None = None, device: str = "auto",
                       backend: str = "auto") -> list[Path]:
    """Figures 13-14 with several finished runs' predictions of one car (e.g. FLARE and
    FLARE++): the car the last run saved (the median-error car of the first 10 by its
    errors); a run that saved another car predicts this one again from its checkpoint."""
    runs = [Path(d) for d in run_dirs]
    with np.load(RunDir(runs[-1]).file(CASE_FILE)) as case:
        chosen, truth = str(case["run"]), case["truth"]
        source = Path(str(case["source"]))
    predictions: dict[str, np.ndarray] = {}
    for directory in runs:
        config = RunDir(directory).read_config()
        label = model_label(config.to_dict())
        if label in predictions:
            label += f", seed {config.seed} ({directory.name})"
        with np.load(RunDir(directory).file(CASE_FILE)) as case:
            saved = str(case["run"]) == chosen
            pred = case["pred"] if saved else None
        if pred is None:
            pred, _, _ = predict_car(directory, chosen, chunk_size=chunk_size,
                                     device=device)
        predictions[label] = pred
    return plot_surface_case(source, truth, predictions, out_dir, case_name=chosen,
                             backend=backend)


__all__ = ["plot_runs_together", "predict_car"]
