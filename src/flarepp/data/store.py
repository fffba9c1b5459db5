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

**One writer, names inside.** :class:`StoreWriter` holds the store's lease
(:class:`StoreLock`, ``STORE/.lock``) while it writes, so a second writer is refused;
every sample records a digest of the identity (spec, source) of the conversion that wrote
it. Every sample and array name becomes a path through :func:`inside`
(:func:`flarepp.io.confined`): a manifest naming ``../x``, an absolute path or a link out
of the store is refused, as is any other hand edit of its keys, in one sentence naming the
manifest and the key.

**Edits after conversion.** ``meta.json`` and the manifest record each array's size,
modification time, SHA-256 and a sampled digest (:func:`~flarepp.data.fingerprint.
sampled_digest`). Opening a split checks every array's size, and its sampled digest where
the time differs (a copied store keeps its content, not its times); ``flarepp data check
STORE --verify`` compares every byte with the SHA-256, and each sample's own ``meta.json``
with the manifest (a sample another conversion wrote is refused). The fingerprint a run
stores is a hash of the per-sample digests: ``--resume`` on an edited store is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from flarepp.data.base import (ChannelStatistics, DataError, DatasetSplits, RunningMoments,
                               SplitStatistics)
from flarepp.data.fingerprint import data_fingerprint, file_sha256, sampled_digest
from flarepp.data.layout import ChannelLayout
from flarepp.data.registry import DATASETS, OPTION_CHECKS
from flarepp.io import (RowArray, UnreadableFile, UnsafeName, atomic_write_all, check_name,
                        confined, is_temporary, read_json, save_npy)
from flarepp.locks import LOCK_NAME, Lease, Verdict

MANIFEST = "manifest.json"
CONVERT_RECORD = "convert.json"
SAMPLE_META = "meta.json"
STORE_FORMAT = "flarepp-store"
STORE_VERSION = 1
CHUNK_ROWS = 1 << 20          # rows per chunk when streaming statistics over a sample
SPLITS = ("train", "test", "val")
RESERVED = (MANIFEST, CONVERT_RECORD, LOCK_NAME)
"""Names at a store's top that no sample may take."""


def inside(root: str | Path, name: Any, what: str, *, flat: bool = False) -> Path:
    """:func:`flarepp.io.confined` of a name a store reads or writes (a sample's folder, an
    array's file), its refusal a :class:`DataError` (the store's data is at fault)."""
    try:
        return confined(root, name, what=what, flat=flat)
    except UnsafeName as err:
        raise DataError(str(err)) from None


def sample_folder(root: str | Path, name: Any, what: str = "sample name") -> Path:
    """The folder of sample ``name`` in the store ``root``: a relative path inside it
    (:func:`inside`) that is not one of the store's own files."""
    if name in RESERVED:
        raise DataError(f"{what} {name!r} cannot name a sample: it is a file of the store "
                        f"{str(root)!r}")
    return inside(root, name, what)


def array_file(folder: str | Path, group: Any, what: str = "array name") -> Path:
    """``folder/<group>.npy``: a group's array file, a plain file name in its sample's
    folder (:func:`inside`)."""
    if not isinstance(group, str):
        return inside(folder, group, what, flat=True)   # the sentence for a non-string
    return inside(folder, f"{group}.npy", what, flat=True)


def identity_digest(identity: Any) -> str:
    """A short SHA-256 of what made a store (its ``convert.json`` identity: spec and
    source): recorded in every sample it writes, so a sample another conversion wrote is
    told apart."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# one sample's folder

def _write_arrays(files: dict[Path, np.ndarray]) -> None:
    def saver(arr: np.ndarray) -> Callable[[Path], None]:
        def write(tmp: Path) -> None:
            with open(tmp, "wb") as handle:   # a handle: numpy would append ".npy" to a name
                save_npy(handle, arr)
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
    prepared = {array_file(folder, name): np.ascontiguousarray(
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


# ---------------------------------------------------------------------------------------------
# the sink

class StoreLock(Lease):
    """The lease of a store being written, ``STORE/.lock`` (:class:`flarepp.locks.Lease`):
    one writer at a time, across hosts; a writer killed on this host never blocks."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        super().__init__(self.root / LOCK_NAME)

    def held_message(self, verdict: Verdict) -> str:
        return (f"{super().held_message(verdict)}; it is writing the store "
                f"{str(self.root)!r}: wait for it to finish, or give another --out")


