"""PDE field regression on meshes and point clouds (paper Section 4.1, Table 1).

Shape letters: B batch, N points, I input and O output channels.

Data: a registered dataset (:mod:`flarepp.data`) with train and test splits, in memory
(the benchmarks, ``npz``) or a store read one sample at a time (dataset ``store``,
:mod:`flarepp.data.store`); with ``config.val_fraction`` > 0 a validation split ``val`` is
carved from the training split (:meth:`flarepp.data.DatasetSplits.carve_validation`: the
same samples whatever the run's seed) and the rest is the training split everything below
fits on. Outputs are standardised per channel with the training split's mean and std,
fitted over real points only; inputs per channel by ``config.input_norm``
(:data:`INPUT_NORMS`; ``reference``: the FLARE study's rule per dataset,
:data:`REFERENCE_INPUT_NORM`). The statistics of a store come from one streaming float64
pass (:class:`~flarepp.data.RunningMoments`), equal to the in-memory fit to rounding. A
sample's points are its real points (padding dropped); a batch pads them to its own
longest mesh with a mask, so memory follows the batch, not the dataset's largest mesh. With
the store's ``points_per_step`` a training item is a fresh random subset of that many of a
sample's points (:func:`~flarepp.data.subset_points`, seeded per sample and epoch, as the
surface task's ``cells_per_step``); evaluation uses every point.

Conditions: per-sample global values ``c [K]`` (a load, an inflow speed, a Reynolds number;
a store's ``conditions``), standardised by the training split's mean and std (the ``c``
normaliser of the checkpoint), enter a model of ``model.arch="conditioned"``
(:mod:`flarepp.models.conditioned`) as one conditioning token ``[B, 1, K]``: its
``conditioning`` scheme decides how (``concat`` appends them to every point's inputs,
``adaln`` modulates every block, ``cross`` adds the token to every encode). A plain model
on data with conditions trains without them and says so (a ``DataWarning``).

Loss (``config.loss``, :data:`LOSSES`): ``rel_l2``, the metric below as the loss;
``rel_l2_grad``, that plus ``grad_loss_weight`` x the relative L2 error of the grid's
central-difference gradients (the FLARE study's Darcy loss); ``mse``, the MSE of the
normalised outputs; ``reference`` picks per dataset as the study does (:data:`REFERENCE_LOSS`).
Metric (the FLARE study's): per-sample relative L2 ``||y_hat - y|| / ||y||`` of the
de-normalised outputs over real points and channels, averaged over samples. A sample whose
target is identically zero has no relative error; it is left out of the mean and reported
under ``zero_target_samples`` with its absolute L2 error.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from flarepp.data import (ChannelStatistics, DataError, DatasetSplits, DataWarning,
                          MeshSamples, Normalizer, load_dataset, subset_points)
from flarepp.io import RowArray, atomic_write_npz
from flarepp.models import build_model
from flarepp.plots import Panel, Series, weight_series
from flarepp.plots3d import plot_field_run
from flarepp.registry import Registry
from flarepp.storage.rundir import RunDir
from flarepp.models.surrogate import UnitMaps
from flarepp.storage.checkpoint import unit_maps
from flarepp.tasks.base import Batch, Item, Task, TokenSum, collate_point_clouds, units_on
from flarepp.tasks.registry import TASKS


def relative_l2(pred_BNO: torch.Tensor, true_BNO: torch.Tensor,
                mask_BN: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample ``||pred - true|| / ||true||`` over real points and channels, ``[B]``.

    Computed in float64; a sample with ``||true|| = 0`` gives ``inf`` (or ``nan`` if the
    prediction is exact too): callers report such samples separately.
    """
    err, ref = squared_norms(pred_BNO, true_BNO, mask_BN)
    return (err / ref).sqrt()


BASELINE_MAX_ROWS = 1 << 23
"""Training rows above which :meth:`FieldTask.baseline_metrics` is left out (the bound of
the end-of-run evaluation's training subsample, ``final_eval_train=auto``)."""

NORM_ROWS = 1 << 16
"""Rows per block of :func:`squared_norms` (its float64 temporaries: 0.5 MiB per channel)."""


