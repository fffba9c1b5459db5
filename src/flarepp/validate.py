"""Checks shared by the config dataclasses of mixers, models and runs: positive numbers, a
choice among names, and the annotated type of every field (:func:`check_types`, which the run
config's one check, :func:`flarepp.train.validate`, applies to every section)."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Iterable


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


def type_hints(obj: Any) -> dict[str, Any]:
    """Resolved annotations of a dataclass or function; ``{}`` when they cannot be
    resolved (names only then get checked)."""
    try:
        return typing.get_type_hints(obj)
    except (NameError, TypeError):
        return {}


def conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` (as read from JSON or a Python literal) has type ``hint``.

    ``int`` excludes ``bool``; ``float`` takes ints; ``tuple``/``list`` hints take either
    sequence (JSON has no tuples).
    """
    if hint is Any or isinstance(hint, typing.TypeVar):
        return True
    if hint is type(None) or hint is None:
        return value is None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, a) for a in args)
    if origin is typing.ClassVar:
        return True
    if origin is typing.Literal:
        return value in args
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (tuple, list) or hint in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return False
        if not args:
            return True
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return len(value) == len(args) and all(map(conforms, value, args))
        return all(conforms(v, args[0]) for v in value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            return False
        return not args or all(conforms(k, args[0]) and conforms(v, args[1])
                               for k, v in value.items())
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # an annotation this checker does not model (a Protocol, a string...)


def _type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def check_types(values: Any, what: str, *, hints: dict[str, Any] | None = None) -> None:
    """Raise a ``ValueError`` naming the first of ``values`` (a dataclass or a dict of
    keyword values) whose value does not have its annotated type."""
    if hints is None:
        hints = type_hints(type(values))
        items = [(f.name, getattr(values, f.name)) for f in dataclasses.fields(values)]
    else:
        items = list(values.items())
    for name, value in items:
        if name in hints and not conforms(value, hints[name]):
            raise ValueError(f"{what}: {name} must be of type {_type_name(hints[name])}, "
                             f"got {value!r} ({type(value).__name__})")
