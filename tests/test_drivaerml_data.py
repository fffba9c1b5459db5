"""The full-surface DrivAerML reader: geometry, the memory-mapped cache, bad files, the split,
training statistics.

The ``.vtp`` files here are written by VTK's own XML writer (not the package's), in the
released layout: ``run_<i>/boundary_<i>.vtp`` with cell arrays ``pMeanTrim`` (1 component)
and ``wallShearStressMeanTrim`` (3 components).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from flarepp.data import DataError
from flarepp.data import drivaerml
from flarepp.data.drivaerml import (DrivAerMLSurfaces, load_split, merge_moments,
                                    polygon_centres_and_normals, surface_statistics)

try:
    from vtkmodules.util.numpy_support import numpy_to_vtk, vtk_to_numpy
    from vtkmodules.vtkCommonCore import vtkPoints
    from vtkmodules.vtkCommonDataModel import vtkCellArray, vtkPolyData
    from vtkmodules.vtkIOXML import vtkXMLPolyDataWriter
    HAS_VTK = True
except ModuleNotFoundError:
    HAS_VTK = False

needs_vtk = pytest.mark.skipif(not HAS_VTK, reason="VTK is not installed (pip install "
                               "'flarepp[surface]'); the .vtp reader cannot run without it")


# ---------------------------------------------------------------------------------------------
# fixtures: small surfaces in the released format

CUBE_POINTS = np.array([[x, y, z] for z in (0, 1) for y in (0, 1) for x in (0, 1)], float)
CUBE_FACES = [[0, 2, 3, 1], [4, 5, 7, 6], [0, 1, 5, 4], [2, 6, 7, 3], [0, 4, 6, 2],
              [1, 3, 7, 5]]                                   # outward: -z +z -y +y -x +x
CUBE_CENTRES = np.array([[.5, .5, 0], [.5, .5, 1], [.5, 0, .5], [.5, 1, .5], [0, .5, .5],
                         [1, .5, .5]])
CUBE_NORMALS = np.array([[0, 0, -1], [0, 0, 1], [0, -1, 0], [0, 1, 0], [-1, 0, 0], [1, 0, 0]],
                        float)


def polydata(points, faces, cell_arrays=(), point_arrays=()):
    """A vtkPolyData of polygons ``faces`` (lists of point ids) with named numpy arrays."""
    data = vtkPolyData()
    pts = vtkPoints()
    pts.SetData(numpy_to_vtk(np.asarray(points, np.float64), deep=True))
    data.SetPoints(pts)
    offsets = np.concatenate([[0], np.cumsum([len(f) for f in faces])]).astype(np.int64)
    cells = vtkCellArray()
    cells.SetData(numpy_to_vtk(offsets, deep=True),
                  numpy_to_vtk(np.concatenate(faces).astype(np.int64), deep=True))
    data.SetPolys(cells)
    for target, arrays in ((data.GetCellData(), cell_arrays),
                           (data.GetPointData(), point_arrays)):
        for name, values in arrays:
            array = numpy_to_vtk(np.ascontiguousarray(values), deep=True)
            array.SetName(name)
            target.AddArray(array)
    return data


def write_vtk(path, data, compressed=True):
    """VTK's XML writer, binary appended, zlib-compressed or raw."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = vtkXMLPolyDataWriter()
    writer.SetFileName(str(path))
    writer.SetInputData(data)
    if not compressed:
        writer.SetCompressorTypeToNone()
    assert writer.Write() == 1
    return path


def cube_fields(seed=0, n=6):
    rng = np.random.default_rng(seed)
    return (rng.normal(0, 300, n).astype(np.float32),
            rng.normal(0, 2, (n, 3)).astype(np.float32))


def write_run(root, run, points=CUBE_POINTS, faces=CUBE_FACES, seed=0,
              names=("pMeanTrim", "wallShearStressMeanTrim"), compressed=True):
    pressure, shear = cube_fields(seed, len(faces))
    path = root / f"run_{run}" / f"boundary_{run}.vtp"
    write_vtk(path, polydata(points, faces, [(names[0], pressure), (names[1], shear)]),
              compressed)
    return path, pressure, shear


