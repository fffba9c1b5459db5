"""Darcy flow in a piecewise-constant porous medium: the FNO recipe, solved by finite volumes.

The benchmark (paper Section C.1, Table 6; FNO's Darcy data) maps a permeability field ``a`` on
the unit square to the pressure ``u`` solving

    -div(a grad u) = f  in (0, 1)^2,    u = 0 on the boundary,    f = 1.

Permeability: a Gaussian random field ``g ~ N(0, (-Laplacian + tau^2 I)^(-alpha))`` with
``tau = 3``, ``alpha = 2`` (covariance ``(-Laplacian + 9 I)^(-2)``), thresholded at zero:
``a = 12`` where ``g >= 0`` and ``a = 3`` elsewhere. ``g`` is drawn in the eigenbasis of the
Neumann Laplacian, ``g(x, y) = sum_{k,l} (pi^2 (k^2 + l^2) + tau^2)^(-alpha/2) xi_kl
cos(k pi x) cos(l pi y)`` with ``xi_kl ~ N(0, 1)`` for ``0 <= k, l < R`` and the constant mode
dropped (zero mean, so about half the square is high-permeability). The overall scale of ``g``
is irrelevant after thresholding.

Discretisation: the ``R x R`` grid of nodes ``x_i = i / (R - 1)`` (boundary included), a
vertex-centred 5-point finite-volume scheme: each interior node balances the fluxes through
the four faces of its ``h x h`` control volume, ``sum_faces a_face (u_P - u_nb) / h^2 = f``,
with the face permeability the harmonic mean ``2 a_P a_nb / (a_P + a_nb)`` of the two nodes'
values (exact for a flux through two layers in series). For constant ``a`` this is the
standard second-order 5-point Laplacian. The ``(R - 2)^2`` unknowns are found by a sparse
direct solve (``scipy.sparse.linalg.spsolve``).

Array layout: ``coeff[s, i, j]`` and ``sol[s, i, j]`` live at ``(x, y) = (x_i, x_j)`` (axis 0
is x). Files follow the public release: ``piececonst_r{R}_N{S}_smooth1.mat`` (train) and
``..._smooth2.mat`` (test), MATLAB v5, keys ``coeff`` and ``sol`` of shape ``[S, R, R]``
(float32 here; the release's files are larger but share keys and layout).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.fft
import scipy.io
import scipy.sparse
import scipy.sparse.linalg
from tqdm.auto import tqdm

from flarepp.data.generators._io import check_counts, refuse_existing, write_atomically

TAU = 3.0
ALPHA = 2.0
HIGH_PERMEABILITY = 12.0
LOW_PERMEABILITY = 3.0
TRAIN_SPLIT, TEST_SPLIT = 0, 1


def sample_permeability(resolution: int, rng: np.random.Generator) -> np.ndarray:
    """One thresholded Gaussian random field ``a [R, R]`` with values 12 / 3 (module doc).

    The cosine sum over ``R x R`` modes at the ``R`` nodes ``x_i = i / (R - 1)`` is a 2-D
    type-I DCT once the interior modes are halved (``scipy.fft.dctn`` doubles them).
    """
    modes = np.arange(resolution)
    k2 = modes[:, None] ** 2 + modes[None, :] ** 2
    amplitude_KK = (np.pi ** 2 * k2 + TAU ** 2) ** (-ALPHA / 2)
    amplitude_KK[0, 0] = 0.0  # drop the constant mode: a zero-mean field
    half = np.full(resolution, 0.5)
    half[[0, -1]] = 1.0
    coefficients_KK = amplitude_KK * rng.standard_normal((resolution, resolution))
    field_RR = scipy.fft.dctn(coefficients_KK * np.outer(half, half), type=1)
    return np.where(field_RR >= 0.0, HIGH_PERMEABILITY, LOW_PERMEABILITY)


def solve_darcy(a_RR: np.ndarray, f: float = 1.0) -> np.ndarray:
    """Solve ``-div(a grad u) = f``, ``u = 0`` on the boundary, on the node grid of ``a``.

    ``a_RR`` holds the permeability at the ``R x R`` nodes of the unit square (boundary
    included); returns ``u [R, R]`` (zero on the boundary). Scheme: see the module docstring.
    """
    a_RR = np.asarray(a_RR, dtype=np.float64)
    n = a_RR.shape[0]
    if a_RR.ndim != 2 or a_RR.shape[1] != n or n < 3:
        raise ValueError(f"permeability must be a square grid [R, R] with R >= 3, "
                         f"got {list(a_RR.shape)}")
    if not (np.isfinite(a_RR).all() and (a_RR > 0).all()):
        raise ValueError("permeability must be finite and positive")
    h = 1.0 / (n - 1)
    m = n - 2  # interior nodes per side
    # face permeabilities: faces_x[i, j] between nodes (i, j) and (i+1, j); faces_y likewise
    faces_x = 2 * a_RR[:-1, :] * a_RR[1:, :] / (a_RR[:-1, :] + a_RR[1:, :])   # [R-1, R]
    faces_y = 2 * a_RR[:, :-1] * a_RR[:, 1:] / (a_RR[:, :-1] + a_RR[:, 1:])   # [R, R-1]
    diagonal = (faces_x[:-1, 1:-1] + faces_x[1:, 1:-1]
                + faces_y[1:-1, :-1] + faces_y[1:-1, 1:]).ravel()
    index = np.arange(m * m).reshape(m, m)  # unknown number of interior node (i+1, j+1)
    # couplings between interior neighbours; boundary neighbours carry u = 0 and drop out
    west, east = index[:-1, :].ravel(), index[1:, :].ravel()
    coupling_x = faces_x[1:-1, 1:-1].ravel()
    south, north = index[:, :-1].ravel(), index[:, 1:].ravel()
    coupling_y = faces_y[1:-1, 1:-1].ravel()
    rows = np.concatenate([index.ravel(), west, east, south, north])
    cols = np.concatenate([index.ravel(), east, west, north, south])
    vals = np.concatenate([diagonal, -coupling_x, -coupling_x, -coupling_y, -coupling_y])
    matrix = scipy.sparse.csc_matrix((vals, (rows, cols)), shape=(m * m, m * m))
    rhs = np.full(m * m, f * h * h)
    u_RR = np.zeros((n, n))
    u_RR[1:-1, 1:-1] = scipy.sparse.linalg.spsolve(matrix, rhs).reshape(m, m)
    return u_RR


def darcy_sample(resolution: int, seed: int, split: int,
                 index: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample ``index`` of ``split`` for ``seed``: ``(coeff [R, R], sol [R, R])``.

    Each sample has its own stream ``default_rng([seed, split, index])``, so sample ``i`` is
    the same however many samples are generated.
    """
    rng = np.random.default_rng([seed, split, index])
    a_RR = sample_permeability(resolution, rng)
    return a_RR, solve_darcy(a_RR)


