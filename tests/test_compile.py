"""``flarepp.compile_model`` (``--compile``): the compiled model computes what the eager one
does, outputs and gradients, on the device at hand (inductor's C++ backend on the CPU)."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from flarepp.models import build_model
from flarepp.models.backbone import compile_model

# Inductor compiles C++ for each graph (forward and backward of every block kind): minutes
# on a shared 2-core machine (measured 7 min here), hence ``slow``.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None
                                 and not torch.cuda.is_available(),
                                 reason="inductor on the CPU needs a C++ compiler")]


def test_compiled_model_matches_eager_outputs_and_gradients():
    """FLARE++ (all three SDPA calls, per-head norms, the FP32 gated sum) with a padding
    mask, float32: a failure means a compiled block computes something else than the eager
    block (a graph break is not a failure; a wrong fusion or a dropped mask is)."""
    torch.manual_seed(0)
    eager = build_model(mixer="flarepp", in_dim=3, out_dim=2, dim=16, heads=2, blocks=2,
                        latents=4)
    with torch.no_grad():  # move every parameter off its structured init
        for p in eager.parameters():
            p.add_(0.1 * torch.randn_like(p))
    compiled = compile_model(copy.deepcopy(eager))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 40, 3, generator=g)
    mask = torch.rand(2, 40, generator=g) > 0.25
    mask[:, 0] = True
    cot = torch.randn(2, 40, 2, generator=g)
    results = []
    for model in (eager, compiled):
        xi = x.clone().requires_grad_(True)
        y = model(xi, mask)
        y.backward(cot)
        results.append((y.detach(), xi.grad, {n: p.grad for n, p in model.named_parameters()}))
    (y0, gx0, gp0), (y1, gx1, gp1) = results
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y1, y0, **tol)
    torch.testing.assert_close(gx1, gx0, **tol)
    assert gp1.keys() == gp0.keys()
    for name in gp0:
        torch.testing.assert_close(gp1[name], gp0[name], **tol, msg=lambda m: f"{name}: {m}")
