"""Linear elasticity of a unit cell with a random void: the Elasticity benchmark's task, made here.

The public benchmark (Geo-FNO; paper Section C.1, Table 6) maps the 972-point cloud of a unit
cell with a central void of random shape to the von Mises stress at those points. Its
release used a hyperelastic material; this generator solves the linear analogue:

* **Geometry**: the square ``[0, 1]^2`` minus a star-shaped void centred at ``(1/2, 1/2)``
  with radius ``r(theta) = 0.2 + 0.2 / (1 + exp(g(theta)))`` in ``(0.2, 0.4)``, where
  ``g(theta) = c_0 + sum_{k=1}^{8} a_k cos(k theta) + b_k sin(k theta)`` and
  ``c_0, a_k, b_k ~ N(0, (2 / (1 + k^2))^2)`` (a smooth random periodic function).
* **Material**: isotropic, Young's modulus ``E = 1``, Poisson ratio ``nu = 0.3``, plane strain.
* **Boundary conditions**: bottom edge clamped (``u = 0``); uniform tension traction
  ``t = (0, 1)`` on the top edge; the sides and the void are traction-free. Equilibrium
  ``div sigma = 0`` with ``sigma = lambda tr(eps) I + 2 mu eps``, ``eps = sym grad u``.
  With traction loading the stress does not depend on ``E``, and it is stated in units of the
  applied traction (dimensionless).
* **Discretisation**: a quality Delaunay triangulation (``triangle``, minimum angle 30 deg)
  with at least 972 vertices, P1 Lagrange elements (scikit-fem, one-point quadrature, exact
  for constant strains), a sparse direct solve. Element stresses are averaged to the vertices
  weighted by element area; the von Mises stress at a vertex is
  ``sqrt(((sxx - syy)^2 + (syy - szz)^2 + (szz - sxx)^2) / 2 + 3 sxy^2)`` with
  ``szz = nu (sxx + syy)`` (plane strain).
* **Points**: all boundary vertices (outer square and void) plus a random subset of interior
  vertices, 972 in all, in mesh order.

Files follow the Geo-FNO release: ``Random_UnitCell_sigma_10.npy`` ``[972, S]`` and
``Random_UnitCell_XY_10.npy`` ``[972, 2, S]`` (float32), ``S = n_train + n_test``, train
samples first, so the ``elasticity`` loader (first ``n_train``, last ``n_test``) reads it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from flarepp.data.drivaerml import require_vtk
from flarepp.data.generators._io import (check_counts, check_disk_room, refuse_existing,
                                        write_atomically)
from flarepp.data.loaders import ELASTICITY_POINTS as N_POINTS
from flarepp.data.loaders import ELASTICITY_SIGMA_FILE as SIGMA_FILE
from flarepp.data.loaders import ELASTICITY_XY_FILE as XY_FILE
from flarepp.io import atomic_write, save_npy

YOUNG_MODULUS = 1.0
POISSON_RATIO = 0.3
TRACTION = 1.0
VOID_MODES = 8
SIDE_SEGMENTS = 28       # boundary vertices per side of the square
VOID_SEGMENTS = 72       # boundary vertices on the void
MESH_VERTICES = 1060     # aimed-for vertex count before choosing 972 (at least 972)
TRAIN_SPLIT, TEST_SPLIT = 0, 1
LOAD_RANGE = (0.5, 2.0)  # traction magnitudes of elasticity-mesh cases


def _require_mesh_packages():
    try:
        import skfem
        import triangle
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"the elasticity generator needs scikit-fem and triangle ({err.name} is missing): "
            "pip install 'flarepp[mesh]'") from err
    return skfem, triangle


def void_radius(theta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random star-shaped void radius ``r(theta)`` in ``(0.2, 0.4)`` (module docstring)."""
    k = np.arange(1, VOID_MODES + 1)
    scale = 2.0 / (1.0 + k ** 2)
    c0 = 2.0 * rng.standard_normal()
    a, b = scale * rng.standard_normal(VOID_MODES), scale * rng.standard_normal(VOID_MODES)
    g = c0 + np.cos(np.outer(theta, k)) @ a + np.sin(np.outer(theta, k)) @ b
    return 0.2 + 0.2 / (1.0 + np.exp(g))


