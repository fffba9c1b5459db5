"""Token mixers, registered by name in :data:`MIXERS`."""

from __future__ import annotations

import dataclasses

from flarepp.mixers import attention as _attention  # noqa: F401  (registers)
from flarepp.mixers import flare as _flare  # noqa: F401  (registers)
from flarepp.mixers import abupt as _abupt  # noqa: F401  (registers)
from flarepp.mixers import luna as _luna  # noqa: F401  (registers)
from flarepp.mixers import linear_attention as _linear_attention  # noqa: F401  (registers)
from flarepp.mixers import linformer as _linformer  # noqa: F401  (registers)
from flarepp.mixers import nystromformer as _nystromformer  # noqa: F401  (registers)
from flarepp.mixers import transolver as _transolver  # noqa: F401  (registers)
from flarepp.mixers import causal as _causal  # noqa: F401  (registers)
from flarepp.mixers import rank_adaptive as _rank_adaptive  # noqa: F401  (registers)
from flarepp.mixers import higher_order as _higher_order  # noqa: F401  (registers)
from flarepp.mixers import cross as _cross  # noqa: F401  (registers)
from flarepp.mixers.base import Mixer, MixerConfig
from flarepp.mixers.registry import MIXERS


def list_mixers() -> list[str]:
    """Names of the registered mixers."""
    return MIXERS.names()


def mixer_config(name: str, **kwargs) -> MixerConfig:
    """The config of mixer ``name`` with its registered defaults and ``kwargs`` applied."""
    entry = MIXERS.entry(name)
    cls = entry.obj.config_cls
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise TypeError(f"mixer {name!r} takes no option(s) {unknown}; "
                        f"its options are {sorted(fields)}")
    return cls(**{**entry.defaults, **kwargs})


def build_mixer(name: str, **kwargs) -> Mixer:
    """Build a registered mixer: ``build_mixer("flarepp", dim=128, heads=8, latents=64)``."""
    return MIXERS.get(name)(mixer_config(name, **kwargs))


__all__ = ["MIXERS", "Mixer", "MixerConfig", "build_mixer", "list_mixers", "mixer_config"]
