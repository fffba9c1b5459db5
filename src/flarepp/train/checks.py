"""The run config's checks that belong to the trainer's floor and above: the task's own
options (:func:`flarepp.tasks.check_task_config`) and the optimiser's weight-decay rule."""

from __future__ import annotations

from flarepp.storage.config import RunConfig
from flarepp.tasks import check_task_config
from flarepp.train.optim import WEIGHT_DECAY_GROUPS


def check_run_config(config: RunConfig) -> RunConfig:
    """``config``, after the checks :class:`RunConfig` cannot make on its own floor; raises a
    ``ValueError`` naming the key."""
    WEIGHT_DECAY_GROUPS.entry(config.weight_decay_groups)
    check_task_config(config)
    return config


__all__ = ["check_run_config"]