def _cell_outline(rng: np.random.Generator) -> tuple[dict, float]:
    """Planar straight-line graph of the square with its void, and the solid's area."""
    theta = np.linspace(0.0, 2 * np.pi, VOID_SEGMENTS, endpoint=False)
    radius = void_radius(theta, rng)
    void = np.c_[0.5 + radius * np.cos(theta), 0.5 + radius * np.sin(theta)]
    t = np.linspace(0.0, 1.0, SIDE_SEGMENTS, endpoint=False)
    zero, one = np.zeros_like(t), np.ones_like(t)
    square = np.concatenate([np.c_[t, zero], np.c_[one, t], np.c_[1 - t, one], np.c_[zero, 1 - t]])

    def loop(start: int, count: int) -> np.ndarray:
        i = np.arange(count)
        return start + np.c_[i, (i + 1) % count]

    pslg = {"vertices": np.concatenate([square, void]),
            "segments": np.concatenate([loop(0, len(square)), loop(len(square), len(void))]),
            "segment_markers": np.ones(len(square) + len(void), np.int32),
            "holes": np.array([[0.5, 0.5]])}
    void_area = 0.5 * abs(np.dot(void[:, 0], np.roll(void[:, 1], -1))
                          - np.dot(void[:, 1], np.roll(void[:, 0], -1)))
    return pslg, 1.0 - void_area


def _mesh(pslg: dict, solid_area: float, triangle) -> dict:
    """Quality triangulation with at least ``N_POINTS`` vertices (refined until it has)."""
    max_area = 1.9 * solid_area / MESH_VERTICES  # calibrated: ~MESH_VERTICES vertices
    for _ in range(20):
        mesh = triangle.triangulate(pslg, f"pq30a{max_area:.8f}")
        if len(mesh["vertices"]) >= N_POINTS:
            return mesh
        max_area *= 0.85
    raise RuntimeError(f"could not mesh the unit cell with {N_POINTS} vertices")


def solve_unit_cell(vertices_V2: np.ndarray, triangles_T3: np.ndarray,
                    traction: float = TRACTION) -> np.ndarray:
    """Von Mises stress ``[V]`` at the vertices for the loading of the module docstring,
    the top edge's tension traction of magnitude ``traction``."""
    skfem, _ = _require_mesh_packages()
    from skfem.helpers import sym_grad
    from skfem.models.elasticity import lame_parameters, linear_elasticity, linear_stress

    mesh = skfem.MeshTri(np.ascontiguousarray(vertices_V2.T, dtype=np.float64),
                         np.ascontiguousarray(triangles_T3.T, dtype=np.int64))
    element = skfem.ElementVector(skfem.ElementTriP1())
    basis = skfem.Basis(mesh, element, intorder=1)
    lam, mu = lame_parameters(YOUNG_MODULUS, POISSON_RATIO)  # plane strain Lame constants
    stiffness = skfem.asm(linear_elasticity(lam, mu), basis)

    @skfem.LinearForm
    def top_traction(v, w):
        return traction * v[1]

    top = skfem.FacetBasis(mesh, element, facets=mesh.facets_satisfying(
        lambda x: np.isclose(x[1], 1.0)), intorder=1)
    load = skfem.asm(top_traction, top)
    clamped = basis.get_dofs(lambda x: np.isclose(x[1], 0.0))
    u = skfem.solve(*skfem.condense(stiffness, load, D=clamped))

    stress = linear_stress(lam, mu)(sym_grad(basis.interpolate(u)))  # [2, 2, T, 1]
    area_T = basis.dx[:, 0]
    weight_V = np.bincount(triangles_T3.ravel(), np.repeat(area_T, 3), len(vertices_V2))

    def to_vertices(component_T: np.ndarray) -> np.ndarray:
        return np.bincount(triangles_T3.ravel(), np.repeat(area_T * component_T, 3),
                           len(vertices_V2)) / weight_V

    sxx, syy, sxy = (to_vertices(stress[i, j, :, 0]) for i, j in ((0, 0), (1, 1), (0, 1)))
    szz = POISSON_RATIO * (sxx + syy)
    return np.sqrt(0.5 * ((sxx - syy) ** 2 + (syy - szz) ** 2 + (szz - sxx) ** 2)
                   + 3.0 * sxy ** 2)


