"""The FLARE++ paper's settings and parameter counts as data (paper Sec. C.2-C.3, Tables 7-10).

Each table is written here once; the presets (``flarepp.train.presets``), the Table 1
comparison (``flarepp.experiments.comparison``) and the parameter-count tests read it.

* :data:`TABLE7` -- settings held fixed across datasets and mixers;
* :data:`TABLE8` -- per-dataset depth B, latent budget M, batch size, weight decay, epochs;
* :data:`TABLE9` -- the complete architectures' departures from Tables 7-8;
* :data:`TABLE10` -- parameter counts of the author-run models (millions, two decimals),
  :data:`TABLE10_FLARE_STUDY` those the caption quotes for the reproduced models;
* :data:`DRIVAERML_FULL` -- the full-surface DrivAerML protocol (Sec. 4.2, C.1) and
  :data:`FIGURE5_CLAIMS` the numbers Sec. 4.2 reads off Figure 5.

:data:`INPUT_CHANNELS` is not a paper table: it is the input width each flarepp loader
produces (Sec. C.1), which the parameter counts depend on through the input projection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

TABLE1_DATASETS: tuple[str, ...] = ("elasticity", "darcy", "airfoil", "pipe", "drivaerml-40k")
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
    name: MappingProxyType(dict(zip(TABLE1_DATASETS, counts))) for name, counts in [
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


@dataclass(frozen=True)
class FullSurfaceSettings:
    """The full-surface DrivAerML protocol (Sec. 4.2 and C.1; not a row of Table 8).

    Backbone of Table 7 (C = 128, H = 8) at every depth and latent budget of the grid;
    same optimiser, peak learning rate, one-cycle schedule and epochs as the standard
    benchmarks; FP16 with RMSNorm in place of LayerNorm; weight decay 1e-4; one geometry
    per step with a fresh uniform subset of ``cells_per_step`` cells drawn without
    replacement; the test value on every cell of every test surface. Split of Alkin et al.
    (2025): 400 train / 34 validation (unused) / 50 test geometries."""

    blocks: tuple[int, ...] = (2, 4, 8)
    latents: tuple[int, ...] = (64, 128, 256)
    cells_per_step: int = 100_000
    batch_size: int = 1
    weight_decay: float = 1e-4
    epochs: int = 500
    precision: str = "fp16"
    norm: str = "rmsnorm"
    abupt_anchors: int = 512
    split_sizes: tuple[int, int, int] = (400, 34, 50)
    in_channels: int = 6          # cell centre (x, y, z) and unit normal
    out_channels: int = 4         # p_s and the three wall-shear components


DRIVAERML_FULL = FullSurfaceSettings()
"""Sec. 4.2 / C.1: the full-surface DrivAerML settings (``drivaerml-b{B}-m{M}`` presets)."""

FIGURE5_CLAIMS: Mapping[str, Any] = MappingProxyType({
    "flarepp_over_flare_gain_by_blocks": {2: 0.31, 4: 0.22, 8: 0.13},
    "flarepp_over_flare_cost": (1.1, 1.2),
    "flare_best": {"error_pct": 0.734, "gpu_hours": 5.75},
    "flarepp_undercuts_flare_best_at_gpu_hours": 5.19,
    "smallest_budget": {"flare_error_pct": (2.93, 2.98), "flarepp_error_pct": 1.99},
})
"""Sec. 4.2's reading of Figure 5 (normalised 4-channel MSE in %, one H100, 500 epochs):
FLARE++'s mean error reduction over FLARE per depth (averaged over latent budgets), the
cost ratio of matched runs, FLARE's best run, and the smallest-budget runs."""

__all__ = ["TABLE1_DATASETS", "DRIVAERML_FULL", "FIGURE5_CLAIMS", "INPUT_CHANNELS", "TABLE7",
           "TABLE8", "TABLE9", "TABLE10", "TABLE10_FLARE_STUDY", "DatasetSettings",
           "Deviation", "FullSurfaceSettings"]
