"""Sequence classification on Long Range Arena (the ``sequence`` task; paper Section 4.3, D.5).

Shape letters: B batch, N tokens of the longest sequence in a batch, K classes.

Data: ``config.dataset`` names a Long Range Arena reader (:data:`flarepp.data.lra.
LRA_DATASETS`: ``listops``, ``pathfinder``, ``cifar10``, ``fashion-mnist``, ``imdb``,
``aan``, ``lra-pickle``), registered here in :data:`flarepp.data.DATASETS` too so that a
run config is checked like any other: ``config.dataset_options`` are the reader's keyword
options plus ``split_limits`` (at most that many samples of a split, a seeded subset in
file order: :meth:`~flarepp.data.lra.LRADataset.limited`). Splits ``train``, ``val``,
``test``; an item is one sample's token ids (two documents for Retrieval) and its label.
A batch is padded to its own longest sequence with a mask (omitted when every token of the
batch is real, as for images); one padded batch per step (``item_size`` 1: no
micro-batches, see :meth:`SequenceTask.item_size`).

Model: the ``sequence-classifier`` (:mod:`flarepp.models.sequence`) built from
``config.model`` with the vocabulary, classes, maximum length and number of documents of
the data; a two-document task runs the two-tower form.

Loss (the convention of :mod:`flarepp.tasks.base`): ``sum_b -log softmax(z_b)[y_b]``, the
cross-entropy summed over the batch, with the number of samples as the count: the mean
cross-entropy of the reference (``lra/utils.py``'s ``compute_cls_loss``; binary tasks here
have two logits and a softmax instead of one logit and a sigmoid, the same model family).
Metric: accuracy, the share of samples whose arg-max logit is the label (higher is better);
the split's chance level (1/K) and majority-class share are reported beside it.

Evaluation splits: ``val`` is evaluated after every ``eval_every`` epochs (the curve), and
``val`` and ``test`` at the end (``test_accuracy`` is the reported number, as Table 12's).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from flarepp.data import DATASETS, DataError  # noqa: F401
from flarepp.data.fingerprint import data_fingerprint
from flarepp.data.lra import LRA_DATASETS, LRADataset, collate
from flarepp.io import atomic_write_json, atomic_write_text
from flarepp.models import build_model
from flarepp.plots import Panel, Series, plot_curves, weight_series
from flarepp.tasks.base import Batch, Item, Task, TokenSum
from flarepp.storage.rundir import RunDir
from flarepp.tasks.registry import TASKS

MODEL_ARCH = "sequence-classifier"


def load_sequence_data(config: Any, data_root: str | Path | None) -> LRADataset:
    """The LRA data a run config names: ``config.dataset`` read from ``data_root`` (the
    reader's default folder when ``None``, e.g. Debian's Fashion-MNIST) with
    ``config.dataset_options``."""
    if config.dataset not in LRA_DATASETS:
        raise ValueError(f"task sequence reads a Long Range Arena dataset, got "
                         f"{config.dataset!r}; known: {', '.join(LRA_DATASETS.names())}")
    return DATASETS.get(config.dataset)(data_root, **config.dataset_options)


# -- the task --------------------------------------------------------------------------------

@TASKS.register("sequence", doc="Long Range Arena sequence classification: accuracy")
class SequenceTask(Task):
    """Token sequences -> one class each (module docstring); ``data`` a preloaded dataset."""

    name = "sequence"
    headline = "accuracy"
    lower_is_better = False
    token_keys = ()   # pooling and the two towers are not token-sharded
    eval_splits = ("val", "test")

    def __init__(self, config: Any, data_root: str | Path, *,
                 data: LRADataset | None = None) -> None:
        super().__init__(config, data_root)
        self.data = data if data is not None else load_sequence_data(config, data_root)
        missing = sorted({"train", *self.eval_splits} - set(self.data.splits))
        if missing:
            raise DataError(f"{self.data.source}: task sequence needs the splits train, val "
                            f"and test; missing {missing}")

    @classmethod
    def check_config(cls, config: Any) -> None:
        """The task's fixed parts: an LRA dataset, the sequence classifier, cross-entropy."""
        if config.dataset not in LRA_DATASETS:
            raise ValueError(f"task sequence reads a Long Range Arena dataset; "
                             f"dataset={config.dataset!r} is not one of "
                             f"{', '.join(LRA_DATASETS.names())}")
        arch = config.model.get("arch")
        if arch != MODEL_ARCH:
            raise ValueError(f"task sequence needs model.arch={MODEL_ARCH!r}, got {arch!r}")
        for key in ("vocab_size", "num_classes", "max_length", "two_tower"):
            if key in config.model:
                raise ValueError(f"model.{key} comes from the data in task sequence; remove "
                                 "it from the config")
        if config.loss != "reference":
            raise ValueError(f"task sequence trains on the cross-entropy; leave loss at "
                             f"'reference', got {config.loss!r}")

    # -- data ----------------------------------------------------------------------------
    def num_samples(self, split: str) -> int:
        return len(self._split(split))

    def _split(self, split: str):
        try:
            return self.data.splits[split]
        except KeyError:
            raise ValueError(f"unknown split {split!r}; {self.data.source} has "
                             f"{', '.join(self.data.splits)}") from None

    def get(self, split: str, index: int, seed: int, *, training: bool = False) -> Item:
        item = self._split(split).item(index)
        item["index"] = np.int64(index)
        return item

    def item_size(self, item: Item) -> int:
        """1: a batch is one padded micro-batch, whatever its lengths.

        Padding a ListOps batch to its longest sequence costs at most the ratio of the
        longest to the mean length (about 2 on LRA's 500-2000 tokens), images and
        Pathfinder have one length, and the reference pads every sequence to the task's
        fixed length; splitting a step of 32 sequences into length groups would trade that
        padding for several smaller matrix products per step.
        """
        return 1

    def collate(self, items: list[Item]) -> Batch:
        batch = collate(items)
        for key in ("mask", "mask_1"):
            if key in batch and bool(batch[key].all()):
                del batch[key]   # every token real (images): the mixers' unmasked path
        batch["index"] = torch.tensor([int(it["index"]) for it in items])
        return batch

    # -- model ---------------------------------------------------------------------------
    def model_sizes(self) -> dict[str, Any]:
        """The classifier settings that come from the data."""
        d = self.data
        return {"vocab_size": d.vocab_size, "num_classes": d.num_classes,
                "max_length": d.max_length, "two_tower": d.two_documents}

    def build_model(self) -> nn.Module:
        return build_model(**self.config.model_kwargs(), **self.model_sizes())

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Logits ``[B, K]``; a two-document batch goes through both towers."""
        return model(batch["tokens"], mask=batch.get("mask"), tokens_1=batch.get("tokens_1"),
                     mask_1=batch.get("mask_1"))

    # -- loss and metrics ----------------------------------------------------------------
    def loss(self, pred: torch.Tensor, batch: Batch, token_sum: TokenSum) -> torch.Tensor:
        """``sum_b -log softmax(pred_b)[label_b]`` in nats (at least float32)."""
        logits = pred.to(torch.promote_types(pred.dtype, torch.float32))
        return F.cross_entropy(logits, batch["label"], reduction="sum")

    def loss_count(self, batch: Batch, token_sum: TokenSum) -> torch.Tensor:
        labels = batch["label"]
        return torch.full((), float(labels.shape[0]), device=labels.device)

    def eval_records(self, pred: torch.Tensor, batch: Batch) -> dict[str, np.ndarray]:
        logits = pred.detach().double()
        nats = F.cross_entropy(logits, batch["label"], reduction="none")
        return {"index": batch["index"].cpu().numpy(),
                "label": batch["label"].cpu().numpy(),
                "predicted": logits.argmax(-1).cpu().numpy(),
                "nats": nats.cpu().numpy()}

    def summarize(self, split: str, records: dict[str, np.ndarray]) -> dict[str, Any]:
        """Accuracy, mean cross-entropy, and the chance levels of this split's labels."""
        K = self.data.num_classes
        if not records:
            return {"accuracy": float("nan"), "cross_entropy": float("nan"), "samples": 0,
                    "chance": 1.0 / K, "majority": float("nan")}
        labels = records["label"]
        shares = np.bincount(labels, minlength=K) / len(labels)
        return {"accuracy": float(np.mean(records["predicted"] == labels)),
                "cross_entropy": float(np.mean(records["nats"])),
                "samples": int(len(labels)), "chance": 1.0 / K,
                "majority": float(shares.max())}

    # -- state and outputs ---------------------------------------------------------------
    def describe_data(self) -> dict[str, Any]:
        d = self.data
        return {"dataset": self.config.dataset, "task": d.task, "source": d.source,
                **self.model_sizes(),
                "samples": {name: len(split) for name, split in d.splits.items()}}

    def data_identity(self) -> dict[str, Any]:
        train = self.data.splits["train"]
        arrays = {"labels": train.labels}
        for k, document in enumerate(train.documents):
            arrays[f"tokens_{k}"] = document.tokens
            arrays[f"offsets_{k}"] = document.offsets
        return data_fingerprint(arrays, self.data_root)

    def check_model(self, model_config: dict[str, Any]) -> None:
        if model_config.get("arch") != MODEL_ARCH:
            raise DataError(f"task sequence needs a {MODEL_ARCH}, the checkpoint's model is "
                            f"{model_config.get('arch')!r}")
        for key, have in self.model_sizes().items():
            stored = model_config.get(key)
            # a longer position table takes shorter data; everything else must match
            fits = stored >= have if key == "max_length" else stored == have
            if not fits:
                raise DataError(f"{self.data.source}: the data have {key}={have}, the "
                                f"checkpoint's model was built for {key}={stored}")

    def write_outputs(self, out_dir: Path, split: str, records: dict[str, np.ndarray]
                      ) -> list[Path]:
        """``<split>_predictions.csv`` (index, label, predicted, nats) and
        ``<split>_accuracy.json`` (the metrics and the confusion matrix, rows = labels)."""
        K = self.data.num_classes
        confusion = np.zeros((K, K), np.int64)
        np.add.at(confusion, (records["label"], records["predicted"]), 1)
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(["index", "label", "predicted", "nats"])
        writer.writerows(zip(records["index"].tolist(), records["label"].tolist(),
                             records["predicted"].tolist(), records["nats"].tolist()))
        table = RunDir(out_dir).file(RunDir.PREDICTION_TABLE, split=split)
        atomic_write_text(table, text.getvalue())
        summary = RunDir(out_dir).file(RunDir.ACCURACY, split=split)
        atomic_write_json(summary, {**self.summarize(split, records), "split": split,
                                    "confusion": confusion.tolist()})
        return [table, summary]

    @classmethod
    def plot_run(cls, out_dir: Path, cases: int) -> list[Path]:
        references: tuple[tuple[float, str, str], ...] = ()
        summaries = sorted(Path(out_dir).glob(RunDir.ACCURACY.format(split="*")))
        if summaries:   # chance levels of the run's data
            chance = json.loads(summaries[0].read_text())
            references = ((100 * chance["chance"], "chance (1/K)", "--"),
                          (100 * chance["majority"], "majority class", ":"))
        return [plot_curves(out_dir, [
            Panel("training cross-entropy (nats)", (Series("train_loss", "training"),),
                  log=False),
            Panel("accuracy (%)", (*weight_series("val_accuracy", "validation", 100.0),
                                   Series("test_accuracy", "test", 100.0)),
                  log=False, references=references)])]


__all__ = ["SequenceTask", "load_sequence_data"]
