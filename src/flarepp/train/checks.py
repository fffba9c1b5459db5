"""The run config's one check, :func:`validate`, and the one ``--set``, :func:`apply_overrides`.

A :class:`~flarepp.storage.config.RunConfig` holds data and its migration only; whether it
makes a run is decided here, once, at every entry: ``flarepp train`` (a preset, ``--config``,
``--set``), a sweep's points, ``flarepp eval`` (the stored config it rebuilds the task from),
the presets, and :class:`~flarepp.train.Trainer` itself (the Python API). Every field's type,
every range, every ``model`` key against the architecture's (and mixer's) config class,
every ``dataset_options`` key against the dataset loader's options (and the loader's own
checks of their values, :data:`flarepp.data.OPTION_CHECKS`), the task's own options
(:func:`flarepp.tasks.check_task_config`) and the optimiser's weight-decay rule: each failure
is a ``ValueError`` naming the key, raised before any data is read or any model is built.
After it the config is trusted (torchtitan validates its job config once, at the entry).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any

from flarepp.data import DATASETS, OPTION_CHECKS
from flarepp.device import PRECISIONS
from flarepp.mixers import MIXERS
from flarepp.models import MODELS
from flarepp.inference.execution import STREAM_ABOVE
from flarepp.storage.config import (ATTN_SCALE_WORDS, EVAL_WEIGHTS, FINAL_EVAL_TRAIN,
                                    VERSION_KEY, RunConfig, field_default, model_config_class)
from flarepp.tasks import check_task_config
from flarepp.train.optim import WEIGHT_DECAY_GROUPS
from flarepp.validate import check_types, require_positive, type_hints
from flarepp.values import parse_value, split_assignment

SECTIONS = ("model", "dataset_options", "model.mixer_options")
"""The nested sections ``--set`` reaches (``model.latents=32``)."""


def validate(config: RunConfig) -> RunConfig:
    """``config`` if it makes a run; else a ``ValueError`` naming the key (module docstring)."""
    check_types(config, "run config")
    _check_ranges(config)
    _check_model(config)
    _check_dataset(config)
    WEIGHT_DECAY_GROUPS.entry(config.weight_decay_groups)
    check_task_config(config)
    return config


def _check_ranges(c: RunConfig) -> None:
    if c.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, "
                         f"got {c.precision!r}")
    require_positive(c, ("epochs", "batch_size", "checkpoint_every", "eval_every"))
    if not 0.0 <= c.val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1) (the share of the training "
                         f"split held out for validation), got {c.val_fraction}")
    if c.momentum_cycle is not None and not 0.0 <= c.momentum_cycle[0] <= c.momentum_cycle[1] < 1:
        raise ValueError(f"momentum_cycle must be (base, max) with 0 <= base <= max "
                         f"< 1, got {tuple(c.momentum_cycle)}")
    if isinstance(c.attn_scale, str) and c.attn_scale not in ATTN_SCALE_WORDS:
        raise ValueError(f"attn_scale must be a positive number or one of "
                         f"{', '.join(ATTN_SCALE_WORDS)}, got {c.attn_scale!r}")
    if not isinstance(c.attn_scale, str) and not c.attn_scale > 0:
        raise ValueError(f"attn_scale must be positive, got {c.attn_scale}")
    if c.eval_weights not in EVAL_WEIGHTS:
        raise ValueError(f"eval_weights must be one of {', '.join(EVAL_WEIGHTS)}, got "
                         f"{c.eval_weights!r}")
    if c.latent_schedule is not None:
        last = c.schedule().milestones[-1][0]  # parses, or raises naming the problem
        if last >= c.epochs:
            raise ValueError(f"latent_schedule {c.latent_schedule!r}: the growth at epoch "
                             f"{last} never happens in a run of epochs={c.epochs} (growth "
                             f"epochs count from 0 and must be below {c.epochs})")
    if c.loader_workers < -1:
        raise ValueError(f"loader_workers must be -1 (automatic) or a count >= 0, got "
                         f"{c.loader_workers}")
    if c.keep_checkpoints is not None and c.keep_checkpoints < 1:
        raise ValueError(f"keep_checkpoints must be at least 1 (the checkpoint to resume "
                         f"from), or None to keep every one; got {c.keep_checkpoints}")
    if c.memory_budget_gib is not None and not c.memory_budget_gib > 0:
        raise ValueError(f"memory_budget_gib (--memory-budget) must be a positive number of "
                         f"GiB, got {c.memory_budget_gib}")
    if c.eval_chunk_size is not None and c.eval_chunk_size < 1:
        raise ValueError(f"eval_chunk_size must be a count of points >= 1 (or None: a "
                         f"mesh whole up to {STREAM_ABOVE} points, streamed above), got "
                         f"{c.eval_chunk_size}")
    train_set = c.final_eval_train
    if (train_set not in FINAL_EVAL_TRAIN if isinstance(train_set, str)
            else isinstance(train_set, bool) or train_set < 1):
        raise ValueError(f"final_eval_train must be one of {', '.join(FINAL_EVAL_TRAIN)} or a "
                         f"count of training samples >= 1, got {train_set!r}")


def _check_model(c: RunConfig) -> None:
    """Every ``model`` key a field of the architecture's (and mixer's) config class, with a
    value of that field's type."""
    model = dict(c.model)
    arch = model.pop("arch", "surrogate")
    MODELS.entry(arch)
    cls = model_config_class(arch)
    known = {f.name for f in dataclasses.fields(cls)} - {"in_dim", "out_dim"}
    unknown = sorted(set(model) - known)
    if unknown:
        raise ValueError(f"model key(s) {unknown} unknown to architecture {arch!r}; "
                         f"its keys: arch, {', '.join(sorted(known))} (in_dim and out_dim "
                         "come from the data)")
    check_types(model, f"model ({arch})", hints=type_hints(cls))
    if not isinstance(c.attn_scale, str) and "attn_scale" not in known:
        raise ValueError(f"attn_scale={c.attn_scale} given, but architecture {arch!r} "
                         "has no SDPA scale option")
    mixer = model.get("mixer", field_default(cls, "mixer"))
    if mixer is None or "mixer" not in known:
        return
    mixer_cls = MIXERS.get(mixer).config_cls
    options = dict(model.get("mixer_options") or {})
    allowed = ({f.name for f in dataclasses.fields(mixer_cls)}
               - {"dim", "heads", "latents", "norm", "attn_scale"})
    bad = sorted(set(options) - allowed)
    if bad:
        raise ValueError(f"model.mixer_options key(s) {bad} unknown to mixer {mixer!r}; its "
                         f"options: {', '.join(sorted(allowed)) or '(none)'}")
    check_types(options, f"model.mixer_options ({mixer})", hints=type_hints(mixer_cls))


