"""Atomic, durable file writes: every file flarepp writes appears complete or not at all.

A file is written to a temporary file beside its target (same directory, hence the same file
system), the temporary is flushed and ``fsync``-ed, renamed over the target with
``os.replace`` (atomic on POSIX), and the directory is ``fsync``-ed so that the rename itself
survives a power loss. A process killed at any point leaves either the old file or the new
one, plus at worst a temporary named ``.<target name>.<pid>.<random>.tmp``, which
:func:`is_temporary` recognises and ``flarepp.storage.checkpoint.remove_stale_temporaries``
removes.

Permissions: the temporary is created with mode ``0o666`` filtered by the process umask,
exactly as ``open(path, "w")`` creates a new file (``tempfile.mkstemp`` would give ``0600``);
when the target already exists its mode is kept, as an in-place rewrite would keep it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any, Callable, Mapping

Writer = Callable[[Path], Any]
"""``write(tmp_path)``: writes the complete content to ``tmp_path`` (and closes it)."""

_TEMPORARY = re.compile(r"\..+\.[0-9]+\.[0-9a-f]+\.tmp")
# The pattern of tempfile.mkstemp(prefix=".<name>.", suffix=".tmp"), used by flarepp before
# this module: temporaries a killed older version left behind are still recognised.
_LEGACY_TEMPORARY = re.compile(r"\..+\.[A-Za-z0-9_]{8}\.tmp")


def is_temporary(name: str) -> bool:
    """Whether a file name is that of an atomic writer's temporary (``.<name>.<tag>.tmp``)."""
    return bool(_TEMPORARY.fullmatch(name) or _LEGACY_TEMPORARY.fullmatch(name))


def _create_temporary(path: Path) -> Path:
    """An empty new file beside ``path``; ``O_EXCL`` never takes over another's temporary."""
    while True:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        try:
            if path.exists():  # keep the mode of the file being replaced (os.fchmod: POSIX only)
                os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        finally:
            os.close(fd)
        return tmp


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(directory: Path) -> None:
    """Make renames and creations in ``directory`` durable (POSIX; a no-op where directories
    cannot be opened, e.g. on Windows, or where the file system refuses to sync one)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as err:
        # Some file systems (certain network and FUSE mounts) do not sync directories;
        # the rename is still atomic there, only its durability is the file system's.
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _named(err: OSError, path: Path) -> OSError:
    """``err`` of a write to ``path`` as an ``OSError`` naming ``path``; numpy's short write
    (``"8 requested and 0 written"``, no errno) says what stops a write short."""
    if err.errno is not None:
        return OSError(err.errno, err.strerror, str(path))
    text = str(err)
    if "requested and" in text:
        text = (f"the write stopped short ({text}): the file system or the quota is full, "
                "or a file-size limit was reached")
    return OSError(errno.EIO, text, str(path))


def atomic_write_all(files: Mapping[str | Path, Writer]) -> list[Path]:
    """Write several files all-or-nothing up to the renames; returns their paths.

    Every ``write(tmp_path)`` runs and every temporary is synced before the first rename, so
    a failure while writing (disk full, an exception in a writer, Ctrl-C) leaves no new or
    half-written file and no temporary behind. Each rename is atomic on its own.
    """
    staged: list[tuple[Path, Path]] = []
    try:
        for target, write in files.items():
            path = Path(target)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = _create_temporary(path)
            staged.append((tmp, path))
            try:
                write(tmp)
                _fsync_file(tmp)
            except OSError as err:
                if err.filename is not None:
                    raise
                # a failed write() (ENOSPC, EFBIG) names no file: name the target
                raise _named(err, path) from err
        for tmp, path in staged:
            os.replace(tmp, path)
        for directory in {path.parent for _, path in staged}:
            fsync_directory(directory)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    return [path for _, path in staged]


def atomic_write(path: str | Path, write: Writer) -> Path:
    """Write ``path`` atomically through ``write(tmp_path)``; returns ``path``."""
    return atomic_write_all({path: write})[0]


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding=encoding))


def atomic_write_json(path: str | Path, obj: Any, *, indent: int | None = 2) -> Path:
    """``obj`` as JSON (UTF-8, a final newline); unserialisable values raise before any
    file is touched."""
    return atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")


class RowArray:
    """An array written into an ``.npz`` one row (index along its first axis) at a time:
    ``shape``, ``dtype`` and ``row(i)``, the ``i``-th row ``[*shape[1:]]``; what
    :func:`atomic_write_npz` writes of a split's padded meshes without holding them."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, row: Callable[[int], Any]) -> None:
        self.shape, self.dtype, self.row = tuple(int(n) for n in shape), dtype, row


