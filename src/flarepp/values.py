"""The one reading of a value typed on the command line: ``--set``, ``--grid`` and ``--option``.

* :func:`parse_value` -- ``"8"`` -> 8, ``"1e-3"`` -> 0.001, ``"None"`` -> None,
  ``"[1, 2]"`` -> [1, 2], ``"(0.9, 0.99)"`` -> (0.9, 0.99), ``"True"`` -> True: a Python
  literal; any other text is the bare word itself (``flarepp``, ``rmsnorm``). Every option
  that takes ``KEY=VALUE`` reads its value here, so ``--set lr=1e-3``, a grid value
  ``lr=1e-3,3e-3`` and ``data check --option n_test=4`` mean the same thing.
* :func:`split_assignment` / :func:`parse_assignments` -- ``KEY=VALUE`` items.
* :func:`split_values`, :func:`parse_range` -- the grid's syntax: ``V1,V2,...`` (commas inside
  brackets or quotes belong to one value) and the ranges an adaptive search samples
  (``LOW:HIGH[:log]`` real, ``LOW..HIGH[:log]`` integer).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any


def parse_value(text: str) -> Any:
    """A typed value: a Python literal (``8``, ``1e-3``, ``None``, ``[1, 2]``, ``True``),
    else the bare word as a string. Nothing is evaluated beyond literals."""
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, RecursionError):
        return text.strip()


def split_assignment(item: str, option: str) -> tuple[str, str]:
    """``"model.latents=32"`` -> ``("model.latents", "32")``; anything without ``=`` or with
    an empty key is a ``ValueError`` naming ``option``."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"{option} expects KEY=VALUE, got {item!r}")
    return key.strip(), text


def parse_assignments(items: list[str], option: str) -> dict[str, Any]:
    """``["n_test=4", "kind=hard"]`` -> ``{"n_test": 4, "kind": "hard"}`` (:func:`parse_value`);
    a key given twice is an error naming it."""
    values: dict[str, Any] = {}
    for item in items:
        key, text = split_assignment(item, option)
        if key in values:
            raise ValueError(f"{option} {key}: given twice")
        values[key] = parse_value(text)
    return values


def split_values(text: str, option: str = "--grid") -> list[str]:
    """``"flare,flarepp"`` -> ``["flare", "flarepp"]``; commas inside brackets or quotes
    belong to one value (``"[none,standard],standard"`` is two values). The values stay
    text (a grid point is named after them); :func:`parse_value` reads each."""
    values, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            values.append(text[start:i].strip())
            start = i + 1
    values.append(text[start:].strip())
    if any(not v for v in values):
        raise ValueError(f"{option}: empty value in {text!r}")
    return values


def parse_axes(items: list[str], option: str = "--grid") -> list[tuple[str, list[str]]]:
    """``["seed=0,1", "model.blocks=2,4"]`` -> ``[("seed", ["0", "1"]), ...]``."""
    axes: list[tuple[str, list[str]]] = []
    for item in items:
        if "=" not in item:
            raise ValueError(f"{option} expects KEY=V1,V2,..., got {item!r}")
        key, text = split_assignment(item, option)
        if key in (k for k, _ in axes):
            raise ValueError(f"{option}: key {key!r} given twice")
        values = split_values(text, option)
        if len(set(values)) != len(values):
            raise ValueError(f"{option} {key}: repeated value in {values}")
        axes.append((key, values))
    return axes


_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_RANGE = re.compile(rf"^(?P<low>{_NUMBER})(?P<sep>:|\.\.)(?P<high>{_NUMBER})(?P<log>:log)?$")


@dataclass(frozen=True)
class Range:
    """A search axis's interval, both ends included: real numbers ``LOW:HIGH`` (uniform)
    or ``LOW:HIGH:log`` (log-uniform), integers ``LOW..HIGH`` or ``LOW..HIGH:log``."""

    low: float
    high: float
    integer: bool
    log: bool

    def text(self) -> str:
        ends = (f"{int(self.low)}..{int(self.high)}" if self.integer
                else f"{self.low:g}:{self.high:g}")
        return ends + (":log" if self.log else "")


def parse_range(key: str, text: str, option: str = "--grid") -> Range | None:
    """The range ``text`` writes (:class:`Range`), or None when it is not one (a value)."""
    match = _RANGE.match(text.strip())
    if match is None:
        return None
    integer, log = match["sep"] == "..", bool(match["log"])
    kind = int if integer else float
    try:
        low, high = kind(match["low"]), kind(match["high"])
    except ValueError:
        raise ValueError(f"{option} {key}={text}: an integer range is LOW..HIGH with whole "
                         "numbers (a real one LOW:HIGH)") from None
    if not low < high:
        raise ValueError(f"{option} {key}={text}: the range's low end must be below its high "
                         "end")
    if log and low <= 0:
        raise ValueError(f"{option} {key}={text}: a log range needs a positive low end")
    return Range(low, high, integer, log)


__all__ = ["Range", "parse_assignments", "parse_axes", "parse_range", "parse_value",
           "split_assignment", "split_values"]
