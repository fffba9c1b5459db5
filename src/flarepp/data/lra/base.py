"""In-memory Long Range Arena data: token sequences, labels, splits.

Shape letters: S sequences, T tokens in all sequences together, B batch, N tokens of the
longest sequence in a batch.

Every LRA reader and generator returns one :class:`LRADataset`: named splits of
variable-length token sequences (one per document; two for Retrieval) with integer labels,
the vocabulary size and the number of classes. Sequences are stored flat (all tokens in one
array plus ``S + 1`` offsets), so a split of 96,000 ListOps sequences or 25,000 byte-level
reviews costs its tokens and nothing more; batches are padded to their own longest sequence
(:meth:`LRASplit.batch`, :func:`collate`), with a mask.

Token id conventions follow the LRA release: for text-like tasks (ListOps, Text, Retrieval)
id 0 is padding and never a real token; for image-like tasks (Image, Pathfinder) the ids are
pixel intensities 0..255 and every sequence has the full image length.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flarepp.data.base import DataError

PAD_ID = 0


@dataclass(frozen=True)
class TokenSequences:
    """``S`` variable-length sequences: sequence ``i`` is ``tokens[offsets[i]:offsets[i+1]]``.

    ``tokens [T]`` holds non-negative ids in the smallest integer dtype that fits them,
    ``offsets [S + 1]`` int64 starts at 0 and never decreases.
    """

    tokens: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or self.offsets.ndim != 1 or len(self.offsets) < 1:
            raise DataError(f"TokenSequences needs tokens [T] and offsets [S + 1], got "
                            f"{list(self.tokens.shape)} and {list(self.offsets.shape)}")
        if self.offsets[0] != 0 or self.offsets[-1] != len(self.tokens) \
                or (np.diff(self.offsets) < 0).any():
            raise DataError("TokenSequences offsets must start at 0, end at len(tokens) = "
                            f"{len(self.tokens)} and never decrease")

    @classmethod
    def from_sequences(cls, sequences: Iterable[Sequence[int] | np.ndarray]) -> TokenSequences:
        arrays = [np.asarray(s).reshape(-1) for s in sequences]
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
        return cls(compact_ids(tokens), offsets)

    @classmethod
    def from_padded(cls, ids_SN: np.ndarray, lengths_S: np.ndarray | None = None
                    ) -> TokenSequences:
        """Rows of ``ids [S, N]``; ``lengths`` keeps the first ``lengths[i]`` of row ``i``
        (all ``N`` when ``None``: fixed-length sequences such as images)."""
        ids_SN = np.asarray(ids_SN)
        S, N = ids_SN.shape
        if lengths_S is None:
            offsets = np.arange(S + 1, dtype=np.int64) * N
            return cls(compact_ids(ids_SN.reshape(-1)), offsets)
        lengths_S = np.asarray(lengths_S, dtype=np.int64)
        keep_SN = np.arange(N)[None, :] < lengths_S[:, None]
        offsets = np.concatenate([[0], np.cumsum(lengths_S)]).astype(np.int64)
        return cls(compact_ids(ids_SN[keep_SN]), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.tokens[self.offsets[index]:self.offsets[index + 1]]

    def subset(self, indices: np.ndarray) -> TokenSequences:
        indices = np.asarray(indices, dtype=np.int64)
        lengths = self.lengths[indices]
        return TokenSequences(self.tokens[_gather_index(self.offsets[indices], lengths)],
                              np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))

    def pad(self, indices: np.ndarray, pad_id: int = PAD_ID) -> tuple[np.ndarray, np.ndarray]:
        """Sequences ``indices`` padded to their longest: ``ids [B, N]`` int64 and
        ``mask [B, N]`` bool (True = real token)."""
        indices = np.asarray(indices, dtype=np.int64)
        lengths_B = self.lengths[indices]
        n = int(lengths_B.max()) if len(indices) else 0
        ids_BN = np.full((len(indices), n), pad_id, dtype=np.int64)
        mask_BN = np.arange(n)[None, :] < lengths_B[:, None]
        ids_BN[mask_BN] = self.tokens[_gather_index(self.offsets[indices], lengths_B)]
        return ids_BN, mask_BN

    @property
    def max_id(self) -> int:
        return int(self.tokens.max()) if len(self.tokens) else -1


def _gather_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Flat indices of the tokens of sequences starting at ``starts`` (row-major)."""
    total = int(lengths.sum())
    row_start = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return row_start + np.arange(total, dtype=np.int64)


