"""Data layer: loaders on tiny files in the public formats, the user format, errors, generators.

Every file here is written by the test in the exact layout of the public release it imitates
(the files and keys tabled in ``flarepp.data.loaders``; paper Sec. C.1), at a few samples, so
the whole module runs in seconds.
"""

from __future__ import annotations

import re
from pathlib import Path

import h5py
import numpy as np
import pytest
import scipy.io

from flarepp.data import DataError, Normalizer, load_dataset
from flarepp.data.generators import GENERATORS
from flarepp.data.generators._io import write_atomically
from flarepp.data.generators.darcy import make_darcy, solve_darcy
from flarepp.data.loaders import unit_square_grid


def series_solution(resolution: int, terms: int = 401) -> np.ndarray:
    """``-Laplace u = 1`` on the unit square, ``u = 0`` on the boundary, as a Fourier series:
    ``u = sum_{m,n odd} 16 / (pi^4 m n (m^2 + n^2)) sin(m pi x) sin(n pi y)``."""
    x = np.linspace(0.0, 1.0, resolution)
    odd = np.arange(1, terms, 2)
    sines = np.sin(np.pi * np.outer(x, odd))
    m, n = odd[:, None], odd[None, :]
    coef = 16.0 / (np.pi ** 4 * m * n * (m ** 2 + n ** 2))
    return sines @ coef @ sines.T


# ---------------------------------------------------------------------------------------------
# the Darcy solver and generator

def test_darcy_solver_converges_to_series_solution():
    """Constant permeability a = 1, f = 1: the 5-point FV scheme is second order, so the max
    error against the series solution must fall ~4x per halving of h, and at R = 33
    (h = 1/32) lie below 1e-4 (measured 5.7e-5, i.e. ~0.058 h^2; the series is truncated at
    m, n < 401, a truncation error below 1e-8). A failure points to a wrong stencil, wrong
    face coefficients, a mis-indexed coupling or a wrong h^2 scaling of the right-hand side."""
    errors = {}
    for resolution in (17, 33):
        u = solve_darcy(np.ones((resolution, resolution)))
        errors[resolution] = np.abs(u - series_solution(resolution)).max()
        assert np.all(u[[0, -1], :] == 0) and np.all(u[:, [0, -1]] == 0)
    assert errors[33] < 1e-4
    assert 3.5 < errors[17] / errors[33] < 4.5


def test_darcy_solver_satisfies_the_stated_flux_balance():
    """For a random 12/3 medium, every interior node satisfies, by an explicit loop,
    ``sum_nb 2 a_P a_nb / (a_P + a_nb) (u_P - u_nb) / h^2 = 1``, and doubling ``a`` halves
    ``u``. A failure points to arithmetic instead of harmonic face means, a mis-indexed
    neighbour, or boundary values that are not zero."""
    rng = np.random.default_rng(0)
    a = rng.choice([3.0, 12.0], (7, 7))
    u = solve_darcy(a)
    h = 1.0 / 6
    for i in range(1, 6):
        for j in range(1, 6):
            balance = sum(2 * a[i, j] * a[p, q] / (a[i, j] + a[p, q]) * (u[i, j] - u[p, q])
                          for p, q in ((i - 1, j), (i + 1, j), (i, j - 1), (i, j + 1)))
            assert balance / h ** 2 == pytest.approx(1.0, rel=1e-10)
    np.testing.assert_allclose(solve_darcy(2 * a), u / 2, rtol=1e-12)


