"""Pictures on meshes, rendered without a display: car surfaces like the paper's Figures
13-14, and any sample's fields on its own mesh.

**Fields on a mesh** (:func:`plot_mesh_fields`; ``flarepp infer --write-mesh`` and a fields
run's case figures, :func:`plot_cases`, draw through it): a row per channel of reference,
prediction and signed error in % of the reference RMS (the panels of
:func:`flarepp.plots.field_panel_specs`), on what the mesh is (:func:`mesh_kind`): a planar
mesh by its own cells (matplotlib), a surface as its polygons and a volume mesh as a
cut-away of its boundary (:func:`mesh_surface`: the octant facing the camera clipped off,
so the inside shows on three cut planes), both rendered off-screen by VTK with more ambient
light than the cars (a face's colour reads as its value), a point cloud by its points.

**Car surfaces**: one figure per quantity, the kinematic surface pressure ``p_s = p / rho`` and the kinematic
wall-shear magnitude ``tau = |tau_w| / rho`` (m^2/s^2): top row the reference and each model's
prediction, bottom row the magnitude of each model's pointwise error in percent of the
reference's RMS over the cells visible from the camera (so the RMS of an error panel over the
visible cells is that case's relative L2 error in percent). Following the paper's rendering
conventions (Appendix E): a fixed camera with parallel projection and fixed lighting, field
limits at the 0.5th and 99.5th percentiles of the reference over the visible cells, one error
scale shared by the models with limit the 99.5th percentile of the larger error, labelled
colour bars. The case is chosen as the paper does for Figure 13: the median by error of the
first ``subset`` (10) test cases.

Two renderers, chosen by ``backend``:

* ``"vtk"``: the surface's polygons rendered off-screen by VTK (``flarepp[surface]``); on a
  machine without a display this needs EGL or OSMesa (Mesa's ``libegl1``/``libegl-mesa0`` or
  ``libosmesa6`` on Debian). Visible cells: cell centres that pass VTK's z-buffer test
  (``vtkSelectVisiblePoints``).
* ``"matplotlib"``: flat-shaded ``Poly3DCollection`` (always headless); visible cells are
  those facing the camera, and above ``max_cells`` cells a random subset of them is drawn.

``"auto"`` uses VTK when a test render in a child process succeeds (a missing OpenGL library
may abort a process, so it is not tried in this one), else matplotlib, and says so.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.tri as mtri  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import Normalize  # noqa: E402

from flarepp.data.meshes import cell_arrays, cell_type_dimension, read_mesh  # noqa: E402
from flarepp.plots import (ERROR_LABEL, FlatMesh, Panel, Series, channel_label,  # noqa: E402
                           field_panel_specs, field_panels, plot_curves, plot_fields,
                           weight_series)
from flarepp.storage.rundir import RunDir  # noqa: E402
from flarepp.data.drivaerml import (CHUNK_CELLS, SurfacePolygons,  # noqa: E402
                                    polygon_centres_and_normals, read_vtp)

BACKENDS = ("auto", "vtk", "matplotlib")
VIEW_DIRECTION = np.array([-1.0, -1.35, 0.8])   # camera side of the body: front left, above
VIEW_UP = np.array([0.0, 0.0, 1.0])
PANEL_SIZE = (960, 520)                         # pixels of one rendered panel
FIELD_PERCENTILES = (0.5, 99.5)
ERROR_PERCENTILE = 99.5
FIELD_CMAP, ERROR_CMAP, NO_DATA_GREY = "viridis", "YlOrRd", (0.6, 0.6, 0.6)
AMBIENT, DIFFUSE = 0.35, 0.65
VISIBILITY_TOLERANCE = 0.002                    # z-buffer depth slack, x the body's diagonal


@dataclass(frozen=True)
class Quantity:
    """A scalar shown on the surface, computed from the 4 channels (p_s, tau_x, tau_y, tau_z)."""

    file_name: str
    label: str
    of_fields: Callable[[np.ndarray], np.ndarray]


QUANTITIES = {
    "pressure": Quantity("surface_pressure", r"$p_s = p/\rho$ [m$^2$/s$^2$]",
                         lambda f_N4: np.asarray(f_N4[:, 0], np.float64)),
    "wall_shear": Quantity("surface_wall_shear", r"$\tau = |\tau_w|/\rho$ [m$^2$/s$^2$]",
                           lambda f_N4: np.linalg.norm(np.asarray(f_N4[:, 1:4], np.float64),
                                                       axis=1)),
}


# ---------------------------------------------------------------------------------------------
# choosing the case

def median_case(case_errors: Sequence[float], subset: int = 10) -> int:
    """Index of the median-error case among the first ``subset`` cases (the lower median for
    an even count, so it is a real case), as the paper picks Figure 13's case."""
    errors = np.asarray(case_errors, np.float64)[:subset]
    if errors.size == 0:
        raise ValueError("no cases to choose from")
    order = np.argsort(errors, kind="stable")
    return int(order[(len(order) - 1) // 2])


def case_relative_l2(pred_NK: np.ndarray, true_NK: np.ndarray) -> float:
    """``||pred - true|| / ||true||`` of one case over all cells and channels (float64);
    the argument order of :func:`flarepp.tasks.fields.relative_l2`."""
    true = np.asarray(true_NK, np.float64)
    return float(np.linalg.norm(np.asarray(pred_NK, np.float64) - true)
                 / max(np.linalg.norm(true), 1e-300))


# ---------------------------------------------------------------------------------------------
# renderers

_PROBE = r"""
import sys
import numpy as np
from vtkmodules import vtkRenderingOpenGL2 as gl
from vtkmodules.vtkFiltersSources import vtkSphereSource
from vtkmodules.vtkRenderingCore import (vtkActor, vtkPolyDataMapper, vtkRenderer,
                                         vtkWindowToImageFilter)
from vtkmodules.util.numpy_support import vtk_to_numpy
window = getattr(gl, sys.argv[1])()
source = vtkSphereSource()
mapper = vtkPolyDataMapper(); mapper.SetInputConnection(source.GetOutputPort())
actor = vtkActor(); actor.SetMapper(mapper)
renderer = vtkRenderer(); renderer.AddActor(actor); renderer.SetBackground(1, 1, 1)
window.SetOffScreenRendering(1); window.AddRenderer(renderer); window.SetSize(64, 64)
window.Render()
grab = vtkWindowToImageFilter(); grab.SetInput(window); grab.Update()
image = vtk_to_numpy(grab.GetOutput().GetPointData().GetScalars())
sys.exit(0 if (image < 250).any() else 3)
"""


@functools.lru_cache(maxsize=1)
def vtk_window_class() -> str | None:
    """Name of a VTK render-window class that renders off-screen here, or None: each
    candidate is tried in a child process (X only when ``DISPLAY`` is set, then EGL, then
    OSMesa), once per process."""
    try:
        import vtkmodules.vtkRenderingOpenGL2  # noqa: F401
    except ModuleNotFoundError:
        return None
    candidates = (["vtkXOpenGLRenderWindow"] if os.environ.get("DISPLAY") else []) + [
        "vtkEGLRenderWindow", "vtkOSOpenGLRenderWindow"]
    for name in candidates:
        try:
            done = subprocess.run([sys.executable, "-c", _PROBE, name], capture_output=True,
                                  timeout=120)
        except subprocess.TimeoutExpired:
            continue
        if done.returncode == 0:
            return name
    return None


VTK_RENDER_HINT = ("VTK cannot render off-screen here (no vtk package, or no EGL/OSMesa: "
                   "pip install 'flarepp[surface]'; apt-get install libegl1 libegl-mesa0 or "
                   "libosmesa6)")


def resolve_backend(backend: str = "auto") -> tuple[str, str | None]:
    """``(backend, vtk window class)``; ``"vtk"`` raises when VTK cannot render here."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known backends: {', '.join(BACKENDS)}")
    if backend == "matplotlib":
        return "matplotlib", None
    window = vtk_window_class()
    if window is not None:
        return "vtk", window
    if backend == "vtk":
        raise RuntimeError(VTK_RENDER_HINT)
    warnings.warn(f"{VTK_RENDER_HINT}; falling back to matplotlib", RuntimeWarning, stacklevel=2)
    return "matplotlib", None


def _camera_frame(points_P3: np.ndarray):
    """Focal point, unit view direction (towards the camera), up and right vectors, and the
    half extents of the body across the screen."""
    lo, hi = points_P3.min(axis=0), points_P3.max(axis=0)
    focal = (lo + hi) / 2
    towards = VIEW_DIRECTION / np.linalg.norm(VIEW_DIRECTION)
    right = np.cross(VIEW_UP, towards)
    right /= np.linalg.norm(right)
    up = np.cross(towards, right)
    corners = np.array([[x, y, z] for x in (lo[0], hi[0]) for y in (lo[1], hi[1])
                        for z in (lo[2], hi[2])]) - focal
    return focal, towards, up, right, np.abs(corners @ right).max(), np.abs(corners @ up).max()


def _lit_renderer(actor):
    """A white-background ``vtkRenderer`` of ``actor``, lit from both sides by one light
    fixed relative to the camera (the same shading from any view)."""
    from vtkmodules.vtkRenderingCore import vtkLight, vtkRenderer
    renderer = vtkRenderer()
    renderer.AddActor(actor)
    renderer.SetBackground(1.0, 1.0, 1.0)
    renderer.TwoSidedLightingOn()
    renderer.AutomaticLightCreationOff()
    light = vtkLight()
    light.SetLightTypeToCameraLight()
    light.SetPosition(0.3, 0.6, 1.0)        # fixed relative to the camera
    light.SetFocalPoint(0.0, 0.0, 0.0)
    renderer.AddLight(light)
    return renderer


class _VTKRenderer:
    """Renders one surface under a fixed camera, once per coloured panel, coloured by
    values at its cells or (``association="point"``) at its points."""

    def __init__(self, surface: SurfacePolygons, window_class: str, size=PANEL_SIZE, *,
                 association: str = "cell", lighting: tuple[float, float] = (AMBIENT, DIFFUSE)):
        from vtkmodules import vtkRenderingOpenGL2 as gl
        from vtkmodules.util.numpy_support import numpy_to_vtk, vtk_to_numpy
        from vtkmodules.vtkCommonCore import vtkLookupTable
        from vtkmodules.vtkRenderingCore import (vtkActor, vtkPolyDataMapper,
                                                 vtkWindowToImageFilter)
        self._numpy_to_vtk, self._vtk_to_numpy = numpy_to_vtk, vtk_to_numpy
        self.polydata = self._surface_polydata(surface)
        self.lut = vtkLookupTable()
        self.mapper = vtkPolyDataMapper()
        self.mapper.SetInputData(self.polydata)
        self.association = association
        if association == "point":
            self.mapper.SetScalarModeToUsePointData()
            self.mapper.InterpolateScalarsBeforeMappingOn()
        else:
            self.mapper.SetScalarModeToUseCellData()
        self.mapper.SetLookupTable(self.lut)
        self.mapper.UseLookupTableScalarRangeOn()
        actor = vtkActor()
        actor.SetMapper(self.mapper)
        prop = actor.GetProperty()
        prop.SetInterpolationToFlat()
        prop.SetAmbient(lighting[0])
        prop.SetDiffuse(lighting[1])
        prop.SetSpecular(0.0)
        self.renderer = _lit_renderer(actor)
        self.window = getattr(gl, window_class)()
        self.window.SetOffScreenRendering(1)
        self.window.AddRenderer(self.renderer)
        self.window.SetSize(*size)
        self._aim_camera(surface.points, size)
        self._grab = vtkWindowToImageFilter
        self.diagonal = float(np.linalg.norm(np.ptp(surface.points, axis=0)))
        self.rendered = False
        self.size = size

    def _surface_polydata(self, surface: SurfacePolygons):
        """The surface's points and polygons as a ``vtkPolyData`` (copies of the arrays)."""
        from vtkmodules.vtkCommonCore import vtkPoints
        from vtkmodules.vtkCommonDataModel import vtkCellArray, vtkPolyData
        polydata = vtkPolyData()
        points = vtkPoints()
        points.SetData(self._numpy_to_vtk(np.ascontiguousarray(surface.points), deep=True))
        polydata.SetPoints(points)
        cells = vtkCellArray()
        cells.SetData(self._numpy_to_vtk(surface.offsets.astype(np.int64), deep=True),
                      self._numpy_to_vtk(surface.connectivity.astype(np.int64), deep=True))
        polydata.SetPolys(cells)
        return polydata

    def _aim_camera(self, points_P3: np.ndarray, size: tuple[int, int]) -> None:
        """A parallel projection along :data:`VIEW_DIRECTION` that frames the whole body in
        a panel of ``size`` pixels, with a small margin."""
        focal, towards, up, _, half_w, half_h = _camera_frame(points_P3)
        camera = self.renderer.GetActiveCamera()
        camera.ParallelProjectionOn()
        camera.SetFocalPoint(*focal)
        camera.SetPosition(*(focal + 10.0 * max(half_w, half_h) * towards))
        camera.SetViewUp(*up)
        camera.SetParallelScale(1.04 * max(half_h, half_w * size[1] / size[0]))
        self.renderer.ResetCameraClippingRange()

    def visible_cells(self, centres_N3: np.ndarray) -> np.ndarray:
        """Boolean ``[N]``: the cell centre passes the z-buffer test of the view (the depth
        does not depend on the colours: any earlier render serves, else one is made)."""
        from vtkmodules.vtkCommonCore import vtkIdTypeArray, vtkPoints
        from vtkmodules.vtkCommonDataModel import vtkPolyData
        from vtkmodules.vtkRenderingCore import vtkSelectVisiblePoints
        if not self.rendered:
            count = (self.polydata.GetNumberOfPoints() if self.association == "point"
                     else self.polydata.GetNumberOfCells())
            self.render(np.zeros(count), "viridis", (0.0, 1.0))
        cloud = vtkPolyData()
        points = vtkPoints()
        points.SetData(self._numpy_to_vtk(np.ascontiguousarray(centres_N3, np.float64),
                                          deep=True))
        cloud.SetPoints(points)
        ids = self._numpy_to_vtk(np.arange(len(centres_N3), dtype=np.int64), deep=True,
                                 array_type=vtkIdTypeArray().GetDataType())
        ids.SetName("cell_id")
        cloud.GetPointData().AddArray(ids)
        select = vtkSelectVisiblePoints()
        select.SetInputData(cloud)
        select.SetRenderer(self.renderer)
        select.SetTolerance(1e-4)
        select.SetToleranceWorld(VISIBILITY_TOLERANCE * self.diagonal)
        select.Update()
        visible = np.zeros(len(centres_N3), bool)
        kept = select.GetOutput().GetPointData().GetArray("cell_id")
        if kept is not None:
            visible[self._vtk_to_numpy(kept)] = True
        return visible

    def render(self, values_N: np.ndarray, cmap: str, limits: tuple[float, float]) -> np.ndarray:
        """RGB image ``[H, W, 3]`` of the surface coloured by ``values_N`` (NaN: grey)."""
        colours = plt.get_cmap(cmap)(np.linspace(0.0, 1.0, 256))
        self.lut.SetNumberOfTableValues(256)
        for i, rgba in enumerate(colours):
            self.lut.SetTableValue(i, *rgba)
        self.lut.SetRange(*limits)
        self.lut.SetNanColor(*NO_DATA_GREY, 1.0)
        scalars = self._numpy_to_vtk(np.ascontiguousarray(values_N, np.float64), deep=True)
        scalars.SetName("shown")
        (self.polydata.GetPointData() if self.association == "point"
         else self.polydata.GetCellData()).SetScalars(scalars)
        self.polydata.Modified()
        self.window.Render()
        self.rendered = True
        grab = self._grab()
        grab.SetInput(self.window)
        grab.ReadFrontBufferOff()
        grab.Update()
        image = self._vtk_to_numpy(grab.GetOutput().GetPointData().GetScalars())
        width, height = self.size
        return image.reshape(height, width, -1)[::-1, :, :3].copy()


class _MatplotlibRenderer:
    """Flat-shaded polygons in a matplotlib 3-D axis with an orthographic camera."""

    def __init__(self, surface: SurfacePolygons, centres_N3, normals_N3, areas_N,
                 max_cells: int, seed: int = 0):
        _, towards, _, _, _, _ = _camera_frame(surface.points)
        self.towards = towards
        # orientation of the stored normals: outward when the enclosed volume is positive
        signed_volume = float(np.einsum("nc,nc->", centres_N3, normals_N3 * areas_N[:, None]))
        self.facing = (normals_N3 @ towards) * np.sign(signed_volume or 1.0) > 0
        drawn = np.flatnonzero(self.facing)
        if len(drawn) > max_cells:
            drawn = np.sort(np.random.default_rng(seed).choice(drawn, max_cells, replace=False))
        self.drawn = drawn
        sizes = np.diff(surface.offsets)[drawn]
        self.polygons = [surface.points[surface.connectivity[s:s + k]]
                         for s, k in zip(surface.offsets[drawn], sizes)]
        light = towards + 0.4 * VIEW_UP
        light /= np.linalg.norm(light)
        self.shade = AMBIENT + DIFFUSE * np.abs(normals_N3[drawn] @ light)
        self.limits = np.stack([surface.points.min(0), surface.points.max(0)])

    def visible_cells(self, centres_N3: np.ndarray) -> np.ndarray:
        return self.facing

    def render(self, values_N: np.ndarray, cmap: str, limits: tuple[float, float]) -> np.ndarray:
        from mpl_toolkits.mplot3d.art3d import Poly3DCollection
        values = np.asarray(values_N, np.float64)[self.drawn]
        rgb = plt.get_cmap(cmap)(Normalize(*limits, clip=True)(values))[:, :3]
        rgb[~np.isfinite(values)] = NO_DATA_GREY
        rgb = np.clip(rgb * self.shade[:, None], 0.0, 1.0)
        width, height = PANEL_SIZE
        fig = plt.figure(figsize=(width / 100, height / 100), dpi=100)
        ax = fig.add_axes([0, 0, 1, 1], projection="3d", proj_type="ortho")
        ax.add_collection3d(Poly3DCollection(self.polygons, facecolors=rgb, edgecolors=rgb,
                                             linewidths=0.3))
        for setter, low, high in zip((ax.set_xlim, ax.set_ylim, ax.set_zlim), *self.limits):
            setter(low, high)
        ax.set_box_aspect(np.ptp(self.limits, axis=0), zoom=0.95)    # equal scale on all axes
        ax.view_init(elev=np.degrees(np.arcsin(self.towards[2])),
                     azim=np.degrees(np.arctan2(self.towards[1], self.towards[0])))
        ax.set_axis_off()
        fig.canvas.draw()
        image = np.asarray(fig.canvas.buffer_rgba())[:, :, :3].copy()
        plt.close(fig)
        return image


# ---------------------------------------------------------------------------------------------
# the figures

def _as_polygons(surface) -> SurfacePolygons:
    if isinstance(surface, SurfacePolygons):
        return surface
    if isinstance(surface, (str, Path)):
        return read_vtp(surface, arrays=[])
    points, faces = surface
    faces = np.asarray(faces)
    return SurfacePolygons(np.asarray(points), np.arange(0, faces.size + 1, faces.shape[1]),
                           faces.reshape(-1).astype(np.int64), {})


def _cell_geometry(polygons: SurfacePolygons) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Centres, normals and areas of every cell, a bounded number of cells at a time."""
    n = polygons.n_cells
    parts = [polygon_centres_and_normals(polygons.points, polygons.offsets,
                                         polygons.connectivity, start, min(start + CHUNK_CELLS, n))
             for start in range(0, n, CHUNK_CELLS)]
    return tuple(np.concatenate(arrays) for arrays in zip(*parts))


def plot_surface_case(surface, truth_N4: np.ndarray, predictions: Mapping[str, np.ndarray],
                      out_dir: str | Path, *, case_name: str = "",
                      quantities: Sequence[str] = ("pressure", "wall_shear"),
                      backend: str = "auto", max_cells: int = 150_000) -> list[Path]:
    """Write one PNG per quantity for one case; returns the paths.

    ``surface``: a ``.vtp`` path, a ``SurfacePolygons`` or ``(points [P, 3], faces [N, K])``;
    ``truth_N4`` and each ``predictions[name]`` hold (p_s, tau_x, tau_y, tau_z) per cell.
    """
    polygons = _as_polygons(surface)
    n = polygons.n_cells
    truth_N4 = np.asarray(truth_N4)
    for name, values in [("truth", truth_N4), *predictions.items()]:
        if np.shape(values) != (n, 4):
            raise ValueError(f"{name}: expected [{n}, 4] values for the {n} cells, got "
                             f"{list(np.shape(values))}")
    backend, window = resolve_backend(backend)
    centres, normals, areas = _cell_geometry(polygons)
    renderer = (_VTKRenderer(polygons, window) if backend == "vtk"
                else _MatplotlibRenderer(polygons, centres, normals, areas, max_cells))
    visible = renderer.visible_cells(centres)     # the camera is fixed: one test for all panels
    if not visible.any():
        raise RuntimeError(f"no cell of {case_name or 'the surface'} is visible from the camera")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key in quantities:
        quantity = QUANTITIES[key]
        reference = quantity.of_fields(truth_N4)
        rms = float(np.sqrt(np.mean(reference[visible] ** 2)))
        errors = {name: 100.0 * np.abs(quantity.of_fields(np.asarray(p)) - reference)
                  / max(rms, 1e-300) for name, p in predictions.items()}
        field_limits = tuple(np.percentile(reference[visible], FIELD_PERCENTILES))
        error_limit = max([float(np.percentile(e[visible], ERROR_PERCENTILE))
                           for e in errors.values()] + [1e-12])
        top = [("reference", renderer.render(reference, FIELD_CMAP, field_limits))]
        top += [(name, renderer.render(quantity.of_fields(np.asarray(p)), FIELD_CMAP,
                                       field_limits)) for name, p in predictions.items()]
        bottom = [(f"{name}: |error|, RMS {np.sqrt(np.mean(e[visible] ** 2)):.2f}%",
                   renderer.render(e, ERROR_CMAP, (0.0, error_limit)))
                  for name, e in errors.items()]
        path = RunDir(out_dir).figure(f"{quantity.file_name}"
                                      f"{'_' + case_name if case_name else ''}")
        _compose(path, top, bottom, quantity.label, field_limits, error_limit,
                 f"{case_name}  ({backend}, {int(visible.sum())} of {n} cells visible)")
        paths.append(path)
    return paths


def _crop(images: list[np.ndarray], margin: int = 8) -> list[np.ndarray]:
    """Crop every image to the union of their non-white pixels (same box for all panels)."""
    ink = np.zeros(images[0].shape[:2], bool)
    for image in images:
        ink |= (image < 250).any(axis=-1)
    if not ink.any():
        return images
    rows, cols = np.flatnonzero(ink.any(axis=1)), np.flatnonzero(ink.any(axis=0))
    r0, r1 = max(rows[0] - margin, 0), rows[-1] + margin + 1
    c0, c1 = max(cols[0] - margin, 0), cols[-1] + margin + 1
    return [image[r0:r1, c0:c1] for image in images]


def _compose(path: Path, top, bottom, label: str, field_limits, error_limit: float,
             caption: str) -> None:
    columns = len(top)
    images = _crop([image for _, image in top] + [image for _, image in bottom])
    height, width = images[0].shape[:2]
    panel_width = 4.0
    fig, axes = plt.subplots(2, columns, squeeze=False, layout="constrained",
                             figsize=(panel_width * columns + 1.0,
                                      2 * (panel_width * height / width + 0.35) + 0.3))
    for ax, (title, _), image in zip(axes[0], top, images):
        ax.imshow(image)
        ax.set_title(title, fontsize=11)
    axes[1, 0].text(0.5, 0.5, "|prediction - reference|\nin % of the reference RMS\n"
                    "over the visible cells", ha="center", va="center", fontsize=9,
                    color="0.3", transform=axes[1, 0].transAxes)
    for ax, (title, _), image in zip(axes[1, 1:], bottom, images[columns:]):
        ax.imshow(image)
        ax.set_title(title, fontsize=10)
    for ax in axes.flat:
        ax.set_axis_off()
    fig.colorbar(plt.cm.ScalarMappable(Normalize(*field_limits), FIELD_CMAP), ax=axes[0],
                 shrink=0.85, label=label)
    fig.colorbar(plt.cm.ScalarMappable(Normalize(0.0, error_limit), ERROR_CMAP), ax=axes[1],
                 shrink=0.85, label="|error| [% of RMS]")
    fig.suptitle(caption, fontsize=9, color="0.35")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_surface_cases(surfaces: Sequence, truths: Sequence[np.ndarray],
                       predictions: Mapping[str, Sequence[np.ndarray]], out_dir: str | Path, *,
                       case_names: Sequence[str] | None = None, subset: int = 10,
                       case_errors: Sequence[float] | None = None, select_by: str | None = None,
                       backend: str = "auto", **options) -> list[Path]:
    """Pictures of the median-error case of the first ``subset`` cases (paper, Figure 13).

    ``surfaces[i]``, ``truths[i]`` and ``predictions[name][i]`` describe case ``i`` (lazy
    sequences such as memory-mapped arrays are fine: only the chosen case is read in full).
    The error ranking uses ``case_errors`` when given (e.g. the task's metric per case), else
    the relative L2 error over the 4 channels of model ``select_by`` (default: the last).
    """
    if not predictions:
        raise ValueError("no predictions to plot")
    n_cases = len(truths)
    names = list(case_names) if case_names is not None else [f"case_{i}" for i in
                                                             range(n_cases)]
    if case_errors is None:
        model = select_by if select_by is not None else list(predictions)[-1]
        if model not in predictions:
            raise ValueError(f"select_by {model!r} is not one of {list(predictions)}")
        case_errors = [case_relative_l2(predictions[model][i], truths[i])
                       for i in range(min(subset, n_cases))]
    chosen = median_case(case_errors, subset)
    return plot_surface_case(surfaces[chosen], truths[chosen],
                             {name: values[chosen] for name, values in predictions.items()},
                             out_dir, case_name=names[chosen], backend=backend, **options)


# ---------------------------------------------------------------------------------------------
# fields on a solver's mesh

MESH_LIGHTING = (0.65, 0.35)
"""Ambient and diffuse light of mesh pictures: more ambient than the cars', so a face's
colour stays readable as its field value whatever way it faces."""


def mesh_kind(mesh) -> str:
    """How a mesh is pictured: ``"points"`` (no cells of 2 or 3 dimensions: a point cloud),
    ``"flat"`` (2-D cells in a coordinate plane: drawn by matplotlib), ``"surface"`` (2-D
    cells in space) or ``"solid"`` (3-D cells: a cut-away of its boundary)."""
    dimension = max((cell_type_dimension(int(t)) for t in mesh.distinct_cell_types),
                    default=0)
    if dimension < 2:
        return "points"
    if dimension == 3:
        return "solid"
    extent = np.ptp(np.asarray(mesh.points), axis=0)
    return "flat" if (extent == 0).any() else "surface"


def _cut_away(mesh):
    """``mesh`` without the octant of its bounding box nearest the camera (clipped, not
    whole cells removed): the boundary shows on the far sides, the inside on the three cut
    planes."""
    lo, hi = np.asarray(mesh.bounds[0::2]), np.asarray(mesh.bounds[1::2])
    middle, margin = (lo + hi) / 2, np.ptp(np.stack([lo, hi]), axis=0) + 1.0
    near = np.sign(VIEW_DIRECTION)
    box = np.ravel([(middle[k], hi[k] + margin[k]) if near[k] > 0 else
                    (lo[k] - margin[k], middle[k]) for k in range(3)])
    return mesh.clip_box(box, invert=True, crinkle=False)


def mesh_surface(mesh, association: str, arrays: Mapping[str, np.ndarray]
                 ) -> tuple[SurfacePolygons, dict[str, np.ndarray]]:
    """The polygons a picture of ``mesh`` shows (its surface; of 3-D cells the boundary of
    :func:`_cut_away`) and each of ``arrays`` (``[P]`` or ``[C]`` at ``association``)
    carried onto them: cell values copied to the pieces of cut cells, point values
    interpolated at the cut."""
    shown = mesh.copy(deep=False)
    shown.clear_data()
    target = shown.point_data if association == "point" else shown.cell_data
    for name, values in arrays.items():
        target[name] = np.ascontiguousarray(values, np.float64)
    if mesh_kind(mesh) == "solid":
        shown = _cut_away(shown)
    surface = shown.extract_surface(algorithm="dataset_surface").triangulate()
    _, offsets, connectivity = cell_arrays(surface)
    polygons = SurfacePolygons(np.asarray(surface.points, np.float64), offsets,
                               connectivity, {})
    data = surface.point_data if association == "point" else surface.cell_data
    return polygons, {name: np.asarray(data[name]) for name in arrays}


def flat_mesh(mesh, association: str) -> FlatMesh:
    """The :class:`~flarepp.plots.FlatMesh` of a planar mesh: its polygons as fans of
    triangles in its two in-plane coordinates (cells of fewer than 3 points left out)."""
    _, offsets, connectivity = cell_arrays(mesh)
    sizes = np.diff(offsets)
    triangles, owner = [], []
    for k in np.unique(sizes[sizes >= 3]):
        cells = np.flatnonzero(sizes == k)
        fan = np.stack([np.zeros(k - 2, int), np.arange(1, k - 1), np.arange(2, k)], axis=1)
        triangles.append(connectivity[offsets[cells, None, None] + fan].reshape(-1, 3))
        owner.append(np.repeat(cells, k - 2))
    points = np.asarray(mesh.points, np.float64)
    plane = [k for k in range(3) if np.ptp(points[:, k]) > 0][:2]
    triangulation = mtri.Triangulation(points[:, plane[0]], points[:, plane[1]],
                                       np.concatenate(triangles))
    return FlatMesh(triangulation, np.concatenate(owner) if association == "cell" else None)


def plot_mesh_fields(path: str | Path, mesh, association: str, pred_NO: np.ndarray,
                     true_NO: np.ndarray | None, names: list[str], units: str, title: str,
                     *, backend: str = "auto") -> Path:
    """One picture of a sample's fields on its own mesh, a row per output channel (at most
    4): reference, prediction and signed error in % of the reference RMS
    (:func:`~flarepp.plots.field_panel_specs`), or the prediction alone. ``pred`` and
    ``true`` hold one row per point or cell of ``mesh`` (``association``). As
    :func:`mesh_kind` says: a planar mesh by its cells (matplotlib), a surface or a solid's
    cut-away rendered off-screen by VTK (:func:`mesh_surface`), a point cloud by its
    points; when VTK cannot render here (``backend="auto"``), the points, with a warning
    naming what to install. Written to ``path``."""
    kind = mesh_kind(mesh)
    rows = min(pred_NO.shape[1], 4)
    if kind == "flat":
        return plot_fields(path, None, pred_NO, true_NO, names, units, title,
                           flat=flat_mesh(mesh, association))
    window = None if kind == "points" else _mesh_window(backend)
    if window is None:
        centres = (np.asarray(mesh.points) if association == "point"
                   else np.asarray(mesh.cell_centers().points))
        return plot_fields(path, centres, pred_NO, true_NO, names, units, title)
    specs = [field_panel_specs(None if true_NO is None else true_NO[:, ch], pred_NO[:, ch])
             for ch in range(rows)]
    surface, shown = mesh_surface(mesh, association, {
        f"{ch}:{k}": values for ch, panels in enumerate(specs)
        for k, (values, _, _) in enumerate(panels)})
    renderer = _VTKRenderer(surface, window, association=association, lighting=MESH_LIGHTING)
    images = [[renderer.render(shown[f"{ch}:{k}"], kw["cmap"], (kw["vmin"], kw["vmax"]))
               for k, (_, _, kw) in enumerate(panels)] for ch, panels in enumerate(specs)]
    what = "cut-away of the volume" if kind == "solid" else "surface"
    return _compose_fields(Path(path), specs, images, [channel_label(names, ch, units)
                                                       for ch in range(rows)],
                           f"{title}\n({what}, {surface.n_cells:,} polygons drawn)")


def _mesh_window(backend: str) -> str | None:
    """The VTK window class a mesh picture renders with: None for ``"matplotlib"``, and
    for ``"auto"`` where VTK cannot render (with a warning naming what to install)."""
    if backend == "matplotlib":
        return None
    if backend == "vtk":
        return resolve_backend("vtk")[1]
    window = vtk_window_class()
    if window is None:
        warnings.warn(f"{VTK_RENDER_HINT}; the mesh picture shows its points, not its surface",
                      RuntimeWarning, stacklevel=3)
    return window


def _compose_fields(path: Path, specs, images, labels: list[str], caption: str) -> Path:
    """The rendered panels ``images[row][col]`` in one figure, each with its colour bar."""
    cropped = _crop([image for row in images for image in row])
    height, width = cropped[0].shape[:2]
    cols = max(len(row) for row in images)
    fig, axes = plt.subplots(len(images), cols, squeeze=False, layout="constrained",
                             figsize=(4.2 * cols + 0.8, len(images) * (4.2 * height / width
                                                                       + 0.5) + 0.5))
    panels = iter(cropped)
    for row, (panel_specs, label) in enumerate(zip(specs, labels)):
        for ax, (_, title, kw) in zip(axes[row], panel_specs):
            ax.imshow(next(panels))
            ax.set_title(title, fontsize=10)
            fig.colorbar(plt.cm.ScalarMappable(Normalize(kw["vmin"], kw["vmax"]), kw["cmap"]),
                         ax=ax, shrink=0.8,
                         label=ERROR_LABEL if title == "signed error" else label)
    for ax in axes.flat:
        ax.set_axis_off()
    fig.suptitle(caption, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# a fields run's figures

def plot_cases(pred_path: Path, out_dir: Path, cases: int = 3) -> list[Path]:
    """One figure per chosen test case (best, median, worst by relative L2) and channel,
    in the run directory ``out_dir`` (:meth:`RunDir.case_figure`): on the case's source
    mesh where the predictions name one that is still there (``sources``, e.g. a converted
    store's files: :func:`plot_mesh_fields`, the mesh read once per case),
    else on its points."""
    data = np.load(pred_path)
    pred, true, coords, rel = data["pred"], data["true"], data["coords"], data["rel_l2"]
    mask = data["mask"] if "mask" in data else None
    grid = data["grid_shape"] if "grid_shape" in data else None
    names = [str(n) for n in data["field_names"]]
    units = str(data["units"])
    sources = [str(s) for s in data["sources"]] if "sources" in data else None
    association = str(data["association"]) if "association" in data else "point"
    order = np.argsort(rel)
    picks = sorted({int(order[0]), int(order[len(order) // 2]), int(order[-1])})[:cases]
    written = []
    for case in picks:
        m = None if mask is None else mask[case]
        real = slice(None) if m is None else m
        title = f"test case {case}: relative L2 = {100 * rel[case]:.2f}%"
        mesh = None if sources is None else _case_mesh(sources[case], len(pred[case][real]),
                                                       association)
        for ch in range(true.shape[-1]):
            path = RunDir(out_dir).case_figure(case, ch)
            written.append(path)
            if mesh is not None:
                plot_mesh_fields(path, mesh, association, pred[case][real][:, ch:ch + 1],
                                 true[case][real][:, ch:ch + 1],
                                 names[ch:ch + 1] or [f"channel {ch}"], units, title)
                continue
            fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
            field_panels(fig, axes, true[case, :, ch], pred[case, :, ch], coords[case], grid,
                          m, channel_label(names, ch, units))
            fig.suptitle(title)
            fig.savefig(path, dpi=110)
            plt.close(fig)
    return written


def _case_mesh(source: str, rows: int, association: str):
    """The mesh file ``source`` a case's ``rows`` predictions are the points or cells of,
    read; None (with a warning saying so) when it is gone or no longer has that many."""
    if not source or not Path(source).is_file():
        if source:
            warnings.warn(f"{source}: the source mesh is gone; the case is drawn on its points",
                          RuntimeWarning, stacklevel=3)
        return None
    mesh = read_mesh(source)
    if (mesh.n_points if association == "point" else mesh.n_cells) != rows:
        warnings.warn(f"{source}: has not the {rows} {association}s predicted (changed after "
                      "conversion?); the case is drawn on its points", RuntimeWarning,
                      stacklevel=3)
        return None
    return mesh


def plot_field_run(run_dir: str | Path, panels: list[Panel], cases: int = 3) -> list[Path]:
    """The figures of a fields run: ``cases`` test cases (truth, prediction, error) and its
    training curves."""
    run = RunDir(run_dir)
    pred = run.predictions("test")
    if not pred.is_file():
        raise FileNotFoundError(f"{str(pred)!r} not found: is {str(run_dir)!r} a finished "
                                "flarepp run directory?")
    written = plot_cases(pred, run.path, cases)
    if run.has_log():
        written.append(plot_curves(run.path, panels))
    return written


# ---------------------------------------------------------------------------------------------
# a surface run's figures

CASE_FILE = RunDir.SURFACE_CASE
"""The case a finished surface run saved for Figures 13-14 (prediction and reference)."""



def model_label(config: dict[str, Any]) -> str:
    """``"flarepp, B=2, M=64"`` from a run's ``config.json``."""
    model = config.get("model", {})
    parts = [str(model.get("mixer", model.get("arch", "model")))]
    parts += [f"{k}={model[key]}" for k, key in (("B", "blocks"), ("M", "latents"))
              if key in model]
    return ", ".join(parts)


def plot_surface_run(run_dir: str | Path, *, backend: str = "auto") -> list[Path]:
    """Figures 13-14 of a finished surface run (reference, prediction and |error| in % of
    the reference RMS over the visible cells, for ``p_s`` and ``|tau_w|``), from its
    ``surface_case.npz`` and the case's ``.vtp``, and ``curves.png``."""
    run = RunDir(run_dir)
    path = run.file(CASE_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found: is {str(run_dir)!r} a finished "
                                "surface run?")
    with np.load(path) as case:
        pred, truth = case["pred"], case["truth"]
        car, source, nmse = str(case["run"]), Path(str(case["source"])), float(case["nmse"])
    if not source.is_file():
        raise FileNotFoundError(f"{str(source)!r}, the surface of the case in {str(path)!r}, "
                                "is gone: the figures draw its polygons")
    label = f"{model_label(run.read_config().to_dict())} ({nmse:.3g}%)"
    paths = plot_surface_case(source, truth, {label: pred}, run.path, case_name=car,
                              backend=backend)
    if run.has_log():
        paths.append(plot_surface_curves(run.path))
    return paths


def plot_surface_curves(run_dir: Path) -> Path:
    """``curves.png``: training loss (subsets, live weights) and the scored split's error
    (every cell, raw and EMA weights) against epoch, both 100 x MSE of standardised
    channels."""
    return plot_curves(run_dir, [Panel("normalised MSE x 100 [%]", (
        Series("train_loss", "training loss (cell subsets, live weights)"),
        *weight_series("test_nmse", "test, every cell")))])