def write_split(path, train, test, val=()):
    path.write_text(json.dumps({"train": [f"run_{i}" for i in train],
                                "val": [f"run_{i}" for i in val],
                                "test": [f"run_{i}" for i in test]}))
    return path


@pytest.fixture
def two_cars(tmp_path):
    """``run_3`` (raw) and ``run_8`` (zlib) cubes for training, ``run_10`` for test, and a
    split file listing them."""
    root = tmp_path / "drivaerml"
    written = {3: write_run(root, 3, seed=3, compressed=False), 8: write_run(root, 8, seed=8),
               10: write_run(root, 10, seed=10)}
    split = write_split(tmp_path / "split.json", train=[3, 8], test=[10])
    return root, split, written


# ---------------------------------------------------------------------------------------------
# geometry

def test_cube_centres_and_normals_by_hand():
    """A unit cube of 6 outward quads: centres at the face centres, normals the axes, areas 1.
    A failure points to a wrong fan cross product, wrong sign or wrong centroid weights."""
    faces = np.array(CUBE_FACES)
    offsets = np.arange(0, 25, 4)
    centres, normals, areas = polygon_centres_and_normals(CUBE_POINTS, offsets, faces.ravel())
    np.testing.assert_allclose(centres, CUBE_CENTRES, atol=1e-15)
    np.testing.assert_allclose(normals, CUBE_NORMALS, atol=1e-15)
    np.testing.assert_allclose(areas, 1.0)


def test_tetrahedron_and_non_convex_polygon_by_hand():
    """Tetrahedron (0,0,0), e_x, e_y, e_z: centres are vertex means, the slanted face's normal
    is (1,1,1)/sqrt(3) with area sqrt(3)/2. An L-shaped hexagon (2x1 and 1x1 rectangles,
    one non-convex polygon whose fan from vertex 0 has a negatively oriented triangle) has
    its centroid at the rectangles' area-weighted mean (5/6, 5/6, 0), which the vertex mean
    (1, 1, 0) or unsigned fan weights miss."""
    points = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]], float)
    faces = [[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3]]
    centres, normals, areas = polygon_centres_and_normals(points, np.arange(0, 13, 3),
                                                          np.concatenate(faces))
    np.testing.assert_allclose(centres, points[np.array(faces)].mean(axis=1), atol=1e-15)
    np.testing.assert_allclose(normals, [[0, 0, -1], [0, -1, 0], [-1, 0, 0],
                                         np.ones(3) / np.sqrt(3)], atol=1e-15)
    np.testing.assert_allclose(areas, [0.5, 0.5, 0.5, np.sqrt(3) / 2])

    # L shape: [0,2]x[0,1] plus [0,1]x[1,2]; fan from the reflex vertex's neighbour (2, 0)
    ell = np.array([[2, 0, 0], [2, 1, 0], [1, 1, 0], [1, 2, 0], [0, 2, 0], [0, 0, 0]], float)
    centre, normal, area = polygon_centres_and_normals(ell, np.array([0, 6]), np.arange(6))
    expected = (2 * np.array([1.0, 0.5, 0]) + 1 * np.array([0.5, 1.5, 0])) / 3
    np.testing.assert_allclose(centre[0], expected, atol=1e-15)
    np.testing.assert_allclose(normal[0], [0, 0, 1])
    np.testing.assert_allclose(area, [3.0])