def _lease_file(name: str) -> bool:
    return name in (LOCK_NAME, f"{LOCK_NAME}.takeover")


def store_files(root: Path) -> tuple[list[Path], list[Path]]:
    """``(files a store consists of, everything else)`` under ``root`` (its lease aside):
    ``convert.json`` and ``manifest.json`` at its top, and in the sample folders below
    ``meta.json`` and ``.npy`` arrays, and the atomic writers' temporaries. A symbolic
    link is never the store's."""
    ours, others = [], []
    for folder, dirs, files in os.walk(root):   # links to folders are listed, not entered
        folder = Path(folder)
        others += [folder / d for d in dirs if (folder / d).is_symlink()]
        for name in files:
            path = folder / name
            top = folder == root
            if top and _lease_file(name):
                continue
            mine = (name in (CONVERT_RECORD, MANIFEST) if top else
                    name == SAMPLE_META or name.endswith(".npy")) or is_temporary(name)
            (ours if mine and not path.is_symlink() else others).append(path)
    return ours, others


def clear_store(root: Path) -> None:
    """Delete the store at ``root``: its own files (:func:`store_files`) and the folders
    they leave empty; a folder holding anything else is refused and nothing is deleted.
    ``root`` itself stays (a link to a folder stays a link)."""
    ours, others = store_files(root)
    if others:
        shown = str(others[0].relative_to(root))
        raise DataError(f"{root} holds files a store does not ({shown!r}"
                        + (f" and {len(others) - 1} more" if len(others) > 1 else "")
                        + "): --overwrite deletes only a store's own files; move them out or "
                          "give another --out")
    for path in ours:
        path.unlink()
    for folder, dirs, _ in sorted(os.walk(root), key=lambda w: -len(Path(w[0]).parts)):
        if Path(folder) != root and not any(Path(folder).iterdir()):
            Path(folder).rmdir()


class StoreWriter:
    """Writes a store: ``convert.json`` first (``identity``: what makes the samples, e.g.
    the spec and the source), one :func:`write_sample` per sample, ``manifest.json`` last.

    The writer holds the store's lease (:class:`StoreLock`) from its creation until
    :meth:`finish` or :meth:`close` (``with StoreWriter(...) as writer``): a second writer
    of the same store is refused, naming the first. An existing store with the same
    identity is resumed (:meth:`finished` tells which samples are done); one with another
    identity is refused unless ``overwrite``, which deletes it first (its own files only,
    :func:`clear_store`); a directory that is not a store and not empty is refused."""

    def __init__(self, root: str | Path, identity: dict[str, Any], *,
                 overwrite: bool = False) -> None:
        self.root = Path(root)
        self.identity = json.loads(json.dumps(identity))   # as it reads back
        self.digest = identity_digest(self.identity)
        if self.root.exists() and not self.root.is_dir():
            raise DataError(f"{self.root} is a file, not a store directory")
        self.lease = StoreLock(self.root).acquire()
        try:
            self._prepare(overwrite)
        except BaseException:
            self.close()
            raise

    def _prepare(self, overwrite: bool) -> None:
        record = self.root / CONVERT_RECORD
        entries = [p for p in self.root.iterdir() if not _lease_file(p.name)]
        if entries:
            if not record.is_file() and not (self.root / MANIFEST).is_file():
                raise DataError(f"{self.root} is not empty and holds no store "
                                f"({CONVERT_RECORD}); give an empty or new directory")
            previous = self._read_record()
            started = any(p.name != CONVERT_RECORD for p in entries)
            if previous != self.identity:
                if not overwrite and started:  # a store of no sample yet is nothing to lose
                    changed = sorted(k for k in set(previous or {}) | set(self.identity)
                                     if (previous or {}).get(k) != self.identity.get(k))
                    raise DataError(f"{self.root} holds a store made otherwise (differs in "
                                    f"{changed}); pass --overwrite to replace it, or give "
                                    "another --out")
                clear_store(self.root)
        (self.root / MANIFEST).unlink(missing_ok=True)   # incomplete until finish()
        _write_json(record, {"format": STORE_FORMAT, "version": STORE_VERSION,
                             "identity": self.identity})

    def close(self) -> None:
        """Give the store's lease back (the store stays as it is: unfinished until
        :meth:`finish`)."""
        self.lease.release()

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_record(self) -> dict[str, Any] | None:
        try:
            return read_json(self.root / CONVERT_RECORD).get("identity")
        except (FileNotFoundError, UnreadableFile, AttributeError):
            return None

    def finished(self, name: str, source: dict[str, Any]) -> dict[str, Any] | None:
        """The meta of sample ``name`` when it is finished by this writer's identity from
        the same ``source`` (identity of its source file) and its arrays are intact; None
        otherwise."""
        folder = sample_folder(self.root, name)
        meta = read_sample_meta(folder)
        if meta is None or meta.get("source") != source or meta.get("identity") != self.digest:
            return None
        for array, entry in meta["stored"].items():
            if array_problem(array_file(folder, array), entry) is not None:
                return None
        return meta

    def write(self, name: str, arrays: dict[str, np.ndarray], meta: dict[str, Any]
              ) -> dict[str, Any]:
        return write_sample(sample_folder(self.root, name), arrays,
                            {**meta, "identity": self.digest})

    def finish(self, layout: ChannelLayout, splits: dict[str, list[str]],
               metas: dict[str, dict[str, Any]], info: dict[str, Any] | None = None
               ) -> "MeshStore":
        """Write ``manifest.json`` (the layout, the splits, every sample's meta), give the
        lease back and return the store, opened."""
        write_manifest(self.root, layout, splits, metas,
                       {"identity": self.identity, **(info or {})})
        self.close()
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
                      "stored": m["stored"], "digest": m["digest"],
                      **({"identity": m["identity"]} if "identity" in m else {})}
               for name, m in metas.items()}
    path = Path(root) / MANIFEST
    _write_json(path, {"format": STORE_FORMAT, "version": STORE_VERSION,
                       "layout": layout.to_dict(), "splits": splits, "samples": samples,
                       **(info or {})})
    return path


