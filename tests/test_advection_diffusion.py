"""The advection-diffusion generator (flarepp.data.generators.advection_diffusion): the
solver against closed-form and quadrature solutions, its convergence, and the files."""

import numpy as np
import pytest
from scipy.integrate import quad

from flarepp.cli import main as cli
from flarepp.data import DataError
from flarepp.data.generators.advection_diffusion import (Problem, grid,
                                                         make_advection_diffusion,
                                                         periodic_gaussian, random_trajectory,
                                                         read_trajectories, solve)

VELOCITY, KAPPA, CENTRE, WIDTH = (0.6, -0.3), 0.005, (0.3, 0.6), 0.07


def gaussian_solution(R, t):
    """A Gaussian of width s0 advected by v and diffused by kappa on the periodic square:
    ``(s0^2 / s(t)^2) G(x - c - v t; s(t))`` with ``s(t)^2 = s0^2 + 2 kappa t``."""
    x, y = grid(R)
    s2 = WIDTH ** 2 + 2 * KAPPA * t
    centre = ((CENTRE[0] + VELOCITY[0] * t) % 1.0, (CENTRE[1] + VELOCITY[1] * t) % 1.0)
    return WIDTH ** 2 / s2 * periodic_gaussian(x, y, centre, np.sqrt(s2))


def gaussian_error(R, times=(0.0, 0.4, 1.0)):
    x, y = grid(R)
    u = solve(periodic_gaussian(x, y, CENTRE, WIDTH), Problem(VELOCITY, KAPPA), np.array(times))
    return max(np.abs(u[i] - gaussian_solution(R, t)).max() for i, t in enumerate(times))


def test_advected_diffusing_gaussian_matches_closed_form():
    """The exact Fourier integrator reproduces the closed-form solution to rounding once
    the Gaussian is resolved (R >= 24), after several periods of travel across the
    periodic square. A failure points to a sign or a 2 pi in the propagator."""
    assert gaussian_error(32) < 1e-12
    assert gaussian_error(24, times=tuple(np.linspace(0, 3.0, 7))) < 1e-12


def test_spectral_convergence_in_resolution():
    """The only error is the grid's truncation of the initial Gaussian: it falls faster
    than any power of R. The observed order ``log(e_a / e_b) / log(R_b / R_a)`` of each
    refinement grows (7, 18, 29 here) instead of settling at a finite order."""
    sizes = (8, 12, 16, 20)
    errors = [gaussian_error(R) for R in sizes]
    orders = [np.log(ea / eb) / np.log(rb / ra) for ea, eb, ra, rb
              in zip(errors, errors[1:], sizes, sizes[1:])]
    assert errors[0] > 1e-3 and errors[-1] < 1e-7, errors
    assert all(b > a + 5 for a, b in zip(orders, orders[1:])) and orders[-1] > 20, orders


def test_pulsating_source_matches_greens_function_quadrature():
    """From u = 0, the state is the source's Green's-function integral,
    ``int_0^T A cos(2 pi f s) (w^2 / w(T-s)^2) G(x - c - v (T - s); w(T-s)) ds``, evaluated
    independently by adaptive quadrature at a few points (1e-10). Checks the closed-form
    source term of every step, for many steps and for one big step alike."""
    R = 32
    x, y = grid(R)
    problem = Problem(VELOCITY, KAPPA, (0.5, 0.4), 0.06, 2.0, 1.0)
    T = 0.7
    many = solve(np.zeros((R, R)), problem, np.linspace(0, T, 15))[-1]
    one = solve(np.zeros((R, R)), problem, np.array([0.0, T]))[-1]
    np.testing.assert_allclose(one, many, rtol=0, atol=1e-12)  # step-size independent
    w = problem.source_width
    for i, j in ((16, 13), (20, 14), (5, 27)):
        def integrand(s, i=i, j=j):
            s2 = w ** 2 + 2 * KAPPA * (T - s)
            centre = (0.5 + VELOCITY[0] * (T - s), 0.4 + VELOCITY[1] * (T - s))
            return (problem.source_amplitude * np.cos(2 * np.pi * problem.frequency * s)
                    * w ** 2 / s2 * periodic_gaussian(x[i, j], y[i, j], centre, np.sqrt(s2)))
        value = quad(integrand, 0, T, epsabs=1e-13, epsrel=1e-12, limit=200)[0]
        assert abs(many[i, j] - value) < 1e-10, (i, j, many[i, j], value)


def test_stable_for_any_step():
    """Every mode's propagator has modulus <= 1 and the source term is evaluated only where
    it cannot overflow: one step of t = 50 (1000 x the data's dt) equals 1000 steps of 0.05;
    without the source the state then holds only its mean (every other mode decayed)."""
    R = 16
    x, y = grid(R)
    u0 = periodic_gaussian(x, y, CENTRE, 0.1)
    forced = Problem(VELOCITY, KAPPA, (0.2, 0.7), 0.08, 3.0, 1.0)
    one = solve(u0, forced, np.array([0.0, 50.0]))[-1]
    many = solve(u0, forced, np.linspace(0.0, 50.0, 1001))[-1]
    assert np.isfinite(one).all()
    np.testing.assert_allclose(one, many, rtol=0, atol=1e-10)
    free = solve(u0, Problem(VELOCITY, 0.05), np.array([0.0, 50.0]))[-1]
    np.testing.assert_allclose(free, u0.mean(), rtol=0, atol=1e-12)


def test_files_are_deterministic_per_trajectory(tmp_path, capsys):
    """`flarepp data make advection-diffusion` writes both splits; trajectory i does not
    depend on how many are generated; the reader checks counts and names missing files."""
    assert cli(["data", "make", "advection-diffusion", "--out", str(tmp_path / "a"),
                "--train", "3", "--test", "2", "--resolution", "8", "--quiet"]) == 0
    make_advection_diffusion(tmp_path / "b", n_train=1, n_test=1, resolution=8, seed=0,
                             progress=False)
    a, b = read_trajectories(tmp_path / "a", "train"), read_trajectories(tmp_path / "b", "train")
    assert a.u.shape == (3, 21, 8, 8) and a.params.shape == (3, 6)
    np.testing.assert_array_equal(a.u[0], b.u[0])
    np.testing.assert_array_equal(a.params[0], b.params[0])
    u, _ = random_trajectory(8, np.random.default_rng([0, 1, 1]))
    np.testing.assert_allclose(read_trajectories(tmp_path / "a", "test").u[1], u, rtol=1e-6,
                               atol=1e-6)
    assert a.times[1] == pytest.approx(0.05) and a.source_width == pytest.approx(0.08)
    with pytest.raises(DataError, match="asked for 5 train trajectories"):
        read_trajectories(tmp_path / "a", "train", 5)
    with pytest.raises(DataError, match="missing file"):
        read_trajectories(tmp_path, "test")
