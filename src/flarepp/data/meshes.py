"""Solver output files in: one registered reader per mesh format, and cell geometry.

Shape letters: P points of a mesh, C its cells, T tetrahedra of a decomposition.

Every reader turns a file into one pyvista dataset (an ``UnstructuredGrid`` or
``PolyData``: points, cells, point data, cell data, field data) through a well-kept mesh
library, pyvista over VTK or meshio, and says in a :class:`~flarepp.data.DataError` naming
the file why it cannot (truncated, corrupt, empty); the conversion
(:mod:`flarepp.data.convert`) takes it from there. :data:`MESH_FORMATS` lists the formats,
each tested on a file of that format written in the tests by the library's own writers
(OpenFOAM: a hand-written ASCII case); formats no writer here can produce (CGNS, Exodus II,
Fluent) are not registered.

Cell geometry (:func:`cell_geometry`), for data at cells:

* **2-D cells** (triangles, quads, polygons, pixels) as the DrivAerML reader computes them
  (:func:`flarepp.data.drivaerml.polygon_centres_and_normals`): the fan area vector ``a``,
  unit normal ``a / |a|``, area ``|a|`` and centre the area-weighted centroid of the fan
  triangles.
* **3-D linear cells** (tetrahedra, voxels, hexahedra, wedges, pyramids, pentagonal and
  hexagonal prisms): the polyhedron bounded by the cell's faces as VTK defines them, a
  face of more than 3 vertices taken as the fan of triangles about its vertex mean. By the
  divergence theorem, with tetrahedra from the cell's first vertex ``x_0`` to each fan
  triangle ``(p, q, r)`` (relative to ``x_0``): volume ``V = |sum_t det(p, q, r)| / 6``,
  centre ``x_0 + sum_t det_t (p + q + r) / (4 sum_t det_t)``. Exact for planar faces
  (then the fan is immaterial); for warped faces the fan about the face's vertex mean is
  the same from both cells sharing the face, so the volumes of a conforming mesh sum to
  the volume it bounds, and it does not depend on how the cell's vertices are numbered.
  Computed per cell type, vectorised in chunks, from VTK's own face tables (:func:`fan_table`),
  each ``det(p, q, r)`` a dot with the cross product of a cell edge that serves both its
  faces, the sums over the corners one small matrix product (:class:`FanTable`).
* **Other 3-D cells** (quadratic cells, polyhedra) split into tetrahedra by VTK
  (``vtkDataSetTriangleFilter``): volume ``V = sum_t |det(b - a, c - a, d - a)| / 6`` and
  centre the volume-weighted centroid ``sum_t V_t (a + b + c + d) / 4 / V`` (exact for a
  polyhedron with planar faces).

Reading needs ``pip install 'flarepp[mesh-io]'`` (pyvista and meshio; VTK comes with
pyvista).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import h5py
import numpy as np

from flarepp.data.base import DataError
from flarepp.data.drivaerml import captured_vtk_messages, polygon_centres_and_normals
from flarepp.device import available_memory
from flarepp.io import UnsafeName, atomic_write, confined, require_room
from flarepp.registry import Registry

MESH_IO_HINT = "pip install 'flarepp[mesh-io]'"
CHUNK_CELLS = 1 << 20


def _require(module: str):
    """``module`` imported, or a sentence saying which extra to install."""
    import importlib
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(f"reading mesh files needs {module} ({err.name} is "
                                  f"missing): {MESH_IO_HINT}") from err


def require_pyvista():
    return _require("pyvista")


def require_meshio():
    return _require("meshio")


@dataclass(frozen=True)
class MeshFormat:
    """A registered format: its ``suffixes`` (a case directory's ``.foam`` file for
    OpenFOAM), the ``library`` that reads it, whether its files carry data ``arrays``
    (STL holds geometry only) and ``read(path) -> pyvista dataset``."""

    name: str
    suffixes: tuple[str, ...]
    library: str
    arrays: bool
    read: Callable[[Path], Any]
    marker: bool = False      # the file only marks a case directory (may be empty)


MESH_FORMATS: Registry = Registry("mesh format")


def register_format(name: str, suffixes: tuple[str, ...], library: str, *, arrays: bool = True,
                    marker: bool = False, doc: str = "") -> Callable:
    def wrap(read: Callable[[Path], Any]) -> Callable[[Path], Any]:
        MESH_FORMATS.add(name, MeshFormat(name, suffixes, library, arrays, read, marker),
                         doc=doc)
        return read
    return wrap


def format_of(path: str | Path) -> str | None:
    """The registered format whose suffix ``path`` has (case-insensitive), or None."""
    suffix = Path(path).suffix.lower()
    for name in MESH_FORMATS.names():
        if suffix in MESH_FORMATS.get(name).suffixes:
            return name
    return None


def known_suffixes() -> list[str]:
    return sorted({s for n in MESH_FORMATS.names() for s in MESH_FORMATS.get(n).suffixes})


class MeshTooLarge(DataError):
    """A mesh whose points or cells, declared or read, exceed the rows a reader was allowed."""


DECLARED_SIZES = {
    "vtu": re.compile(rb'\bNumberOf(Points|Cells)="\s*(\d+)\s*"'),
    "vtp": re.compile(rb'\bNumberOf(Points|Verts|Lines|Strips|Polys)="\s*(\d+)\s*"'),
    "vtk": re.compile(rb"^(POINTS|CELLS|POLYGONS|VERTICES|LINES|TRIANGLE_STRIPS|POINT_DATA|"
                      rb"CELL_DATA|DIMENSIONS)[ \t]+(\d+(?:[ \t]+\d+)*)", re.MULTILINE),
    "gmsh": re.compile(rb"^\$(Nodes|Elements)[ \t]*\r?\n[ \t]*(\d+(?:[ \t]+\d+)*)",
                       re.MULTILINE)}
"""The sizes a mesh file declares before its data (VTK XML ``NumberOf...`` attributes,
legacy VTK keyword lines, Gmsh section counts), which the readers allocate before reading
the data itself."""

DECLARATION_WORDS = {"vtu": (b"NumberOf",), "vtp": (b"NumberOf",),
                     "vtk": (b"POINTS", b"CELLS", b"POLYGONS", b"VERTICES", b"LINES",
                             b"TRIANGLE_STRIPS", b"POINT_DATA", b"CELL_DATA", b"DIMENSIONS"),
                     "gmsh": (b"$Nodes", b"$Elements")}
"""The words every declaration of :data:`DECLARED_SIZES` starts with: the file is searched
for them (a fast substring search) and the pattern tried only there, where trying it at
every byte of a file took as long as VTK's reading it."""