# ---------------------------------------------------------------------------------------------
# reading a store

def _checked_layout(value: Any, path: Path) -> ChannelLayout:
    """The manifest's ``layout``, every group an object with a plain ``name`` (its array's
    file name), ``channels`` and a finite ``scale``; a :class:`DataError` naming the key."""
    if not isinstance(value, dict):
        raise DataError(f"{path}: 'layout' is {_shown(value)}, not an object (the channel "
                        "layout)")
    for key in ("inputs", "targets", "conditions"):
        groups = value.get(key, [] if key == "conditions" else None)
        if not isinstance(groups, list):
            raise DataError(f"{path}: layout.{key} is {_shown(groups)}, not a list of channel "
                            "groups")
        for i, g in enumerate(groups):
            if not (isinstance(g, dict) and isinstance(g.get("name"), str)
                    and isinstance(g.get("channels"), list) and g["channels"]
                    and all(isinstance(c, str) for c in g["channels"])
                    and _number(g.get("scale", 1.0)) and math.isfinite(g.get("scale", 1.0))
                    and all(isinstance(g.get(k, ""), str) for k in ("source", "units"))):
                raise DataError(f"{path}: layout.{key}[{i}] is not a channel group (an object "
                                "with a 'name', a list of 'channels', a finite 'scale', "
                                "'source' and 'units' strings)")
            _name(g["name"], f"{path}: layout.{key}[{i}].name", flat=True)
    try:
        return ChannelLayout.from_dict(value)
    except (TypeError, ValueError) as err:
        raise DataError(f"{path}: 'layout' is not a channel layout ({err})") from None


def _checked_samples(root: Path, manifest: dict[str, Any], path: Path,
                     layout: ChannelLayout) -> dict[str, dict[str, Any]]:
    """The manifest's ``samples``, each name a folder inside the store and each entry a
    sample record (:func:`_check_sample`)."""
    samples = manifest.get("samples")
    if not isinstance(samples, dict):
        raise DataError(f"{path}: 'samples' is {_shown(samples)}, not an object of samples "
                        "by name")
    groups = [g.name for g in layout.inputs + layout.targets]
    for name, entry in samples.items():
        sample_folder(root, name, f"{path}: sample name")
        _check_sample(entry, f"{path}: samples[{name!r}]", groups,
                      len(layout.condition_names))
    return samples


