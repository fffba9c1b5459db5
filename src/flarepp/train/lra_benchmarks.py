"""The five Long Range Arena benchmarks: data, model and optimisation settings in one table.

Paper Section 4.3 and D.5 (Table 12) run FLARE++ "with FLARE's backbone and task
configurations". ``paper`` settings transcribe the commands of the FLARE study's
``out/lra/run.sh`` (the values below its header table, which is partly stale: e.g. its
header gives ListOps 6 blocks of width 512, the commands run 4 blocks of width 128).
Common to every run there: AdamW with betas (0.9, 0.98) and eps 1e-8, OneCycle per step
(10 % warm-up, ``div_factor`` 1e4, ``final_div_factor`` 1e-2, cosine), gradient clipping
1.0, mixed precision, no EMA; mean pooling and learned absolute positions unless stated.
``flare_family`` lists what the FLARE runs set differently from the other mixers (more
heads, the latent count M, SDPA scale 1.0 where the study passes ``--attn_scale one``).

``tiny`` settings are CPU-sized (small models in FP32, the CPU's fast path; thousands of
steps, i.e. tens of CPU-minutes per run: ``flarepp lra compare --steps`` shortens them),
on data a machine without internet can make or install: generated ListOps and Pathfinder,
Debian's Fashion-MNIST for Image. Text and Retrieval have no offline data (no package
ships IMDB or AAN); their tiny settings exist for the real files.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flarepp.data.lra import load_lra
from flarepp.data.lra.base import LRADataset
from flarepp.models.sequence import SequenceClassifierConfig
from flarepp.registry import Registry

FLARE_FAMILY = ("flare", "flarepp", "flarepp-simple", "flarepp-v1")


@dataclass(frozen=True, kw_only=True)
class LRARunSettings:
    """Model and optimisation settings of one task at one size.

    Model fields are those of :class:`~flarepp.models.sequence.SequenceClassifierConfig`;
    ``steps`` or ``epochs`` (exactly one) bound the run; ``split_limits`` keeps at most
    ``n`` samples of a split (CPU sizes of released data). ``train_samples`` is the size of
    the training split the steps are counted against (the release's, or the tiny data's),
    so that :meth:`run_epochs` can turn steps into whole epochs. The optimiser and schedule
    fields default to what every run of the reference shares (AdamW eps 1e-8; OneCycle
    with 10 % warm-up, ``div_factor`` 1e4, ``final_div_factor`` 1e-2 and beta1 cycled
    0.95 -> 0.85 -> 0.95, torch's ``cycle_momentum``; no EMA, ``ema_decay`` 0).
    """

    blocks: int
    dim: int
    heads: int
    ffn_ratio: float
    latents: int
    pooling: str = "mean"
    positional: str = "learned"
    head: str = "mlp"
    attn_scale: float | None = None
    embedding_dropout: float = 0.0
    head_dropout: float = 0.0
    flare_family: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 32
    steps: int | None = None
    epochs: int | None = None
    lr: float
    weight_decay: float
    schedule: str = "onecycle"
    clip_grad_norm: float = 1.0
    betas: tuple[float, float] = (0.9, 0.98)
    mixed_precision: bool = True
    split_limits: dict[str, int] = field(default_factory=dict)
    train_samples: int | None = None
    eps: float = 1e-8
    pct_start: float = 0.1
    div_factor: float = 1e4
    final_div_factor: float = 1e-2
    momentum_cycle: tuple[float, float] | None = (0.85, 0.95)
    ema_decay: float = 0.0

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError(f"give exactly one of steps and epochs, got steps={self.steps}, "
                             f"epochs={self.epochs}")
        if self.steps is not None and self.train_samples is None:
            raise ValueError("a run bounded by steps needs train_samples (the training "
                             "split the steps are counted against)")

    def run_epochs(self, train_samples: int | None = None, steps: int | None = None,
                   batch_size: int | None = None) -> int:
        """Whole epochs of the run: ``epochs``, or ``ceil(steps / ceil(train_samples /
        batch_size))`` for a run bounded by steps (the last epoch is completed, so a run
        takes at most one epoch of steps more than ``steps``). ``train_samples``, ``steps``
        and ``batch_size`` override the table's (a smaller training split, a shorter run,
        other batches)."""
        steps = steps if steps is not None else self.steps
        batch_size = batch_size or self.batch_size
        if steps is None:
            return self.epochs
        n = train_samples if train_samples is not None else self.train_samples
        if n is None:
            raise ValueError(f"counting {steps} steps in epochs needs the training split's "
                             "size (train_samples)")
        if n < 1 or steps < 1:
            raise ValueError(f"steps and train_samples must be positive, got steps={steps}, "
                             f"train_samples={n}")
        return math.ceil(steps / math.ceil(n / batch_size))

    def model_options(self, mixer: str) -> dict[str, Any]:
        """Keyword settings of the classifier for ``mixer`` (FLARE-family overrides applied)."""
        names = {f.name for f in dataclasses.fields(SequenceClassifierConfig)}
        options = {k: v for k, v in dataclasses.asdict(self).items()
                   if k in names and k != "mixer_options"}
        if mixer in FLARE_FAMILY:
            options.update(self.flare_family)
        return {**options, "mixer": mixer}


@dataclass(frozen=True, kw_only=True)
class LRABenchmark:
    """One LRA benchmark: its dataset (a :data:`~flarepp.data.lra.LRA_DATASETS` name), whether
    it pairs two documents, ``paper`` and ``tiny`` settings, the offline data for ``tiny``
    (``tiny_dataset``; ``tiny_make``: options of ``flarepp lra data make``; ``tiny_load``:
    options of its loader), ``notes`` on where the reference differs from what runs here."""

    name: str
    dataset: str
    two_tower: bool = False
    paper: LRARunSettings
    tiny: LRARunSettings
    tiny_dataset: str | None
    tiny_make: dict[str, Any] = field(default_factory=dict)
    tiny_load: dict[str, Any] = field(default_factory=dict)
    notes: str = ""

    def settings(self, size: str) -> LRARunSettings:
        if size not in ("paper", "tiny"):
            raise ValueError(f"unknown size {size!r}; known sizes: paper, tiny")
        return getattr(self, size)

    def load(self, size: str = "paper", root: str | Path | None = None, *,
             dataset: str | None = None, **options: Any) -> LRADataset:
        """This task's data at ``size``: the paper's dataset, or for ``tiny`` the offline one
        when there is one, with the size's loader options and split limits applied.
        ``dataset`` and ``options`` override the table (e.g. ``dataset="lra-pickle"``)."""
        settings = self.settings(size)
        tiny = size == "tiny" and dataset is None and self.tiny_dataset is not None
        name = dataset or (self.tiny_dataset if tiny else self.dataset)
        defaults = self.tiny_load if tiny else {}
        data = load_lra(name, root, **{**defaults, **options})
        return data.limited(settings.split_limits) if settings.split_limits else data

    def model_config(self, *, vocab_size: int, num_classes: int, max_length: int, mixer: str,
                     size: str = "paper", **overrides: Any) -> SequenceClassifierConfig:
        """The classifier config for this task's data sizes and ``mixer``."""
        options = {**self.settings(size).model_options(mixer), **overrides}
        return SequenceClassifierConfig(vocab_size=vocab_size, num_classes=num_classes,
                                        max_length=max_length, two_tower=self.two_tower,
                                        **options)


