"""Complete models, registered by architecture name in :data:`MODELS`.

``build_model(arch="surrogate", mixer="flarepp", in_dim=2, out_dim=1, ...)`` builds the
shared residual backbone around a mixer; other architectures register their own config
class and builder. ``model_from_config(model.config.to_dict())`` rebuilds any of them.
:class:`~flarepp.models.surrogate.Surrogate` is a model with its maps to physical units.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from flarepp.models.backbone import (TRANSOLVER_BACKBONE, SurrogateConfig, SurrogateModel,
                                     TransolverBackbone)
from flarepp.models.gnot import GNOT
from flarepp.models.lno import LNO
from flarepp.models.luna import LunaSurrogate
from flarepp.models.perceiver_io import PerceiverIO
from flarepp.models.set_transformer import SetTransformer
from flarepp.models.sequence import SequenceClassifier
from flarepp.models.registry import MODELS
from flarepp.models.surrogate import Surrogate, UnitMaps

MODELS.add("surrogate", SurrogateModel,
           doc="shared residual backbone of Table 7 around a registered mixer")
# The Transolver family's skeleton as options of the same backbone: NVIDIA PhysicsNeMo's
# FLARE model (physicsnemo.models.flare.FLARE, v2.2) with its defaults.
MODELS.add("transolver-backbone", TransolverBackbone, defaults=TRANSOLVER_BACKBONE,
           doc="the backbone as the Transolver skeleton (PhysicsNeMo's FLARE): input MLP "
               "in -> 2C -> C, one-Linear head, exact GELU, FFN ratio 4")
# The comparison architectures of Table 9 (paper Sec. C.3).
MODELS.add("luna", LunaSurrogate,
           doc="the backbone with Luna layers and their packed stream carried across blocks")
MODELS.add("set-transformer", SetTransformer,
           doc="Set Transformer: an ISAB with M inducing points replaces each block")
MODELS.add("perceiver-io", PerceiverIO,
           doc="PerceiverIO: 512 latents, 8 latent self-attention blocks, MLP ratio 4")
MODELS.add("gnot", GNOT, doc="GNOT: normalized linear attention, geometry-gated 3 experts")
MODELS.add("lno", LNO, doc="Latent Neural Operator: 256 latent modes, 4 latent blocks")
# Long Range Arena (paper Sec. 4.3, D.5): token ids in, class logits out.
MODELS.add("sequence-classifier", SequenceClassifier,
           doc="LRA classifier: embeddings, blocks around a mixer, pooling, MLP head")


from flarepp.models import causal_lm as _causal_lm  # noqa: E402,F401  (registers)
from flarepp.models import conditioned as _conditioned  # noqa: E402,F401  (registers)


def list_models() -> list[str]:
    return MODELS.names()


def _config_cls(model_cls: type) -> type:
    return getattr(model_cls, "config_cls", SurrogateConfig)


def build_model(arch: str = "surrogate", **kwargs: Any) -> nn.Module:
    """Build a registered architecture from keyword settings (see its config class)."""
    entry = MODELS.entry(arch)
    cls = _config_cls(entry.obj)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise TypeError(f"model {arch!r} takes no option(s) {unknown}; "
                        f"its options are {sorted(fields)}")
    return entry.obj(cls(**{**entry.defaults, **kwargs}))


def model_from_config(config: dict[str, Any]) -> nn.Module:
    """Rebuild a model from ``model.config.to_dict()`` (as stored in checkpoints)."""
    config = dict(config)
    return build_model(config.pop("arch", "surrogate"), **config)


__all__ = ["MODELS", "Surrogate", "SurrogateConfig", "SurrogateModel", "UnitMaps",
           "build_model", "list_models", "model_from_config"]
