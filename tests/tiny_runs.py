"""Tiny trained runs for the tests of what comes after training (inference, export,
fine-tuning, bad inputs): darcy-tiny at 9 x 9 on generated data, seconds on a CPU."""

from __future__ import annotations

from pathlib import Path

TINY = ["epochs=2", "batch_size=4", "model.dim=8", "model.heads=2", "model.blocks=1",
        "model.latents=4", "device=cpu",
        "dataset_options={'resolution': 9, 'n_train': 8, 'n_test': 4}"]


def tiny_darcy_run(root: Path, *overrides: str, seed: int = 3) -> tuple[Path, Path]:
    """Darcy data (8 train, 4 test samples of seed ``seed``) and a darcy-tiny run on it
    with :data:`TINY` and ``overrides``: ``(data, run directory)``."""
    from flarepp.data.generators.darcy import make_darcy
    from flarepp.train import get_preset, train
    make_darcy(root / "data", n_train=8, n_test=4, resolution=9, seed=seed, progress=False)
    train(get_preset("darcy-tiny", [*TINY, *overrides]), root / "run",
          data_root=root / "data", progress=False)
    return root / "data", root / "run"
