"""The full-surface DrivAerML task's files: reader, memory-mapped cache, split and statistics.

DrivAerML (Ashton et al. 2024) releases one surface file per car, ``run_<i>/boundary_<i>.vtp``
(VTK XML PolyData, ~8.8M polygons), with OpenFOAM's time-averaged cell arrays ``pMeanTrim``
(kinematic surface pressure ``p_s = p / rho``, m^2/s^2) and ``wallShearStressMeanTrim``
(kinematic wall-shear vector ``tau_w / rho``, m^2/s^2). The paper's full-surface task (Section
4.2 and C.1) takes per cell its centre and unit normal as inputs (6 channels) and the pressure
and three wall-shear components as targets (4 channels), centres scaled to the training
split's bounding box and targets standardised by its per-channel mean and std; the split is
Alkin et al. (2025)'s, 400 train / 34 validation / 50 test runs.

Shape letters: N cells of one surface, P its points, K vertices of one polygon.

* **Geometry.** A polygon with vertices ``v_0 .. v_{K-1}`` (orientation as stored) has the
  fan area vector ``a = 1/2 sum_{k=1}^{K-2} (v_k - v_0) x (v_{k+1} - v_0)`` (equal to Newell's
  vector of its edges), unit normal ``n = a / |a|`` and centre the area-weighted centroid of
  its fan triangles, ``sum_t w_t c_t / sum_t w_t`` with ``w_t = a_t . n`` (the polygon's
  centroid when it is planar, also for non-convex ones). Triangles, quads and any larger
  polygons are handled alike.
* **Cache.** Reading an 8.8M-cell ``.vtp`` takes far longer than a training step, so each car
  is converted once into ``<cache>/run_<i>/`` holding ``centres.npy`` [N, 3], ``normals.npy``
  [N, 3], ``areas.npy`` [N, 1] (the cells' areas, for integrated forces), ``fields.npy``
  [N, 4] (float32) and ``meta.json``, a sample of the store format
  (:func:`flarepp.data.store.write_sample`: temporary files and renames, ``meta.json``
  last); :meth:`DrivAerMLSurfaces.prepare` adds the ``manifest.json`` that makes the cache a
  complete store. ``meta.json`` also keeps the free-stream velocity a file states (the
  ``flarepp`` field data of generated surfaces; the released files state none) and records
  the source file's size, its
  modification time, a hash of its header and of blocks sampled through it
  (:func:`sampled_digest`: an edited file whose size and time were restored is seen too) and
  the array names, so a changed source (or other field names) is converted again; later
  loads open the arrays with ``numpy.load(mmap_mode="r")``.
* **Statistics** of the training split (bounding box of the centres, per-channel mean and
  std of the targets over every training cell) are computed streaming, chunk by chunk, in
  float64 with the pairwise update of Chan, Golub & LeVeque (1979), and cached as JSON.

Every problem with a file (missing run directory or file, unreadable or truncated file,
missing array, wrong number of components or cells, non-finite values, degenerate cells)
raises ``DataError`` naming the file and the problem. Reading needs VTK (``pip install
'flarepp[surface]'``); the cache and the statistics do not.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from flarepp.data.base import DataError, merge_moments  # noqa: F401  (re-exported)
from flarepp.data.fingerprint import sampled_digest  # noqa: F401  (re-exported)
from flarepp.data.layout import ChannelGroup, ChannelLayout
from flarepp.data.store import open_sample, read_sample_meta, write_manifest, write_sample
from flarepp.io import atomic_write_json

PRESSURE_ARRAY = "pMeanTrim"
WALL_SHEAR_ARRAY = "wallShearStressMeanTrim"
FIELD_NAMES = ("p_s", "tau_x", "tau_y", "tau_z")   # the 4 target channels, in this order
FIELD_UNITS = "m^2/s^2"                             # kinematic: divided by the density
SPLIT_NAMES = ("train", "val", "test")
CACHE_FORMAT = 2                 # 2: a store sample, with cell areas and the stated free stream
CACHE_DIR_NAME = ".flarepp_cache"
CHUNK_CELLS = 1 << 20        # cells per chunk when computing geometry or statistics
RUN_ID = re.compile(r"run_(\d+)")
CACHE_ARRAYS = {"centres": 3, "normals": 3, "fields": len(FIELD_NAMES), "areas": 1}
"""The arrays of a cached car (:func:`~flarepp.data.store.write_sample`) and their widths."""


def cache_layout(pressure_array: str, wall_shear_array: str) -> ChannelLayout:
    """The cache as a store: inputs the cell centres and normals, targets the 4 fields."""
    return ChannelLayout(
        inputs=(ChannelGroup("centres", ("x", "y", "z"), "cell centres", units="m"),
                ChannelGroup("normals", ("n_x", "n_y", "n_z"), "cell normals")),
        targets=(ChannelGroup("fields", FIELD_NAMES, f"{pressure_array}, {wall_shear_array}",
                              units=FIELD_UNITS),),
        association="cell", coordinates=3, dimensions=3)
VTK_INSTALL_HINT = "pip install 'flarepp[surface]' (the PyPI wheel 'vtk')"


# ---------------------------------------------------------------------------------------------
# VTK access: optional dependency, errors captured instead of printed

def require_vtk():
    """Import the VTK modules this package uses, or raise a message saying how to install."""
    try:
        from vtkmodules import vtkCommonCore, vtkCommonDataModel, vtkIOXML
        from vtkmodules.util import numpy_support
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"reading and writing .vtp surfaces needs VTK ({err.name} is missing): "
            f"{VTK_INSTALL_HINT}") from err
    return vtkCommonCore, vtkCommonDataModel, vtkIOXML, numpy_support


@contextlib.contextmanager
def captured_vtk_messages() -> Iterator[list[str]]:
    """Collect VTK's error and warning text for the duration of the block instead of
    printing it; the list holds the text once the block exits.

    VTK reports reader failures through its output window and logger, not exceptions. The
    process-wide output window and stderr verbosity are swapped only inside the block and
    restored on exit.
    """
    core, _, _, _ = require_vtk()
    window = core.vtkStringOutputWindow()
    previous_window = core.vtkOutputWindow.GetInstance()
    # VTK has no getter for the stderr verbosity; with no log callbacks added, the cutoff is it
    previous_verbosity = core.vtkLogger.GetCurrentVerbosityCutoff()
    messages: list[str] = []
    core.vtkOutputWindow.SetInstance(window)
    core.vtkLogger.SetStderrVerbosity(core.vtkLogger.VERBOSITY_OFF)
    try:
        yield messages
    finally:
        core.vtkOutputWindow.SetInstance(previous_window)
        core.vtkLogger.SetStderrVerbosity(previous_verbosity)
        text = window.GetOutput().strip()
        if text:
            messages.extend(m.strip() for m in re.split(r"\n\s*\n", text) if m.strip())


@dataclass
class SurfacePolygons:
    """A polygon surface: ``points [P, 3]``, ``offsets [N + 1]`` and ``connectivity``
    (cell ``i`` has vertices ``connectivity[offsets[i]:offsets[i + 1]]``), and cell arrays."""

    points: np.ndarray
    offsets: np.ndarray
    connectivity: np.ndarray
    cell_arrays: dict[str, np.ndarray]
    field_data: dict = field(default_factory=dict)   # the ``flarepp`` record, if written

    @property
    def n_cells(self) -> int:
        return len(self.offsets) - 1


def read_vtp(path: str | Path, arrays: Sequence[str] | None = None) -> SurfacePolygons:
    """Read a VTK XML PolyData file of polygons; ``arrays``: cell arrays to return (None: all).

    Raises ``DataError`` naming the file for a missing, unreadable or truncated file, cells
    that are not polygons, or a requested array that is absent or has the wrong cell count.
    """
    _, _, io_xml, numpy_support = require_vtk()
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: surface file is missing")
    reader = io_xml.vtkXMLPolyDataReader()
    reader.SetFileName(str(path))
    with captured_vtk_messages() as messages:
        reader.Update()
    errors = [m for m in messages if m.startswith("ERROR")]
    polydata = reader.GetOutput()
    if errors:
        detail = " ".join(errors[0].split("\n")[1:]).strip() or errors[0]
        raise DataError(f"{path}: unreadable or truncated VTK file ({detail})")
    n_cells = polydata.GetNumberOfCells()
    if n_cells == 0 or polydata.GetPoints() is None:
        raise DataError(f"{path}: no cells (empty, truncated or not a PolyData surface)")
    if polydata.GetNumberOfPolys() != n_cells:
        raise DataError(f"{path}: {n_cells - polydata.GetNumberOfPolys()} of {n_cells} cells "
                        "are vertices, lines or strips; only polygon surfaces are supported")
    polys = polydata.GetPolys()
    cell_data = polydata.GetCellData()
    names = [cell_data.GetArrayName(i) for i in range(cell_data.GetNumberOfArrays())]
    wanted = names if arrays is None else list(arrays)
    cell_arrays = {}
    for name in wanted:
        array = cell_data.GetArray(name)
        if array is None:
            point_data = polydata.GetPointData()
            where = (" (it is a point array; cell data is expected)"
                     if point_data.GetArray(name) is not None else "")
            raise DataError(f"{path}: cell array {name!r} is missing{where}; the file has "
                            f"cell arrays {names}")
        values = numpy_support.vtk_to_numpy(array)
        if len(values) != n_cells:
            raise DataError(f"{path}: cell array {name!r} has {len(values)} values for "
                            f"{n_cells} cells")
        cell_arrays[name] = values
    record = polydata.GetFieldData().GetAbstractArray("flarepp")
    try:
        field_data = json.loads(record.GetValue(0)) if record is not None else {}
    except (AttributeError, ValueError):  # another tool's array of that name: not ours
        field_data = {}
    surface = SurfacePolygons(
        points=numpy_support.vtk_to_numpy(polydata.GetPoints().GetData()),
        offsets=numpy_support.vtk_to_numpy(polys.GetOffsetsArray()).astype(np.int64),
        connectivity=numpy_support.vtk_to_numpy(polys.GetConnectivityArray()).astype(np.int64),
        cell_arrays=cell_arrays, field_data=field_data)
    check_cells(surface, path)
    return surface


def check_cells(surface: SurfacePolygons, path: str | Path) -> None:
    """Raise ``DataError`` naming ``path`` unless the offsets delimit every cell's vertices
    in the connectivity and every vertex index is one of the file's points: VTK reads a
    corrupt index as is, and numpy would take -1 as the last point and fail on one too large
    with a bare ``IndexError``."""
    offsets, connectivity = surface.offsets, surface.connectivity
    n_points = len(surface.points)
    if (offsets[0] != 0 or offsets[-1] != len(connectivity)
            or (np.diff(offsets) < 0).any()):
        raise DataError(f"{path}: the polygon offsets do not delimit the {len(connectivity)} "
                        f"connectivity entries (corrupt file)")
    outside = (connectivity < 0) | (connectivity >= n_points)
    if outside.any():
        first = int(np.flatnonzero(outside)[0])
        cell = int(np.searchsorted(offsets, first, side="right")) - 1
        raise DataError(f"{path}: cell {cell} refers to point {int(connectivity[first])}, but "
                        f"the file's points are numbered 0 to {n_points - 1} "
                        f"({int(outside.sum())} such vertex index(es); corrupt connectivity)")


def write_vtp(path: str | Path, surface: SurfacePolygons, field_data: dict | None = None) -> Path:
    """Write ``surface`` as VTK XML PolyData (appended raw binary), atomically: the file is
    written beside ``path`` under a temporary name and renamed. ``field_data`` (a JSON-able
    dict) is stored as the string field array ``flarepp`` for provenance."""
    core, data_model, io_xml, numpy_support = require_vtk()
    path = Path(path)
    polydata = data_model.vtkPolyData()
    points = core.vtkPoints()
    points.SetData(numpy_support.numpy_to_vtk(np.ascontiguousarray(surface.points), deep=True))
    polydata.SetPoints(points)
    cells = data_model.vtkCellArray()
    cells.SetData(numpy_support.numpy_to_vtk(surface.offsets.astype(np.int64), deep=True),
                  numpy_support.numpy_to_vtk(surface.connectivity.astype(np.int64), deep=True))
    polydata.SetPolys(cells)
    for name, values in surface.cell_arrays.items():
        array = numpy_support.numpy_to_vtk(np.ascontiguousarray(values), deep=True)
        array.SetName(name)
        polydata.GetCellData().AddArray(array)
    if field_data is not None:
        text = core.vtkStringArray()
        text.SetName("flarepp")
        text.InsertNextValue(json.dumps(field_data, sort_keys=True))
        polydata.GetFieldData().AddArray(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    writer = io_xml.vtkXMLPolyDataWriter()
    writer.SetFileName(str(tmp))
    writer.SetInputData(polydata)
    writer.SetDataModeToAppended()
    writer.EncodeAppendedDataOff()
    writer.SetCompressorTypeToNone()
    try:
        with captured_vtk_messages() as messages:
            ok = writer.Write()
        if not ok or any(m.startswith("ERROR") for m in messages):
            raise OSError(f"{path}: VTK could not write the file ({' '.join(messages)})")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# ---------------------------------------------------------------------------------------------
# cell geometry

def polygon_centres_and_normals(points_P3: np.ndarray, offsets: np.ndarray,
                                connectivity: np.ndarray, start: int = 0,
                                stop: int | None = None) -> tuple[np.ndarray, np.ndarray,
                                                                  np.ndarray]:
    """Centres ``[n, 3]``, unit normals ``[n, 3]`` and areas ``[n]`` of cells ``start:stop``
    (float64; module docstring). Raises ``ValueError`` for a cell of zero area or fewer than
    three vertices, naming the first such cell."""
    stop = len(offsets) - 1 if stop is None else stop
    first, sizes = offsets[start:stop], np.diff(offsets[start:stop + 1])
    centres = np.empty((stop - start, 3))
    area_vectors = np.empty((stop - start, 3))
    for size in np.unique(sizes):
        if size < 3:
            bad = start + int(np.flatnonzero(sizes == size)[0])
            raise ValueError(f"cell {bad} has {size} vertices; a polygon needs at least 3")
        cells = np.flatnonzero(sizes == size)
        v_nK3 = points_P3[connectivity[first[cells, None] + np.arange(size)]].astype(np.float64)
        edge_a = v_nK3[:, 1:-1] - v_nK3[:, :1]
        edge_b = v_nK3[:, 2:] - v_nK3[:, :1]
        fan_nT3 = 0.5 * np.cross(edge_a, edge_b)                     # fan triangle areas
        area_n3 = fan_nT3.sum(axis=1)
        unit_n3 = area_n3 / np.linalg.norm(area_n3, axis=1, keepdims=True).clip(1e-300)
        weight_nT = np.einsum("ntc,nc->nt", fan_nT3, unit_n3)        # signed, for non-convex
        centre_nT3 = (v_nK3[:, :1] + v_nK3[:, 1:-1] + v_nK3[:, 2:]) / 3.0
        centres[cells] = (np.einsum("nt,ntc->nc", weight_nT, centre_nT3)
                          / weight_nT.sum(axis=1, keepdims=True).clip(1e-300))
        area_vectors[cells] = area_n3
    areas = np.linalg.norm(area_vectors, axis=1)
    if not (areas > 0).all():
        bad = start + int(np.flatnonzero(~(areas > 0))[0])
        raise ValueError(f"cell {bad} has zero area (degenerate polygon), "
                         f"{int((~(areas > 0)).sum())} such cell(s) in cells {start}:{stop}")
    return centres, area_vectors / areas[:, None], areas


# ---------------------------------------------------------------------------------------------
# the split

def default_split_file() -> Path:
    """The paper's split (Section C.1: Alkin et al. 2025's run ids), shipped with the package."""
    return Path(str(resources.files("flarepp.data") / "splits" / "drivaerml_split.json"))


def load_split(path: str | Path | None = None) -> dict[str, list[str]]:
    """Read a split file: a JSON object with lists ``train`` and ``test`` (``val`` optional)
    of run ids ``"run_<i>"``; other keys (a description, hidden runs) are ignored. ``None``
    reads the packaged default. Raises ``DataError`` naming the file for anything else."""
    path = default_split_file() if path is None else Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: split file is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: split file is not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path}: split file must hold a JSON object with lists 'train' and "
                        f"'test', got {type(raw).__name__}")
    split, seen = {}, {}
    for name in SPLIT_NAMES:
        if name not in raw:
            if name == "val":
                split[name] = []
                continue
            raise DataError(f"{path}: split file has no {name!r} list (keys: {sorted(raw)})")
        runs = raw[name]
        if not isinstance(runs, list) or not all(isinstance(r, str) and RUN_ID.fullmatch(r)
                                                  for r in runs):
            raise DataError(f"{path}: {name!r} must be a list of run ids 'run_<i>'")
        for run in runs:
            if run in seen:
                raise DataError(f"{path}: {run} is listed twice (in {seen[run]!r} and "
                                f"{name!r})")
            seen[run] = name
        split[name] = list(runs)
    return split


# ---------------------------------------------------------------------------------------------
# one converted surface and the training statistics

@dataclass
class SurfaceCar:
    """One car: ``centres [N, 3]``, unit ``normals [N, 3]``, cell ``areas [N]`` (m^2) and
    ``fields [N, 4]`` = (p_s, tau_x, tau_y, tau_z) in m^2/s^2, float32 arrays memory-mapped
    from the cache; ``free_stream`` the velocity (m/s) the file states, or None."""

    car: str
    source: Path
    centres: np.ndarray
    normals: np.ndarray
    fields: np.ndarray
    areas: np.ndarray
    free_stream: tuple[float, float, float] | None = None

    @property
    def n_cells(self) -> int:
        return int(self.centres.shape[0])


@dataclass
class SurfaceStatistics:
    """Training-split statistics (paper C.1): bounding box of the cell centres and the
    per-channel mean and std (population, ddof 0) of the 4 targets over all training cells."""

    bbox_min: list[float]
    bbox_max: list[float]
    field_mean: list[float]
    field_std: list[float]
    n_cells: int
    n_runs: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict) -> "SurfaceStatistics":
        return cls(**state)


class DrivAerMLSurfaces:
    """The full-surface DrivAerML files under ``root`` (``root/run_<i>/boundary_<i>.vtp``).

    ``split_file``: JSON of run ids (``load_split``; default the paper's split).
    ``cache_dir``: where converted arrays go (default ``root/.flarepp_cache``).
    ``pressure_array``, ``wall_shear_array``: the cell arrays to read.

    ``runs(split)`` lists run ids, ``load(run)`` returns a ``SurfaceCar`` of memory-mapped
    arrays (converting the ``.vtp`` on first use), ``statistics()`` the training-split
    statistics, ``polygons(run)`` the surface itself for pictures.
    """

    def __init__(self, root: str | Path, *, split_file: str | Path | None = None,
                 cache_dir: str | Path | None = None, pressure_array: str = PRESSURE_ARRAY,
                 wall_shear_array: str = WALL_SHEAR_ARRAY) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise DataError(f"{self.root}: DrivAerML directory does not exist")
        self.split_file = default_split_file() if split_file is None else Path(split_file)
        self.split = load_split(self.split_file)
        self.cache_dir = self.root / CACHE_DIR_NAME if cache_dir is None else Path(cache_dir)
        self.pressure_array = pressure_array
        self.wall_shear_array = wall_shear_array
        # sampled_digest per source, keyed by what any write changes (ctime even when the
        # size and modification time are restored): a load per training step costs a stat
        self._digests: dict[tuple, str] = {}

    # -- layout ---------------------------------------------------------------------------

    def cars(self, split: str = "train") -> list[str]:
        if split not in self.split:
            raise ValueError(f"unknown split {split!r}; known splits: {list(self.split)}")
        return list(self.split[split])

    def vtp_path(self, car: str) -> Path:
        """``root/run_<i>/boundary_<i>.vtp``; ``DataError`` when the run or file is missing."""
        match = RUN_ID.fullmatch(car)
        if match is None:
            raise DataError(f"{car!r} is not a run id 'run_<i>'")
        run_dir = self.root / car
        if not run_dir.is_dir():
            raise DataError(f"{run_dir}: run directory is missing (listed in "
                            f"{self.split_file})")
        path = run_dir / f"boundary_{match.group(1)}.vtp"
        if not path.is_file():
            raise DataError(f"{path}: surface file is missing")
        return path

    def check_layout(self, splits: Sequence[str] = ("train", "test")) -> None:
        """Raise ``DataError`` listing the runs of ``splits`` whose file is missing."""
        missing = [run for split in splits for run in self.cars(split)
                   if not (self.root / run / f"boundary_{run[4:]}.vtp").is_file()]
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise DataError(f"{self.root}: {len(missing)} run(s) of {list(splits)} in "
                            f"{self.split_file} have no boundary file: {shown}")

    # -- conversion and loading -----------------------------------------------------------

    def _meta(self, source: Path) -> dict:
        stat = source.stat()
        return {"format": CACHE_FORMAT, "source": str(source.resolve()),
                "source_size": stat.st_size, "source_mtime_ns": stat.st_mtime_ns,
                "source_digest": self._digest(source, stat),
                "arrays": [self.pressure_array, self.wall_shear_array]}

    def _digest(self, source: Path, stat: os.stat_result) -> str:
        key = (str(source), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
        if key not in self._digests:
            self._digests[key] = sampled_digest(source)
        return self._digests[key]

    def load(self, car: str) -> SurfaceCar:
        """The run's arrays, memory-mapped from the cache (converted from the ``.vtp`` first
        when the cache is missing or was made from another version of the file)."""
        source = self.vtp_path(car)
        folder = self.cache_dir / car
        expected = self._meta(source)
        cached = self._open_cache(folder, expected)
        if cached is None:
            self.convert(car)
            cached = self._open_cache(folder, expected)
            if cached is None:
                raise DataError(f"{folder}: cache written for {source} cannot be read back")
        return SurfaceCar(car, source, *cached)

    @staticmethod
    def _open_cache(folder: Path, expected: dict) -> tuple[np.ndarray, ...] | None:
        arrays = open_sample(folder, expected, CACHE_ARRAYS)
        if arrays is None:
            return None
        stream = read_sample_meta(folder).get("free_stream")
        return (arrays["centres"], arrays["normals"], arrays["fields"], arrays["areas"][:, 0],
                None if stream is None else tuple(float(v) for v in stream))

    def convert(self, car: str) -> Path:
        """Read ``car``'s ``.vtp``, check it, and write its cache folder (module docstring)."""
        source = self.vtp_path(car)
        meta = self._meta(source)
        surface = read_vtp(source, [self.pressure_array, self.wall_shear_array])
        pressure = surface.cell_arrays[self.pressure_array]
        wall_shear = surface.cell_arrays[self.wall_shear_array]
        n = surface.n_cells
        if pressure.reshape(n, -1).shape[1] != 1:
            raise DataError(f"{source}: cell array {self.pressure_array!r} has "
                            f"{pressure.reshape(n, -1).shape[1]} components, expected 1")
        if wall_shear.reshape(n, -1).shape[1] != 3:
            raise DataError(f"{source}: cell array {self.wall_shear_array!r} has "
                            f"{wall_shear.reshape(n, -1).shape[1]} components, expected 3")
        fields = np.concatenate([pressure.reshape(n, 1), wall_shear.reshape(n, 3)], axis=1)
        for name, values in ((self.pressure_array, fields[:, :1]),
                             (self.wall_shear_array, fields[:, 1:]), ("points", surface.points)):
            finite = np.isfinite(values).all(axis=-1)
            if not finite.all():
                raise DataError(f"{source}: {name} holds {int((~finite).sum())} non-finite "
                                f"value(s), first at index {int(np.flatnonzero(~finite)[0])}")
        folder = self.cache_dir / car
        centres, normals = np.empty((n, 3), np.float32), np.empty((n, 3), np.float32)
        areas = np.empty(n, np.float32)
        for start in range(0, n, CHUNK_CELLS):          # bounded float64 temporaries
            stop = min(start + CHUNK_CELLS, n)
            try:
                centres[start:stop], normals[start:stop], areas[start:stop] = \
                    polygon_centres_and_normals(surface.points, surface.offsets,
                                                surface.connectivity, start, stop)
            except ValueError as err:
                raise DataError(f"{source}: {err}") from None
        meta["n_cells"] = n
        if "free_stream" in surface.field_data:
            meta["free_stream"] = [float(v) for v in surface.field_data["free_stream"]]
        try:
            write_sample(folder, {"centres": centres, "normals": normals, "fields": fields,
                                  "areas": areas[:, None]}, meta)
        except DataError as err:
            raise DataError(f"{err}; pass cache_dir= a writable directory") from None
        return folder

    def prepare(self, splits: Sequence[str] = ("train", "test"), progress: bool = True) -> None:
        """Convert every run of ``splits`` whose cache is missing or stale, then write the
        cache's ``manifest.json``: the cache is then a complete store
        (:mod:`flarepp.data.store`; ``flarepp data check CACHE`` describes it, dataset
        ``store`` reads it)."""
        runs = [run for split in splits for run in self.cars(split)]
        for run in tqdm(runs, desc="convert .vtp", unit="run", disable=not progress):
            self.load(run)
        metas = {run: read_sample_meta(self.cache_dir / run) for run in runs}
        write_manifest(self.cache_dir, cache_layout(self.pressure_array, self.wall_shear_array),
                       {split: self.cars(split) for split in splits}, metas,
                       {"made_by": "flarepp.data.drivaerml", "root": str(self.root),
                        "split_file": str(self.split_file)})

    def polygons(self, car: str) -> SurfacePolygons:
        """The run's surface (points and polygons) with the two field arrays, for pictures."""
        return read_vtp(self.vtp_path(car), [self.pressure_array, self.wall_shear_array])

    # -- statistics -----------------------------------------------------------------------

    def statistics(self, split: str = "train", progress: bool = True) -> SurfaceStatistics:
        """Statistics of ``split`` (module docstring), cached in ``cache_dir`` under a key of
        the run ids, their source files' size and time and the array names."""
        runs = self.cars(split)
        if not runs:
            raise DataError(f"{self.split_file}: split {split!r} lists no runs")
        key = hashlib.sha256(json.dumps(
            [self._meta(self.vtp_path(run)) for run in runs]).encode()).hexdigest()[:16]
        path = self.cache_dir / f"statistics_{split}_{key}.json"
        if path.is_file():
            return SurfaceStatistics.from_dict(json.loads(path.read_text()))
        stats = surface_statistics((self.load(run) for run in runs), len(runs), progress)
        atomic_write_json(path, stats.to_dict(), indent=1)
        return stats


