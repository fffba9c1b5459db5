"""The dataset registry: ``DATASETS.register(name)`` on ``load(root, **options) -> DatasetSplits``.

:data:`OPTION_CHECKS` holds, by dataset name, the checks of its options beyond their types
(a count that must be positive), run when a run config is validated, before any data is
read (:func:`flarepp.train.validate`)."""

from typing import Callable

from flarepp.registry import Registry

DATASETS: Registry = Registry("dataset")

OPTION_CHECKS: dict[str, Callable[..., None]] = {}
