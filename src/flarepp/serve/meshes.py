"""A mesh file in, the same mesh with its predicted fields out.

Shape letters: n rows (the mesh's points or cells, as the run's data were), I inputs, O
outputs.

* **In** (:func:`mesh_request`): the inputs built from the file exactly as the run's data
  were built, as ``flarepp infer --mesh`` builds them (:func:`flarepp.inference.mesh_cases.
  mesh_cases`): for a run on a converted store, by the conversion's own filters under the
  channel layout the run stored (point positions or cell centres, normals, areas, volumes,
  named arrays with their unit scales, conditions from the request or the file's field
  data); for the surface task, each cell's centre and unit normal.
* **Out** (:func:`write_prediction`): the file's mesh with ``pred_<field>`` point or cell
  arrays (:func:`flarepp.data.meshes.write_fields`), as VTK XML (``.vtp`` for polygon
  surfaces and point clouds, ``.vtu`` for every other mesh); with ``surface`` its outer
  surface as ``.vtp`` (what a browser's vtk.js draws). A surface run's integrated force
  ``F = sum_cells (-p n + tau_w) A`` (:func:`flarepp.tasks.surface.integrated_forces`) is
  stored as the field data ``force``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flarepp.data.meshes import format_of, read_mesh, write_fields
from flarepp.inference.mesh_cases import mesh_cases
from flarepp.locks import file_safe
from flarepp.serve.run import ServedRun
from flarepp.tasks.surface import integrated_forces


@dataclass
class MeshRequest:
    """A mesh's inputs for one run: ``x [n, I]``, ``conditions [C]`` (None for a model that
    takes none), where the rows live (``association``) and, for a surface run, cell
    ``areas [n]`` (for its force)."""

    x: np.ndarray
    conditions: np.ndarray | None
    association: str
    areas: np.ndarray | None = None


OTHER_FILES = ("ensight", "openfoam")
"""Mesh formats whose file names other files (an EnSight case its geometry and variables,
an OpenFOAM marker its case directory): an upload is one file, so these are refused
(their readers would look for the other files beside it, or wherever it points)."""


def mesh_request(run: ServedRun, path: Path, conditions: dict[str, float], *,
                 max_rows: int | None = None) -> MeshRequest:
    """The inputs of the mesh file ``path`` for ``run`` (module docstring); ``conditions``
    by name in the run's units; ``max_rows`` bounds the mesh's points and cells, declared
    or read, before its inputs are built (:class:`~flarepp.data.meshes.MeshTooLarge`).
    Raises a sentence for a run whose inputs cannot be built from a mesh, a file no
    reader takes or of a format that names other files, or conditions the run lacks."""
    refused = run.mesh_support()
    if refused is not None:
        raise ValueError(refused)
    fmt = format_of(path)
    if fmt in OTHER_FILES:
        raise ValueError(f"a {path.suffix} file ({fmt}) names other files, which an upload "
                         "does not bring; send a single-file mesh (VTU, VTP, VTK, VTKHDF, "
                         "STL, Gmsh, XDMF)")
    case = next(mesh_cases(run.predictor, path, conditions=conditions, max_rows=max_rows))
    return MeshRequest(case.x[0], None if case.conditions is None else case.conditions[0],
                       case.association, case.areas)


def integrated_force(request: MeshRequest, fields_NO: np.ndarray) -> np.ndarray | None:
    """A surface run's force ``[3]`` (float64) on the mesh, None for any other run."""
    if request.areas is None or fields_NO.shape[-1] != 4:
        return None
    fields, normals = (torch.from_numpy(np.asarray(a, np.float64)[None])
                       for a in (fields_NO, request.x[:, 3:6]))
    return integrated_forces(fields, normals, torch.from_numpy(request.areas[None])).numpy()[0]


def field_names(run: ServedRun, outputs: int) -> list[str]:
    """The names the predicted arrays get: the run's field names (file-safe), else y<k>."""
    names = [file_safe(n) for n in run.layout.field_names]
    return names if len(names) == outputs else [f"y{k}" for k in range(outputs)]


def write_prediction(source: Path, request: MeshRequest, fields_NO: np.ndarray,
                     names: list[str], out: Path, *, force: np.ndarray | None = None,
                     surface: bool = False) -> Path:
    """``source``'s mesh with ``pred_<name>`` arrays (and field data ``force``) written
    beside ``out``'s stem (module docstring); the path written."""
    mesh = read_mesh(source)
    if force is not None:
        mesh.field_data["force"] = np.asarray(force, np.float64)
    arrays = {f"pred_{name}": fields_NO[:, k] for k, name in enumerate(names)}
    written = write_fields(mesh, arrays, request.association, out, where=source.name)
    if not surface or written.suffix == ".vtp":
        return written
    outer = read_mesh(written).extract_surface(pass_pointid=False, pass_cellid=False)
    if force is not None:
        outer.field_data["force"] = np.asarray(force, np.float64)
    return write_fields(outer, {}, request.association, out.with_name(out.name + "-surface"))


__all__ = ["MeshRequest", "OTHER_FILES", "field_names", "integrated_force", "mesh_request",
           "write_prediction"]
