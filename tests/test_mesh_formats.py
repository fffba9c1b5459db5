"""Every claimed mesh format, on real files its library writes (tests/mesh_files.py):
converted to a store, the stored values are the written ones; a truncated file is a
sentence naming it; cell geometry equals explicit references."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pyvista")
pytest.importorskip("meshio")

from flarepp.data import DataError  # noqa: E402
from flarepp.data.convert import convert  # noqa: E402
from flarepp.data.meshes import MESH_FORMATS, cell_geometry, read_mesh  # noqa: E402
from flarepp.data.spec import parse_spec  # noqa: E402
from mesh_files import (ARRAY_NAMES, CARRIES, LINEAR_VOLUME_TYPES, WRITERS,  # noqa: E402
                        cell_field, cells_of_type, convex_hull_reference, fan_reference,
                        point_field, surface_mesh, velocity, volume_mesh, write_openfoam)

FORMATS = MESH_FORMATS.names()


def test_every_registered_format_has_a_test_writer():
    """A format is claimed (registered) only with a writer of real files in the tests; a
    failure names a format registered without one, or a writer left for a dropped one."""
    assert set(FORMATS) == set(WRITERS)


def _cases(tmp_path, fmt, n=3):
    source = tmp_path / fmt
    for i in range(n):
        WRITERS[fmt](source, f"case_{i}", i)
    return source


def _geometry(fmt):
    if fmt in ("vtp", "stl"):
        return ["coordinates", "normals", "areas"]
    return ["coordinates", "volumes"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_converts_to_the_values_written(tmp_path, fmt):
    """Each file's point array T, cell arrays p, U and field data load land in the store
    as written, at the points or at the cells' centres (so independent of the writer's
    order); an STL, which holds no arrays, gives its geometry. A failure points to a reader
    that loses, reorders or mixes up arrays, or to wrong cell centres."""
    source = _cases(tmp_path, fmt)
    names = ARRAY_NAMES.get(fmt, {})
    carries = CARRIES[fmt]
    conditions = ["load"] if "field" in carries else []
    if "point" in carries:
        spec = parse_spec({"targets": [names.get("T", "T")], "conditions": conditions,
                           "split": {"test": "case_2*"}})
        store = convert(source, tmp_path / "point-store", spec, progress=False).store
        assert store.layout.association == "point"
        assert [n.split(".")[0] for n in store.splits["test"]] == ["case_2"]
        for split in ("train", "test"):
            samples = store.split(split)
            for i in range(len(samples)):
                x, y = samples.sample(i)
                np.testing.assert_allclose(y[:, 0], point_field(x.astype(np.float64)),
                                           rtol=1e-6, atol=1e-6)
        if conditions:
            assert store.samples["case_1"]["conditions"] == [2.5]
    spec = parse_spec({"association": "cell", "geometry": _geometry(fmt),
                       "targets": [names.get("p", "p"), names.get("U", "U")]
                       if "cell" in carries else []})
    store = convert(source, tmp_path / "cell-store", spec, progress=False).store
    samples = store.split("train")
    x, y = samples.sample(0)
    centres = x[:, :3].astype(np.float64)
    if "cell" in carries:
        np.testing.assert_allclose(y[:, 0], cell_field(centres), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(y[:, 1:4], velocity(centres), rtol=1e-5, atol=1e-6)
    if fmt in ("vtp", "stl"):
        np.testing.assert_allclose(np.linalg.norm(x[:, 3:6], axis=1), 1.0, atol=1e-6)
        assert x[:, 6].sum() == pytest.approx(surface_mesh(0).area, rel=1e-5)
    elif fmt == "openfoam":
        assert x[:, 3].sum() == pytest.approx(0.25, rel=1e-6)     # the 1 x 0.5 x 0.5 box
    else:
        assert x[:, 3].sum() == pytest.approx(0.5, rel=1e-6)      # the 1 x 1 x 0.5 box
    first = store.splits["train"][0]
    assert store.samples[first]["source"]["case"].endswith(
        WRITERS[fmt](tmp_path / "again", "case_0", 0).name)


def _truncate(path):
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_truncated_file_is_a_sentence_naming_it(tmp_path, fmt):
    """A file cut in half (a copy interrupted, a full disk) was read as a smaller mesh or
    hung (meshio on a cut Gmsh file); now a DataError naming the file. For OpenFOAM the
    field file is cut, for EnSight its geometry, for XDMF its XML."""
    case = WRITERS[fmt](tmp_path, "case", 0)
    cut = {"openfoam": case.parent / "1" / "p",
           "ensight": case.parent / "case.0.00000.geo"}.get(fmt, case)
    _truncate(cut)
    with pytest.raises(DataError) as err:
        read_mesh(case)
    assert str(case) in str(err.value)


def test_surface_cell_geometry_is_the_drivaerml_readers():
    """Cell centres, normals and areas of a triangulated sphere equal
    polygon_centres_and_normals on the same polygons (one geometry for both readers), and
    VTK's own cell areas. A failure points to a reordered or differently computed cell."""
    from flarepp.data.drivaerml import polygon_centres_and_normals
    from flarepp.data.meshes import cell_arrays
    mesh = surface_mesh(0)
    geometry = cell_geometry(mesh, "sphere")
    _, offsets, connectivity = cell_arrays(mesh)
    centres, normals, areas = polygon_centres_and_normals(np.asarray(mesh.points, float),
                                                          offsets, connectivity)
    np.testing.assert_array_equal(geometry.centres, centres)
    np.testing.assert_array_equal(geometry.normals, normals)
    sizes = mesh.compute_cell_sizes(length=False, volume=False)
    np.testing.assert_allclose(geometry.measures, sizes.cell_data["Area"], rtol=1e-10)


