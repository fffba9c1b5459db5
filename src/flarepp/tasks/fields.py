"""PDE field regression on meshes and point clouds (paper Section 4.1, Table 1).

Shape letters: B batch, N points, I input and O output channels.

Data: a registered dataset (:mod:`flarepp.data`) with train and test splits; with
``config.val_fraction`` > 0 a validation split ``val`` is carved from the training split
(:meth:`flarepp.data.DatasetSplits.carve_validation`: the same samples whatever the run's
seed) and the rest is the training split everything below fits on. Outputs are
standardised per channel with the training split's mean and std, fitted over real points
only; inputs per channel by ``config.input_norm`` (:data:`INPUT_NORMS`; ``reference``: the
FLARE study's rule per dataset, :data:`REFERENCE_INPUT_NORM`). A sample's points are its
real points (padding dropped); a batch pads them to its own longest mesh with a mask, so
memory follows the batch, not the dataset's largest mesh.

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

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from flarepp.data import DataError, DatasetSplits, MeshSamples, Normalizer, load_dataset
from flarepp.io import atomic_write_npz
from flarepp.models import build_model
from flarepp.registry import Registry
from flarepp.storage.rundir import RunDir
from flarepp.tasks.base import Batch, Item, Task, TokenSum, collate_point_clouds
from flarepp.tasks.registry import TASKS


def relative_l2(pred_BNO: torch.Tensor, true_BNO: torch.Tensor,
                mask_BN: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample ``||pred - true|| / ||true||`` over real points and channels, ``[B]``.

    Computed in float64; a sample with ``||true|| = 0`` gives ``inf`` (or ``nan`` if the
    prediction is exact too): callers report such samples separately.
    """
    err = (pred_BNO - true_BNO).double().square()
    ref = true_BNO.double().square()
    if mask_BN is not None:
        err = err * mask_BN[..., None]
        ref = ref * mask_BN[..., None]
    return (err.sum((1, 2)) / ref.sum((1, 2))).sqrt()


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
    channels = x_SNI.shape[-1]
    shift, scale = np.zeros(channels, np.float32), np.ones(channels, np.float32)
    standard = [k for k, r in enumerate(rules) if r == "standard"]
    if standard:
        fitted = Normalizer.fit(x_SNI[..., standard], mask_SN, what="input")
        shift[standard], scale[standard] = fitted.mean, fitted.std
    box = [k for k, r in enumerate(rules) if r == "bbox"]
    if box:
        flat = x_SNI[..., box].reshape(-1, len(box))
        if mask_SN is not None:
            flat = flat[mask_SN.reshape(-1)]
        low, high = flat.min(0).astype(np.float64), flat.max(0).astype(np.float64)
        shift[box] = low
        scale[box] = np.where(high > low, high - low, 1.0)  # a flat channel is only shifted
    return Normalizer(shift, scale)