def _check_dataset(c: RunConfig) -> None:
    """The dataset registered, ``dataset_options`` among its loader's keyword options, of
    their types, and what the loader's own check (:data:`flarepp.data.OPTION_CHECKS`) says
    of their values."""
    loader = DATASETS.get(c.dataset)
    params = {name for name, p in inspect.signature(loader).parameters.items()
              if name != "root" and p.kind is inspect.Parameter.KEYWORD_ONLY}
    unknown = sorted(set(c.dataset_options) - params)
    if unknown:
        raise ValueError(f"dataset_options key(s) {unknown} unknown to dataset "
                         f"{c.dataset!r}; its options: {', '.join(sorted(params)) or '(none)'}")
    hints = type_hints(getattr(loader, "__wrapped__", loader))
    check_types(c.dataset_options, f"dataset_options ({c.dataset})", hints=hints)
    if c.dataset in OPTION_CHECKS:
        OPTION_CHECKS[c.dataset](**c.dataset_options)


def dataset_takes(config: RunConfig, option: str) -> bool:
    """Whether the run's dataset loader has the keyword option ``option``."""
    return option in inspect.signature(DATASETS.get(config.dataset)).parameters


def apply_overrides(config: RunConfig, overrides: list[str]) -> RunConfig:
    """``["model.latents=32", "epochs=3"]`` -> a new config, :func:`validate`-d. Each value
    is read by :func:`flarepp.values.parse_value`. An unknown key, a value of the wrong type
    or an option the dataset or model does not take raises a ``ValueError`` naming the key
    and the known ones (and the ``--set`` keys given); nothing is loaded."""
    d = copy.deepcopy(config.to_dict())
    for item in overrides:
        key, text = split_assignment(item, "--set")
        _assign(d, key.split("."), parse_value(text))
    try:
        return validate(RunConfig.from_dict(d))
    except ValueError as err:
        keys = ", ".join(item.split("=", 1)[0] for item in overrides)
        raise ValueError(f"{err} (with --set {keys})" if overrides else str(err)) from None


def _assign(d: dict[str, Any], parts: list[str], value: Any) -> None:
    """``d[parts[0]][parts[1]]... = value``, creating a :data:`SECTIONS` section left out."""
    key = ".".join(parts)
    if len(parts) == 1 and (parts[0] not in d or parts[0] == VERSION_KEY):
        raise ValueError(f"--set {key}: unknown key; known keys: {', '.join(sorted(d))} "
                         f"and the sections {', '.join(SECTIONS)} (e.g. model.latents)")
    target = d
    for depth, part in enumerate(parts[:-1]):
        if part not in target and ".".join(parts[:depth + 1]) in SECTIONS:
            target[part] = {}
        if not isinstance(target.get(part), dict):
            raise ValueError(f"--set {key}: {'.'.join(parts[:depth + 1])!r} is not a "
                             f"section of the config (sections: {', '.join(SECTIONS)})")
        target = target[part]
    target[parts[-1]] = value


__all__ = ["SECTIONS", "apply_overrides", "dataset_takes", "validate"]
