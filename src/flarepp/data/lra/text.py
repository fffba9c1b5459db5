"""LRA's byte-level Text (IMDB sentiment) and Retrieval (AAN citation matching) tasks.

Tokenisation (LRA's ``tokenizer = "char"``, TFDS's ``ByteTextEncoder``): a text's UTF-8
bytes ``b`` become ids ``b + 1``; 0 is padding; vocabulary 257. Sequences are cut to
``max_length`` = 4000 bytes (LRA, Tay et al. 2021, Sec. 3: Text 4K, Retrieval 4K per
document).

* Text, the IMDB release ``aclImdb/{train,test}/{pos,neg}/*.txt`` (Maas et al. 2011): one
  review per file, label 1 for ``pos`` and 0 for ``neg``; the ``unsup`` reviews are not
  used. LRA has no validation set for IMDB and evaluates on the test set, so ``val`` and
  ``test`` are both the test reviews. Files are read as stored, in sorted name order.
* Retrieval, the LRA release ``tsv_data/new_aan_pairs.{train,eval,test}.tsv``: no header,
  tab-separated, no quoting, five columns ``label  id1  id2  text1  text2`` with the label
  written as a number (``0``/``1``, or ``0.0``/``1.0``); a pair is positive when paper 1
  cites paper 2. LRA reads the first 10,000 bytes of each text and keeps ``max_length``.
  ``eval`` is the ``val`` split.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flarepp.data.base import DataError
from flarepp.data.lra.base import LRADataset, LRASplit, TokenSequences, missing

BYTE_VOCAB = 257
AAN_FILES = {"train": "new_aan_pairs.train.tsv", "val": "new_aan_pairs.eval.tsv",
             "test": "new_aan_pairs.test.tsv"}
AAN_READ_BYTES = 10_000  # LRA's matching pipeline encodes s[:10000]


def byte_tokens(texts: list[bytes], max_length: int) -> TokenSequences:
    """Texts as byte ids ``b + 1`` (0 = padding), each cut to ``max_length`` bytes."""
    cut = [t[:max_length] for t in texts]
    if any(len(t) == 0 for t in cut):
        raise DataError("an empty text: every document needs at least one byte")
    flat = np.frombuffer(b"".join(cut), np.uint8).astype(np.uint16) + 1
    lengths = np.array([len(t) for t in cut], dtype=np.int64)
    return TokenSequences(flat, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def read_imdb_split(root: Path, split: str) -> tuple[list[bytes], np.ndarray]:
    texts, labels = [], []
    for label, polarity in ((0, "neg"), (1, "pos")):
        folder = root / split / polarity
        if not folder.is_dir():
            raise missing(folder, f"IMDB {split}/{polarity} folder", "Download "
                          "aclImdb_v1.tar.gz from https://ai.stanford.edu/~amaas/data/"
                          "sentiment/ and unpack it; pass the aclImdb folder")
        files = sorted(folder.glob("*.txt"))
        if not files:
            raise DataError(f"{folder}: no review files (*.txt)")
        texts.extend(f.read_bytes() for f in files)
        labels.extend([label] * len(files))
    return texts, np.array(labels, dtype=np.int64)


def load_imdb(root: str | Path, *, max_length: int = 4000) -> LRADataset:
    """LRA Text from the IMDB release under ``root`` (``aclImdb`` or its parent)."""
    root = Path(root)
    if not (root / "train").is_dir() and (root / "aclImdb").is_dir():
        root = root / "aclImdb"
    train = read_imdb_split(root, "train")
    test = read_imdb_split(root, "test")
    test_split = LRASplit((byte_tokens(test[0], max_length),), test[1])
    splits = {"train": LRASplit((byte_tokens(train[0], max_length),), train[1]),
              "val": test_split, "test": test_split}
    return LRADataset("text", splits, vocab_size=BYTE_VOCAB, num_classes=2,
                      max_length=max_length, source=str(root)).validate()


def read_aan_tsv(path: Path) -> tuple[list[bytes], list[bytes], np.ndarray]:
    """Texts 1 and 2 and labels of one ``new_aan_pairs`` TSV (module docstring)."""
    if not path.is_file():
        raise missing(path, "AAN pairs file", "Unpack lra_release.gz and pass its "
                      "lra_release/tsv_data folder")
    first, second, labels = [], [], []
    for number, line in enumerate(path.read_bytes().split(b"\n"), 1):
        line = line.rstrip(b"\r")
        if not line:
            continue
        fields = line.split(b"\t")
        if len(fields) != 5:
            raise DataError(f"{path}: line {number} has {len(fields)} tab-separated fields; "
                            "expected 5: label, id1, id2, text1, text2")
        try:
            label = float(fields[0])
        except ValueError:
            raise DataError(f"{path}: line {number}: label {fields[0]!r} is not a number") \
                from None
        if label not in (0.0, 1.0):
            raise DataError(f"{path}: line {number}: label {label} is neither 0 nor 1")
        labels.append(int(label))
        first.append(fields[3][:AAN_READ_BYTES])
        second.append(fields[4][:AAN_READ_BYTES])
    if not labels:
        raise DataError(f"{path}: no pairs")
    return first, second, np.array(labels, dtype=np.int64)


def load_aan(root: str | Path, *, max_length: int = 4000) -> LRADataset:
    """LRA Retrieval from ``new_aan_pairs.{train,eval,test}.tsv`` under ``root``."""
    root = Path(root)
    if not (root / AAN_FILES["train"]).exists() and (root / "tsv_data").is_dir():
        root = root / "tsv_data"
    splits = {}
    for split, name in AAN_FILES.items():
        first, second, labels = read_aan_tsv(root / name)
        splits[split] = LRASplit((byte_tokens(first, max_length),
                                  byte_tokens(second, max_length)), labels)
    return LRADataset("retrieval", splits, vocab_size=BYTE_VOCAB, num_classes=2,
                      max_length=max_length, source=str(root)).validate()


__all__ = ["AAN_FILES", "BYTE_VOCAB", "byte_tokens", "load_aan", "load_imdb", "read_aan_tsv",
           "read_imdb_split"]
