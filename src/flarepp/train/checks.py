"""The run config's checks that belong to the trainer's floor and above: the task's own
options (:func:`flarepp.tasks.check_task_config`) and the optimiser's weight-decay rule."""

from __future__ import annotations

from flarepp.storage import config as stored_config
from flarepp.storage.config import RunConfig
from flarepp.tasks import check_task_config
from flarepp.train.optim import WEIGHT_DECAY_GROUPS


def check_run_config(config: RunConfig) -> RunConfig:
    """``config``, after the checks :class:`RunConfig` cannot make on its own floor; raises a
    ``ValueError`` naming the key."""
    WEIGHT_DECAY_GROUPS.entry(config.weight_decay_groups)
    check_task_config(config)
    return config


def apply_overrides(config: RunConfig, overrides: list[str]) -> RunConfig:
    """``["model.latents=32", "epochs=3"]`` -> a new config, checked completely: by
    :func:`flarepp.storage.config.apply_overrides` on its floor, then by
    :func:`check_run_config`. An error names the key (and the ``--set`` keys given)."""
    config = stored_config.apply_overrides(config, overrides)
    try:
        return check_run_config(config)
    except ValueError as err:
        keys = ", ".join(item.split("=", 1)[0] for item in overrides)
        raise ValueError(f"{err} (with --set {keys})" if overrides else str(err)) from None


__all__ = ["apply_overrides", "check_run_config"]
