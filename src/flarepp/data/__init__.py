"""Datasets: loaders for the public benchmarks, a user format and PDE data generators.

Importing this package registers every loader, so :data:`DATASETS` is complete at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flarepp.data.base import (ChannelStatistics, DataError, DatasetSplits, DataWarning,
                               MeshSamples, Normalizer, RunningMoments, subset_points,
                               validation_indices)
from flarepp.data.layout import ChannelGroup, ChannelLayout
from flarepp.data.registry import DATASETS, OPTION_CHECKS
from flarepp.data import loaders as _loaders  # noqa: F401  (registers the loaders)
from flarepp.data import lra as _lra  # noqa: F401  (registers the Long Range Arena readers)
from flarepp.data import rollout as _rollout  # noqa: F401  (registers "advection-diffusion")
from flarepp.data import store as _store  # noqa: F401  (registers "store")
from flarepp.data import surface as _surface  # noqa: F401  (registers "drivaerml")
from flarepp.data import text as _text  # noqa: F401  (registers "text-files")


def load_dataset(name: str, root: str | Path, **options: Any) -> DatasetSplits:
    """Load registered dataset ``name`` from ``root`` (a directory or file) and validate it."""
    loader = DATASETS.get(name)
    root = Path(root)
    if not root.exists():
        raise DataError(f"data path {str(root)!r} does not exist (dataset {name!r})")
    return loader(root, **options).validate()


__all__ = ["ChannelGroup", "ChannelLayout", "ChannelStatistics", "DATASETS", "DataError", "OPTION_CHECKS",
           "DataWarning", "DatasetSplits", "MeshSamples", "Normalizer", "RunningMoments",
           "load_dataset", "subset_points", "validation_indices"]
