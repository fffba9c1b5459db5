"""``flarepp data convert``: solver output files -> one store, as a pipeline of small stages.

Shape letters: n rows of a sample (its points, or its cells), k channels of one array.

* **Source** (:func:`find_cases`): the case files under a directory (or one file), each
  read by the registered reader of its format (:data:`~flarepp.data.meshes.MESH_FORMATS`);
  files of several formats in one directory are refused unless the spec's ``format`` or
  ``pattern`` picks one. A case's name is its path under the source without the suffix
  (an OpenFOAM case: its directory).
* **Filters** (:func:`case_sample`): the rows (points, or cells with their centres,
  normals and areas or volumes, :func:`~flarepp.data.meshes.cell_geometry`), the geometry
  channels, the named arrays (renamed, times their unit scale), the per-case conditions
  (field data or a table), each checked: present at the spec's association (an array
  stored at the other is named as such), one row per point or cell, finite, a mesh that
  is not empty or degenerate.
* **Sink** (:class:`~flarepp.data.store.StoreWriter`): one sample folder per case,
  written atomically, the manifest last.

A killed conversion leaves finished samples (``meta.json`` written) and at worst one
without ``meta.json``; running the same command again reads only the cases not finished
(a finished case is recognised by its source file's size, time and sampled digest, no
read of the mesh) and rewrites the unfinished one. Until the manifest is written, no
reader takes the store. A conversion holds the store's lease while it writes (a second
one into the same store is refused, naming it); every name that becomes a path (an
array's name, a case's, a table's case, an XDMF data item's file, the spec's pattern) is
confined to its directory (:func:`flarepp.io.confined`).
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tqdm.auto import tqdm

from flarepp.data.base import DataError
from flarepp.data.fingerprint import sampled_digest
from flarepp.data.layout import ChannelGroup, ChannelLayout, channel_names
from flarepp.data.meshes import MESH_FORMATS, cell_geometry, format_of, known_suffixes, read_mesh
from flarepp.data.spec import ArraySpec, ConversionSpec, SpecError
from flarepp.data.store import MeshStore, StoreWriter
from flarepp.io import UnsafeName, check_name, confined

GEOMETRY_SOURCE = {"coordinates": {"point": "point positions", "cell": "cell centres"},
                   "normals": {"cell": "cell unit normals"}, "areas": {"cell": "cell areas"},
                   "volumes": {"cell": "cell volumes"}}


@dataclass(frozen=True)
class Case:
    """One case: its ``name`` in the store, its file and its format."""

    name: str
    path: Path
    format: str

    def files(self) -> list[Path]:
        """The files its content is in: the file itself, and for an OpenFOAM case every
        file of its directory, for EnSight the files named after the case."""
        if self.format == "openfoam":
            return sorted(p for p in self.path.parent.rglob("*") if p.is_file())
        if self.format == "ensight":
            stem = self.path.name.split(".")[0]
            return sorted(p for p in self.path.parent.glob(f"{stem}.*") if p.is_file())
        return [self.path]

    def identity(self) -> dict[str, Any]:
        """Size, time and sampled digest of every file (what a finished case is known by)."""
        root = self.path.parent
        out = []
        for p in self.files():
            stat = p.stat()
            out.append([str(p.relative_to(root)), stat.st_size, stat.st_mtime_ns,
                        sampled_digest(p)])
        return {"case": str(self.path.resolve()), "files": out}


def _case_name(path: Path, source: Path, fmt: str) -> str:
    rel = path.relative_to(source)
    if fmt == "openfoam" and rel.parent != Path("."):
        return rel.parent.as_posix()
    return rel.with_suffix("").as_posix()


def find_cases(source: str | Path, spec: ConversionSpec) -> list[Case]:
    """The cases under ``source`` (a directory, or one file), sorted by name."""
    source = Path(source)
    if not source.exists():
        raise DataError(f"source {str(source)!r} does not exist")
    if source.is_file():
        fmt = spec.format or format_of(source)
        if fmt is None:
            raise DataError(f"{source}: no registered mesh format reads {source.suffix!r} "
                            "files")
        return [Case(source.stem, source, fmt)]
    pattern = spec.pattern or "*"
    if spec.pattern is not None:   # a glob under the source: no link planted there leads out
        try:
            confined(source, spec.pattern, what="the spec's pattern (--pattern)")
        except UnsafeName as err:
            raise SpecError(str(err)) from None
    files = [p for p in sorted(source.rglob(pattern)) if p.is_file()
             and not any(part.startswith(".") for part in p.relative_to(source).parts)
             and format_of(p) is not None]
    if spec.format is not None:
        suffixes = MESH_FORMATS.get(spec.format).suffixes
        files = [p for p in files if p.suffix.lower() in suffixes]
    formats: dict[str, list[Path]] = {}
    for p in files:
        formats.setdefault(format_of(p), []).append(p)
    if not files:
        raise DataError(f"{source}: no mesh files" + (f" matching {pattern!r}" if spec.pattern
                                                      else "")
                        + (f" of format {spec.format!r}" if spec.format else "")
                        + f" (readable suffixes: {', '.join(_suffixes())})")
    if len(formats) > 1:
        shown = "; ".join(f"{len(paths)} {fmt} ({paths[0].relative_to(source)})"
                          for fmt, paths in sorted(formats.items()))
        raise DataError(f"{source}: holds mesh files of several formats ({shown}); set the "
                        "spec's format (--format) or pattern (--pattern) to pick one")
    fmt = next(iter(formats))
    cases = [Case(_case_name(p, source, fmt), p, fmt) for p in files]
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise DataError(f"{source}: two files give the case name "
                        f"{next(n for n in names if names.count(n) > 1)!r}")
    return cases


def _suffixes() -> list[str]:
    return known_suffixes()


# ---------------------------------------------------------------------------------------------
# conditions from a table

def read_condition_table(path: str | Path, names: list[str]) -> dict[str, dict[str, float]]:
    """``{case: {condition: value}}`` from a CSV (a header row, the case in a column named
    ``case``, one value per column on every row) or a JSON object ``{case: {condition:
    value}}``. A case given twice, a row of another length than the header, a value that is
    not a number (``true`` included) or a case that no source could hold (``../x``, an
    absolute path) is a :class:`DataError` naming the table, the case and the line or key."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"condition table {str(path)!r} does not exist")
    rows = _json_table(path) if path.suffix.lower() == ".json" else _csv_table(path)
    out: dict[str, dict[str, float]] = {}
    for case, values in rows.items():
        try:
            check_name(case, what=f"{path}: case", inside="the source")
        except UnsafeName as err:
            raise DataError(f"{err}; a row names a case by its path under the source") \
                from None
        out[case] = {}
        for name in names:
            value = values.get(name)
            if value is None or value == "":
                continue
            try:
                if isinstance(value, bool):
                    raise TypeError
                out[case][name] = float(value)
            except (TypeError, ValueError):
                raise DataError(f"{path}: condition {name!r} of case {case!r} is "
                                f"{value!r}, not a number") from None
    return out