SCAN_BLOCK = 1 << 23
"""Bytes of a mesh file :func:`declared_rows` holds at a time (the file is read in blocks,
never whole)."""

SCAN_TAIL = 1 << 16
"""The longest declaration :func:`declared_rows` reads whole across two blocks: one
starting in a block's last ``SCAN_TAIL`` bytes is tried again with the next block."""


def _declarations(path: Path, fmt: str):
    """The matches of ``fmt``'s :data:`DECLARED_SIZES` pattern in the file ``path``, each
    tried where one of its :data:`DECLARATION_WORDS` starts, the file read in blocks of
    :data:`SCAN_BLOCK` bytes (a word in a block's last :data:`SCAN_TAIL` bytes is tried
    with the next block)."""
    pattern, words = DECLARED_SIZES[fmt], DECLARATION_WORDS[fmt]
    with open(path, "rb") as file:
        data, start = b"", 0       # data[start:] is unsearched; data[start - 1] precedes it
        while True:
            block = file.read(SCAN_BLOCK)
            data += block
            end = len(data) - SCAN_TAIL if block else len(data)
            starts: set[int] = set()
            for word in words if end > start else ():   # occurrences starting in [start, end)
                i = data.find(word, start, end + len(word) - 1)
                while i >= 0:
                    starts.add(i)
                    i = data.find(word, i + 1, end + len(word) - 1)
            for i in sorted(starts):
                found = pattern.match(data, i)
                if found is not None:
                    yield found
            if not block:
                return
            if end > start:
                data, start = data[end - 1:], 1


def declared_rows(path: Path, fmt: str) -> int:
    """The most rows (points, cells or a legacy file's grid ``DIMENSIONS``) the file
    ``path`` of format ``fmt`` declares, summed over its pieces; 0 for a format whose
    sizes are not read here."""
    if fmt not in DECLARED_SIZES:
        return 0
    totals: dict[bytes, int] = {}
    for found in _declarations(path, fmt):
        numbers = [int(n) for n in found.group(2).split()]
        key = found.group(1)
        size = (int(np.prod(numbers, dtype=object)) if key == b"DIMENSIONS"
                else max(numbers) if fmt == "gmsh" else numbers[0])   # Gmsh 4: blocks, count
        totals[key] = totals.get(key, 0) + size
    return max(totals.values(), default=0)


POINT_BYTES = 12
"""Bytes of one point's coordinates as a reader allocates them (3 float32) at the least."""


def _check_rows(path: Path, rows: int, max_rows: int | None, how: str) -> None:
    if max_rows is not None and rows > max_rows:
        raise MeshTooLarge(f"{path.name}: the mesh {how} {rows} points or cells, over the "
                           f"{max_rows} allowed")


def read_mesh(path: str | Path, fmt: str | None = None, *, max_rows: int | None = None):
    """``path`` as one pyvista dataset with at least one point (``fmt``: a registered
    format, default the one of its suffix); :class:`DataError` naming the file otherwise.
    ``max_rows`` bounds its points and cells (:class:`MeshTooLarge`): as the file declares
    them before any is read (VTK XML, legacy VTK and Gmsh files, which a few bytes can make
    declare billions, which the readers allocate or abort on), and as read, before any
    array of them is built (a legacy grid's points exist only once asked for); whatever
    ``max_rows``, a declaration whose coordinates alone exceed the memory this process may
    allocate is refused. A cell naming a point the mesh lacks is refused."""
    path = Path(path)
    fmt = fmt or format_of(path)
    if fmt is None:
        raise DataError(f"{path}: no registered mesh format reads {path.suffix!r} files "
                        f"(known: {', '.join(known_suffixes())})")
    if not path.exists():
        raise DataError(f"{path}: the mesh file is missing")
    entry = MESH_FORMATS.get(fmt)
    if not entry.marker and path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty (0 bytes)")
    declared = declared_rows(path, fmt)
    _check_rows(path, declared, max_rows, "declares")
    if declared * POINT_BYTES > (free := available_memory()):
        raise MeshTooLarge(f"{path}: the mesh declares {declared} points or cells, whose "
                           f"coordinates alone need {declared * POINT_BYTES / 2**30:.1f} GiB, "
                           f"more than the {free / 2**30:.1f} GiB this process may allocate")
    mesh = _single(entry.read(path), path)
    if mesh.n_points == 0:
        raise DataError(f"{path}: the mesh has no points (an empty or truncated {fmt} file)")
    _check_rows(path, max(mesh.n_points, mesh.n_cells), max_rows, "has")
    _check_connectivity(mesh, path)
    return mesh


