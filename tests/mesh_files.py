"""Real files of every claimed mesh format, written by the libraries' own writers (pyvista/VTK,
meshio) or, for OpenFOAM, as a hand-written ASCII case: what tests/test_mesh_formats.py and
tests/test_convert.py convert.

Every file holds the same kind of content, from which the expected store values follow
without knowing the writer's point or cell order:

* point data ``T = point_field(x)`` at every point;
* cell data ``p = cell_field(c)`` at every cell, ``c`` the cell's centroid, and ``U`` with
  three components ``(c_x, 2 c_y, 3 c_z)``;
* field data ``load`` (where the format carries field data).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def point_field(xyz: np.ndarray) -> np.ndarray:
    return xyz[:, 0] + 2.0 * xyz[:, 1] - 0.5 * xyz[:, 2] + 1.0


def cell_field(centres: np.ndarray) -> np.ndarray:
    return np.sin(3.0 * centres[:, 0]) + centres[:, 1] * centres[:, 2] + 2.0


def velocity(centres: np.ndarray) -> np.ndarray:
    return centres * np.array([1.0, 2.0, 3.0])


def volume_mesh(seed: int = 0, n: int = 4):
    """A tetrahedral mesh of the box [0, 1] x [0, 1] x [0, 0.5] with jittered inner points
    and the arrays of the module docstring (tetrahedra: every format writes them)."""
    import pyvista as pv
    grid = pv.ImageData(dimensions=(n + 1, n + 1, 3), spacing=(1 / n, 1 / n, 0.25))
    mesh = grid.triangulate().cast_to_unstructured_grid()
    rng = np.random.default_rng(seed)
    pts = np.array(mesh.points)
    inner = (pts > 1e-9).all(1) & (pts[:, :2] < 1 - 1e-9).all(1) & (pts[:, 2] < 0.5 - 1e-9)
    pts[inner] += rng.uniform(-0.03, 0.03, (inner.sum(), 3))
    mesh.points = pts
    return _with_arrays(mesh, seed)


def surface_mesh(seed: int = 0):
    """A closed triangulated surface (a sphere) with the arrays of the module docstring."""
    import pyvista as pv
    mesh = pv.Sphere(radius=0.5 + 0.1 * seed, theta_resolution=10, phi_resolution=8)
    return _with_arrays(mesh, seed)


def _centroids(mesh) -> np.ndarray:
    from flarepp.data.meshes import cell_geometry
    return cell_geometry(mesh, "test mesh").centres


def _with_arrays(mesh, seed: int):
    centres = _centroids(mesh)
    mesh.point_data["T"] = point_field(np.asarray(mesh.points))
    mesh.cell_data["p"] = cell_field(centres)
    mesh.cell_data["U"] = velocity(centres)
    mesh.field_data["load"] = np.array([1.5 + seed])
    return mesh


# ---------------------------------------------------------------------------------------------
# volume cells of every linear VTK type, and slow references for their geometry

LINEAR_VOLUME_TYPES = {"tetra": 10, "voxel": 11, "hexahedron": 12, "wedge": 13, "pyramid": 14,
                       "pentagonal prism": 15, "hexagonal prism": 16}


def cells_of_type(cell_type: int, blocks=(3, 2, 2), *, warp: float = 0.0, seed: int = 0):
    """A grid of VTK's ``vtkCellTypeSource`` cells of ``cell_type`` over ``blocks`` unit
    blocks, moved by a projective map ``x -> (A x + b) / (1 + c . x)`` (planes stay planes,
    so every face stays planar, but the cells are no affine images of each other; voxels,
    axis-aligned by definition, only scaled and moved) and, with ``warp`` > 0, every point
    jittered by up to ``warp`` (faces of 4+ points warp)."""
    import pyvista as pv
    from vtkmodules.vtkFiltersSources import vtkCellTypeSource
    source = vtkCellTypeSource()
    source.SetCellType(cell_type)
    source.SetBlocksDimensions(*blocks)
    source.Update()
    mesh = pv.wrap(source.GetOutput())
    rng = np.random.default_rng(seed)
    x = np.asarray(mesh.points, np.float64)
    voxel = cell_type == 11
    a = np.diag(rng.uniform(0.5, 2, 3)) if voxel else np.eye(3) + 0.3 * rng.uniform(-1, 1, (3, 3))
    c = np.zeros(3) if voxel else rng.uniform(0.02, 0.08, 3)
    mesh.points = (x @ a.T + rng.uniform(-5, 5, 3)) / (1 + x @ c)[:, None]
    if warp:
        mesh.points = np.asarray(mesh.points) + rng.uniform(-warp, warp, (mesh.n_points, 3))
    return mesh


def _faces(cell_type: int):
    """The faces of a VTK cell type as local vertex lists (pixel faces in polygon order),
    asked of a VTK cell one cell at a time (the slow way)."""
    from vtkmodules.vtkCommonDataModel import vtkGenericCell
    cell = vtkGenericCell()
    cell.SetCellType(cell_type)
    n = cell.GetNumberOfPoints()
    cell.GetPointIds().SetNumberOfIds(n)
    cell.GetPoints().SetNumberOfPoints(n)
    for i in range(n):
        cell.GetPointIds().SetId(i, i)
    faces = []
    for f in range(cell.GetNumberOfFaces()):
        face = cell.GetFace(f)
        ids = [face.GetPointIds().GetId(j) for j in range(face.GetNumberOfPoints())]
        faces.append([ids[0], ids[1], ids[3], ids[2]] if face.GetCellType() == 8 else ids)
    return faces


def fan_reference(mesh) -> tuple[np.ndarray, np.ndarray]:
    """Centres and volumes of every linear volume cell, cell by cell: each face a fan of
    triangles about its vertex mean (a triangle itself), tetrahedra from the cell's vertex
    mean (not the fast path's vertex 0) to every fan triangle, ``det / 6`` each; the
    volume-weighted mean of the tetrahedra's centroids."""
    points = np.asarray(mesh.points, np.float64)
    centres, volumes = np.zeros((mesh.n_cells, 3)), np.zeros(mesh.n_cells)
    for c in range(mesh.n_cells):
        cell = mesh.get_cell(c)
        x = points[cell.point_ids]
        apex = x.mean(0)
        moment, volume = np.zeros(3), 0.0
        for face in _faces(int(cell.type)):
            fan = [x[face]] if len(face) == 3 else [
                (x[face[i]], x[face[(i + 1) % len(face)]], x[face].mean(0))
                for i in range(len(face))]
            for a, b, d in fan:
                six = np.linalg.det(np.stack([a - apex, b - apex, d - apex]))
                volume += six / 6
                moment += six / 6 * (apex + a + b + d) / 4
        centres[c], volumes[c] = moment / volume, abs(volume)
    return centres, volumes


def convex_hull_reference(mesh) -> tuple[np.ndarray, np.ndarray]:
    """Centres and volumes of convex cells (planar faces) from scipy, cell by cell: the
    convex hull's volume, and the volume-weighted centroid of a Delaunay tetrahedralisation
    of the cell's vertices -- geometry that knows nothing of VTK's face lists."""
    from scipy.spatial import ConvexHull, Delaunay
    points = np.asarray(mesh.points, np.float64)
    centres, volumes = np.zeros((mesh.n_cells, 3)), np.zeros(mesh.n_cells)
    for c in range(mesh.n_cells):
        x = points[mesh.get_cell(c).point_ids]
        tets = x[Delaunay(x).simplices]
        v = np.abs(np.linalg.det(tets[:, 1:] - tets[:, :1])) / 6
        centres[c] = (v[:, None] * tets.mean(1)).sum(0) / v.sum()
        volumes[c] = ConvexHull(x).volume
    return centres, volumes


# ---------------------------------------------------------------------------------------------
# one writer per claimed format: write(folder, name, seed) -> the case file

def _save(mesh, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    mesh.save(path)
    return path


def write_vtu(folder: Path, name: str, seed: int = 0) -> Path:
    return _save(volume_mesh(seed), folder / f"{name}.vtu")


def write_vtk(folder: Path, name: str, seed: int = 0) -> Path:
    return _save(volume_mesh(seed), folder / f"{name}.vtk")


def write_vtkhdf(folder: Path, name: str, seed: int = 0) -> Path:
    return _save(volume_mesh(seed), folder / f"{name}.vtkhdf")


def write_vtp(folder: Path, name: str, seed: int = 0) -> Path:
    return _save(surface_mesh(seed), folder / f"{name}.vtp")


def write_stl(folder: Path, name: str, seed: int = 0) -> Path:
    return _save(surface_mesh(seed), folder / f"{name}.stl")


def write_ensight(folder: Path, name: str, seed: int = 0) -> Path:
    """VTK's EnSight Gold writer (it names variables ``T_n`` per node and ``p_c``, ``U_c``
    per element, as its case file states)."""
    from vtkmodules.vtkIOParallel import vtkEnSightWriter
    mesh = volume_mesh(seed)
    mesh.cell_data["BlockId"] = np.ones(mesh.n_cells, np.int32)
    folder.mkdir(parents=True, exist_ok=True)
    writer = vtkEnSightWriter()
    writer.SetPath(str(folder))
    writer.SetBaseName(name)
    writer.SetInputData(mesh)
    writer.SetTimeStep(0)
    writer.Write()
    writer.WriteCaseFile(1)
    return folder / f"{name}.0.case"


def write_gmsh(folder: Path, name: str, seed: int = 0) -> Path:
    return _meshio_write(folder / f"{name}.msh", seed, "gmsh")


def write_xdmf(folder: Path, name: str, seed: int = 0) -> Path:
    return _meshio_write(folder / f"{name}.xdmf", seed, "xdmf")


def _meshio_write(path: Path, seed: int, file_format: str) -> Path:
    import meshio
    mesh = volume_mesh(seed)
    tets = np.asarray(mesh.cells_dict[10])
    out = meshio.Mesh(np.asarray(mesh.points), [("tetra", tets)],
                      point_data={"T": np.asarray(mesh.point_data["T"])},
                      cell_data={"p": [np.asarray(mesh.cell_data["p"])],
                                 "U": [np.asarray(mesh.cell_data["U"])]})
    path.parent.mkdir(parents=True, exist_ok=True)
    if file_format == "gmsh":   # binary: meshio cannot read back its ASCII vector element data
        meshio.write(path, out, file_format="gmsh", binary=True)
    else:
        meshio.write(path, out, file_format=file_format)
    return path


# ---------------------------------------------------------------------------------------------
# OpenFOAM: a hand-written ASCII case of nx x ny x nz hexahedra

def _foam_header(cls: str, obj: str, location: str = "") -> str:
    where = f'    location    "{location}";\n' if location else ""
    return ("FoamFile\n{\n    version     2.0;\n    format      ascii;\n"
            f"    class       {cls};\n{where}    object      {obj};\n}}\n\n")


def openfoam_cells(nx: int = 3, ny: int = 2, nz: int = 2, size=(1.0, 0.5, 0.5)
                   ) -> tuple[np.ndarray, list[list[int]], list[int], list[int], int]:
    """``(points, faces, owner, neighbour, internal faces)`` of a box of hexahedra, in
    OpenFOAM's order: internal faces by owner then neighbour, then the boundary faces;
    every face's vertices turn around its normal out of its owner."""
    def pid(i, j, k):
        return i + (nx + 1) * (j + (ny + 1) * k)

    def cid(i, j, k):
        return i + nx * (j + ny * k)

    ii, jj, kk = np.meshgrid(np.arange(nx + 1), np.arange(ny + 1), np.arange(nz + 1),
                             indexing="ij")
    points = np.zeros(((nx + 1) * (ny + 1) * (nz + 1), 3))
    for i, j, k in zip(ii.ravel(), jj.ravel(), kk.ravel()):
        points[pid(i, j, k)] = (i * size[0] / nx, j * size[1] / ny, k * size[2] / nz)

    def face(axis, i, j, k):   # the face at the +axis side of cell (i, j, k), normal +axis
        if axis == 0:
            return [pid(i + 1, j, k), pid(i + 1, j + 1, k), pid(i + 1, j + 1, k + 1),
                    pid(i + 1, j, k + 1)]
        if axis == 1:
            return [pid(i, j + 1, k), pid(i, j + 1, k + 1), pid(i + 1, j + 1, k + 1),
                    pid(i + 1, j + 1, k)]
        return [pid(i, j, k + 1), pid(i + 1, j, k + 1), pid(i + 1, j + 1, k + 1),
                pid(i, j + 1, k + 1)]

    faces, owner, neighbour = [], [], []
    cells = [(i, j, k) for k in range(nz) for j in range(ny) for i in range(nx)]
    for i, j, k in cells:
        for axis, (di, dj, dk) in enumerate(((1, 0, 0), (0, 1, 0), (0, 0, 1))):
            if i + di < nx and j + dj < ny and k + dk < nz:
                faces.append(face(axis, i, j, k))
                owner.append(cid(i, j, k))
                neighbour.append(cid(i + di, j + dj, k + dk))
    internal = len(faces)
    for i, j, k in cells:
        for axis, (di, dj, dk) in enumerate(((1, 0, 0), (0, 1, 0), (0, 0, 1))):
            if (i, j, k)[axis] == (nx, ny, nz)[axis] - 1:        # the +axis boundary
                faces.append(face(axis, i, j, k))
                owner.append(cid(i, j, k))
            if (i, j, k)[axis] == 0:                            # the -axis boundary
                lower = face(axis, i - di, j - dj, k - dk)
                faces.append(lower[::-1])
                owner.append(cid(i, j, k))
    return points, faces, owner, neighbour, internal


def write_openfoam(folder: Path, name: str, seed: int = 0, time: str = "1",
                   factor: float = 1.0) -> Path:
    """``folder/name/`` as an OpenFOAM case (constant/polyMesh, system/controlDict, a time
    directory with the cell fields p (times ``factor``) and U) and its ``name.foam``."""
    case = folder / name
    mesh_dir = case / "constant" / "polyMesh"
    mesh_dir.mkdir(parents=True, exist_ok=True)
    (case / "system").mkdir(exist_ok=True)
    points, faces, owner, neighbour, internal = openfoam_cells(3 + seed % 2, 2, 2)
    n_cells = max(owner) + 1
    body = "\n".join(f"({x:.10g} {y:.10g} {z:.10g})" for x, y, z in points)
    (mesh_dir / "points").write_text(_foam_header("vectorField", "points", "constant/polyMesh")
                                     + f"{len(points)}\n(\n{body}\n)\n")
    body = "\n".join(f"4({' '.join(map(str, f))})" for f in faces)
    (mesh_dir / "faces").write_text(_foam_header("faceList", "faces", "constant/polyMesh")
                                    + f"{len(faces)}\n(\n{body}\n)\n")
    for obj, values in (("owner", owner), ("neighbour", neighbour)):
        (mesh_dir / obj).write_text(_foam_header("labelList", obj, "constant/polyMesh")
                                    + f"{len(values)}\n(\n" + "\n".join(map(str, values))
                                    + "\n)\n")
    (mesh_dir / "boundary").write_text(
        _foam_header("polyBoundaryMesh", "boundary", "constant/polyMesh")
        + f"1\n(\n    walls\n    {{\n        type wall;\n        nFaces {len(faces) - internal};"
          f"\n        startFace {internal};\n    }}\n)\n")
    (case / "system" / "controlDict").write_text(
        _foam_header("dictionary", "controlDict", "system")
        + "application simpleFoam;\nstartFrom startTime;\nstartTime 0;\nstopAt endTime;\n"
          "endTime 1;\ndeltaT 1;\nwriteControl timeStep;\nwriteInterval 1;\n")
    centres = _hex_centres(points, faces, owner, neighbour, n_cells)
    fields = case / time
    fields.mkdir(exist_ok=True)
    p = factor * cell_field(centres)
    (fields / "p").write_text(
        _foam_header("volScalarField", "p", time) + "dimensions [0 2 -2 0 0 0 0];\n\n"
        f"internalField nonuniform List<scalar> {n_cells}\n(\n"
        + "\n".join(f"{v:.12g}" for v in p)
        + "\n);\n\nboundaryField\n{\n    walls\n    {\n        type zeroGradient;\n    }\n}\n")
    u = velocity(centres)
    (fields / "U").write_text(
        _foam_header("volVectorField", "U", time) + "dimensions [0 1 -1 0 0 0 0];\n\n"
        f"internalField nonuniform List<vector> {n_cells}\n(\n"
        + "\n".join(f"({a:.12g} {b:.12g} {c:.12g})" for a, b, c in u)
        + "\n);\n\nboundaryField\n{\n    walls\n    {\n        type zeroGradient;\n    }\n}\n")
    foam = case / f"{name}.foam"
    foam.write_text("")
    return foam


def _hex_centres(points, faces, owner, neighbour, n_cells) -> np.ndarray:
    """Centres of the box's hexahedra: the mean of their 8 distinct vertices (a box)."""
    vertices: list[set[int]] = [set() for _ in range(n_cells)]
    for f, o in zip(faces, owner):
        vertices[o].update(f)
    for f, o in zip(faces, neighbour):
        vertices[o].update(f)
    return np.array([points[sorted(v)].mean(0) for v in vertices])


WRITERS = {"vtu": write_vtu, "vtp": write_vtp, "vtk": write_vtk, "vtkhdf": write_vtkhdf,
           "ensight": write_ensight, "openfoam": write_openfoam, "stl": write_stl,
           "gmsh": write_gmsh, "xdmf": write_xdmf}
"""A writer for every registered format: tests/test_mesh_formats.py fails for a format
registered without one (a format is claimed only when a file of it is tested)."""

ARRAY_NAMES = {"ensight": {"T": "T_n", "p": "p_c", "U": "U_c"}}
"""Array names a writer changes (VTK's EnSight writer appends _n / _c)."""

CARRIES = {"vtu": ("point", "cell", "field"), "vtk": ("point", "cell", "field"),
           "vtkhdf": ("point", "cell", "field"), "vtp": ("point", "cell", "field"),
           "ensight": ("point", "cell"), "openfoam": ("cell",), "stl": (),
           "gmsh": ("point", "cell"), "xdmf": ("point", "cell")}
"""What each writer's files hold: point data, cell data, field data."""