def squared_norms(pred_BNO: torch.Tensor, true_BNO: torch.Tensor,
                  mask_BN: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample ``(||pred - true||^2, ||true||^2)`` over real points and channels, ``[B]``
    each, accumulated in float64 over blocks of :data:`NORM_ROWS` rows: a sample of a
    million rows never has a float64 copy of its fields (evaluation in bounded memory)."""
    err = true_BNO.new_zeros(true_BNO.shape[0], dtype=torch.float64)
    ref = torch.zeros_like(err)
    for start in range(0, true_BNO.shape[1], NORM_ROWS):
        rows = slice(start, start + NORM_ROWS)
        diff = (pred_BNO[:, rows] - true_BNO[:, rows]).double().square_()
        true = true_BNO[:, rows].double().square_()
        if mask_BN is not None:
            real = mask_BN[:, rows, None]
            diff, true = diff * real, true * real
        err += diff.sum((1, 2))
        ref += true.sum((1, 2))
    return err, ref


# ---------------------------------------------------------------------------------------------
# training losses (the loss convention of flarepp.tasks.base: a sum over the batch, a count)

def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _masked(t_BNO: torch.Tensor, mask_BN: torch.Tensor | None) -> torch.Tensor:
    return t_BNO if mask_BN is None else t_BNO * mask_BN[..., None]


def relative_l2_sum(pred_BNO: torch.Tensor, true_BNO: torch.Tensor,
                    mask_BN: torch.Tensor | None, token_sum: TokenSum) -> torch.Tensor:
    """``sum_b ||pred_b - true_b|| / ||true_b||`` over real points and channels (a scalar).

    The FLARE study's ``RelL2Loss`` (github.com/vpuri3/FLARE.py, ``pdebench/utils.py``)
    times the batch size; the squared norms are summed over a sample's tokens through
    ``token_sum``, so a sample split over context-parallel ranks gives the same value.
    """
    pred, true = _at_least_fp32(pred_BNO), _at_least_fp32(true_BNO)
    err = token_sum(_masked((pred - true).square(), mask_BN).sum((1, 2)))
    ref = token_sum(_masked(true.square(), mask_BN).sum((1, 2)))
    return (err / ref).sqrt().sum()


def grid_gradients(u_BNO: torch.Tensor, grid_shape: tuple[int, int],
                   mask_BN: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Central differences ``u[i+1, j] - u[i-1, j]`` and ``u[i, j+1] - u[i, j-1]`` at every
    node of the row-major ``n1 x n2`` grid of the N = n1 n2 points, ``[B, n1, n2, O]`` each.

    Values beyond the grid's edge, and at masked-out nodes, count as zero (the FLARE study's
    ``central_diff`` pads with zeros). The factor ``1 / (2 dx)`` is left out: it cancels in
    every relative error these gradients enter.
    """
    b, n, o = u_BNO.shape
    n1, n2 = grid_shape
    u = _masked(u_BNO, mask_BN).reshape(b, n1, n2, o)
    padded = nn.functional.pad(u, (0, 0, 1, 1, 1, 1))                    # [B, n1+2, n2+2, O]
    along_1 = padded[:, 2:, 1:-1] - padded[:, :-2, 1:-1]
    along_2 = padded[:, 1:-1, 2:] - padded[:, 1:-1, :-2]
    return along_1, along_2


def gradient_relative_l2_sum(pred_BNO: torch.Tensor, true_BNO: torch.Tensor,
                             grid_shape: tuple[int, int],
                             mask_BN: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_b sum_axis ||d pred_b - d true_b|| / ||d true_b||``: the FLARE study's Darcy
    derivative term (``darcy_deriv_loss`` in github.com/vpuri3/FLARE.py, ``pdebench/utils.py``).

    As there, the prediction's boundary ring is set to zero first (the Dirichlet condition
    ``u = 0`` of the Darcy problem) while the target is taken as it is; gradients come from
    :func:`grid_gradients`; the norms run over the real nodes of the whole grid and the
    channels. The stencil needs every node of a sample in one process: a batch whose token
    axis is not the whole grid (context parallelism, streaming) is refused.
    """
    n1, n2 = grid_shape
    if pred_BNO.shape[1] != n1 * n2:
        raise ValueError(f"the gradient loss needs every node of the {n1} x {n2} grid in one "
                         f"process, but the batch holds {pred_BNO.shape[1]} of its "
                         f"{n1 * n2} points (context parallelism splits a sample's points "
                         "over ranks); use loss=rel_l2 with context parallelism")
    pred, true = _at_least_fp32(pred_BNO), _at_least_fp32(true_BNO)
    interior = torch.zeros(n1, n2, dtype=torch.bool, device=pred.device)
    interior[1:-1, 1:-1] = True
    pred = pred * interior.reshape(1, n1 * n2, 1)
    real = (None if mask_BN is None else
            mask_BN.reshape(-1, n1, n2)[..., None])
    total = pred.new_zeros(())
    for d_pred, d_true in zip(grid_gradients(pred, grid_shape, mask_BN),
                              grid_gradients(true, grid_shape, mask_BN)):
        err, ref = (d_pred - d_true).square(), d_true.square()
        if real is not None:
            err, ref = err * real, ref * real
        total = total + (err.sum((1, 2, 3)) / ref.sum((1, 2, 3))).sqrt().sum()
    return total


class FieldLoss:
    """A training loss of the field task: ``__call__`` the batch's sum of loss terms,
    ``count`` its normaliser. ``physical_targets``: whether it compares de-normalised
    fields (then the task hands it decoded predictions and physical targets);
    ``needs_grid``: whether it needs each sample's whole structured grid."""

    physical_targets: bool = True
    needs_grid: bool = False

    def __init__(self, task: "FieldTask") -> None:
        self.task = task

    def __call__(self, pred_BNO: torch.Tensor, true_BNO: torch.Tensor,
                 mask_BN: torch.Tensor | None, token_sum: TokenSum) -> torch.Tensor:
        raise NotImplementedError

    def count(self, true_BNO: torch.Tensor, mask_BN: torch.Tensor | None,
              token_sum: TokenSum) -> torch.Tensor:
        """Samples: every sample's terms are means over its own points already."""
        return torch.full((), float(true_BNO.shape[0]), device=true_BNO.device)


LOSSES: Registry = Registry("loss")


@LOSSES.register("mse", doc="MSE of the normalised outputs over real points and channels")
class NormalisedMSE(FieldLoss):
    """``sum over real points and channels of (y_hat - y)^2`` of standardised outputs,
    divided by the number of those values in the global batch (flarepp's original loss)."""

    physical_targets = False

    def __call__(self, pred_BNO, true_BNO, mask_BN, token_sum):
        err = _masked((_at_least_fp32(pred_BNO) - true_BNO).square(), mask_BN)
        return token_sum(err.sum())

    def count(self, true_BNO, mask_BN, token_sum):
        count = (torch.full((), float(true_BNO.numel()), device=true_BNO.device)
                 if mask_BN is None else mask_BN.sum() * true_BNO.shape[-1])
        return token_sum(count)


@LOSSES.register("rel_l2", doc="per-sample relative L2 of de-normalised outputs (the metric)")
class RelativeL2(FieldLoss):
    """The reported metric as the loss: ``mean_b ||y_hat_b - y_b|| / ||y_b||`` of the
    de-normalised outputs (the FLARE study's loss on Elasticity, Airfoil, Pipe and
    DrivAerML: ``lossfun`` in github.com/vpuri3/FLARE.py, ``pdebench/__main__.py``)."""

    def __call__(self, pred_BNO, true_BNO, mask_BN, token_sum):
        return relative_l2_sum(pred_BNO, true_BNO, mask_BN, token_sum)


@LOSSES.register("rel_l2_grad", doc="rel_l2 + grad_loss_weight x relative L2 of grid "
                                     "gradients (the study's Darcy loss)")
class RelativeL2WithGradients(FieldLoss):
    """``mean_b [rel_b + w (rel(d1)_b + rel(d2)_b)]``, ``w = config.grad_loss_weight``
    (0.1 in the FLARE study): the relative L2 error plus that of the central-difference
    gradients along both grid axes (:func:`gradient_relative_l2_sum`), the study's Darcy
    loss (``batch_lossfun`` in github.com/vpuri3/FLARE.py, ``pdebench/__main__.py``).
    Needs a structured mesh (``grid_shape``)."""

    needs_grid = True

    def __call__(self, pred_BNO, true_BNO, mask_BN, token_sum):
        grid = self.task.splits.train.grid_shape
        weight = self.task.config.grad_loss_weight
        return (relative_l2_sum(pred_BNO, true_BNO, mask_BN, token_sum)
                + weight * gradient_relative_l2_sum(pred_BNO, true_BNO, grid, mask_BN))


REFERENCE_LOSS: dict[str, str] = {"darcy": "rel_l2_grad"}
"""``loss="reference"`` per dataset; ``rel_l2`` elsewhere (the FLARE study's choice for
Elasticity, Airfoil, Pipe and DrivAerML, ``pdebench/__main__.py``)."""


# ---------------------------------------------------------------------------------------------
# input normalisation

INPUT_NORMS = ("standard", "none", "bbox")
"""Per-channel input rules: ``standard`` ``(a - mean) / std``; ``none`` the raw value;
``bbox`` ``(a - min) / (max - min)``, the training split's bounding box mapped to [0, 1]."""

REFERENCE_INPUT_NORM: dict[str, str | tuple[str, ...]] = {
    "elasticity": "none",                       # raw point coordinates
    "airfoil": "none",                          # raw mesh coordinates
    "darcy": ("none", "none", "standard"),      # raw grid positions, standardised coefficient
    "pipe": "standard",                         # standardised mesh coordinates
    "drivaerml-40k": "bbox",                    # cell centres scaled to the bounding box
}
"""``input_norm="reference"`` per dataset, as the FLARE study's loaders do it
(github.com/vpuri3/FLARE.py, ``pdebench/dataset/utils.py``: Identity, UnitGaussian and
unit-cube normalisers); ``standard`` for other datasets. The study's DrivAerML box is a
fixed one written in its code; here it is the training split's."""


def resolve_loss(config: Any) -> str:
    """``config.loss``, with ``reference`` replaced by the dataset's (:data:`REFERENCE_LOSS`)."""
    if config.loss == "reference":
        return REFERENCE_LOSS.get(config.dataset, "rel_l2")
    return config.loss


def resolve_input_norm(config: Any, channels: int) -> list[str]:
    """One rule of :data:`INPUT_NORMS` per input channel."""
    rule = config.input_norm
    if rule == "reference":
        rule = REFERENCE_INPUT_NORM.get(config.dataset, "standard")
    rules = [rule] * channels if isinstance(rule, str) else list(rule)
    if len(rules) != channels:
        raise DataError(f"input_norm gives {len(rules)} rules {rules}, but the data of "
                        f"dataset {config.dataset!r} has {channels} input channels")
    return rules


def fit_input_normalizer(x_SNI: np.ndarray, mask_SN: np.ndarray | None,
                         rules: list[str]) -> Normalizer:
    """A :class:`Normalizer` (``(a - shift) / scale`` per channel) applying ``rules`` to the
    channels of ``x``, fitted on the training split's real points."""
    return input_normalizer(ChannelStatistics.of_array(x_SNI, mask_SN), rules)


def input_normalizer(stats: ChannelStatistics, rules: list[str]) -> Normalizer:
    """:func:`fit_input_normalizer` from the training split's statistics over its real
    points (whole-array or streamed, :meth:`~flarepp.data.MeshSamples.fit_statistics`)."""
    channels = len(rules)
    shift, scale = np.zeros(channels, np.float32), np.ones(channels, np.float32)
    standard = [k for k, r in enumerate(rules) if r == "standard"]
    if standard:
        fitted = Normalizer.from_statistics(stats.select(standard), what="input")
        shift[standard], scale[standard] = fitted.mean, fitted.std
    box = [k for k, r in enumerate(rules) if r == "bbox"]
    if box:
        low, high = stats.low[box], stats.high[box]
        shift[box] = low
        scale[box] = np.where(high > low, high - low, 1.0)  # a flat channel is only shifted
    return Normalizer(shift, scale)


def _source_meshes(samples: Any) -> dict[str, np.ndarray]:
    """``sources`` (each sample's source mesh file, "" where it has none) and the store's
    ``association``, for pictures on the meshes (:func:`flarepp.plots3d.plot_cases`); empty
    for samples that do not come from mesh files."""
    source_of = getattr(samples, "source_of", None)
    if source_of is None:
        return {}
    files = [source_of(i) for i in range(len(samples))]
    files = [(f.get("case") if isinstance(f, dict) else f) or "" for f in files]
    return {"sources": np.asarray(files), "association":
            np.asarray(samples.store.layout.association)}


@TASKS.register("fields", doc="PDE fields on meshes: relative L2 (or MSE) loss and metric")
class FieldTask(Task):
    """Regression of output fields at the points of a mesh from inputs at those points."""

    name = "fields"
    headline = "rel_l2"
    reported = ("zero_target_samples",)  # where a target is identically zero (summarize)
    token_keys = ("x", "y", "mask")
    carves_validation = True

    def __init__(self, config: Any, data_root: str | Path, *,
                 splits: DatasetSplits | None = None) -> None:
        super().__init__(config, data_root)
        # As read: the data's fingerprint covers its whole training split.
        self.data_splits = splits or load_dataset(config.dataset, self.data_root,
                                                  **config.dataset_options)
        self.splits = self.data_splits
        if config.val_fraction > 0:
            self.splits = self.data_splits.carve_validation(config.val_fraction)
        if self.splits.val is not None:
            self.eval_splits = (*self.eval_splits, "val")
        train = self.splits.train
        if len(self.splits.test) == 0:
            raise DataError(f"{self._where()}: the data's test split is empty, and a run is "
                            "evaluated on it; for a store, convert again with test cases "
                            "(a source of 2 or more cases, or --test-pattern)")
        if self.splits.out_dim == 0:
            raise DataError(f"{self.splits.source or self.data_root}: the data has no target "
                            "channels (a store converted with targets = [], for prediction "
                            "only), so there is nothing to train on")
        self.layout = self.splits.channel_layout()
        self.points_per_step = self.splits.points_per_step
        self.variable_n = any(s.mask is not None for s in (train, self.splits.test))
        self.loss_name = resolve_loss(config)
        self.loss_fn: FieldLoss = LOSSES.get(self.loss_name)(self)
        self.input_norm = resolve_input_norm(config, self.splits.in_dim)
        self.conditioned = self._takes_conditions()
        stats = train.fit_statistics()
        self._check_loss_data(stats)
        # A grid loss sees whole grids: padded nodes of a masked grid stay in place, masked.
        self.keeps_grid = self.loss_fn.needs_grid and train.mask is not None
        c_norm = (Normalizer.from_statistics(stats.conditions, what="condition",
                                             names=self.layout.condition_names)
                  if self.conditioned else None)
        self._set_normalizers(input_normalizer(stats.x, self.input_norm),
                              Normalizer.from_statistics(stats.y, what="output"), c_norm)

    def _where(self) -> str:
        return self.splits.source or str(self.data_root)

    def _takes_conditions(self) -> bool:
        """Whether the model takes the data's per-sample conditions: a ``conditioned``
        model needs them; a plain one on data with conditions trains without them, with a
        warning naming them (module docstring)."""
        arch = self.config.model.get("arch", "surrogate")
        names = self.layout.condition_names
        has = self.splits.train.conditions is not None
        if arch == "conditioned":
            if not has:
                raise DataError(f"{self._where()}: model.arch='conditioned' takes per-sample "
                                "conditions, but the data has none (a store converted with "
                                "`conditions` in its spec has them); train a plain model")
            if (self.config.eval_chunk_size is not None
                    and self.config.model.get("conditioning", "cross") == "cross"):
                raise ValueError("eval_chunk_size streams a mesh in chunks, but "
                                 "model.conditioning='cross' gathers the conditions in every "
                                 "encode beside the mesh's points, which a chunk's partial "
                                 "encode would count once per chunk; leave eval_chunk_size "
                                 "unset (each mesh whole) or condition by concat or adaln, "
                                 "which stream exactly")
            return True
        if has:
            warnings.warn(f"{self._where()}: the data has per-sample conditions {names}, "
                          f"which model.arch={arch!r} does not take, so it trains without "
                          "them; to use them train a conditioned model (preset "
                          "store-conditioned-tiny, or --set model.arch=conditioned), or "
                          "leave them out with dataset_options.conditions=[]", DataWarning,
                          stacklevel=3)
        return False

    @classmethod
    def check_config(cls, config: Any) -> None:
        """The task's options in ``config`` (``loss``, ``input_norm``, ``grad_loss_weight``),
        checked before any data is read; a ``ValueError`` names the option and its values."""
        if config.loss != "reference" and config.loss not in LOSSES:
            raise ValueError(f"unknown loss {config.loss!r}; known losses: "
                             f"{', '.join(LOSSES.names())} and reference (the FLARE study's "
                             "per dataset)")
        rules = [config.input_norm] if isinstance(config.input_norm, str) else config.input_norm
        for rule in rules:
            if rule not in (*INPUT_NORMS, "reference") or (rule == "reference"
                                                           and len(rules) > 1):
                raise ValueError(f"input_norm: unknown rule {rule!r}; give one of "
                                 f"{', '.join(INPUT_NORMS)} or reference, or a list with one "
                                 f"of {', '.join(INPUT_NORMS)} per input channel")
        if config.grad_loss_weight < 0:
            raise ValueError(f"grad_loss_weight must be >= 0, got {config.grad_loss_weight}")

    def _check_loss_data(self, stats) -> None:
        """Refuse training data on which the loss is undefined (a relative error of a zero
        target, a gradient loss without a grid or on random point subsets)."""
        train, where = self.splits.train, self._where()
        if self.loss_fn.needs_grid and self.points_per_step is not None:
            raise ValueError(f"loss={self.loss_name} needs every node of a grid, but "
                             f"dataset_options.points_per_step={self.points_per_step} trains "
                             "on random subsets of the points; use loss=rel_l2")
        if not self.loss_fn.physical_targets:
            return
        if stats.zero_targets:
            raise DataError(f"{where}: training sample(s) {stats.zero_targets[:10]} have an "
                            f"all-zero target, whose relative error (loss={self.loss_name}) "
                            "is undefined; remove them or train with loss=mse")
        if self.loss_fn.needs_grid:
            if train.grid_shape is None:
                raise DataError(f"{where}: loss=rel_l2_grad needs a structured grid "
                                f"(grid_shape), but dataset {self.config.dataset!r} has none; "
                                "use loss=rel_l2")
            mask = np.ones(train.y.shape[:2], bool) if train.mask is None else train.mask
            y = torch.from_numpy(train.y.astype(np.float64))
            grads = grid_gradients(y, train.grid_shape,
                                   None if train.mask is None else torch.from_numpy(mask))
            flat = sorted({int(i) for g in grads
                           for i in np.flatnonzero(g.square().sum((1, 2, 3)).numpy() == 0)})
            if flat:
                raise DataError(f"{where}: training sample(s) {flat[:10]} have a "
                                "target constant along a grid axis, whose gradient's relative "
                                "error (loss=rel_l2_grad) is undefined; use loss=rel_l2")

    def _set_normalizers(self, x_norm: Normalizer, y_norm: Normalizer,
                         c_norm: Normalizer | None = None) -> None:
        self.x_norm, self.y_norm, self.c_norm = x_norm, y_norm, c_norm
        self.units = UnitMaps(**unit_maps(self.normalizers()))  # the loss de-normalises
        self._check_test_range()

    def _check_test_range(self) -> dict[int, float]:
        """Warn (:meth:`Normalizer.check_range`) when standardised test inputs lie far
        outside the training range; channels under ``none`` or ``bbox`` are not in training
        standard deviations and are left out. Returns ``{channel: max |z|}``."""
        standard = [k for k, r in enumerate(self.input_norm) if r == "standard"]
        test = self.splits.test
        if not standard or len(test) == 0:
            return {}
        part = Normalizer(self.x_norm.mean[standard], self.x_norm.std[standard])
        return part.check_statistics(
            test.fit_statistics().x.select(standard), channels=standard,
            what=f"{self.splits.source or self.config.dataset} test inputs")

    # -- data ----------------------------------------------------------------------------
    def samples(self, split: str) -> MeshSamples:
        known = ("train", "test") if self.splits.val is None else ("train", "test", "val")
        if split not in known:
            raise ValueError(f"unknown split {split!r}; the fields task has 'train' and "
                             "'test', and 'val' with val_fraction > 0")
        return getattr(self.splits, split)

    def num_samples(self, split: str) -> int:
        return len(self.samples(split))

    def get(self, split: str, index: int, seed: int, *, training: bool = False) -> Item:
        """Normalised inputs; for training the targets the loss compares (normalised for
        ``mse``, physical otherwise), physical ones for evaluation; a training item of a
        store with ``points_per_step`` is a random subset of the sample's points drawn
        with ``seed``; the sample's normalised ``conditions`` for a conditioned model."""
        s = self.samples(split)
        normalise_y = training and not self.loss_fn.physical_targets
        item = {"index": np.int64(index)}
        if training and self.keeps_grid:     # whole grids with their own masks
            real = s.mask[index][:, None]
            x = self.x_norm.encode(s.x[index]) * real
            y = self.y_norm.encode(s.y[index]) * real if normalise_y else s.y[index]
            item["mask"] = np.ascontiguousarray(s.mask[index])
        else:
            points = None
            if training and self.points_per_step is not None:
                points = subset_points(int(s.point_counts()[index]), self.points_per_step,
                                       seed)
            x, y = s.sample(index, points)
            x = self.x_norm.encode(x)
            if normalise_y:
                y = self.y_norm.encode(y)
        item.update(x=np.ascontiguousarray(x, np.float32), y=np.ascontiguousarray(y, np.float32))
        if self.conditioned:
            item["conditions"] = np.ascontiguousarray(
                self.c_norm.encode(s.conditions[index]), np.float32)
        return item

    def item_size(self, item: Item) -> int:
        return int(item["x"].shape[0])

    def sample_sizes(self, split: str) -> np.ndarray:
        return self.samples(split).point_counts()

    def collate(self, items: list[Item]) -> Batch:
        own_masks = "mask" in items[0]  # whole grids with their own masks
        lengths = [self.item_size(it) for it in items]
        batch = collate_point_clouds(items, lengths, masked=(self.variable_n or len(set(
            lengths)) > 1) and not own_masks)
        if own_masks:
            batch["mask"] = torch.from_numpy(np.stack([it["mask"] for it in items]))
        if self.conditioned:
            batch["conditions"] = torch.from_numpy(np.stack([it["conditions"] for it in items]))
        return batch

    # -- model ---------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        extra = ({"cond_dim": len(self.layout.condition_names), "cond_tokens": 1}
                 if self.conditioned else {})
        return build_model(in_dim=self.splits.in_dim, out_dim=self.splits.out_dim,
                           **extra, **self.config.model_kwargs())

    def model_inputs(self, batch: Batch) -> Batch:
        """``x`` and ``mask``; for a conditioned model also the batch's conditions as one
        conditioning token ``[B, 1, K]`` (module docstring)."""
        inputs = {key: batch[key] for key in ("x", "mask") if key in batch}
        if not self.conditioned:
            return inputs
        if "conditions" not in batch:
            names = self.layout.condition_names
            raise DataError(f"the model was trained with per-sample conditions {names}, and "
                            "this batch has none; give every sample its conditions")
        return {**inputs, "conditioning": batch["conditions"][:, None, :]}

    # -- loss and metrics ----------------------------------------------------------------
    def loss(self, pred: torch.Tensor, batch: Batch, token_sum: TokenSum) -> torch.Tensor:
        """The sum over the batch of ``config.loss``'s terms (:data:`LOSSES`), of the
        predictions de-normalised by the task's maps for a loss of physical fields."""
        mask = batch.get("mask")
        if self.loss_fn.physical_targets:
            pred = units_on(self.units, pred.device).denormalise(pred, mask)
        return self.loss_fn(pred, batch["y"], mask, token_sum)

    def loss_count(self, batch: Batch, token_sum: TokenSum) -> torch.Tensor:
        return self.loss_fn.count(batch["y"], batch.get("mask"), token_sum)

    def eval_records(self, pred: torch.Tensor, batch: Batch) -> dict[str, np.ndarray]:
        """Per sample: relative and absolute L2 errors of the predictions (physical units,
        zero at padding: the predictor's) and the target's norm."""
        err, ref = squared_norms(pred, batch["y"], batch.get("mask"))
        return {"index": batch["index"].cpu().numpy(),
                "rel_l2": (err / ref).sqrt().cpu().numpy(),
                "ref_norm": ref.sqrt().cpu().numpy(),
                "abs_l2": err.sqrt().cpu().numpy()}

    def summarize(self, split: str, records: dict[str, np.ndarray]) -> dict[str, Any]:
        zero = records["ref_norm"] == 0
        rel = records["rel_l2"]
        metrics: dict[str, Any] = {
            "rel_l2": float(rel[~zero].mean()) if (~zero).any() else float("nan"),
            "per_sample": [float(v) if not z else None for v, z in zip(rel, zero)]}
        if zero.any():
            metrics["zero_target_samples"] = {
                int(i): float(a) for i, a in zip(records["index"][zero],
                                                 records["abs_l2"][zero])}
        return metrics

    # -- state and outputs ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The ``x`` and ``y`` normalisers, and ``c`` (the conditions') when conditioned."""
        state = {"x": self.x_norm.state_dict(), "y": self.y_norm.state_dict()}
        if self.c_norm is not None:
            state["c"] = self.c_norm.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.conditioned and "c" not in state:
            raise DataError("the checkpoint holds no normaliser of the conditions "
                            f"{self.layout.condition_names} this task feeds its model")
        self._set_normalizers(Normalizer.from_state_dict(state["x"]),
                              Normalizer.from_state_dict(state["y"]),
                              Normalizer.from_state_dict(state["c"]) if self.conditioned
                              else None)

    def normalizers(self) -> dict[str, Normalizer]:
        maps = {"x": self.x_norm, "y": self.y_norm}
        if self.c_norm is not None:
            maps["c"] = self.c_norm
        return maps

    def input_layout(self) -> dict[str, Any]:
        """``{"coordinates": G, "names": [...]}``: the first G input channels are the
        points' coordinates, as the data's channel layout says (a store's, from its spec);
        for in-memory data only where its plot positions are exactly those channels (every
        built-in dataset). G is None when the data does not say (an ``npz`` without
        ``coords``, or with positions that are not inputs)."""
        coordinates = self.layout.coordinates or None
        train = self.splits.train
        if coordinates is not None and self.splits.layout is None:
            real = np.ones(train.x.shape[:2], bool) if train.mask is None else train.mask
            if train.coords is None or not np.array_equal(
                    train.coords[real], train.x[..., :coordinates][real]):
                coordinates = None
        return {"coordinates": coordinates, "names": self.layout.input_channels}

    def describe_data(self) -> dict[str, Any]:
        """Field names, units, loss, input rules and the channel ``layout``
        (:class:`~flarepp.data.ChannelLayout`: every input, target and condition channel,
        the leading coordinate channels, point or cell data, units and scales), with the
        ``conditions`` the model takes ([] for none): enough to assemble a model's inputs
        from a mesh."""
        facts = {"dataset": self.config.dataset, "field_names": self.splits.field_names,
                 "units": self.splits.units, "loss": self.loss_name,
                 "input_norm": self.input_norm, "inputs": self.input_layout(),
                 "layout": self.layout.to_dict(),
                 "conditions": self.layout.condition_names if self.conditioned else [],
                 "points_per_step": self.points_per_step}
        if self.splits.val is not None:
            facts["validation"] = {"fraction": self.config.val_fraction,
                                   "samples": len(self.splits.val)}
        return facts

    def baseline_metrics(self) -> dict[str, float]:
        """``train_constant_rel_l2``: the metric on the training samples of the best
        prediction that ignores the input, one fixed value per point and channel,
        ``c_n = sum_b w_b y_bn / sum_b w_b`` over the samples whose point n is real, with
        ``w_b = 1 / ||y_b||^2``: the fixed prediction that minimises the mean squared
        relative error ``mean_b ||c - y_b||^2 / ||y_b||^2``. A sample with a zero target is
        left out, as in the metric. Left out (``{}``) for a training split of more than
        :data:`BASELINE_MAX_ROWS` rows: its float64 accumulators hold the widest sample's
        rows, and its two passes read the whole split, more than the end-of-run evaluation
        of such a store reads (a store of large meshes, whose points differ per sample
        anyway)."""
        train = self.splits.train
        counts = train.point_counts()
        if int(np.sum(counts)) > BASELINE_MAX_ROWS:
            return {}

        def targets(b: int) -> tuple[np.ndarray, np.ndarray]:   # y [n, O], its positions [n]
            real = None if train.mask is None else train.mask[b]
            where = np.arange(counts[b]) if real is None else np.flatnonzero(real)
            return train.sample(b)[1].astype(np.float64), where

        weighted = np.zeros((train.n_points, train.out_dim))
        weight = np.zeros((train.n_points, 1))
        ref_S = np.zeros(len(train))
        for b in range(len(train)):                  # one pass: the weighted mean per point
            y, where = targets(b)
            ref_S[b] = np.square(y).sum()
            if ref_S[b] > 0:
                weighted[where] += y / ref_S[b]
                weight[where] += 1.0 / ref_S[b]
        keep = ref_S > 0
        if not keep.any():
            return {}
        constant_NO = weighted / np.where(weight > 0, weight, 1.0)
        err_S = np.zeros(len(train))
        for b in np.flatnonzero(keep):               # a second pass: its error per sample
            y, where = targets(b)
            err_S[b] = np.square(constant_NO[where] - y).sum()
        return {f"train_constant_{self.headline}":
                float(np.sqrt(err_S[keep] / ref_S[keep]).mean())}

    def data_identity(self) -> dict[str, Any]:
        return self.data_splits.train.fingerprint(self.data_root)

    def check_model(self, model_config: dict[str, Any]) -> None:
        for key, have in (("in_dim", self.splits.in_dim), ("out_dim", self.splits.out_dim)):
            if model_config.get(key) != have:
                what = "inputs" if key == "in_dim" else "outputs"
                raise DataError(f"{self.splits.source or self.data_root}: the data's {what} "
                                f"have {have} channels, the checkpoint's model takes "
                                f"{model_config.get(key)}")
        takes = model_config.get("arch") == "conditioned"
        names = self.layout.condition_names if self.conditioned else []
        if takes != self.conditioned or (takes and model_config.get("cond_dim") != len(names)):
            raise DataError(f"{self._where()}: the task feeds the model the conditions "
                            f"{names}, the checkpoint's model takes "
                            f"{model_config.get('cond_dim', 0) if takes else 0} conditions")

    def predictions_to_keep(self, split: str) -> list[int]:
        """Every test sample: :meth:`write_outputs` writes the test predictions."""
        return list(range(self.num_samples(split))) if split == "test" else []

    def write_outputs(self, out_dir: Path, split: str, records: dict[str, np.ndarray], *,
                      predictions: Mapping[int, np.ndarray] | None = None) -> list[Path]:
        """``predictions_test.npz``: ``pred`` and ``true [S, N, O]`` at the split's own
        point layout (zeros at padding), ``coords``, ``rel_l2`` per sample, the field names
        and units (and ``mask``, ``grid_shape``, the source meshes where the data has
        them); the predictions and a store's samples are written one sample at a time."""
        if split != "test":
            return []
        padded = self.samples(split).padded_arrays()
        real, kept = padded["real"], predictions or {}

        def pred_row(i: int) -> np.ndarray:
            row = np.zeros((real.shape[1], self.splits.out_dim), np.float32)
            pred = kept.get(i)
            if pred is not None:
                row[real[i]] = pred
            return row

        arrays = {"pred": RowArray((*real.shape, self.splits.out_dim), np.float32, pred_row),
                  "true": padded["true"], "coords": padded["coords"],
                  "rel_l2": records["rel_l2"],
                  "field_names": np.asarray(self.splits.field_names),
                  "units": np.asarray(self.splits.units)}
        arrays.update({k: padded[k] for k in ("mask", "grid_shape") if k in padded})
        arrays.update(_source_meshes(self.samples(split)))
        return [atomic_write_npz(RunDir(out_dir).predictions(split), arrays, compressed=True)]

    @classmethod
    def plot_run(cls, out_dir: Path, cases: int) -> list[Path]:
        run = RunDir(out_dir)
        # as stored: an unversioned config trained the legacy protocol (MSE)
        loss = run.read_config().loss if run.config_path.is_file() else "mse"
        if loss == "reference":
            loss = REFERENCE_LOSS.get(run.read_config().dataset, "rel_l2")
        panels = [Panel(f"training loss ({loss})",
                        (Series("train_loss", "training (live weights)"),)),
                  Panel("test relative L2 [%]", weight_series("test_rel_l2", "test", 100.0))]
        return plot_field_run(out_dir, panels, cases=cases)