def _check_connectivity(mesh, path: Path) -> None:
    """Refuse a cell that names a point outside the mesh (VTK reads it as it is)."""
    pv = require_pyvista()
    if hasattr(mesh, "GetPolys"):
        arrays = [mesh.GetVerts(), mesh.GetLines(), mesh.GetPolys(), mesh.GetStrips()]
    else:
        arrays = [mesh.GetCells()] if hasattr(mesh, "GetCells") else []
    for cells in arrays:
        if cells is None or cells.GetNumberOfCells() == 0:
            continue
        ids = pv.convert_array(cells.GetConnectivityArray())
        if ids.size and (ids.min() < 0 or ids.max() >= mesh.n_points):
            bad = ids.max() if ids.max() >= mesh.n_points else ids.min()
            raise DataError(f"{path}: a cell names point {int(bad)}, but the mesh has "
                            f"{mesh.n_points} points (a corrupt or hand-edited file)")


def _single(dataset, path: Path):
    """A multi-block result (OpenFOAM regions, EnSight parts) as one dataset."""
    pv = require_pyvista()
    if isinstance(dataset, pv.MultiBlock):
        blocks = [b for b in dataset.recursive_iterator() if b is not None and b.n_points]
        if not blocks:
            raise DataError(f"{path}: the file holds no mesh (no block with points)")
        if len(blocks) == 1:
            return blocks[0]
        merged = pv.merge(blocks, merge_points=False)
        return merged
    return dataset


class _Collect(logging.Handler):
    def __init__(self, messages: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"ERROR: {record.getMessage()}" if record.levelno >= logging.ERROR
                             else record.getMessage())