def _json_table(path: Path) -> dict[str, dict[str, Any]]:
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        twice = [k for k in keys if keys.count(k) > 1]
        if twice:
            raise DataError(f"{path}: key {twice[0]!r} is given twice in one object (a "
                            "case, or a condition of a case, has one value)")
        return dict(pairs)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not a JSON table of conditions ({err})") from None
    except RecursionError:
        raise DataError(f"{path}: not a JSON table of conditions (nested thousands of "
                        "levels deep)") from None
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise DataError(f"{path}: a JSON condition table is an object {{case: {{name: "
                        "value}}}}")
    return raw


def _csv_table(path: Path) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    first: dict[str, int] = {}
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames
        if header is None or "case" not in header:
            raise DataError(f"{path}: a CSV condition table needs a header row with a "
                            f"'case' column, got {header}")
        for row in reader:
            line = reader.line_num
            extra, values = row.pop(None, []), list(row.values())
            if extra or None in values:
                count = len(values) - values.count(None) + len(extra)
                raise DataError(f"{path}: line {line} has {count} value(s) for the "
                                f"{len(header)} columns of its header {header}")
            case = row.pop("case")
            if case in rows:
                raise DataError(f"{path}: case {case!r} is given twice (lines {first[case]} "
                                f"and {line})")
            rows[case], first[case] = row, line
    return rows


