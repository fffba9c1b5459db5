"""Run configuration (paper Tables 7-8, C.2; the FLARE study's protocol): the data and its
migration.

A :class:`RunConfig` holds what a run depends on and how it is stored; it checks nothing
itself. Its one check -- every field's type and range, every ``model`` key against the
chosen architecture's (and mixer's) config class, every ``dataset_options`` key against the
dataset loader's options, the task's own options, the optimiser's rules -- is
:func:`flarepp.train.validate`, on the trainer's floor, which every entry point (``train``,
a sweep's points, ``eval``, presets, ``--set`` through :func:`flarepp.train.apply_overrides`,
the trainer itself) applies before any data is read or any model is built.

Stored configs carry :data:`CONFIG_VERSION`: :meth:`RunConfig.from_stored` reads what a run
stored (an unversioned one trained the :data:`LEGACY_PROTOCOL`), :meth:`RunConfig.from_dict`
what a user wrote (today's defaults for whatever it leaves out).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from flarepp.models import MODELS, SurrogateConfig
from flarepp.rank_growth import LatentSchedule

# How a run executes, not what it computes: a run may resume with other values.
RUNTIME_FIELDS = ("device", "compile", "loader_workers", "eval_chunk_size",
                  "keep_checkpoints", "memory_budget_gib", "final_eval_train")

CONFIG_VERSION = 4
"""The format of a stored run config. 1: the configs of runs stored before the version was
written (they lack it; an absent protocol field means :data:`LEGACY_PROTOCOL`); 2: the
version is written, and ``config.json`` is laid out in :data:`FILE_SECTIONS`; 3: adds
``eval_weights`` (a version-1 or -2 config lacks it: those runs reported the EMA weights,
:data:`ADDED_SINCE`); 4: adds ``val_fraction`` (an earlier config lacks it: those runs
trained on their whole training split)."""

VERSION_KEY = "config_version"

FILE_SECTIONS: dict[str, tuple[str, ...]] = {
    "data": ("dataset", "dataset_options", "data_root", "val_fraction"),
    "optimisation": ("epochs", "batch_size", "lr", "weight_decay", "betas", "eps", "pct_start",
                     "div_factor", "final_div_factor", "grad_clip", "ema_decay",
                     "latent_schedule"),
    "protocol": ("loss", "grad_loss_weight", "input_norm", "weight_decay_groups",
                 "momentum_cycle", "attn_scale", "precision", "eval_weights"),
    "runtime": ("device", "compile", "loader_workers", "eval_chunk_size", "checkpoint_every",
                "eval_every", "plot_cases", "keep_checkpoints", "memory_budget_gib",
                "final_eval_train"),
}
"""How ``config.json`` groups the fields beside ``name``, ``task``, ``seed`` and ``model``
(the model section is the ``model`` field itself)."""

LEGACY_PROTOCOL: dict[str, Any] = {
    "loss": "mse", "grad_loss_weight": 0.1, "input_norm": "standard",
    "weight_decay_groups": "all", "momentum_cycle": None, "attn_scale": "sqrt",
    "eval_weights": "ema"}
"""The training protocol of runs stored before these fields existed (MSE of normalised
outputs, every input channel standardised, weight decay on every parameter, a fixed beta1,
SDPA scale 1/sqrt(D) for every mixer, errors reported from the EMA weights): a stored
config that lacks a field ran with this."""

ADDED_SINCE: dict[int, dict[str, Any]] = {3: {"eval_weights": "ema"},
                                          4: {"val_fraction": 0.0}}
"""Fields a config version added, with the value the runs stored by an earlier version ran
with: a stored config of version v lacking such a field of a version above v gets it."""

EVAL_WEIGHTS = ("raw", "ema")

FINAL_EVAL_TRAIN = ("auto", "all", "none")
"""Words of ``final_eval_train`` (besides a count of samples)."""

REFERENCE_ATTN_SCALE: dict[str, float] = {"flare": 1.0}
"""SDPA scale of ``attn_scale="reference"`` per mixer, where it is not 1/sqrt(D).