@TASKS.register("fields", doc="PDE fields on meshes: relative L2 (or MSE) loss and metric")
class FieldTask(Task):
    """Regression of output fields at the points of a mesh from inputs at those points."""

    name = "fields"
    headline = "rel_l2"
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
            self.eval_splits = (*self.eval_splits, "val")
        train = self.splits.train
        self.variable_n = any(s.mask is not None for s in (train, self.splits.test))
        self.loss_name = resolve_loss(config)
        self.loss_fn: FieldLoss = LOSSES.get(self.loss_name)(self)
        self.input_norm = resolve_input_norm(config, self.splits.in_dim)
        self._check_loss_data()
        # A grid loss sees whole grids: padded nodes of a masked grid stay in place, masked.
        self.keeps_grid = self.loss_fn.needs_grid and train.mask is not None
        self._set_normalizers(fit_input_normalizer(train.x, train.mask, self.input_norm),
                              Normalizer.fit(train.y, train.mask, what="output"))

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

    def _check_loss_data(self) -> None:
        """Refuse training data on which the loss is undefined (a relative error of a zero
        target, a gradient loss without a grid)."""
        if not self.loss_fn.physical_targets:
            return
        train, where = self.splits.train, self.splits.source or str(self.data_root)
        mask = np.ones(train.y.shape[:2], bool) if train.mask is None else train.mask
        zero = np.flatnonzero((np.square(train.y, dtype=np.float64)
                               * mask[..., None]).sum((1, 2)) == 0)
        if len(zero):
            raise DataError(f"{where}: training sample(s) {zero[:10].tolist()} have an all-zero "
                            f"target, whose relative error (loss={self.loss_name}) is "
                            "undefined; remove them or train with loss=mse")
        if self.loss_fn.needs_grid:
            if train.grid_shape is None:
                raise DataError(f"{where}: loss=rel_l2_grad needs a structured grid "
                                f"(grid_shape), but dataset {self.config.dataset!r} has none; "
                                "use loss=rel_l2")
            y = torch.from_numpy(train.y.astype(np.float64))
            grads = grid_gradients(y, train.grid_shape,
                                   None if train.mask is None else torch.from_numpy(mask))
            flat = sorted({int(i) for g in grads
                           for i in np.flatnonzero(g.square().sum((1, 2, 3)).numpy() == 0)})
            if flat:
                raise DataError(f"{where}: training sample(s) {flat[:10]} have a "
                                "target constant along a grid axis, whose gradient's relative "
                                "error (loss=rel_l2_grad) is undefined; use loss=rel_l2")

    def _set_normalizers(self, x_norm: Normalizer, y_norm: Normalizer) -> None:
        self.x_norm, self.y_norm = x_norm, y_norm
        train = self.splits.train
        # Normalised training arrays, padding kept at exactly zero.
        x_n, y_n = x_norm.encode(train.x), y_norm.encode(train.y)
        if train.mask is not None:
            x_n, y_n = x_n * train.mask[..., None], y_n * train.mask[..., None]
        self._train_normalised = (x_n, y_n)
        self._check_test_range()

    def _check_test_range(self) -> dict[int, float]:
        """Warn (:meth:`Normalizer.check_range`) when standardised test inputs lie far
        outside the training range; channels under ``none`` or ``bbox`` are not in training
        standard deviations and are left out. Returns ``{channel: max |z|}``."""
        standard = [k for k, r in enumerate(self.input_norm) if r == "standard"]
        test = self.splits.test
        if not standard or test.x.shape[0] == 0:
            return {}
        part = Normalizer(self.x_norm.mean[standard], self.x_norm.std[standard])
        return part.check_range(test.x[..., standard], test.mask, channels=standard,
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
        ``mse``, physical otherwise), physical ones for evaluation."""
        s = self.samples(split)
        if training:
            x = self._train_normalised[0][index]
            y = s.y[index] if self.loss_fn.physical_targets else self._train_normalised[1][index]
        else:
            x, y = self.x_norm.encode(s.x[index]), s.y[index]
        item = {"index": np.int64(index)}
        if s.mask is not None and training and self.keeps_grid:
            item["mask"] = np.ascontiguousarray(s.mask[index])
        elif s.mask is not None:
            real = s.mask[index]
            x, y = x[real], y[real]
        item.update(x=np.ascontiguousarray(x, np.float32), y=np.ascontiguousarray(y, np.float32))
        return item

    def item_size(self, item: Item) -> int:
        return int(item["x"].shape[0])

    def collate(self, items: list[Item]) -> Batch:
        own_masks = "mask" in items[0]  # whole grids with their own masks
        batch = collate_point_clouds(items, [self.item_size(it) for it in items],
                                     masked=self.variable_n and not own_masks)
        if own_masks:
            batch["mask"] = torch.from_numpy(np.stack([it["mask"] for it in items]))
        return batch

    # -- model ---------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        return build_model(in_dim=self.splits.in_dim, out_dim=self.splits.out_dim,
                           **self.config.model_kwargs())

    # -- loss and metrics ----------------------------------------------------------------
    def loss(self, pred: torch.Tensor, batch: Batch, token_sum: TokenSum) -> torch.Tensor:
        """The sum over the batch of ``config.loss``'s terms (:data:`LOSSES`)."""
        mask = batch.get("mask")
        if self.loss_fn.physical_targets:
            pred = _masked(self.y_norm.decode(_at_least_fp32(pred)), mask)
        return self.loss_fn(pred, batch["y"], mask, token_sum)

    def loss_count(self, batch: Batch, token_sum: TokenSum) -> torch.Tensor:
        return self.loss_fn.count(batch["y"], batch.get("mask"), token_sum)

    def eval_records(self, pred: torch.Tensor, batch: Batch) -> dict[str, np.ndarray]:
        """Per sample: relative and absolute L2 errors of the predictions (physical units,
        zero at padding: the predictor's), the target's norm and the predictions."""
        out = pred
        mask = batch.get("mask")
        y = batch["y"]
        ref = y.double().square()
        err = (out - y).double().square()
        if mask is not None:
            ref, err = ref * mask[..., None], err * mask[..., None]
        return {"index": batch["index"].cpu().numpy(),
                "rel_l2": relative_l2(out, y, mask).cpu().numpy(),
                "ref_norm": ref.sum((1, 2)).sqrt().cpu().numpy(),
                "abs_l2": err.sum((1, 2)).sqrt().cpu().numpy(),
                "pred": out.cpu().numpy()}

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
        return {"x": self.x_norm.state_dict(), "y": self.y_norm.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._set_normalizers(Normalizer.from_state_dict(state["x"]),
                              Normalizer.from_state_dict(state["y"]))

    def normalizers(self) -> dict[str, Normalizer]:
        return {"x": self.x_norm, "y": self.y_norm}

    def input_layout(self) -> dict[str, Any]:
        """``{"coordinates": G, "names": [...]}``: the first G input channels are the
        points' coordinates when the data's plot positions are exactly those channels
        (every built-in dataset); G is None when the data does not say (an ``npz`` without
        ``coords``, or with positions that are not inputs)."""
        train = self.splits.train
        coordinates = None
        if train.coords is not None and train.coords.shape[-1] <= train.x.shape[-1]:
            g = train.coords.shape[-1]
            real = np.ones(train.x.shape[:2], bool) if train.mask is None else train.mask
            if np.array_equal(train.coords[real], train.x[..., :g][real]):
                coordinates = int(g)
        axes = ("x", "y", "z")
        names = [axes[k] if coordinates is not None and k < coordinates <= 3
                 else f"input {k}" for k in range(self.splits.in_dim)]
        return {"coordinates": coordinates, "names": names}

    def describe_data(self) -> dict[str, Any]:
        facts = {"dataset": self.config.dataset, "field_names": self.splits.field_names,
                 "units": self.splits.units, "loss": self.loss_name,
                 "input_norm": self.input_norm, "inputs": self.input_layout()}
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
        left out, as in the metric."""
        train = self.splits.train
        real_SN1 = (np.ones(train.y.shape[:2], bool) if train.mask is None
                    else train.mask)[..., None]
        y_SNO = train.y.astype(np.float64) * real_SN1
        ref_S = np.square(y_SNO).sum((1, 2))
        keep = ref_S > 0
        if not keep.any():
            return {}
        w_S11 = (1.0 / ref_S[keep])[:, None, None]
        weight_NO = (w_S11 * real_SN1[keep]).sum(0)
        constant_NO = (w_S11 * y_SNO[keep]).sum(0) / np.where(weight_NO > 0, weight_NO, 1.0)
        err_S = (np.square(constant_NO - y_SNO) * real_SN1).sum((1, 2))
        return {f"train_constant_{self.headline}":
                float(np.sqrt(err_S[keep] / ref_S[keep]).mean())}

    def data_identity(self) -> dict[str, Any]:
        from flarepp.data.fingerprint import data_fingerprint
        return data_fingerprint(self.data_splits.train, self.data_root)

    def check_model(self, model_config: dict[str, Any]) -> None:
        for key, have in (("in_dim", self.splits.in_dim), ("out_dim", self.splits.out_dim)):
            if model_config.get(key) != have:
                what = "inputs" if key == "in_dim" else "outputs"
                raise DataError(f"{self.splits.source or self.data_root}: the data's {what} "
                                f"have {have} channels, the checkpoint's model takes "
                                f"{model_config.get(key)}")

    def full_predictions(self, split: str, records: dict[str, np.ndarray]) -> np.ndarray:
        """Predictions ``[S, N, O]`` at the split's own point layout (zeros at padding)."""
        s = self.samples(split)
        pred = np.zeros(s.y.shape, np.float32)
        for row, i in enumerate(records["index"]):
            if s.mask is None:
                pred[i] = records["pred"][row, : s.n_points]
            else:
                real = s.mask[i]
                pred[i, real] = records["pred"][row, : int(real.sum())]
        return pred

    def write_outputs(self, out_dir: Path, split: str, records: dict[str, np.ndarray]
                      ) -> list[Path]:
        if split != "test":
            return []
        s = self.samples(split)
        coords = s.coords if s.coords is not None else s.x[..., :2]
        arrays = {"pred": self.full_predictions(split, records), "true": s.y,
                  "coords": coords, "rel_l2": records["rel_l2"],
                  "field_names": np.asarray(self.splits.field_names),
                  "units": np.asarray(self.splits.units)}
        if s.mask is not None:
            arrays["mask"] = s.mask
        if s.grid_shape is not None:
            arrays["grid_shape"] = np.asarray(s.grid_shape)
        return [atomic_write_npz(RunDir(out_dir).predictions(split), arrays, compressed=True)]

    @classmethod
    def plot_run(cls, out_dir: Path, cases: int) -> list[Path]:
        from flarepp.plots import Panel, Series, plot_field_run, weight_series
        run = RunDir(out_dir)
        # as stored: an unversioned config trained the legacy protocol (MSE)
        loss = run.read_config().loss if run.config_path.is_file() else "mse"
        if loss == "reference":
            loss = REFERENCE_LOSS.get(run.read_config().dataset, "rel_l2")
        panels = [Panel(f"training loss ({loss})",
                        (Series("train_loss", "training (live weights)"),)),
                  Panel("test relative L2 [%]", weight_series("test_rel_l2", "test", 100.0))]
        return plot_field_run(out_dir, panels, cases=cases)
