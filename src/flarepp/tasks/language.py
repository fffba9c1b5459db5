"""Byte-level next-token prediction on a directory of text files (the ``lm`` task).

Shape letters: B batch, T window length (``context``), V vocabulary (256 byte values).

The talk ("FLARE + high order attention ideas", Aim 2, "Next-token prediction with
FLARE") proposes causal FLARE as a decoder; this task trains the decoder-only
:class:`~flarepp.models.causal_lm.CausalLM` on text that exists on every machine without a
download: by default the Python standard library's own source files
(``sysconfig.get_paths()["stdlib"]``).

Data (dataset ``text-files``, :func:`load_text_files`): every file under ``root`` matching
``pattern`` (default ``*.py``, searched recursively), directories named in ``exclude``
skipped (default ``site-packages``, ``__pycache__``), in sorted order of their relative
POSIX paths. A file is held out for the ``test`` split when the SHA-256 of its relative
path, read as a fraction in [0, 1), is below ``test_fraction``: the split is by file, and a
file's side does not depend on which other files exist. Each split is its files' bytes
concatenated in that order (a window may span the end of one file and the start of the
next, as in any packed language-model corpus).

Items: window ``i`` of a split is ``context + 1`` consecutive bytes starting at an offset
drawn uniformly by ``numpy.random.default_rng(seed)`` (the trainer gives every training
item a fresh seed per epoch, evaluation items the seed ``i``: fixed evaluation windows).
``n_train`` windows make an epoch; ``n_test`` windows are evaluated per split.

Loss (the loss convention of :mod:`flarepp.tasks.base`): the summed next-byte
cross-entropy in nats over the window's ``context`` predictions, with the number of
predicted bytes as the count. Metric: bits per byte, ``sum of -log2 p(next byte) /
predicted bytes`` over the split's evaluation windows (lower is better).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from flarepp.data import DataError
from flarepp.data.fingerprint import data_fingerprint
from flarepp.data.text import (ByteSplit, TextFiles, default_text_root,  # noqa: F401
                               held_out_fraction, load_text_files)
from flarepp.io import atomic_write
from flarepp.models import build_model
from flarepp.plots import Panel, Series, plot_curves, weight_series
from flarepp.tasks.base import Batch, Item, Task, TokenSum
from flarepp.storage.rundir import RunDir
from flarepp.tasks.registry import TASKS

VOCAB_SIZE = 256
LOG2 = math.log(2.0)


def window(split: ByteSplit, context: int, seed: int) -> np.ndarray:
    """``context + 1`` consecutive bytes at an offset drawn by ``default_rng(seed)``, int64."""
    start = int(np.random.default_rng(seed).integers(0, len(split) - context))
    return split.data[start:start + context + 1].astype(np.int64)


@TASKS.register("lm", doc="byte-level next-token prediction on text files: bits per byte")
class LanguageModelTask(Task):
    """A causal model predicts every next byte of a window; bits per byte held out by file."""

    name = "lm"
    headline = "bits_per_byte"
    lower_is_better = True
    token_keys = ()            # causal mixers are not token-shardable
    eval_splits = ("test", "train")

    def __init__(self, config: Any, data_root: str | Path, *,
                 corpus: TextFiles | None = None) -> None:
        super().__init__(config, data_root)
        self.corpus = corpus or load_text_files(self.data_root,
                                                **config.dataset_options).validate()

    @classmethod
    def check_config(cls, config: Any) -> None:
        """The lm task's loss is fixed (next-byte cross-entropy); its model a token decoder."""
        if config.dataset != "text-files":
            raise ValueError(f"task lm reads dataset 'text-files', got {config.dataset!r}")
        if config.loss != "reference":
            raise ValueError(f"task lm trains on next-byte cross-entropy; leave loss at "
                             f"'reference', got {config.loss!r}")
        arch = config.model.get("arch")
        if arch != "causal-lm":
            raise ValueError(f"task lm needs model.arch='causal-lm' (a decoder), got {arch!r}")

    # -- data ----------------------------------------------------------------------------
    def num_samples(self, split: str) -> int:
        self.corpus.split(split)
        return self.corpus.n_train if split == "train" else self.corpus.n_test

    def get(self, split: str, index: int, seed: int, *, training: bool = False) -> Item:
        ids = window(self.corpus.split(split), self.corpus.context, seed)
        return {"index": np.int64(index), "ids": ids}

    def collate(self, items: list[Item]) -> Batch:
        return {"ids": torch.from_numpy(np.stack([it["ids"] for it in items])),
                "index": torch.tensor([int(it["index"]) for it in items])}

    # -- model ---------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        return build_model(vocab_size=VOCAB_SIZE, **self.config.model_kwargs())

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Logits ``[B, T, V]`` of the bytes after each of the first T bytes."""
        return model(batch["ids"][:, :-1])

    # -- loss and metrics ----------------------------------------------------------------
    def loss(self, pred: torch.Tensor, batch: Batch, token_sum: TokenSum) -> torch.Tensor:
        """``sum_b sum_t -log p(ids[b, t + 1] | ids[b, <= t])`` in nats."""
        logits = pred.to(torch.promote_types(pred.dtype, torch.float32))
        return token_sum(F.cross_entropy(logits.flatten(0, 1),
                                         batch["ids"][:, 1:].flatten(), reduction="sum"))

    def loss_count(self, batch: Batch, token_sum: TokenSum) -> torch.Tensor:
        ids = batch["ids"]
        return token_sum(torch.full((), float(ids.shape[0] * (ids.shape[1] - 1)),
                                    device=ids.device))

    def eval_records(self, pred: torch.Tensor, batch: Batch) -> dict[str, np.ndarray]:
        targets = batch["ids"][:, 1:]
        nats = F.cross_entropy(pred.detach().double().transpose(1, 2), targets,
                               reduction="none")
        return {"index": batch["index"].cpu().numpy(),
                "nats": nats.sum(1).cpu().numpy(),
                "bytes": np.full(len(targets), targets.shape[1], np.int64)}

    def summarize(self, split: str, records: dict[str, np.ndarray]) -> dict[str, Any]:
        total = float(records["nats"].sum())
        count = int(records["bytes"].sum())
        return {"bits_per_byte": total / count / LOG2, "nats_per_byte": total / count,
                "windows": len(records["index"])}

    # -- state and outputs ---------------------------------------------------------------
    def describe_data(self) -> dict[str, Any]:
        c = self.corpus
        return {"dataset": "text-files", "root": str(c.root), "pattern": c.pattern,
                "context": c.context,
                "files": {"train": len(c.train.files), "test": len(c.test.files)},
                "bytes": {"train": len(c.train), "test": len(c.test)}}

    def data_identity(self) -> dict[str, Any]:
        return data_fingerprint({"train": self.corpus.train.data}, self.data_root)

    def check_model(self, model_config: dict[str, Any]) -> None:
        if model_config.get("arch") != "causal-lm" or model_config.get("in_dim") is not None \
                or model_config.get("vocab_size") != VOCAB_SIZE:
            raise DataError(f"task lm needs a causal-lm over {VOCAB_SIZE} byte values, the "
                            f"checkpoint's model is {model_config.get('arch')!r} with "
                            f"vocab_size={model_config.get('vocab_size')}, "
                            f"in_dim={model_config.get('in_dim')}")

    def write_outputs(self, out_dir: Path, split: str, records: dict[str, np.ndarray], *,
                      predictions: dict[int, np.ndarray] | None = None) -> list[Path]:
        path = RunDir(out_dir).file(RunDir.BITS_PER_BYTE, split=split)
        text = json.dumps(self.summarize(split, records), indent=2)
        atomic_write(path, lambda tmp: Path(tmp).write_text(text))
        return [path]

    @classmethod
    def plot_run(cls, out_dir: Path, cases: int) -> list[Path]:
        return [plot_curves(out_dir, [Panel("bits per byte", (
            Series("train_loss", "training (live weights)", 1.0 / LOG2),
            *weight_series("test_bits_per_byte", "held-out files")), log=False)])]


__all__ = ["ByteSplit", "LanguageModelTask", "TextFiles", "default_text_root",
           "held_out_fraction", "load_text_files", "window"]