def table_rows(table: dict[str, dict[str, float]], cases: list[Case], path: str | Path
               ) -> dict[str, dict[str, float]]:
    """Each case's row of the condition table at ``path``: the row of its name, else of its
    file's stem; a stem row that would serve several cases (``train/case_0`` and
    ``test/case_0``) is a :class:`DataError` naming them."""
    out: dict[str, dict[str, float]] = {}
    by_stem: dict[str, list[str]] = {}
    for case in cases:
        if case.name in table:
            out[case.name] = table[case.name]
            continue
        stem = Path(case.name).name
        if stem in table:
            by_stem.setdefault(stem, []).append(case.name)
            out[case.name] = table[stem]
    for stem, names in by_stem.items():
        if len(names) > 1:
            more = f" and {len(names) - 2} more" if len(names) > 2 else ""
            raise DataError(f"{path}: row {stem!r} names the cases {names[0]!r} and "
                            f"{names[1]!r}{more} by their file's stem; name each row by its "
                            "case's full name")
    return out


# ---------------------------------------------------------------------------------------------
# the filters

@dataclass
class CaseSample:
    """What one case gives the store: arrays by group name, the layout they make, the
    case's condition values."""

    arrays: dict[str, np.ndarray]
    layout: ChannelLayout
    conditions: list[float]


def _check_finite(values: np.ndarray, path: Path, what: str) -> None:
    bad = ~np.isfinite(values)
    if bad.any():
        rows = np.flatnonzero(bad.reshape(len(values), -1).any(axis=1))
        raise DataError(f"{path}: {what} holds NaN or inf at {len(rows)} row(s), first at row "
                        f"{int(rows[0])}")


FLOAT32_MAX, FLOAT32_TINY = float(np.finfo(np.float32).max), float(np.finfo(np.float32).tiny)


def _check_float32(values: np.ndarray, path: Path, what: str, key: str) -> None:
    """Refuse values that float32, the store's type, cannot keep: beyond its range (they
    would be stored as inf) or all below its smallest normal number (stored as 0 or with
    their digits lost) where the source is not all zero; ``key`` names the spec's scale."""
    big = float(np.abs(values).max()) if values.size else 0.0
    if big > FLOAT32_MAX:
        raise DataError(f"{path}: {what} times its scale reaches {big:.3g}, beyond the range "
                        f"of float32 that the store keeps ({FLOAT32_MAX:.3g}); lower the "
                        f"spec's {key}")
    if 0 < big < FLOAT32_TINY:
        raise DataError(f"{path}: {what} times its scale is at most {big:.3g}, below the "
                        f"smallest normal float32 ({FLOAT32_TINY:.3g}), so the store would keep "
                        f"zeros; raise the spec's {key}")


def _data_array(mesh, path: Path, spec: ArraySpec, association: str, n: int,
                key: str = "scale") -> np.ndarray:
    """Array ``spec.array`` at ``association`` as ``[n, k]`` float64, times its scale
    (``key``: the spec's key of that scale, for errors)."""
    here = mesh.point_data if association == "point" else mesh.cell_data
    other = mesh.cell_data if association == "point" else mesh.point_data
    if spec.array not in here.keys():
        if spec.array in other.keys():
            swap = "cell" if association == "point" else "point"
            raise DataError(f"{path}: array {spec.array!r} is {swap} data, but the spec reads "
                            f"{association} data (association = {association!r}); set "
                            f"association = {swap!r}, or name a {association} array "
                            f"({sorted(here.keys())})")
        field_names = sorted(mesh.field_data.keys())
        raise DataError(f"{path}: no array {spec.array!r}; its point arrays are "
                        f"{sorted(mesh.point_data.keys())}, its cell arrays "
                        f"{sorted(mesh.cell_data.keys())}"
                        + (f", its field data {field_names}" if field_names else ""))
    values = np.asarray(here[spec.array])
    if values.dtype.kind not in "biuf":
        raise DataError(f"{path}: array {spec.array!r} holds {values.dtype} values, not numbers")
    if len(values) != n:
        raise DataError(f"{path}: array {spec.array!r} has {len(values)} rows, but the "
                        f"sample has {n} {association}s (the inputs and targets of a sample "
                        "need one row per point or cell each)")
    values = np.multiply(values.reshape(n, -1), spec.scale, dtype=np.float64)
    _check_finite(values, path, f"array {spec.array!r}")
    _check_float32(values, path, f"array {spec.array!r}", key)
    return values