def _check_sample(entry: Any, where: str, groups: list[str], conditions: int) -> None:
    """A sample record: positive ``rows``, one number per condition, a ``stored`` record
    (shape, bytes, time, digests) of every array of the layout, a hexadecimal ``digest``."""
    if not isinstance(entry, dict):
        raise DataError(f"{where} is {_shown(entry)}, not an object (a sample record)")
    rows = entry.get("rows")
    if type(rows) is not int or rows < 1:
        raise DataError(f"{where}.rows is {rows!r}, not a positive integer")
    values = entry.get("conditions", [])
    if not isinstance(values, list) or len(values) != conditions \
            or not all(_number(v) for v in values):
        raise DataError(f"{where}.conditions is {_shown(values)}, not a list of {conditions} "
                        "number(s), one per condition of the layout")
    stored = entry.get("stored")
    if not isinstance(stored, dict):
        raise DataError(f"{where}.stored is {_shown(stored)}, not an object of array records")
    missing = [g for g in groups if g not in stored]
    if missing:
        raise DataError(f"{where}.stored has no record of array {missing[0]!r} of the layout")
    for array, record in stored.items():
        _name(array, f"{where}.stored key", flat=True)
        if not (isinstance(record, dict) and isinstance(record.get("shape"), list)
                and all(type(n) is int and n >= 0 for n in record["shape"])
                and all(type(record.get(k)) is int and record[k] >= 0
                        for k in ("bytes", "mtime_ns"))
                and all(isinstance(record.get(k), str) for k in ("sha256", "sampled"))):
            raise DataError(f"{where}.stored[{array!r}] is not an array record (shape, bytes, "
                            "mtime_ns, sha256, sampled)")
    digest = entry.get("digest")
    if not isinstance(digest, str) or not _hexadecimal(digest):
        raise DataError(f"{where}.digest is {_shown(digest)}, not a hexadecimal digest")


def _checked_splits(value: Any, path: Path, samples: dict[str, Any]) -> dict[str, list[str]]:
    """The manifest's ``splits``: lists of distinct sample names it holds."""
    if not isinstance(value, dict) or not all(isinstance(v, list) for v in value.values()):
        raise DataError(f"{path}: 'splits' is {_shown(value)}, not an object of lists of "
                        "sample names by split")
    for split, names in value.items():
        unknown = [n for n in names if not isinstance(n, str) or n not in samples]
        if unknown:
            raise DataError(f"{path}: splits[{split!r}] names {unknown[0]!r}, which is not "
                            "one of its samples")
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise DataError(f"{path}: splits[{split!r}] names {twice!r} twice")
    return {k: list(v) for k, v in value.items()}


