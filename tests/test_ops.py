"""The functional primitives against explicit-softmax references (float64, 1e-10)."""

import pytest
import torch

from flarepp.ops import decode, encode, encode_with_lse, merge_partials
from reference import explicit_decode, explicit_encode, explicit_encode_lse

B, H, M, N, D = 2, 3, 5, 17, 4
TOL = dict(rtol=1e-10, atol=1e-10)


def _inputs(n=N, requires_grad=True):
    g = torch.Generator().manual_seed(1)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_(requires_grad)
    mask = torch.rand(B, n, generator=g) > 0.3
    mask[:, 0] = True
    return mk(B, H, M, D), mk(B, H, n, D), mk(B, H, n, D), mask


def _grads(out, inputs, cot):
    return torch.autograd.grad(out, inputs, cot)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("scale", [None, 1.0])
def test_encode_matches_explicit(masked, scale):
    """encode = softmax over the N real tokens; a failure means the fused path or the
    mask handling (excluded keys) differs from the paper's encoder."""
    q, k, v, mask = _inputs()
    mask = mask if masked else None
    z = encode(q, k, v, mask, scale=scale)
    ref = explicit_encode(q, k, v, mask, scale=scale)
    torch.testing.assert_close(z, ref, **TOL)
    cot = torch.randn_like(z)
    for a, b in zip(_grads(z, (q, k, v), cot), _grads(ref, (q, k, v), cot)):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("masked", [False, True])
def test_decode_matches_explicit(masked):
    """decode = softmax over M latents; masked tokens' outputs must be exactly zero."""
    q, k, _, mask = _inputs()
    mask = mask if masked else None
    z = torch.randn(B, H, M, D, dtype=torch.float64, requires_grad=True)
    y = decode(k, q, z, mask)
    ref = explicit_decode(k, q, z, mask)
    torch.testing.assert_close(y, ref, **TOL)
    if masked:
        assert (y[~mask[:, None, :, None].expand_as(y)] == 0).all()
    cot = torch.randn_like(y)
    for a, b in zip(_grads(y, (k, q, z), cot), _grads(ref, (k, q, z), cot)):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("masked", [False, True])
def test_encode_with_lse_forward_and_both_cotangents(masked):
    """(Z, L) and the B.5 backward with cotangents of both Z and L; a failure in the
    gradient points at the padded-column trick in _FusedEncodeWithLSE.backward."""
    q, k, v, mask = _inputs()
    mask = mask if masked else None
    z, lse = encode_with_lse(q, k, v, mask)
    zr, lr = explicit_encode_lse(q, k, v, mask)
    torch.testing.assert_close(z, zr, **TOL)
    torch.testing.assert_close(lse, lr, **TOL)
    cz, cl = torch.randn_like(z), torch.randn_like(lse)
    got = torch.autograd.grad((z * cz).sum() + (lse * cl).sum(), (q, k, v))
    want = torch.autograd.grad((zr * cz).sum() + (lr * cl).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


def test_encode_with_lse_empty_and_fully_masked_rows():
    """An empty shard or a fully masked sample gives L = -inf, Z = 0 and finite gradients
    (Appendix B.3's rule); NaN here would poison a context-parallel merge."""
    q, k, v, mask = _inputs()
    mask[1] = False
    z, lse = encode_with_lse(q, k, v, mask)
    assert torch.isneginf(lse[1]).all() and (z[1] == 0).all() and torch.isfinite(lse[0]).all()
    g = torch.autograd.grad(z.sum() + torch.where(torch.isfinite(lse), lse, 0).sum(), (q, k, v))
    assert all(torch.isfinite(t).all() for t in g)
    z0, l0 = encode_with_lse(q, k[:, :, :0], v[:, :, :0])
    assert torch.isneginf(l0).all() and (z0 == 0).all()


def test_merge_partials_is_exact():
    """Merging encodes of disjoint token chunks (one empty, one fully masked) equals the
    encode of all tokens: the log-sum-exp rule of eq. 33."""
    q, k, v, mask = _inputs(n=12)
    mask[:, 4:8] = False  # chunk 1 fully masked
    bounds = [(0, 4), (4, 8), (8, 8), (8, 12)]
    parts = [encode_with_lse(q, k[:, :, a:b], v[:, :, a:b], mask[:, a:b]) for a, b in bounds]
    z, lse = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    zr, lr = explicit_encode_lse(q, k, v, mask)
    torch.testing.assert_close(z, zr, **TOL)
    torch.testing.assert_close(lse, lr, **TOL)
    zs, ls = merge_partials(torch.zeros(2, 1, 1, 1, 2), torch.full((2, 1, 1, 1), float("-inf")))
    assert (zs == 0).all() and torch.isneginf(ls).all()


def test_fused_path_never_materialises_scores():
    """The default encode runs on fused SDPA: memory for N = 2^17 tokens with M = 64 must
    not scale like N x M x heads floats (it would be 256 MiB here)."""
    from torch.profiler import ProfilerActivity, profile
    q = torch.randn(1, 8, 64, 16)
    k = torch.randn(1, 8, 2 ** 17, 16)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        encode(q, k, k)
    peak = max((e.cpu_memory_usage for e in prof.key_averages()), default=0)
    assert peak < 8 * 64 * 2 ** 17 * 4 / 4, f"encode allocated {peak} bytes"