def test_volume_cell_geometry_equals_explicit_tetrahedra_and_hexahedra():
    """Volumes and centres of 3-D cells: a tetrahedron's are |det| / 6 and its vertex mean
    (the explicit formula, cell by cell); a box hexahedron's its side product and its
    centre. A failure points to the tetrahedral split or the per-cell sums."""
    import pyvista as pv
    mesh = volume_mesh(1)
    geometry = cell_geometry(mesh, "box")
    tets = np.asarray(mesh.cells_dict[10])
    v = np.asarray(mesh.points, float)[tets]
    for c in range(0, len(tets), 17):
        volume = abs(np.linalg.det((v[c, 1:] - v[c, 0]).T)) / 6
        assert geometry.measures[c] == pytest.approx(volume, rel=1e-12)
        np.testing.assert_allclose(geometry.centres[c], v[c].mean(0), rtol=1e-12)
    hexes = pv.ImageData(dimensions=(3, 2, 2), spacing=(0.5, 2.0, 0.25),
                         origin=(1, 1, 1)).cast_to_unstructured_grid()
    boxes = cell_geometry(hexes, "hex")
    np.testing.assert_allclose(boxes.measures, 0.25, rtol=1e-12)
    np.testing.assert_allclose(boxes.centres, [[1.25, 2, 1.125], [1.75, 2, 1.125]], rtol=1e-12)