@needs_vtk
def test_normals_and_centres_match_vtk_on_a_mixed_warped_mesh():
    """Against VTK's own filters on random triangles, warped quads and pentagons:
    ``vtkPolyDataNormals`` (cell normals, no reorientation) for every cell, and
    ``vtkCellCenters`` for the triangles (where every centre definition agrees). A failure
    points to a fan that is not Newell's vector or a group-by-size indexing error."""
    from vtkmodules.vtkFiltersCore import vtkPolyDataNormals
    from vtkmodules.vtkFiltersCore import vtkCellCenters
    rng = np.random.default_rng(1)
    points = rng.normal(size=(60, 3))
    faces = []
    for size in rng.choice([3, 4, 5], 200):
        base = rng.normal(size=3)
        angles = np.sort(rng.uniform(0, 2 * np.pi, size))
        ring = base + np.c_[np.cos(angles), np.sin(angles), 0.2 * rng.normal(size=size)]
        faces.append(len(points) + np.arange(size))
        points = np.concatenate([points, ring])
    offsets = np.concatenate([[0], np.cumsum([len(f) for f in faces])])
    centres, normals, _ = polygon_centres_and_normals(points, offsets, np.concatenate(faces))

    vtk_normals = vtkPolyDataNormals()
    vtk_normals.SetInputData(polydata(points, faces))
    vtk_normals.ComputeCellNormalsOn()
    vtk_normals.ComputePointNormalsOff()
    vtk_normals.SplittingOff()
    vtk_normals.ConsistencyOff()
    vtk_normals.AutoOrientNormalsOff()
    vtk_normals.Update()
    reference = vtk_to_numpy(vtk_normals.GetOutput().GetCellData().GetNormals())
    np.testing.assert_allclose(normals, reference, atol=1e-6)

    centre_filter = vtkCellCenters()
    centre_filter.SetInputData(polydata(points, faces))
    centre_filter.Update()
    vtk_centres = vtk_to_numpy(centre_filter.GetOutput().GetPoints().GetData())
    triangles = np.array([len(f) == 3 for f in faces])
    np.testing.assert_allclose(centres[triangles], vtk_centres[triangles], atol=1e-12)


# ---------------------------------------------------------------------------------------------
# reading, caching

@needs_vtk
def test_reader_returns_memory_mapped_centres_normals_and_fields(two_cars):
    """Both runs load as float32 memmaps of [6, 3], [6, 3], [6, 4] with the fields in the
    order (p, tau_x, tau_y, tau_z) as stored. A failure points to a wrong channel order or
    a cache that is not memory-mapped."""
    root, split, written = two_cars
    surfaces = DrivAerMLSurfaces(root, split_file=split)
    assert surfaces.cars("train") == ["run_3", "run_8"] and surfaces.cars("test") == ["run_10"]
    surfaces.check_layout()
    for run in (3, 8, 10):
        car = surfaces.load(f"run_{run}")
        _, pressure, shear = written[run]
        for array in (car.centres, car.normals, car.fields):
            assert isinstance(array, np.memmap) and array.dtype == np.float32
        assert car.fields.shape == (6, 4) and car.source == written[run][0]
        np.testing.assert_array_equal(car.fields[:, 0], pressure)
        np.testing.assert_array_equal(car.fields[:, 1:], shear)
        np.testing.assert_allclose(car.centres, CUBE_CENTRES, atol=1e-7)
        np.testing.assert_allclose(car.normals, CUBE_NORMALS, atol=1e-7)


@needs_vtk
def test_field_names_are_configurable(tmp_path):
    """Arrays under other names are read when named, and missing under the default names."""
    root = tmp_path / "cars"
    _, pressure, _ = write_run(root, 1, names=("p", "wallShearStress"))
    split = write_split(tmp_path / "s.json", [1], [])
    car = DrivAerMLSurfaces(root, split_file=split, pressure_array="p",
                            wall_shear_array="wallShearStress").load("run_1")
    np.testing.assert_array_equal(car.fields[:, 0], pressure)
    with pytest.raises(DataError, match=r"boundary_1\.vtp: cell array 'pMeanTrim' is missing"):
        DrivAerMLSurfaces(root, split_file=split, cache_dir=tmp_path / "other").load("run_1")


