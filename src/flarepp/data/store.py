"""The on-disk store every task trains from: one folder of ``.npy`` arrays per sample.

Shape letters: S samples, n rows (points or cells) of one sample, I input and O target
channels, K conditions.

Layout of a store ``STORE/``::

    manifest.json            written last: format, channel layout, splits, every sample
    convert.json             what made it (spec and source), written first
    <sample>/<group>.npy     float32 [n, width] per channel group (coordinates, normals, p, ...)
    <sample>/meta.json       written after the sample's arrays: rows, source, conditions,
                             each array's shape, size, time and digests

**Why memory-mapped ``.npy`` and not zarr.** A sample is read whole (evaluation) or as a
random subset of its rows (``points_per_step``); both are one ``numpy.load(mmap_mode="r")``
and an index, with the operating system's page cache doing the lazy reading and nothing
read that is not touched. No new dependency, no chunk size to tune, and the format is the
DrivAerML cache's (:mod:`flarepp.data.drivaerml` writes its cars with :func:`write_sample`),
so one reader serves both. Zarr's strengths (compression, cloud object stores, one array
chunked over many samples) are not needed by a per-sample mesh dataset on a file system.

**Atomicity.** :func:`write_sample` deletes ``meta.json`` first, writes the arrays through
temporary files and renames, then writes ``meta.json``: a sample without ``meta.json`` is
unfinished and is never read; :class:`StoreWriter` writes ``manifest.json`` only after
every sample, so a store a conversion left unfinished is refused by readers, and a rerun
converts only what is missing.

**Edits after conversion.** ``meta.json`` and the manifest record each array's size,
modification time, SHA-256 and a sampled digest (:func:`~flarepp.data.fingerprint.
sampled_digest`). Opening a split checks every array's size, and its sampled digest where
the time differs (a copied store keeps its content, not its times); ``flarepp data check
STORE --verify`` compares every byte with the SHA-256. The fingerprint a run stores is a
hash of the per-sample digests: ``--resume`` on an edited store is refused.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from flarepp.data.base import (ChannelStatistics, DataError, DatasetSplits, RunningMoments,
                               SplitStatistics)
from flarepp.data.fingerprint import data_fingerprint, file_sha256, sampled_digest
from flarepp.data.layout import ChannelLayout
from flarepp.data.registry import DATASETS
from flarepp.io import atomic_write_all, is_temporary, read_json, UnreadableFile

MANIFEST = "manifest.json"
CONVERT_RECORD = "convert.json"
SAMPLE_META = "meta.json"
STORE_FORMAT = "flarepp-store"
STORE_VERSION = 1
CHUNK_ROWS = 1 << 20          # rows per chunk when streaming statistics over a sample
SPLITS = ("train", "test", "val")


# ---------------------------------------------------------------------------------------------
# one sample's folder

def _write_arrays(files: dict[Path, np.ndarray]) -> None:
    def saver(arr: np.ndarray) -> Callable[[Path], None]:
        def write(tmp: Path) -> None:
            with open(tmp, "wb") as handle:   # a handle: numpy would append ".npy" to a name
                np.save(handle, arr)
        return write
    atomic_write_all({path: saver(arr) for path, arr in files.items()})


def _write_json(path: Path, value: dict) -> None:
    text = json.dumps(value, indent=1) + "\n"
    atomic_write_all({path: lambda tmp: Path(tmp).write_text(text, encoding="utf-8")})


def _stored_entry(path: Path, shape: tuple[int, ...]) -> dict[str, Any]:
    stat = path.stat()
    return {"shape": list(shape), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "sha256": file_sha256(path), "sampled": sampled_digest(path)}


def sample_digest(stored: dict[str, dict[str, Any]]) -> str:
    """One digest of a sample's arrays: SHA-256 over their names and SHA-256s."""
    import hashlib
    text = json.dumps(sorted((name, entry["sha256"]) for name, entry in stored.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def write_sample(folder: str | Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]
                 ) -> dict[str, Any]:
    """Write one sample: each of ``arrays`` (``[n, width]``, the same n) as
    ``folder/<name>.npy`` (float32), then ``folder/meta.json`` holding ``meta`` plus
    ``rows`` (n), ``stored`` (each array's shape, size, time, SHA-256 and sampled digest) and
    their ``digest``; returns that meta. ``meta.json`` is removed first and written last
    (module docstring), stale temporaries of a killed write are removed."""
    folder = Path(folder)
    rows = {len(a) for a in arrays.values()}
    if len(rows) != 1:
        raise ValueError(f"{folder}: the arrays of one sample have different row counts "
                         f"{ {k: len(a) for k, a in arrays.items()} }")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / SAMPLE_META).unlink(missing_ok=True)   # invalid until rewritten
    except OSError as err:
        raise DataError(f"cannot write the sample folder {folder} ({err.strerror or err}); "
                        "give a writable directory") from err
    for stale in folder.iterdir():
        if is_temporary(stale.name):
            stale.unlink(missing_ok=True)
    prepared = {folder / f"{name}.npy": np.ascontiguousarray(
        np.asarray(a, np.float32).reshape(len(a), -1)) for name, a in arrays.items()}
    _write_arrays(prepared)
    stored = {path.stem: _stored_entry(path, arr.shape) for path, arr in prepared.items()}
    written = {**meta, "rows": rows.pop(), "stored": stored, "digest": sample_digest(stored)}
    _write_json(folder / SAMPLE_META, written)
    return written


