"""Which registered mixers and models are exact when their tokens are split (App. B.4).

Token sharding and streaming replace a mixer's ``backend.encode`` by a merge of partial
encodes and leave everything else local. That is exact only for a model whose every
token-global operation is a backend ``encode`` and whose other layers act per token. A
mixer or model declares that here, by its registry name; anything else is refused with an
error rather than silently computed per shard. Full attention is not here: its N x N
softmax needs every key for every query, which no latent merge provides.
"""

from __future__ import annotations

from torch import nn

from flarepp.mixers import MIXERS, Mixer
from flarepp.models import MODELS
from flarepp.ops import AttentionBackend
from flarepp.registry import Registry

SHARDABLE_MIXERS: Registry = Registry("token-shardable mixer")
SHARDABLE_MODELS: Registry = Registry("token-shardable model")

SHARDABLE_MIXERS.add("flare", True, doc="one encode per block (B.4)")
SHARDABLE_MIXERS.add("flarepp", True, doc="two encodes per block: synthesis, then gather")
SHARDABLE_MIXERS.add("flarepp-simple", True, doc="two encodes per block")
SHARDABLE_MIXERS.add("flarepp-v1", True, doc="two encodes per block")
SHARDABLE_MIXERS.add("luna", True, doc="pack = one encode per block; unpack = a local decode")
SHARDABLE_MODELS.add("surrogate", True, doc="pointwise io MLPs, norms and FFNs around mixers")
SHARDABLE_MODELS.add("luna", True, doc="the backbone plus a packed stream [B, M, C] that only "
                     "encodes update, so it is replicated exactly")


def _registered_names(registry: Registry, cls: type) -> list[str]:
    return [name for name in registry.names() if registry.get(name) is cls]


def check_token_shardable(model: nn.Module, purpose: str) -> None:
    """Raise a ``ValueError`` unless every mixer and model class in ``model`` is shardable."""
    mixers = 0
    for path, module in model.named_modules():
        if isinstance(module, Mixer):
            mixers += 1
            names = _registered_names(MIXERS, type(module))
            if not any(name in SHARDABLE_MIXERS for name in names):
                label = "/".join(names) or type(module).__name__
                raise ValueError(
                    f"{purpose}: mixer {label!r} at {path or '(top)'} mixes tokens outside "
                    "the latent encode, so its tokens cannot be split exactly (full "
                    "attention needs every key for every query); token-shardable mixers: "
                    f"{', '.join(SHARDABLE_MIXERS.names())}")
        else:
            names = _registered_names(MODELS, type(module))
            if names and not any(name in SHARDABLE_MODELS for name in names):
                raise ValueError(
                    f"{purpose}: model architecture {names[0]!r} is not known to be "
                    "pointwise outside its mixers; token-shardable models: "
                    f"{', '.join(SHARDABLE_MODELS.names())}")
    if mixers == 0:
        raise ValueError(f"{purpose}: {type(model).__name__} holds no flarepp mixer, so there "
                         "is no encoder to merge across token shards")


def install_backend(model: nn.Module, backend: AttentionBackend
                    ) -> list[tuple[nn.Module, AttentionBackend]]:
    """Route every mixer of ``model`` through ``backend``; returns what to restore."""
    previous = []
    for module in model.modules():
        if isinstance(getattr(module, "backend", None), AttentionBackend):
            previous.append((module, module.backend))
            module.backend = backend
    return previous


def restore_backends(previous: list[tuple[nn.Module, AttentionBackend]]) -> None:
    """Undo :func:`install_backend`."""
    for module, backend in previous:
        module.backend = backend
