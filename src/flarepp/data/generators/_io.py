"""File writes shared by the generators: every file appears complete or not at all."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Callable

from flarepp.io import atomic_write_all


def write_atomically(files: dict[Path, Callable[[BinaryIO], None]]) -> list[Path]:
    """Write each ``path`` with ``writer(fileobj)`` through :func:`flarepp.io.atomic_write_all`:
    every temporary is written and synced before the first rename, so a failing writer
    leaves no new or half-written file behind."""
    def through_handle(writer: Callable[[BinaryIO], None]) -> Callable[[Path], None]:
        def write(tmp: Path) -> None:
            with open(tmp, "wb") as handle:
                writer(handle)
        return write

    return atomic_write_all({path: through_handle(writer) for path, writer in files.items()})


def refuse_existing(paths: list[Path], overwrite: bool) -> None:
    """Raise ``FileExistsError`` naming the files, unless ``overwrite`` allows replacing them."""
    existing = [str(p) for p in paths if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"refusing to overwrite existing {', '.join(existing)} "
                              "(pass overwrite=True / --overwrite to replace)")