def atomic_write_npz(path: str | Path, arrays: Mapping[str, Any], *,
                     compressed: bool = False) -> Path:
    """``arrays`` as one ``.npz`` file (``numpy.savez``, or ``savez_compressed``: the same
    archive members), written atomically: an interrupted write leaves the previous file,
    never half of a new one. A :class:`RowArray` value is written row by row, so the file
    may hold arrays larger than memory."""
    import zipfile
    import numpy as np
    from numpy.lib import format as npy

    def member(archive: zipfile.ZipFile, key: str, value: Any) -> None:
        with archive.open(f"{key}.npy", "w", force_zip64=True) as f:
            if not isinstance(value, RowArray):
                npy.write_array(f, np.asanyarray(value))
                return
            dtype = np.dtype(value.dtype)
            npy.write_array_header_1_0(f, {"descr": npy.dtype_to_descr(dtype),
                                           "fortran_order": False, "shape": value.shape})
            for i in range(value.shape[0]):
                row = np.ascontiguousarray(value.row(i), dtype)
                if row.shape != value.shape[1:]:
                    raise ValueError(f"{key}: row {i} has shape {list(row.shape)}, the array "
                                     f"{list(value.shape[1:])} per row")
                f.write(row.tobytes())

    def write(tmp: Path) -> None:
        how = zipfile.ZIP_DEFLATED if compressed else zipfile.ZIP_STORED
        with zipfile.ZipFile(tmp, "w", compression=how, allowZip64=True) as archive:
            for key, value in arrays.items():
                member(archive, key, value)
    return atomic_write(path, write)


def save_npy(handle: Any, array: Any) -> None:
    """``array`` as ``.npy`` into the open binary file ``handle``, through its ``write``.
    (``numpy.save`` to a file object writes the data with ``tofile``, through a C stdio
    buffer whose failed flush it does not report: a full disk or a file-size limit then left
    a truncated array and no error. Python's writes raise ``OSError`` with its errno.)"""
    import types
    import numpy as np
    np.save(types.SimpleNamespace(write=handle.write), array, allow_pickle=False)