LRA_BENCHMARKS: Registry = Registry("LRA benchmark")

_FLARE = {"heads": 8, "latents": 128, "attn_scale": 1.0}


def _tiny(**settings: Any) -> LRARunSettings:
    """A task's CPU size: what every task's shares (2 blocks of width 64, 4 heads, FFN ratio
    2, 32 latents, FLARE's family at ``attn_scale`` 1, FP32), then the task's ``settings``."""
    shared = dict(blocks=2, dim=64, heads=4, ffn_ratio=2.0, latents=32,
                  flare_family={"attn_scale": 1.0}, mixed_precision=False)
    return LRARunSettings(**{**shared, **settings})

LRA_BENCHMARKS.add("listops", LRABenchmark(
    name="listops", dataset="listops",
    paper=LRARunSettings(blocks=4, dim=128, heads=8, ffn_ratio=4.0, latents=128,
                         head="linear", flare_family=_FLARE, steps=10_000, lr=5e-4,
                         weight_decay=1e-5, train_samples=96_000),
    tiny=_tiny(head="linear", steps=3_000, lr=1e-3, weight_decay=1e-5, train_samples=10_000),
    tiny_dataset="listops",
    tiny_make={"n_train": 10_000, "n_val": 1_000, "n_test": 1_000, "min_length": 50,
               "max_length": 300},
    tiny_load={"max_length": 300},
), doc="ListOps: 10-way, sequences of 500-2000 tokens (tiny: 50-300)")

