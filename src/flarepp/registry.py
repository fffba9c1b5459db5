"""Name -> builder registries for mixers, models, datasets and presets.

A registry maps a public name (``"flarepp"``) to an object and an optional dict of default
keyword overrides, so a variant is a registered (class, defaults) pair rather than a new
branch in a factory. Unknown names raise a ``ValueError`` that lists the known ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    obj: T
    defaults: dict[str, Any] = field(default_factory=dict)
    doc: str = ""


class Registry(Generic[T]):
    """A named collection; ``kind`` is used in error messages ("mixer", "model", ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, *, defaults: dict[str, Any] | None = None,
                 doc: str = "") -> Callable[[T], T]:
        def wrap(obj: T) -> T:
            self.add(name, obj, defaults=defaults, doc=doc)
            return obj
        return wrap

    def add(self, name: str, obj: T, *, defaults: dict[str, Any] | None = None,
            doc: str = "") -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = Entry(name, obj, dict(defaults or {}), doc)

    def entry(self, name: str) -> Entry[T]:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self.names()) or "(none)"
            raise ValueError(f"unknown {self.kind} {name!r}; known {self.kind}s: {known}") from None

    def get(self, name: str) -> T:
        return self.entry(name).obj

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)
