"""Contract tests generated from the model registry: every registered architecture gets them.

Tiny sizes (C=16, H=2, B=2, M=4) so the whole file runs in seconds. An architecture may
declare ``permutation_equivariant = False`` or ``supports_mask = False`` as class
attributes; it is then checked for a clear error (masks) or skipped (equivariance).
"""

import dataclasses

import pytest
import torch

import flarepp
from flarepp.models import MODELS
from flarepp.ops import AttentionBackend
from reference import assert_backend_parity

# Point-cloud models ([B, N, in] -> [B, N, out]); token classifiers (input_kind "tokens")
# have their own contract in test_sequence_model.py.
NAMES = [n for n in MODELS.names() if getattr(MODELS.get(n), "input_kind", "points") == "points"]
TINY = dict(dim=16, heads=2, blocks=2, latents=4)
IN, OUT = 3, 2


def make(name, dtype=torch.float64):
    """The architecture at tiny sizes, passing only the settings its config has."""
    torch.manual_seed(0)
    fields = {f.name for f in dataclasses.fields(MODELS.get(name).config_cls)}
    kwargs = {k: v for k, v in TINY.items() if k in fields}
    model = flarepp.build_model(arch=name, in_dim=IN, out_dim=OUT, **kwargs).to(dtype)
    with torch.no_grad():  # move off the init (zero biases, unit norms) so every term matters
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def supports_mask(model):
    return getattr(model, "supports_mask", True)


def has_backend(model):
    return any(isinstance(getattr(m, "backend", None), AttentionBackend)
               for m in model.modules())


@pytest.mark.parametrize("name", NAMES)
def test_shape_backward_every_parameter_gets_gradient(name):
    """[B, N, in] -> [B, N, out], finite; a parameter without a gradient is dead code."""
    model = make(name, torch.float32)
    x = torch.randn(2, 23, IN, requires_grad=True)
    y = model(x)
    assert y.shape == (2, 23, OUT) and torch.isfinite(y).all()
    y.square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{name}: parameter {pname} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient in {pname}"
    assert torch.isfinite(x.grad).all()


BACKEND_NAMES = [n for n in NAMES if has_backend(make(n))]


def test_models_without_attention_backend_are_the_known_ones():
    """Only GNOT (normalised linear attention, no softmax: nothing for an explicit softmax
    backend to replace) runs without a backend; its attention is checked against its own
    definition in test_comparison_models.py. A new model missing here lost its backend."""
    assert sorted(set(NAMES) - set(BACKEND_NAMES)) == ["gnot"]


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_fused_matches_explicit_backend(name):
    """Every attention call through the backend equals an explicit softmax inside the whole
    model (float64, 1e-10, outputs and all gradients); a failure points to a backend call
    with the wrong operand order, scale or mask."""
    fused = make(name)
    x = torch.randn(2, 19, IN, dtype=torch.float64)
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[1, 13:] = False
    mask = mask if supports_mask(fused) else None
    assert_backend_parity(fused, x, mask)


@pytest.mark.parametrize("name", NAMES)
def test_permutation_equivariance(name):
    """Permuting the mesh points permutes the outputs: points carry no order."""
    model = make(name)
    x = torch.randn(2, 21, IN, dtype=torch.float64)
    perm = torch.randperm(21)
    if not getattr(model, "permutation_equivariant", True):
        # Declared order-dependent (e.g. AB-UPT's anchors once N > anchors): it must still
        # be a deterministic function of its input in eval mode.
        torch.testing.assert_close(model(x), model(x.clone()), rtol=0, atol=0)
        return
    torch.testing.assert_close(model(x)[:, perm], model(x[:, perm]), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_masked_points_are_invisible(name):
    """Appending masked points with huge values leaves the real points' outputs unchanged
    and gives zero at the masked ones; a failure means padding leaks into a sum over points
    (an encode, a slice, a normaliser) or a masked output escaped zeroing."""
    model = make(name)
    x = torch.randn(2, 15, IN, dtype=torch.float64)
    if not supports_mask(model):
        with pytest.raises(ValueError, match="mask"):
            model(x, mask=torch.ones(2, 15, dtype=torch.bool))
        return
    junk = torch.full((2, 6, IN), 1e6, dtype=torch.float64)
    junk[1] = torch.randn(6, IN) * 1e6
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[:, 15:] = False
    y = model(torch.cat([x, junk], dim=1), mask=mask)
    torch.testing.assert_close(y[:, :15], model(x), rtol=1e-8, atol=1e-8)
    assert (y[:, 15:] == 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_padded_batch_equals_one_at_a_time(name):
    """Two meshes of different N padded into one batch equal the two run separately."""
    model = make(name)
    a = torch.randn(1, 11, IN, dtype=torch.float64)
    b = torch.randn(1, 17, IN, dtype=torch.float64)
    batch = torch.zeros(2, 17, IN, dtype=torch.float64)
    batch[0, :11], batch[1] = a[0], b[0]
    mask = torch.zeros(2, 17, dtype=torch.bool)
    mask[0, :11], mask[1] = True, True
    if not supports_mask(model):  # declared: a mask must be refused, not ignored
        with pytest.raises(ValueError, match="mask"):
            model(batch, mask=mask)
        return
    y = model(batch, mask=mask)
    torch.testing.assert_close(y[0:1, :11], model(a), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y[1:2], model(b), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_rebuilds_from_its_config(name):
    """``model_from_config(model.config.to_dict())`` rebuilds the same architecture (what a
    checkpoint stores); a failure means ``to_dict`` lost the arch name or a setting."""
    model = make(name)
    assert model.config.to_dict()["arch"] == name
    clone = flarepp.model_from_config(model.config.to_dict()).to(torch.float64)
    clone.load_state_dict(model.state_dict())
    x = torch.randn(1, 9, IN, dtype=torch.float64)
    torch.testing.assert_close(model(x), clone(x))


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_width_is_named(name):
    """A wrong channel count says which shape was expected."""
    model = make(name)
    with pytest.raises(ValueError, match=rf"\[B, N, {IN}\]"):
        model(torch.randn(1, 5, IN + 1, dtype=torch.float64))
