"""Contract tests generated from the mixer registry: every registered mixer gets them.

A mixer may declare ``permutation_equivariant = False`` or ``supports_mask = False`` as
class attributes; it is then checked for a clear error instead of the property. One that
declares ``stochastic_in_training = True`` is checked in eval mode.
"""


import pytest
import torch

import flarepp
from flarepp.mixers import MIXERS
from reference import assert_backend_parity

NAMES = MIXERS.names()
SMALL = dict(dim=16, heads=2, latents=4)


def make(name, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    mixer = flarepp.build_mixer(name, **{**SMALL, **kw}).to(dtype)
    # A mixer that samples in training mode (Gumbel noise, random anchors) declares
    # stochastic_in_training = True and is checked in eval mode, where it is deterministic.
    return mixer.eval() if getattr(mixer, "stochastic_in_training", False) else mixer


def supports_mask(mixer):
    return getattr(mixer, "supports_mask", True)


def equivariant(mixer):
    return getattr(mixer, "permutation_equivariant", True)


@pytest.mark.parametrize("name", NAMES)
def test_shape_backward_every_parameter_gets_gradient(name):
    """[B, N, C] -> [B, N, C]; a parameter without a gradient is dead code in the mixer."""
    mixer = make(name, torch.float32)
    x = torch.randn(2, 23, SMALL["dim"], requires_grad=True)
    y = mixer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.square().mean().backward()
    for pname, p in mixer.named_parameters():
        assert p.grad is not None, f"{name}: parameter {pname} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient in {pname}"
    assert torch.isfinite(x.grad).all()


# Mixers that make no softmax call through the attention backend (their attention is not a
# softmax over one token set, or is computed in a causal scan), so the backend parity below
# checks nothing for them; each is checked against its own explicit float64 form instead,
# in the test file named here.
NO_BACKEND_CALLS = {
    "linear-attention": "test_linear_mixers.py", "performer": "test_linear_mixers.py",
    "cosformer": "test_linear_mixers.py", "multilinear": "test_higher_order.py",
    "triple": "test_higher_order.py", "flare-causal": "test_causal.py",
    "flarepp-causal": "test_causal.py", "attention-causal": "test_causal.py",
}


@pytest.mark.parametrize("name", NAMES)
def test_fused_matches_explicit_backend(name):
    """The fused attention calls equal explicit softmaxes inside the whole mixer (float64,
    1e-10, forward and gradients of input and every parameter). A mixer whose attention
    makes no backend call must be listed in NO_BACKEND_CALLS with the test file that checks
    its explicit form: a mixer that silently lost its backend calls fails here."""
    fused = make(name)
    x = torch.randn(2, 19, SMALL["dim"], dtype=torch.float64)
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[1, 13:] = False
    mask = mask if supports_mask(fused) else None
    calls = assert_backend_parity(fused, x, mask)
    if name in NO_BACKEND_CALLS:
        assert calls == 0, f"{name} now calls the backend: remove it from NO_BACKEND_CALLS"
        import pathlib
        assert (pathlib.Path(__file__).parent / NO_BACKEND_CALLS[name]).is_file()
    else:
        assert calls > 0, (f"{name} made no attention-backend call, so this parity test "
                           "checked nothing; list it in NO_BACKEND_CALLS with the test file "
                           "of its explicit form")


@pytest.mark.parametrize("name", NAMES)
def test_permutation_equivariance(name):
    """Permuting the tokens permutes the outputs: mesh points carry no order."""
    mixer = make(name)
    x = torch.randn(2, 21, SMALL["dim"], dtype=torch.float64)
    perm = torch.randperm(21)
    if not equivariant(mixer):
        # Declared order-dependent (e.g. AB-UPT's anchors once N > anchors): it must still
        # be a deterministic function of its input in eval mode.
        torch.testing.assert_close(mixer(x), mixer(x.clone()), rtol=0, atol=0)
        return
    torch.testing.assert_close(mixer(x)[:, perm], mixer(x[:, perm]), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_masked_tokens_are_invisible(name):
    """Appending masked tokens, whatever their values (1e6), leaves real tokens' outputs
    unchanged; masked outputs are zero."""
    mixer = make(name)
    x = torch.randn(2, 15, SMALL["dim"], dtype=torch.float64)
    if not supports_mask(mixer):
        with pytest.raises(ValueError, match="mask"):
            mixer(x, mask=torch.ones(2, 15, dtype=torch.bool))
        return
    junk = torch.full((2, 6, SMALL["dim"]), 1e6, dtype=torch.float64)
    junk[1] = torch.randn(6, SMALL["dim"]) * 1e6
    padded = torch.cat([x, junk], dim=1)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[:, 15:] = False
    y = mixer(padded, mask=mask)
    torch.testing.assert_close(y[:, :15], mixer(x), rtol=1e-6, atol=1e-6)
    assert (y[:, 15:] == 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_padded_batch_equals_one_at_a_time(name):
    """Two meshes of different N padded into one batch equal the two run separately."""
    mixer = make(name)
    a = torch.randn(1, 11, SMALL["dim"], dtype=torch.float64)
    b = torch.randn(1, 17, SMALL["dim"], dtype=torch.float64)
    batch = torch.zeros(2, 17, SMALL["dim"], dtype=torch.float64)
    batch[0, :11], batch[1] = a[0], b[0]
    mask = torch.zeros(2, 17, dtype=torch.bool)
    mask[0, :11], mask[1] = True, True
    if not supports_mask(mixer):  # declared: a mask must be refused, not ignored
        with pytest.raises(ValueError, match="mask"):
            mixer(batch, mask=mask)
        return
    y = mixer(batch, mask=mask)
    torch.testing.assert_close(y[0:1, :11], mixer(a), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y[1:2], mixer(b), rtol=1e-10, atol=1e-10)


def _fp16_autocast_works():
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.nn.functional.scaled_dot_product_attention(
                *(torch.randn(1, 1, 4, 8) for _ in range(3)))
        return True
    except RuntimeError:
        return False


DTYPES = [torch.bfloat16] + ([torch.float16] if _fp16_autocast_works() else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_mixed_precision_finite_at_4096(name, dtype):
    """Under 16-bit autocast at N = 4096, outputs and gradients stay finite."""
    mixer = make(name, torch.float32, dim=32, heads=4, latents=16,
                 norm="rmsnorm")
    x = torch.randn(1, 4096, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        y = mixer(x)
    assert torch.isfinite(y.float()).all()
    y.float().square().mean().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in mixer.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", NAMES)
def test_in_backbone(name):
    """Every mixer runs inside the surrogate backbone with a padding mask."""
    model = flarepp.build_model(mixer=name, in_dim=3, out_dim=2, blocks=2, **SMALL)
    x = torch.randn(2, 13, 3)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[0, 9:] = False
    y = model(x, mask=mask if supports_mask(model.blocks[0].mixer) else None)
    assert y.shape == (2, 13, 2) and torch.isfinite(y).all()
