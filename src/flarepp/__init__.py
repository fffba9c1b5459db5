"""flarepp: FLARE and FLARE++ low-rank attention for neural PDE surrogates.

Public API::

    import flarepp
    flarepp.list_mixers()
    mixer = flarepp.build_mixer("flarepp", dim=128, heads=8, latents=64)
    model = flarepp.build_model(mixer="flarepp", in_dim=2, out_dim=1, dim=128, heads=8,
                                blocks=8, latents=64)
    y = model(x, mask=None)   # [B, N, in_dim] -> [B, N, out_dim]
"""

from flarepp.mixers import MIXERS, Mixer, MixerConfig, build_mixer, list_mixers
from flarepp.models import MODELS, build_model, list_models, model_from_config
from flarepp.models.backbone import compile_model
from flarepp.ops import decode, encode, encode_with_lse, set_backend

__version__ = "0.1.0"

__all__ = [
    "MIXERS", "MODELS", "Mixer", "MixerConfig", "build_mixer", "build_model", "compile_model",
    "decode", "encode", "encode_with_lse", "list_mixers", "list_models", "model_from_config",
    "set_backend",
]