LRA_BENCHMARKS.add("text", LRABenchmark(
    name="text", dataset="imdb",
    paper=LRARunSettings(blocks=4, dim=128, heads=8, ffn_ratio=4.0, latents=128,
                         pooling="cls", flare_family={"latents": 128, "attn_scale": None},
                         steps=20_000, lr=1e-5, weight_decay=1e-4, train_samples=25_000),
    tiny=_tiny(pooling="cls", flare_family={}, steps=2_000, lr=1e-3, weight_decay=1e-4,
               split_limits={"train": 5_000, "val": 1_000, "test": 1_000}, train_samples=5_000),
    tiny_dataset=None,
    notes="The reference runs Text with rotary position embeddings (--pos_embed rope) inside "
          "attention, which the mixer interface does not take; learned absolute positions "
          "are used instead. Its FLARE command, as written, inherits LR=5e-7 from the "
          "Linformer block above it; 1e-5 is the section's own LR.",
), doc="Text: byte-level IMDB sentiment, 2-way, up to 4000 bytes")

LRA_BENCHMARKS.add("retrieval", LRABenchmark(
    name="retrieval", dataset="aan", two_tower=True,
    paper=LRARunSettings(blocks=4, dim=128, heads=4, ffn_ratio=4.0, latents=128,
                         head="linear", flare_family=_FLARE, steps=10_000, lr=5e-4,
                         weight_decay=1e-4, train_samples=147_086),
    tiny=_tiny(head="linear", steps=2_000, lr=1e-3, weight_decay=1e-4,
               split_limits={"train": 5_000, "val": 1_000, "test": 1_000}, train_samples=5_000),
    tiny_dataset=None,
    notes="Two towers with shared weights, pooled summaries concatenated [u, v] as the "
          "reference (tower_combine='lra' gives LRA's [u, v, u*v, u-v]).",
), doc="Retrieval: byte-level AAN citation pairs, 2-way, two documents of up to 4000 bytes")

LRA_BENCHMARKS.add("image", LRABenchmark(
    name="image", dataset="cifar10",
    paper=LRARunSettings(blocks=3, dim=64, heads=4, ffn_ratio=2.0, latents=256,
                         flare_family={"heads": 8, "latents": 256, "attn_scale": 1.0},
                         steps=20_000, lr=1e-3, weight_decay=5e-2, train_samples=45_000),
    tiny=_tiny(steps=3_000, lr=1e-3, weight_decay=5e-2,
               split_limits={"train": 10_000, "val": 1_000, "test": 2_000},
               train_samples=10_000),
    tiny_dataset="fashion-mnist",
    notes="Paper: grayscale CIFAR-10, 1024 tokens. Offline (tiny): Fashion-MNIST from "
          "Debian's dataset-fashion-mnist, 784 tokens; a different, easier data set.",
), doc="Image: grayscale CIFAR-10 pixels, 10-way (tiny: Fashion-MNIST)")

LRA_BENCHMARKS.add("pathfinder32", LRABenchmark(
    name="pathfinder32", dataset="pathfinder",
    paper=LRARunSettings(blocks=4, dim=128, heads=8, ffn_ratio=1.0, latents=128,
                         embedding_dropout=0.1, flare_family=_FLARE, epochs=200, lr=5e-4,
                         weight_decay=5e-4, clip_grad_norm=0.5, mixed_precision=False),
    tiny=_tiny(ffn_ratio=1.0, steps=3_000, lr=5e-4, weight_decay=5e-4, clip_grad_norm=0.5,
               train_samples=9_600),
    tiny_dataset="pathfinder",
    tiny_make={"count": 12_000, "difficulty": "curv_baseline"},
    tiny_load={"difficulty": "curv_baseline"},
    notes="Paper settings are those of the FLARE command (the transformer ran LR 6e-4, "
          "batch 64, constant LR, EMA 0.999, dropout 0.05). The reference also drops out "
          "attention and projections (0.1), which the mixers do not take. Generated "
          "images draw unbroken snakes (see flarepp.data.lra.pathfinder).",
), doc="Pathfinder-32: are the two dots connected? 2-way, 1024 pixels (hard set)")


__all__ = ["FLARE_FAMILY", "LRA_BENCHMARKS", "LRARunSettings", "LRABenchmark"]
