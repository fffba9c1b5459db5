"""Transient 2-D advection-diffusion with a pulsating source, solved exactly in Fourier space.

Shape letters: S trajectories, T time steps (T + 1 states), R grid points per side.

The PDE, on the periodic unit square, for one trajectory:

    du/dt + v . grad u = kappa Laplacian(u) + A cos(2 pi f t) g(x),      u(x, 0) = u0(x),

with a constant velocity ``v``, diffusivity ``kappa`` and a Gaussian source
``g(x) = sum_n exp(-|x - s - n|^2 / (2 sigma_s^2))`` (sum over the periodic images n) of
amplitude ``A`` and frequency ``f`` (one period per unit time: the source injects, then
removes, then injects again). ``u0`` is a sum of 2-4 Gaussian bumps of random centres,
widths and signed amplitudes.

Solver: on the ``R x R`` grid ``x_ij = (i, j) / R`` each Fourier mode ``k`` (wavenumbers
``2 pi (m1, m2)``, ``|m| < R/2``) obeys the linear ODE ``u_k' = lambda_k u_k + A cos(w t)
g_k`` with ``lambda_k = -i k . v - kappa |k|^2`` and ``w = 2 pi f``. Over a step
``t0 -> t1 = t0 + dt`` it is integrated exactly (an exponential integrator with the source
integral in closed form):

    u_k(t1) = e^{lambda_k dt} u_k(t0) + A g_k (J_k(w) + J_k(-w)) / 2,
    J_k(w)  = int_{t0}^{t1} e^{lambda_k (t1 - s)} e^{i w s} ds
            = e^{i w t1} dt phi_1((lambda_k - i w) dt),

with ``phi_1(z) = (e^z - 1) / z`` (``phi_1(0) = 1``), evaluated for ``Re z <= 0`` only, so no
term can overflow; ``|e^{lambda_k dt}| <= 1``, so the scheme is stable for any ``dt``. The
only approximation is the truncation of ``u0`` and ``g`` to the grid's Fourier modes, which
for the widths used here (>= 0.08 at R = 16) is below 1e-4 relative; the tests check the
solver against the closed-form solution of a diffusing, advected Gaussian and against a
quadrature of the source's Green's-function integral, and its spectral convergence in R.

Files (``advection_diffusion_{train,test}.npz``): ``u [S, T + 1, R, R]`` float32 (axis 2
is x, axis 3 is y), ``params [S, 6]`` = (v_x, v_y, kappa, s_x, s_y, A), ``times [T + 1]``,
``param_names``, ``source_width``, ``frequency``. Each trajectory has its own random stream
``default_rng([seed, split, index])``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from flarepp.data.base import DataError
from flarepp.data.generators._io import check_counts, refuse_existing, write_atomically

STEPS = 20
DT = 0.05
FREQUENCY = 1.0
SOURCE_WIDTH = 0.08
SPEED = (0.25, 0.75)
DIFFUSIVITY = (1e-3, 1e-2)        # log-uniform
AMPLITUDE = (0.5, 2.0)
BUMPS = (2, 4)
BUMP_WIDTH = (0.08, 0.2)
PARAM_NAMES = ("velocity_x", "velocity_y", "diffusivity", "source_x", "source_y",
               "source_amplitude")
TRAIN_SPLIT, TEST_SPLIT = 0, 1
FILE_NAMES = {"train": "advection_diffusion_train.npz", "test": "advection_diffusion_test.npz"}


def grid(resolution: int) -> tuple[np.ndarray, np.ndarray]:
    """Node coordinates ``(x [R, R], y [R, R])`` of the periodic grid, ``x_ij = i / R``."""
    axis = np.arange(resolution) / resolution
    return np.meshgrid(axis, axis, indexing="ij")


def periodic_gaussian(x: np.ndarray, y: np.ndarray, centre: tuple[float, float],
                      width: float, images: int = 2) -> np.ndarray:
    """``sum_n exp(-|(x, y) - centre - n|^2 / (2 width^2))`` over periodic images
    ``n in {-images..images}^2``."""
    out = np.zeros(np.broadcast(x, y).shape)
    for nx in range(-images, images + 1):
        for ny in range(-images, images + 1):
            d2 = (x - centre[0] - nx) ** 2 + (y - centre[1] - ny) ** 2
            out += np.exp(-d2 / (2 * width ** 2))
    return out


def phi1(z: np.ndarray) -> np.ndarray:
    """``(e^z - 1) / z`` with the value 1 at ``z = 0`` (complex ``z``, ``Re z <= 0``)."""
    small = np.abs(z) < 1e-8
    safe = np.where(small, 1.0, z)
    return np.where(small, 1.0 + z / 2, np.expm1(safe) / safe)


@dataclass(frozen=True)
class Problem:
    """One trajectory's coefficients: velocity ``(v_x, v_y)``, diffusivity, the source's
    centre, width, amplitude and frequency."""

    velocity: tuple[float, float]
    diffusivity: float
    source_centre: tuple[float, float] = (0.5, 0.5)
    source_width: float = SOURCE_WIDTH
    source_amplitude: float = 0.0
    frequency: float = FREQUENCY


def solve(u0_RR: np.ndarray, problem: Problem, times: np.ndarray) -> np.ndarray:
    """States ``u [len(times), R, R]`` at ``times`` (increasing, ``times[0]`` the time of
    ``u0``) by the exact Fourier-space integrator of the module docstring, in float64."""
    u0_RR = np.asarray(u0_RR, dtype=np.float64)
    R = u0_RR.shape[0]
    if u0_RR.ndim != 2 or u0_RR.shape[1] != R:
        raise ValueError(f"u0 must be a square grid [R, R], got {list(u0_RR.shape)}")
    times = np.asarray(times, dtype=np.float64)
    if times.ndim != 1 or np.any(np.diff(times) <= 0):
        raise ValueError("times must be a 1-D increasing sequence")
    if problem.diffusivity < 0:
        raise ValueError(f"diffusivity must be >= 0, got {problem.diffusivity}")
    k = 2 * np.pi * np.fft.fftfreq(R, d=1.0 / R)
    kx, ky = np.meshgrid(k, k, indexing="ij")
    vx, vy = problem.velocity
    rate = -1j * (kx * vx + ky * vy) - problem.diffusivity * (kx ** 2 + ky ** 2)  # lambda_k
    x, y = grid(R)
    source_hat = problem.source_amplitude * np.fft.fft2(
        periodic_gaussian(x, y, problem.source_centre, problem.source_width))
    w = 2 * np.pi * problem.frequency
    u_hat = np.fft.fft2(u0_RR)
    out = np.empty((len(times), R, R))
    out[0] = u0_RR
    for j in range(1, len(times)):
        t1, dt = times[j], times[j] - times[j - 1]
        forcing = 0.5 * dt * (np.exp(1j * w * t1) * phi1((rate - 1j * w) * dt)
                              + np.exp(-1j * w * t1) * phi1((rate + 1j * w) * dt))
        u_hat = np.exp(rate * dt) * u_hat + source_hat * forcing
        out[j] = np.fft.ifft2(u_hat).real
    return out


def random_trajectory(resolution: int, rng: np.random.Generator, *, steps: int = STEPS,
                      dt: float = DT) -> tuple[np.ndarray, np.ndarray]:
    """``(u [steps + 1, R, R], params [6])`` of one random trajectory (module doc)."""
    x, y = grid(resolution)
    u0 = np.zeros((resolution, resolution))
    for _ in range(rng.integers(BUMPS[0], BUMPS[1] + 1)):
        u0 += rng.uniform(-1.0, 1.0) * periodic_gaussian(
            x, y, tuple(rng.uniform(0, 1, 2)), rng.uniform(*BUMP_WIDTH))
    speed, angle = rng.uniform(*SPEED), rng.uniform(0, 2 * np.pi)
    velocity = (speed * np.cos(angle), speed * np.sin(angle))
    diffusivity = float(np.exp(rng.uniform(*np.log(DIFFUSIVITY))))
    centre = tuple(rng.uniform(0, 1, 2))
    amplitude = rng.uniform(*AMPLITUDE)
    problem = Problem(velocity, diffusivity, centre, SOURCE_WIDTH, amplitude, FREQUENCY)
    u = solve(u0, problem, dt * np.arange(steps + 1))
    return u, np.array([*velocity, diffusivity, *centre, amplitude])


def make_advection_diffusion(out: str | Path, *, n_train: int = 1000, n_test: int = 200,
                             resolution: int | None = 32, seed: int = 0,
                             progress: bool = True, overwrite: bool = False) -> list[Path]:
    """Generate train and test trajectories in ``out``; returns the two files' paths."""
    resolution = 32 if resolution is None else int(resolution)
    if resolution < 4:
        raise ValueError(f"advection-diffusion resolution must be >= 4, got {resolution}")
    check_counts("advection-diffusion", n_train, n_test, seed)
    out = Path(out)
    paths = {split: out / name for split, name in FILE_NAMES.items()}
    refuse_existing(list(paths.values()), overwrite)
    arrays = {}
    with tqdm(total=n_train + n_test, desc=f"advection-diffusion r={resolution}",
              unit="trajectory", disable=not progress) as bar:
        for split, code, count in (("train", TRAIN_SPLIT, n_train), ("test", TEST_SPLIT, n_test)):
            u = np.empty((count, STEPS + 1, resolution, resolution), np.float32)
            params = np.empty((count, len(PARAM_NAMES)), np.float32)
            for i in range(count):
                u[i], params[i] = random_trajectory(resolution,
                                                    np.random.default_rng([seed, code, i]))
                bar.update()
            arrays[split] = dict(u=u, params=params, times=DT * np.arange(STEPS + 1),
                                 param_names=np.array(PARAM_NAMES), frequency=FREQUENCY,
                                 source_width=SOURCE_WIDTH)

    def writer(split: str):
        return lambda handle: np.savez(handle, **arrays[split])

    return write_atomically({paths[s]: writer(s) for s in FILE_NAMES})


