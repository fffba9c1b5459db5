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


def check_counts(what: str, n_train: int, n_test: int, seed: int) -> None:
    """Refuse a train or test count below one or a negative seed, in one ``ValueError``
    naming the generator ``what`` and the three values."""
    if n_train < 1 or n_test < 1 or seed < 0:
        raise ValueError(f"{what} needs train, test >= 1 and seed >= 0, got train={n_train}, "
                         f"test={n_test}, seed={seed}")


def refuse_existing(paths: list[Path], overwrite: bool) -> None:
    """Raise ``FileExistsError`` naming the files, unless ``overwrite`` allows replacing them."""
    existing = [str(p) for p in paths if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"refusing to overwrite existing {', '.join(existing)} "
                              "(pass overwrite=True / --overwrite to replace)")


def check_disk_room(out: Path, samples: int, sample_bytes: int, what: str) -> None:
    """Refuse ``samples`` files of at least ``sample_bytes`` each that cannot fit the free
    space at ``out`` (the files ``out`` holds already count as room: they are kept or
    replaced), in one sentence (``OSError``), before any job list of that length is made:
    a count of 10^12 was a list that grew until the kernel killed the process."""
    import shutil
    out = Path(out)
    existing = out
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    held = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) if out.is_dir() else 0
    need = samples * sample_bytes
    if need > free + held:
        raise OSError(f"{what}: {samples} samples need at least {need / 2**30:.3g} GiB on disk "
                      f"and {str(existing)!r} has {free / 2**30:.3g} GiB free; choose fewer "
                      "--train/--test samples (or a smaller --resolution)")