def elasticity_sample(seed: int, split: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample ``index`` of ``split``: ``(points [972, 2], von Mises stress [972])``.

    Each sample has its own stream ``default_rng([seed, split, index])``.
    """
    _, triangle = _require_mesh_packages()
    rng = np.random.default_rng([seed, split, index])
    pslg, solid_area = _cell_outline(rng)
    mesh = _mesh(pslg, solid_area, triangle)
    vertices_V2, triangles_T3 = mesh["vertices"], mesh["triangles"]
    stress_V = solve_unit_cell(vertices_V2, triangles_T3)
    on_boundary = mesh["vertex_markers"].ravel() == 1
    boundary, interior = np.flatnonzero(on_boundary), np.flatnonzero(~on_boundary)
    if len(boundary) > N_POINTS:
        raise RuntimeError(f"{len(boundary)} boundary vertices exceed {N_POINTS} points")
    keep = np.sort(np.concatenate(
        [boundary, rng.choice(interior, N_POINTS - len(boundary), replace=False)]))
    return vertices_V2[keep], stress_V[keep]


def elasticity_case(seed: int, split: int, index: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Case ``index`` of ``split`` as a solver writes it: ``(vertices [V, 2], triangles
    [T, 3], von Mises stress [V] at every vertex, load)``, the unit cell of
    :func:`elasticity_sample` (the same geometry) under a top traction of magnitude ``load``
    drawn uniformly from ``LOAD_RANGE`` by its own stream ``default_rng([seed, split, index,
    1])``. The stress is linear in the load, so a model that is not told the load cannot
    know the stress's magnitude."""
    _, triangle = _require_mesh_packages()
    rng = np.random.default_rng([seed, split, index])
    pslg, solid_area = _cell_outline(rng)
    mesh = _mesh(pslg, solid_area, triangle)
    load = float(np.random.default_rng([seed, split, index, 1]).uniform(*LOAD_RANGE))
    vertices_V2, triangles_T3 = mesh["vertices"], mesh["triangles"]
    return vertices_V2, triangles_T3, solve_unit_cell(vertices_V2, triangles_T3, load), load


def write_case_vtu(path: str | Path, vertices_V2: np.ndarray, triangles_T3: np.ndarray,
                   point_data: dict[str, np.ndarray], field_data: dict[str, float]) -> Path:
    """A triangle mesh as a VTK XML unstructured grid (``z = 0``), written atomically,
    with ``point_data`` arrays and ``field_data`` scalars."""
    core, data_model, io_xml, numpy_support = require_vtk()
    grid = data_model.vtkUnstructuredGrid()
    points = core.vtkPoints()
    points.SetData(numpy_support.numpy_to_vtk(
        np.c_[vertices_V2, np.zeros(len(vertices_V2))].astype(np.float64), deep=True))
    grid.SetPoints(points)
    cells = data_model.vtkCellArray()
    offsets = np.arange(0, 3 * len(triangles_T3) + 1, 3, dtype=np.int64)
    cells.SetData(numpy_support.numpy_to_vtk(offsets, deep=True),
                  numpy_support.numpy_to_vtk(triangles_T3.astype(np.int64).ravel(), deep=True))
    grid.SetCells(5, cells)                                   # VTK_TRIANGLE
    for name, values in point_data.items():
        array = numpy_support.numpy_to_vtk(np.ascontiguousarray(values, np.float64), deep=True)
        array.SetName(name)
        grid.GetPointData().AddArray(array)
    for name, value in field_data.items():
        array = numpy_support.numpy_to_vtk(np.array([value], np.float64), deep=True)
        array.SetName(name)
        grid.GetFieldData().AddArray(array)

    def write(tmp: Path) -> None:
        writer = io_xml.vtkXMLUnstructuredGridWriter()
        writer.SetFileName(str(tmp))
        writer.SetInputData(grid)
        if not writer.Write():
            raise OSError(f"{path}: VTK could not write the file")
    return atomic_write(path, write)


def make_elasticity_mesh(out: str | Path, *, n_train: int = 64, n_test: int = 16,
                         resolution: int | None = None, seed: int = 0, progress: bool = True,
                         overwrite: bool = False) -> list[Path]:
    """One VTU file per case, as a finite-element solver writes its output:
    ``out/train/case_<i>.vtu`` and ``out/test/case_<i>.vtu``, each the whole triangle mesh
    of a unit cell (:func:`elasticity_case`) with the point array ``von_mises`` and the
    field data ``load`` (the traction's magnitude, a global condition). Convert with
    ``flarepp data convert OUT --out STORE --targets von_mises --conditions load
    --test-pattern 'test/*'`` (docs/data.md)."""
    if resolution is not None:
        raise ValueError(f"elasticity-mesh writes each case's whole mesh (about "
                         f"{MESH_VERTICES} vertices); resolution {resolution} does not apply")
    check_counts("elasticity-mesh", n_train, n_test, seed)
    _require_mesh_packages()
    out = Path(out)
    check_disk_room(out, n_train + n_test, 40 * MESH_VERTICES, "elasticity-mesh")  # ~48 B each
    jobs = [("train", TRAIN_SPLIT, i) for i in range(n_train)] + \
        [("test", TEST_SPLIT, i) for i in range(n_test)]
    paths = [out / folder / f"case_{i:04d}.vtu" for folder, _, i in jobs]
    refuse_existing(paths, overwrite)
    for path, (_, split, index) in tqdm(list(zip(paths, jobs)), desc="elasticity-mesh",
                                        unit="case", disable=not progress):
        vertices, triangles, stress, load = elasticity_case(seed, split, index)
        write_case_vtu(path, vertices, triangles, {"von_mises": stress}, {"load": load})
    return paths


def make_elasticity(out: str | Path, *, n_train: int = 1000, n_test: int = 200,
                    resolution: int | None = None, seed: int = 0, progress: bool = True,
                    overwrite: bool = False) -> list[Path]:
    """Generate the Geo-FNO-layout Elasticity files in ``out``; returns their paths.

    ``resolution`` must be ``None`` or 972 (the benchmark's fixed point count). Both files are
    written only after every sample is solved, through temporary files and renames.
    """
    if resolution not in (None, N_POINTS):
        raise ValueError(f"elasticity has a fixed {N_POINTS} points per sample; "
                         f"resolution {resolution} does not apply")
    check_counts("elasticity", n_train, n_test, seed)
    _require_mesh_packages()
    out = Path(out)
    paths = [out / SIGMA_FILE, out / XY_FILE]
    refuse_existing(paths, overwrite)

    total = n_train + n_test
    sigma_PS = np.empty((N_POINTS, total), np.float32)
    xy_P2S = np.empty((N_POINTS, 2, total), np.float32)
    jobs = [(TRAIN_SPLIT, i) for i in range(n_train)] + [(TEST_SPLIT, i) for i in range(n_test)]
    for s, (split, index) in enumerate(tqdm(jobs, desc="elasticity", unit="sample",
                                            disable=not progress)):
        xy_P2S[:, :, s], sigma_PS[:, s] = elasticity_sample(seed, split, index)

    return write_atomically({paths[0]: lambda handle: save_npy(handle, sigma_PS),
                             paths[1]: lambda handle: save_npy(handle, xy_P2S)})