@needs_vtk
def test_cache_is_reused_and_invalidated_when_the_source_changes(two_cars, monkeypatch):
    """A second load opens the cache without reading the .vtp; rewriting the source (new size
    or time) converts it again and returns the new values. A failure points to a cache key
    that ignores the source, or one that never matches."""
    root, split, _ = two_cars
    surfaces = DrivAerMLSurfaces(root, split_file=split)
    surfaces.load("run_3")
    meta = json.loads((root / ".flarepp_cache" / "run_3" / "meta.json").read_text())
    assert meta["n_cells"] == 6 and meta["arrays"] == ["pMeanTrim", "wallShearStressMeanTrim"]

    def no_read(*args, **kwargs):
        raise AssertionError("the .vtp was read again although the cache is valid")

    with monkeypatch.context() as patch:
        patch.setattr(drivaerml, "read_vtp", no_read)
        cached = surfaces.load("run_3")
    assert cached.n_cells == 6

    path, pressure, _ = write_run(root, 3, seed=99, compressed=False)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10 ** 9))   # same size, new time
    reloaded = surfaces.load("run_3")
    np.testing.assert_array_equal(reloaded.fields[:, 0], pressure)


@needs_vtk
def test_cache_write_is_atomic_meta_last(two_cars):
    """A cache folder missing ``meta.json`` (a conversion that died) is rebuilt; no temporary
    files are left behind."""
    root, split, _ = two_cars
    surfaces = DrivAerMLSurfaces(root, split_file=split, cache_dir=root.parent / "cache")
    surfaces.load("run_8")
    folder = root.parent / "cache" / "run_8"
    (folder / "meta.json").unlink()
    (folder / "fields.npy").write_bytes(b"half written")
    car = surfaces.load("run_8")
    assert car.fields.shape == (6, 4)
    assert sorted(p.name for p in folder.iterdir()) == ["areas.npy", "centres.npy",
                                                         "fields.npy", "meta.json",
                                                         "normals.npy"]


# ---------------------------------------------------------------------------------------------
# bad files: each names the file and the problem

def _bad(tmp_path, data=None, raw: bytes | None = None, run=5):
    root = tmp_path / "bad"
    path = root / f"run_{run}" / f"boundary_{run}.vtp"
    if raw is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
    elif data is not None:
        write_vtk(path, data)
    split = write_split(tmp_path / "split.json", [run], [])
    return DrivAerMLSurfaces(root, split_file=split), path


@needs_vtk
@pytest.mark.parametrize("case, message", [
    ("missing pressure", r"cell array 'pMeanTrim' is missing; the file has cell arrays "
                         r"\['wallShearStressMeanTrim'\]"),
    ("pressure as point data", r"'pMeanTrim' is missing \(it is a point array"),
    ("pressure with 3 components", r"'pMeanTrim' has 3 components, expected 1"),
    ("shear with 1 component", r"'wallShearStressMeanTrim' has 1 components, expected 3"),
    ("too few values", r"unreadable or truncated .*pMeanTrim"),
    ("NaN pressure", r"pMeanTrim holds 1 non-finite value\(s\), first at index 2"),
    ("inf shear", r"wallShearStressMeanTrim holds 1 non-finite value\(s\), first at index 4"),
    ("degenerate cell", r"cell 6 has zero area"),
    ("a line cell", r"1 of 7 cells are vertices, lines or strips"),
])
def test_bad_contents_raise_data_error_naming_file_and_problem(tmp_path, case, message):
    pressure, shear = cube_fields()
    faces, points = list(CUBE_FACES), CUBE_POINTS
    cells, point_arrays = [("pMeanTrim", pressure), ("wallShearStressMeanTrim", shear)], []
    if case == "missing pressure":
        cells = cells[1:]
    elif case == "pressure as point data":
        cells, point_arrays = cells[1:], [("pMeanTrim", np.zeros(8, np.float32))]
    elif case == "pressure with 3 components":
        cells[0] = ("pMeanTrim", shear)
    elif case == "shear with 1 component":
        cells[1] = ("wallShearStressMeanTrim", pressure)
    elif case == "too few values":
        cells[0] = ("pMeanTrim", pressure[:4])
    elif case == "NaN pressure":
        pressure[2] = np.nan
    elif case == "inf shear":
        shear[4, 1] = np.inf
    elif case == "degenerate cell":
        faces = faces + [[0, 1, 1]]
        cells = [("pMeanTrim", np.append(pressure, 0).astype(np.float32)),
                 ("wallShearStressMeanTrim", np.vstack([shear, np.zeros((1, 3), np.float32)]))]
    data = polydata(points, faces, cells, point_arrays)
    if case == "a line cell":
        from vtkmodules.vtkCommonDataModel import vtkCellArray as Cells
        lines = Cells()
        lines.InsertNextCell(2, [0, 7])
        data.SetLines(lines)
        data.GetCellData().RemoveArray("pMeanTrim")
        data.GetCellData().RemoveArray("wallShearStressMeanTrim")
        for name, values in [("pMeanTrim", np.append(pressure, 0).astype(np.float32)),
                             ("wallShearStressMeanTrim",
                              np.vstack([shear, np.zeros((1, 3), np.float32)]))]:
            array = numpy_to_vtk(values, deep=True)
            array.SetName(name)
            data.GetCellData().AddArray(array)
    surfaces, path = _bad(tmp_path, data)
    with pytest.raises(DataError, match=message) as info:
        surfaces.load("run_5")
    assert str(path) in str(info.value)