def _conditions(mesh, case: Case, spec: ConversionSpec,
                rows: dict[str, dict[str, float]] | None) -> list[float]:
    """The case's condition values: its row of the table (``rows``, :func:`table_rows`; None
    without a table), else its field data; each times its scale."""
    row = None if rows is None else rows.get(case.name)
    values = []
    for k, cond in enumerate(spec.conditions):
        if row is not None and cond.array in row:
            value = row[cond.array]
        elif cond.array in mesh.field_data.keys():
            raw = np.asarray(mesh.field_data[cond.array])
            if raw.size != 1 or raw.dtype.kind not in "biuf":
                raise DataError(f"{case.path}: field data {cond.array!r} holds "
                                f"{raw.size} value(s) of {raw.dtype}, not one number")
            value = float(raw.reshape(-1)[0])
        else:
            where = (f" nor in {spec.condition_table} (which has "
                     f"{'no row' if row is None else 'no value'} for case {case.name!r})"
                     if spec.condition_table is not None else
                     " nor given by name (infer's --condition NAME=VALUE or --conditions "
                     "TABLE; serve's conditions)" if rows is not None else "")
            raise DataError(f"{case.path}: condition {cond.array!r} is missing: not in its "
                            f"field data ({sorted(mesh.field_data.keys())}){where}")
        value *= cond.scale
        if not np.isfinite(value):
            raise DataError(f"{case.path}: condition {cond.array!r} is {value}, not finite")
        _check_float32(np.array([value]), case.path, f"condition {cond.array!r}",
                       f"conditions[{k}].scale")
        values.append(value)
    return values


def _dimensions(points: np.ndarray, spec: ConversionSpec, fixed: int | None, path: Path) -> int:
    dims = spec.dimensions or fixed or (2 if np.all(points[:, 2] == 0) else 3)
    if dims == 2 and np.any(points[:, 2] != 0):
        raise DataError(f"{path}: the store keeps 2 coordinates, but this mesh has points with "
                        f"z != 0 (up to {np.abs(points[:, 2]).max():.6g}); set dimensions = 3")
    return dims


def case_sample(mesh, case: Case, spec: ConversionSpec,
                rows: dict[str, dict[str, float]] | None, dimensions: int | None) -> CaseSample:
    """The filters (module docstring) on one case's mesh; ``rows``: each case's row of the
    condition table (:func:`table_rows`, None without one); ``dimensions`` fixed by the
    cases before it (None for the first)."""
    path = case.path
    points = np.asarray(mesh.points)    # as read (float32 or float64): no copy here
    _check_finite(points, path, "the point coordinates")
    dims = _dimensions(points, spec, dimensions, path)
    association = spec.association
    arrays: dict[str, np.ndarray] = {}
    if association == "point":
        n = len(points)
        extent = points.max(axis=0) - points.min(axis=0) if n else np.zeros(3)
        if n < 2 or not (extent > 0).any():
            raise DataError(f"{path}: degenerate mesh: its {n} point(s) all coincide")
        geometry = {"coordinates": np.asarray(points[:, :dims], np.float64)}
    else:
        cells = cell_geometry(mesh, path)
        n = len(cells.measures)
        geometry = {"coordinates": cells.centres[:, :dims], "normals": cells.normals,
                    "areas": cells.measures[:, None] if cells.dimension == 2 else None,
                    "volumes": cells.measures[:, None] if cells.dimension == 3 else None}
    inputs, targets = [], []
    for name in spec.geometry:
        values = geometry.get(name)
        if values is None:
            dim = "3-D" if name in ("normals", "areas") else "2-D"
            raise DataError(f"{path}: geometry {name!r} is not defined for its cells ("
                            f"{dim} cells have none); remove it from geometry")
        arrays[name] = values
        inputs.append(ChannelGroup(name, tuple("xyz"[:values.shape[1]]) if name == "coordinates"
                                   else channel_names(name, values.shape[1]),
                                   GEOMETRY_SOURCE[name][association]))
    for groups, specs, kind in ((inputs, spec.inputs, "inputs"),
                                (targets, spec.targets, "targets")):
        for i, a in enumerate(specs):
            arrays[a.name] = _data_array(mesh, path, a, association, n, f"{kind}[{i}].scale")
            groups.append(ChannelGroup(a.name, channel_names(a.name, arrays[a.name].shape[1]),
                                       a.array, a.scale, a.units))
    conditions = tuple(ChannelGroup(c.name, (c.name,), c.array, c.scale, c.units)
                       for c in spec.conditions)
    layout = ChannelLayout(tuple(inputs), tuple(targets), conditions, association,
                           dims if spec.geometry[:1] == ("coordinates",) else 0, dims)
    return CaseSample(arrays, layout, _conditions(mesh, case, spec, rows))


