"""Long Range Arena data (Tay et al. 2021; paper Section 4.3 and D.5): readers of the
released files, generators for ListOps and Pathfinder.

``load_lra(name, root, **options)`` returns an :class:`LRADataset` (token sequences per
split, vocabulary size, number of classes) from a registered reader:

=================  =====================================================================
``listops``        ``basic_{train,val,test}.tsv`` (LRA release ``listops-1000/``)
``pathfinder``     ``<set>/imgs/*/sample_*.png`` + ``<set>/metadata/*.npy`` (release layout)
``cifar10``        the CIFAR-10 python batches (grayscale, 1024 tokens)
``fashion-mnist``  the IDX files of Debian's ``dataset-fashion-mnist`` (784 tokens)
``imdb``           ``aclImdb/{train,test}/{pos,neg}/*.txt`` (byte-level)
``aan``            ``new_aan_pairs.{train,eval,test}.tsv`` (byte-level pairs)
``lra-pickle``     the FLARE study's ``lra-<task>.{train,dev,test}.pickle`` (``task=...``)
=================  =====================================================================

Nothing is downloaded: a missing file raises a :class:`~flarepp.data.DataError` that says
where to put it (docs/lra.md). ``LRA_GENERATORS`` write ListOps and Pathfinder sets in the
release formats. The per-benchmark model and run settings are not data: they live in
:mod:`flarepp.train.lra_benchmarks`.
"""

from __future__ import annotations

import inspect
import typing
from pathlib import Path
from typing import Any

from flarepp.data.lra.base import LRADataset, LRASplit, TokenSequences, collate
from flarepp.data.lra.images import FASHION_MNIST_DIR, load_cifar10, load_fashion_mnist
from flarepp.data.lra.listops import load_listops, make_listops
from flarepp.data.lra.pathfinder import load_pathfinder, make_pathfinder
from flarepp.data.lra.pickles import load_reference_pickles
from flarepp.data.lra.text import load_aan, load_imdb
from flarepp.data.registry import DATASETS
from flarepp.registry import Registry

LRA_DATASETS: Registry = Registry("LRA dataset")
LRA_DATASETS.add("listops", load_listops, doc="ListOps TSVs (release or generated)")
LRA_DATASETS.add("pathfinder", load_pathfinder, doc="Pathfinder image folders + metadata")
LRA_DATASETS.add("cifar10", load_cifar10, doc="CIFAR-10 python batches, grayscale")
LRA_DATASETS.add("fashion-mnist", load_fashion_mnist,
                 defaults={"root": FASHION_MNIST_DIR}, doc="Fashion-MNIST IDX files")
LRA_DATASETS.add("imdb", load_imdb, doc="IMDB reviews, byte-level")
LRA_DATASETS.add("aan", load_aan, doc="AAN citation pairs, byte-level")
LRA_DATASETS.add("lra-pickle", load_reference_pickles, doc="the FLARE study's LRA pickles")

LRA_GENERATORS: Registry = Registry("LRA generator")
LRA_GENERATORS.add("listops", make_listops, doc="random ListOps expressions, LRA rules")
LRA_GENERATORS.add("pathfinder", make_pathfinder, doc="Pathfinder-32 images, release layout")


def load_lra(name: str, root: str | Path | None = None, **options: Any) -> LRADataset:
    """Read registered LRA dataset ``name`` from ``root`` (a folder; optional where the
    reader has a default, e.g. Fashion-MNIST's Debian path)."""
    entry = LRA_DATASETS.entry(name)
    if root is None:
        if "root" not in entry.defaults:
            raise ValueError(f"LRA dataset {name!r} needs a data folder (root)")
        root = entry.defaults["root"]
    return entry.obj(root, **options)


# The readers as run-config datasets of :data:`flarepp.data.DATASETS` (task ``sequence``).

def _limited_reader(name: str):
    """LRA reader ``name`` with a ``split_limits`` option, its signature the reader's own
    keywords plus that one (what :class:`~flarepp.storage.config.RunConfig` checks)."""
    entry = LRA_DATASETS.entry(name)

    def load(root: str | Path | None = None, *, split_limits: dict[str, int] | None = None,
             **options: Any) -> LRADataset:
        data = load_lra(name, root, **options)
        return data.limited(split_limits) if split_limits else data

    own = inspect.signature(entry.obj)
    keywords = [p for p in own.parameters.values() if p.kind is p.KEYWORD_ONLY]
    limits = inspect.Parameter("split_limits", inspect.Parameter.KEYWORD_ONLY, default=None,
                               annotation=dict[str, int] | None)
    root = inspect.Parameter("root", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
    load.__signature__ = own.replace(parameters=[root, *keywords, limits])
    hints = typing.get_type_hints(entry.obj)
    load.__annotations__ = {k: v for k, v in hints.items() if k != "return"} | {
        "split_limits": dict[str, int] | None}
    load.__name__ = load.__qualname__ = f"load_lra_{name.replace('-', '_')}"
    load.__doc__ = f"LRA reader {name!r} ({entry.doc}), optionally limited per split."
    return load


for _name in LRA_DATASETS.names():
    DATASETS.add(_name, _limited_reader(_name),
                 doc=f"Long Range Arena: {LRA_DATASETS.entry(_name).doc} (task sequence)")


__all__ = ["LRA_DATASETS", "LRA_GENERATORS", "LRADataset", "LRASplit", "TokenSequences", "collate",
           "load_lra"]