def test_openfoam_latest_time_and_cell_data(tmp_path):
    """The OpenFOAM reader takes the latest time directory (2/, where p is doubled, over
    1/) and keeps the fields as cell data (no interpolated point copies). A failure points
    to the reader's time or cell-to-point settings."""
    write_openfoam(tmp_path, "cavity", 0, time="1")
    foam = write_openfoam(tmp_path, "cavity", 0, time="2", factor=2.0)
    mesh = read_mesh(foam)
    assert "p" in mesh.cell_data.keys() and "p" not in mesh.point_data.keys()
    centres = cell_geometry(mesh, foam).centres
    np.testing.assert_allclose(mesh.cell_data["p"], 2.0 * cell_field(centres), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# 3-D cell geometry of every linear cell type against slow references

@pytest.mark.parametrize("name", sorted(LINEAR_VOLUME_TYPES))
def test_planar_faced_cells_of_every_linear_type_match_three_references(name):
    """Cells of each linear VTK type under a projective map (planar faces, no two cells
    alike): centres and volumes equal (1e-12) scipy's convex hull and Delaunay centroid,
    cell by cell; VTK's own tetrahedra (the former path, ``triangulated_geometry``); and
    VTK's cell sizes. A failure points to a face table (order, orientation, a voxel's
    pixel faces) or the vectorised sums."""
    from flarepp.data.meshes import triangulated_geometry
    mesh = cells_of_type(LINEAR_VOLUME_TYPES[name], seed=3)
    geometry = cell_geometry(mesh, name)
    hull_centres, hull_volumes = convex_hull_reference(mesh)
    np.testing.assert_allclose(geometry.measures, hull_volumes, rtol=1e-12)
    np.testing.assert_allclose(geometry.centres, hull_centres, rtol=1e-12, atol=1e-12)
    vtk_centres, vtk_volumes = triangulated_geometry(mesh, np.arange(mesh.n_cells))
    np.testing.assert_allclose(geometry.measures, vtk_volumes, rtol=1e-12)
    np.testing.assert_allclose(geometry.centres, vtk_centres, rtol=1e-12, atol=1e-12)
    sizes = mesh.compute_cell_sizes(length=False, area=False).cell_data["Volume"]
    np.testing.assert_allclose(geometry.measures, np.abs(sizes), rtol=1e-10)


@pytest.mark.parametrize("name", sorted(LINEAR_VOLUME_TYPES))
def test_warped_cells_are_the_fan_polyhedra_and_tile_their_mesh(name):
    """Jittered cells (faces of 4+ points no longer planar): centres and volumes equal the
    cell-by-cell fan reference (faces fanned about their vertex mean, tetrahedra from the
    cell's vertex mean, not the fast path's vertex 0) to 1e-12, and where the cells tile
    their box (VTK's prisms of 5 and 6 sides do not) their volumes sum to the volume the
    mesh's boundary encloses (the same face shape seen from both cells of an inner face).
    A failure points to a dropped triangle or a face shape that differs between
    neighbours."""
    mesh = cells_of_type(LINEAR_VOLUME_TYPES[name], warp=0.08, seed=4)
    geometry = cell_geometry(mesh, name)
    centres, volumes = fan_reference(mesh)
    np.testing.assert_allclose(geometry.measures, volumes, rtol=1e-12)
    np.testing.assert_allclose(geometry.centres, centres, rtol=1e-12, atol=1e-12)
    if name.endswith("prism"):
        return
    boundary = mesh.extract_surface(algorithm="dataset_surface")
    enclosed = 0.0
    for c in range(boundary.n_cells):
        x = np.asarray(boundary.points, np.float64)[boundary.get_cell(c).point_ids]
        fan_point = x.mean(0)
        enclosed += sum(np.dot(fan_point, np.cross(x[i], x[(i + 1) % len(x)]))
                        for i in range(len(x))) / 6
    assert geometry.measures.sum() == pytest.approx(abs(enclosed), rel=1e-12)


def _random_cells(cell_type: int, count: int, rng) -> np.ndarray:
    """``[count, corners, 3]``: VTK's reference cell of ``cell_type`` scaled, turned and
    moved at random, every vertex jittered by a fifth of the cell's size."""
    from vtkmodules.vtkCommonDataModel import vtkGenericCell
    reference = vtkGenericCell()
    reference.SetCellType(cell_type)
    corners = reference.GetNumberOfPoints()
    unit = np.asarray(reference.GetParametricCoords()).reshape(corners, 3)
    turns = np.linalg.qr(rng.standard_normal((count, 3, 3)))[0]
    x = np.einsum("cij,cnj->cni", turns * rng.uniform(0.5, 2, (count, 1, 1)),
                  unit + rng.uniform(-0.2, 0.2, (count, corners, 3)))
    return x + rng.uniform(-50, 50, (count, 1, 3))


@pytest.mark.parametrize("name", sorted(LINEAR_VOLUME_TYPES))
def test_random_cells_of_every_linear_type_match_the_per_triangle_fans(name, monkeypatch):
    """Disjoint random cells (:func:`_random_cells`: no two alike, faces far from
    planar) over several chunks: alone, after a block of cells of another type (one run
    of the connectivity, not from the first cell) and interleaved with them: centres and
    volumes equal the cell-by-cell fan reference (every fan triangle's own 3x3
    determinant, tetrahedra from the cell's vertex mean) to 1e-12 relative. A failure points to the shared edges of the fast path (a cross product's
    sign, a triangle dotted with the wrong edge or point) or its vertex weights."""
    import pyvista as pv
    from flarepp.data import meshes
    monkeypatch.setattr(meshes, "CHUNK_VOLUME_CELLS", 16)
    cell_type = LINEAR_VOLUME_TYPES[name]
    other = 14 if cell_type == 10 else 10
    rng = np.random.default_rng(cell_type)
    x, y = _random_cells(cell_type, 2 * 16 + 7, rng), _random_cells(other, 20, rng)
    cells = [x[i] for i in range(len(x))] + [y[i] for i in range(len(y))]
    types = np.array([cell_type] * len(x) + [other] * len(y), np.uint8)
    mixed = rng.permutation(len(cells))
    for order in (np.arange(len(x)), np.arange(len(cells))[::-1], mixed):
        first = np.cumsum([0] + [len(cells[i]) for i in order])
        grid = pv.UnstructuredGrid(
            np.concatenate([[len(cells[i]), *range(first[k], first[k + 1])]
                            for k, i in enumerate(order)]),
            types[order], np.concatenate([cells[i] for i in order]))
        geometry = cell_geometry(grid, name)
        centres, volumes = fan_reference(grid)
        np.testing.assert_allclose(geometry.measures, volumes, rtol=1e-12)
        np.testing.assert_allclose(geometry.centres, centres, rtol=1e-12, atol=50e-12)


def test_mixed_cells_an_inside_out_cell_and_quadratic_cells_in_one_mesh():
    """One grid of tetrahedra, hexahedra, wedges and pyramids (warped), a hexahedron
    numbered inside out (top and bottom swapped) and quadratic tetrahedra (VTK's
    tetrahedra path): every cell's centre and volume lands at its own row, equal to its
    reference; the inside-out hexahedron gives the same centre and a positive volume. A
    failure points to the per-type grouping or the fallback's row order."""
    import pyvista as pv
    parts = [cells_of_type(LINEAR_VOLUME_TYPES[n], (2, 1, 1), warp=0.05, seed=k)
             for k, n in enumerate(("tetra", "hexahedron", "wedge", "pyramid"))]
    quadratic = cells_of_type(10, (1, 1, 1), seed=9)
    tets = np.asarray(quadratic.cells_dict[10])
    x = np.asarray(quadratic.points, np.float64)
    edges = [(0, 1), (1, 2), (2, 0), (0, 3), (1, 3), (2, 3)]
    cells, points = [], [x]
    for t, tet in enumerate(tets[:5]):
        mids = np.array([(x[tet[a]] + x[tet[b]]) / 2 for a, b in edges])
        ids = len(x) + 6 * t + np.arange(6)
        points.append(mids)
        cells.append(np.concatenate([[10], tet, ids]))
    quadratic = pv.UnstructuredGrid(np.concatenate(cells), np.full(len(cells), 24),
                                    np.concatenate(points))
    mixed = pv.merge([*parts, quadratic], merge_points=False)
    order = np.random.default_rng(0).permutation(mixed.n_cells)   # types interleaved
    mixed = mixed.extract_cells(order).cast_to_unstructured_grid()
    geometry = cell_geometry(mixed, "mixed")
    linear = np.asarray(mixed.celltypes) != 24
    centres, volumes = fan_reference(mixed.extract_cells(np.flatnonzero(linear)))
    np.testing.assert_allclose(geometry.measures[linear], volumes, rtol=1e-12)
    np.testing.assert_allclose(geometry.centres[linear], centres, rtol=1e-12, atol=1e-12)
    q = np.asarray(mixed.points, np.float64)[
        [mixed.get_cell(c).point_ids[:4] for c in np.flatnonzero(~linear)]]
    np.testing.assert_allclose(geometry.measures[~linear],
                               np.abs(np.linalg.det(q[:, 1:] - q[:, :1])) / 6, rtol=1e-12)
    np.testing.assert_allclose(geometry.centres[~linear], q.mean(1), rtol=1e-12)
    hexes = cells_of_type(12, (1, 1, 1), seed=5)
    flipped = np.asarray(hexes.cells_dict[12])[:, [4, 5, 6, 7, 0, 1, 2, 3]]
    inside_out = pv.UnstructuredGrid({12: flipped}, hexes.points)
    turned = cell_geometry(inside_out, "inside out")
    plain = cell_geometry(hexes, "hex")
    np.testing.assert_allclose(turned.measures, plain.measures, rtol=1e-12)
    np.testing.assert_allclose(turned.centres, plain.centres, rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# files that declare more than they hold, or read other files (the serve probe of issue 41)

HUGE_DECLARATIONS = {
    "legacy grid": ("big.vtk", b"# vtk DataFile Version 3.0\nx\nASCII\nDATASET "
                    b"STRUCTURED_POINTS\nDIMENSIONS 3000 3000 3000\nORIGIN 0 0 0\n"
                    b"SPACING 1 1 1\n"),
    "legacy points": ("big.vtk", b"# vtk DataFile Version 3.0\nx\nASCII\nDATASET "
                      b"UNSTRUCTURED_GRID\nPOINTS 2000000000 float\n0 0 0\n"),
    "vtu": ("big.vtu", b'<?xml version="1.0"?><VTKFile type="UnstructuredGrid"><Unstructured'
            b'Grid><Piece NumberOfPoints="2000000000" NumberOfCells="0"><Points><DataArray '
            b'type="Float32" NumberOfComponents="3" format="ascii">0 0 0</DataArray></Points>'
            b'</Piece></UnstructuredGrid></VTKFile>'),
    "gmsh": ("big.msh", b"$MeshFormat\n2.2 0 8\n$EndMeshFormat\n$Nodes\n2000000000\n"
             b"1 0 0 0\n$EndNodes\n")}


@pytest.mark.parametrize("kind", sorted(HUGE_DECLARATIONS))
def test_a_file_declaring_more_rows_than_allowed_is_refused_before_reading(tmp_path, kind):
    """A 100-byte file declaring 2e9 points (27e9 for a legacy grid, whose points VTK makes
    when asked) is refused from its declaration: VTK's XML reader aborted the process
    (std::bad_alloc), the grid's points took 201 GiB, before any bound was looked at."""
    from flarepp.data.meshes import MeshTooLarge
    name, content = HUGE_DECLARATIONS[kind]
    (tmp_path / name).write_bytes(content)
    with pytest.raises(MeshTooLarge, match=r"declares \d+ points or cells, over the 1000 "):
        read_mesh(tmp_path / name, max_rows=1000)


@pytest.mark.parametrize("block", [5, 13, 64, 1 << 23])
def test_declarations_are_found_across_the_blocks_the_file_is_read_in(tmp_path, monkeypatch,
                                                                      block):
    """declared_rows reads a file in blocks and tries its pattern only where a declaration's
    word starts: declarations at every offset against the block boundaries (pieces of a
    VTU, a legacy file's keyword lines, Gmsh sections) are each counted once, and the near
    misses (a word inside another, a keyword not at a line's start) not at all. A failure
    points to a declaration lost or counted twice at a block boundary."""
    from flarepp.data import meshes
    monkeypatch.setattr(meshes, "SCAN_BLOCK", block)
    monkeypatch.setattr(meshes, "SCAN_TAIL", 48)
    rng = np.random.default_rng(block)

    def filler():
        return bytes(rng.choice(list(b"ab 01\n"), int(rng.integers(0, 30))))

    texts = {"vtu": (lambda k: b'<Piece NumberOfPoints="%d" NumberOfCells="7">' % k,
                     b'xNumberOfPoints="999999"'),
             "vtk": (lambda k: b"\nPOINTS %d float\nCELLS 7 28\n" % k, b" POINTS 999999 x"),
             "gmsh": (lambda k: b"\n$Nodes\n1 %d 1 %d\n$Elements\n7\n" % (k, k),
                      b" $Nodes\n999999\n")}
    for fmt, (declaration, near_miss) in texts.items():
        sizes = rng.integers(10, 100, 12)
        content = b"".join(filler() + declaration(int(k)) + filler() + near_miss
                           for k in sizes)
        path = tmp_path / f"declares.{fmt}"
        path.write_bytes(content)
        assert meshes.declared_rows(path, fmt) == sizes.sum(), fmt


def test_a_mesh_read_over_the_bound_or_naming_missing_points_is_refused(tmp_path):
    import pyvista as pv
    from flarepp.data.meshes import MeshTooLarge
    pv.Sphere().save(tmp_path / "sphere.vtp")
    with pytest.raises(MeshTooLarge, match="over the 100 allowed"):
        read_mesh(tmp_path / "sphere.vtp", max_rows=100)
    assert read_mesh(tmp_path / "sphere.vtp", max_rows=10_000).n_points == 842
    (tmp_path / "bad.vtk").write_bytes(
        b"# vtk DataFile Version 3.0\nx\nASCII\nDATASET UNSTRUCTURED_GRID\nPOINTS 3 float\n"
        b"0 0 0 1 0 0 0 1 0\nCELLS 1 4\n3 0 1 99\nCELL_TYPES 1\n5\n")
    with pytest.raises(DataError, match="a cell names point 99, but the mesh has 3 points"):
        read_mesh(tmp_path / "bad.vtk")


def test_a_vtkhdf_file_reading_another_file_is_refused(tmp_path):
    """A VTKHDF dataset with external storage made VTK read any file's bytes as the points
    (and `flarepp serve` return them in the mesh it answers); an external link alike."""
    import h5py
    secret = tmp_path / "elsewhere.bin"
    secret.write_bytes(np.arange(30, dtype=np.float64).tobytes())
    for how in ("external storage", "external link"):
        path = tmp_path / f"{how.replace(' ', '_')}.vtkhdf"
        with h5py.File(path, "w") as f:
            g = f.create_group("VTKHDF")
            g.attrs["Version"], g.attrs["Type"] = (2, 1), np.bytes_("UnstructuredGrid")
            for key, value in (("NumberOfPoints", [10]), ("NumberOfCells", [1]),
                               ("NumberOfConnectivityIds", [1]), ("Offsets", [0, 1]),
                               ("Connectivity", [0]), ("Types", np.array([1], np.uint8))):
                g.create_dataset(key, data=value)
            if how == "external storage":
                g.create_dataset("Points", shape=(10, 3), dtype="f8",
                                 external=[(str(secret), 0, h5py.h5f.UNLIMITED)])
            else:
                g["Points"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/points")
        with pytest.raises(DataError, match="a VTKHDF file is read from its own data only"):
            read_mesh(path)
