"""The registry of complete models by architecture name (filled by :mod:`flarepp.models`)."""

from flarepp.registry import Registry

MODELS: Registry = Registry("model")