@needs_vtk
@pytest.mark.parametrize("cut", [0.3, 0.7, 0.9])
def test_truncated_files_raise_data_error(tmp_path, cut):
    """A file cut in its XML header or in its appended data does not load silently."""
    good, _, _ = write_run(tmp_path / "good", 5, compressed=False)
    data = good.read_bytes()
    surfaces, path = _bad(tmp_path, raw=data[:int(cut * len(data))])
    with pytest.raises(DataError, match="unreadable or truncated VTK file") as info:
        surfaces.load("run_5")
    assert str(path) in str(info.value)


@needs_vtk
@pytest.mark.parametrize("raw", [b"", b"not xml at all"])
def test_empty_and_garbage_files_raise_data_error(tmp_path, raw):
    surfaces, path = _bad(tmp_path, raw=raw)
    with pytest.raises(DataError, match=rf"{path}: unreadable"):
        surfaces.load("run_5")


def test_missing_run_directory_and_file_raise_data_error(tmp_path):
    """Layout errors need no VTK: a run of the split with no directory, or no file in it."""
    root = tmp_path / "cars"
    (root / "run_2").mkdir(parents=True)
    split = write_split(tmp_path / "split.json", [1], [2])
    surfaces = DrivAerMLSurfaces(root, split_file=split)
    with pytest.raises(DataError, match=r"run_1: run directory is missing \(listed in .*split"):
        surfaces.load("run_1")
    with pytest.raises(DataError, match=r"run_2/boundary_2\.vtp: surface file is missing"):
        surfaces.load("run_2")
    with pytest.raises(DataError, match=r"2 run\(s\) of \['train', 'test'\] .* run_1, run_2"):
        surfaces.check_layout()
    with pytest.raises(DataError, match="DrivAerML directory does not exist"):
        DrivAerMLSurfaces(tmp_path / "nowhere", split_file=split)


def test_missing_vtk_names_the_extra_to_install(monkeypatch, tmp_path):
    """Without VTK the reader says how to install it instead of a bare ImportError."""
    monkeypatch.setitem(sys.modules, "vtkmodules", None)
    root = tmp_path / "cars"
    (root / "run_1").mkdir(parents=True)
    (root / "run_1" / "boundary_1.vtp").write_bytes(b"<VTKFile/>")
    surfaces = DrivAerMLSurfaces(root, split_file=write_split(tmp_path / "s.json", [1], []))
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'flarepp\[surface\]'"):
        surfaces.load("run_1")


# ---------------------------------------------------------------------------------------------
# the split