# ---------------------------------------------------------------------------------------------
# a trained run's inputs for a new mesh

def layout_spec(layout: ChannelLayout) -> ConversionSpec:
    """The spec that builds ``layout``'s inputs and conditions from a mesh (no targets): each
    input group read back from what :func:`case_sample` recorded, a geometry group by its
    name and computed source (:data:`GEOMETRY_SOURCE`), any other group from its array,
    scale and units. A group that was not read from a mesh array (an in-memory dataset's
    ``inputs``) raises :class:`SpecError` naming it."""
    geometry: list[str] = []
    inputs: list[ArraySpec] = []
    for group in layout.inputs:
        if GEOMETRY_SOURCE.get(group.name, {}).get(layout.association) == group.source:
            if inputs:
                raise SpecError(f"the layout puts geometry {group.name!r} after the arrays "
                                f"{[a.name for a in inputs]}; a conversion puts geometry first")
            geometry.append(group.name)
        elif group.source:
            inputs.append(ArraySpec(group.source, group.name, group.scale, group.units))
        else:
            raise SpecError(f"input channels {', '.join(group.channels)} ({group.name!r}) were "
                            "not read from a mesh array (a generated or in-memory dataset), "
                            "so they cannot be built from a mesh")
    conditions = tuple(ArraySpec(c.source or c.name, c.name, c.scale, c.units)
                       for c in layout.conditions)
    return ConversionSpec(targets=(), inputs=tuple(inputs), geometry=tuple(geometry),
                          association=layout.association, conditions=conditions,
                          dimensions=layout.dimensions or None)


def mesh_inputs(path: str | Path, layout: ChannelLayout,
                conditions: dict[str, float] | None = None, *, max_rows: int | None = None
                ) -> tuple[np.ndarray, list[float]]:
    """``(x [n, I] float32, conditions [K])`` of the mesh file ``path`` for a run whose
    inputs are ``layout``'s, built by the same filters that converted its store
    (:func:`layout_spec`, :func:`case_sample`) and assembled in the layout's group order as a
    store sample is. ``conditions`` (by the layout's condition names, in its stored units)
    come before the mesh's field data; a name the layout lacks is a :class:`DataError`;
    ``max_rows`` bounds the mesh's points and cells (:func:`~flarepp.data.meshes.read_mesh`)."""
    path = Path(path)
    spec = layout_spec(layout)
    fmt = format_of(path)
    if fmt is None:
        raise DataError(f"{path.name}: no registered mesh format reads {path.suffix!r} files "
                        f"(readable suffixes: {', '.join(_suffixes())})")
    given = dict(conditions or {})
    unknown = sorted(set(given) - set(layout.condition_names))
    if unknown:
        raise DataError(f"conditions {unknown} are not this run's; it takes "
                        f"{layout.condition_names or 'none'}")
    by_array = {c.source or c.name: given[c.name] / c.scale for c in layout.conditions
                if c.name in given}
    case = Case(path.stem, path, fmt)
    sample = case_sample(read_mesh(path, fmt, max_rows=max_rows), case, spec,
                         {case.name: by_array}, layout.dimensions or None)
    if sample.layout.input_channels != layout.input_channels:
        raise DataError(f"{path.name}: its inputs are {sample.layout.input_channels}, the "
                        f"run's are {layout.input_channels}")
    x = np.concatenate([sample.arrays[g.name] for g in layout.inputs], axis=1)
    return x.astype(np.float32), sample.conditions


# ---------------------------------------------------------------------------------------------
# the pipeline

@dataclass
class ConversionReport:
    """What :func:`convert` did: the ``store``, cases ``read`` and ``reused`` (finished by
    an earlier, interrupted run), rows written, seconds spent, and ``warnings`` about the
    store (an empty test split), one sentence each."""

    store: MeshStore
    read: int
    reused: int
    rows: int
    seconds: float
    warnings: list[str] = field(default_factory=list)


