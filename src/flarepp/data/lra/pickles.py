"""The pre-tokenised LRA pickles the FLARE study reads (its ``lra/dataset/lra.py``).

Files ``lra-<name>.{train,dev,test}.pickle`` in one folder, ``<name>`` one of ``listops``,
``text``, ``retrieval``, ``image``, ``pathfinder32-curv_contour_length_14``: each a pickled
list of dicts ``{"input_ids_0": ids, "label": int}`` (Retrieval adds ``"input_ids_1"``)
with every ``ids`` array of one fixed length per file. They were made by the
Nystromformer authors' LRA scripts from LRA's own pipelines (ListOps ids from LRA's token
encoder with 0 = padding, padded to 2048; Text and Retrieval byte ids + 1 with 0 =
padding, padded to 4096; Image and Pathfinder raw pixels 0..255, 1024 per image).

Read here as variable-length sequences: for the text-like tasks trailing zeros are padding
and are dropped (a real token is never 0 there); pixels are kept whole. The vocabulary is
the largest id + 1 and the classes the largest label + 1, as the reference computes them;
``dev`` becomes the ``val`` split and ``test`` is read when present.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flarepp.data.base import DataError
from flarepp.data.lra.base import LRADataset, LRASplit, TokenSequences, load_data_pickle, missing

PICKLE_NAMES = {"listops": "listops", "text": "text", "retrieval": "retrieval",
                "image": "image", "pathfinder32": "pathfinder32-curv_contour_length_14",
                "pathfinder128": "pathfinder128-curv_contour_length_14"}
PADDED_TASKS = ("listops", "text", "retrieval")  # 0 is padding, never a token
SPLIT_FILES = {"train": "train", "val": "dev", "test": "test"}


def pickle_path(root: Path, task: str, split: str) -> Path:
    return root / f"lra-{PICKLE_NAMES[task]}.{SPLIT_FILES[split]}.pickle"


def read_pickle_split(path: Path, task: str) -> LRASplit:
    """One pickle as a split: the documents (two for retrieval) and the labels."""
    samples = load_data_pickle(path)
    keys = ("input_ids_0", "input_ids_1") if task == "retrieval" else ("input_ids_0",)
    if not isinstance(samples, list) or not samples:
        raise DataError(f"{path}: expected a non-empty list of dicts, "
                        f"got {type(samples).__name__}")
    bad = next((i for i, s in enumerate(samples)
                if not isinstance(s, dict) or any(k not in s for k in (*keys, "label"))), None)
    if bad is not None:
        raise DataError(f"{path}: sample {bad} lacks one of the keys {[*keys, 'label']}")
    documents = []
    for key in keys:
        ids_SN = np.stack([np.asarray(s[key]).reshape(-1) for s in samples]) \
            if len({np.asarray(s[key]).size for s in samples}) == 1 else None
        if ids_SN is None:
            raise DataError(f"{path}: {key} arrays differ in length; the reference pads "
                            "every sample of a file to one length")
        if task in PADDED_TASKS:
            real_SN = ids_SN != 0
            lengths = np.where(real_SN.any(1), ids_SN.shape[1] - real_SN[:, ::-1].argmax(1), 0)
            documents.append(TokenSequences.from_padded(ids_SN, lengths))
        else:
            documents.append(TokenSequences.from_padded(ids_SN))
    labels = np.array([int(s["label"]) for s in samples], dtype=np.int64)
    return LRASplit(tuple(documents), labels)


def load_reference_pickles(root: str | Path, *, task: str) -> LRADataset:
    """The ``lra-<task>`` pickles under ``root`` (module docstring)."""
    if task not in PICKLE_NAMES:
        raise ValueError(f"unknown LRA pickle task {task!r}; known: {', '.join(PICKLE_NAMES)}")
    root = Path(root)
    splits = {}
    for split, stem in SPLIT_FILES.items():
        path = pickle_path(root, task, split)
        if not path.is_file():
            if split == "test":
                continue
            raise missing(path, f"LRA {task} {stem} pickle", "The FLARE study "
                          "reads these from the 'long-range-arena-processed' Kaggle archive "
                          "(made by the Nystromformer LRA scripts); put them in one folder")
        splits[split] = read_pickle_split(path, task)
    documents = [d for split in splits.values() for d in split.documents]
    longest = max(int(d.lengths.max()) for d in documents)
    classes = max(2, int(max(split.labels.max() for split in splits.values())) + 1)
    return LRADataset(task, splits, vocab_size=max(d.max_id for d in documents) + 1,
                      num_classes=classes, max_length=longest, source=str(root)).validate()


__all__ = ["PICKLE_NAMES", "load_reference_pickles", "pickle_path", "read_pickle_split"]
