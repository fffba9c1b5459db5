"""Run configuration (paper Tables 7-8, C.2; the FLARE study's protocol) and ``--set`` overrides.

A :class:`RunConfig` is checked when it is made -- every field's type, every ``model`` key
against the chosen architecture's (and mixer's) config class, every ``dataset_options`` key
against the dataset loader's options -- so a typo or a bad value fails at once, naming the
key and the known ones, before any data is read or any model is built. The checks that
belong to higher floors (the task's own options, the optimiser's rules) are added by
:func:`flarepp.train.check_run_config`, which every preset and command applies.

Stored configs carry :data:`CONFIG_VERSION`: :meth:`RunConfig.from_stored` reads what a run
stored (an unversioned one trained the :data:`LEGACY_PROTOCOL`), :meth:`RunConfig.from_dict`
what a user wrote (today's defaults for whatever it leaves out).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import math
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from flarepp.device import PRECISIONS
from flarepp.validate import require_positive

# How a run executes, not what it computes: a run may resume with other values.
RUNTIME_FIELDS = ("device", "compile", "loader_workers", "eval_chunk_size",
                  "keep_checkpoints")

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
                "eval_every", "plot_cases", "keep_checkpoints"),
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
    evaluation meshes in chunks of that many points; ``keep_checkpoints`` K keeps the K
    newest checkpoints of the run plus the one of the epoch with the best recorded metric
    (``None`` keeps every one; older ones are deleted only after a newer one is written).

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

    def __post_init__(self) -> None:
        check_types(self, "run config")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, "
                             f"got {self.precision!r}")
        require_positive(self, ("epochs", "batch_size", "checkpoint_every", "eval_every"))
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1) (the share of the training "
                             f"split held out for validation), got {self.val_fraction}")
        self.betas = tuple(self.betas)
        if self.momentum_cycle is not None:
            self.momentum_cycle = tuple(self.momentum_cycle)
            base, top = self.momentum_cycle
            if not 0.0 <= base <= top < 1.0:
                raise ValueError(f"momentum_cycle must be (base, max) with 0 <= base <= max "
                                 f"< 1, got {self.momentum_cycle}")
        if isinstance(self.attn_scale, str) and self.attn_scale not in ATTN_SCALE_WORDS:
            raise ValueError(f"attn_scale must be a positive number or one of "
                             f"{', '.join(ATTN_SCALE_WORDS)}, got {self.attn_scale!r}")
        if not isinstance(self.attn_scale, str) and not self.attn_scale > 0:
            raise ValueError(f"attn_scale must be positive, got {self.attn_scale}")
        if self.eval_weights not in EVAL_WEIGHTS:
            raise ValueError(f"eval_weights must be one of {', '.join(EVAL_WEIGHTS)}, got "
                             f"{self.eval_weights!r}")
        if self.latent_schedule is not None:
            last = self.schedule().milestones[-1][0]  # parses, or raises naming the problem
            if last >= self.epochs:
                raise ValueError(f"latent_schedule {self.latent_schedule!r}: the growth at "
                                 f"epoch {last} never happens in a run of epochs={self.epochs} "
                                 f"(growth epochs count from 0 and must be below {self.epochs})")
        if self.loader_workers < -1:
            raise ValueError(f"loader_workers must be -1 (automatic) or a count >= 0, got "
                             f"{self.loader_workers}")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be at least 1 (the checkpoint to resume "
                             f"from), or None to keep every one; got {self.keep_checkpoints}")
        self._check_model()
        self._check_dataset()

    # -- checks against the registries -----------------------------------------------------
    def _check_model(self) -> None:
        """Every ``model`` key a field of the architecture's (and mixer's) config class,
        with a value of that field's type."""
        from flarepp.models import MODELS
        model = dict(self.model)
        arch = model.pop("arch", "surrogate")
        cls = model_config_class(arch)
        data_fields = {"in_dim", "out_dim"}
        known = {f.name: f for f in dataclasses.fields(cls) if f.name not in data_fields}
        unknown = sorted(set(model) - set(known))
        if unknown:
            raise ValueError(f"model key(s) {unknown} unknown to architecture {arch!r}; "
                             f"its keys: arch, {', '.join(sorted(known))} (in_dim and out_dim "
                             "come from the data)")
        check_types(model, f"model ({arch})", hints=_type_hints(cls))
        if not isinstance(self.attn_scale, str) and "attn_scale" not in known:
            raise ValueError(f"attn_scale={self.attn_scale} given, but architecture {arch!r} "
                             "has no SDPA scale option")
        mixer = model.get("mixer", _field_default(cls, "mixer"))
        if mixer is not None and "mixer" in known:
            from flarepp.mixers import MIXERS
            mixer_cls = MIXERS.get(mixer).config_cls
            shared = {"dim", "heads", "latents", "norm", "attn_scale"}
            options = dict(model.get("mixer_options") or {})
            allowed = {f.name for f in dataclasses.fields(mixer_cls)} - shared
            bad = sorted(set(options) - allowed)
            if bad:
                known = ", ".join(sorted(allowed)) or "(none)"
                raise ValueError(f"model.mixer_options key(s) {bad} unknown to mixer "
                                 f"{mixer!r}; its options: {known}")
            check_types(options, f"model.mixer_options ({mixer})",
                        hints=_type_hints(mixer_cls))
        MODELS.entry(arch)

    def _check_dataset(self) -> None:
        """The dataset registered, ``dataset_options`` among its loader's keyword options."""
        import inspect

        from flarepp.data import DATASETS
        loader = DATASETS.get(self.dataset)
        params = {name: p for name, p in inspect.signature(loader).parameters.items()
                  if name != "root" and p.kind is inspect.Parameter.KEYWORD_ONLY}
        unknown = sorted(set(self.dataset_options) - set(params))
        if unknown:
            raise ValueError(f"dataset_options key(s) {unknown} unknown to dataset "
                             f"{self.dataset!r}; its options: "
                             f"{', '.join(sorted(params)) or '(none)'}")
        hints = _type_hints(getattr(loader, "__wrapped__", loader))
        check_types(self.dataset_options, f"dataset_options ({self.dataset})", hints=hints)

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

    def schedule(self):
        """The :class:`flarepp.rank_growth.LatentSchedule` of ``latent_schedule`` (or None)."""
        if self.latent_schedule is None:
            return None
        from flarepp.rank_growth import LatentSchedule
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
        return REFERENCE_ATTN_SCALE.get(kwargs.get("mixer", _field_default(cls, "mixer")))

    def sdpa_scale(self) -> float | None:
        """The SDPA scale the run's model uses (``None`` if it has no such option)."""
        kwargs = self.model_kwargs()
        cls = model_config_class(kwargs.get("arch", "surrogate"))
        if "attn_scale" not in {f.name for f in dataclasses.fields(cls)}:
            return None
        scale = kwargs.get("attn_scale")
        if scale is not None:
            return float(scale)
        dim, heads = (kwargs.get(k, _field_default(cls, k)) for k in ("dim", "heads"))
        return 1.0 / math.sqrt(dim // heads)


    def sdpa_scale_text(self) -> str:
        """:meth:`sdpa_scale` as a report writes it: ``1``, ``1/sqrt(16)``, ``-``."""
        kwargs = self.model_kwargs()
        cls = model_config_class(kwargs.get("arch", "surrogate"))
        dim, heads = (kwargs.get(k, _field_default(cls, k)) for k in ("dim", "heads"))
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
    from flarepp.models import MODELS, SurrogateConfig
    return getattr(MODELS.get(arch), "config_cls", SurrogateConfig)


def _field_default(cls: type, name: str) -> Any:
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    return None


# -- value types -------------------------------------------------------------------------------

def _type_hints(obj: Any) -> dict[str, Any]:
    """Resolved annotations of a dataclass or function; ``{}`` when they cannot be
    resolved (names only then get checked)."""
    try:
        return typing.get_type_hints(obj)
    except (NameError, TypeError):
        return {}


def conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` (as read from JSON or a Python literal) has type ``hint``.

    ``int`` excludes ``bool``; ``float`` takes ints; ``tuple``/``list`` hints take either
    sequence (JSON has no tuples).
    """
    if hint is Any or isinstance(hint, typing.TypeVar):
        return True
    if hint is type(None) or hint is None:
        return value is None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, a) for a in args)
    if origin is typing.ClassVar:
        return True
    if origin is typing.Literal:
        return value in args
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (tuple, list) or hint in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return False
        if not args:
            return True
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return len(value) == len(args) and all(map(conforms, value, args))
        return all(conforms(v, args[0]) for v in value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            return False
        return not args or all(conforms(k, args[0]) and conforms(v, args[1])
                               for k, v in value.items())
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # an annotation this checker does not model (a Protocol, a string...)


def _type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def check_types(values: Any, what: str, *, hints: dict[str, Any] | None = None) -> None:
    """Raise a ``ValueError`` naming the first of ``values`` (a dataclass or a dict of
    keyword values) whose value does not have its annotated type."""
    if hints is None:
        hints = _type_hints(type(values))
        items = [(f.name, getattr(values, f.name)) for f in dataclasses.fields(values)]
    else:
        items = list(values.items())
    for name, value in items:
        if name in hints and not conforms(value, hints[name]):
            raise ValueError(f"{what}: {name} must be of type {_type_name(hints[name])}, "
                             f"got {value!r} ({type(value).__name__})")


# -- --set overrides ---------------------------------------------------------------------------

def parse_value(text: str) -> Any:
    """A ``--set`` value: a Python literal (``8``, ``1e-3``, ``None``, ``[1, 2]``), else the
    bare word as a string (``flarepp``, ``rmsnorm``)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


SECTIONS = ("model", "dataset_options", "model.mixer_options")


def apply_overrides(config: RunConfig, overrides: list[str]) -> RunConfig:
    """``["model.latents=32", "epochs=3"]`` -> a new, checked config.

    An unknown key, a value of the wrong type or an option the dataset or model does not
    take raises a ``ValueError`` naming the key and the known ones (nothing is loaded)."""
    d = copy.deepcopy(config.to_dict())
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) == 1 and (parts[0] not in d or parts[0] == VERSION_KEY):
            raise ValueError(f"--set {key}: unknown key; known keys: {', '.join(sorted(d))} "
                             f"and the sections {', '.join(SECTIONS)} (e.g. model.latents)")
        target = d
        for depth, part in enumerate(parts[:-1]):
            if part not in target and ".".join(parts[:depth + 1]) in SECTIONS:
                target[part] = {}
            if not isinstance(target.get(part), dict):
                raise ValueError(f"--set {key}: {'.'.join(parts[:depth + 1])!r} is not a "
                                 f"section of the config (sections: {', '.join(SECTIONS)})")
            target = target[part]
        target[parts[-1]] = parse_value(text.strip())
    try:
        return RunConfig.from_dict(d)
    except ValueError as err:
        keys = ", ".join(item.split("=", 1)[0] for item in overrides)
        raise ValueError(f"{err} (with --set {keys})" if overrides else str(err)) from None


__all__ = ["ADDED_SINCE", "ATTN_SCALE_WORDS", "CONFIG_VERSION", "EVAL_WEIGHTS", "FILE_SECTIONS",
           "LEGACY_PROTOCOL", "VERSION_KEY", "flatten_sections", "REFERENCE_ATTN_SCALE",
           "RUNTIME_FIELDS", "RunConfig", "apply_overrides", "check_types", "conforms",
           "describe_scale", "model_config_class", "parse_value", "stored_version"]
