"""Car-surface pressure and wall shear on the full mesh: the DrivAerML task (paper Sec. 4.2, C.1).

Shape letters: B batch (one geometry per step), N cells of a surface, I = 6 input and
O = 4 output channels.

Data (dataset ``drivaerml``, :func:`load_drivaerml`): ``root/run_<i>/boundary_<i>.vtp`` with
the kinematic pressure and wall-shear cell arrays, read through
:class:`~flarepp.data.drivaerml.DrivAerMLSurfaces` (memory-mapped cache, a split file of run
ids): the released DrivAerML files (Ashton et al. 2024) or those of ``flarepp data make
surface-flow``. ``test_split`` says which split is scored, ``test`` or ``val``.

Inputs per cell (C.1): its centre scaled to the training split's bounding box,
``(c - min) / (max - min)`` per axis, and its unit normal (6 channels). Targets: ``(p_s, tau_x,
tau_y, tau_z)`` standardised per channel by the mean and std over every training cell. Both
maps are per-channel ``(a - shift) / scale`` (:class:`~flarepp.data.Normalizer`; the normals'
shift 0 and scale 1), stored in checkpoints as the ``x`` and ``y`` normalisers.

Loss and metric (C.1): the MSE of the standardised channels averaged over cells and channels,
times 100 (``nmse``, in %). In the loss convention of :mod:`flarepp.tasks.base` the loss is
the sum ``100 sum (y_hat - y)^2`` over the batch's real cells and channels with count ``4 x
real cells``, both summed over the tokens through ``token_sum``, so context parallelism
gives the single-process value.

Training (C.1): each item is one geometry and a uniform subset of ``cells_per_step`` of its
cells drawn without replacement by ``numpy.random.default_rng(seed)`` (:func:`subset_cells`);
the trainer hands every sample a fresh seed every epoch, so each step sees a new subset. A
surface with fewer cells is taken whole.

Evaluation: every cell of every surface of the scored split, one surface per batch; the
engine streams it in chunks (``eval_chunk_size``, :mod:`flarepp.distributed.streaming`) or
splits it over context-parallel ranks, and hands the predictions in physical units. A car's
record is its per-channel sum of squared standardised errors ``((y_hat - y) / std)^2``, its
cell count, its relative L2 over the 4 channels and its integrated forces, nothing per
cell; its metric ``100 sum e^2 / (4 N)`` is averaged over the cars (and per channel
likewise), the relative L2 too.

Integrated forces (per car, predicted and true): pressure and wall shear summed over the
cells, ``F = sum_cells (-p_s n + tau_w) A`` (:func:`integrated_forces`; kinematic, so per
unit density, m^4/s^2), with the normals as the file orients them: outward, the force on
the body, for the generated surfaces; OpenFOAM orients boundary faces out of the fluid
(into the car), which reverses the sign of the pressure term, and its wall shear is the
wall's stress on the fluid, which reverses the shear term: the whole force changes sign
and neither R² nor the relative errors change (PhysicsNeMo's DrivAerML drag adds ``p n``
and subtracts the shear). Drag is ``F . d`` along the free stream ``d`` and lift ``F . z``;
both are per unit dynamic pressure, ``C A = F . d / (U^2 / 2)`` in m^2 (the drag area:
``C_d`` times a reference area, which no file states), where the file states its free
stream ``U`` (generated surfaces: 40 m/s, with their yaw), else the kinematic force itself
along ``x`` (m^4/s^2; the released DrivAerML files state neither speed nor area).
``drag_r2`` and ``lift_r2``: the coefficient of determination ``1 - sum (hat - true)^2 /
sum (true - mean true)^2`` over the scored cars, the number AB-UPT reports for DrivAerML's
drag and lift; undefined (NaN, its reason under ``r2_undefined``) with fewer than 2 cars, or
where the true values spread by at most ``R2_SPREAD`` of the force coefficients' magnitude
(the lift of bodies symmetric about the flow is zero up to round-off: R² would divide the
errors by that round-off, -2e16 where it was computed). After training, the case the paper
would show in Figures 13-14 (the median-error car of the first 10) is predicted again and written, in
physical units, to ``surface_case.npz``; ``flarepp plot RUN`` renders it with
:mod:`flarepp.plots3d`. ``surface_errors.json`` lists every car's errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from flarepp.data import DataError, Normalizer, load_dataset, subset_points
from flarepp.data.drivaerml import (FIELD_NAMES, FIELD_UNITS, PRESSURE_ARRAY,
                                    WALL_SHEAR_ARRAY, DrivAerMLSurfaces, SurfaceStatistics)
from flarepp.data.fingerprint import data_fingerprint
from flarepp.data.surface import (DATASET, TEST_SPLITS, SurfaceData,  # noqa: F401  (re-exported)
                                  check_options, load_drivaerml, resolve_split_file)
from flarepp.plots3d import CASE_FILE, median_case, plot_surface_run
from flarepp.storage.rundir import RunDir
from flarepp.io import atomic_write_json, atomic_write_npz
from flarepp.models import build_model
from flarepp.tasks.base import Batch, Item, Task, TokenSum, collate_point_clouds, pad_stack
from flarepp.tasks.fields import relative_l2
from flarepp.tasks.registry import TASKS

INPUT_NAMES = ("centre x", "centre y", "centre z", "normal x", "normal y", "normal z")
IN_CHANNELS, OUT_CHANNELS = len(INPUT_NAMES), len(FIELD_NAMES)
METRIC_SCALE = 100.0                # the metric is in %
FIGURE_SUBSET = 10                  # Figures 13-14: the median case of the first 10 test cars
ERRORS_FILE = RunDir.SURFACE_ERRORS


subset_cells = subset_points
"""``size`` distinct cells of ``n_cells`` drawn by ``default_rng(seed)``, sorted
(:func:`flarepp.data.subset_points`, which the fields task's ``points_per_step`` uses too)."""


def input_normalizer(stats: SurfaceStatistics) -> Normalizer:
    """Centres to the training bounding box (``(c - min) / (max - min)``; a flat axis is
    only shifted), normals as they are."""
    low = np.asarray(stats.bbox_min, np.float64)
    extent = np.asarray(stats.bbox_max, np.float64) - low
    extent = np.where(extent > 0, extent, 1.0)
    return Normalizer(np.concatenate([low, np.zeros(3)]).astype(np.float32),
                      np.concatenate([extent, np.ones(3)]).astype(np.float32))


def output_normalizer(stats: SurfaceStatistics) -> Normalizer:
    """Per-channel standardisation by the training mean and (population) std; a channel
    that is constant over the training cells is centred only."""
    std = np.asarray(stats.field_std, np.float64)
    return Normalizer(np.asarray(stats.field_mean, np.float32),
                      np.where(std > 0, std, 1.0).astype(np.float32))


# ---------------------------------------------------------------------------------------------
# the task

@TASKS.register("surface", doc="car surfaces (DrivAerML): 4-channel normalised MSE on "
                               "every cell, 100K cells per step")
class SurfaceTask(Task):
    """Pressure and wall shear at every cell of a car surface from its centre and normal."""

    name = "surface"
    headline = "nmse"
    reported = ("rel_l2", "drag_r2", "lift_r2", "r2_undefined")   # the last: where R² is NaN
    lower_is_better = True
    token_keys = ("x", "y", "mask")
    eval_splits = ("test",)

    def __init__(self, config: Any, data_root: str | Path, *,
                 splits: SurfaceData | None = None) -> None:
        super().__init__(config, data_root)
        self.data = splits or load_dataset(config.dataset, self.data_root,
                                           **config.dataset_options)
        self.statistics = self.data.surfaces.statistics("train", progress=False)
        self.x_norm = input_normalizer(self.statistics)
        self.y_norm = output_normalizer(self.statistics)

    @classmethod
    def check_config(cls, config: Any) -> None:
        """The dataset is ``drivaerml`` with usable options; the loss and the input and
        output maps are the paper's (C.1), so ``loss`` and ``input_norm`` stay
        ``reference``."""
        if config.dataset != DATASET:
            raise ValueError(f"task surface reads dataset {DATASET!r}, got {config.dataset!r}")
        options = {"test_split": "test", "cells_per_step": 100_000,
                   "pressure_array": PRESSURE_ARRAY, "wall_shear_array": WALL_SHEAR_ARRAY,
                   **{k: v for k, v in config.dataset_options.items()
                      if k in ("test_split", "cells_per_step", "pressure_array",
                               "wall_shear_array")}}
        check_options(**options)
        for key in ("loss", "input_norm"):
            if getattr(config, key) != "reference":
                raise ValueError(f"task surface trains on the paper's normalised 4-channel MSE "
                                 f"with bounding-box inputs (Sec. C.1); leave {key} at "
                                 f"'reference', got {getattr(config, key)!r}")

    # -- data ----------------------------------------------------------------------------
    def car(self, split: str, index: int) -> str:
        return self.data.cars(split)[index]

    def num_samples(self, split: str) -> int:
        return len(self.data.cars(split))

    def get(self, split: str, index: int, seed: int, *, training: bool = False) -> Item:
        """Normalised inputs ``x [n, 6]`` and standardised targets ``y [n, 4]`` of a
        ``cells_per_step`` subset drawn with ``seed`` (training), or of every cell with the
        targets in physical units, ``fields [n, 4]``, and the cell ``areas [n]`` too
        (evaluation)."""
        run = self.data.surfaces.load(self.car(split, index))
        if training:
            cells = subset_cells(run.n_cells, self.data.cells_per_step, seed)
            centres, normals, fields = run.centres[cells], run.normals[cells], run.fields[cells]
        else:
            centres, normals, fields = run.centres, run.normals, run.fields
        x = self.x_norm.encode(np.concatenate([centres, normals], axis=1))
        y = self.y_norm.encode(np.asarray(fields))
        item = {"index": np.int64(index), "x": np.ascontiguousarray(x, np.float32),
                "y": np.ascontiguousarray(y, np.float32)}
        if not training:
            item["fields"] = np.ascontiguousarray(fields, np.float32)
            item["areas"] = np.ascontiguousarray(run.areas, np.float32)
        return item

    def item_size(self, item: Item) -> int:
        return int(item["x"].shape[0])

    def collate(self, items: list[Item]) -> Batch:
        lengths = [self.item_size(it) for it in items]
        batch = collate_point_clouds(items, lengths, masked=len(set(lengths)) > 1)
        for key in ("fields", "areas"):   # evaluation items only
            if all(key in it for it in items):
                batch[key] = torch.from_numpy(pad_stack([it[key] for it in items],
                                                        max(lengths)))
        return batch

    def eval_batch_size(self) -> int:
        """One whole surface per evaluation batch (C.1: one geometry per forward)."""
        return 1

    # -- model ---------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        return build_model(in_dim=IN_CHANNELS, out_dim=OUT_CHANNELS,
                           **self.config.model_kwargs())

    # -- loss and metrics ----------------------------------------------------------------
    @staticmethod
    def _squared_errors(pred_BNO: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``(y_hat - y)^2`` at least in float32, zero at padding, ``[B, N, O]``."""
        pred = pred_BNO.to(torch.promote_types(pred_BNO.dtype, torch.float32))
        err = (pred - batch["y"].to(pred.dtype)).square()
        mask = batch.get("mask")
        return err if mask is None else err * mask[..., None]

    def loss(self, pred: torch.Tensor, batch: Batch, token_sum: TokenSum) -> torch.Tensor:
        """``100 sum (y_hat - y)^2`` over the batch's real cells and channels."""
        return METRIC_SCALE * token_sum(self._squared_errors(pred, batch).sum())

    def loss_count(self, batch: Batch, token_sum: TokenSum) -> torch.Tensor:
        """Real cells x 4 channels of the batch (summed over the token shards)."""
        y, mask = batch["y"], batch.get("mask")
        cells = (torch.full((), float(y.shape[0] * y.shape[1]), device=y.device)
                 if mask is None else mask.sum().float())
        return token_sum(cells * y.shape[-1])

    def eval_records(self, pred: torch.Tensor, batch: Batch) -> dict[str, np.ndarray]:
        """Per car, from predictions and targets in physical units: the sum of squared
        standardised errors per channel (float64), the number of cells, the relative L2
        over the 4 channels and the integrated forces ``[3]`` predicted and true."""
        mask = batch.get("mask")
        pred, true = pred.double(), batch["fields"].double()
        std = torch.as_tensor(self.y_norm.std, dtype=torch.float64, device=pred.device)
        err = ((pred - true) / std).square()
        err = err if mask is None else err * mask[..., None]
        cells = (torch.full((err.shape[0],), err.shape[1]) if mask is None
                 else mask.sum(1))
        # the inputs' normal channels are the unit normals: their map is the identity
        normals = batch["x"][..., 3:6].double()
        areas = batch["areas"].double()
        return {"index": batch["index"].cpu().numpy(), "sse": err.sum(1).cpu().numpy(),
                "cells": cells.cpu().numpy().astype(np.int64),
                "rel_l2": relative_l2(pred, true, mask).cpu().numpy(),
                "force_pred": integrated_forces(pred, normals, areas, mask).cpu().numpy(),
                "force_true": integrated_forces(true, normals, areas, mask).cpu().numpy()}

    def summarize(self, split: str, records: dict[str, np.ndarray]) -> dict[str, Any]:
        """``nmse``: the mean over cars of each car's ``100 x`` mean squared standardised
        error over its cells and the 4 channels; ``nmse_channels`` per channel;
        ``rel_l2`` the mean over cars of the relative L2 over the 4 channels; ``drag_r2``
        and ``lift_r2`` over the cars, and each car's drag and lift (module docstring)."""
        per_channel = case_channel_errors(records)
        per_case = per_channel.mean(axis=1)
        runs = [self.data.cars(split)[int(i)] for i in records["index"]]
        forces = self.force_coefficients(runs, records)
        return {"nmse": float(per_case.mean()),
                "nmse_channels": {name: float(v)
                                  for name, v in zip(FIELD_NAMES, per_channel.mean(axis=0))},
                "rel_l2": float(records["rel_l2"].mean()),
                **force_r_squared(forces),
                "forces": forces,
                "per_sample": per_case.tolist(), "runs": runs,
                "cells": int(records["cells"].sum())}

    def force_coefficients(self, runs: list[str], records: dict[str, np.ndarray]
                           ) -> dict[str, Any]:
        """Each car's drag and lift, predicted and true, per unit dynamic pressure where
        its file states the free stream, else the kinematic force (module docstring)."""
        out: dict[str, Any] = {k: [] for k in ("drag_pred", "drag_true", "lift_pred",
                                               "lift_true", "quantity")}
        for car, f_pred, f_true in zip(runs, records["force_pred"], records["force_true"]):
            stream = self.data.surfaces.load(car).free_stream
            speed = None if stream is None else float(np.linalg.norm(stream))
            drag = np.array([1.0, 0.0, 0.0]) if not speed else np.asarray(stream) / speed
            scale = 1.0 if not speed else 0.5 * speed ** 2
            for name, f in (("pred", f_pred), ("true", f_true)):
                out[f"drag_{name}"].append(float(f @ drag / scale))
                out[f"lift_{name}"].append(float(f[2] / scale))
            out["quantity"].append("per unit dynamic pressure (m^2)" if speed else
                                   "kinematic force along x and z (m^4/s^2)")
        return out

    # -- state and outputs ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"x": self.x_norm.state_dict(), "y": self.y_norm.state_dict(),
                "statistics": self.statistics.to_dict()}

    def normalizers(self) -> dict[str, Normalizer]:
        return {"x": self.x_norm, "y": self.y_norm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.x_norm = Normalizer.from_state_dict(state["x"])
        self.y_norm = Normalizer.from_state_dict(state["y"])
        if "statistics" in state:
            self.statistics = SurfaceStatistics.from_dict(state["statistics"])

    def describe_data(self) -> dict[str, Any]:
        s = self.data.surfaces
        return {"dataset": DATASET, "root": str(s.root), "split_file": str(s.split_file),
                "test_split": self.data.test_split, "cells_per_step": self.data.cells_per_step,
                "field_names": list(FIELD_NAMES), "units": FIELD_UNITS,
                "inputs": {"coordinates": 3, "names": list(INPUT_NAMES)},
                "arrays": [s.pressure_array, s.wall_shear_array],
                "runs": {"train": self.num_samples("train"), "test": self.num_samples("test")},
                "statistics": self.statistics.to_dict()}

    def data_identity(self) -> dict[str, Any]:
        """The training runs' ids and cell counts and the training statistics (bounding box,
        mean and std over every cell, in float64): a content fingerprint that costs no pass
        over the cells once the statistics are cached."""
        runs = self.data.cars("train")
        cells = np.array([self.data.surfaces.load(r).n_cells for r in runs], np.int64)
        s = self.statistics
        stats = np.array([*s.bbox_min, *s.bbox_max, *s.field_mean, *s.field_std, s.n_cells],
                         np.float64)
        ids = np.array([int(r[4:]) for r in runs], np.int64)
        return data_fingerprint({"train_runs": ids, "train_cells": cells,
                                 "train_statistics": stats}, self.data_root)

    def check_model(self, model_config: dict[str, Any]) -> None:
        for key, have in (("in_dim", IN_CHANNELS), ("out_dim", OUT_CHANNELS)):
            if model_config.get(key) != have:
                raise DataError(f"{self.data_root}: the surface task has {have} "
                                f"{'input' if key == 'in_dim' else 'output'} channels, the "
                                f"checkpoint's model has {key}={model_config.get(key)}")

    def cases_to_predict(self, split: str, records: dict[str, np.ndarray]) -> list[int]:
        """The case of Figures 13-14: the median-error car of the first ``FIGURE_SUBSET``."""
        if not len(records.get("index", ())):
            return []
        errors = case_channel_errors(records).mean(axis=1)
        return [int(records["index"][median_case(errors, FIGURE_SUBSET)])]

    def write_outputs(self, out_dir: Path, split: str, records: dict[str, np.ndarray], *,
                      predictions: dict[int, np.ndarray] | None = None) -> list[Path]:
        """``surface_errors.json`` (every car's errors) and, for the case predicted again,
        ``surface_case.npz``: ``pred`` and ``truth`` ``[N, 4]`` in m^2/s^2, ``run``,
        ``source`` (its ``.vtp``), its ``nmse`` and the channel names."""
        out_dir = Path(out_dir)
        per_channel = case_channel_errors(records)
        runs = self.data.cars(split)
        forces = self.force_coefficients([runs[int(i)] for i in records["index"]], records)
        cases = [{"run": runs[int(i)], "index": int(i), "cells": int(n),
                  "nmse": float(e.mean()),
                  "nmse_channels": dict(zip(FIELD_NAMES, map(float, e))),
                  "rel_l2": float(records["rel_l2"][row]),
                  **{k: v[row] for k, v in forces.items()}}
                 for row, (i, n, e) in enumerate(zip(records["index"], records["cells"],
                                                     per_channel))]
        chosen = list(predictions or {})
        run_dir = RunDir(out_dir)
        paths = [run_dir.file(ERRORS_FILE)]
        atomic_write_json(paths[0], {
            "split": self.data.test_split, "metric": "100 x MSE of the standardised channels",
            "nmse": float(per_channel.mean(axis=1).mean()), "figure_subset": FIGURE_SUBSET,
            "figure_case": runs[chosen[0]] if chosen else None,
            **force_r_squared(forces), "cases": cases})
        for index, pred_NO in (predictions or {}).items():
            run = self.data.surfaces.load(runs[index])
            row = int(np.flatnonzero(records["index"] == index)[0])
            arrays = {"pred": np.asarray(pred_NO, np.float32),
                      "truth": np.asarray(run.fields, np.float32), "run": np.asarray(run.car),
                      "source": np.asarray(str(run.source.resolve())),
                      "index": np.int64(index), "nmse": np.float64(cases[row]["nmse"]),
                      "field_names": np.asarray(FIELD_NAMES), "units": np.asarray(FIELD_UNITS)}
            paths.append(atomic_write_npz(run_dir.file(CASE_FILE), arrays))
        return paths

    @classmethod
    def plot_run(cls, out_dir: Path, cases: int) -> list[Path]:
        """Figures 13-14 for the run's saved case (``cases`` does not apply: the paper shows
        one car) and the training curves."""
        return plot_surface_run(out_dir)

    # -- inference on whole surfaces (``flarepp infer``) ----------------------------------
    @classmethod
    def inference_cases(cls, config: Any, data_root: str | Path, split: str
                        ) -> Iterator[tuple[str, np.ndarray, np.ndarray, str]]:
        """``(run id, inputs [1, N, 6], targets [1, N, 4], its .vtp file)`` in physical units
        for every run of ``split`` (``train``, ``val`` or ``test`` of the config's split
        file) under ``data_root``, one at a time; needs no training split."""
        options = dict(config.dataset_options)
        options.pop("test_split", None), options.pop("cells_per_step", None)
        root = Path(data_root)
        surfaces = DrivAerMLSurfaces(
            root, split_file=resolve_split_file(root, options.pop("split_file", None)),
            **options)
        for car in surfaces.cars(split):
            run = surfaces.load(car)
            x = np.concatenate([run.centres, run.normals], axis=1)[None]
            yield car, x, np.asarray(run.fields)[None], str(surfaces.vtp_path(car))


def integrated_forces(fields_BN4: torch.Tensor, normals_BN3: torch.Tensor,
                      areas_BN: torch.Tensor, mask_BN: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """``F = sum_cells (-p_s n + tau_w) A`` per sample, ``[B, 3]``: the kinematic pressure
    ``fields[..., 0]`` and wall shear ``fields[..., 1:4]`` integrated over the cell areas
    with the unit normals as given (padding left out)."""
    traction = -fields_BN4[..., :1] * normals_BN3 + fields_BN4[..., 1:4]
    weights = areas_BN if mask_BN is None else areas_BN * mask_BN
    return (traction * weights[..., None]).sum(1)


R2_SPREAD = 1e-6
"""Below this fraction of the values' magnitude, the spread of the true values is taken as
none (:func:`r_squared_why`): float32 round-off of forces summed over cells is about that."""


def r_squared_why(predicted: list[float] | np.ndarray, true: list[float] | np.ndarray, *,
                  scale: float | None = None) -> tuple[float, str | None]:
    """``(R², None)`` with ``R² = 1 - sum (p - t)^2 / sum (t - mean t)^2``, or ``(NaN,
    why)`` where it is undefined: fewer than 2 values, or true values whose standard
    deviation is at most ``R2_SPREAD`` times ``scale`` (default: the largest magnitude of
    the predicted and true values) -- e.g. the lift of bodies symmetric about the flow,
    zero up to round-off, where R² would divide the errors by the round-off's spread."""
    p, t = np.asarray(predicted, np.float64), np.asarray(true, np.float64)
    if len(t) < 2:
        return float("nan"), f"undefined with {len(t)} value(s): R² needs 2 or more"
    if scale is None:
        scale = float(max(np.abs(t).max(), np.abs(p).max()))
    spread = float(t.std())
    if spread <= R2_SPREAD * scale:
        return float("nan"), (f"undefined: the {len(t)} true values vary by {spread:.3g} "
                              f"(standard deviation), at most {R2_SPREAD:g} of their "
                              f"magnitude {scale:.3g}, so there is no spread to explain")
    return 1.0 - float(np.square(p - t).sum()) / float(np.square(t - t.mean()).sum()), None


def r_squared(predicted: list[float] | np.ndarray, true: list[float] | np.ndarray, *,
              scale: float | None = None) -> float:
    """R² of :func:`r_squared_why` (NaN where it is undefined)."""
    return r_squared_why(predicted, true, scale=scale)[0]


def force_r_squared(forces: dict[str, Any]) -> dict[str, Any]:
    """``drag_r2`` and ``lift_r2`` over the cars of ``forces``
    (:meth:`SurfaceTask.force_coefficients`), both against the magnitude of the force
    coefficients (drag and lift, predicted and true): a lift that is zero up to round-off
    on every car is undefined, not a large negative number; ``r2_undefined`` says why, by
    key, where one is."""
    values = [forces[f"{k}_{w}"] for k in ("drag", "lift") for w in ("pred", "true")]
    scale = float(np.abs(np.concatenate([np.asarray(v, float) for v in values])).max()) \
        if len(forces["drag_true"]) else 0.0
    out: dict[str, Any] = {}
    undefined = {}
    for key in ("drag", "lift"):
        out[f"{key}_r2"], why = r_squared_why(forces[f"{key}_pred"], forces[f"{key}_true"],
                                              scale=scale)
        if why is not None:
            undefined[f"{key}_r2"] = why
    if undefined:
        out["r2_undefined"] = undefined
    return out


def case_channel_errors(records: dict[str, np.ndarray]) -> np.ndarray:
    """``100 x`` mean squared standardised error per case and channel, ``[S, 4]``."""
    return METRIC_SCALE * records["sse"] / records["cells"][:, None]


__all__ = ["DATASET", "R2_SPREAD", "SurfaceData", "SurfaceTask", "case_channel_errors",
           "force_r_squared", "input_normalizer", "integrated_forces", "load_drivaerml",
           "output_normalizer", "r_squared", "r_squared_why", "subset_cells"]
