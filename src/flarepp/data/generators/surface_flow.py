"""Surface pressure and wall shear on car-like bodies: the full-surface DrivAerML task, made here.

The paper's full-surface task (Section 4.2, C.1) maps each cell of a car surface (centre and
unit normal) to its pressure and wall-shear vector. The release (Ashton et al. 2024) cannot
be fetched on these machines, so this generator writes the same layout,
``run_<i>/boundary_<i>.vtp`` with cell arrays ``pMeanTrim`` and ``wallShearStressMeanTrim``,
for a family of closed car-like bodies in inviscid flow:

* **Bodies** (``CarBody``): lofted sections ``y = w(xi) C(phi)``, ``z = z_m(xi) + h(xi) S(phi)``
  (a superellipse, different exponents above and below the waist, the upper half narrowed by
  a tumblehome factor) along ``x = L xi``. The top and bottom centre-line profiles pass
  monotone cubic (PCHIP) curves through control points for the hood, windshield, roof and
  rear (fastback to squareback), smoothed by a Gaussian of width 0.04 L (curvature radii a
  few-thousand-panel solve resolves); the ends close elliptically at the nose and with a
  power law of chosen bluntness at the tail. Sampled: length, width, roof height, ground clearance,
  nose length and height, hood height, windshield position, roof end and tail height, tail
  closure and bluntness, section exponents and the yaw angle of the flow. No wheels, mirrors
  or ground plane: the body is in free air.
* **Mesh**: ``n_u`` stations with cosine clustering toward the ends times ``n_phi`` points
  around; quads between rings, triangle fans at the two poles; ``n_u * n_phi`` cells whose
  vertex order gives outward normals.
* **Pressure**: incompressible potential flow ``u = U_inf + grad phi``, ``Laplace phi = 0``,
  ``u . n = 0`` on the body, by the constant-strength source panel method of Hess & Smith
  (1967): flat panels (each polygon projected on the plane of its Newell normal through its
  vertex mean), one unknown source density ``sigma_j`` per panel, collocation at the panel
  centroids, ``1/2 sigma_i + sum_{j != i} sigma_j V_ij . n_i = -U_inf . n_i``. The velocity
  of a unit source density on a planar polygon is exact (the closed form of Hess & Smith
  1967 and Newman 1986, written per edge):
  ``V = (1 / 4 pi) (sum_e m_e log((r_a + r_b + d_e) / (r_a + r_b - d_e)) + n Omega)``
  over its edges ``e`` (in-plane outward edge normal ``m_e``, length ``d_e``, distances
  ``r_a, r_b`` from the field point to the edge's ends) with ``Omega`` the signed solid angle
  it subtends (Van Oosterom & Strackee 1983). Pairs farther apart than ``NEAR_FIELD_RADII``
  panel radii use the point-source limit ``A_j (x - c_j) / (4 pi |x - c_j|^3)`` instead.
  Up to ``DIRECT_SOLVE_MAX`` panels the dense system is solved by LU, beyond it by GMRES
  (a second-kind equation: 5-15 iterations). Surface velocity ``u_t = u - (u . n) n``,
  ``C_p = 1 - |u_t|^2 / U_inf^2`` and the kinematic pressure ``p_s = C_p U_inf^2 / 2``.
  Validated against the analytic sphere and ellipsoid (``tests/test_surface_flow.py``).
* **Wall shear**: a turbulent flat-plate skin-friction law applied locally, ``c_f = 0.0576
  Re_s^{-1/5}`` (the 1/7-power-law result for a turbulent flat plate; Schlichting,
  Boundary-Layer Theory) with ``Re_s = |u_t| s / nu``, where ``s`` is the run length from
  the front stagnation point: the shortest path from the upstream-facing cell of highest
  ``C_p`` (potential flow also stagnates at the rear) through the graph of cells sharing a
  vertex (a geodesic-distance stand-in for the streamline length, a few % longer than the
  geodesic; clipped below at ``MIN_RUN_LENGTH``).
  ``tau_w / rho = c_f |u_t| u_t / 2`` (kinematic, along the surface velocity), m^2/s^2. It
  ignores pressure gradients, laminar flow and separation: a model, not a RANS solution.
* **Large meshes**: a dense panel solve grows as N^2 in memory; above ``max_solver_panels``
  cells the flow is solved on a coarser mesh of the same body (same ``(u, phi)``
  parameterisation, about ``max_solver_panels`` cells), and the coarse total velocity and run
  length are interpolated bilinearly in ``(u, phi)`` (periodic in ``phi``) to the fine cells,
  where ``u_t``, ``C_p`` and the shear are formed with the fine normals. Millions of cells
  thus carry a flow resolved at the coarse panel size (on sampled bodies, solving on 4,800
  instead of 8,000 panels changes ``C_p`` by 0.011-0.015 RMS).

Free stream ``U_inf = FREE_STREAM_SPEED`` m/s along ``(cos beta, sin beta, 0)`` (``beta``: yaw),
air ``nu = KINEMATIC_VISCOSITY``. Files: ``run_1 .. run_{n_train}`` then the test runs, and
``split.json`` listing them (read with ``DrivAerMLSurfaces(out, split_file=out/'split.json')``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import scipy.linalg
import scipy.sparse
import scipy.sparse.csgraph
import scipy.sparse.linalg
from scipy.interpolate import PchipInterpolator, RegularGridInterpolator
from scipy.ndimage import gaussian_filter1d
from tqdm.auto import tqdm

from flarepp.data.drivaerml import (PRESSURE_ARRAY, WALL_SHEAR_ARRAY, SurfacePolygons,
                                    polygon_centres_and_normals, require_vtk, write_vtp)
from flarepp.data.generators._io import (check_counts, check_disk_room, refuse_existing,
                                        write_atomically)

FREE_STREAM_SPEED = 40.0          # m/s, a road-car speed
KINEMATIC_VISCOSITY = 1.5e-5      # m^2/s, air at about 20 C
SKIN_FRICTION_COEFFICIENT = 0.0576
SKIN_FRICTION_EXPONENT = -0.2
MIN_RUN_LENGTH = 0.01             # m
NEAR_FIELD_RADII = 4.0            # exact panel integrals within this many panel radii
DIRECT_SOLVE_MAX = 2000           # panels solved by dense LU; GMRES above
MAX_SOLVER_PANELS = 8000          # larger meshes: solve coarse, interpolate
GMRES_TOLERANCE = 1e-10
CHUNK_ELEMENTS = 1_000_000        # rows x panels per block of the far field (cache-sized)
NEAR_PAIR_CHUNK = 16_384          # panel pairs per block of the exact near field
INTERPOLATION_CHUNK = 1 << 20     # fine cells per block of the coarse-to-fine interpolation
ASPECT = 1.5                      # n_phi / n_u: cells about as long as wide
END_CLUSTERING = 1.0              # weight of cosine spacing in the stations (``station``)
PROFILE_SAMPLES = 2001            # stations of the centre-line profiles before smoothing
PROFILE_SMOOTHING = 0.04          # Gaussian width of the profile smoothing, x the length
SPLIT_FILE = "split.json"
TRAIN_SPLIT, TEST_SPLIT = 0, 1
FOUR_PI = 4.0 * np.pi


# ---------------------------------------------------------------------------------------------
# the source panel method

@dataclass
class SourcePanels:
    """Flat panels: ``vertices [F, K, 3]`` (planar; triangles repeat a vertex), unit
    ``normals [F, 3]``, ``centroids [F, 3]`` (collocation points), ``areas [F]`` and
    ``radii [F]`` (largest centroid-vertex distance)."""

    vertices: np.ndarray
    normals: np.ndarray
    centroids: np.ndarray
    areas: np.ndarray
    radii: np.ndarray

    def __len__(self) -> int:
        return len(self.areas)

    @classmethod
    def from_polygons(cls, points_P3: np.ndarray, polygons_FK: np.ndarray) -> "SourcePanels":
        """Panels from polygons given as vertex indices ``[F, K]`` (orientation sets the
        normal; a triangle in a ``K = 4`` array repeats its last vertex)."""
        v_FK3 = np.asarray(points_P3, np.float64)[polygons_FK]
        newell_F3 = 0.5 * np.cross(v_FK3, np.roll(v_FK3, -1, axis=1)).sum(axis=1)
        normals = newell_F3 / np.linalg.norm(newell_F3, axis=1, keepdims=True)
        mean_F3 = v_FK3.mean(axis=1)
        height_FK = np.einsum("fkc,fc->fk", v_FK3 - mean_F3[:, None], normals)
        planar_FK3 = v_FK3 - height_FK[..., None] * normals[:, None]
        fan_FT3 = 0.5 * np.cross(planar_FK3[:, 1:-1] - planar_FK3[:, :1],
                                 planar_FK3[:, 2:] - planar_FK3[:, :1])
        weight_FT = np.einsum("ftc,fc->ft", fan_FT3, normals)
        areas = weight_FT.sum(axis=1)
        centre_FT3 = (planar_FK3[:, :1] + planar_FK3[:, 1:-1] + planar_FK3[:, 2:]) / 3.0
        centroids = np.einsum("ft,ftc->fc", weight_FT, centre_FT3) / areas[:, None]
        radii = np.linalg.norm(planar_FK3 - centroids[:, None], axis=-1).max(axis=1)
        return cls(planar_FK3, normals, centroids, areas, radii)


def source_panel_velocity(points_Q3: np.ndarray, vertices_QK3: np.ndarray,
                          normals_Q3: np.ndarray) -> np.ndarray:
    """Velocity ``[Q, 3]`` at ``points_Q3[q]`` induced by a unit source density on the planar
    polygon ``vertices_QK3[q]`` (normal ``normals_Q3[q]``), exact (module docstring).

    On the polygon's own plane inside it the normal part is ambiguous (``Omega = +-2 pi``);
    callers set the self-influence's normal part to ``1/2`` (the exterior limit).
    """
    edge_QK3 = np.roll(vertices_QK3, -1, axis=1) - vertices_QK3
    length_QK = np.linalg.norm(edge_QK3, axis=-1)
    edge_normal_QK3 = (np.cross(edge_QK3, normals_Q3[:, None, :])
                       / np.where(length_QK > 0, length_QK, 1.0)[..., None])
    rel_QK3 = points_Q3[:, None, :] - vertices_QK3
    dist_QK = np.linalg.norm(rel_QK3, axis=-1)
    dist_sum_QK = dist_QK + np.roll(dist_QK, -1, axis=1)
    log_QK = np.where(length_QK > 0, np.log((dist_sum_QK + length_QK)
                                            / np.maximum(dist_sum_QK - length_QK, 1e-300)), 0.0)
    velocity = np.einsum("qk,qkc->qc", log_QK, edge_normal_QK3)
    solid_angle = np.zeros(len(points_Q3))
    r0, d0 = rel_QK3[:, 0], dist_QK[:, 0]
    for k in range(1, vertices_QK3.shape[1] - 1):
        rk, rk1, dk, dk1 = rel_QK3[:, k], rel_QK3[:, k + 1], dist_QK[:, k], dist_QK[:, k + 1]
        triple = np.einsum("qc,qc->q", r0, np.cross(rk, rk1))
        denominator = (d0 * dk * dk1 + np.einsum("qc,qc->q", r0, rk) * dk1
                       + np.einsum("qc,qc->q", r0, rk1) * dk + np.einsum("qc,qc->q", rk, rk1) * d0)
        solid_angle += 2.0 * np.arctan2(triple, denominator)
    return (velocity + solid_angle[:, None] * normals_Q3) / FOUR_PI


def _near_pairs(panels: SourcePanels, near_radii: float
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs ``(i, j)`` with ``|c_i - c_j| < near_radii * radius_j`` (self pairs included),
    sorted by ``i``, and their exact velocity ``[Q, 3]`` per unit source density, the self
    term's normal part set to 1/2 (the exterior limit)."""
    from scipy.spatial import cKDTree
    centroids = panels.centroids
    tree = cKDTree(centroids)
    reach = near_radii * panels.radii
    pairs = tree.sparse_distance_matrix(tree, float(reach.max()), output_type="ndarray")
    close = pairs["v"] < reach[pairs["j"]]
    diagonal = np.arange(len(panels))
    keys = np.unique(np.concatenate([pairs["i"][close] * len(panels) + pairs["j"][close],
                                     diagonal * (len(panels) + 1)]))    # sorted by row
    rows, cols = np.divmod(keys, len(panels))
    velocity = np.empty((len(rows), 3))
    for start in range(0, len(rows), NEAR_PAIR_CHUNK):
        part = slice(start, start + NEAR_PAIR_CHUNK)
        velocity[part] = source_panel_velocity(centroids[rows[part]],
                                               panels.vertices[cols[part]],
                                               panels.normals[cols[part]])
    is_self = rows == cols
    normal = panels.normals[cols[is_self]]
    velocity[is_self] += ((0.5 - np.einsum("qc,qc->q", velocity[is_self], normal))[:, None]
                          * normal)
    return rows, cols, velocity


