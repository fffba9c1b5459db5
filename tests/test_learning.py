"""A small FLARE++ learns a closed-form operator: the solution map of 1-D Poisson.

Shape letters: B batch, N points, K sine modes.

Problem. ``-u''(x) = f(x)`` on ``(0, 1)``, ``u(0) = u(1) = 0``, whose solution map is the
integral operator ``u(x) = int_0^1 G(x, s) f(s) ds`` with Green's function
``G(x, s) = min(x, s) (1 - max(x, s))``. Forcings are ``f = sum_k a_k sin(k pi x)``,
``k = 1..K``, ``a_k ~ N(0, 1)`` independent, so ``u = sum_k a_k sin(k pi x) / (k pi)^2``
exactly. The model sees N interior points ``x_i = i / (N + 1)`` with features
``(x_i, f(x_i))`` and predicts ``u(x_i)``.

Bound, derived without the model. ``u(x_i)`` depends on f everywhere (G is dense), so a
model that does not move information between points predicts ``u(x_i)`` from
``(x_i, f(x_i))`` alone. ``(f(x_i), u(x_i))`` is a zero-mean Gaussian pair, so the best such
predictor in mean square is linear: ``E[u_i | f_i] = alpha_i f_i`` with
``alpha_i = sum_k s_ki^2 / (k pi)^2 / sum_k s_ki^2``, ``s_ki = sin(k pi x_i)``. Its relative
L2 error on the held-out forcings, computed in closed form below, is about 0.96 (it is no
better than predicting zero, 1.0). The test asks the trained model for a quarter of it.
"""

from __future__ import annotations

import math

import pytest
import torch

import flarepp

N, K = 32, 4
STEPS, BATCH, LR = 400, 32, 3e-3

x_N = torch.arange(1, N + 1, dtype=torch.float64) / (N + 1)
k_K = torch.arange(1, K + 1, dtype=torch.float64)
modes_KN = torch.sin(math.pi * k_K[:, None] * x_N[None, :])


def forcing_and_solution(a_BK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forcings ``f [B, N]`` of sine coefficients ``a [B, K]`` and their exact solutions."""
    return a_BK @ modes_KN, (a_BK / (math.pi * k_K) ** 2) @ modes_KN


def poisson_pairs(count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` random forcings and their solutions, ``a_k ~ N(0, 1)``."""
    return forcing_and_solution(torch.randn(count, K, generator=generator,
                                            dtype=torch.float64))


def features(f_BN: torch.Tensor) -> torch.Tensor:
    """``[B, N, 2]``: position and forcing, f scaled to O(1)."""
    return torch.stack([x_N.expand_as(f_BN), f_BN / 2], dim=-1).float()


def relative_l2(pred_BN: torch.Tensor, u_BN: torch.Tensor) -> float:
    """The project's metric: mean over samples of ``||pred - u|| / ||u||``."""
    return ((pred_BN - u_BN).norm(dim=1) / u_BN.norm(dim=1)).mean().item()


def test_data_is_the_greens_function_solution():
    """The closed-form u equals ``int G(x, s) f(s) ds`` (trapezoid rule, 4001 nodes) at the
    model's points: a failure means the test's data is not the Poisson solution map."""
    a_BK = torch.randn(3, K, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    _, u_BN = forcing_and_solution(a_BK)
    s = torch.linspace(0, 1, 4001, dtype=torch.float64)
    f_BS = a_BK @ torch.sin(math.pi * k_K[:, None] * s[None, :])
    green_NS = (torch.minimum(x_N[:, None], s[None, :])
                * (1 - torch.maximum(x_N[:, None], s[None, :])))
    integral_BN = torch.trapezoid(green_NS[None] * f_BS[:, None, :], s, dim=-1)
    torch.testing.assert_close(integral_BN, u_BN, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_flarepp_fits_the_poisson_solution_map():
    """A 2-block FLARE++ surrogate (C=32, H=4, M=8, 25k parameters), trained for 400 Adam
    steps (OneCycle, lr 3e-3, gradient clipping 1.0) on fresh batches of 32 forcings, predicts
    u on 256 held-out forcings to a relative L2 error below a quarter of the best error any
    model without token mixing can reach (module docstring; measured: 0.096 against a
    bound of 0.240; 0.088-0.106 with seeds 1-3 of the model and the batches).

    A failure points to token mixing that does not carry information between points (an
    encode or decode over the wrong axis, a routing that ignores the keys, a mask that drops
    points), to gradients that do not reach the mixer, or to an initialisation or norm that
    stops this budget from optimising."""
    f_test, u_test = poisson_pairs(256, torch.Generator().manual_seed(1))
    s_KN = modes_KN ** 2
    alpha_N = (s_KN / (math.pi * k_K[:, None]) ** 2).sum(0) / s_KN.sum(0)
    pointwise_error = relative_l2(alpha_N * f_test, u_test)
    assert 0.9 < pointwise_error < 1.0  # the derivation's number, before any training

    torch.manual_seed(0)
    model = flarepp.build_model(mixer="flarepp", in_dim=2, out_dim=1, dim=32, heads=4,
                                blocks=2, latents=8)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=STEPS,
                                                   pct_start=0.1)
    batches = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        f_BN, u_BN = poisson_pairs(BATCH, batches)
        # pi^2 u is O(1): the first mode's solution is a_1 sin(pi x) / pi^2
        loss = (model(features(f_BN))[..., 0] - math.pi ** 2 * u_BN.float()).square().mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    with torch.no_grad():
        pred = model(features(f_test))[..., 0].double() / math.pi ** 2
    error = relative_l2(pred, u_test)
    assert error < pointwise_error / 4, (
        f"relative L2 {error:.3f} after {STEPS} steps; bound {pointwise_error / 4:.3f} "
        f"(a quarter of the best pointwise error {pointwise_error:.3f})")