def _name(name: str, what: str, *, flat: bool = False) -> None:
    try:
        check_name(name, what=what, flat=flat, inside="the store")
    except UnsafeName as err:
        raise DataError(str(err)) from None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _hexadecimal(text: str) -> bool:
    return len(text) % 2 == 0 and all(c in "0123456789abcdef" for c in text)


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{type(value).__name__} {text[:limit]}..."


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
        self.layout = _checked_layout(manifest.get("layout"), path)
        self.samples: dict[str, dict[str, Any]] = _checked_samples(self.root, manifest, path,
                                                                   self.layout)
        self.splits: dict[str, list[str]] = _checked_splits(manifest.get("splits"), path,
                                                            self.samples)

    def array_path(self, name: str, group: str) -> Path:
        """The file of array ``group`` of sample ``name``, confined to the store
        (:func:`inside`: a link planted in the store is refused)."""
        where = f"{self.root / MANIFEST}:"
        return array_file(sample_folder(self.root, name, f"{where} sample name"), group,
                          f"{where} array name")

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
            if full:
                self._check_same_conversion(name, entry)
            for array, stored in entry["stored"].items():
                path = self.array_path(name, array)
                problem = array_problem(path, stored, full=full)
                if problem is not None:
                    raise DataError(f"{path} {problem}: the store was changed after "
                                    "conversion, so its recorded fingerprint no longer "
                                    "holds; convert it again")

    def _check_same_conversion(self, name: str, entry: dict[str, Any]) -> None:
        """Sample ``name``'s own ``meta.json`` says the conversion the manifest records
        wrote it: its digest, its layout (unit scales included) and the identity of the
        conversion (spec and source) that wrote it, where recorded."""
        folder = sample_folder(self.root, name)
        meta = read_sample_meta(folder)
        if meta is None:
            raise DataError(f"{folder / SAMPLE_META} is missing or unreadable: the store was "
                            "changed after conversion; convert it again")
        expected = {"digest": entry["digest"], "layout": self.manifest["layout"],
                    "identity": identity_digest(self.manifest.get("identity"))}
        differ = [key for key, want in expected.items() if key in meta and meta[key] != want]
        if differ:
            raise DataError(f"{folder / SAMPLE_META}: sample {name!r} was written by another "
                            f"conversion than the manifest records (its {' and '.join(differ)} "
                            "differ): the store mixes two conversions; convert it again with "
                            "--overwrite")

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
        if not groups:                    # a store without targets (for prediction)
            rows_n = self._rows[index] if rows is None else len(np.arange(self._rows[index])[rows])
            return np.zeros((rows_n, 0), np.float32)
        parts = []
        for name, width in groups:
            path = self.store.array_path(self.names[index], name)
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

    def padded_arrays(self) -> dict[str, Any]:
        """``true [S, N, O]`` padded to the longest sample, ``coords`` (the leading
        coordinate inputs, else the first two), ``real``/``mask [S, N]``; ``true`` and
        ``coords`` as :class:`~flarepp.io.RowArray`, each sample read when its row is
        written (never the split at once)."""
        n = self.n_points
        width = self.store.layout.coordinates or min(2, self.in_dim)
        real = np.arange(n)[None, :] < self._rows[:, None]

        def padded(i: int, groups: list[tuple[str, int]], channels: int) -> np.ndarray:
            row = np.zeros((n, channels), np.float32)
            row[:self._rows[i]] = self._read(i, groups, None)[:, :channels]
            return row

        return {"true": RowArray((len(self), n, self.out_dim), np.float32,
                                 lambda i: padded(i, self._targets, self.out_dim)),
                "coords": RowArray((len(self), n, width), np.float32,
                                   lambda i: padded(i, self._inputs, width)),
                "real": real, "mask": real}

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


def check_store_options(*, points_per_step: int | None = None,
                        conditions: list[str] | None = None, n_train: int | None = None,
                        n_test: int | None = None) -> None:
    """The store's options as a run config states them (a usage error, ``ValueError``,
    naming the key): counts are positive integers, ``conditions`` a list of names. Run
    configs are checked with it before any data is read (:data:`OPTION_CHECKS`)."""
    for key, value in (("points_per_step", points_per_step), ("n_train", n_train),
                       ("n_test", n_test)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"dataset_options.{key} must be a positive integer, got {value!r}")
    if conditions is not None and not (isinstance(conditions, list)
                                       and all(isinstance(c, str) for c in conditions)):
        raise ValueError(f"dataset_options.conditions must be a list of condition names, got "
                         f"{conditions!r}")


def load_store(root: Path, *, points_per_step: int | None = None,
               conditions: list[str] | None = None, n_train: int | None = None,
               n_test: int | None = None) -> DatasetSplits:
    """A store's ``train`` and ``test`` splits (and ``val`` when it has one), read lazily.

    ``points_per_step``: training items are a random subset of that many rows of a sample
    (a new one every step; evaluation uses every row); ``conditions``: the per-sample
    conditions to use (default all of the store's, ``[]`` none); ``n_train`` / ``n_test``
    keep the first samples of each split (:func:`check_store_options`)."""
    check_store_options(points_per_step=points_per_step, conditions=conditions,
                        n_train=n_train, n_test=n_test)
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
OPTION_CHECKS["store"] = check_store_options


__all__ = ["CONVERT_RECORD", "MANIFEST", "MeshStore", "RESERVED", "SAMPLE_META", "StoreLock",
           "StoreSamples", "StoreWriter", "array_file", "array_problem", "clear_store",
           "identity_digest", "inside", "load_store", "open_sample", "read_sample_meta",
           "sample_digest", "sample_folder", "store_files", "write_manifest", "write_sample"]
