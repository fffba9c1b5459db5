"""The ``text-files`` dataset: the text files under a directory as byte splits, held out by
file (the lm task's data)."""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flarepp.data.base import DataError
from flarepp.data.registry import DATASETS


def default_text_root() -> str:
    """The Python standard library's source directory of this interpreter."""
    return sysconfig.get_paths()["stdlib"]


def held_out_fraction(relative_path: str) -> float:
    """The SHA-256 of ``relative_path`` as a number in [0, 1): which split a file is in."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


@dataclass
class ByteSplit:
    """One split: its files (relative paths, in order) and their concatenated bytes."""

    files: list[str]
    data: np.ndarray   # uint8 [total bytes]

    def __len__(self) -> int:
        return int(self.data.shape[0])


@dataclass
class TextFiles:
    """The ``text-files`` dataset: train and test :class:`ByteSplit` and how they were made."""

    train: ByteSplit
    test: ByteSplit
    root: Path
    context: int
    n_train: int
    n_test: int
    pattern: str

    def split(self, name: str) -> ByteSplit:
        if name not in ("train", "test"):
            raise ValueError(f"unknown split {name!r}; the lm task has 'train' and 'test'")
        return getattr(self, name)

    def validate(self) -> TextFiles:
        """Both splits must hold at least one window of ``context + 1`` bytes."""
        for name in ("train", "test"):
            s = self.split(name)
            if len(s) < self.context + 1:
                raise DataError(f"{self.root}: the {name} split holds {len(s)} bytes in "
                                f"{len(s.files)} file(s) matching {self.pattern!r}, fewer than "
                                f"one window of context + 1 = {self.context + 1}; lower "
                                "context or change test_fraction / pattern")
        return self


def load_text_files(root: Path, *, context: int = 256, n_train: int = 2048,
                    n_test: int = 256, pattern: str = "*.py", test_fraction: float = 0.05,
                    exclude: list[str] | None = None) -> TextFiles:
    """Read the text files under ``root`` into byte splits (module docstring).

    ``root`` is a directory; ``exclude`` names directories to skip at any depth (default
    ``["site-packages", "__pycache__"]``). ``context`` is the window length T, ``n_train``
    the windows per training epoch, ``n_test`` the evaluation windows per split.
    """
    root = Path(root)
    for name, value in (("context", context), ("n_train", n_train), ("n_test", n_test)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DataError(f"text-files: {name} must be a positive integer, got {value!r}")
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"text-files: test_fraction must be in (0, 1), got {test_fraction}")
    if not root.is_dir():
        raise DataError(f"text-files: {str(root)!r} is not a directory of text files")
    skipped = set(["site-packages", "__pycache__"] if exclude is None else exclude)
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob(pattern)
                   if p.is_file() and not skipped & set(p.relative_to(root).parts[:-1]))
    if not files:
        raise DataError(f"text-files: no file matching {pattern!r} under {str(root)!r}")
    sides: dict[str, list[str]] = {"train": [], "test": []}
    for rel in files:
        sides["test" if held_out_fraction(rel) < test_fraction else "train"].append(rel)

    def read(names: list[str]) -> ByteSplit:
        chunks = [np.frombuffer((root / n).read_bytes(), dtype=np.uint8) for n in names]
        data = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
        return ByteSplit(names, data)

    return TextFiles(read(sides["train"]), read(sides["test"]), root, context, n_train,
                     n_test, pattern)


DATASETS.add("text-files", load_text_files,
             doc="text files under a directory as byte splits held out by file (lm task)")


__all__ = ["ByteSplit", "TextFiles", "default_text_root", "held_out_fraction",
           "load_text_files"]
