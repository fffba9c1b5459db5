"""Loaders for the public benchmark files and for a user's own data, registered in ``DATASETS``.

Each loader is ``load(root, **options) -> DatasetSplits``; ``root`` is a directory holding the
files (or one of the files). Splits, sub-sampling and layouts follow the Transolver / FLARE
setup (paper Section C.1, Table 6):

=============== ============================================= ================== ==========
name            files and keys                                split (defaults)   N, in/out
=============== ============================================= ================== ==========
elasticity      ``Random_UnitCell_sigma_10.npy`` [972, S],    first 1000 / last  972, 2 / 1
                ``Random_UnitCell_XY_10.npy`` [972, 2, S]     200
darcy           ``piececonst_r{R}_N{S}_smooth1.mat`` (train), first 1000 / first 7225, 3 / 1
                ``..._smooth2.mat`` (test); ``coeff``, ``sol`` 200, grid
                [S, R, R]; MATLAB v5 or v7.3                  subsampled to 85
airfoil         ``NACA_Cylinder_{X,Y}.npy`` [S, 221, 51],     0-999 / 1000-1199  11271, 2 / 1
                ``NACA_Cylinder_Q.npy`` [S, 5, 221, 51] (Mach
                = channel 4)
pipe            ``Pipe_{X,Y}.npy`` [S, 129, 129],             0-999 / 1000-1199  16641, 2 / 1
                ``Pipe_Q.npy`` [S, C, 129, 129] (u_x = ch. 0)
drivaerml-40k   ``{train,test}/run_<id>.npz`` with            all (387 / 97)     40000, 3 / 1
                ``surface_mesh_centers`` [n, 3],
                ``surface_fields`` [n, 4] (p/rho = col. 0)
npz             the user format (see ``load_npz``)            files or fraction  any
=============== ============================================= ================== ==========

Options common to the benchmarks: ``n_train`` and ``n_test`` (defaults: the paper's sizes);
a file with too few samples raises ``DataError``. Darcy's inputs are ``(x, y, a)`` with
``(x, y)`` the unit-square grid coordinates and ``a`` the permeability; the grid of side ``R``
is sub-sampled to ``resolution`` points per side with stride ``(R - 1) / (resolution - 1)``
(421 -> 85: stride 5), which must be an integer. Structured meshes set ``grid_shape``;
``coords`` are always the physical point positions.

Every missing file, missing key, wrong shape, sample-count mismatch or non-finite value raises
``DataError`` naming the file, the key and the expected shape.
"""

from __future__ import annotations

import functools
import inspect
import re
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from flarepp.data.base import DataError, DatasetSplits, MeshSamples
from flarepp.data.registry import DATASETS

ELASTICITY_SIGMA_FILE = "Random_UnitCell_sigma_10.npy"
ELASTICITY_XY_FILE = "Random_UnitCell_XY_10.npy"
ELASTICITY_POINTS = 972
DARCY_TRAIN_GLOB = "piececonst_r*_N*_smooth1.mat"
DARCY_TEST_GLOB = "piececonst_r*_N*_smooth2.mat"
AIRFOIL_GRID = (221, 51)
AIRFOIL_MACH_CHANNEL = 4
PIPE_GRID = (129, 129)
PIPE_VELOCITY_CHANNEL = 0
DRIVAER_DIR = "drivaerml_surface_presampled_40k"


def _register(name: str, doc: str) -> Callable:
    """Register ``fn(root, **options)`` under ``name``, turning unknown options into DataError."""
    def wrap(fn: Callable[..., DatasetSplits]) -> Callable[..., DatasetSplits]:
        accepted = [p for p in inspect.signature(fn).parameters if p != "root"]

        @functools.wraps(fn)
        def load(root: Path, **options: Any) -> DatasetSplits:
            unknown = sorted(set(options) - set(accepted))
            if unknown:
                raise DataError(f"dataset {name!r} does not take option(s) {unknown}; "
                                f"it takes {accepted}")
            return fn(Path(root), **options)

        DATASETS.add(name, load, doc=doc)
        return load
    return wrap


# ---------------------------------------------------------------------------------------------
# checks shared by the loaders

