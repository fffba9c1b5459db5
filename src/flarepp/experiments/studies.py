"""The studies the commands start, as specs for the one engine (:mod:`.engine`).

* :func:`sweep_study` -- ``flarepp sweep``: the Cartesian product of ``--grid`` axes, each
  any ``--set`` key (or ``preset``: a different preset per value); an axis may also be a
  range (:func:`parse_range`), which only an adaptive search (:mod:`.search`) samples;
* :func:`compare_study` -- ``flarepp compare``: Table 1's models x datasets x seeds;
* :func:`lra_study` -- ``flarepp lra compare``: Table 12's LRA tasks x mixers x seeds;
* :func:`pareto_study` -- ``flarepp drivaerml pareto``: Figure 5's depth x latent grid.

Each returns a :class:`~.engine.Study` whose points carry complete run configs and the
labels their reports group by; nothing here trains or reads results.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from flarepp.data import load_dataset
from flarepp.data.generators import how_to_get
from flarepp.experiments.comparison import COMPARISON_MODELS, comparison_model_kwargs
from flarepp.experiments.engine import Point, Study, create_study, open_study
from flarepp.mixers import MIXERS
from flarepp.storage.config import RunConfig
from flarepp.storage.studydir import StudyDir
from flarepp.tasks.sequence import load_sequence_data
from flarepp.train import get_preset
from flarepp.train.checks import apply_overrides
from flarepp.train.lra_benchmarks import LRA_BENCHMARKS
from flarepp.train.presets import lra_run_config
from flarepp.values import Range, parse_axes, parse_range, split_values

# ---------------------------------------------------------------------------------------------
# the grid of a sweep (its syntax, ``--grid KEY=V1,V2`` and ranges, is read by flarepp.values)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", ".", text).strip(".") or "_"


def grid_names(axes: list[tuple[str, list[str]]]) -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    """``(name, ((key, value), ...))`` of every point of the product, first axis slowest;
    the name is ``mixer-flare_seed-0`` (the last part of each key; the whole key where
    two axes share a last part)."""
    short = [k.rsplit(".", 1)[-1] for k, _ in axes]
    labels = [s if short.count(s) == 1 else k.replace(".", "-")
              for s, (k, _) in zip(short, axes)]
    points = []
    for combo in itertools.product(*(values for _, values in axes)):
        name = "_".join(f"{label}-{_slug(v)}" for label, v in zip(labels, combo)) or "base"
        points.append((name, tuple(zip((k for k, _ in axes), combo))))
    if len({n for n, _ in points}) != len(points):
        points = [(f"{i:04d}_{n}", v) for i, (n, v) in enumerate(points)]
    return points


SWEEP_REPORTS = ("runs", "seeds", "depth", "precision", "selection", "paired", "length",
                 "rollout", "growth")
"""The report plug-ins of a sweep; each writes nothing where its grid does not apply."""


def sweep_study(preset: str, axes: list[tuple[str, list[str]]], *,
                sets: list[str] | None = None, data: str | None = None) -> Study:
    """A point per grid point: ``preset`` (or the point's ``preset`` axis value) with
    ``sets``, then ``data`` as its ``data_root``, then the point's axis values (so a
    ``data_root`` axis wins over ``data``). Every config is checked here."""
    if not axes:
        raise ValueError("give --grid KEY=V1,V2 ... (e.g. --grid seed=0,1,2)")
    for key, values in axes:
        if len(values) == 1 and parse_range(key, values[0]) is not None:
            raise ValueError(f"--grid {key}={values[0]} is a range: a grid needs values "
                             "(V1,V2,...); a range is searched with --search optuna")
    points = []
    for name, values in grid_names(axes):
        chosen = dict(values).get("preset", preset)
        base = get_preset(chosen, sets or [])
        if data is not None:
            base = dataclasses.replace(base, data_root=str(data))
        config = apply_overrides(base, [f"{k}={v}" for k, v in values if k != "preset"])
        points.append(Point(name, config, dict(values)))
    same: dict[str, str] = {}
    for point in points:  # values that read alike (seed=0,00; lr=0.001,1e-3): one run twice
        key = json.dumps(point.config.identity(), sort_keys=True, default=str)
        if key in same:
            raise ValueError(f"--grid: points {same[key]} and {point.name} are the same run "
                             "(their values read as the same config); give each value once")
        same[key] = point.name
    return Study("sweep", points, list(SWEEP_REPORTS),
                 info={"preset": preset, "axes": [[k, v] for k, v in axes]})


# ---------------------------------------------------------------------------------------------
# Table 1


def preset_name(dataset: str, scale: str) -> str:
    if scale not in ("tiny", "paper"):
        raise ValueError(f"scale must be 'tiny' or 'paper', got {scale!r}")
    return f"{dataset}-tiny" if scale == "tiny" else dataset


def compare_study(models: list[str], datasets: list[str], *, epochs: int | None = None,
                  seeds: int = 1, scale: str = "tiny", data_root: str | Path | None = None,
                  overrides: list[str] | None = None) -> Study:
    """Table 1: each model on each dataset's preset (``DATASET-tiny`` or the paper's), its
    Table 1 keywords (:mod:`.comparison`), each seed. ``data_root`` holds one directory per
    dataset (default: each preset's ``data_root``); ``epochs`` wins over ``overrides``."""
    for name in models:
        COMPARISON_MODELS.entry(name)  # unknown names fail before any data is read
    if seeds <= 0:
        raise ValueError(f"seeds must be positive, got {seeds}")
    points, n_points = [], {}
    for dataset in datasets:
        base = get_preset(preset_name(dataset, scale), overrides)
        root = Path(data_root) / dataset if data_root is not None else Path(base.data_root)
        if not root.exists():
            raise FileNotFoundError(
                f"data for {dataset!r} not found at {str(root)!r}; "
                f"{how_to_get(base.dataset, str(root))}, or pass --data-root")
        n_points[dataset] = load_dataset(base.dataset, root, **base.dataset_options
                                         ).train.n_points
        settings = {k: base.model[k] for k in ("dim", "heads", "blocks", "latents")}
        for model in models:
            for seed in range(seeds):
                config = dataclasses.replace(
                    base, name=f"{base.name}-{model}", seed=seed, data_root=str(root),
                    model=comparison_model_kwargs(model, dataset, settings),
                    epochs=epochs or base.epochs)
                points.append(Point(f"{dataset}/{model}/seed{seed}", config,
                                    {"model": model, "dataset": dataset, "seed": seed}))
    return Study("compare", points, ["runs", "table1"],
                 info={"n_points": n_points})


# ---------------------------------------------------------------------------------------------
# Table 12


def lra_point_config(task: str, mixer: str, seed: int, size: str, *, steps: int | None = None,
                     split_limits: dict[str, int] | None = None,
                     train_samples: int | None = None, data_root: str | None = None,
                     overrides: list[str] | None = None) -> RunConfig:
    """An LRA run's config: the task table's settings for ``mixer``
    (:func:`flarepp.train.presets.lra_run_config`), then ``overrides``, then ``seed``.

    The steps are counted in batches of the final ``batch_size`` (an overridden one too);
    an ``epochs`` override wins over the steps."""
    options = dict(steps=steps, split_limits=split_limits, train_samples=train_samples,
                   data_root=data_root)
    overrides = [*(overrides or []), f"seed={seed}"]
    probe = apply_overrides(lra_run_config(task, size, mixer, **options), overrides)
    config = lra_run_config(task, size, mixer, batch_size=probe.batch_size, **options)
    return apply_overrides(config, overrides)


def lra_study(tasks: list[str], mixers: list[str], *, seeds: int = 3, size: str = "tiny",
              data_roots: dict[str, str] | None = None, steps: int | None = None,
              split_limits: dict[str, int] | None = None,
              overrides: list[str] | None = None) -> Study:
    """Table 12: tasks x mixers x seeds, seed-major (a complete one-seed table exists
    early). Each task's data is read here once: its training-split size sets the epochs
    of a step budget, and its chance level (1/K) and majority-class share are stated."""
    for task in tasks:
        LRA_BENCHMARKS.entry(task)
    for mixer in mixers:
        MIXERS.entry(mixer)
    if seeds <= 0:
        raise ValueError(f"seeds must be positive, got {seeds}")
    if not tasks or not mixers:
        raise ValueError("give at least one task and one mixer")
    roots = dict(data_roots or {})
    unknown = sorted(set(roots) - set(tasks))
    if unknown:
        raise ValueError(f"--data names task(s) {unknown} that are not compared "
                         f"({', '.join(tasks)})")
    options = dict(steps=steps, split_limits=split_limits, overrides=overrides)
    facts: dict[str, dict[str, Any]] = {}
    for task in tasks:
        nominal = lra_point_config(task, mixers[0], 0, size, data_root=roots.get(task),
                                   **options)
        data = load_sequence_data(nominal, nominal.data_root)
        labels = data.splits["test"].labels
        shares = np.bincount(labels, minlength=data.num_classes) / len(labels)
        facts[task] = {"data_root": nominal.data_root, "chance": 1.0 / data.num_classes,
                       "majority": float(shares.max()),
                       "train_samples": len(data.splits["train"]),
                       "test_samples": len(data.splits["test"])}
    points = []
    for seed in range(seeds):
        for task in tasks:
            for mixer in mixers:
                config = lra_point_config(task, mixer, seed, size,
                                          data_root=facts[task]["data_root"],
                                          train_samples=facts[task]["train_samples"],
                                          **options)
                points.append(Point(f"{task}/{mixer}/seed{seed}", config,
                                    {"task": task, "mixer": mixer, "seed": seed}))
    return Study("lra", points, ["runs", "lra"], info={"tasks": facts})


# ---------------------------------------------------------------------------------------------
# Figure 5

ANCHOR_MIXER = "abupt"


def pareto_study(base: RunConfig, mixers: Sequence[str], blocks: Sequence[int],
                 latents: Sequence[int], seeds: Sequence[int], anchors: int, *,
                 data: str | None = None, timing_epochs: int = 2) -> Study:
    """Each mixer at each depth, each latent budget (AB-UPT: ``anchors`` anchors instead,
    Table 9) and each seed; every point gets a separate timing run (its cost, Sec. D.4)."""
    if base.task != "surface":
        raise ValueError(f"preset {base.name!r} is not a surface-task preset (try "
                         "drivaerml-tiny or drivaerml-b2-m64)")
    if data is not None:
        base = dataclasses.replace(base, data_root=str(data))
    points = []
    for mixer in mixers:
        for b in blocks:
            for m in [None] if mixer == ANCHOR_MIXER else list(latents):
                for seed in seeds:
                    values = [f"model.mixer={mixer}", f"model.blocks={b}", f"seed={seed}"]
                    if m is None:
                        values.append(f"model.mixer_options.anchors={anchors}")
                        budget = f"A-{anchors}"
                    else:
                        values.append(f"model.latents={m}")
                        budget = f"M-{m}"
                    points.append(Point(f"{mixer}_B-{b}_{budget}_seed-{seed}",
                                        apply_overrides(base, values),
                                        {"mixer": mixer, "blocks": b, "seed": seed,
                                         "budget": (f"{anchors} anchors" if m is None
                                                    else f"M={m}")}))
    return Study("pareto", points, ["runs", "cost"], info={"preset": base.name},
                 timing_epochs=timing_epochs)


# ---------------------------------------------------------------------------------------------
# directories of an earlier flarepp


def open_any_study(out_dir: str | Path) -> Study:
    """The study of ``out_dir``: its ``study.json``, or a sweep or Pareto study an earlier
    flarepp stored as ``sweep.json`` / ``pareto.json``, converted once."""
    if not StudyDir(out_dir).has_study():
        legacy = legacy_study(out_dir)
        if legacy is not None:
            return create_study(out_dir, legacy)
    return open_study(out_dir)


def legacy_study(out_dir: str | Path) -> Study | None:
    """The study of a directory an earlier ``flarepp sweep`` (``sweep.json``: base config,
    axes, data) or ``drivaerml pareto`` (``pareto.json``: base, points, data) started, with
    the same point names (its runs are found where they are); None without either."""
    found = StudyDir(out_dir).read_earlier_spec()
    if found is None:
        return None
    kind, stored = found
    base = dataclasses.replace(RunConfig.from_stored(stored["base"]),
                               data_root=stored["data_root"])
    if kind == "sweep":
        axes = [(k, list(v)) for k, v in stored["axes"]]
        points = [Point(n, apply_overrides(base, [f"{k}={v}" for k, v in values]),
                        dict(values)) for n, values in grid_names(axes)]
        return Study("sweep", points, list(SWEEP_REPORTS),
                     info={"preset": base.name, "axes": [[k, v] for k, v in axes]})
    points = []
    for n, values in stored["points"]:
        given = dict(values)
        budget = (f"{given['model.mixer_options.anchors']} anchors"
                  if "model.mixer_options.anchors" in given else f"M={given['model.latents']}")
        points.append(Point(n, apply_overrides(base, [f"{k}={v}" for k, v in values]),
                            {"mixer": given["model.mixer"], "blocks": int(given["model.blocks"]),
                             "seed": int(given["seed"]), "budget": budget}))
    return Study("pareto", points, ["runs", "cost"], info={"preset": base.name},
                 timing_epochs=2)


__all__ = ["SWEEP_REPORTS", "compare_study", "grid_names", "legacy_study", "lra_point_config", "lra_study", "open_any_study",
           "parse_axes", "pareto_study", "preset_name", "split_values", "sweep_study",
           "Range", "parse_range"]