def append_line(path: str | Path, line: str) -> None:
    """Append ``line`` and a newline to ``path`` (a log), flushed to the file system; a
    failed write (a full disk) raises an ``OSError`` naming ``path``."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError as err:
        if err.filename is not None or err.errno is None:
            raise
        raise OSError(err.errno, err.strerror, str(path)) from err


def require_room(path: str | Path, nbytes: int, what: str = "the file") -> None:
    """Raise an ``OSError`` naming ``path`` before a write of up to ``nbytes`` that cannot
    fit: more than the free space of ``path``'s file system (``shutil.disk_usage``), or
    than the process's file-size limit (``ulimit -f``, ``RLIMIT_FSIZE``). For writers
    that cannot fail cleanly on a full disk (a C++ library's), called before them; another
    writer can still take the space in between, which their own check then meets."""
    import shutil
    path = Path(path)
    folder = path.parent
    while not folder.exists() and folder != folder.parent:   # the folder may be made later
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    limit = _file_size_limit()
    if limit is not None and nbytes > limit:
        raise OSError(errno.EFBIG, f"{what} needs up to {nbytes:,} bytes, more than the "
                                   f"file-size limit (ulimit -f) of {limit:,} bytes; raise the "
                                   "limit", str(path))
    if nbytes > free:
        raise OSError(errno.ENOSPC, f"{what} needs up to {nbytes:,} bytes and its file system "
                                    f"has {free:,} free; free space there or write elsewhere",
                      str(path))


def _file_size_limit() -> int | None:
    try:
        import resource
    except ImportError:          # pragma: no cover (Windows has no file-size limit)
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


class UnreadableFile(ValueError):
    """A file flarepp wrote earlier (a run's ``config.json``, ``log.jsonl``, ``metrics.json``)
    that no longer decodes: the message names the file and the place."""


def read_json(path: str | Path) -> Any:
    """The JSON value in ``path``; :class:`UnreadableFile` naming the file, line and column
    when it is not JSON (a hand edit, a copy cut short, another file under this name)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UnreadableFile(f"{path}: not valid JSON at line {err.lineno}, column "
                             f"{err.colno} ({err.msg})") from None
    except UnicodeDecodeError as err:
        raise UnreadableFile(f"{path}: not UTF-8 text (byte {err.start}), so not JSON") \
            from None
    except RecursionError:
        raise UnreadableFile(f"{path}: JSON nested too deeply to be read (arrays or objects "
                             "within each other thousands of levels deep)") from None


def read_json_lines(path: str | Path) -> list[Any]:
    """One JSON value per non-empty line of ``path`` (a ``log.jsonl``); a line that does
    not decode raises :class:`UnreadableFile` naming the file and the line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise UnreadableFile(f"{path}: not UTF-8 text (byte {err.start})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise UnreadableFile(f"{path}: line {number} is not valid JSON ({err.msg}, "
                                 f"column {err.colno})") from None
    return records


class UnsafeName(ValueError):
    """A name read from a file or given by a user that would become a path outside the
    directory it belongs in."""


def check_name(name: Any, *, what: str = "name", flat: bool = False,
               inside: str = "its directory") -> list[str]:
    """The parts of ``name`` when it is a relative path of plain parts separated by ``/``
    (one part with ``flat``: a file name) -- none empty, ``.`` or ``..``, no backslash,
    NUL or control character, not absolute; :class:`UnsafeName` otherwise, one sentence
    naming ``what``, the name and where it belongs (``inside``). The checks of
    :func:`confined` that need no file system, for names checked before their directory is
    known (a spec's array names)."""
    if not isinstance(name, str):
        raise UnsafeName(f"{what} {name!r} is not a string: a name inside {inside} is a "
                         "relative path of plain parts separated by '/'")
    parts = name.split("/")
    bad = (not name or name.startswith("/")
           or any(part in ("", ".", "..") or "\\" in part
                  or any(ord(ch) < 32 or ord(ch) == 127 for ch in part) for part in parts))
    if flat and (bad or len(parts) > 1):
        raise UnsafeName(f"{what} {name!r} is not a plain file name inside {inside} (one "
                         "part: no '/', not empty, '.' or '..', no backslash or control "
                         "character)")
    if bad:
        raise UnsafeName(f"{what} {name!r} is not a relative path inside {inside} "
                         "(parts separated by '/', none empty, '.' or '..', no backslash or "
                         "control character)")
    return parts


def confined(root: str | Path, name: Any, *, what: str = "name", flat: bool = False) -> Path:
    """``root / name`` for a ``name`` that becomes a path (a spec's target name, a store's
    sample or group name, a case name, a study point, a file written beside others), never
    outside ``root``: ``name`` passes :func:`check_name` (``flat``: a single part) and no
    part of it that exists under ``root`` is a symbolic link leading out of ``root``.
    Anything else is :class:`UnsafeName`, one sentence naming ``what`` and the name. Every
    entry point that turns a read name into a path goes through here."""
    parts = check_name(name, what=what, flat=flat, inside=repr(str(root)))
    root = Path(root)
    path = root.joinpath(*parts)
    top = root.resolve()
    probe = root
    for part in parts:  # a link planted under root must not lead the path out of it
        probe = probe / part
        if probe.is_symlink() and not probe.resolve().is_relative_to(top):
            raise UnsafeName(f"{what} {name!r}: {str(probe)!r} is a symbolic link leading "
                             f"out of {str(root)!r}; remove it")
    return path


__all__ = ["RowArray", "UnreadableFile", "UnsafeName", "append_line", "atomic_write",
           "atomic_write_all", "atomic_write_bytes", "atomic_write_json", "atomic_write_npz",
           "atomic_write_text", "check_name", "confined", "fsync_directory", "is_temporary",
           "read_json", "read_json_lines", "require_room", "save_npy"]
