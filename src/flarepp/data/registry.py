"""The dataset registry: ``DATASETS.register(name)`` on ``load(root, **options) -> DatasetSplits``."""

from flarepp.registry import Registry

DATASETS: Registry = Registry("dataset")