@contextlib.contextmanager
def _captured_pyvista_log(messages: list[str]):
    """pyvista's observer on its readers reports VTK errors through the root logger (not
    VTK's output window): collect them instead of printing."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = [_Collect(messages)]
    root.setLevel(logging.WARNING)
    try:
        yield messages
    finally:
        root.handlers, root.level = handlers, level


def _vtk_read(path: Path, make_reader: Callable[[], Any] | None = None):
    """``make_reader().read()`` (default ``pyvista.read``) with VTK's messages captured
    (the reader's set-up parses files too): any error is a :class:`DataError` naming the
    file (VTK reports a truncated file in its log and returns what it could read)."""
    pv = require_pyvista()
    logged: list[str] = []
    try:
        with captured_vtk_messages() as messages, _captured_pyvista_log(logged), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mesh = pv.read(path) if make_reader is None else make_reader().read()
    except Exception as err:   # pyvista raises its own and VTK's types: all mean unreadable
        text = str(err).strip()
        raise DataError(f"{path}: unreadable or truncated file ({type(err).__name__}: "
                        f"{text.splitlines()[-1] if text else err})") from None
    errors = [m for m in messages + logged if m.startswith("ERROR") or "Error" in m]
    if errors:
        detail = " ".join(errors[0].split("\n")[1:]).strip() or errors[0]
        raise DataError(f"{path}: unreadable or truncated file ({detail[:200]})")
    return mesh


# ---------------------------------------------------------------------------------------------
# the formats

@register_format("vtu", (".vtu",), "pyvista", doc="VTK XML unstructured grid")
@register_format("vtp", (".vtp",), "pyvista", doc="VTK XML polygonal data (surfaces)")
@register_format("vtk", (".vtk",), "pyvista", doc="VTK legacy file")
def read_vtk(path: Path):
    return _vtk_read(path)


@register_format("vtkhdf", (".vtkhdf",), "pyvista", doc="VTKHDF (HDF5) file")
def read_vtkhdf(path: Path):
    """A VTKHDF file whose data are all its own (:func:`hdf5_data_inside`)."""
    hdf5_data_inside(path)
    return _vtk_read(path)


def hdf5_data_inside(path: Path) -> None:
    """Refuse an HDF5 file that reads data from other files -- an external link, a dataset
    with external storage (raw bytes of any file, at any path) or a virtual dataset --
    which VTK's reader would follow wherever they point (as an XDMF data item would,
    :func:`xdmf_tree`); a :class:`DataError` naming the file and the object."""
    found: list[str] = []

    def look(name: str, link: Any) -> None:
        if isinstance(link, h5py.ExternalLink):
            found.append(f"{name!r} is an external link to {link.filename!r}")
            return
        item = f.get(name)
        if isinstance(item, h5py.Dataset) and (item.external or item.is_virtual):
            found.append(f"dataset {name!r} reads its data from "
                         + ("external files" if item.external else "other datasets (virtual)"))
    try:
        with h5py.File(path, "r") as f:
            f.visititems_links(look)
    except OSError as err:
        raise DataError(f"{path}: unreadable or truncated HDF5 file ({err})") from None
    if found:
        raise DataError(f"{path}: {found[0]}; a VTKHDF file is read from its own data only")


@register_format("stl", (".stl",), "pyvista", arrays=False,
                 doc="STL surface (geometry only: no data arrays)")
def read_stl(path: Path):
    return _vtk_read(path)


@register_format("ensight", (".case",), "pyvista", doc="EnSight Gold case (all parts merged)")
def read_ensight(path: Path):
    pv = require_pyvista()
    return _vtk_read(path, lambda: pv.get_reader(str(path)))


@register_format("openfoam", (".foam",), "pyvista", marker=True,
                 doc="OpenFOAM case (its .foam file): the internal mesh at the latest time, "
                     "cell fields as cell data")
def read_openfoam(path: Path):
    pv = require_pyvista()

    if not (path.parent / "constant" / "polyMesh").is_dir():
        raise DataError(f"{path}: the OpenFOAM case has no internal mesh (constant/polyMesh "
                        "missing beside the .foam file)")

    def reader():
        made = pv.POpenFOAMReader(str(path))
        made.cell_to_point_creation = False   # cell fields stay cell data
        if made.time_values:
            made.set_active_time_value(made.time_values[-1])
        made.enable_all_cell_arrays()
        return made

    blocks = _vtk_read(path, reader)
    internal = blocks["internalMesh"] if "internalMesh" in blocks.keys() else None
    if internal is None or internal.n_cells == 0:
        raise DataError(f"{path}: the OpenFOAM case has no internal mesh (constant/polyMesh "
                        "missing, empty or truncated)")
    return internal


def _meshio_read(path: Path, read: Callable[[], Any] | None = None):
    """``read()`` (default ``meshio.read(path)``) as a pyvista dataset; any failure is a
    :class:`DataError` naming the file."""
    meshio = require_meshio()
    pv = require_pyvista()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mesh = meshio.read(path) if read is None else read()
    except Exception as err:   # meshio raises ReadError, ValueError, KeyError, h5py's...
        raise DataError(f"{path}: unreadable, truncated or inconsistent file "
                        f"({type(err).__name__}: {err})") from None
    return pv.from_meshio(mesh)


@register_format("gmsh", (".msh",), "meshio", doc="Gmsh mesh (.msh)")
def read_gmsh(path: Path):
    # meshio loops forever on a Gmsh file cut short; a complete one ends with an $End line
    with open(path, "rb") as f:
        f.seek(max(path.stat().st_size - 64, 0))
        tail = f.read().rstrip().rsplit(b"\n", 1)[-1]
    if not tail.strip().startswith(b"$End"):
        raise DataError(f"{path}: truncated Gmsh file (it does not end with an $End... "
                        "section line)")
    return _meshio_read(path)


@register_format("xdmf", (".xdmf",), "meshio", doc="XDMF (with its HDF5 heavy data)")
def read_xdmf(path: Path):
    """An XDMF file through meshio's reader, given the XML tree :func:`xdmf_tree` confined
    (meshio would read a ``Binary`` data item's file wherever it points)."""
    root = xdmf_tree(path)

    def read():
        from meshio.xdmf.main import XdmfReader
        version = root.get("Version", "")
        if root.tag != "Xdmf" or version.split(".")[0] not in ("2", "3"):
            raise ValueError(f"not an XDMF 2 or 3 document (root {root.tag!r}, version "
                             f"{version!r})")
        reader = XdmfReader(str(path))
        return reader.read_xdmf2(root) if version.startswith("2") else reader.read_xdmf3(root)
    return _meshio_read(path, read)


def xdmf_tree(path: Path):
    """The XML root of the XDMF file ``path``, every heavy-data file it names (a
    ``DataItem`` of format ``Binary``, or ``HDF`` as ``file.h5:/dataset``) confined to the
    file's directory (:func:`flarepp.io.confined`: relative to it, as XDMF defines, or an
    absolute path inside it) and rewritten as an absolute path, so that no file outside
    the case is read; anything else is a :class:`DataError` naming the file and the item."""
    from xml.etree import ElementTree
    try:
        root = ElementTree.parse(path).getroot()
    except (ElementTree.ParseError, OSError) as err:
        raise DataError(f"{path}: unreadable, truncated or inconsistent file (XML: {err})"
                        ) from None
    folder = path.parent
    for item in root.iter("DataItem"):
        fmt = item.get("Format", "XML")
        if fmt not in ("Binary", "HDF"):
            continue
        text = (item.text or "").strip()
        name, colon, dataset = text.partition(":") if fmt == "HDF" else (text, "", "")
        item.text = str(_heavy_data_file(folder, name, path, fmt)) + colon + dataset
    return root


def _heavy_data_file(folder: Path, name: str, path: Path, fmt: str) -> Path:
    named = PurePosixPath(name)
    if named.is_absolute():   # meshio's own writer names a Binary file as it was given
        for base in (folder.absolute(), folder.resolve()):
            if named.is_relative_to(base.as_posix()):
                named = named.relative_to(base.as_posix())
                break
    try:
        return confined(folder, named.as_posix() if name else name,
                        what=f"{path}: the {fmt} data item's file").absolute()
    except UnsafeName as err:
        raise DataError(f"{err}; an XDMF case reads its heavy data from files in its own "
                        "directory") from None


# ---------------------------------------------------------------------------------------------
# cell geometry

POLYGON_TYPES = {5: None, 7: None, 9: None, 8: np.array([0, 1, 3, 2])}
"""VTK cell types read as polygons (triangle, polygon, quad; a pixel with its vertex order
turned into a polygon's)."""


def cell_type_dimension(cell_type: int) -> int:
    """The dimension (0-3) of the cells of a VTK cell type."""
    from vtkmodules import vtkCommonDataModel as dm
    utilities = getattr(dm, "vtkCellTypeUtilities", None) or dm.vtkCellTypes
    return int(utilities.GetDimension(int(cell_type)))


def _cell_type_name(cell_type: int) -> str:
    from vtkmodules import vtkCommonDataModel as dm
    utilities = getattr(dm, "vtkCellTypeUtilities", None) or dm.vtkCellTypes
    return str(utilities.GetClassNameFromTypeId(int(cell_type)))


def _unstructured(mesh):
    """``mesh`` as an unstructured grid (itself when it is one: pyvista's cast copies)."""
    pv = require_pyvista()
    return mesh if isinstance(mesh, pv.UnstructuredGrid) else mesh.cast_to_unstructured_grid()


def cell_arrays(mesh) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(cell types [C], offsets [C + 1], connectivity)`` of any pyvista dataset (views of
    an unstructured grid's own arrays where they are int64 already)."""
    from vtkmodules.util.numpy_support import vtk_to_numpy
    grid = _unstructured(mesh)
    cells = grid.GetCells()
    return (np.asarray(grid.celltypes).astype(np.int64, copy=False),
            vtk_to_numpy(cells.GetOffsetsArray()).astype(np.int64, copy=False),
            vtk_to_numpy(cells.GetConnectivityArray()).astype(np.int64, copy=False))


def cell_dimension(mesh, path: Path | str) -> int:
    """The dimension (1, 2, 3) every cell of ``mesh`` has; cells of several dimensions (a
    volume mesh with boundary faces, a surface with edges) raise, naming the counts."""
    types = cell_arrays(mesh)[0]
    if len(types) == 0:
        raise DataError(f"{path}: the mesh has no cells (empty or truncated)")
    dims: dict[int, int] = {}
    counts = np.bincount(types)
    for t in np.flatnonzero(counts):
        dims[cell_type_dimension(t)] = dims.get(cell_type_dimension(t), 0) + int(counts[t])
    if len(dims) > 1:
        shown = ", ".join(f"{n} of dimension {d}" for d, n in sorted(dims.items()))
        raise DataError(f"{path}: its cells have several dimensions ({shown}); data at cells "
                        "needs cells of one dimension (extract the volume or the surface)")
    return next(iter(dims))


@dataclass
class CellGeometry:
    """Per cell: ``centres [C, 3]``, unit ``normals [C, 3]`` (2-D cells, else None) and
    ``measures [C]`` (areas of 2-D cells, volumes of 3-D cells), float64."""

    dimension: int
    centres: np.ndarray
    normals: np.ndarray | None
    measures: np.ndarray


def cell_geometry(mesh, path: Path | str) -> CellGeometry:
    """Centres, normals and areas (2-D cells) or centres and volumes (3-D cells) of every
    cell (module docstring); a degenerate cell (zero area or volume) raises, naming it."""
    dimension = cell_dimension(mesh, path)
    if dimension == 2:
        points = np.asarray(mesh.points, np.float64)
        types, offsets, connectivity = cell_arrays(mesh)
        unknown = sorted(set(types.tolist()) - set(POLYGON_TYPES))
        if unknown:
            raise DataError(f"{path}: 2-D cells of type {_cell_type_name(unknown[0])} are not "
                            "read at cells (triangles, quads, polygons and pixels are)")
        pixels = np.flatnonzero(types == 8)
        if len(pixels):
            connectivity = connectivity.copy()
            index = offsets[pixels, None] + POLYGON_TYPES[8]
            connectivity[offsets[pixels, None] + np.arange(4)] = connectivity[index]
        n = len(types)
        centres, normals, areas = np.empty((n, 3)), np.empty((n, 3)), np.empty(n)
        for start in range(0, n, CHUNK_CELLS):
            stop = min(start + CHUNK_CELLS, n)
            try:
                centres[start:stop], normals[start:stop], areas[start:stop] = \
                    polygon_centres_and_normals(points, offsets, connectivity, start, stop)
            except ValueError as err:
                raise DataError(f"{path}: {err}") from None
        return CellGeometry(2, centres, normals, areas)
    if dimension == 3:
        return _volume_geometry(mesh, path)
    raise DataError(f"{path}: its cells are {dimension}-D (vertices or lines); data at "
                    "cells needs surface (2-D) or volume (3-D) cells")


def _volume_geometry(mesh, path: Path | str) -> CellGeometry:
    """Volumes and centres of 3-D cells (module docstring): linear cells by their faces'
    fans (:func:`_fan_geometry`), one cell type at a time in chunks of
    :data:`CHUNK_VOLUME_CELLS`, each chunk's vertices read from the points as stored and
    made float64 there; any other 3-D cell (quadratic, polyhedron) through VTK's
    tetrahedra (:func:`triangulated_geometry`)."""
    types, offsets, connectivity = cell_arrays(mesh)
    points = np.asarray(mesh.points)
    n = len(types)
    centres, volumes = np.empty((n, 3)), np.empty(n)
    others = []
    present = np.flatnonzero(np.bincount(types))
    for cell_type in present:
        table = fan_table(int(cell_type))
        ids = None if len(present) == 1 else np.flatnonzero(types == cell_type)  # None: all
        if table is None:
            others.append(np.arange(n) if ids is None else ids)
            continue
        corners = np.diff(offsets) if ids is None else offsets[ids + 1] - offsets[ids]
        if (corners != table.points).any():
            others.append(np.arange(n) if ids is None else ids)
            continue
        for where, vertices_Cn in _chunks_of(ids, n, offsets, connectivity, table.points):
            extended_N3C = np.empty((len(table.face_weights) + table.points, 3,
                                     len(vertices_Cn)))
            # [n, C, 3] rows gathered, then turned: 3x faster than turning [C, n, 3]
            extended_N3C[:table.points] = np.take(points, vertices_Cn.T,
                                                  axis=0).transpose(0, 2, 1)
            centres[where], volumes[where] = _fan_geometry(extended_N3C, table)
    if others:
        ids = np.concatenate(others)
        centres[ids], volumes[ids] = triangulated_geometry(mesh, ids)
    if not (volumes > 0).all():
        bad = int(np.flatnonzero(~(volumes > 0))[0])
        raise DataError(f"{path}: cell {bad} has zero volume (degenerate), "
                        f"{int((~(volumes > 0)).sum())} such cell(s)")
    return CellGeometry(3, centres, None, volumes)


def _chunks_of(ids: np.ndarray | None, n: int, offsets: np.ndarray, connectivity: np.ndarray,
               corners: int):
    """``(where, vertex ids [C, corners])`` of chunks of the cells ``ids`` (each of
    ``corners`` points; None: all ``n`` cells); ``where`` a slice when the cells are
    consecutive, which reads their vertex ids as one run of the connectivity."""
    consecutive = ids is None or ids[-1] - ids[0] + 1 == len(ids)
    first = 0 if ids is None else int(ids[0])
    count = n if ids is None else len(ids)
    for start in range(0, count, CHUNK_VOLUME_CELLS):
        if consecutive:
            stop = first + min(start + CHUNK_VOLUME_CELLS, count)
            yield (slice(first + start, stop),
                   connectivity[offsets[first + start]:offsets[stop]].reshape(-1, corners))
        else:
            chunk = ids[start:start + CHUNK_VOLUME_CELLS]
            yield chunk, connectivity[offsets[chunk, None] + np.arange(corners)]


CHUNK_VOLUME_CELLS = 1 << 10
"""3-D cells per chunk of :func:`_volume_geometry`: its float64 temporaries (under 2 MiB)
stay in the cache, which makes the chunked loop 2x faster than whole arrays."""


@dataclass(frozen=True)
class FanTable:
    """The faces of a linear 3-D VTK cell type of ``points`` vertices as fans of triangles:
    ``face_weights [F, points]`` make the centre (vertex mean) of each face of more than 3
    vertices, and ``triangles [T, 3]`` index the cell's vertices (``0 .. points - 1``) and
    then those face centres; oriented outward, without the triangles through vertex 0.

    The same triangles as :func:`_fan_geometry` evaluates them: ``edges [K, 2]`` the pairs
    of cell vertices whose cross products ``x_a x x_b`` the triangles share (each cell edge
    serves the two faces that meet there), triangle ``t``'s ``det = sign_t x_{opposite_t} .
    (x_a x x_b)`` of edge ``edge_of[t]``, and ``weights [points + 1, T]``: row ``j <
    points`` the signed count of triangles at vertex ``j`` plus the share of the face
    centres it makes (``sum_t det_t (p + q + r) = sum_j (weights det)_j x_j``), the last
    row the signs (``sum_t det_t``)."""

    points: int
    face_weights: np.ndarray
    triangles: np.ndarray
    edges: np.ndarray
    opposite: np.ndarray
    edge_of: np.ndarray
    weights: np.ndarray


@functools.lru_cache(maxsize=None)
def fan_table(cell_type: int) -> FanTable | None:
    """The :class:`FanTable` of a linear 3-D VTK cell type, read from VTK's own face
    definitions (pixel faces of a voxel put in polygon order), or None for any other type
    (quadratic cells, polyhedra, lower dimensions) or one whose faces VTK does not orient
    consistently."""
    from vtkmodules.vtkCommonDataModel import vtkGenericCell
    cell = vtkGenericCell()
    cell.SetCellType(cell_type)
    n = cell.GetNumberOfPoints()
    if not cell.IsLinear() or cell.GetCellDimension() != 3 or n == 0 \
            or cell.GetParametricCoords() is None:
        return None
    cell.GetPointIds().SetNumberOfIds(n)
    cell.GetPoints().SetNumberOfPoints(n)
    for i in range(n):
        cell.GetPointIds().SetId(i, i)
    weights, triangles = [], []
    for f in range(cell.GetNumberOfFaces()):
        face = cell.GetFace(f)
        ids = [face.GetPointIds().GetId(j) for j in range(face.GetNumberOfPoints())]
        if face.GetCellType() == 8:          # a pixel: its vertices are not in cyclic order
            ids = [ids[0], ids[1], ids[3], ids[2]]
        if len(ids) == 3:
            triangles.append(ids)
            continue
        weights.append(np.bincount(ids, minlength=n) / len(ids))
        centre = n + len(weights) - 1
        triangles += [[ids[i], ids[(i + 1) % len(ids)], centre] for i in range(len(ids))]
    face_weights = np.asarray(weights).reshape(-1, n)
    triangles = np.asarray(triangles)
    reference = np.asarray(cell.GetParametricCoords()).reshape(n, 3)
    reference = reference - reference.mean(0)
    extended = np.concatenate([reference, face_weights @ reference])
    signs = np.sign(np.linalg.det(extended[triangles]))
    if not (signs == signs[0]).all():
        return None
    if signs[0] < 0:
        triangles = triangles[:, ::-1]
    return _shared_edges(n, face_weights, triangles[~(triangles == 0).any(axis=1)])


def _shared_edges(n: int, face_weights: np.ndarray, triangles: np.ndarray) -> FanTable:
    """The :class:`FanTable` of ``triangles`` (none through vertex 0): each triangle's
    determinant as ``x_c . (x_a x x_b)`` over one of its edges between cell vertices, a
    fan triangle's own face edge, a triangular face's an edge already chosen where it has
    one (fans first), so that the fewest cross products serve all."""
    edges: list[tuple[int, int]] = []
    opposite_T, edge_of_T = np.zeros(len(triangles), int), np.zeros(len(triangles), int)
    sign_T = np.zeros(len(triangles))
    for t in sorted(range(len(triangles)), key=lambda t: bool((triangles[t] < n).all())):
        a, b, c = (int(i) for i in triangles[t])
        turns = [(p, q, r) for p, q, r in ((a, b, c), (b, c, a), (c, a, b)) if p < n and q < n]
        p, q, r = next((turn for turn in turns if tuple(sorted(turn[:2])) in edges), turns[0])
        if (min(p, q), max(p, q)) not in edges:
            edges.append((min(p, q), max(p, q)))
        opposite_T[t], edge_of_T[t] = r, edges.index((min(p, q), max(p, q)))
        sign_T[t] = 1.0 if p < q else -1.0
    incidence = np.zeros((n + len(face_weights), len(triangles)))
    for t, triangle in enumerate(triangles):
        incidence[triangle, t] = 1.0
    at_vertices = incidence[:n] + face_weights.T @ incidence[n:]
    return FanTable(n, face_weights, triangles, np.asarray(edges).reshape(-1, 2), opposite_T,
                    edge_of_T, np.vstack([at_vertices * sign_T, sign_T]))


NEXT, AFTER = np.array([1, 2, 0]), np.array([2, 0, 1])
"""Coordinates turned for a cross product: ``(a x b)_k = a_next(k) b_after(k) - a_after(k)
b_next(k)``."""


def _fan_geometry(extended_N3C: np.ndarray, table: FanTable) -> tuple[np.ndarray, np.ndarray]:
    """Centres ``[C, 3]`` and volumes ``[C]`` of cells of one linear type from their
    vertices, the first ``table.points`` rows of ``extended_N3C`` (``[points + F, 3, C]``,
    whose last ``F`` rows it fills with the face centres, all relative to vertex 0): the
    divergence theorem over the faces fanned about their centres, as tetrahedra from vertex 0
    (``V = sum_t det(p, q, r) / 6``, centre ``x_0 + sum_t det_t (p + q + r) / (4 sum_t
    det_t)``), each ``det`` a dot with a cross product its edge shares and the corner sums
    one product with ``table.weights`` (:class:`FanTable`); exact for planar faces whatever
    the apex, and a cell numbered inside out gives the same centre and volume."""
    n = table.points
    apex = extended_N3C[0].copy()
    vertices = extended_N3C[:n]
    vertices -= apex
    if len(table.face_weights):
        np.matmul(table.face_weights, vertices.reshape(n, -1),
                  out=extended_N3C[n:].reshape(len(table.face_weights), -1))
    a, b = table.edges[:, :1], table.edges[:, 1:]
    cross = extended_N3C[a, NEXT] * extended_N3C[b, AFTER]   # [K, 3, C], gathered turned
    cross -= extended_N3C[a, AFTER] * extended_N3C[b, NEXT]
    dots = extended_N3C[table.opposite]
    dots *= cross[table.edge_of]
    det = dots[:, 0]
    det += dots[:, 1]
    det += dots[:, 2]
    weights = table.weights @ det
    six_volume = weights[n]
    moment = np.einsum("jc,jkc->kc", weights[1:n], vertices[1:])
    with np.errstate(divide="ignore", invalid="ignore"):
        centre = apex + moment / (4 * six_volume)
    return centre.T, np.abs(six_volume) / 6


def triangulated_geometry(mesh, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Centres ``[len(ids), 3]`` and volumes of the cells ``ids`` of ``mesh`` split into
    tetrahedra by VTK (``vtkDataSetTriangleFilter``): ``V = sum_t |det(b - a, c - a, d - a)|
    / 6`` and the volume-weighted centroid of the tetrahedra."""
    from vtkmodules.vtkFiltersGeneral import vtkDataSetTriangleFilter
    from vtkmodules.util.numpy_support import numpy_to_vtk, vtk_to_numpy
    pv = require_pyvista()
    grid = _unstructured(mesh).copy(deep=False)
    grid.clear_data()
    grid = grid.extract_cells(ids) if len(ids) < grid.n_cells else grid
    marks = numpy_to_vtk(np.arange(grid.n_cells, dtype=np.int64), deep=True)
    marks.SetName("flarepp_cell")
    grid.GetCellData().AddArray(marks)
    split = vtkDataSetTriangleFilter()
    split.SetInputData(grid)
    split.Update()
    tets = pv.wrap(split.GetOutput())
    owner = np.asarray(tets.cell_data["flarepp_cell"], np.int64)
    corners = vtk_to_numpy(tets.GetCells().GetConnectivityArray()).reshape(-1, 4)
    v_T43 = np.asarray(tets.points, np.float64)[corners]
    volume_T = np.abs(np.linalg.det(v_T43[:, 1:] - v_T43[:, :1])) / 6.0
    n = grid.n_cells
    volumes = np.bincount(owner, volume_T, n)
    centres = np.stack([np.bincount(owner, volume_T * v_T43[:, :, k].mean(1), n)
                        for k in range(3)], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return centres / volumes[:, None], volumes


# ---------------------------------------------------------------------------------------------
# fields written back onto a mesh

def point_cloud(coordinates_PG: np.ndarray):
    """A pyvista ``PolyData`` of vertices at ``coordinates [P, G]`` (G = 1..3; missing axes
    0): the mesh of samples that came without one (generated or ``.npz`` data)."""
    pv = require_pyvista()
    points = np.zeros((len(coordinates_PG), 3))
    width = min(3, coordinates_PG.shape[1])
    points[:, :width] = coordinates_PG[:, :width]
    return pv.PolyData(points)


def mesh_suffix(mesh) -> str:
    """The file suffix :func:`write_fields` gives ``mesh``: ``.vtp`` for polygon surfaces
    and point clouds (``PolyData``), ``.vtu`` for every other mesh."""
    return ".vtp" if isinstance(mesh, require_pyvista().PolyData) else ".vtu"


def written_bytes(mesh) -> int:
    """An upper bound of the bytes of ``mesh`` as VTK XML (appended raw data, zlib): its
    points, every point, cell and field array as stored, its cells' ids at 8 bytes (the
    writer's Int64) and types, 1% for the compressor's block headers and 64 KiB of XML."""
    arrays = [mesh.points, *(mesh.point_data[k] for k in mesh.point_data.keys()),
              *(mesh.cell_data[k] for k in mesh.cell_data.keys()),
              *(mesh.field_data[k] for k in mesh.field_data.keys())]
    total = sum(np.asarray(a).nbytes for a in arrays)
    if isinstance(mesh, require_pyvista().PolyData):
        cells = [mesh.GetVerts(), mesh.GetLines(), mesh.GetPolys(), mesh.GetStrips()]
    else:
        cells = [mesh.GetCells()]
        total += mesh.n_cells                                      # types, uint8
    ids = sum(c.GetNumberOfConnectivityIds() + c.GetNumberOfCells() + 1 for c in cells)
    return int(1.01 * (total + 8 * ids)) + (64 << 10) + 512 * len(arrays)


def write_fields(mesh, arrays: dict[str, np.ndarray], association: str, out: str | Path,
                 *, where: str = "") -> Path:
    """``mesh`` with ``arrays`` (``name -> [P or C] or [P or C, k]``) added as point or cell
    data (``association``), saved as ``out`` with :func:`mesh_suffix`'s suffix appended
    (``out`` ``a/Re.1e5`` gives ``a/Re.1e5.vtu``) by VTK's XML writer, through a temporary
    file and a rename; the path written. An array whose row count is not the mesh's is a
    :class:`DataError` naming ``where`` (the source file). Space first: a full disk or a
    file-size limit kills VTK's writer (SIGSEGV, SIGABRT), so the bytes are bounded
    (:func:`written_bytes`) and compared with the room there
    (:func:`flarepp.io.require_room`) before it runs, and its result is checked; a failure
    is an ``OSError`` naming the file and leaves no temporary."""
    pv = require_pyvista()
    if not isinstance(mesh, pv.PolyData):
        mesh = mesh.cast_to_unstructured_grid()
    rows = mesh.n_points if association == "point" else mesh.n_cells
    target = mesh.point_data if association == "point" else mesh.cell_data
    for name, values in arrays.items():
        if len(values) != rows:
            raise DataError(f"{where or 'the mesh'}: has {rows} {association}s but the "
                            f"predictions have {len(values)} rows for {name!r}; the source "
                            "file changed after conversion?")
        target[name] = np.ascontiguousarray(values)
    out = Path(out)
    out = out.with_name(out.name + mesh_suffix(mesh))
    require_room(out, written_bytes(mesh), "the mesh")

    def save(tmp: Path) -> None:  # the writer is chosen by the suffix, which tmp lacks
        named = Path(f"{tmp}{out.suffix}")
        try:
            _vtk_write(mesh, named, out)
            os.replace(named, tmp)
        finally:
            named.unlink(missing_ok=True)
    atomic_write(out, save)
    return out


def _vtk_write(mesh, path: Path, target: Path) -> None:
    """``mesh`` written to ``path`` by VTK's XML writer (appended raw data, zlib), its
    result checked: an ``OSError`` naming ``target`` when it reports a failure."""
    from vtkmodules.vtkCommonMisc import vtkErrorCode
    from vtkmodules.vtkIOXML import vtkXMLPolyDataWriter, vtkXMLUnstructuredGridWriter
    pv = require_pyvista()
    writer = (vtkXMLPolyDataWriter if isinstance(mesh, pv.PolyData)
              else vtkXMLUnstructuredGridWriter)()
    writer.SetFileName(str(path))
    writer.SetInputData(mesh)
    writer.SetDataModeToAppended()
    writer.EncodeAppendedDataOff()
    writer.SetCompressorTypeToZLib()
    ok = writer.Write()
    code = writer.GetErrorCode()
    if ok != 1 or code != 0 or not path.is_file():
        raise OSError(errno.EIO, "VTK's writer failed ("
                      f"{vtkErrorCode.GetStringFromErrorCode(code) if code else 'no file'})",
                      str(target))


__all__ = ["CellGeometry", "FanTable", "MESH_FORMATS", "MeshFormat", "MeshTooLarge",
           "cell_dimension", "cell_geometry", "cell_type_dimension", "declared_rows",
           "fan_table", "format_of", "hdf5_data_inside", "known_suffixes", "mesh_suffix",
           "point_cloud", "read_mesh", "register_format", "write_fields", "written_bytes"]
