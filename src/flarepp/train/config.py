"""Run configuration (paper Tables 7-8, C.2; FACTS.md section 3) and ``--set`` overrides."""

from __future__ import annotations

import ast
import copy
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from flarepp.device import PRECISIONS
from flarepp.validate import require_positive

# How a run executes, not what it computes: a run may resume with other values.
RUNTIME_FIELDS = ("device", "compile", "loader_workers", "eval_chunk_size")


@dataclass(kw_only=True)
class RunConfig:
    """Everything a training run depends on; stored in every checkpoint.

    ``model`` holds ``build_model`` keywords except ``in_dim``/``out_dim`` (taken from the
    data). ``model.norm`` unset means LayerNorm for FP32 and RMSNorm for mixed precision
    (C.2). Optimisation follows the FLARE study: AdamW (0.9, 0.999, 1e-8), one-cycle
    (cosine, ``pct_start`` 0.1, ``div_factor`` = ``final_div_factor`` = 1e4) stepped per
    batch, gradient clipping at 1.0, EMA of the weights with decay 0.999.

    ``task`` names the registered task (:mod:`flarepp.tasks`). The runtime fields (device,
    compile, loader workers, streaming chunk of evaluation) change how a run executes, not
    what it computes, so a run may be resumed with other values: ``device`` is ``auto``
    (``cuda:LOCAL_RANK`` when CUDA is available, else the CPU), ``cpu``, ``cuda`` or
    ``cuda:K``; ``loader_workers`` -1 means 2 worker processes on CUDA and none on the CPU
    (where they would compete with the compute for the cores); ``eval_chunk_size`` streams
    evaluation meshes in chunks of that many points.
    """

    name: str
    dataset: str
    task: str = "fields"
    dataset_options: dict[str, Any] = field(default_factory=dict)
    data_root: str = "data"
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
    precision: str = "fp32"
    seed: int = 0
    checkpoint_every: int = 10
    eval_every: int = 1
    plot_cases: int = 3
    device: str = "auto"
    compile: bool = False
    loader_workers: int = -1
    eval_chunk_size: int | None = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, "
                             f"got {self.precision!r}")
        require_positive(self, ("epochs", "batch_size", "checkpoint_every", "eval_every"))
        self.betas = tuple(self.betas)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def identity(self) -> dict[str, Any]:
        """What the run computes: the config without its runtime fields."""
        return {k: v for k, v in self.to_dict().items() if k not in RUNTIME_FIELDS}

    def workers(self, device_type: str) -> int:
        if self.loader_workers >= 0:
            return self.loader_workers
        return 2 if device_type == "cuda" else 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown run config key(s) {unknown}")
        return cls(**d)

    def model_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.model)
        if kwargs.get("norm") is None:
            kwargs["norm"] = "layernorm" if self.precision == "fp32" else "rmsnorm"
        return kwargs


def _parse_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word such as flarepp or rmsnorm


def apply_overrides(config: RunConfig, overrides: list[str]) -> RunConfig:
    """``["model.latents=32", "epochs=3"]`` -> a new config; unknown keys are errors."""
    d = copy.deepcopy(config.to_dict())
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        target = d
        for part in parts[:-1]:
            if not isinstance(target.get(part), dict):
                raise ValueError(f"--set {key}: {part!r} is not a section of the config "
                                 f"(sections: model, dataset_options)")
            target = target[part]
        if len(parts) == 1 and parts[0] not in d:
            raise ValueError(f"--set {key}: unknown key; known keys: {', '.join(sorted(d))}")
        target[parts[-1]] = _parse_value(text.strip())
    return RunConfig.from_dict(d)