def read_sample_meta(folder: str | Path) -> dict[str, Any] | None:
    """A sample's ``meta.json``, or None when it is missing or unreadable (unfinished)."""
    try:
        meta = read_json(Path(folder) / SAMPLE_META)
    except (FileNotFoundError, UnreadableFile):
        return None
    return meta if isinstance(meta, dict) and "stored" in meta else None


def array_problem(path: Path, entry: dict[str, Any], *, full: bool = False) -> str | None:
    """Why the array file at ``path`` is not what ``entry`` (its recorded ``stored``
    entry) describes, or None: missing, another size, or other content (the sampled
    digest where the modification time differs; every byte with ``full``)."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return "is missing"
    if stat.st_size != entry["bytes"]:
        return f"has {stat.st_size} bytes, {entry['bytes']} when it was written"
    if full:
        return None if file_sha256(path) == entry["sha256"] else "holds other bytes"
    if stat.st_mtime_ns != entry["mtime_ns"] and sampled_digest(path) != entry["sampled"]:
        return "holds other bytes"
    return None


def open_sample(folder: str | Path, expected: dict[str, Any],
                widths: dict[str, int]) -> dict[str, np.memmap] | None:
    """The arrays ``widths`` names (``{name: width}``), memory-mapped, when ``folder``
    holds a finished sample whose meta agrees with ``expected`` on every key it names and
    whose arrays are as written; None otherwise (a cache to rebuild)."""
    folder = Path(folder)
    meta = read_sample_meta(folder)
    if meta is None or {k: meta.get(k) for k in expected} != expected:
        return None
    arrays = {}
    for name, width in widths.items():
        entry = meta["stored"].get(name)
        path = folder / f"{name}.npy"
        if entry is None or array_problem(path, entry) is not None:
            return None
        try:
            array = np.load(path, mmap_mode="r")
        except (FileNotFoundError, ValueError):
            return None
        if array.shape != (meta["rows"], width) or array.dtype != np.float32:
            return None
        arrays[name] = array
    return arrays


def check_sample_name(name: str) -> str:
    """A sample name is a relative POSIX path without ``..`` (its folder in the store)."""
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or name in (MANIFEST,
                                                                         CONVERT_RECORD):
        raise DataError(f"{name!r} cannot name a sample (a relative path inside the store)")
    return name


# ---------------------------------------------------------------------------------------------
# the sink

class StoreWriter:
    """Writes a store: ``convert.json`` first (``identity``: what makes the samples, e.g.
    the spec and the source), one :func:`write_sample` per sample, ``manifest.json`` last.

    An existing store with the same identity is resumed (:meth:`finished` tells which
    samples are done); one with another identity is refused unless ``overwrite``, which
    deletes it first; a directory that is not a store and not empty is refused."""

    def __init__(self, root: str | Path, identity: dict[str, Any], *,
                 overwrite: bool = False) -> None:
        self.root = Path(root)
        self.identity = json.loads(json.dumps(identity))   # as it reads back
        record = self.root / CONVERT_RECORD
        if self.root.exists() and not self.root.is_dir():
            raise DataError(f"{self.root} is a file, not a store directory")
        if self.root.is_dir() and any(self.root.iterdir()):
            if not record.is_file() and not (self.root / MANIFEST).is_file():
                raise DataError(f"{self.root} is not empty and holds no store "
                                f"({CONVERT_RECORD}); give an empty or new directory")
            previous = self._read_record()
            started = any(p.name != CONVERT_RECORD for p in self.root.iterdir())
            if previous != self.identity:
                if not overwrite and started:  # a store of no sample yet is nothing to lose
                    changed = sorted(k for k in set(previous or {}) | set(self.identity)
                                     if (previous or {}).get(k) != self.identity.get(k))
                    raise DataError(f"{self.root} holds a store made otherwise (differs in "
                                    f"{changed}); pass --overwrite to replace it, or give "
                                    "another --out")
                shutil.rmtree(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / MANIFEST).unlink(missing_ok=True)   # incomplete until finish()
        _write_json(record, {"format": STORE_FORMAT, "version": STORE_VERSION,
                             "identity": self.identity})

    def _read_record(self) -> dict[str, Any] | None:
        try:
            return read_json(self.root / CONVERT_RECORD).get("identity")
        except (FileNotFoundError, UnreadableFile, AttributeError):
            return None

    def finished(self, name: str, source: dict[str, Any]) -> dict[str, Any] | None:
        """The meta of sample ``name`` when it is finished from the same ``source``
        (identity of its source file) and its arrays are intact; None otherwise."""
        folder = self.root / check_sample_name(name)
        meta = read_sample_meta(folder)
        if meta is None or meta.get("source") != source:
            return None
        for array, entry in meta["stored"].items():
            if array_problem(folder / f"{array}.npy", entry) is not None:
                return None
        return meta

    def write(self, name: str, arrays: dict[str, np.ndarray], meta: dict[str, Any]
              ) -> dict[str, Any]:
        return write_sample(self.root / check_sample_name(name), arrays, meta)

    def finish(self, layout: ChannelLayout, splits: dict[str, list[str]],
               metas: dict[str, dict[str, Any]], info: dict[str, Any] | None = None
               ) -> "MeshStore":
        """Write ``manifest.json`` (the layout, the splits, every sample's meta) and
        return the store, opened."""
        write_manifest(self.root, layout, splits, metas,
                       {"identity": self.identity, **(info or {})})
        return MeshStore(self.root)


def write_manifest(root: str | Path, layout: ChannelLayout, splits: dict[str, list[str]],
                   metas: dict[str, dict[str, Any]], info: dict[str, Any] | None = None
                   ) -> Path:
    """``root/manifest.json`` for samples whose metas are ``metas`` (by name)."""
    unknown = sorted({s for names in splits.values() for s in names} - set(metas))
    if unknown:
        raise ValueError(f"splits name samples without a meta: {unknown[:5]}")
    samples = {name: {"rows": m["rows"], "association": layout.association,
                      "source": m.get("source"), "conditions": m.get("conditions", []),
                      "stored": m["stored"], "digest": m["digest"]}
               for name, m in metas.items()}
    path = Path(root) / MANIFEST
    _write_json(path, {"format": STORE_FORMAT, "version": STORE_VERSION,
                       "layout": layout.to_dict(), "splits": splits, "samples": samples,
                       **(info or {})})
    return path


# ---------------------------------------------------------------------------------------------
# reading a store

class MeshStore:
    """A store opened from its ``manifest.json`` (module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        path = self.root / MANIFEST
        if not path.is_file():
            if (self.root / CONVERT_RECORD).is_file():
                raise DataError(f"{self.root}: the store is unfinished (no {MANIFEST}: its "
                                "conversion was stopped); run the same `flarepp data "
                                "convert` again to finish it")
            raise DataError(f"{self.root}: not a store (no {MANIFEST}); make one with "
                            "`flarepp data convert`")
        try:
            manifest = read_json(path)
        except UnreadableFile as err:
            raise DataError(str(err)) from None
        if not isinstance(manifest, dict) or manifest.get("format") != STORE_FORMAT:
            raise DataError(f"{path}: not a flarepp store manifest")
        if manifest.get("version") != STORE_VERSION:
            raise DataError(f"{path}: store format version {manifest.get('version')}, this "
                            f"flarepp reads version {STORE_VERSION}; convert it again")
        self.manifest = manifest
        self.layout = ChannelLayout.from_dict(manifest["layout"])
        self.splits: dict[str, list[str]] = {k: list(v) for k, v in manifest["splits"].items()}
        self.samples: dict[str, dict[str, Any]] = manifest["samples"]

    def names(self, split: str) -> list[str]:
        if split not in self.splits:
            raise DataError(f"{self.root}: the store has no {split!r} split (it has "
                            f"{sorted(self.splits)})")
        return list(self.splits[split])

    def split(self, split: str, *, conditions: list[str] | None = None,
              count: int | None = None) -> "StoreSamples":
        """The samples of ``split`` (the first ``count``), with the conditions named (all
        of the store's by default, ``[]`` none)."""
        names = self.names(split)
        if count is not None:
            if count > len(names):
                raise DataError(f"{self.root}: split {split!r} holds {len(names)} samples, "
                                f"fewer than the {count} asked for (n_{split}={count})")
            names = names[:count]
        return StoreSamples(self, names, self.condition_columns(conditions))

    def condition_columns(self, conditions: list[str] | None) -> list[int]:
        known = self.layout.condition_names
        if conditions is None:
            return list(range(len(known)))
        unknown = [c for c in conditions if c not in known]
        if unknown:
            raise DataError(f"{self.root}: condition(s) {unknown} are not in the store, whose "
                            f"conditions are {known or 'none'}")
        return [known.index(c) for c in conditions]

    def check(self, names: Iterable[str] | None = None, *, full: bool = False) -> None:
        """Raise a :class:`DataError` naming the first array of ``names`` (default: every
        sample) changed since the store was written (:func:`array_problem`)."""
        for name in self.samples if names is None else names:
            entry = self.samples[name]
            for array, stored in entry["stored"].items():
                path = self.root / name / f"{array}.npy"
                problem = array_problem(path, stored, full=full)
                if problem is not None:
                    raise DataError(f"{path} {problem}: the store was changed after "
                                    "conversion, so its recorded fingerprint no longer "
                                    "holds; convert it again")

    def describe(self) -> list[str]:
        """Lines of ``flarepp data check STORE``: layout, splits, sizes, conditions."""
        layout = self.layout
        lines = [f"store {self.root} ({layout.association} data, {layout.dimensions}-D, "
                 f"{len(self.samples)} samples)"]
        for what, groups in (("inputs", layout.inputs), ("targets", layout.targets),
                             ("conditions", layout.conditions)):
            shown = ", ".join(f"{g.name} {list(g.channels)}" + (f" [{g.units}]" if g.units
                                                                else "")
                              + (f" x{g.scale:g}" if g.scale != 1 else "")
                              + (f" from {g.source}" if g.source and g.source != g.name
                                 else "") for g in groups)
            lines.append(f"  {what}: {shown or 'none'}")
        lines.append(f"  leading coordinate channels: {layout.coordinates}")
        for split, names in self.splits.items():
            rows = np.array([self.samples[n]["rows"] for n in names]) if names else np.zeros(1)
            lines.append(f"  {split}: {len(names)} samples, {int(rows.min())}-"
                         f"{int(rows.max())} rows (median {int(np.median(rows))}), "
                         f"{int(rows.sum())} in all")
        if layout.conditions:
            values = np.array([self.samples[n]["conditions"] for n in self.samples], float)
            for k, name in enumerate(layout.condition_names):
                lines.append(f"  condition {name}: {values[:, k].min():.6g} to "
                             f"{values[:, k].max():.6g}")
        return lines


class StoreSamples:
    """The samples of one split of a store, read one at a time (never padded): the same
    questions as :class:`~flarepp.data.MeshSamples` answer (``sample``, ``point_counts``,
    ``fit_statistics``, ``subset``, ...). ``conditions [S, K]`` float32, or None."""

    mask = None
    grid_shape = None
    coords = None

    def __init__(self, store: MeshStore, names: list[str], condition_columns: list[int]
                 ) -> None:
        self.store, self.names = store, list(names)
        self.condition_columns = list(condition_columns)
        layout = store.layout
        self._inputs = [(g.name, g.width) for g in layout.inputs]
        self._targets = [(g.name, g.width) for g in layout.targets]
        self._rows = np.array([store.samples[n]["rows"] for n in self.names], np.int64)
        self._conditions = None
        if self.condition_columns:
            values = np.array([store.samples[n]["conditions"] for n in self.names],
                              np.float64).reshape(len(self.names), -1)
            self._conditions = values[:, self.condition_columns].astype(np.float32)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def in_dim(self) -> int:
        return sum(w for _, w in self._inputs)

    @property
    def out_dim(self) -> int:
        return sum(w for _, w in self._targets)

    @property
    def n_points(self) -> int:
        return int(self._rows.max()) if len(self._rows) else 0

    @property
    def conditions(self) -> np.ndarray | None:
        return self._conditions

    def point_counts(self) -> np.ndarray:
        return self._rows.copy()

    def source_of(self, index: int) -> str | None:
        return self.store.samples[self.names[index]].get("source")

    def _read(self, index: int, groups: list[tuple[str, int]],
              rows: np.ndarray | slice | None) -> np.ndarray:
        folder = self.store.root / self.names[index]
        if not groups:                    # a store without targets (for prediction)
            rows_n = self._rows[index] if rows is None else len(np.arange(self._rows[index])[rows])
            return np.zeros((rows_n, 0), np.float32)
        parts = []
        for name, width in groups:
            path = folder / f"{name}.npy"
            try:
                array = np.load(path, mmap_mode="r")
            except (OSError, ValueError) as err:
                raise DataError(f"{path}: cannot read the stored array ({err}); convert the "
                                "store again") from None
            if array.shape != (self._rows[index], width):
                raise DataError(f"{path}: holds {list(array.shape)}, the manifest says "
                                f"[{self._rows[index]}, {width}]; convert the store again")
            parts.append(np.array(array if rows is None else array[rows], np.float32))
            del array                     # drop the mapping: resident memory stays one sample
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)

    def sample(self, index: int, points: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """``(x [n, I], y [n, O])`` of sample ``index``, or at its rows ``points``."""
        return self._read(index, self._inputs, points), self._read(index, self._targets, points)

    def chunks(self, index: int, size: int = CHUNK_ROWS
               ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(x, y)`` of sample ``index`` in consecutive chunks of ``size`` rows."""
        for start in range(0, int(self._rows[index]), size):
            rows = slice(start, start + size)
            yield self._read(index, self._inputs, rows), self._read(index, self._targets, rows)

    def fit_statistics(self) -> SplitStatistics:
        """One streaming float64 pass over every row (:class:`~flarepp.data.RunningMoments`):
        memory is a chunk of one sample, whatever the store's size."""
        x, y = RunningMoments(self.in_dim), RunningMoments(self.out_dim)
        zero = []
        for i in range(len(self)):
            squares = 0.0
            for x_chunk, y_chunk in self.chunks(i):
                x.add(x_chunk)
                y.add(y_chunk)
                squares += float(np.square(y_chunk, dtype=np.float64).sum())
            if squares == 0:
                zero.append(i)
        where = f"{self.store.root}"
        conditions = self.conditions
        return SplitStatistics(x.result(f"{where} inputs"), y.result(f"{where} targets"),
                               None if conditions is None
                               else ChannelStatistics.of_array(conditions), zero)

    def padded_arrays(self) -> dict[str, np.ndarray]:
        """``true [S, N, O]`` padded to the longest sample, ``coords`` (the leading
        coordinate inputs, else the first two), ``real``/``mask [S, N]``."""
        n = self.n_points
        true = np.zeros((len(self), n, self.out_dim), np.float32)
        width = self.store.layout.coordinates or min(2, self.in_dim)
        coords = np.zeros((len(self), n, width), np.float32)
        real = np.arange(n)[None, :] < self._rows[:, None]
        for i in range(len(self)):
            x, y = self.sample(i)
            true[i, :len(y)], coords[i, :len(x)] = y, x[:, :width]
        return {"true": true, "coords": coords, "real": real, "mask": real}

    def subset(self, index: Any) -> "StoreSamples":
        return StoreSamples(self.store, list(np.asarray(self.names, dtype=object)[index]),
                            self.condition_columns)

    def validate(self, source: str) -> "StoreSamples":
        """Every array as written (:meth:`MeshStore.check`), finite conditions."""
        self.store.check(self.names)
        conditions = self.conditions
        if conditions is not None and not np.isfinite(conditions).all():
            i = int(np.argwhere(~np.isfinite(conditions))[0][0])
            raise DataError(f"{source}: sample {self.names[i]!r} has a NaN or inf condition")
        return self

    def fingerprint(self, path: Any) -> dict[str, Any]:
        """A content fingerprint of these samples from their recorded digests (no pass
        over the arrays): names, row counts and per-sample SHA-256s."""
        import hashlib
        names = np.frombuffer(hashlib.sha256("\n".join(self.names).encode()).digest(),
                              np.uint8)
        digests = np.frombuffer(b"".join(bytes.fromhex(self.store.samples[n]["digest"])
                                         for n in self.names), np.uint8)
        arrays = {"names": names, "rows": self._rows, "digests": digests}
        if self.conditions is not None:
            arrays["conditions"] = self.conditions
        return data_fingerprint(arrays, path)


# ---------------------------------------------------------------------------------------------
# the registered dataset

def _units(layout: ChannelLayout) -> str:
    units = [g.units for g in layout.targets]
    return ", ".join(u for u in units if u) or "units not given"


def load_store(root: Path, *, points_per_step: int | None = None,
               conditions: list[str] | None = None, n_train: int | None = None,
               n_test: int | None = None) -> DatasetSplits:
    """A store's ``train`` and ``test`` splits (and ``val`` when it has one), read lazily.

    ``points_per_step``: training items are a random subset of that many rows of a sample
    (a new one every step; evaluation uses every row); ``conditions``: the per-sample
    conditions to use (default all of the store's, ``[]`` none); ``n_train`` / ``n_test``
    keep the first samples of each split."""
    for key, value in (("points_per_step", points_per_step), ("n_train", n_train),
                       ("n_test", n_test)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise DataError(f"dataset_options.{key} must be a positive integer, got {value!r}")
    if conditions is not None and not (isinstance(conditions, list)
                                       and all(isinstance(c, str) for c in conditions)):
        raise DataError(f"dataset_options.conditions must be a list of condition names, got "
                        f"{conditions!r}")
    store = MeshStore(root)
    columns = store.condition_columns(conditions)
    names = [store.layout.condition_names[k] for k in columns]
    train = store.split("train", conditions=names, count=n_train)
    test = store.split("test", conditions=names, count=n_test)
    val = store.split("val", conditions=names) if store.splits.get("val") else None
    layout = store.layout.with_conditions(names)
    return DatasetSplits("store", train, test, field_names=layout.target_channels,
                         units=_units(layout), source=str(root), val=val, layout=layout,
                         points_per_step=points_per_step)


DATASETS.add("store", load_store,
             doc="a flarepp store (`flarepp data convert`): per-sample .npy arrays, read "
                 "lazily, optional per-sample conditions (fields task)")


__all__ = ["CONVERT_RECORD", "MANIFEST", "MeshStore", "SAMPLE_META", "StoreSamples",
           "StoreWriter", "array_problem", "load_store", "open_sample", "read_sample_meta",
           "sample_digest", "write_manifest", "write_sample"]
