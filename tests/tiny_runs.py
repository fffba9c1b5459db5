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


STORE_TINY = ["--set", "epochs=1", "--set", "model.dim=8", "--set", "model.blocks=1",
              "--set", "model.latents=4", "--set", "model.heads=2", "--quiet"]


def tiny_store_run(root: Path, preset: str = "store-conditioned-tiny", *overrides: str
                   ) -> tuple[Path, Path, Path]:
    """Elasticity VTU cases as a solver writes them (``load`` as field data, 6 train and 2
    test), their store (``flarepp data convert``, ``load`` a condition) and a ``preset``
    run on it, one epoch of a width-8 model: ``(cases, store, run)``."""
    from flarepp.cli import main
    from flarepp.data.generators.elasticity import make_elasticity_mesh
    cases, store, run = root / "cases", root / "store", root / "run"
    make_elasticity_mesh(cases, n_train=6, n_test=2, progress=False)
    assert main(["data", "convert", str(cases), "--out", str(store), "--targets", "von_mises",
                 "--conditions", "load", "--test-pattern", "test/*", "--quiet"]) == 0
    assert main(["train", preset, "--data", str(store), "--out", str(run), *STORE_TINY,
                 *overrides]) == 0
    return cases, store, run


def tiny_surface_run(root: Path) -> tuple[Path, Path]:
    """Generated surface-flow bodies (2 train, 1 test, ~800 cells each) and a surface-task
    run on them (DrivAerML's inputs: cell centres and normals; outputs pressure and wall
    shear), one epoch of a width-8 model: ``(data, run)``."""
    from flarepp.data.generators import make_surface_flow
    from flarepp.train import RunConfig, Trainer, validate
    data = root / "surfaces"
    make_surface_flow(data, n_train=2, n_test=1, resolution=800, seed=3, progress=False)
    config = validate(RunConfig(
        name="surface-tiny", task="surface", dataset="drivaerml", data_root=str(data),
        dataset_options={"split_file": "split.json", "cells_per_step": 256},
        model={"mixer": "flarepp", "dim": 8, "heads": 2, "blocks": 1, "latents": 4},
        epochs=1, batch_size=1, lr=3e-3, device="cpu"))
    Trainer(config, root / "surface-run", progress=False).fit()
    return data, root / "surface-run"
