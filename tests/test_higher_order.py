"""Multilinear and triple attention (flarepp.mixers.higher_order) against explicit forms."""

import pytest
import torch

import flarepp
from flarepp.mixers.higher_order import TripleAttention
from flarepp.ops import AttentionBackend
from reference import (_heads, _lin, _split_weights, explicit_multilinear, explicit_triple,
                       reference_higher_order_mixer)

SMALL = dict(dim=16, heads=2, latents=4)
VARIANTS = [("multilinear", {"order": 1}), ("multilinear", {"order": 2}),
            ("multilinear", {"order": 3}), ("triple", {})]
IDS = ["multilinear-1", "multilinear-2", "multilinear-3", "triple"]


def make(name, **kw):
    torch.manual_seed(0)
    mixer = flarepp.build_mixer(name, **{**SMALL, **kw}).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mixer


@pytest.mark.parametrize("name,kw", VARIANTS, ids=IDS)
def test_equals_the_token_tuple_sums(name, kw):
    """Forward and all gradients equal the explicit forms (float64, 1e-10): the
    linearised L-simplicial sum over L-tuples of tokens (multilinear) and the token-pair
    kernel ``(q1 . k1)(q2 . k2)`` (triple), 1/N-scaled over real tokens, with padding and
    a masked token inside a sequence. A failure points to the state factorisation, the
    scaling or the mask."""
    mixer = make(name, **kw)
    x = torch.randn(2, 9, SMALL["dim"], dtype=torch.float64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    mask[0, 2] = False
    params = list(mixer.parameters())
    for m in (None, mask):
        outs = []
        for fn in (lambda xi: mixer(xi, mask=m),
                   lambda xi: reference_higher_order_mixer(name, mixer, xi, m)):
            xi = x.clone().requires_grad_(True)
            y = fn(xi)
            cot = torch.sin(torch.arange(y.numel(), dtype=y.dtype)).view_as(y)
            outs.append((y, torch.autograd.grad(y, [xi] + params, cot)))
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-10, atol=1e-10)
        for a, b in zip(outs[0][1], outs[1][1]):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_triple_attention_is_the_talks_d_cubed_state():
    """The talk's formulas literally: ``S_ijk = (1/N) sum_n K1_ni V_nj K2_nk`` as a
    D x D x D tensor and ``Y_nj = sum_ik Q1_ni S_ijk Q2_nk``, per head."""
    mixer = make("triple")
    x = torch.randn(2, 11, SMALL["dim"], dtype=torch.float64)
    q1, q2, k1, k2, v = (_heads(_lin(x, w, None), SMALL["heads"])
                         for w, _ in _split_weights(mixer.qkv_proj, 5))
    state = torch.einsum("bhni,bhnj,bhnk->bhijk", k1, v, k2) / 11          # [B, H, D, D, D]
    y = torch.einsum("bhni,bhijk,bhnk->bhnj", q1, state, q2)
    torch.testing.assert_close(y, explicit_triple(q1, q2, k1, k2, v), rtol=1e-12, atol=1e-12)
    out = mixer.out_proj(y.transpose(1, 2).reshape(2, 11, -1))
    torch.testing.assert_close(mixer(x), out, rtol=1e-12, atol=1e-12)


def test_multilinear_is_q_times_the_hadamard_product_of_states():
    """``Y = Q (S_1 ⊙ S_2)``, ``S_l = K_l^T V_l / N``, equals the 2-simplicial tuple sum."""
    q, k1, v1, k2, v2 = (torch.randn(1, 2, 7, 4, dtype=torch.float64) for _ in range(5))
    s1, s2 = k1.transpose(-1, -2) @ v1 / 7, k2.transpose(-1, -2) @ v2 / 7
    torch.testing.assert_close(q @ (s1 * s2), explicit_multilinear(q, [k1, k2], [v1, v2]),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,kw", VARIANTS, ids=IDS)
def test_fully_masked_sample_gives_zeros(name, kw):
    """N = 0 real tokens: zero output and finite gradients, not 0/0."""
    mixer = make(name, **kw)
    x = torch.randn(2, 5, SMALL["dim"], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1] = False
    y = mixer(x, mask=mask)
    assert (y[1] == 0).all() and torch.isfinite(y).all()
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_output_does_not_grow_with_n():
    """With the 1/N scaling the output of i.i.d. tokens stays O(1) as N grows 100-fold
    (an unscaled order-3 state would grow like N^3)."""
    mixer = make("multilinear", order=3)
    sizes = [mixer(torch.randn(1, n, SMALL["dim"], dtype=torch.float64)).abs().mean().item()
             for n in (50, 5000)]
    assert 0.2 < sizes[1] / sizes[0] < 5, sizes


def test_features_are_the_outer_product():
    a, b = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    phi = TripleAttention.features(a, b).view(1, 1, 3, 4, 4)
    torch.testing.assert_close(phi, a[..., :, None] * b[..., None, :])


class RaisingBackend(AttentionBackend):
    name = "raising"

    def encode(self, *args, **kwargs):
        raise AssertionError("encode called")

    decode = self_attention = encode


@pytest.mark.parametrize("name,kw", VARIANTS, ids=IDS)
def test_no_attention_backend_is_involved(name, kw):
    """No softmax, so no backend call: the registry's backend-parity test is vacuous for
    these mixers, and the explicit-form tests above are what checks them."""
    mixer = make(name, **kw)
    flarepp.set_backend(mixer, RaisingBackend())
    assert torch.isfinite(mixer(torch.randn(1, 6, SMALL["dim"], dtype=torch.float64))).all()


def test_order_must_be_positive():
    with pytest.raises(ValueError, match="order"):
        flarepp.build_mixer("multilinear", order=0)