def darcy_file_names(resolution: int, n_train: int, n_test: int) -> tuple[str, str]:
    return (f"piececonst_r{resolution}_N{n_train}_smooth1.mat",
            f"piececonst_r{resolution}_N{n_test}_smooth2.mat")


def make_darcy(out: str | Path, *, n_train: int = 1000, n_test: int = 200,
               resolution: int | None = 85, seed: int = 0, progress: bool = True,
               overwrite: bool = False) -> list[Path]:
    """Generate Darcy train and test files in ``out`` (release layout); returns their paths.

    Both files are written only after every sample is solved, each through a temporary file
    and a rename, so an interrupted run leaves no partial dataset.
    """
    resolution = 85 if resolution is None else int(resolution)
    if resolution < 3:
        raise ValueError(f"darcy resolution must be >= 3, got {resolution}")
    check_counts("darcy", n_train, n_test, seed)
    out = Path(out)
    train_name, test_name = darcy_file_names(resolution, n_train, n_test)
    paths = [out / train_name, out / test_name]
    refuse_existing(paths, overwrite)

    arrays = {}
    with tqdm(total=n_train + n_test, desc=f"darcy r={resolution}", unit="sample",
              disable=not progress) as bar:
        for split, count in ((TRAIN_SPLIT, n_train), (TEST_SPLIT, n_test)):
            coeff_SRR = np.empty((count, resolution, resolution), np.float32)
            sol_SRR = np.empty_like(coeff_SRR)
            for i in range(count):
                coeff_SRR[i], sol_SRR[i] = darcy_sample(resolution, seed, split, i)
                bar.update()
            arrays[split] = {"coeff": coeff_SRR, "sol": sol_SRR}

    def writer(split: int):
        return lambda handle: scipy.io.savemat(handle, arrays[split], format="5")

    return write_atomically({paths[0]: writer(TRAIN_SPLIT), paths[1]: writer(TEST_SPLIT)})