def test_packaged_split_is_the_papers():
    """Section C.1: Alkin et al.'s split, 400 train (399 here: run_45 is left out, as the
    shipped file documents) / 34 validation / 50 test, disjoint, ids 'run_<i>'."""
    split = load_split()
    assert (len(split["train"]), len(split["val"]), len(split["test"])) == (399, 34, 50)
    everything = split["train"] + split["val"] + split["test"]
    assert len(set(everything)) == len(everything) and "run_45" not in everything
    assert drivaerml.default_split_file().is_file()


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ('["run_1"]', "must hold a JSON object"),
    ('{"train": ["run_1"]}', "has no 'test' list"),
    ('{"train": ["run_1"], "test": ["1"]}', r"'test' must be a list of run ids"),
    ('{"train": ["run_1"], "test": ["run_1"]}', r"run_1 is listed twice \(in 'train' and "
                                                r"'test'\)"),
])
def test_bad_split_files_raise_data_error(tmp_path, content, message):
    path = tmp_path / "split.json"
    path.write_text(content)
    with pytest.raises(DataError, match=message) as info:
        load_split(path)
    assert str(path) in str(info.value)
    with pytest.raises(DataError, match="split file is missing"):
        load_split(tmp_path / "absent.json")


def test_split_without_val_is_accepted(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('{"train": ["run_2", "run_1"], "test": ["run_7"], "note": "x"}')
    assert load_split(path) == {"train": ["run_2", "run_1"], "val": [], "test": ["run_7"]}


# ---------------------------------------------------------------------------------------------
# training statistics

def test_merge_moments_equals_numpy_in_float64_with_a_large_offset():
    """Chan's update over uneven chunks equals numpy's two-pass mean/std on the whole array
    even at mean 1e6, std 1 (a sum of squares in float32 would lose every digit)."""
    rng = np.random.default_rng(0)
    data = (1e6 + rng.normal(size=(1000, 4))).astype(np.float32)
    count, mean, m2 = 0, np.zeros(4), np.zeros(4)
    for chunk in np.split(data, [1, 7, 300, 301, 999]):
        count, mean, m2 = merge_moments(count, mean, m2, chunk)
    exact = data.astype(np.float64)
    np.testing.assert_allclose(mean, exact.mean(0), rtol=1e-15)
    np.testing.assert_allclose(np.sqrt(m2 / count), exact.std(0), rtol=1e-9)


@needs_vtk
def test_training_statistics_stream_over_runs_and_are_cached(two_cars, monkeypatch):
    """Bounding box and per-channel mean/std over the training runs equal numpy on their
    concatenation (chunks of 4 cells force merges across chunk and run boundaries); a second
    call reads the cached JSON. A failure points to a merge error or a stale cache key."""
    root, split, written = two_cars
    monkeypatch.setattr(drivaerml, "CHUNK_CELLS", 4)
    surfaces = DrivAerMLSurfaces(root, split_file=split)
    stats = surfaces.statistics("train", progress=False)
    fields = np.concatenate([np.c_[written[r][1], written[r][2]] for r in (3, 8)])
    np.testing.assert_allclose(stats.field_mean, fields.astype(np.float64).mean(0), rtol=1e-12)
    np.testing.assert_allclose(stats.field_std, fields.astype(np.float64).std(0), rtol=1e-12)
    np.testing.assert_allclose(stats.bbox_min, [0, 0, 0], atol=1e-7)
    np.testing.assert_allclose(stats.bbox_max, [1, 1, 1], atol=1e-7)
    assert (stats.n_cells, stats.n_runs) == (12, 2)

    monkeypatch.setattr(drivaerml, "surface_statistics", lambda *a, **k: 1 / 0)
    assert surfaces.statistics("train", progress=False) == stats


def test_surface_statistics_need_no_files():
    """The streaming statistics take any objects with centres and fields (e.g. memmaps)."""
    class Car:
        def __init__(self, n, shift):
            self.centres = np.arange(3 * n, dtype=np.float32).reshape(n, 3) + shift
            self.fields = np.full((n, 4), shift, np.float32)
            self.n_cells = n

    stats = surface_statistics([Car(2, 0.0), Car(6, 1.0)])
    np.testing.assert_allclose(stats.field_mean, 0.75)
    np.testing.assert_allclose(stats.field_std, np.sqrt(0.75 * 0.25))
    assert stats.bbox_min == [0.0, 1.0, 2.0] and stats.bbox_max == [16.0, 17.0, 18.0]