def test_darcy_generator_is_seeded_and_readable_by_the_loader(tmp_path):
    """Same seed -> identical files; another seed -> different fields; sample i does not
    depend on how many are generated; the release-layout files load with the `darcy` loader
    at the generated resolution and sub-sampled (stride 2). A failure points to unseeded
    randomness, a file-layout mismatch between generator and loader, or wrong sub-sampling."""
    paths = make_darcy(tmp_path / "a", n_train=3, n_test=2, resolution=9, seed=7, progress=False)
    assert [p.name for p in paths] == ["piececonst_r9_N3_smooth1.mat",
                                       "piececonst_r9_N2_smooth2.mat"]
    make_darcy(tmp_path / "b", n_train=3, n_test=2, resolution=9, seed=7, progress=False)
    make_darcy(tmp_path / "c", n_train=2, n_test=1, resolution=9, seed=8, progress=False)
    make_darcy(tmp_path / "d", n_train=2, n_test=1, resolution=9, seed=7, progress=False)
    a = scipy.io.loadmat(paths[0])
    b = scipy.io.loadmat(tmp_path / "b" / paths[0].name)
    c = scipy.io.loadmat(tmp_path / "c" / "piececonst_r9_N2_smooth1.mat")
    d = scipy.io.loadmat(tmp_path / "d" / "piececonst_r9_N2_smooth1.mat")
    assert a["coeff"].shape == a["sol"].shape == (3, 9, 9)
    np.testing.assert_array_equal(a["sol"], b["sol"])
    np.testing.assert_array_equal(a["coeff"][:2], d["coeff"])
    assert not np.array_equal(a["coeff"][:2], c["coeff"])
    assert set(np.unique(a["coeff"])) <= {3.0, 12.0}

    splits = load_dataset("darcy", tmp_path / "a", resolution=9, n_train=3, n_test=2)
    assert splits.train.x.shape == (3, 81, 3) and splits.test.y.shape == (2, 81, 1)
    assert splits.train.grid_shape == (9, 9)
    np.testing.assert_allclose(splits.train.x[0, :, :2], unit_square_grid(9))
    np.testing.assert_allclose(splits.train.x[:, :, 2], a["coeff"].reshape(3, 81))
    np.testing.assert_allclose(splits.train.y[..., 0], a["sol"].reshape(3, 81))
    coarse = load_dataset("darcy", tmp_path / "a", resolution=5, n_train=3, n_test=2)
    np.testing.assert_allclose(coarse.train.y[..., 0], a["sol"][:, ::2, ::2].reshape(3, 25))
    np.testing.assert_allclose(coarse.train.coords[0], unit_square_grid(5), atol=1e-7)


