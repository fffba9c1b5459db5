"""Study directories whose runs are written here, not trained: every report plug-in's input
in milliseconds.

:func:`fake_studies` makes one study of each kind the commands start (sweeps over settings,
mixers, seeds and draws; depth and precision; epochs; a latent schedule; rollouts; Table 1;
Table 12; Figure 5's costs) and writes each point's run directory as the trainer would leave
it (``config.json``, ``metrics.json``, ``log.jsonl``, and where a plug-in reads them
``cost.json``, ``surface_errors.json``, ``test_rollout.npz``), with seeded values, some runs
failed, pending or not fitted. Reports of these directories are compared before and after a
change to the reports (they must not move) and read back from ``results.csv``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from flarepp.experiments.engine import FAILED_NAME, Point, Study, create_study, run_dir
from flarepp.experiments.studies import pareto_study, parse_axes, sweep_study
from flarepp.train import get_preset
from flarepp.train.checks import apply_overrides


def _metrics(rng: np.random.Generator, headline: str, config, *, val: bool, both: bool,
             lower: bool = True) -> dict:
    test = float(rng.uniform(0.05, 0.3)) if lower else float(rng.uniform(0.4, 0.9))
    train = test * float(rng.uniform(0.5, 1.1))
    out = {f"test_{headline}": test, f"train_{headline}": train,
           f"train_constant_{headline}": 0.25, "epochs": config.epochs,
           "params": int(rng.integers(1000, 5000)), "seconds": float(rng.uniform(1, 50)),
           "device": "cpu", "eval_weights": "raw" if both else "ema"}
    if both:
        out.update({f"test_{headline}_raw": test, f"test_{headline}_ema": test * 1.01})
    if val:
        out.update({f"val_{headline}": test * 1.02, f"val_{headline}_raw": test * 1.02,
                    f"val_{headline}_ema": test * 1.03})
    return out


def write_run(out_dir: Path, point: Point, metrics: dict | None, rng: np.random.Generator, *,
              failed: str | None = None, steps_per_epoch: int = 3) -> None:
    """A point's run directory as a finished (``metrics``), failed or pending run leaves it,
    with a ``log.jsonl`` of one record per epoch."""
    from flarepp.tasks import TASKS
    directory = run_dir(out_dir, point)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(point.config.to_dict()))
    headline = TASKS.get(point.config.task).headline
    records = []
    for epoch in range(1, point.config.epochs + 1):
        error = float(0.5 / epoch + rng.uniform(0, 0.02))
        records.append({"epoch": epoch, "seconds": float(rng.uniform(1, 3)),
                        f"test_{headline}": error,
                        "step_losses": [float(error + rng.uniform(0, 0.1))
                                        for _ in range(steps_per_epoch)]})
    (directory / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if failed:
        (directory / FAILED_NAME).write_text(json.dumps({"error": failed,
                                                         "type": "FloatingPointError"}))
    elif metrics is not None:
        (directory / "metrics.json").write_text(json.dumps(metrics))


def _fill(out_dir: Path, study: Study, seed: int, *, val: bool = False, both: bool = True,
          failed: int | None = None, pending: int | None = None, unfit: int | None = None,
          lower: bool = True, extra=None) -> Study:
    from flarepp.tasks import TASKS
    study = create_study(out_dir, study)
    rng = np.random.default_rng(seed)
    for i, point in enumerate(study.points):
        headline = TASKS.get(point.config.task).headline
        metrics = _metrics(rng, headline, point.config, val=val, both=both, lower=lower)
        if i == unfit:
            metrics[f"train_{headline}"] = 0.9
        write_run(out_dir, point, None if i == pending else metrics, rng,
                  failed="loss is nan at step 3" if i == failed else None)
        if extra is not None and i != pending:
            extra(run_dir(out_dir, point), point, rng)
    return study


def _sweep(preset: str, grid: list[str], sets: list[str], data: str = "d.npz") -> Study:
    return sweep_study(preset, parse_axes(grid), sets=sets, data=data)


TINY = ["model.dim=8", "model.heads=2", "model.latents=4", "batch_size=4", "device=cpu"]
MIXERS = "model.mixer=flare,flarepp,flarepp-simple"


def _rollout_steps(directory: Path, point: Point, rng: np.random.Generator) -> None:
    steps = np.cumsum(rng.uniform(0.01, 0.05, size=(4, 6)), axis=1)    # [samples, steps]
    np.savez(directory / "test_rollout.npz", rel_l2=steps)


def _surface_cases(directory: Path, point: Point, rng: np.random.Generator) -> None:
    cases = [{"nmse_channels": {c: float(rng.uniform(0.1, 1)) for c in
                                ("p_s", "tau_x", "tau_y", "tau_z")}} for _ in range(2)]
    (directory / "surface_errors.json").write_text(json.dumps({"cases": cases}))
    if point.labels["seed"] == 0:   # the others are costed from their training logs
        (directory / "cost.json").write_text(json.dumps(
            {"epoch_seconds": float(rng.uniform(1, 2)), "epoch_cpu_seconds": 1.5,
             "timing_epochs": 2, "device": "cpu", "threads": 1}))


def fake_studies(root: Path, names: tuple[str, ...] | None = None) -> dict[str, Path]:
    """One study of each kind under ``root`` (module docstring), by name (those of
    ``names``; all of them for None)."""
    root = Path(root)
    settings = [*TINY, "epochs=4", "val_fraction=0.2"]
    studies = {
        "settings": lambda: (_sweep("npz", ["lr=1e-3,3e-3", MIXERS, "seed=0,1",
                                            "data_root=A.npz,B.npz"], settings),
                             dict(val=True, failed=5, unfit=7)),
        "pending": lambda: (_sweep("npz", ["lr=1e-3,3e-3", "model.mixer=flare,flarepp",
                                           "seed=0,1"], settings), dict(val=True, pending=2)),
        "depth": lambda: (_sweep("npz", ["model.mixer=flare,flarepp", "model.blocks=1,2",
                                         "model.latents=4,8", "precision=fp32,bf16",
                                         "seed=0,1"],
                                 ["model.dim=8", "model.heads=2", "batch_size=4",
                                  "device=cpu", "epochs=3"]), dict(both=False)),
        "length": lambda: (_sweep("npz", ["epochs=2,4", "model.mixer=flare,flarepp,transolver",
                                          "seed=0,1"], TINY), dict(failed=3)),
        "schedule": lambda: (_sweep("darcy-tiny", ["latent_schedule='4','8','4,8@2'",
                                                   "seed=0,1"],
                                    [*TINY, "epochs=4", "model.mixer=flare"]), {}),
        "rollout": lambda: (_sweep("rollout-tiny", ["preset=rollout-tiny,rollout-tiny-adaln",
                                                    "seed=0,1"], ["epochs=2", "device=cpu"]),
                            dict(extra=_rollout_steps)),
        "compare": lambda: (_table1(), {}),
        "lra": lambda: (_lra(), dict(lower=False)),
        "pareto": lambda: (pareto_study(get_preset("drivaerml-tiny", ["epochs=3"]),
                                        ["flare", "flarepp", "abupt"], [1, 2], [8, 16], [0, 1],
                                        64, data="cars"), dict(extra=_surface_cases)),
    }
    out = {}
    for i, (name, make) in enumerate(studies.items()):
        if names is not None and name not in names:
            continue
        study, options = make()
        out[name] = root / name
        _fill(out[name], study, i, **options)
    return out


def _table1() -> Study:
    points = []
    for dataset in ("darcy", "elasticity"):
        base = get_preset(f"{dataset}-tiny", ["epochs=2", "device=cpu"])
        for model in ("flare", "flarepp", "transolver"):
            for seed in (0, 1):
                config = apply_overrides(base, [f"model.mixer={model}", f"seed={seed}",
                                                f"data_root={dataset}"])
                points.append(Point(f"{dataset}/{model}/seed{seed}", config,
                                    {"model": model, "dataset": dataset, "seed": seed}))
    return Study("compare", points, ["runs", "table1"],
                 info={"n_points": {"darcy": 484, "elasticity": 972}})


def _lra() -> Study:
    points, facts = [], {}
    for task in ("listops", "image"):
        base = get_preset(f"lra-{task}-tiny", ["epochs=2", "device=cpu"])
        facts[task] = {"data_root": task, "chance": 0.1, "majority": 0.2,
                       "train_samples": 64, "test_samples": 16}
        for seed in (0, 1):
            for mixer in ("flare", "flarepp"):
                config = apply_overrides(base, [f"model.mixer={mixer}", f"seed={seed}"])
                points.append(Point(f"{task}/{mixer}/seed{seed}", config,
                                    {"task": task, "mixer": mixer, "seed": seed}))
    return Study("lra", points, ["runs", "lra"], info={"tasks": facts})