def _shape_str(dims: Sequence[int | str]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def _expect_shape(shape: Sequence[int], path: Path | str, key: str,
                  expected: Sequence[int | str], note: str = "") -> dict[str, int]:
    """Check ``shape`` against ``expected`` (ints fixed, strings free but consistent)."""
    bound: dict[str, int] = {}
    ok = len(shape) == len(expected)
    if ok:
        for size, want in zip(shape, expected):
            if isinstance(want, str):
                ok &= bound.setdefault(want, size) == size
            else:
                ok &= size == want
    if not ok:
        raise DataError(f"{path}: key {key!r} has shape {list(shape)}, expected "
                        f"{_shape_str(expected)}{note}")
    return bound


def _check_finite(arr: np.ndarray, path: Path | str, key: str,
                  valid: np.ndarray | None = None) -> None:
    """Raise if ``arr`` holds NaN/inf (at points where ``valid [S, N]`` is True, if given)."""
    bad = ~np.isfinite(arr)
    if valid is not None:
        bad &= valid.reshape(valid.shape + (1,) * (arr.ndim - valid.ndim))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise DataError(f"{path}: key {key!r} holds {int(bad.sum())} NaN/inf value(s), "
                        f"first at index {list(where)}")


def _check_count(option: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                              or value < 1):
        raise DataError(f"{option} must be a positive integer, got {value!r}")


def _locate(root: Path, filename: str, dataset: str) -> Path:
    """``root`` is the file or a directory holding it (or a sibling file of the set)."""
    folder = root.parent if root.is_file() else root
    path = folder / filename
    if not path.is_file():
        raise DataError(f"{dataset}: missing file {path} (expected {filename!r} in {folder})")
    return path


def _refuse_empty(path: Path) -> None:
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty (0 bytes); re-download or re-create it")


def _load_npy(path: Path, key: str) -> np.ndarray:
    _refuse_empty(path)
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise DataError(f"{path}: the file is truncated or not a .npy array, so {key!r} "
                        f"cannot be read ({err}); re-download or re-create it") from err


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` file, with a :class:`DataError` sentence for a broken one.

    An ``.npz`` is a zip archive of ``.npy`` arrays: an empty file, a truncated one (its zip
    directory is at the end) and one of random bytes are told apart from an archive that
    holds Python objects, which is refused without being unpickled (``allow_pickle=False``),
    and from an archive of no arrays or of an array without elements, which hold no data.
    """
    _refuse_empty(path)
    if not zipfile.is_zipfile(path):
        raise DataError(f"{path}: the file is truncated or not a zip archive (an .npz file is "
                        "a zip of .npy arrays); re-download or re-create it")
    contents: dict[str, np.ndarray] = {}
    try:
        with np.load(path, allow_pickle=False) as data:
            for key in data.files:
                try:
                    contents[key] = data[key]
                except ValueError as err:
                    if "pickle" not in str(err):
                        raise
                    raise DataError(f"{path}: key {key!r} holds Python objects (an object "
                                    "array), which are not read (unpickling them could run "
                                    "code); store numeric arrays, and meshes of different N "
                                    "as per-sample keys x_0, y_0, ...") from None
    except DataError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, zlib.error) as err:
        raise DataError(f"{path}: the file is truncated or corrupt ({type(err).__name__}: "
                        f"{err}); re-download or re-create it") from err
    if not contents:
        raise DataError(f"{path}: the archive holds no arrays (an .npz of x [S, N, in] and "
                        "y [S, N, out] was expected)")
    _refuse_empty_arrays(contents, path)
    return contents


def _refuse_empty_arrays(contents: dict[str, Any], path: Path) -> None:
    """A :class:`DataError` naming the first array of ``contents`` without elements (a
    sample set of 0 samples, points or channels gives no prediction, error or statistic)."""
    for key, value in contents.items():
        if isinstance(value, np.ndarray) and value.size == 0:
            raise DataError(f"{path}: key {key!r} is empty (shape {list(value.shape)}): "
                            "every sample, point and channel count must be at least 1")


def _enough(path: Path | str, available: int, needed: int, what: str) -> None:
    """Raise unless ``available >= needed`` samples; ``what`` names the options asking."""
    if available < needed:
        raise DataError(f"{path}: holds {available} samples, fewer than the {needed} that "
                        f"{what} asks for; pass smaller n_train / n_test")


def _grid_samples(x_SHWI: np.ndarray, y_SHWO: np.ndarray) -> MeshSamples:
    """A structured mesh ``[S, H, W, .]`` flattened row-major to ``[S, H*W, .]``."""
    s, h, w = x_SHWI.shape[:3]
    x = np.ascontiguousarray(x_SHWI.reshape(s, h * w, -1), dtype=np.float32)
    y = np.ascontiguousarray(y_SHWO.reshape(s, h * w, -1), dtype=np.float32)
    return MeshSamples(x=x, y=y, coords=x[..., :2].copy(), grid_shape=(h, w))


# ---------------------------------------------------------------------------------------------
# Elasticity (Geo-FNO)

@_register("elasticity", doc="Geo-FNO unit cell: 972-point clouds -> von Mises stress")
def load_elasticity(root: Path, *, n_train: int = 1000, n_test: int = 200) -> DatasetSplits:
    """Geo-FNO Elasticity: inputs the raw point coordinates (x, y), output the stress.

    Train: the first ``n_train`` samples; test: the last ``n_test`` (the release's 2000
    samples give 0-999 and 1800-1999). Generated files (``flarepp data make elasticity``)
    hold train samples first, then test samples, so pass their sizes.
    """
    _check_count("n_train", n_train)
    _check_count("n_test", n_test)
    sigma_path = _locate(root, ELASTICITY_SIGMA_FILE, "elasticity")
    xy_path = _locate(root, ELASTICITY_XY_FILE, "elasticity")
    sigma_PS = _load_npy(sigma_path, "sigma")
    s = _expect_shape(sigma_PS.shape, sigma_path, "sigma", (ELASTICITY_POINTS, "S"))["S"]
    xy_P2S = _load_npy(xy_path, "XY")
    _expect_shape(xy_P2S.shape, xy_path, "XY", (ELASTICITY_POINTS, 2, s))
    _enough(sigma_path, s, n_train + n_test,
            f"n_train={n_train} (first samples) + n_test={n_test} (last samples)")

    def take(index: slice) -> MeshSamples:
        sigma = np.asarray(sigma_PS[:, index], dtype=np.float32)
        xy = np.asarray(xy_P2S[:, :, index], dtype=np.float32)
        _check_finite(sigma, sigma_path, "sigma")
        _check_finite(xy, xy_path, "XY")
        x_SN2 = np.ascontiguousarray(xy.transpose(2, 0, 1))
        return MeshSamples(x=x_SN2, y=np.ascontiguousarray(sigma.T[..., None]),
                           coords=x_SN2.copy())

    return DatasetSplits("elasticity", take(slice(0, n_train)), take(slice(s - n_test, s)),
                         field_names=["von Mises stress"], units="as released (none stated)",
                         source=str(sigma_path.parent))


# ---------------------------------------------------------------------------------------------
# Darcy (FNO release, MATLAB v5 or v7.3)

def _glob_one(root: Path, pattern: str) -> Path:
    folder = root.parent if root.is_file() else root
    found = sorted(folder.glob(pattern))
    if not found:
        raise DataError(f"darcy: no file matching {pattern!r} in {folder}")
    if len(found) > 1:
        raise DataError(f"darcy: several files match {pattern!r} in {folder}: "
                        f"{[p.name for p in found]}; keep one pair per directory")
    return found[0]


def _read_mat(path: Path, keys: Sequence[str], count: int, resolution: int,
              option: str) -> list[np.ndarray]:
    """Read ``keys`` ``[S, R, R]`` from a v5 or v7.3 ``.mat``, first ``count`` samples, with
    the grid sub-sampled to ``resolution`` points per side."""
    import h5py
    import scipy.io

    def stride_for(side: int) -> int:
        if resolution < 2 or (side - 1) % (resolution - 1):
            raise DataError(f"{path}: a grid of {side} points per side cannot be sub-sampled "
                            f"to resolution {resolution}: (R - 1) / (resolution - 1) = "
                            f"{side - 1} / {resolution - 1} is not an integer")
        return (side - 1) // (resolution - 1)

    arrays: list[np.ndarray] = []
    expected: Sequence[int | str] = ("S", "R", "R")  # the first key fixes S and R
    _refuse_empty(path)
    if h5py.is_hdf5(path):  # v7.3: MATLAB's column-major [S, R, R] appears as [R, R, S]
        try:
            with h5py.File(path, "r") as handle:
                for key in keys:
                    if key not in handle:
                        raise DataError(f"{path}: missing key {key!r} (found "
                                        f"{sorted(handle)}), expected [S, R, R]")
                    stored = handle[key]
                    shape = stored.shape[::-1]
                    _expect_shape(shape, path, key, expected,
                                  " (MATLAB v7.3: stored transposed as [R, R, S])")
                    expected = shape
                    _enough(path, shape[0], count, f"{option}={count}")
                    stride = stride_for(shape[1])
                    arrays.append(np.asarray(stored[::stride, ::stride, :count]).T)
        except OSError as err:  # h5py: a truncated or damaged HDF5 file
            raise DataError(f"{path}: the file is truncated or not a valid MATLAB v7.3 (HDF5) "
                            f"file ({err}); re-download or re-create it") from err
    else:
        try:
            contents = scipy.io.loadmat(path, variable_names=list(keys))
        except (ValueError, TypeError, OSError, NotImplementedError,
                scipy.io.matlab.MatReadError) as err:
            raise DataError(f"{path}: the file is truncated or not a MATLAB .mat file "
                            f"({err}); re-download or re-create it") from err
        for key in keys:
            if key not in contents:
                raise DataError(f"{path}: missing key {key!r}, expected [S, R, R]")
            arr = contents[key]
            _expect_shape(arr.shape, path, key, expected)
            expected = arr.shape
            _enough(path, arr.shape[0], count, f"{option}={count}")
            stride = stride_for(arr.shape[1])
            arrays.append(arr[:count, ::stride, ::stride])
    for key, arr in zip(keys, arrays):
        _check_finite(arr, path, key)
    return arrays


def unit_square_grid(resolution: int) -> np.ndarray:
    """Node coordinates ``[R*R, 2]`` of the unit square, ``(x_i, x_j)`` at row-major ``(i, j)``."""
    t = np.linspace(0.0, 1.0, resolution)
    gx, gy = np.meshgrid(t, t, indexing="ij")
    return np.stack([gx.ravel(), gy.ravel()], axis=-1)


@_register("darcy", doc="FNO Darcy flow: permeability on an 85 x 85 grid -> pressure")
def load_darcy(root: Path, *, resolution: int = 85, n_train: int = 1000,
               n_test: int = 200) -> DatasetSplits:
    """FNO Darcy: inputs ``(x, y, coeff)``, output ``sol``, on a ``resolution``-sided grid.

    Train: the first ``n_train`` samples of ``*_smooth1.mat``; test: the first ``n_test`` of
    ``*_smooth2.mat``. Array axis 1 of ``coeff[s, i, j]`` is x, axis 2 is y.
    """
    _check_count("n_train", n_train)
    _check_count("n_test", n_test)
    _check_count("resolution", resolution)
    grid_N2 = unit_square_grid(resolution).astype(np.float32)

    def take(path: Path, count: int, option: str) -> MeshSamples:
        coeff_SRR, sol_SRR = _read_mat(path, ("coeff", "sol"), count, resolution, option)
        n = resolution * resolution
        coords = np.broadcast_to(grid_N2, (count, n, 2))
        x = np.concatenate([coords, coeff_SRR.reshape(count, n, 1)], axis=-1)
        return MeshSamples(x=x.astype(np.float32), y=sol_SRR.reshape(count, n, 1),
                           coords=coords.copy(), grid_shape=(resolution, resolution))

    train_path = _glob_one(root, DARCY_TRAIN_GLOB)
    test_path = _glob_one(root, DARCY_TEST_GLOB)
    return DatasetSplits("darcy", take(train_path, n_train, "n_train"),
                         take(test_path, n_test, "n_test"),
                         field_names=["pressure u"], units="dimensionless",
                         source=str(train_path.parent))


# ---------------------------------------------------------------------------------------------
# Airfoil and Pipe (Geo-FNO structured meshes)

def _load_structured(root: Path, dataset: str, prefix: str, grid: tuple[int, int],
                     channel: int, n_train: int, n_test: int
                     ) -> tuple[MeshSamples, MeshSamples, Path]:
    """``{prefix}_X/_Y.npy [S, H, W]`` and ``{prefix}_Q.npy [S, C, H, W]``, channel ``channel``.

    Train: samples ``[0, n_train)``; test: ``[n_train, n_train + n_test)``.
    """
    _check_count("n_train", n_train)
    _check_count("n_test", n_test)
    x_path, y_path, q_path = (_locate(root, f"{prefix}_{k}.npy", dataset) for k in "XYQ")
    coord_x = _load_npy(x_path, "X")
    s = _expect_shape(coord_x.shape, x_path, "X", ("S", *grid))["S"]
    coord_y = _load_npy(y_path, "Y")
    _expect_shape(coord_y.shape, y_path, "Y", (s, *grid))
    fields = _load_npy(q_path, "Q")
    c = _expect_shape(fields.shape, q_path, "Q", (s, "C", *grid))["C"]
    if c <= channel:
        raise DataError(f"{q_path}: key 'Q' has {c} channels, expected [S, {channel + 1}, "
                        f"{grid[0]}, {grid[1]}] (channel {channel} is the target)")
    _enough(x_path, s, n_train + n_test, f"n_train={n_train} + n_test={n_test}")

    def take(index: slice) -> MeshSamples:
        parts = {"X": (x_path, coord_x[index]), "Y": (y_path, coord_y[index]),
                 "Q": (q_path, fields[index, channel])}
        for key, (path, arr) in parts.items():
            _check_finite(arr, path, key)
        xy = np.stack([parts["X"][1], parts["Y"][1]], axis=-1)
        return _grid_samples(xy, np.asarray(parts["Q"][1])[..., None])

    return take(slice(0, n_train)), take(slice(n_train, n_train + n_test)), x_path.parent


def _register_structured(name: str, doc: str, prefix: str, grid: tuple[int, int],
                         channel: int, field_name: str) -> Callable[..., DatasetSplits]:
    """Register the Geo-FNO structured mesh ``name``: inputs the mesh coordinates (x, y),
    output channel ``channel`` of ``{prefix}_Q.npy`` (``field_name``, dimensionless)."""
    def load(root: Path, *, n_train: int = 1000, n_test: int = 200) -> DatasetSplits:
        train, test, folder = _load_structured(root, name, prefix, grid, channel, n_train,
                                               n_test)
        return DatasetSplits(name, train, test, field_names=[field_name],
                             units="dimensionless", source=str(folder))
    load.__name__ = f"load_{name}"
    load.__doc__ = (f"Geo-FNO {name}: inputs the mesh coordinates (x, y), output the "
                    f"{field_name} (Q ch. {channel}).")
    return _register(name, doc=doc)(load)


load_airfoil = _register_structured(
    "airfoil", "Geo-FNO airfoil: 221 x 51 body-fitted mesh -> Mach number", "NACA_Cylinder",
    AIRFOIL_GRID, AIRFOIL_MACH_CHANNEL, "Mach number")
load_pipe = _register_structured(
    "pipe", "Geo-FNO pipe: 129 x 129 mesh -> horizontal velocity", "Pipe", PIPE_GRID,
    PIPE_VELOCITY_CHANNEL, "velocity u_x")


# ---------------------------------------------------------------------------------------------
# DrivAerML-40K (FLARE study's presampled surface points)

def _pad(per_sample: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
    """Stack ``[N_s, K]`` arrays to ``[S, max N, K]`` (zeros beyond N_s) and the mask ``[S, N]``
    (``None`` when every sample has the same N)."""
    lengths = [len(a) for a in per_sample]
    n = max(lengths)
    out = np.zeros((len(per_sample), n, per_sample[0].shape[1]), np.float32)
    mask = np.zeros((len(per_sample), n), bool)
    for i, a in enumerate(per_sample):
        out[i, : len(a)] = a
        mask[i, : len(a)] = True
    return out, (None if min(lengths) == n else mask)


def _run_id(path: Path) -> tuple[int, str]:
    match = re.fullmatch(r"run_(\d+)\.npz", path.name)
    return (int(match.group(1)) if match else -1, path.name)


@_register("drivaerml-40k", doc="DrivAerML, 40K presampled surface cells -> pressure p/rho")
def load_drivaerml_40k(root: Path, *, n_train: int | None = None,
                       n_test: int | None = None) -> DatasetSplits:
    """FLARE study's DrivAerML-40K: inputs the cell centres (x, y, z), output ``p / rho``.

    ``root`` is ``drivaerml_surface_presampled_40k`` or its parent; its ``train/`` and
    ``test/`` folders hold one ``run_<id>.npz`` per car (387 / 97), read in run order.
    ``n_train`` / ``n_test`` keep the first runs of each (default: all).
    """
    _check_count("n_train", n_train)
    _check_count("n_test", n_test)
    folder = root if (root / "train").is_dir() else root / DRIVAER_DIR
    if not (folder / "train").is_dir() or not (folder / "test").is_dir():
        raise DataError(f"drivaerml-40k: expected folders train/ and test/ of run_<id>.npz "
                        f"in {root} or {root / DRIVAER_DIR}")

    def take(split: str, count: int | None) -> MeshSamples:
        files = sorted((folder / split).glob("run_*.npz"), key=_run_id)
        if not files:
            raise DataError(f"drivaerml-40k: no run_<id>.npz files in {folder / split}")
        if count is not None:
            _enough(folder / split, len(files), count, f"n_{split}={count}")
            files = files[:count]
        centers, pressure = [], []
        for path in files:
            contents = read_npz(path)
            missing = {"surface_mesh_centers", "surface_fields"} - set(contents)
            if missing:
                raise DataError(f"{path}: missing key(s) {sorted(missing)} (found "
                                f"{sorted(contents)})")
            xyz, fields = contents["surface_mesh_centers"], contents["surface_fields"]
            n = _expect_shape(xyz.shape, path, "surface_mesh_centers", ("n", 3))["n"]
            _expect_shape(fields.shape, path, "surface_fields", (n, 4))
            _check_finite(xyz, path, "surface_mesh_centers")
            _check_finite(fields[:, :1], path, "surface_fields")
            centers.append(xyz)
            pressure.append(fields[:, :1])
        x, mask = _pad(centers)
        y, _ = _pad(pressure)
        return MeshSamples(x=x, y=y, mask=mask, coords=x.copy())

    return DatasetSplits("drivaerml-40k", take("train", n_train), take("test", n_test),
                         field_names=["surface pressure p/rho"], units="m^2/s^2",
                         source=str(folder))


# ---------------------------------------------------------------------------------------------
# The user format

_PER_SAMPLE_KEY = re.compile(r"(x|y|coords)_(\d+)")
_METADATA_KEYS = ("field_names", "units", "grid_shape")


def _read_user_file(path: Path) -> dict[str, Any]:
    """Keys of a ``.npz`` or ``.pt`` file as numpy arrays (strings stay strings)."""
    if path.suffix == ".npz":
        return read_npz(path)
    if path.suffix == ".pt":
        import torch
        _refuse_empty(path)
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises many types for a bad file; all mean "unreadable"
            raise DataError(f"{path}: cannot read as a torch file of tensors ({err})") from err
        if not isinstance(data, dict):
            raise DataError(f"{path}: expected a dict of named tensors, got {type(data).__name__}")
        out = {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().cpu()
                value = (value.float() if value.is_floating_point() else value).numpy()
            out[str(key)] = value
        _refuse_empty_arrays(out, path)
        return out
    raise DataError(f"{path}: unsupported file type {path.suffix!r}, expected .npz or .pt")


def _as_array(value: Any, path: Path, key: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise DataError(f"{path}: key {key!r} must be numeric, got dtype {arr.dtype}")
    return arr


def _mask_array(value: Any, path: Path, s: int, n: int) -> np.ndarray:
    mask = _as_array(value, path, "mask")
    _expect_shape(mask.shape, path, "mask", (s, n))
    if not np.isin(mask, (0, 1)).all():
        raise DataError(f"{path}: key 'mask' [S, N] must hold only 0/1 or True/False")
    return mask.astype(bool)


def _fixed_layout(data: dict[str, Any], path: Path) -> MeshSamples:
    x = _as_array(data["x"], path, "x")
    bound = _expect_shape(x.shape, path, "x", ("S", "N", "in"))
    s, n = bound["S"], bound["N"]
    if "y" not in data:
        raise DataError(f"{path}: missing key 'y', expected [S, N, out] = [{s}, {n}, out]")
    y = _as_array(data["y"], path, "y")
    if y.ndim == 3 and y.shape[0] != s:
        raise DataError(f"{path}: x holds {s} samples but y holds {y.shape[0]}: key 'y' must "
                        f"be [S, N, out] = [{s}, {n}, out]")
    _expect_shape(y.shape, path, "y", (s, n, "out"))
    mask = _mask_array(data["mask"], path, s, n) if "mask" in data else None
    coords = None
    if "coords" in data:
        coords = _as_array(data["coords"], path, "coords")
        _expect_shape(coords.shape, path, "coords", (s, n, "dims"))
    grid_shape = None
    if "grid_shape" in data:
        grid = _as_array(data["grid_shape"], path, "grid_shape")
        if grid.shape != (2,) or int(np.prod(grid)) != n:
            raise DataError(f"{path}: key 'grid_shape' must be 2 integers (n1, n2) with "
                            f"n1 * n2 = N = {n}, got {grid.tolist()}")
        grid_shape = (int(grid[0]), int(grid[1]))
    arrays = {"x": x, "y": y} if coords is None else {"x": x, "y": y, "coords": coords}
    for key, arr in arrays.items():
        _check_finite(arr, path, key, mask)
        arr = arrays[key] = arr.astype(np.float32)  # a copy: zero the padding below
        if mask is not None:
            arr[~mask] = 0.0  # padding may hold anything, even NaN; 0 * NaN would leak
    return MeshSamples(x=arrays["x"], y=arrays["y"], mask=mask, coords=arrays.get("coords"),
                       grid_shape=grid_shape)


def _per_sample_layout(data: dict[str, Any], path: Path) -> MeshSamples:
    found: dict[str, dict[int, Any]] = {"x": {}, "y": {}, "coords": {}}
    for key, value in data.items():
        match = _PER_SAMPLE_KEY.fullmatch(key)
        if match:
            found[match.group(1)][int(match.group(2))] = value
    s = len(found["x"])
    if sorted(found["x"]) != list(range(s)):
        raise DataError(f"{path}: per-sample keys must be x_0 ... x_{{S-1}} without gaps, "
                        f"found indices {sorted(found['x'])}")
    for key in ("y", "coords"):
        if key == "coords" and not found[key]:
            continue
        if sorted(found[key]) != list(range(s)):
            missing = sorted(set(range(s)) - set(found[key]))
            extra = sorted(set(found[key]) - set(range(s)))
            raise DataError(f"{path}: x holds {s} samples (x_0 ... x_{s - 1}) but {key}_i "
                            f"keys disagree: missing {missing[:5]}, unmatched {extra[:5]}")
    xs, ys, cs = [], [], []
    for i in range(s):
        x = _as_array(found["x"][i], path, f"x_{i}")
        bound = _expect_shape(x.shape, path, f"x_{i}", ("N", xs[0].shape[1] if xs else "in"))
        y = _as_array(found["y"][i], path, f"y_{i}")
        _expect_shape(y.shape, path, f"y_{i}", (bound["N"], ys[0].shape[1] if ys else "out"))
        _check_finite(x, path, f"x_{i}")
        _check_finite(y, path, f"y_{i}")
        xs.append(x)
        ys.append(y)
        if found["coords"]:
            c = _as_array(found["coords"][i], path, f"coords_{i}")
            dims = cs[0].shape[1] if cs else "dims"
            _expect_shape(c.shape, path, f"coords_{i}", (bound["N"], dims))
            _check_finite(c, path, f"coords_{i}")
            cs.append(c)
    x_SNI, mask = _pad(xs)
    y_SNO, _ = _pad(ys)
    coords = _pad(cs)[0] if cs else None
    return MeshSamples(x=x_SNI, y=y_SNO, mask=mask, coords=coords)


def read_user_samples(path: Path) -> tuple[MeshSamples, list[str] | None, str | None]:
    """One user file -> ``(samples, field_names or None, units or None)`` (see ``load_npz``)."""
    data = _read_user_file(path)
    if "x" in data:
        allowed = {"x", "y", "mask", "coords", *_METADATA_KEYS}
        layout = "x, y, mask, coords, field_names, units, grid_shape"
        samples = _fixed_layout(data, path)
    elif "x_0" in data:
        allowed = {k for k in data if _PER_SAMPLE_KEY.fullmatch(k)} | {"field_names", "units"}
        layout = "x_i, y_i, coords_i (i = 0, 1, ...), field_names, units"
        samples = _per_sample_layout(data, path)
    else:
        raise DataError(f"{path}: no key 'x' (x [S, N, in], y [S, N, out]) and no per-sample "
                        f"keys 'x_0', 'y_0', ...; found keys {sorted(data)}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise DataError(f"{path}: unexpected key(s) {unknown}; this layout takes {layout}")
    field_names = None
    if "field_names" in data:
        field_names = [str(v) for v in np.atleast_1d(np.asarray(data["field_names"]))]
        if len(field_names) != samples.y.shape[-1]:
            raise DataError(f"{path}: key 'field_names' names {len(field_names)} fields but "
                            f"y has {samples.y.shape[-1]} output channels")
    units = str(np.asarray(data["units"])) if "units" in data else None
    return samples, field_names, units


def _user_files(folder: Path, stem: str) -> Path:
    candidates = [folder / f"{stem}{ext}" for ext in (".npz", ".pt")]
    present = [p for p in candidates if p.is_file()]
    if len(present) != 1:
        what = "both" if present else "neither"
        raise DataError(f"npz: {folder} holds {what} of {[p.name for p in candidates]}; expected "
                        "exactly one train and one test file (or point at a single data file)")
    return present[0]


@_register("npz", doc="your own data: x [S, N, in], y [S, N, out], optional mask [S, N]")
def load_npz(root: Path, *, test_fraction: float | None = None, n_train: int | None = None,
             n_test: int | None = None) -> DatasetSplits:
    """The user format: one ``.npz`` / ``.pt`` file, or a directory with ``train`` and ``test``.

    **Fixed N** (every sample has the same points): keys

    * ``x`` ``[S, N, in]`` input features per point (usually starting with the coordinates),
    * ``y`` ``[S, N, out]`` target fields,
    * ``mask`` ``[S, N]`` optional, bool or 0/1: True marks a real point, False padding,
    * ``coords`` ``[S, N, dims]`` optional point positions for plots (default: first inputs),
    * ``grid_shape`` ``[2]`` optional ``(n1, n2)`` when the N points are a row-major grid.

    **Variable N** (meshes of different sizes): per-sample keys ``x_0, y_0, x_1, y_1, ...``
    with ``x_i [N_i, in]``, ``y_i [N_i, out]`` and optionally ``coords_i [N_i, dims]``;
    samples are padded with zeros to the largest ``N_i`` and given a mask.

    Both layouts may add ``field_names`` (one string per output channel) and ``units``.
    A ``.pt`` file is a dict of the same names to tensors (``torch.save``; read with
    ``weights_only=True``).

    **Split**: ``root`` a directory holding ``train.npz`` and ``test.npz`` (or ``.pt``) gives
    the split explicitly; ``root`` a single file is split in order, the last
    ``round(test_fraction * S)`` samples (default ``test_fraction = 0.2``) forming the test
    split. ``n_train`` / ``n_test`` keep only the first samples of each split.
    """
    _check_count("n_train", n_train)
    _check_count("n_test", n_test)
    if root.is_dir():
        if test_fraction is not None:
            raise DataError(f"npz: test_fraction applies to a single data file; {root} is a "
                            "directory of train and test files")
        train_path, test_path = _user_files(root, "train"), _user_files(root, "test")
        train, names, units = read_user_samples(train_path)
        test, _, _ = read_user_samples(test_path)
        source = f"{train_path} + {test_path.name}"
    else:
        fraction = 0.2 if test_fraction is None else float(test_fraction)
        if not 0.0 < fraction < 1.0:
            raise DataError(f"npz: test_fraction must lie in (0, 1), got {test_fraction}")
        samples, names, units = read_user_samples(root)
        total = len(samples)
        held_out = int(round(fraction * total))
        if not 0 < held_out < total:
            raise DataError(f"{root}: {total} samples cannot be split with test_fraction "
                            f"{fraction} (it leaves {held_out} test samples)")
        train = samples.subset(slice(0, total - held_out))
        test = samples.subset(slice(total - held_out, total))
        source = str(root)
    for split, samples, count in (("train", train, n_train), ("test", test, n_test)):
        if count is not None:
            _enough(f"{source} ({split} split)", len(samples), count, f"n_{split}={count}")
    if n_train is not None:
        train = train.subset(slice(0, n_train))
    if n_test is not None:
        test = test.subset(slice(0, n_test))
    out_dim = train.y.shape[-1]
    default_names = ["u"] if out_dim == 1 else [f"u{k}" for k in range(out_dim)]
    return DatasetSplits("npz", train, test, field_names=names or default_names,
                         units=units or "units not given", source=source)
