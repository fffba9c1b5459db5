"""The FLARE study's own FLARE model, loaded at benchmark time for side-by-side timing.

The FLARE study publishes its code as the GitHub repository ``vpuri3/FLARE.py``; its
``pdebench/models/flare.py`` defines ``FLAREModel`` (residual input/output MLPs, pre-norm
blocks of FLARE and a residual-MLP FFN). flarepp neither depends on it nor copies it: a
user who has a clone names it (``flarepp bench scaling --reference-repo PATH``), and that
one file is imported from the clone when a benchmark point needs it. The file imports
``einops``, which must then be installed.

:func:`flare_study_model` builds it at the configuration of the paper's Table 7 that
flarepp's ``flare`` backbone has: C channels, H heads, M latents, linear key and value
projections (``num_layers_k_proj = num_layers_v_proj = -1``: ``x + x W``, the study's
residual linear), a GELU FFN of ratio 2 (``num_layers_ffn = 0``, ``ffn_mlp_ratio = 2``),
input and output MLPs with two hidden layers, flarepp's norm type, SDPA scale ``1/sqrt(D)`` (the
scale does not change the cost).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

from torch import nn

REFERENCE_MIXER = "flare-study"
"""The mixer name under which benchmarks list the FLARE study's model."""
MODEL_FILE = Path("pdebench") / "models" / "flare.py"


def _load_module(repo: Path) -> ModuleType:
    path = Path(repo).expanduser() / MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --reference-repo must be a clone of the "
                                f"FLARE study's repository (vpuri3/FLARE.py), which has "
                                f"{MODEL_FILE}")
    name = f"_flare_study_flare_{abs(hash(str(path.resolve())))}"  # one module per clone
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(f"{path} imports {err.name!r}, which is not installed; "
                                  f"install it to benchmark the FLARE study's model") from None
    sys.modules[name] = module
    return module


def flare_study_model(repo: str | Path, *, in_dim: int, out_dim: int, dim: int, heads: int,
                      blocks: int, latents: int, norm: str = "layernorm") -> nn.Module:
    """``FLAREModel`` from the clone at ``repo``, at flarepp's ``flare`` backbone settings
    (``norm``: ``layernorm`` or ``rmsnorm`` for the blocks, as flarepp's run)."""
    module = _load_module(Path(repo))
    return module.FLAREModel(
        in_dim=in_dim, out_dim=out_dim, channel_dim=dim, num_blocks=blocks, num_heads=heads,
        num_latents=latents, attn_scale=1.0 / math.sqrt(dim // heads),
        num_layers_in_out_proj=2, num_layers_k_proj=-1, num_layers_v_proj=-1,
        num_layers_ffn=0, ffn_mlp_ratio=2.0, rmsnorm=norm == "rmsnorm")
