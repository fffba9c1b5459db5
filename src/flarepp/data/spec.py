"""The conversion spec: what ``flarepp data convert`` takes from every case and where it goes.

A spec is a small TOML file (and/or command-line flags, which win over it). **Why TOML**:
a person writes it once by hand, so it needs comments (JSON has none) and typed values
without YAML's surprises (``no`` read as False, ``1e3`` as a string in YAML 1.1); Python
reads it with the standard library (``tomllib``, 3.11+; ``tomli`` before), so it adds no
dependency. Every key is checked; an unknown one is refused, naming it and the known ones.

.. code-block:: toml

    association = "point"                 # values at the points, or "cell" (cell centres)
    geometry = ["coordinates"]            # computed leading inputs (see GEOMETRY)
    inputs = []                           # arrays after the geometry, in order
    targets = [{array = "von_mises", name = "stress", units = "MPa", scale = 1e-6}]
    conditions = ["load"]                 # per-case scalars: field data, or table columns
    condition_table = "conditions.csv"    # optional: a CSV (column "case") or JSON table
    [split]
    test = "test/*"                       # cases whose name matches go to test; or
    # test_fraction = 0.2                 # a fixed-seed random share of the cases

An array is its name in the files, or a table ``{array, name, scale, units}``: stored under
``name`` (default the array's), multiplied by ``scale`` (a unit conversion) and labelled
with ``units``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from flarepp.data.base import validation_indices
from flarepp.data.layout import ASSOCIATIONS
from flarepp.data.meshes import MESH_FORMATS
from flarepp.io import UnsafeName, check_name

GEOMETRY = {"coordinates": "point positions, or cell centres with association 'cell'",
            "normals": "unit normals of 2-D cells (association 'cell')",
            "areas": "areas of 2-D cells (association 'cell')",
            "volumes": "volumes of 3-D cells (association 'cell')"}
"""The geometry channels a conversion computes, put first among the inputs in the order
given; ``coordinates``, when given, comes first (the leading coordinate channels)."""

SPEC_KEYS = {
    "association": "'point' or 'cell': where every value of a sample lives",
    "geometry": f"computed leading inputs, any of {', '.join(GEOMETRY)}",
    "inputs": "arrays after the geometry, in order",
    "targets": "arrays the model predicts",
    "conditions": "per-case scalars, from field data or condition_table",
    "condition_table": "a CSV (a 'case' column) or JSON table of conditions by case",
    "dimensions": "2 or 3 coordinates (default: 2 when every z of the first case is 0)",
    "format": "the mesh format to read (default: the one of the files' suffixes)",
    "pattern": "glob of the case files under the source (default: every mesh file)",
    "split": "a table: test (a glob of case names), val (a glob), or test_fraction",
}
ARRAY_KEYS = ("array", "name", "scale", "units")
SPLIT_KEYS = ("test", "val", "test_fraction")
DEFAULT_TEST_FRACTION = 0.2


class SpecError(ValueError):
    """A spec that cannot be used: the message names the file and the key (a usage
    error, exit status 2)."""


@dataclass(frozen=True)
class ArraySpec:
    """One array taken from every case: ``array`` in the files, stored as ``name``, its
    values times ``scale``, in ``units``."""

    array: str
    name: str
    scale: float = 1.0
    units: str = ""


@dataclass(frozen=True)
class SplitSpec:
    """Which cases are test (``test``, a glob of case names, or ``test_fraction``) and
    validation (``val``, a glob); the rest train."""

    test: str | None = None
    val: str | None = None
    test_fraction: float | None = None

    def assign(self, names: list[str]) -> dict[str, list[str]]:
        """``{"train", "test"[, "val"]: case names}`` for the sorted ``names``."""
        val = [n for n in names if self.val and fnmatch.fnmatch(n, self.val)]
        rest = [n for n in names if n not in set(val)]
        if self.test is not None:
            test = [n for n in rest if fnmatch.fnmatch(n, self.test)]
        else:
            fraction = DEFAULT_TEST_FRACTION if self.test_fraction is None else self.test_fraction
            held = validation_indices(len(rest), fraction, "split.test_fraction")[1] \
                if len(rest) > 1 else []
            test = [rest[i] for i in held]
        train = [n for n in rest if n not in set(test)]
        if self.test is not None and not test and rest:
            raise SpecError(f"split.test (--test-pattern) {self.test!r} matches none of the "
                            f"{len(rest)} cases (e.g. {rest[0]!r}): the store would have no "
                            "test split")
        if not train and names:
            raise SpecError(f"the split leaves no training case: of the {len(names)} cases "
                            f"{len(val)} match split.val and {len(test)} are test cases "
                            f"(split.test {self.test!r}, --test-pattern)")
        out = {"train": train, "test": test}
        if val:
            out["val"] = val
        return out


@dataclass(frozen=True)
class ConversionSpec:
    """A parsed, checked spec (module docstring)."""

    targets: tuple[ArraySpec, ...]
    inputs: tuple[ArraySpec, ...] = ()
    geometry: tuple[str, ...] = ("coordinates",)
    association: str = "point"
    conditions: tuple[ArraySpec, ...] = ()
    condition_table: str | None = None
    dimensions: int | None = None
    format: str | None = None
    pattern: str | None = None
    split: SplitSpec = field(default_factory=SplitSpec)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()
                              ).hexdigest()[:16]

    def with_table(self, path: str | None) -> "ConversionSpec":
        return replace(self, condition_table=path)


def _check_table(value: Any, keys: Any, what: str, where: str) -> None:
    """Raise unless ``value`` is a table (dict) of ``keys`` only, naming the unknown ones."""
    if not isinstance(value, dict):
        raise SpecError(f"{where}: {what} is a table of {', '.join(keys)}, got {value!r}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise SpecError(f"{where}: unknown key(s) {unknown}; {what} takes {', '.join(keys)}")


def _array(value: Any, where: str) -> ArraySpec:
    if isinstance(value, str) and value:
        return ArraySpec(value, value)
    _check_table(value, ARRAY_KEYS, "an array (or its name)", where)
    if not isinstance(value.get("array"), str) or not value["array"]:
        raise SpecError(f"{where}: the table {value!r} names no 'array'")
    scale = value.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale == 0 \
            or not math.isfinite(scale):
        raise SpecError(f"{where}: 'scale' must be a finite non-zero number, got {scale!r}")
    name = value.get("name", value["array"])
    units = value.get("units", "")
    if not isinstance(name, str) or not name or not isinstance(units, str):
        raise SpecError(f"{where}: 'name' and 'units' must be strings")
    return ArraySpec(value["array"], name, float(scale), units)


def _arrays(d: dict[str, Any], key: str, where: str) -> tuple[ArraySpec, ...]:
    value = d.get(key, [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise SpecError(f"{where}: {key!r} must be a list of arrays, got {value!r}")
    arrays = tuple(_array(v, f"{where}: {key}[{i}]") for i, v in enumerate(value))
    if key in ("inputs", "targets"):   # stored as <sample>/<name>.npy
        for i, a in enumerate(arrays):
            try:
                check_name(a.name, what=f"{where}: {key}[{i}] name", flat=True,
                           inside="a sample's folder")
            except UnsafeName as err:
                raise SpecError(f"{err}; give the array a plain 'name'") from None
    return arrays


def parse_spec(d: dict[str, Any], where: str = "spec") -> ConversionSpec:
    """A :class:`ConversionSpec` from a dict (a TOML file's, or flags'); ``where`` names it
    in errors."""
    _check_table(d, SPEC_KEYS, "a spec", where)
    association = d.get("association", "point")
    if association not in ASSOCIATIONS:
        raise SpecError(f"{where}: association must be one of {', '.join(ASSOCIATIONS)}, got "
                        f"{association!r}")
    geometry = d.get("geometry", ["coordinates"])
    if isinstance(geometry, str):
        geometry = [geometry]
    if not isinstance(geometry, list) or any(g not in GEOMETRY for g in geometry) \
            or len(set(geometry)) != len(geometry):
        raise SpecError(f"{where}: geometry must list distinct names of {', '.join(GEOMETRY)}, "
                        f"got {geometry!r}")
    if "coordinates" in geometry and geometry[0] != "coordinates":
        raise SpecError(f"{where}: geometry puts 'coordinates' first (the leading coordinate "
                        f"channels), got {geometry}")
    cell_only = [g for g in geometry if g != "coordinates"]
    if cell_only and association != "cell":
        raise SpecError(f"{where}: geometry {cell_only} is computed per cell; set association "
                        "= 'cell'")
    targets = _arrays(d, "targets", where)
    inputs = _arrays(d, "inputs", where)
    conditions = _arrays(d, "conditions", where)
    names = [g for g in geometry] + [a.name for a in inputs + targets]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SpecError(f"{where}: the name(s) {twice} are used twice among geometry, inputs "
                        "and targets (give one a 'name')")
    if len({c.name for c in conditions}) != len(conditions):
        raise SpecError(f"{where}: two conditions share a name")
    if not geometry and not inputs:
        raise SpecError(f"{where}: no inputs: give geometry or inputs")
    _check_scalars(d, where)
    return ConversionSpec(targets=targets, inputs=inputs, geometry=tuple(geometry),
                          association=association, conditions=conditions,
                          condition_table=d.get("condition_table"),
                          dimensions=d.get("dimensions"),
                          format=d.get("format"), pattern=d.get("pattern"),
                          split=_split(d.get("split", {}), where))


def _check_scalars(d: dict[str, Any], where: str) -> None:
    """``dimensions`` (the integer 2 or 3), ``condition_table``, ``format`` and
    ``pattern`` (strings; a pattern is a glob under the source: nothing above it)."""
    dimensions = d.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions not in (2, 3)):
        raise SpecError(f"{where}: dimensions must be the integer 2 or 3, got {dimensions!r}")
    for key in ("condition_table", "format", "pattern"):
        if d.get(key) is not None and not isinstance(d[key], str):
            raise SpecError(f"{where}: {key} must be a string, got {d[key]!r}")
    if d.get("pattern") is not None:
        try:
            check_name(d["pattern"], what=f"{where}: pattern", inside="the source directory")
        except UnsafeName as err:
            raise SpecError(str(err)) from None
    if d.get("format") is not None:
        if d["format"] not in MESH_FORMATS:
            raise SpecError(f"{where}: unknown format {d['format']!r}; known formats: "
                            f"{', '.join(MESH_FORMATS.names())}")


def _split(value: Any, where: str) -> SplitSpec:
    _check_table(value, SPLIT_KEYS, "split", where)
    if value.get("test") is not None and value.get("test_fraction") is not None:
        raise SpecError(f"{where}: give split.test (a glob) or split.test_fraction, not both")
    fraction = value.get("test_fraction")
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(
            fraction, (int, float)) or not 0 < fraction < 1):
        raise SpecError(f"{where}: split.test_fraction must be in (0, 1), got {fraction!r}")
    for key in ("test", "val"):
        if value.get(key) is not None and not isinstance(value[key], str):
            raise SpecError(f"{where}: split.{key} must be a glob string, got {value[key]!r}")
    return SplitSpec(value.get("test"), value.get("val"),
                     None if fraction is None else float(fraction))


def read_spec_file(path: str | Path) -> dict[str, Any]:
    """The table of a TOML spec file; :class:`SpecError` naming it when it is missing or
    not TOML."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:                                          # pragma: no cover (Python 3.10)
        import tomli as tomllib
    path = Path(path)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"spec file {str(path)!r} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise SpecError(f"{path}: not a TOML spec ({err})") from None
    except RecursionError:
        raise SpecError(f"{path}: not a spec: its arrays or tables are nested thousands of "
                        "levels deep") from None


def load_spec(path: str | Path | None = None, overrides: dict[str, Any] | None = None
              ) -> ConversionSpec:
    """The spec of a TOML file (if given) with ``overrides`` (flags: keys of
    :data:`SPEC_KEYS`, None for unset) put over it."""
    d = read_spec_file(path) if path is not None else {}
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key == "split":
            d["split"] = {**d.get("split", {}), **value}
        else:
            d[key] = value
    where = str(path) if path is not None else "the flags"
    return parse_spec(d, where)


__all__ = ["ARRAY_KEYS", "ArraySpec", "ConversionSpec", "GEOMETRY", "SPEC_KEYS", "SpecError",
           "SplitSpec", "load_spec", "parse_spec", "read_spec_file"]