def surface_statistics(surfaces, n_runs: int | None = None,
                       progress: bool = False) -> SurfaceStatistics:
    """Bounding box and per-channel field mean / std over ``surfaces`` (an iterable of
    ``SurfaceCar``), streaming ``CHUNK_CELLS`` rows at a time in float64."""
    lo, hi = np.full(3, np.inf), np.full(3, -np.inf)
    count, mean, m2 = 0, np.zeros(len(FIELD_NAMES)), np.zeros(len(FIELD_NAMES))
    runs = 0
    for surface in tqdm(surfaces, total=n_runs, desc="statistics", unit="run",
                        disable=not progress):
        runs += 1
        for start in range(0, surface.n_cells, CHUNK_CELLS):
            centres = np.asarray(surface.centres[start:start + CHUNK_CELLS], np.float64)
            lo, hi = np.minimum(lo, centres.min(axis=0)), np.maximum(hi, centres.max(axis=0))
            count, mean, m2 = merge_moments(count, mean, m2,
                                            surface.fields[start:start + CHUNK_CELLS])
    if count == 0:
        raise DataError("no cells to compute statistics from")
    return SurfaceStatistics(lo.tolist(), hi.tolist(), mean.tolist(),
                             np.sqrt(m2 / count).tolist(), int(count), runs)