def convert(source: str | Path, out: str | Path, spec: ConversionSpec, *,
            overwrite: bool = False, progress: bool = True,
            read: Callable[[Path, str], Any] = read_mesh) -> ConversionReport:
    """Convert the cases under ``source`` into the store ``out`` (module docstring);
    ``read(path, format)`` is the reader stage (default :func:`read_mesh`). The store is
    written under its lease (:class:`~flarepp.data.store.StoreLock`): a second conversion
    into ``out`` while this one runs is refused, naming this one."""
    source = Path(source)
    cases = find_cases(source, spec)
    if not spec.targets and not spec.inputs and not spec.geometry:
        raise SpecError("the spec names no inputs and no targets")
    if spec.targets and not MESH_FORMATS.get(cases[0].format).arrays:
        raise DataError(f"{cases[0].path}: {cases[0].format} files hold geometry only, no "
                        f"arrays, so they give no targets {[t.array for t in spec.targets]} "
                        "(convert them with targets = [] for prediction)")
    rows = _condition_rows(source, spec, cases)
    splits = spec.split.assign([c.name for c in cases])
    warnings = [] if splits["test"] else [
        f"the store's test split is empty (split.test_fraction holds out no case of a source "
        f"of {len(cases)}), and `flarepp train` evaluates on it: convert a source of 2 or "
        "more cases, or give --test-pattern"]
    started = time.perf_counter()
    identity = {"spec": spec.to_dict(), "source": str(source.resolve())}
    with StoreWriter(out, identity, overwrite=overwrite) as writer:
        layout, metas, reused, written = _write_cases(writer, cases, spec, rows, read, progress)
        store = writer.finish(layout, splits, metas, {"source": str(source.resolve()),
                                                      "spec": spec.to_dict()})
    return ConversionReport(store, len(cases) - reused, reused, written,
                            time.perf_counter() - started, warnings)


def _condition_rows(source: Path, spec: ConversionSpec, cases: list[Case]
                    ) -> dict[str, dict[str, float]] | None:
    """Each case's row of the spec's condition table (a relative path is under the
    source), or None without a table."""
    if spec.condition_table is None:
        return None
    path = Path(spec.condition_table)
    if not path.is_absolute():
        path = (source if source.is_dir() else source.parent) / path
    return table_rows(read_condition_table(path, [c.array for c in spec.conditions]), cases,
                      path)


def _write_cases(writer: StoreWriter, cases: list[Case], spec: ConversionSpec,
                 rows: dict[str, dict[str, float]] | None, read: Callable[[Path, str], Any],
                 progress: bool) -> tuple[ChannelLayout, dict[str, dict], int, int]:
    """Each case through the filters into ``writer`` (a case finished earlier is reused);
    returns the layout, every sample's meta, the count reused and the rows written."""
    metas: dict[str, dict] = {}
    layout, reused, written = None, 0, 0
    for case in tqdm(cases, desc="convert", unit="case", disable=not progress):
        identity = case.identity()
        meta = writer.finished(case.name, identity)
        if meta is not None:
            reused += 1
            sample_layout = ChannelLayout.from_dict(meta["layout"])
        else:
            sample = case_sample(read(case.path, case.format), case, spec, rows,
                                 None if layout is None else layout.dimensions)
            sample_layout = sample.layout
            if layout is not None:
                _same_layout(layout, sample_layout, case)
            meta = writer.write(case.name, sample.arrays,
                                {"source": identity, "layout": sample_layout.to_dict(),
                                 "conditions": sample.conditions})
            written += meta["rows"]
        if layout is None:
            layout = sample_layout
        _same_layout(layout, sample_layout, case)
        metas[case.name] = meta
    return layout, metas, reused, written


def _same_layout(first: ChannelLayout, this: ChannelLayout, case: Case) -> None:
    a, b = first.to_dict(), this.to_dict()
    for key in ("input_channels", "target_channels", "dimensions"):
        if a[key] != b[key]:
            raise DataError(f"{case.path}: its {key.replace('_', ' ')} {b[key]} differ from the "
                            f"first case's {a[key]} (an array with another number of "
                            "components?); every case of a store has the same channels")


__all__ = ["Case", "CaseSample", "ConversionReport", "case_sample", "convert", "find_cases",
           "layout_spec", "mesh_inputs", "read_condition_table", "table_rows"]
