"""Tasks: what the trainer learns (data, model, loss, metric, plots), one class per kind.

``build_task(config, data_root)`` builds the task named by ``config.task``; see
:mod:`flarepp.tasks.base` for the interface and its loss and evaluation conventions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flarepp.tasks.base import Task, gather_records, pad_stack
from flarepp.tasks.registry import TASKS
from flarepp.tasks import fields  # noqa: F401  (registers "fields")
from flarepp.tasks import language  # noqa: F401  (registers "lm" and dataset "text-files")
from flarepp.tasks import rollout  # noqa: F401  (registers "rollout", dataset "advection-diffusion")
from flarepp.tasks import sequence  # noqa: F401  (registers "sequence" and the LRA datasets)
from flarepp.tasks import surface  # noqa: F401  (registers "surface", dataset "drivaerml")


def build_task(config: Any, data_root: str | Path, **options: Any) -> Task:
    """The registered task ``config.task`` on the data at ``data_root``."""
    return TASKS.get(config.task)(config, data_root, **options)


__all__ = ["TASKS", "Task", "build_task", "gather_records", "pad_stack"]
