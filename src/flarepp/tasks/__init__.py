"""Tasks: what the trainer learns (data, model, loss, metric, plots), one class per kind.

``build_task(config, data_root)`` builds the task named by ``config.task``; see
:mod:`flarepp.tasks.base` for the interface and its loss and evaluation conventions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flarepp.storage.rundir import RunDir
from flarepp.tasks.base import Task, gather_records, pad_stack
from flarepp.tasks.registry import TASKS
from flarepp.tasks import fields  # noqa: F401  (registers "fields")
from flarepp.tasks import language  # noqa: F401  (registers "lm")
from flarepp.tasks import rollout  # noqa: F401  (registers "rollout")
from flarepp.tasks import sequence  # noqa: F401  (registers "sequence")
from flarepp.tasks import surface  # noqa: F401  (registers "surface")


def check_task_config(config: Any) -> None:
    """Raise a ``ValueError`` unless ``config.task`` is registered and takes ``config`` (its
    own checks of the options it reads: loss, input norms, dataset...)."""
    task_cls = TASKS.get(config.task)
    if getattr(config, "val_fraction", 0.0) > 0 and not task_cls.carves_validation:
        raise ValueError(f"val_fraction={config.val_fraction}: task {config.task!r} does not "
                         "carve a validation split from its training data (task fields does)")
    task_cls.check_config(config)


def build_task(config: Any, data_root: str | Path, **options: Any) -> Task:
    """The registered task ``config.task`` on the data at ``data_root``."""
    check_task_config(config)
    return TASKS.get(config.task)(config, data_root, **options)


def plot_run_dir(run_dir: str | Path, cases: int = 3) -> list[Path]:
    """The figures of any run directory, drawn by its task (``config.json``'s ``task``)."""
    run = RunDir(run_dir)
    return TASKS.get(run.read_config().task).plot_run(run.path, cases)


__all__ = ["TASKS", "Task", "build_task", "check_task_config", "gather_records", "pad_stack", "plot_run_dir"]
