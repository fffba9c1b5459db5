"""Checks shared by the config dataclasses of mixers, models and runs."""

from __future__ import annotations

from typing import Iterable


def require_positive(config: object, names: tuple[str, ...], owner: str = "") -> None:
    """Raise a ``ValueError`` naming the first of ``names`` that is not a positive number."""
    prefix = f"{owner}: " if owner else ""
    for name in names:
        value = getattr(config, name)
        if not value > 0:
            raise ValueError(f"{prefix}{name} must be positive, got {value}")


def require_choice(config: object, name: str, choices: Iterable[str], owner: str = "") -> None:
    """Raise a ``ValueError`` naming ``name`` when its value is not one of ``choices``."""
    value, choices = getattr(config, name), tuple(choices)
    if value not in choices:
        prefix = f"{owner}: " if owner else ""
        raise ValueError(f"{prefix}{name} must be one of {', '.join(choices)}, got {value!r}")
