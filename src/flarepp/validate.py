"""Checks shared by the config dataclasses of mixers, models and runs."""

from __future__ import annotations


def require_positive(config: object, names: tuple[str, ...], owner: str = "") -> None:
    """Raise a ``ValueError`` naming the first of ``names`` that is not a positive number."""
    prefix = f"{owner}: " if owner else ""
    for name in names:
        value = getattr(config, name)
        if not value > 0:
            raise ValueError(f"{prefix}{name} must be positive, got {value}")
