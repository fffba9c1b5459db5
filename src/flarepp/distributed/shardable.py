"""Which mixers and models are exact when their tokens are split (App. B.4).

Token sharding and streaming replace a mixer's ``backend.encode`` by a merge of partial
encodes and leave everything else local. That is exact only for a model whose every
token-global operation is a backend ``encode`` and whose other layers act per token. A mixer
or model class declares that with the class attribute ``token_shardable = True`` (the way
every other capability -- ``permutation_equivariant``, ``stochastic_in_training`` -- is
declared); anything else is refused with an error rather than silently computed per shard.
Full attention is not shardable: its N x N softmax needs every key for every query, which
no latent merge provides.
"""

from __future__ import annotations

from typing import Iterator

from torch import nn

from flarepp.mixers import MIXERS, Mixer
from flarepp.models import MODELS
from flarepp.ops import AttentionBackend, set_backend
from flarepp.registry import Registry


def is_token_shardable(cls: type) -> bool:
    """Whether ``cls`` (or a base class) declares ``token_shardable = True``."""
    return bool(getattr(cls, "token_shardable", False))


class ShardableNames:
    """A read-only view: the names in ``registry`` whose class is token-shardable.

    Computed on every use, so a mixer or model registered later is included; supports
    ``name in view``, iteration, ``len`` and ``names()`` like a registry.
    """

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def names(self) -> list[str]:
        return [name for name in self._registry.names()
                if is_token_shardable(self._registry.get(name))]

    def __contains__(self, name: object) -> bool:
        return name in self._registry and is_token_shardable(self._registry.get(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"ShardableNames({self._registry.kind}: {', '.join(self.names())})"


SHARDABLE_MIXERS = ShardableNames(MIXERS)
SHARDABLE_MODELS = ShardableNames(MODELS)


def _registered_names(registry: Registry, cls: type) -> list[str]:
    return [name for name in registry.names() if registry.get(name) is cls]


def check_token_shardable(model: nn.Module, purpose: str) -> None:
    """Raise a ``ValueError`` unless every mixer and model class in ``model`` is shardable."""
    mixers = 0
    for path, module in model.named_modules():
        if isinstance(module, Mixer):
            mixers += 1
            if not is_token_shardable(type(module)):
                names = _registered_names(MIXERS, type(module))
                label = "/".join(names) or type(module).__name__
                raise ValueError(
                    f"{purpose}: mixer {label!r} at {path or '(top)'} mixes tokens outside "
                    "the latent encode, so its tokens cannot be split exactly (full "
                    "attention needs every key for every query); token-shardable mixers: "
                    f"{', '.join(SHARDABLE_MIXERS.names())}")
        else:
            names = _registered_names(MODELS, type(module))
            if names and not is_token_shardable(type(module)):
                raise ValueError(
                    f"{purpose}: model architecture {names[0]!r} is not known to be "
                    "pointwise outside its mixers; token-shardable models: "
                    f"{', '.join(SHARDABLE_MODELS.names())}")
    if mixers == 0:
        raise ValueError(f"{purpose}: {type(model).__name__} holds no flarepp mixer, so there "
                         "is no encoder to merge across token shards")


def install_backend(model: nn.Module, backend: AttentionBackend
                    ) -> list[tuple[nn.Module, AttentionBackend]]:
    """Route every mixer of ``model`` through ``backend``; returns what to restore
    (:func:`flarepp.ops.set_backend`'s record of what it replaced)."""
    return set_backend(model, backend)


def restore_backends(previous: list[tuple[nn.Module, AttentionBackend]]) -> None:
    """Undo :func:`install_backend`: each module gets back the backend it had."""
    for module, backend in previous:
        module.backend = backend