The paper writes ``softmax(Q K^T / sqrt(D))`` for every SDPA call (Sec. 3.1, eq. 13, Table
2), but the FLARE study's code, whose runs give FLARE's numbers in Table 1, defaults to
scale 1.0 (``--attn_scale one``; github.com/vpuri3/FLARE.py, ``pdebench/__main__.py``).
FLARE++ and its variants have no public code; they keep the paper's 1/sqrt(D), which
their per-head norms (A.3) are sized for. Every other mixer uses 1/sqrt(D)."""

ATTN_SCALE_WORDS = ("reference", "sqrt")
MOMENTUM_CYCLE_REFERENCE = (0.85, 0.95)


@dataclass(kw_only=True)
class RunConfig:
    """Everything a training run depends on; stored in every checkpoint.

    ``model`` holds ``build_model`` keywords except ``in_dim``/``out_dim`` (taken from the
    data). ``model.norm`` unset means LayerNorm for FP32 and RMSNorm for mixed precision
    (C.2). Optimisation follows the FLARE study: AdamW (0.9, 0.999, 1e-8), one-cycle
    (cosine, ``pct_start`` 0.1, ``div_factor`` = ``final_div_factor`` = 1e4) stepped per
    batch, gradient clipping at 1.0, EMA of the weights with decay 0.999.

    The training protocol where the paper is silent follows the FLARE study's public code
    (github.com/vpuri3/FLARE.py, which the paper follows for what it does not state); each
    choice is an option, the earlier flarepp behaviour one of its values:

    * ``loss``: the task's training loss (:mod:`flarepp.tasks.fields`: ``mse`` of the
      normalised outputs, ``rel_l2`` the per-sample relative L2 error of the de-normalised
      outputs, ``rel_l2_grad`` that plus ``grad_loss_weight`` x the relative L2 error of
      the grid's central-difference gradients); ``reference`` lets the task choose per
      dataset as the study does.
    * ``input_norm``: how input channels are normalised (``standard``, ``none``, ``bbox``,
      a list with one of them per channel, or ``reference``: the study's rule per dataset).
    * ``weight_decay_groups`` (:mod:`flarepp.train.optim`): ``weights`` decays only the
      weight matrices of linear maps, ``reference`` exactly the study's split, ``all``
      every parameter.
    * ``momentum_cycle``: ``(base, max)`` beta1 of the one-cycle schedule (the study
      cycles 0.95 -> 0.85 -> 0.95 against the learning rate); ``None`` keeps
      ``betas[0]`` fixed (Table 7's 0.9).
    * ``attn_scale``: the SDPA scale of mixers whose ``model`` does not set one:
      ``reference`` (:data:`REFERENCE_ATTN_SCALE`: 1.0 for FLARE, 1/sqrt(D) for the rest),
      ``sqrt`` (1/sqrt(D) everywhere), or a number.
    * ``eval_weights``: the weights whose errors are the headline, ``raw`` (the trained
      weights: the study writes its errors from them and evaluates its EMA copy only
      beside them) or ``ema`` (their moving average; flarepp's earlier headline). Both
      are evaluated and stored either way (:mod:`flarepp.train.loop`).

    ``val_fraction`` > 0 holds that share of the training split out of training as a
    validation split, ``val`` (the same samples for every run on the same data, whatever
    its seed; normalisers are fitted on the rest): settings are chosen on it, never on the
    test split. 0 trains on the whole training split. A task that cannot carve one refuses
    it (:func:`flarepp.tasks.check_task_config`).

    ``task`` names the registered task (:mod:`flarepp.tasks`). The runtime fields (device,
    compile, loader workers, streaming chunk of evaluation) change how a run executes, not
    what it computes, so a run may be resumed with other values: ``device`` is ``auto``
    (``cuda:LOCAL_RANK`` when CUDA is available, else the CPU), ``cpu``, ``cuda`` or
    ``cuda:K``; ``loader_workers`` -1 means 2 worker processes on CUDA and none on the CPU
    (where they would compete with the compute for the cores); ``eval_chunk_size`` streams
    evaluation meshes in chunks of that many points (exact; unset: a mesh of up to 65,536
    points is evaluated whole, a larger one streamed in chunks of 16,384,
    :data:`flarepp.inference.execution.STREAM_ABOVE`, ``STREAM_CHUNK``); ``final_eval_train`` says which
    training samples the end of the run evaluates (the test split always, every sample):
    ``all``, ``none``, a count N (N evenly spaced samples) or ``auto`` (every one when the
    training split holds at most 8M points, else an evenly spaced subsample of about 8M
    points: :func:`flarepp.inference.evaluate.final_eval_samples`; a stored config without
    it reads as ``auto``), said on the console and recorded in ``metrics.json``;
    ``keep_checkpoints`` K keeps the K newest checkpoints of the run plus the one of the
    epoch with the best recorded metric (``None`` keeps every one; older ones are deleted only after a newer one is written);
    ``memory_budget_gib`` is the resident memory in GiB the run (its process and its loader
    workers) may take, from which it chooses ``eval_chunk_size``, ``loader_workers`` and an
    unset ``dataset_options.points_per_step`` (:mod:`flarepp.train.budget`; ``None``: the
    cgroup's or the address-space limit where one is set, else no planning). A stored
    config without it (written before it existed) reads as ``None``.

    ``latent_schedule`` grows the latent count M during training (rank-adaptive FLARE, the
    talk's Aim 1(a)): ``"16,32@10,64@20"`` starts at M = 16 and grows every FLARE / FLARE++
    mixer to 32 latents at the start of epoch 10 and to 64 at epoch 20, keeping the model's
    function (:mod:`flarepp.rank_growth`); ``model.latents`` is then the schedule's first M.
    """

    name: str
    dataset: str
    task: str = "fields"
    dataset_options: dict[str, Any] = field(default_factory=dict)
    data_root: str = "data"
    val_fraction: float = 0.0
    model: dict[str, Any] = field(default_factory=dict)
    epochs: int = 500
    batch_size: int = 2
    lr: float = 1e-3
    weight_decay: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    pct_start: float = 0.1
    div_factor: float = 1e4
    final_div_factor: float = 1e4
    grad_clip: float = 1.0
    ema_decay: float = 0.999
    loss: str = "reference"
    grad_loss_weight: float = 0.1
    input_norm: str | list[str] = "reference"
    weight_decay_groups: str = "weights"
    momentum_cycle: tuple[float, float] | None = MOMENTUM_CYCLE_REFERENCE
    attn_scale: str | float = "reference"
    precision: str = "fp32"
    eval_weights: str = "raw"
    seed: int = 0
    checkpoint_every: int = 10
    eval_every: int = 1
    plot_cases: int = 3
    device: str = "auto"
    compile: bool = False
    loader_workers: int = -1
    eval_chunk_size: int | None = None
    latent_schedule: str | None = None
    keep_checkpoints: int | None = 3
    memory_budget_gib: float | None = None
    final_eval_train: str | int = "auto"

    def __post_init__(self) -> None:
        # JSON has no tuples: a stored or typed pair reads as a list
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)
        if isinstance(self.momentum_cycle, list):
            self.momentum_cycle = tuple(self.momentum_cycle)

    # -- views -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, flat, with :data:`VERSION_KEY` (what a checkpoint stores)."""
        return {VERSION_KEY: CONFIG_VERSION, **asdict(self)}

    def identity(self) -> dict[str, Any]:
        """What the run computes: the fields without the runtime ones (and the version)."""
        return {k: v for k, v in asdict(self).items() if k not in RUNTIME_FIELDS}

    def workers(self, device_type: str) -> int:
        if self.loader_workers >= 0:
            return self.loader_workers
        return 2 if device_type == "cuda" else 0

    def to_file(self) -> dict[str, Any]:
        """What ``config.json`` holds: :data:`VERSION_KEY`, ``name``, ``task``, ``seed``,
        ``model``, then the fields grouped in :data:`FILE_SECTIONS`."""
        flat = self.to_dict()
        out: dict[str, Any] = {VERSION_KEY: CONFIG_VERSION}
        out.update({k: flat.pop(k) for k in ("name", "task", "seed", "model")})
        for section, keys in FILE_SECTIONS.items():
            out[section] = {k: flat.pop(k) for k in keys}
        out.update(flat)   # a field no section names yet stays at the top
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        """A config from a user's dict or file: flat (``to_dict()``) or in sections
        (``to_file()``). Every field it lacks takes today's default; ``name`` defaults to
        the dataset's name. A :data:`VERSION_KEY` it holds is checked
        (:func:`stored_version`): a newer flarepp's config is refused, not read with today's
        meaning."""
        stored_version(d)
        return cls._from_flat(flatten_sections(d))

    @classmethod
    def from_stored(cls, d: dict[str, Any]) -> "RunConfig":
        """A config a run stored (in a checkpoint or its ``config.json``). One without
        :data:`VERSION_KEY` was stored before versions were written: a protocol field it
        lacks takes its :data:`LEGACY_PROTOCOL` value, what that run trained with; a field
        added after the stored version (:data:`ADDED_SINCE`) takes the value runs of that
        version had."""
        version = stored_version(d)
        flat = flatten_sections(d)
        if VERSION_KEY not in d:
            flat = {**LEGACY_PROTOCOL, **flat}
        for added, values in ADDED_SINCE.items():
            if version < added:
                flat = {**values, **flat}
        return cls._from_flat(flat)

    @classmethod
    def _from_flat(cls, d: dict[str, Any]) -> "RunConfig":
        d = {k: v for k, v in d.items() if k != VERSION_KEY}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown run config key(s) {unknown}; known keys: "
                             f"{', '.join(sorted(known))}")
        if "name" not in d and isinstance(d.get("dataset"), str):
            d["name"] = d["dataset"]
        missing = [f.name for f in fields(cls) if f.name in ("name", "dataset") and f.name not in d]
        if missing:
            raise ValueError(f"run config key(s) {missing} missing: a run config names at "
                             "least its dataset")
        return cls(**d)

    def schedule(self) -> LatentSchedule | None:
        """The :class:`flarepp.rank_growth.LatentSchedule` of ``latent_schedule`` (or None)."""
        if self.latent_schedule is None:
            return None
        return LatentSchedule.parse(self.latent_schedule)

    def model_kwargs(self) -> dict[str, Any]:
        """``build_model`` keywords: ``model`` with the norm of the precision (C.2) and the
        SDPA scale of ``attn_scale`` filled in where ``model`` leaves them unset; with a
        ``latent_schedule``, the model starts at the schedule's first M."""
        kwargs = dict(self.model)
        if self.latent_schedule is not None:
            kwargs["latents"] = self.schedule().latents_at(0)
        if kwargs.get("norm") is None:
            kwargs["norm"] = "layernorm" if self.precision == "fp32" else "rmsnorm"
        if "attn_scale" not in kwargs:
            scale = self._attn_scale_for(kwargs)
            if scale is not None:
                kwargs["attn_scale"] = scale
        return kwargs

    def _attn_scale_for(self, kwargs: dict[str, Any]) -> float | None:
        if not isinstance(self.attn_scale, str):
            return float(self.attn_scale)
        if self.attn_scale == "sqrt":
            return None
        cls = model_config_class(kwargs.get("arch", "surrogate"))
        if "attn_scale" not in {f.name for f in dataclasses.fields(cls)}:
            return None
        return REFERENCE_ATTN_SCALE.get(kwargs.get("mixer", field_default(cls, "mixer")))

    def sdpa_scale(self) -> float | None:
        """The SDPA scale the run's model uses (``None`` if it has no such option)."""
        kwargs = self.model_kwargs()
        cls = model_config_class(kwargs.get("arch", "surrogate"))
        if "attn_scale" not in {f.name for f in dataclasses.fields(cls)}:
            return None
        scale = kwargs.get("attn_scale")
        if scale is not None:
            return float(scale)
        dim, heads = (kwargs.get(k, field_default(cls, k)) for k in ("dim", "heads"))
        return 1.0 / math.sqrt(dim // heads)


    def sdpa_scale_text(self) -> str:
        """:meth:`sdpa_scale` as a report writes it: ``1``, ``1/sqrt(16)``, ``-``."""
        kwargs = self.model_kwargs()
        cls = model_config_class(kwargs.get("arch", "surrogate"))
        dim, heads = (kwargs.get(k, field_default(cls, k)) for k in ("dim", "heads"))
        return describe_scale(self.sdpa_scale(), dim // heads if dim and heads else None)


def stored_version(d: dict[str, Any]) -> int:
    """The :data:`VERSION_KEY` of a stored or user's config ``d``: 1 when absent (stored
    before versions were written), else an integer from 1 to :data:`CONFIG_VERSION`.

    Raises ``ValueError`` naming the key for anything else: a newer version was written by a
    newer flarepp, whose fields may mean what this one cannot know (it must not train or
    evaluate with today's meaning), and a non-integer or a version below 1 was never
    written by any. The caller names the file."""
    if not isinstance(d, dict) or VERSION_KEY not in d:
        return 1
    version = d[VERSION_KEY]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"key {VERSION_KEY!r} must be an integer >= 1 (the config format "
                         f"version flarepp writes, {CONFIG_VERSION} today), got {version!r}")
    if version > CONFIG_VERSION:
        raise ValueError(f"key {VERSION_KEY!r}: written by a newer flarepp (version "
                         f"{version} > {CONFIG_VERSION}, the newest this flarepp reads); "
                         "upgrade flarepp to use it")
    return version


def flatten_sections(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with the :data:`FILE_SECTIONS` of a ``config.json`` merged into the top level
    (a flat dict is returned as it is, less nothing). A key given both in a section and at
    the top is an error, naming it."""
    if not isinstance(d, dict):
        raise ValueError(f"a run config is a JSON object, got {type(d).__name__}")
    flat = {k: v for k, v in d.items() if k not in FILE_SECTIONS}
    for section in FILE_SECTIONS:
        if section not in d:
            continue
        values = d[section]
        if not isinstance(values, dict):
            raise ValueError(f"run config section {section!r} must be an object, got "
                             f"{values!r}")
        twice = sorted(set(values) & set(flat))
        if twice:
            raise ValueError(f"run config key(s) {twice} given both in section {section!r} "
                             "and at the top level")
        flat.update(values)
    return flat


def describe_scale(scale: float | None, head_dim: int | None = None) -> str:
    """``"1"``, ``"1/sqrt(16)"`` or ``"0.3"``: how a report states an SDPA scale."""
    if scale is None:
        return "-"
    if head_dim and math.isclose(scale, head_dim ** -0.5):
        return f"1/sqrt({head_dim})"
    return f"{scale:g}"


def model_config_class(arch: str) -> type:
    """The config dataclass of registered architecture ``arch``."""
    return getattr(MODELS.get(arch), "config_cls", SurrogateConfig)


def field_default(cls: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls`` (None without one)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    return None


__all__ = ["ADDED_SINCE", "ATTN_SCALE_WORDS", "CONFIG_VERSION", "EVAL_WEIGHTS",
           "FINAL_EVAL_TRAIN", "FILE_SECTIONS",
           "LEGACY_PROTOCOL", "MOMENTUM_CYCLE_REFERENCE", "REFERENCE_ATTN_SCALE",
           "RUNTIME_FIELDS", "RunConfig", "VERSION_KEY", "describe_scale", "field_default",
           "flatten_sections", "model_config_class", "stored_version"]
