"""The FLARE++ paper's settings and parameter counts as data (paper Sec. C.2-C.3, Tables 7-10).

Each table is written here once; the presets (``flarepp.train.presets``), the Table 1
comparison (``flarepp.experiments.comparison``) and the parameter-count tests read it.

* :data:`TABLE7` -- settings held fixed across datasets and mixers;
* :data:`TABLE8` -- per-dataset depth B, latent budget M, batch size, weight decay, epochs;
* :data:`TABLE9` -- the complete architectures' departures from Tables 7-8;
* :data:`TABLE10` -- parameter counts of the author-run models (millions, two decimals),
  :data:`TABLE10_FLARE_STUDY` those the caption quotes for the reproduced models.

:data:`INPUT_CHANNELS` is not a paper table: it is the input width each flarepp loader
produces (Sec. C.1), which the parameter counts depend on through the input projection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

DATASETS: tuple[str, ...] = ("elasticity", "darcy", "airfoil", "pipe", "drivaerml-40k")
"""The five benchmarks of Table 1, in the order of its columns."""

TABLE7: Mapping[str, Any] = MappingProxyType({
    "dim": 128,                 # channel width C
    "heads": 8,                 # attention heads H (head width D = C / H = 16)
    "io_layers": 2,             # input/output projection depth (FLARE study)
    "ffn_ratio": 2.0,           # block feed-forward MLP ratio
    "norm": "layernorm",        # pre-norm LayerNorm (FP32; RMSNorm under mixed precision)
    "lr": 1e-3,                 # peak learning rate, one-cycle schedule
    "betas": (0.9, 0.999),      # AdamW
    "eps": 1e-8,
    "precision": "fp32",
})
"""Table 7: settings held fixed across all datasets and matched-backbone mixers."""


@dataclass(frozen=True)
class DatasetSettings:
    """One row of Table 8."""

    blocks: int
    latents: int
    batch_size: int
    weight_decay: float
    epochs: int


TABLE8: Mapping[str, DatasetSettings] = MappingProxyType({
    "elasticity": DatasetSettings(blocks=8, latents=64, batch_size=2, weight_decay=1e-5,
                                  epochs=500),
    "darcy": DatasetSettings(blocks=8, latents=128, batch_size=2, weight_decay=1e-5,
                             epochs=500),
    "airfoil": DatasetSettings(blocks=8, latents=64, batch_size=2, weight_decay=1e-5,
                               epochs=500),
    "pipe": DatasetSettings(blocks=2, latents=64, batch_size=2, weight_decay=1e-5,
                            epochs=500),
    "drivaerml-40k": DatasetSettings(blocks=4, latents=64, batch_size=1, weight_decay=1e-2,
                                     epochs=500),
})
"""Table 8: per-dataset settings shared by every matched-backbone mixer."""

INPUT_CHANNELS: Mapping[str, int] = MappingProxyType({
    "elasticity": 2,      # point coordinates (x, y)
    "darcy": 3,           # grid coordinates (x, y) and the permeability (Table 6 counts 1)
    "airfoil": 2,         # mesh coordinates
    "pipe": 2,            # mesh coordinates
    "drivaerml-40k": 3,   # cell centres (x, y, z)
})
"""Input width of each flarepp loader (Sec. C.1); every target is one channel."""


@dataclass(frozen=True)
class Deviation:
    """A Table 9 row's settings in place of Tables 7-8: ``fixed`` on every dataset, then
    ``per_dataset`` exceptions."""

    fixed: Mapping[str, Any]
    per_dataset: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def on(self, dataset: str) -> dict[str, Any]:
        return {**self.fixed, **self.per_dataset.get(dataset, {})}


TABLE9: Mapping[str, Deviation] = MappingProxyType({
    "abupt": Deviation({"anchors": 512}),
    "perceiver-io": Deviation({"dim": 128, "heads": 8, "blocks": 8, "latents": 512,
                               "mlp_ratio": 4.0}),
    "lno": Deviation({"dim": 128, "heads": 8, "blocks": 4, "latents": 256},
                     {"elasticity": {"dim": 192}, "airfoil": {"blocks": 8},
                      "pipe": {"blocks": 8}}),
    "gnot": Deviation({"dim": 128, "heads": 8, "blocks": 8, "mlp_ratio": 2.0,
                       "experts": 3}),
})
"""Table 9: departures from Tables 7-8 (the other rows depart in nothing)."""

TABLE10: Mapping[str, Mapping[str, float]] = MappingProxyType({
    name: MappingProxyType(dict(zip(DATASETS, counts))) for name, counts in [
        ("attention", (1.16, 1.16, 1.16, 0.36, 0.63)),
        ("set-transformer", (1.76, 1.83, 1.76, 0.52, 0.93)),
        ("luna", (1.57, 1.57, 1.57, 0.47, 0.84)),
        ("transolver", (1.04, 1.05, 1.04, 0.34, 0.57)),
        ("transolver++", (0.92, 0.94, 0.92, 0.30, 0.51)),
        ("transolver3", (1.04, 1.05, 1.04, 0.34, 0.57)),
        ("abupt", (1.16, 1.16, 1.16, 0.36, 0.63)),
        ("flare", (1.09, 1.16, 1.09, 0.35, 0.60)),
        ("flarepp", (1.29, 1.42, 1.29, 0.40, 0.70)),
    ]})
"""Table 10: parameters in millions (biases and norms included) at Tables 7-8."""

TABLE10_FLARE_STUDY: Mapping[str, float] = MappingProxyType({
    "perceiver-io": 1.87, "lno": 0.92, "gnot": 4.88})
"""Table 10's caption: the reproduced models' counts as the FLARE study quotes them."""

__all__ = ["DATASETS", "INPUT_CHANNELS", "TABLE7", "TABLE8", "TABLE9", "TABLE10",
           "TABLE10_FLARE_STUDY", "DatasetSettings", "Deviation"]