def compact_ids(ids: np.ndarray) -> np.ndarray:
    """Ids in the smallest unsigned dtype that holds them (uint8 for pixels and bytes)."""
    ids = np.asarray(ids)
    if ids.size and int(ids.min()) < 0:
        raise DataError(f"token ids must be non-negative, found {int(ids.min())}")
    top = int(ids.max()) if ids.size else 0
    for dtype in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(dtype).max:
            return ids.astype(dtype, copy=False)
    return ids.astype(np.int64, copy=False)


@dataclass(frozen=True)
class LRASplit:
    """One split: ``documents`` (one :class:`TokenSequences`, two for Retrieval) and
    ``labels [S]`` int64 in ``0..K-1``."""

    documents: tuple[TokenSequences, ...]
    labels: np.ndarray

    def __post_init__(self) -> None:
        if not 1 <= len(self.documents) <= 2:
            raise DataError(f"a split holds one or two documents per sample, "
                            f"got {len(self.documents)}")
        sizes = {len(d) for d in self.documents} | {len(self.labels)}
        if len(sizes) != 1:
            raise DataError(f"documents and labels disagree on the number of samples: "
                            f"{[len(d) for d in self.documents]} vs {len(self.labels)}")

    def __len__(self) -> int:
        return len(self.labels)

    def item(self, index: int) -> dict[str, np.ndarray]:
        """Sample ``index`` as numpy arrays: ``tokens`` (and ``tokens_1``), ``label``."""
        out = {_token_key(k): d[index] for k, d in enumerate(self.documents)}
        out["label"] = np.asarray(self.labels[index], dtype=np.int64)
        return out

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """Samples ``indices`` padded to their longest: ``tokens [B, N]`` int64, ``mask
        [B, N]`` bool (and ``tokens_1``, ``mask_1``), ``label [B]`` int64 (on the CPU)."""
        out: dict[str, torch.Tensor] = {}
        for k, document in enumerate(self.documents):
            ids, mask = document.pad(indices)
            out[_token_key(k)] = torch.from_numpy(ids)
            out[_mask_key(k)] = torch.from_numpy(mask)
        out["label"] = torch.from_numpy(np.asarray(self.labels[np.asarray(indices)],
                                                   dtype=np.int64))
        return out

    def subset(self, indices: np.ndarray) -> LRASplit:
        indices = np.asarray(indices, dtype=np.int64)
        return LRASplit(tuple(d.subset(indices) for d in self.documents),
                        np.asarray(self.labels[indices], dtype=np.int64))


def _token_key(document: int) -> str:
    return "tokens" if document == 0 else f"tokens_{document}"


def _mask_key(document: int) -> str:
    return "mask" if document == 0 else f"mask_{document}"


def collate(items: list[dict[str, np.ndarray]], pad_id: int = PAD_ID) -> dict[str, torch.Tensor]:
    """Items of :meth:`LRASplit.item` -> the batch :meth:`LRASplit.batch` would give."""
    out: dict[str, torch.Tensor] = {}
    for k in range(2):
        key = _token_key(k)
        if key not in items[0]:
            continue
        lengths = np.array([len(item[key]) for item in items])
        ids = np.full((len(items), int(lengths.max())), pad_id, dtype=np.int64)
        for row, item in enumerate(items):
            ids[row, :lengths[row]] = item[key]
        out[key] = torch.from_numpy(ids)
        out[_mask_key(k)] = torch.from_numpy(np.arange(ids.shape[1])[None] < lengths[:, None])
    out["label"] = torch.from_numpy(np.array([item["label"] for item in items], dtype=np.int64))
    return out


