"""Atomic file writes shared by the generators: every file appears complete or not at all."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import BinaryIO, Callable


def write_atomically(files: dict[Path, Callable[[BinaryIO], None]]) -> list[Path]:
    """Write each ``path`` with ``writer(fileobj)`` into a temporary file beside it, then rename.

    All temporaries are written and flushed before the first rename, so a failure while writing
    (disk full, an exception in a writer) leaves no new or half-written file behind; the
    renames themselves are atomic per file (``os.replace`` on one file system).
    """
    staged: list[tuple[Path, Path]] = []
    try:
        for path, writer in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            # O_EXCL: never clobber another writer's temporary; mode 0o666 lets the umask decide
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            staged.append((tmp, path))
            with os.fdopen(fd, "wb") as handle:
                writer(handle)
                handle.flush()
                os.fsync(handle.fileno())
        for tmp, path in staged:
            os.replace(tmp, path)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    return list(files)


def refuse_existing(paths: list[Path], overwrite: bool) -> None:
    """Raise ``FileExistsError`` naming the files, unless ``overwrite`` allows replacing them."""
    existing = [str(p) for p in paths if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"refusing to overwrite existing {', '.join(existing)} "
                              "(pass overwrite=True / --overwrite to replace)")
