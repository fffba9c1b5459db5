"""flarepp: FLARE and FLARE++ low-rank attention for neural PDE surrogates.

Public API::

    import flarepp
    flarepp.list_mixers()
    mixer = flarepp.build_mixer("flarepp", dim=128, heads=8, latents=64)
    model = flarepp.build_model(mixer="flarepp", in_dim=2, out_dim=1, dim=128, heads=8,
                                blocks=8, latents=64)
    y = model(x, mask=None)   # [B, N, in_dim] -> [B, N, out_dim]

    p = flarepp.load("runs/darcy-tiny")        # a trained run: p.surrogate, p.execution
    u = p.predict(points, features=a)          # fields in physical units (NumPy)

The package root sits on the top floor (``api``, docs/architecture.md); ``load``,
``Predictor`` and ``Execution`` are imported on first use, so ``import flarepp.ops`` stays
light.
"""

from flarepp.mixers import MIXERS, Mixer, MixerConfig, build_mixer, list_mixers
from flarepp.models import MODELS, Surrogate, build_model, list_models, model_from_config
from flarepp.models.backbone import compile_model
from flarepp.ops import decode, encode, encode_with_lse, set_backend
from flarepp.version import __version__

_API = ("load", "Predictor", "Execution")


def __getattr__(name: str):
    if name in _API:
        from flarepp import api
        return getattr(api, name)
    raise AttributeError(f"module 'flarepp' has no attribute {name!r}")


__all__ = [
    "Execution", "MIXERS", "MODELS", "Mixer", "MixerConfig", "Predictor", "Surrogate",
    "__version__", "build_mixer",
    "build_model", "compile_model", "decode", "encode", "encode_with_lse", "list_mixers",
    "list_models", "load", "model_from_config", "set_backend",
]
