"""New meshes as ``flarepp infer``'s cases: ``--mesh FILE`` (or a folder of them) and
``--geometry FILE``, with conditions by name or from a table.

Shape letters: n rows (points or cells) of a mesh, I inputs, C conditions.

A mesh's inputs are built exactly as the run's data built them:

* **A run on a converted store**: by the conversion's own filters for one case
  (:func:`flarepp.data.convert.mesh_inputs`, which calls the converter's
  :func:`~flarepp.data.convert.case_sample`) under the spec that made the run's channel
  layout (:func:`~flarepp.data.convert.layout_spec`): point positions or cell centres,
  normals, areas or volumes, named arrays times their unit scales, in the stored order, at
  the run's points or cells. The layout is the one the run stored in its checkpoint (its
  data description); a run that stored none reads it from the store at its recorded data
  path (:func:`~flarepp.inference.predictor.load_predictor`).
* **The surface task**: each cell's centre and unit normal (:func:`~flarepp.inference.
  infer.geometry_case`, as the DrivAerML reader computes them).

Conditions (a conditioned run): ``NAME=VALUE`` pairs by the run's condition names, in its
physical units (as ``Predictor.predict(conditions={...})`` takes them), the same for every
mesh; or a condition table as ``flarepp data convert`` reads it
(:func:`~flarepp.data.convert.read_condition_table`: a row per case name or file stem, a
column per condition array, in the files' units, the spec's scale applied); else the
mesh's own field data, as the conversion reads it.

``--geometry`` is a surface alone: taken by every run whose inputs are a surface's cell
centres and unit normals (the surface task, or a store converted with ``geometry =
["coordinates", "normals"]``, ``association = "cell"`` and nothing else).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from flarepp.data import DataError
from flarepp.data.convert import (GEOMETRY_SOURCE, find_cases, mesh_inputs,
                                  read_condition_table)
from flarepp.data.layout import ChannelLayout
from flarepp.data.spec import ConversionSpec
from flarepp.inference.infer import Case, geometry_case
from flarepp.inference.predictor import Predictor, PredictorError

SURFACE_GEOMETRY = (("coordinates", GEOMETRY_SOURCE["coordinates"]["cell"], 3),
                    ("normals", GEOMETRY_SOURCE["normals"]["cell"], 3))
"""The inputs ``--geometry`` gives: ``(group, source, channels)`` of a conversion's cell
centres and unit normals."""


def takes_surface_geometry(predictor: Predictor) -> bool:
    """Whether the run's inputs are exactly a surface's cell centres and unit normals."""
    if getattr(predictor.config, "task", None) == "surface":
        return True
    layout = predictor.layout.data_layout
    return (layout is not None and layout.association == "cell"
            and tuple((g.name, g.source, g.width) for g in layout.inputs) == SURFACE_GEOMETRY)


def mesh_files(path: str | Path) -> list[tuple[str, Path]]:
    """``(case name, file)`` of a mesh file (named by its stem) or of every mesh file
    under a folder (named by its path there without the suffix), as ``flarepp data
    convert`` finds them (:func:`~flarepp.data.convert.find_cases`: one format, sorted)."""
    path = Path(path)
    if path.is_file():
        return [(path.stem, path)]
    if not path.is_dir():
        raise DataError(f"{path}: no such mesh file or folder")
    return [(c.name, c.path) for c in find_cases(path, ConversionSpec(targets=()))]


def run_layout(predictor: Predictor) -> ChannelLayout:
    """The channel layout a new mesh's inputs are built by: the one the run stored (module
    docstring), or a sentence saying why there is none."""
    layout, config = predictor.layout.data_layout, predictor.config
    if layout is not None:
        return layout
    dataset = getattr(config, "dataset", None)
    if dataset == "store":
        raise PredictorError(f"this run stored no channel layout and its store "
                             f"({config.data_root}) cannot be opened to read it, so a mesh's "
                             "inputs cannot be built as its data was; give the store back "
                             "at that path, or the inputs as an .npz (--data)")
    raise PredictorError(f"this {getattr(config, 'task', '?')!r} run trained on {dataset!r} "
                         "data, not on a converted store, so there is no conversion to build "
                         "a mesh's inputs by; give them as an .npz (--data) or through "
                         "flarepp.load(run).predict")


def table_conditions(path: str | Path, layout: ChannelLayout) -> dict[str, dict[str, float]]:
    """``{case: {condition name: value in the run's units}}`` of a condition table as
    ``flarepp data convert`` reads it (module docstring)."""
    groups = [(g.name, g.source or g.name, g.scale) for g in layout.conditions]
    table = read_condition_table(path, [array for _, array, _ in groups])
    return {case: {name: row[array] * scale for name, array, scale in groups if array in row}
            for case, row in table.items()}


def mesh_cases(predictor: Predictor, path: str | Path, *,
               conditions: dict[str, float] | None = None, table: str | Path | None = None,
               geometry: bool = False, max_rows: int | None = None) -> Iterator[Case]:
    """The cases of the mesh file(s) at ``path`` (module docstring), one at a time, with
    ``conditions`` (by name) or the rows of ``table``; ``geometry``: ``--geometry``, a
    surface alone, refused for a run whose inputs are anything else; ``max_rows`` bounds
    each mesh's points and cells, declared or read, before its inputs are built."""
    if geometry and not takes_surface_geometry(predictor):
        raise PredictorError(f"--geometry gives a surface's cell centres and normals; this "
                             f"run's model takes {predictor.layout.describe()} (use --mesh, "
                             "built as its store was, or --data)")
    files = mesh_files(path)
    if getattr(predictor.config, "task", None) == "surface":
        if conditions or table:
            raise PredictorError("this surface run takes no conditions")
        for name, file in files:
            yield geometry_case(file, name, max_rows=max_rows)
        return
    layout = run_layout(predictor)
    unknown = sorted(set(conditions or {}) - set(layout.condition_names))
    if unknown:
        raise PredictorError(f"conditions {unknown} are not this run's; it takes "
                             f"{layout.condition_names or 'none'}")
    rows = {} if table is None else table_conditions(table, layout)
    takes = predictor.layout.conditions is not None
    for name, file in files:
        given = conditions or rows.get(name, rows.get(Path(name).name, {}))
        x, values = mesh_inputs(file, layout, given, max_rows=max_rows)
        yield Case(name, x[None], conditions=np.asarray([values], np.float32) if takes
                   else None, source=str(file), association=layout.association)


__all__ = ["SURFACE_GEOMETRY", "mesh_cases", "mesh_files", "run_layout", "table_conditions",
           "takes_surface_geometry"]
