"""Car-surface pictures like the paper's Figures 13-14, rendered without a display.

One figure per quantity, the kinematic surface pressure ``p_s = p / rho`` and the kinematic
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
import numpy as np  # noqa: E402
from matplotlib.colors import Normalize  # noqa: E402

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


def vtk_window_class() -> str | None:
    """Name of a VTK render-window class that renders off-screen here, or None: each
    candidate is tried in a child process (X only when ``DISPLAY`` is set, then EGL, then
    OSMesa)."""
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


def resolve_backend(backend: str = "auto") -> tuple[str, str | None]:
    """``(backend, vtk window class)``; ``"vtk"`` raises when VTK cannot render here."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known backends: {', '.join(BACKENDS)}")
    if backend == "matplotlib":
        return "matplotlib", None
    window = vtk_window_class()
    if window is not None:
        return "vtk", window
    message = ("VTK cannot render off-screen here (no vtk package, or no EGL/OSMesa: "
               "pip install 'flarepp[surface]'; apt-get install libegl1 libegl-mesa0 or "
               "libosmesa6)")
    if backend == "vtk":
        raise RuntimeError(message)
    warnings.warn(f"{message}; falling back to matplotlib", RuntimeWarning, stacklevel=2)
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


class _VTKRenderer:
    """Renders one surface under a fixed camera, once per coloured panel."""

    def __init__(self, surface: SurfacePolygons, window_class: str, size=PANEL_SIZE):
        from vtkmodules import vtkRenderingOpenGL2 as gl
        from vtkmodules.util.numpy_support import numpy_to_vtk, vtk_to_numpy
        from vtkmodules.vtkCommonCore import vtkLookupTable, vtkPoints
        from vtkmodules.vtkCommonDataModel import vtkCellArray, vtkPolyData
        from vtkmodules.vtkRenderingCore import (vtkActor, vtkLight, vtkPolyDataMapper,
                                                 vtkRenderer, vtkWindowToImageFilter)
        self._numpy_to_vtk, self._vtk_to_numpy = numpy_to_vtk, vtk_to_numpy
        self.polydata = vtkPolyData()
        points = vtkPoints()
        points.SetData(numpy_to_vtk(np.ascontiguousarray(surface.points), deep=True))
        self.polydata.SetPoints(points)
        cells = vtkCellArray()
        cells.SetData(numpy_to_vtk(surface.offsets.astype(np.int64), deep=True),
                      numpy_to_vtk(surface.connectivity.astype(np.int64), deep=True))
        self.polydata.SetPolys(cells)
        self.lut = vtkLookupTable()
        self.mapper = vtkPolyDataMapper()
        self.mapper.SetInputData(self.polydata)
        self.mapper.SetScalarModeToUseCellData()
        self.mapper.SetLookupTable(self.lut)
        self.mapper.UseLookupTableScalarRangeOn()
        actor = vtkActor()
        actor.SetMapper(self.mapper)
        prop = actor.GetProperty()
        prop.SetInterpolationToFlat()
        prop.SetAmbient(AMBIENT)
        prop.SetDiffuse(DIFFUSE)
        prop.SetSpecular(0.0)
        self.renderer = vtkRenderer()
        self.renderer.AddActor(actor)
        self.renderer.SetBackground(1.0, 1.0, 1.0)
        self.renderer.TwoSidedLightingOn()
        self.renderer.AutomaticLightCreationOff()
        light = vtkLight()
        light.SetLightTypeToCameraLight()
        light.SetPosition(0.3, 0.6, 1.0)        # fixed relative to the camera
        light.SetFocalPoint(0.0, 0.0, 0.0)
        self.renderer.AddLight(light)
        self.window = getattr(gl, window_class)()
        self.window.SetOffScreenRendering(1)
        self.window.AddRenderer(self.renderer)
        self.window.SetSize(*size)
        focal, towards, up, _, half_w, half_h = _camera_frame(surface.points)
        camera = self.renderer.GetActiveCamera()
        camera.ParallelProjectionOn()
        camera.SetFocalPoint(*focal)
        camera.SetPosition(*(focal + 10.0 * max(half_w, half_h) * towards))
        camera.SetViewUp(*up)
        camera.SetParallelScale(1.04 * max(half_h, half_w * size[1] / size[0]))
        self.renderer.ResetCameraClippingRange()
        self._grab = vtkWindowToImageFilter
        self.diagonal = float(np.linalg.norm(np.ptp(surface.points, axis=0)))
        self.rendered = False
        self.size = size

    def visible_cells(self, centres_N3: np.ndarray) -> np.ndarray:
        """Boolean ``[N]``: the cell centre passes the z-buffer test of the view (the depth
        does not depend on the colours: any earlier render serves, else one is made)."""
        from vtkmodules.vtkCommonCore import vtkIdTypeArray, vtkPoints
        from vtkmodules.vtkCommonDataModel import vtkPolyData
        from vtkmodules.vtkRenderingCore import vtkSelectVisiblePoints
        if not self.rendered:
            self.render(np.zeros(self.polydata.GetNumberOfCells()), "viridis", (0.0, 1.0))
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
        self.polydata.GetCellData().SetScalars(scalars)
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
    from flarepp.plots import Panel, Series, plot_curves, weight_series
    return plot_curves(run_dir, [Panel("normalised MSE x 100 [%]", (
        Series("train_loss", "training loss (cell subsets, live weights)"),
        *weight_series("test_nmse", "test, every cell")))])