@dataclass
class Trajectories:
    """One split as read back: ``u [S, T + 1, R, R]``, ``params [S, 6]``, ``times [T + 1]``
    and the source's width and frequency."""

    u: np.ndarray
    params: np.ndarray
    times: np.ndarray
    source_width: float = SOURCE_WIDTH
    frequency: float = FREQUENCY

    @property
    def resolution(self) -> int:
        return int(self.u.shape[-1])

    def __len__(self) -> int:
        return int(self.u.shape[0])


def read_trajectories(root: str | Path, split: str, count: int | None = None) -> Trajectories:
    """The first ``count`` trajectories (all if ``None``) of ``split`` from ``root``."""
    root = Path(root)
    path = (root.parent if root.is_file() else root) / FILE_NAMES[split]
    if not path.is_file():
        raise DataError(f"advection-diffusion: missing file {path} (make it with `flarepp "
                        f"data make advection-diffusion --out {path.parent}`)")
    with np.load(path) as f:
        missing = [k for k in ("u", "params", "times") if k not in f]
        if missing:
            raise DataError(f"{path}: missing key(s) {missing}")
        u, params, times = f["u"], f["params"], f["times"]
        width = float(f["source_width"]) if "source_width" in f else SOURCE_WIDTH
        frequency = float(f["frequency"]) if "frequency" in f else FREQUENCY
    S = u.shape[0]
    if u.ndim != 4 or u.shape[2] != u.shape[3] or params.shape != (S, len(PARAM_NAMES)) \
            or times.shape != (u.shape[1],):
        raise DataError(f"{path}: expected u [S, T+1, R, R], params [S, {len(PARAM_NAMES)}] "
                        f"and times [T+1], got {list(u.shape)}, {list(params.shape)}, "
                        f"{list(times.shape)}")
    if count is not None:
        if count > S:
            raise DataError(f"{path}: asked for {count} {split} trajectories, the file holds {S}")
        u, params = u[:count], params[:count]
    if not (np.isfinite(u).all() and np.isfinite(params).all()):
        raise DataError(f"{path}: u or params hold NaN or inf")
    return Trajectories(np.ascontiguousarray(u), np.ascontiguousarray(params), times, width,
                        frequency)


__all__ = ["FILE_NAMES", "PARAM_NAMES", "Problem", "Trajectories", "grid",
           "make_advection_diffusion", "periodic_gaussian", "phi1", "random_trajectory",
           "read_trajectories", "solve"]