def _far_blocks(panels: SourcePanels, near_rows: np.ndarray, near_cols: np.ndarray):
    """Yield ``(rows, weight [R, F], near)`` over row blocks: ``weight_ij = A_j / (4 pi
    |c_i - c_j|^3)`` (the point-source limit, to be multiplied by ``c_i - c_j``) with the
    near pairs zeroed, and ``near`` the slice of the near-pair arrays in this block."""
    centroids, n_panels = panels.centroids, len(panels)
    sq_norm = (centroids ** 2).sum(axis=1)
    step = max(1, CHUNK_ELEMENTS // n_panels)
    bounds = np.searchsorted(near_rows, np.arange(0, n_panels + step, step))
    for block, start in enumerate(range(0, n_panels, step)):
        rows = np.arange(start, min(start + step, n_panels))
        weight = centroids[rows] @ centroids.T
        weight *= -2.0
        weight += sq_norm[rows, None]
        weight += sq_norm[None]
        weight[np.arange(len(rows)), rows] = 1.0              # self pairs: replaced below
        np.maximum(weight, 1e-300, out=weight)
        distance = np.sqrt(weight)
        weight *= distance                                     # |c_i - c_j|^3
        np.divide(panels.areas[None] / FOUR_PI, weight, out=weight)
        near = slice(bounds[block], bounds[block + 1])
        weight[near_rows[near] - start, near_cols[near]] = 0.0
        yield rows, weight, near


@dataclass
class PanelSolution:
    """Source densities ``sigma [F]``, total velocity ``velocity [F, 3]`` at the collocation
    points, its tangential part ``surface_velocity [F, 3]`` and ``cp [F]``, and the number of
    GMRES iterations (0 for the direct solve)."""

    sigma: np.ndarray
    velocity: np.ndarray
    surface_velocity: np.ndarray
    cp: np.ndarray
    iterations: int


def solve_source_panels(panels: SourcePanels, free_stream: np.ndarray, *,
                        near_radii: float = NEAR_FIELD_RADII,
                        direct_max: int = DIRECT_SOLVE_MAX) -> PanelSolution:
    """Hess-Smith source panel solution for the free stream ``free_stream [3]`` (m/s)."""
    free_stream = np.asarray(free_stream, np.float64)
    normals, centroids = panels.normals, panels.centroids
    n_panels = len(panels)
    near_rows, near_cols, near_velocity = _near_pairs(panels, near_radii)
    influence = np.empty((n_panels, n_panels))
    for rows, weight, near in _far_blocks(panels, near_rows, near_cols):
        n_rows = normals[rows]
        # far pairs: (c_i - c_j) . n_i = c_i . n_i - c_j . n_i
        weight *= np.einsum("rc,rc->r", centroids[rows], n_rows)[:, None] - n_rows @ centroids.T
        weight[near_rows[near] - rows[0], near_cols[near]] = np.einsum(
            "qc,qc->q", near_velocity[near], normals[near_rows[near]])
        influence[rows] = weight
    rhs = -normals @ free_stream
    iterations = 0
    if n_panels <= direct_max:
        sigma = scipy.linalg.solve(influence, rhs)
    else:
        def count(_residual):
            nonlocal iterations
            iterations += 1
        sigma, info = scipy.sparse.linalg.gmres(influence, rhs, rtol=GMRES_TOLERANCE,
                                                restart=60, maxiter=20, callback=count,
                                                callback_type="pr_norm")
        if info != 0:
            raise RuntimeError(f"GMRES did not converge for {n_panels} panels (info {info})")
    del influence
    velocity = np.tile(free_stream, (n_panels, 1))
    for rows, weight, near in _far_blocks(panels, near_rows, near_cols):
        weight *= sigma[None]
        velocity[rows] += centroids[rows] * weight.sum(axis=1)[:, None] - weight @ centroids
    np.add.at(velocity, near_rows, near_velocity * sigma[near_cols, None])
    surface_velocity = velocity - np.einsum("fc,fc->f", velocity, normals)[:, None] * normals
    cp = 1.0 - (surface_velocity ** 2).sum(axis=1) / (free_stream @ free_stream)
    return PanelSolution(sigma, velocity, surface_velocity, cp, iterations)


# ---------------------------------------------------------------------------------------------
# wall shear from a skin-friction law

def cell_adjacency(offsets: np.ndarray, connectivity: np.ndarray,
                   centres_F3: np.ndarray) -> scipy.sparse.csr_matrix:
    """Symmetric graph of cells sharing a vertex, weighted by the distance of their centres.

    Vertex (not edge) neighbours include the diagonals of a quad grid, so shortest paths
    follow oblique directions within ~8% instead of ~41% (a path along grid lines only).
    """
    n_cells = len(offsets) - 1
    cell = np.repeat(np.arange(n_cells), np.diff(offsets))
    incidence = scipy.sparse.csr_matrix((np.ones(len(cell)), (cell, connectivity)),
                                        shape=(n_cells, int(connectivity.max()) + 1))
    shared = scipy.sparse.triu(incidence @ incidence.T, k=1).tocoo()
    weight = np.linalg.norm(centres_F3[shared.row] - centres_F3[shared.col], axis=1)
    graph = scipy.sparse.coo_matrix((weight, (shared.row, shared.col)), shape=(n_cells,) * 2)
    return (graph + graph.T).tocsr()


def run_length_from_stagnation(graph: scipy.sparse.csr_matrix, cp_F: np.ndarray,
                               normals_F3: np.ndarray, free_stream: np.ndarray) -> np.ndarray:
    """Shortest-path distance ``[F]`` through ``graph`` from the front stagnation point: the
    cell of highest ``C_p`` among those facing the stream (potential flow also stagnates at
    the rear, with the same ``C_p = 1``, where no boundary layer starts)."""
    facing = normals_F3 @ free_stream < 0
    source = int(np.flatnonzero(facing)[np.argmax(cp_F[facing])])
    return scipy.sparse.csgraph.dijkstra(graph, directed=False, indices=source)


def wall_shear_stress(surface_velocity_F3: np.ndarray, run_length_F: np.ndarray,
                      viscosity: float = KINEMATIC_VISCOSITY) -> np.ndarray:
    """Kinematic wall shear ``[F, 3]``: ``c_f |u_t| u_t / 2``, ``c_f = 0.0576 Re_s^-0.2``."""
    speed = np.linalg.norm(surface_velocity_F3, axis=1)
    run = np.maximum(run_length_F, MIN_RUN_LENGTH)
    # c_f |u_t| / 2 = 0.0288 |u_t|^0.8 (s / nu)^-0.2, finite as |u_t| -> 0
    factor = (0.5 * SKIN_FRICTION_COEFFICIENT * speed ** (1.0 + SKIN_FRICTION_EXPONENT)
              * (run / viscosity) ** SKIN_FRICTION_EXPONENT)
    return factor[:, None] * surface_velocity_F3


# ---------------------------------------------------------------------------------------------
# the body family

def _uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(rng.uniform(low, high))


@dataclass(frozen=True)
class CarBody:
    """A car-like closed body (module docstring); lengths in metres, ``x`` from the nose."""

    length: float
    width: float
    roof_height: float
    ground_clearance: float
    nose_length: float          # length over which the nose closes elliptically
    nose_height: float          # height of the nose tip
    hood_height: float          # at the windshield base
    windshield_start: float     # fraction of the length
    roof_end: float             # fraction of the length where the roof starts to fall
    tail_height: float          # top of the body at the tail
    tail_length: float          # fraction of the length over which the tail closes
    tail_bluntness: float       # closure exponent: 2 round, larger blunter
    tumblehome: float           # narrowing of the upper half
    top_squareness: float       # superellipse exponents of the section
    bottom_squareness: float
    yaw_deg: float              # flow angle in the ground plane

    @classmethod
    def sample(cls, rng: np.random.Generator) -> "CarBody":
        """Uniform draws over ranges around a mid-size car; ``rear`` in [0, 1] moves the
        rear from fastback (0) to squareback (1)."""
        length = _uniform(rng, 4.2, 4.9)
        roof = _uniform(rng, 1.30, 1.50)
        rear = _uniform(rng, 0.0, 1.0)
        tail_low = _uniform(rng, 0.85, 1.0)
        return cls(
            length=length, width=_uniform(rng, 1.70, 1.95), roof_height=roof,
            ground_clearance=_uniform(rng, 0.12, 0.20),
            nose_length=_uniform(rng, 0.30, 0.65), nose_height=_uniform(rng, 0.40, 0.55),
            hood_height=_uniform(rng, 0.85, 1.00), windshield_start=_uniform(rng, 0.28, 0.36),
            roof_end=0.60 + 0.25 * rear + _uniform(rng, -0.03, 0.03),
            tail_height=tail_low + (roof - 0.06 - tail_low) * rear,
            tail_length=0.16 - 0.05 * rear + _uniform(rng, -0.01, 0.01),
            tail_bluntness=2.0 + 1.0 * rear + _uniform(rng, 0.0, 0.2),
            tumblehome=_uniform(rng, 0.05, 0.20), top_squareness=_uniform(rng, 2.5, 3.5),
            bottom_squareness=_uniform(rng, 3.0, 4.0), yaw_deg=_uniform(rng, -10.0, 10.0))

    def free_stream(self, speed: float = FREE_STREAM_SPEED) -> np.ndarray:
        yaw = np.deg2rad(self.yaw_deg)
        return speed * np.array([np.cos(yaw), np.sin(yaw), 0.0])

    def _closure(self, xi: np.ndarray) -> np.ndarray:
        nose = min(self.nose_length / self.length, 0.3)
        closure = np.ones_like(xi)
        front = xi < nose
        closure[front] = np.sqrt(1.0 - (1.0 - xi[front] / nose) ** 2)
        back = xi > 1.0 - self.tail_length
        t = (xi[back] - (1.0 - self.tail_length)) / self.tail_length
        closure[back] = np.clip(1.0 - t ** 2, 0.0, None) ** (1.0 / self.tail_bluntness)
        return closure

    def profiles(self, xi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Half width, bottom and top heights at stations ``xi = x / length`` in [0, 1]."""
        ws, clear = self.windshield_start, self.ground_clearance
        fine = np.linspace(0.0, 1.0, PROFILE_SAMPLES)
        top = PchipInterpolator(
            [0.0, ws, ws + 0.15, self.roof_end, 1.0],
            [self.hood_height - 0.15, self.hood_height, self.roof_height,
             self.roof_height - 0.03, self.tail_height])(fine)
        bottom = PchipInterpolator([0.0, 0.15, 0.8, 1.0],
                                   [clear + 0.12, clear, clear, clear + 0.15])(fine)
        # round the windshield header and roof end: curvature radii a panel solve resolves
        width = PROFILE_SMOOTHING * (PROFILE_SAMPLES - 1)
        top = np.interp(xi, fine, gaussian_filter1d(top, width, mode="nearest"))
        bottom = np.interp(xi, fine, gaussian_filter1d(bottom, width, mode="nearest"))
        tip = self.nose_height + ((self.tail_height + clear + 0.15) / 2 - self.nose_height) * xi
        closure = self._closure(xi)
        plan = (1.0 - 0.15 * np.clip(1.0 - xi / 0.25, 0.0, None) ** 2
                - 0.08 * np.clip((xi - 0.75) / 0.25, 0.0, None) ** 2)
        return (0.5 * self.width * closure * plan, tip - (tip - bottom) * closure,
                tip + (top - tip) * closure)

    def section(self, xi: np.ndarray, phi: np.ndarray) -> np.ndarray:
        """Points ``[..., 3]`` at stations ``xi`` and angles ``phi`` (broadcast)."""
        half_width, bottom, top = self.profiles(xi)
        middle, half_height = (top + bottom) / 2, (top - bottom) / 2
        cos, sin = np.cos(phi), np.sin(phi)
        exponent = np.where(sin >= 0, 2.0 / self.top_squareness, 2.0 / self.bottom_squareness)
        across = np.sign(cos) * np.abs(cos) ** exponent * (1.0 - self.tumblehome
                                                          * np.clip(sin, 0.0, None) ** 2)
        up = np.sign(sin) * np.abs(sin) ** exponent
        x = self.length * np.broadcast_to(xi, np.broadcast_shapes(xi.shape, phi.shape))
        return np.stack(np.broadcast_arrays(x, half_width * across, middle + half_height * up),
                        axis=-1)


@dataclass
class BodyMesh:
    """A body's surface: ``points [P, 3]``, polygons as ``offsets``/``connectivity`` (for the
    file) and as ``polygons [F, 4]`` (triangles repeat a vertex; for the solver), and each
    cell's parameter-space centre ``uv [F, 2]`` = (u, phi) on the grid ``[n_u, n_phi]``."""

    points: np.ndarray
    offsets: np.ndarray
    connectivity: np.ndarray
    polygons: np.ndarray
    uv: np.ndarray
    n_u: int
    n_phi: int


def grid_size(n_cells: int) -> tuple[int, int]:
    """``(n_u, n_phi)`` with ``n_u * n_phi`` close to ``n_cells`` and ``n_phi ~ ASPECT n_u``
    (``n_phi`` even, so the mesh is symmetric about ``y = 0``)."""
    n_u = max(3, int(round(np.sqrt(n_cells / ASPECT))))
    n_phi = max(4, 2 * int(round(n_cells / (2 * n_u))))
    return n_u, n_phi


def station(u: np.ndarray) -> np.ndarray:
    """``xi(u) = (1 - b) u + b (1 - cos(pi u)) / 2``: stations clustered toward the ends."""
    return (1.0 - END_CLUSTERING) * u + END_CLUSTERING * (1.0 - np.cos(np.pi * u)) / 2.0


def body_mesh(body: CarBody, n_u: int, n_phi: int) -> BodyMesh:
    """Structured surface mesh of ``body``: stations ``xi = (1 - cos(pi u)) / 2`` at
    ``u = i / n_u`` (poles at ``i = 0, n_u``), ``phi = 2 pi j / n_phi``."""
    u = np.arange(n_u + 1) / n_u
    xi = station(u)
    phi = 2.0 * np.pi * np.arange(n_phi) / n_phi
    rings = body.section(xi[1:-1, None], phi[None, :]).reshape(-1, 3)
    poles = body.section(xi[[0, -1]], np.zeros(2))
    points = np.concatenate([poles[:1], rings, poles[1:]]).astype(np.float32)
    tail = len(points) - 1

    def ring(i, j):                       # point index of ring i (1 .. n_u - 1), angle j
        return 1 + (i - 1) * n_phi + j % n_phi

    j = np.arange(n_phi)
    nose = np.stack([np.zeros(n_phi, int), ring(1, j + 1), ring(1, j), ring(1, j)], axis=1)
    i, jj = np.meshgrid(np.arange(1, n_u - 1), j, indexing="ij")
    quads = np.stack([ring(i, jj), ring(i, jj + 1), ring(i + 1, jj + 1), ring(i + 1, jj)],
                     axis=-1).reshape(-1, 4)
    back = np.stack([np.full(n_phi, tail), ring(n_u - 1, j), ring(n_u - 1, j + 1),
                     ring(n_u - 1, j + 1)], axis=1)
    polygons = np.concatenate([nose, quads, back]).astype(np.int64)
    sizes = np.full(len(polygons), 4)
    sizes[:n_phi] = sizes[-n_phi:] = 3
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    keep = np.ones(polygons.shape, bool)
    keep[:n_phi, 3] = keep[-n_phi:, 3] = False
    u_mid = (u[:-1] + u[1:]) / 2
    phi_mid = 2.0 * np.pi * (np.arange(n_phi) + 0.5) / n_phi
    uv = np.stack(np.meshgrid(u_mid, phi_mid, indexing="ij"), axis=-1).reshape(-1, 2)
    return BodyMesh(points, offsets, polygons[keep], polygons, uv, n_u, n_phi)


# ---------------------------------------------------------------------------------------------
# one sample

@dataclass
class SurfaceFlow:
    """A body's mesh with ``cp [F]``, kinematic ``pressure [F]`` and ``wall_shear [F, 3]``
    (m^2/s^2), the ``run_length [F]`` (m) of the skin-friction law, and how it was solved
    (``solver_panels``, ``iterations``)."""

    mesh: BodyMesh
    cp: np.ndarray
    pressure: np.ndarray
    wall_shear: np.ndarray
    run_length: np.ndarray
    solver_panels: int
    iterations: int


def _solve_on_mesh(mesh: BodyMesh, free_stream: np.ndarray
                   ) -> tuple[SourcePanels, PanelSolution, np.ndarray]:
    """Panel solution on ``mesh`` and the run length of every cell from stagnation."""
    panels = SourcePanels.from_polygons(mesh.points, mesh.polygons)
    solution = solve_source_panels(panels, free_stream)
    graph = cell_adjacency(mesh.offsets, mesh.connectivity, panels.centroids)
    return panels, solution, run_length_from_stagnation(graph, solution.cp, panels.normals,
                                                        free_stream)


def _coarse_to_fine(coarse: BodyMesh, values_F4: np.ndarray):
    """Bilinear interpolator in ``(u, phi)`` of per-cell values on the coarse grid (periodic
    in ``phi``: one wrapped column per side; ``u`` clipped to the coarse cell centres)."""
    grid = values_F4.reshape(coarse.n_u, coarse.n_phi, -1)
    uv = coarse.uv.reshape(coarse.n_u, coarse.n_phi, 2)
    u_c, phi_c = uv[:, 0, 0], uv[0, :, 1]
    step = 2.0 * np.pi / coarse.n_phi
    phi_ext = np.concatenate([[phi_c[0] - step], phi_c, [phi_c[-1] + step]])
    interpolate = RegularGridInterpolator(
        (u_c, phi_ext), np.concatenate([grid[:, -1:], grid, grid[:, :1]], axis=1))
    return lambda uv_Q2: interpolate(np.stack([np.clip(uv_Q2[:, 0], u_c[0], u_c[-1]),
                                               uv_Q2[:, 1]], axis=1))


def solve_surface_flow(body: CarBody, n_cells: int, *, speed: float = FREE_STREAM_SPEED,
                       max_solver_panels: int = MAX_SOLVER_PANELS) -> SurfaceFlow:
    """Pressure and wall shear on ``body`` meshed with about ``n_cells`` cells (module
    docstring; above ``max_solver_panels`` cells, a coarse solve interpolated)."""
    mesh = body_mesh(body, *grid_size(n_cells))
    free_stream = body.free_stream(speed)
    n_fine = len(mesh.polygons)
    if n_fine <= max_solver_panels:
        _, solution, run_length = _solve_on_mesh(mesh, free_stream)
        return SurfaceFlow(mesh, solution.cp, 0.5 * speed ** 2 * solution.cp,
                           wall_shear_stress(solution.surface_velocity, run_length), run_length,
                           n_fine, solution.iterations)
    coarse = body_mesh(body, *grid_size(max_solver_panels))
    _, solution, run_length = _solve_on_mesh(coarse, free_stream)
    interpolate = _coarse_to_fine(coarse, np.c_[solution.velocity, run_length])
    cp, wall_shear, fine_run = np.empty(n_fine), np.empty((n_fine, 3)), np.empty(n_fine)
    for start in range(0, n_fine, INTERPOLATION_CHUNK):       # bounded memory at 10M cells
        stop = min(start + INTERPOLATION_CHUNK, n_fine)
        fine = interpolate(mesh.uv[start:stop])
        _, normals, _ = polygon_centres_and_normals(mesh.points, mesh.offsets,
                                                    mesh.connectivity, start, stop)
        tangential = fine[:, :3] - np.einsum("fc,fc->f", fine[:, :3], normals)[:, None] * normals
        cp[start:stop] = 1.0 - (tangential ** 2).sum(axis=1) / speed ** 2
        wall_shear[start:stop] = wall_shear_stress(tangential, fine[:, 3])
        fine_run[start:stop] = fine[:, 3]
    return SurfaceFlow(mesh, cp, 0.5 * speed ** 2 * cp, wall_shear, fine_run,
                       len(coarse.polygons), solution.iterations)


def surface_flow_sample(seed: int, split: int, index: int, n_cells: int,
                        **options) -> tuple[CarBody, SurfaceFlow]:
    """Sample ``index`` of ``split``, drawn from its own stream ``default_rng([seed, split,
    index])`` (so the test runs do not depend on the number of training runs)."""
    body = CarBody.sample(np.random.default_rng([seed, split, index]))
    return body, solve_surface_flow(body, n_cells, **options)


VTP_CELL_BYTES = 50
"""The least bytes of a written surface per cell (about 68 measured: points, polygons,
pressure and wall shear)."""


def make_surface_flow(out: str | Path, *, n_train: int = 16, n_test: int = 4,
                      resolution: int | None = None, seed: int = 0, progress: bool = True,
                      overwrite: bool = False,
                      max_solver_panels: int = MAX_SOLVER_PANELS) -> list[Path]:
    """Write ``run_<i>/boundary_<i>.vtp`` for ``n_train + n_test`` bodies of about
    ``resolution`` cells each (default 5000), and ``split.json``; returns the paths. Each
    file is written under a temporary name and renamed; the split file comes last."""
    n_cells = 5000 if resolution is None else int(resolution)
    if n_cells < 64:
        raise ValueError(f"surface-flow needs at least 64 cells per surface, got {n_cells}")
    check_counts("surface-flow", n_train, n_test, seed)
    require_vtk()
    out = Path(out)
    check_disk_room(out, n_train + n_test, VTP_CELL_BYTES * n_cells, "surface-flow")
    jobs = ([(TRAIN_SPLIT, i) for i in range(n_train)]
            + [(TEST_SPLIT, i) for i in range(n_test)])
    runs = [f"run_{k + 1}" for k in range(len(jobs))]
    paths = [out / run / f"boundary_{run[4:]}.vtp" for run in runs]
    refuse_existing(paths + [out / SPLIT_FILE], overwrite)
    for k, (split, index) in enumerate(tqdm(jobs, desc="surface-flow", unit="run",
                                            disable=not progress)):
        path = paths[k]
        body, flow = surface_flow_sample(seed, split, index, n_cells,
                                         max_solver_panels=max_solver_panels)
        surface = SurfacePolygons(flow.mesh.points, flow.mesh.offsets, flow.mesh.connectivity,
                                  {PRESSURE_ARRAY: flow.pressure.astype(np.float32),
                                   WALL_SHEAR_ARRAY: flow.wall_shear.astype(np.float32)})
        write_vtp(path, surface, field_data={
            "generator": "flarepp surface-flow", "seed": seed, "split": split, "index": index,
            "body": asdict(body), "free_stream": body.free_stream().tolist(),
            "solver_panels": flow.solver_panels, "kinematic_viscosity": KINEMATIC_VISCOSITY})
    split_doc = {"description": f"flarepp surface-flow runs, seed {seed}",
                 "train": runs[:n_train], "val": [], "test": runs[n_train:]}
    write_atomically({out / SPLIT_FILE: lambda h: h.write(json.dumps(split_doc, indent=1)
                                                          .encode())})
    return paths + [out / SPLIT_FILE]
