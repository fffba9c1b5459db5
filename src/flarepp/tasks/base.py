"""The task interface: what the one trainer needs to know about a problem.

A task owns the data (splits, normalisation, how one sample is read and how samples are
batched), the model it builds, the loss, the metric and the plots. The trainer
(:mod:`flarepp.train`) owns everything else: devices, precision, data and context
parallelism, the optimiser, EMA, checkpoints and logging. A task never moves a tensor to
a device and never calls a collective: where a loss needs sums over the tokens of a
sample (which context parallelism splits across ranks), the trainer hands it a
``token_sum`` function that is the identity on one device and a differentiable
all-reduce over the context-parallel group otherwise.

Loss convention. ``loss(pred, batch, token_sum)`` returns the *sum* over the batch of the
loss terms and ``loss_count(batch, token_sum)`` their normaliser (real points x channels
for an MSE, samples for a per-sample error): the trainer divides the sum by the count of
the whole global batch, so a batch split over data-parallel ranks, or over micro-batches,
gives exactly the single-process loss and gradient.

Evaluation convention. ``eval_records(pred, batch)`` turns a batch's predictions into
per-sample records (numpy, keyed by name, with the sample ``index``): small numbers per
sample, never per-point arrays (what a task writes of its predictions it asks for through
``predictions_to_keep`` or ``cases_to_predict``); the predictions come
from the one prediction path (:func:`flarepp.inference.execution.predict_tokens`) through
the task's :meth:`Task.surrogate`, in physical units for a task with output normalisers
(:meth:`Task.normalizers`), as the model gives them otherwise. The trainer gathers the
records of every rank and ``summarize(split, records)`` returns the metrics
(``metrics[task.headline]`` is the number that is reported, beside those named in
``reported``).
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import numpy as np
import torch
from torch import nn

from flarepp.models.surrogate import Surrogate, UnitMaps
from flarepp.storage.checkpoint import unit_maps

TokenSum = Callable[[torch.Tensor], torch.Tensor]
Batch = dict[str, torch.Tensor]
Item = dict[str, np.ndarray]


class Task(abc.ABC):
    """Base class; subclasses register in :data:`flarepp.tasks.TASKS`.

    ``reported`` names metrics of :meth:`summarize` reported beside the headline
    (``metrics.json`` keys ``<split>_<name>``, of the run's ``eval_weights`` weights).
    ``token_keys`` names the batch entries with a token axis (dim 1) that context
    parallelism may split across ranks and that streaming may chunk; a task with none
    cannot be token-sharded. ``eval_splits`` are evaluated at the end of a run, the first
    of them also every ``eval_every`` epochs. ``carves_validation``: the task takes
    ``config.val_fraction`` > 0, holding that share of its training data out as a ``val``
    split (then one of its instance's ``eval_splits``); other tasks refuse it.
    """

    name: ClassVar[str] = ""
    headline: ClassVar[str] = "rel_l2"
    reported: ClassVar[tuple[str, ...]] = ()
    lower_is_better: ClassVar[bool] = True
    token_keys: ClassVar[tuple[str, ...]] = ()
    eval_splits: ClassVar[tuple[str, ...]] = ("test", "train")
    carves_validation: ClassVar[bool] = False

    def __init__(self, config: Any, data_root: str | Path) -> None:
        self.config = config
        self.data_root = Path(data_root)

    # -- data ----------------------------------------------------------------------------
    @abc.abstractmethod
    def num_samples(self, split: str) -> int:
        """Samples in ``split`` ("train", "test", ...)."""

    @abc.abstractmethod
    def get(self, split: str, index: int, seed: int, *, training: bool = False) -> Item:
        """Sample ``index`` of ``split`` as numpy arrays, with its ``index``.

        ``training`` asks for what the loss needs (e.g. normalised targets), otherwise
        what the metric needs; ``seed`` drives any random sub-sampling (the same seed
        gives the same item, on any worker)."""

    def item_size(self, item: Item) -> int:
        """Tokens of one item (what padding to a common length costs); 1 if not tokens."""
        return 1

    def sample_sizes(self, split: str) -> np.ndarray | None:
        """Tokens of every sample of ``split`` as evaluation reads them, known without
        reading the samples (evaluation batches are cut by them); None when not known."""
        return None

    @abc.abstractmethod
    def collate(self, items: list[Item]) -> Batch:
        """Stack items into one batch, padding to the longest item (never the dataset's)."""

    # -- model ---------------------------------------------------------------------------
    @abc.abstractmethod
    def build_model(self) -> nn.Module:
        """The model for this data (input and output widths from the data), on the CPU."""

    def model_inputs(self, batch: Batch) -> Batch:
        """The model's inputs in ``batch``, as :func:`~flarepp.inference.execution.
        predict_tokens` feeds them: ``x [B, N, I]``, ``mask [B, N]`` and ``conditioning``
        tokens ``[B, K, C]`` where the batch has them, in the model's units (the task's
        data pipeline normalised them). A task with ``token_keys`` is predicted through it."""
        return {key: batch[key] for key in ("x", "mask", "conditioning") if key in batch}

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The model on a batch: ``model(x, mask=mask, conditioning=...)`` of
        :meth:`model_inputs`; a task whose model takes other inputs overrides it."""
        inputs = self.model_inputs(batch)
        return model(inputs.pop("x"), **inputs)

    def surrogate(self, model: nn.Module) -> Surrogate:
        """``model`` in physical units: a :class:`~flarepp.models.surrogate.Surrogate`
        with this task's maps (:meth:`normalizers`; the identity where it has none)."""
        return Surrogate(model, **unit_maps(self.normalizers()))

    # -- loss and metrics ----------------------------------------------------------------
    @abc.abstractmethod
    def loss(self, pred: torch.Tensor, batch: Batch, token_sum: TokenSum) -> torch.Tensor:
        """The sum over the batch of the loss terms (a scalar; see the module docstring)."""

    @abc.abstractmethod
    def loss_count(self, batch: Batch, token_sum: TokenSum) -> torch.Tensor:
        """The normaliser of :meth:`loss` for this batch (a scalar, no gradient)."""

    @abc.abstractmethod
    def eval_records(self, pred: torch.Tensor, batch: Batch) -> dict[str, np.ndarray]:
        """Per-sample numpy records of a batch's predictions, with the sample ``index``."""

    @abc.abstractmethod
    def summarize(self, split: str, records: dict[str, np.ndarray]) -> dict[str, Any]:
        """Metrics of a split from all its records; ``[headline]`` is the reported one."""

    # -- state and outputs ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What must travel with a checkpoint to use the model later (normalisers...)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def normalizers(self) -> dict[str, Any]:
        """The maps between physical units and the model's (:class:`flarepp.data.
        Normalizer`), named as stored: ``x`` inputs, ``y`` outputs, ``c`` per-sample
        conditions; ``{}`` for a task whose model sees its data as it is. They become the
        maps of :meth:`surrogate`; :meth:`state_dict` stores them."""
        return {}

    def describe_data(self) -> dict[str, Any]:
        """Facts about the data stored in checkpoints (field names, units, the input
        layout ``inputs``: ``{"coordinates": G, "names": [...]}``...)."""
        return {}

    def baseline_metrics(self) -> dict[str, float]:
        """The metric of a predictor that learns nothing, on the training samples, keyed as
        ``metrics.json`` keys it (``train_constant_<headline>``): a report marks a run whose
        own training metric is no better as one that did not fit its training data. None
        by default."""
        return {}

    def data_identity(self) -> dict[str, Any]:
        """Where the training data is and a fingerprint of its content
        (:func:`flarepp.storage.rundir.data_fingerprint`): ``--resume`` refuses other data
        and ``flarepp eval`` finds the run's data with it; ``{}`` if not applicable."""
        return {}

    @classmethod
    def check_config(cls, config: Any) -> None:
        """Raise a ``ValueError`` naming the option if ``config`` sets one of this task's
        options to a value it does not take, before any data is read; none by default."""

    def check_model(self, model_config: dict[str, Any]) -> None:
        """Raise a sentence if a model of ``model_config`` cannot take this task's data."""

    def eval_batch_size(self) -> int:
        """Samples per evaluation batch (a task whose samples are whole large meshes may
        want one at a time)."""
        return max(self.config.batch_size, 4)

    def predictions_to_keep(self, split: str) -> list[int]:
        """Samples of ``split`` whose predictions :meth:`write_outputs` writes, kept from the
        final evaluation's own pass (on disk, one sample at a time) and handed to it as
        ``predictions``; none by default. (:meth:`cases_to_predict` names samples chosen
        from the records, predicted again after the evaluation.)"""
        return []

    def cases_to_predict(self, split: str, records: dict[str, np.ndarray]) -> list[int]:
        """Samples of ``split`` whose full predictions :meth:`write_outputs` needs although
        the records keep only small per-sample numbers (e.g. the case a figure shows).

        The trainer predicts them again after the final evaluation, on every rank (so
        context parallelism works), and hands ``write_outputs`` the predictions (physical
        units, as :meth:`eval_records` gets them) as ``predictions={index: [N, O] numpy
        array}``; none by default."""
        return []

    def write_outputs(self, out_dir: Path, split: str, records: dict[str, np.ndarray], *,
                      predictions: dict[int, np.ndarray] | None = None) -> list[Path]:
        """Files written from the final evaluation of ``split`` (e.g. predictions);
        ``predictions`` (``{index: [N, O]}``, a mapping read one sample at a time) is passed
        only to a task that asks for some (:meth:`predictions_to_keep`,
        :meth:`cases_to_predict`)."""
        return []

    @classmethod
    def plot_run(cls, out_dir: Path, cases: int) -> list[Path]:
        """Figures of a finished run, from the files of its directory alone."""
        return []

    @classmethod
    def inference_cases(cls, config: Any, data_root: str | Path, split: str
                        ) -> Iterator[tuple[str, np.ndarray, np.ndarray, str]] | None:
        """The task's own cases for ``flarepp infer`` on ``split`` of the data at
        ``data_root``: ``(name, inputs [1, N, I], targets [1, N, O], source mesh file)`` in
        physical units, one at a time; None (the default): the run's dataset's samples."""
        return None


def units_on(units: UnitMaps, device: torch.device) -> UnitMaps:
    """``units`` on ``device``, moved there in place the first time it is asked for: a copy
    from host memory in every step would wait for the device's queued work."""
    return units if units.device == device else units.to(device)


def pad_stack(arrays: list[np.ndarray], length: int, fill: float | int = 0) -> np.ndarray:
    """``[n_i, ...]`` arrays -> ``[len(arrays), length, ...]``, padded at the end with ``fill``."""
    first = arrays[0]
    out = np.full((len(arrays), length, *first.shape[1:]), fill, dtype=first.dtype)
    for i, a in enumerate(arrays):
        out[i, : a.shape[0]] = a
    return out


def collate_point_clouds(items: list[Item], lengths: list[int], *,
                         masked: bool) -> dict[str, torch.Tensor]:
    """Items with per-point ``x [n_i, I]`` and ``y [n_i, O]`` and an ``index`` -> one batch,
    padded to the batch's own largest ``n_i`` (never the dataset's); ``mask [B, N]`` (True at
    real points) when ``masked`` (variable sizes)."""
    n = max(lengths)
    batch = {"x": torch.from_numpy(pad_stack([it["x"] for it in items], n)),
             "y": torch.from_numpy(pad_stack([it["y"] for it in items], n)),
             "index": torch.tensor([int(it["index"]) for it in items])}
    if masked:
        batch["mask"] = torch.from_numpy(np.arange(n)[None, :] < np.asarray(lengths)[:, None])
    return batch


def gather_records(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate per-batch (or per-rank) records and order them by sample ``index``."""
    parts = [p for p in parts if p and len(p["index"])]
    if not parts:
        return {}
    out = {key: np.concatenate([p[key] for p in parts], axis=0) for key in parts[0]}
    order = np.argsort(out["index"], kind="stable")
    return {k: v[order] for k, v in out.items()}
