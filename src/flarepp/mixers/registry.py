"""The mixer registry: ``MIXERS.register(name)`` on a :class:`~flarepp.mixers.base.Mixer`."""

from __future__ import annotations

from flarepp.registry import Registry

MIXERS: Registry = Registry("mixer")
