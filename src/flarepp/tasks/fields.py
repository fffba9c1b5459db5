"""PDE field regression on meshes and point clouds (paper Section 4.1, Table 1).

Shape letters: B batch, N points, I input and O output channels.

Data: a registered dataset (:mod:`flarepp.data`) with train and test splits; inputs and
outputs are standardised per channel with the training split's mean and std, fitted over
real points only. A sample's points are its real points (padding dropped); a batch pads
them to its own longest mesh with a mask, so memory follows the batch, not the dataset's
largest mesh.

Loss: the MSE of the normalised outputs over the real points of the batch.
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

from flarepp.data import DatasetSplits, MeshSamples, Normalizer, load_dataset
from flarepp.io import atomic_write
from flarepp.models import build_model
from flarepp.tasks.base import Batch, Item, Task, TokenSum, pad_stack
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


@TASKS.register("fields", doc="PDE fields on meshes: MSE of normalised outputs, relative L2")
class FieldTask(Task):
    """Regression of output fields at the points of a mesh from inputs at those points."""

    name = "fields"
    headline = "rel_l2"
    token_keys = ("x", "y", "mask")

    def __init__(self, config: Any, data_root: str | Path, *,
                 splits: DatasetSplits | None = None) -> None:
        super().__init__(config, data_root)
        self.splits = splits or load_dataset(config.dataset, self.data_root,
                                             **config.dataset_options)
        train = self.splits.train
        self.x_norm = Normalizer.fit(train.x, train.mask)
        self.y_norm = Normalizer.fit(train.y, train.mask)
        # Normalised training arrays, padding kept at exactly zero.
        x_n, y_n = self.x_norm.encode(train.x), self.y_norm.encode(train.y)
        if train.mask is not None:
            x_n, y_n = x_n * train.mask[..., None], y_n * train.mask[..., None]
        self._train_normalised = (x_n, y_n)
        self.variable_n = any(s.mask is not None for s in (train, self.splits.test))

    # -- data ----------------------------------------------------------------------------
    def samples(self, split: str) -> MeshSamples:
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; the fields task has 'train' and 'test'")
        return getattr(self.splits, split)

    def num_samples(self, split: str) -> int:
        return len(self.samples(split))

    def get(self, split: str, index: int, seed: int, *, training: bool = False) -> Item:
        """Normalised inputs; normalised targets for training, physical ones for evaluation."""
        s = self.samples(split)
        if training:
            x, y = self._train_normalised[0][index], self._train_normalised[1][index]
        else:
            x, y = self.x_norm.encode(s.x[index]), s.y[index]
        if s.mask is not None:
            real = s.mask[index]
            x, y = x[real], y[real]
        return {"x": np.ascontiguousarray(x, np.float32),
                "y": np.ascontiguousarray(y, np.float32), "index": np.int64(index)}

    def item_size(self, item: Item) -> int:
        return int(item["x"].shape[0])

    def collate(self, items: list[Item]) -> Batch:
        lengths = [self.item_size(it) for it in items]
        n = max(lengths)
        batch = {"x": torch.from_numpy(pad_stack([it["x"] for it in items], n)),
                 "y": torch.from_numpy(pad_stack([it["y"] for it in items], n)),
                 "index": torch.tensor([int(it["index"]) for it in items])}
        if self.variable_n:
            mask = np.arange(n)[None, :] < np.asarray(lengths)[:, None]
            batch["mask"] = torch.from_numpy(mask)
        return batch

    # -- model ---------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        return build_model(in_dim=self.splits.in_dim, out_dim=self.splits.out_dim,
                           **self.config.model_kwargs())

    # -- loss and metrics ----------------------------------------------------------------
    def loss(self, pred: torch.Tensor, batch: Batch, token_sum: TokenSum) -> torch.Tensor:
        err = (pred.float() - batch["y"]).square()
        mask = batch.get("mask")
        if mask is not None:
            err = err * mask[..., None]
        return token_sum(err.sum())

    def loss_count(self, batch: Batch, token_sum: TokenSum) -> torch.Tensor:
        y, mask = batch["y"], batch.get("mask")
        count = (torch.tensor(float(y.numel()), device=y.device) if mask is None
                 else mask.sum() * y.shape[-1])
        return token_sum(count)

    def predict(self, pred: torch.Tensor, batch: Batch) -> torch.Tensor:
        """De-normalised predictions, zero at padding."""
        out = self.y_norm.decode(pred.float())
        mask = batch.get("mask")
        return out if mask is None else out * mask[..., None]

    def eval_records(self, pred: torch.Tensor, batch: Batch) -> dict[str, np.ndarray]:
        out = self.predict(pred, batch)
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
        self.x_norm = Normalizer.from_state_dict(state["x"])
        self.y_norm = Normalizer.from_state_dict(state["y"])

    def describe_data(self) -> dict[str, Any]:
        return {"dataset": self.config.dataset, "field_names": self.splits.field_names,
                "units": self.splits.units}

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
        path = out_dir / "test_predictions.npz"

        def write(tmp):
            with open(tmp, "wb") as f:
                np.savez_compressed(f, **arrays)
        atomic_write(path, write)
        return [path]

    @classmethod
    def plot_run(cls, out_dir: Path, cases: int) -> list[Path]:
        from flarepp.plots import plot_run
        return plot_run(out_dir, cases=cases)