def _write_darcy_v73(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """MATLAB v7.3 = HDF5 with a 512-byte user block; column-major [S, R, R] stored [R, R, S]."""
    with h5py.File(path, "w", userblock_size=512) as handle:
        for key, arr in arrays.items():
            handle.create_dataset(key, data=np.asarray(arr, np.float64).T)


def test_darcy_loader_reads_matlab_v5_and_v73_alike(tmp_path):
    """The same arrays written as v5 (scipy.io) and v7.3 (HDF5, transposed) load identically,
    including sub-sampling. A failure points to a missing transpose of v7.3 arrays or a
    stride applied to the wrong axes."""
    rng = np.random.default_rng(0)
    train = {"coeff": rng.choice([3.0, 12.0], (4, 9, 9)), "sol": rng.random((4, 9, 9))}
    test = {"coeff": rng.choice([3.0, 12.0], (2, 9, 9)), "sol": rng.random((2, 9, 9))}
    (tmp_path / "v5").mkdir()
    (tmp_path / "v73").mkdir()
    scipy.io.savemat(tmp_path / "v5" / "piececonst_r9_N4_smooth1.mat", train)
    scipy.io.savemat(tmp_path / "v5" / "piececonst_r9_N2_smooth2.mat", test)
    _write_darcy_v73(tmp_path / "v73" / "piececonst_r9_N4_smooth1.mat", train)
    _write_darcy_v73(tmp_path / "v73" / "piececonst_r9_N2_smooth2.mat", test)
    for resolution in (9, 5):
        v5 = load_dataset("darcy", tmp_path / "v5", resolution=resolution, n_train=3, n_test=2)
        v73 = load_dataset("darcy", tmp_path / "v73", resolution=resolution, n_train=3,
                           n_test=2)
        np.testing.assert_array_equal(v5.train.x, v73.train.x)
        np.testing.assert_array_equal(v5.test.y, v73.test.y)
    s = slice(None, None, 2)
    np.testing.assert_allclose(v73.train.y[..., 0], train["sol"][:3, s, s].reshape(3, 25),
                               rtol=1e-6)
    np.testing.assert_allclose(v73.test.x[..., 2], test["coeff"][:, s, s].reshape(2, 25))


# ---------------------------------------------------------------------------------------------
# the other public layouts

def test_elasticity_loader_takes_first_train_and_last_test_samples(tmp_path):
    """Geo-FNO layout sigma [972, S], XY [972, 2, S]: train = first n_train, test = last
    n_test, x = raw coordinates, y = stress. A failure points to a wrong transpose or split."""
    rng = np.random.default_rng(1)
    sigma, xy = rng.random((972, 6)), rng.random((972, 2, 6))
    np.save(tmp_path / "Random_UnitCell_sigma_10.npy", sigma)
    np.save(tmp_path / "Random_UnitCell_XY_10.npy", xy)
    splits = load_dataset("elasticity", tmp_path, n_train=3, n_test=2)
    assert splits.train.x.shape == (3, 972, 2) and splits.test.y.shape == (2, 972, 1)
    np.testing.assert_allclose(splits.train.x[1], xy[:, :, 1], rtol=1e-6)
    np.testing.assert_allclose(splits.test.y[0, :, 0], sigma[:, 4], rtol=1e-6)
    np.testing.assert_allclose(splits.test.coords[1], xy[:, :, 5], rtol=1e-6)
    assert splits.train.grid_shape is None and splits.field_names == ["von Mises stress"]


@pytest.mark.parametrize("name, prefix, grid, channels, target", [
    ("airfoil", "NACA_Cylinder", (221, 51), 5, 4),
    ("pipe", "Pipe", (129, 129), 3, 0),
])
def test_structured_loaders_read_geo_fno_layout(tmp_path, name, prefix, grid, channels,
                                                target):
    """X, Y [S, H, W] and Q [S, C, H, W]: x = (X, Y) flattened row-major with grid_shape
    (H, W), y = Q's target channel, train [0, n_train), test [n_train, n_train + n_test).
    A failure points to the wrong channel, flattening order or split."""
    rng = np.random.default_rng(2)
    arrays = {k: rng.random((4, *grid)).astype(np.float32) for k in "XY"}
    arrays["Q"] = rng.random((4, channels, *grid)).astype(np.float32)
    for key, arr in arrays.items():
        np.save(tmp_path / f"{prefix}_{key}.npy", arr)
    splits = load_dataset(name, tmp_path, n_train=2, n_test=1)
    assert splits.train.grid_shape == grid and splits.test.x.shape == (1, grid[0] * grid[1], 2)
    np.testing.assert_array_equal(splits.test.y[0, :, 0], arrays["Q"][2, target].ravel())
    np.testing.assert_array_equal(splits.train.x[1, :, 1], arrays["Y"][1].ravel())
    np.testing.assert_array_equal(splits.train.coords, splits.train.x)


def test_drivaerml_loader_orders_runs_and_masks_uneven_counts(tmp_path):
    """Runs sort by numeric id (run_2 before run_10), pressure is column 0 of
    surface_fields, and runs of different n are padded with a mask. A failure points to a
    lexicographic run order, a wrong column or missing padding masks."""
    root = tmp_path / "drivaerml_surface_presampled_40k"
    rng = np.random.default_rng(3)
    runs = {"train": {10: 5, 2: 7}, "test": {4: 6}}
    data = {}
    for split, sizes in runs.items():
        (root / split).mkdir(parents=True)
        for run, n in sizes.items():
            data[run] = (rng.random((n, 3)), rng.random((n, 4)))
            np.savez(root / split / f"run_{run}.npz", surface_mesh_centers=data[run][0],
                     surface_fields=data[run][1])
    splits = load_dataset("drivaerml-40k", tmp_path)
    assert splits.train.x.shape == (2, 7, 3) and splits.test.mask is None
    np.testing.assert_allclose(splits.train.y[0, :, 0], data[2][1][:, 0], rtol=1e-6)
    np.testing.assert_array_equal(splits.train.mask.sum(1), [7, 5])
    assert splits.units == "m^2/s^2"


# ---------------------------------------------------------------------------------------------
# the user format

def test_user_format_fixed_n_single_file_split_by_fraction(tmp_path):
    """x [S, N, in], y [S, N, out], mask [S, N] in one .npz, split in order by test_fraction:
    the last round(0.25 * 8) = 2 samples are the test split; NaN at padded points is accepted
    and zeroed. A failure points to a wrong split, a lost mask, padding NaN that would reach
    the model (0 * NaN = NaN in masked attention), or lost metadata."""
    rng = np.random.default_rng(4)
    x, y = rng.random((8, 5, 3)), rng.random((8, 5, 2))
    mask = np.ones((8, 5), bool)
    mask[1, 3:] = False
    y[1, 3:] = np.nan  # padding may hold anything
    np.savez(tmp_path / "mine.npz", x=x, y=y, mask=mask, field_names=np.array(["p", "T"]))
    splits = load_dataset("npz", tmp_path / "mine.npz", test_fraction=0.25)
    assert len(splits.train) == 6 and len(splits.test) == 2
    np.testing.assert_allclose(splits.test.x, x[6:], rtol=1e-6)
    np.testing.assert_array_equal(splits.train.mask, mask[:6])
    assert np.all(splits.train.y[1, 3:] == 0)  # NaN padding is zeroed, not passed on
    assert splits.field_names == ["p", "T"] and splits.out_dim == 2


def test_user_format_variable_n_is_padded_with_mask(tmp_path):
    """Per-sample keys x_i [N_i, in], y_i [N_i, out] in train/test files (.npz and .pt) are
    padded to the largest N with zeros and a mask marking the real points. A failure points
    to padding that leaks into real points, a wrong mask, or a broken .pt reader."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    train = {f"{k}_{i}": rng.random((n, 2)) for i, n in enumerate((4, 6, 3)) for k in "xy"}
    np.savez(tmp_path / "train.npz", **train)
    torch.save({"x_0": torch.rand(5, 2), "y_0": torch.rand(5, 2), "x_1": torch.rand(2, 2),
                "y_1": torch.rand(2, 2)}, tmp_path / "test.pt")
    splits = load_dataset("npz", tmp_path)
    assert splits.train.x.shape == (3, 6, 2) and splits.test.x.shape == (2, 5, 2)
    np.testing.assert_array_equal(splits.train.mask.sum(1), [4, 6, 3])
    np.testing.assert_allclose(splits.train.y[2, :3], train["y_2"], rtol=1e-6)
    assert np.all(splits.train.x[2, 3:] == 0)
    np.testing.assert_array_equal(splits.test.mask.sum(1), [5, 2])


def test_normalizer_uses_train_split_and_real_points_only(tmp_path):
    """Per-channel mean/std fitted on the train split's real points equal those computed by
    hand: neither the (shifted) test split nor huge padded values enter. A failure points to
    statistics leaking from test data or padding."""
    rng = np.random.default_rng(6)
    x, y = rng.random((4, 6, 1)), rng.normal(2.0, 3.0, (4, 6, 1))
    mask = np.ones((4, 6), bool)
    mask[0, 4:] = False
    y[0, 4:] = 1e6
    np.savez(tmp_path / "train.npz", x=x, y=y, mask=mask)
    np.savez(tmp_path / "test.npz", x=x, y=y + 100.0)
    splits = load_dataset("npz", tmp_path)
    norm = Normalizer.fit(splits.train.y, splits.train.mask)
    real = y[mask]
    np.testing.assert_allclose(norm.mean, [real.mean()], rtol=1e-5)
    np.testing.assert_allclose(norm.std, [real.std()], rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# bad input: each error names the file, the key and what was expected

def _user_file(tmp_path: Path, **arrays) -> Path:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    return path


X, Y = np.zeros((5, 4, 2)), np.zeros((5, 4, 1))
Y_NAN = Y.copy()
Y_NAN[2, 1, 0] = np.nan


@pytest.mark.parametrize("arrays, message", [
    ({"x": X}, r"bad\.npz: missing key 'y', expected \[S, N, out\] = \[5, 4, out\]"),
    ({"inputs": X, "y": Y}, r"bad\.npz: no key 'x'.*found keys \['inputs', 'y'\]"),
    ({"x": X[..., 0], "y": Y}, r"bad\.npz: key 'x' has shape \[5, 4\], expected \[S, N, in\]"),
    ({"x": X, "y": Y[:4]}, r"bad\.npz: x holds 5 samples but y holds 4"),
    ({"x": X, "y": Y[:, :3]}, r"key 'y' has shape \[5, 3, 1\], expected \[5, 4, out\]"),
    ({"x": X, "y": Y_NAN}, r"bad\.npz: key 'y' holds 1 NaN/inf value\(s\), first at index "
                           r"\[2, 1, 0\]"),
    ({"x": X, "y": Y, "mask": np.ones((5, 3))}, r"key 'mask' has shape \[5, 3\], expected "
                                                r"\[5, 4\]"),
    ({"x": X, "y": Y, "mask": np.full((5, 4), 2)}, r"'mask' \[S, N\] must hold only 0/1"),
    ({"x": X, "y": Y, "Mask": np.ones((5, 4))}, r"unexpected key\(s\) \['Mask'\]"),
    ({"x_0": X[0], "y_0": Y[0], "x_1": X[1]}, r"x holds 2 samples .* y_i keys disagree: "
                                              r"missing \[1\]"),
    ({"x_0": X[0], "y_0": Y[0], "x_1": X[1, :, :1], "y_1": Y[1]},
     r"key 'x_1' has shape \[4, 1\], expected \[N, 2\]"),
])
def test_user_format_errors_name_the_problem(tmp_path, arrays, message):
    """Each malformed user file raises DataError whose message names the file, the key and
    the expected shape. A failure points to a check that is missing or a vague message."""
    path = _user_file(tmp_path, **arrays)
    with pytest.raises(DataError, match=message):
        load_dataset("npz", path, test_fraction=0.4)


def test_benchmark_errors_name_file_key_and_shape(tmp_path):
    """Missing files, keys, wrong shapes, too few samples, NaN and bad resolutions in the
    public layouts raise DataError naming what is wrong. A failure points to a loader that
    crashes with a raw KeyError/IndexError or accepts malformed data."""
    with pytest.raises(DataError, match=r"missing file .*Random_UnitCell_sigma_10\.npy"):
        load_dataset("elasticity", tmp_path)
    np.save(tmp_path / "Random_UnitCell_sigma_10.npy", np.zeros((972, 6)))
    np.save(tmp_path / "Random_UnitCell_XY_10.npy", np.zeros((972, 6, 2)))
    with pytest.raises(DataError, match=r"Random_UnitCell_XY_10\.npy: key 'XY' has shape "
                                        r"\[972, 6, 2\], expected \[972, 2, 6\]"):
        load_dataset("elasticity", tmp_path, n_train=3, n_test=2)
    np.save(tmp_path / "Random_UnitCell_XY_10.npy", np.zeros((972, 2, 6)))
    with pytest.raises(DataError, match=r"holds 6 samples, fewer than the 1200"):
        load_dataset("elasticity", tmp_path)
    with pytest.raises(DataError, match=r"does not take option\(s\) \['resolution'\]"):
        load_dataset("elasticity", tmp_path, resolution=85)

    darcy = tmp_path / "darcy"
    darcy.mkdir()
    with pytest.raises(DataError, match=r"no file matching 'piececonst_r\*_N\*_smooth1\.mat'"):
        load_dataset("darcy", darcy)
    coeff = np.ones((2, 9, 9))
    scipy.io.savemat(darcy / "piececonst_r9_N2_smooth1.mat", {"coeff": coeff})
    scipy.io.savemat(darcy / "piececonst_r9_N2_smooth2.mat", {"coeff": coeff, "sol": coeff})
    with pytest.raises(DataError, match=r"smooth1\.mat: missing key 'sol', expected \[S, R, R\]"):
        load_dataset("darcy", darcy, resolution=9, n_train=2, n_test=2)
    scipy.io.savemat(darcy / "piececonst_r9_N2_smooth1.mat", {"coeff": coeff,
                                                               "sol": np.ones((2, 9, 8))})
    with pytest.raises(DataError, match=r"key 'sol' has shape \[2, 9, 8\], expected \[2, 9, 9\]"):
        load_dataset("darcy", darcy, resolution=9, n_train=2, n_test=2)
    _write_darcy_v73(darcy / "piececonst_r9_N2_smooth1.mat",
                     {"coeff": coeff, "sol": np.where(np.eye(9) > 0, np.nan, 1.0)[None] * coeff})
    with pytest.raises(DataError, match=r"smooth1\.mat: key 'sol' holds 18 NaN"):
        load_dataset("darcy", darcy, resolution=9, n_train=2, n_test=2)
    with pytest.raises(DataError, match=r"9 points per side cannot be sub-sampled to "
                                        r"resolution 4.*8 / 3 is not an integer"):
        load_dataset("darcy", darcy, resolution=4, n_train=2, n_test=2)

    with pytest.raises(DataError, match=r"NACA_Cylinder_X\.npy"):
        load_dataset("airfoil", tmp_path)
    with pytest.raises(DataError, match=r"expected folders train/ and test/"):
        load_dataset("drivaerml-40k", tmp_path)


# ---------------------------------------------------------------------------------------------
# the elasticity generator, atomic writes, the command line

def test_elasticity_generator_gives_972_finite_points_reproducibly(tmp_path):
    """Each sample has exactly 972 points in the unit cell outside the void (the cell's
    corners are always kept), finite non-negative von Mises stress of order the applied
    traction, the same arrays for the same seed, and loads with the `elasticity` loader.
    A failure points to point selection, the FE solve or the file layout."""
    pytest.importorskip("skfem")
    pytest.importorskip("triangle")
    make = GENERATORS.get("elasticity")
    make(tmp_path / "a", n_train=2, n_test=1, seed=3, progress=False)
    make(tmp_path / "b", n_train=2, n_test=1, seed=3, progress=False)
    sigma = np.load(tmp_path / "a" / "Random_UnitCell_sigma_10.npy")
    xy = np.load(tmp_path / "a" / "Random_UnitCell_XY_10.npy")
    assert sigma.shape == (972, 3) and xy.shape == (972, 2, 3)
    np.testing.assert_array_equal(sigma, np.load(tmp_path / "b" / "Random_UnitCell_sigma_10.npy"))
    assert np.isfinite(sigma).all() and sigma.min() >= 0
    assert 0.3 < np.median(sigma) < 5.0  # unit traction on a cell at most 80% void-width
    assert xy.min() >= 0 and xy.max() <= 1
    assert np.linalg.norm(xy - 0.5, axis=1).min() > 0.19  # the void's radius exceeds 0.2
    for corner in ([0, 0], [1, 0], [1, 1], [0, 1]):
        assert np.any(np.all(np.isclose(xy[:, :, 0], corner), axis=1))
    assert not np.array_equal(xy[:, :, 0], xy[:, :, 1])
    splits = load_dataset("elasticity", tmp_path / "a", n_train=2, n_test=1)
    np.testing.assert_array_equal(splits.test.y[0, :, 0], sigma[:, 2])


def test_atomic_write_leaves_nothing_when_a_writer_fails(tmp_path):
    """If any file of a set fails to write, none of the set appears and no temporary file is
    left. A failure points to half-written datasets after an interrupted generation."""
    def broken(handle):
        handle.write(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomically({tmp_path / "a.npy": lambda h: h.write(b"ok"), tmp_path / "b.npy": broken})
    assert list(tmp_path.iterdir()) == []


def test_cli_data_make_writes_files_and_refuses_to_overwrite(tmp_path, capsys):
    """`flarepp data make darcy` writes the release files and says where; a second run
    without --overwrite exits 2 and leaves the files untouched; `data check` loads them.
    A failure points to the CLI wiring or a silent overwrite."""
    from flarepp.cli import main
    out = tmp_path / "darcy"
    args = ["data", "make", "darcy", "--out", str(out), "--train", "2", "--test", "1",
            "--resolution", "9", "--quiet"]
    assert main(args) == 0
    assert "piececonst_r9_N2_smooth1.mat" in capsys.readouterr().out
    before = (out / "piececonst_r9_N2_smooth1.mat").read_bytes()
    assert main(args[:-1] + ["--seed", "5", "--quiet"]) == 2
    assert re.search(r"refusing to overwrite", capsys.readouterr().err)
    assert (out / "piececonst_r9_N2_smooth1.mat").read_bytes() == before
    assert main(["data", "check", "darcy", str(out), "--option", "resolution=9",
                 "--option", "n_train=2", "--option", "n_test=1"]) == 0
    assert "x [2, 81, 3]" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["darcy", "elasticity", "elasticity-mesh", "surface-flow",
                                  "advection-diffusion"])
def test_every_generator_refuses_empty_splits_and_negative_seeds_alike(name, tmp_path):
    """A train or test count below one or a negative seed is one sentence naming the
    generator and the three values, before anything is written (one check shared by the
    generators: each had its own wording)."""
    from flarepp.data.generators import GENERATORS
    make = GENERATORS.entry(name).obj
    for train, test, seed in [(0, 1, 0), (1, 0, 0), (1, 1, -1)]:
        with pytest.raises(ValueError, match=f"^{name} needs train, test >= 1 and seed >= 0, "
                                             f"got train={train}, test={test}, seed={seed}$"):
            make(tmp_path / "out", n_train=train, n_test=test, seed=seed)
    assert not (tmp_path / "out").exists()