@dataclass(frozen=True)
class LRADataset:
    """An LRA task's data: ``splits`` by name ("train", "val", "test"), ``vocab_size`` V
    (ids ``0..V-1``), ``num_classes`` K, ``max_length`` (the longest document any split
    may hold, e.g. 2000 for ListOps), the ``task`` and a ``source`` for messages."""

    task: str
    splits: dict[str, LRASplit]
    vocab_size: int
    num_classes: int
    max_length: int
    source: str
    facts: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> LRADataset:
        """Check ids, labels and lengths against the declared sizes; returns ``self``."""
        for name, split in self.splits.items():
            where = f"{self.source} [{name}]"
            if len(split) == 0:
                raise DataError(f"{where}: the split is empty")
            labels = split.labels
            if labels.min() < 0 or labels.max() >= self.num_classes:
                raise DataError(f"{where}: labels must lie in 0..{self.num_classes - 1}, "
                                f"found {int(labels.min())}..{int(labels.max())}")
            for document in split.documents:
                if document.max_id >= self.vocab_size:
                    raise DataError(f"{where}: token id {document.max_id} outside the "
                                    f"vocabulary of {self.vocab_size}")
                if len(document) and document.lengths.min() < 1:
                    raise DataError(f"{where}: an empty sequence (every sequence needs "
                                    "at least one token)")
                if len(document) and document.lengths.max() > self.max_length:
                    raise DataError(f"{where}: a sequence of {int(document.lengths.max())} "
                                    f"tokens exceeds max_length={self.max_length}")
        return self

    @property
    def two_documents(self) -> bool:
        return len(next(iter(self.splits.values())).documents) == 2

    def limited(self, limits: dict[str, int], seed: int = 0) -> LRADataset:
        """At most ``limits[split]`` samples of each named split, a seeded random subset
        kept in file order (CPU-sized runs; release files are often sorted by label)."""
        unknown = sorted(set(limits) - set(self.splits))
        if unknown:
            raise ValueError(f"{self.source}: no split(s) {unknown}; splits: {sorted(self.splits)}")
        rng = np.random.default_rng(seed)
        splits = dict(self.splits)
        for name, limit in limits.items():
            if limit < len(splits[name]):
                keep = np.sort(rng.choice(len(splits[name]), size=limit, replace=False))
                splits[name] = splits[name].subset(keep)
        return dataclasses.replace(self, splits=splits)


def missing(path: Path, what: str, how: str) -> DataError:
    """The error for a missing input file: what it is, where it was looked for, how to get it."""
    return DataError(f"{what} not found at {str(path)!r}. {how} "
                     "(flarepp never downloads data; see docs/lra.md)")


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only, so that a data file cannot run
    code: the CIFAR-10 batches and the LRA pickles hold nothing else."""

    _ALLOWED = frozenset({
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("builtins", "bytearray"), ("_codecs", "encode"), ("collections", "OrderedDict"),
    })

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only numpy arrays "
                                     "and plain containers are accepted in data pickles")


def load_data_pickle(path: Path, *, encoding: str = "ASCII") -> Any:
    """``pickle.load`` restricted to numpy arrays and plain Python containers."""
    try:
        with open(path, "rb") as handle:
            return _ArrayUnpickler(handle, encoding=encoding).load()
    except pickle.UnpicklingError as err:
        raise DataError(f"{path}: {err}") from err


__all__ = ["PAD_ID", "LRADataset", "LRASplit", "TokenSequences", "collate", "compact_ids",
           "load_data_pickle", "missing"]
