"""The comparison mixers and models against their papers' equations, written out explicitly.

Transolver / Transolver-3 / Transolver++ (physics attention, Ada-Temp, Rep-Slice), AB-UPT
anchor attention and its anchor sampling, Luna's nested attention with the carried packed
stream, Set Transformer's ISAB and GNOT's normalized attention; float64, tiny sizes.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import flarepp
from flarepp.mixers import transolver as transolver_module
from flarepp.models.gnot import NormalizedAttention
from reference import explicit_self_attention, masked_softmax

C, H, M = 16, 2, 4
D = C // H


def heads(t):
    B, N, _ = t.shape
    return t.view(B, N, H, -1).transpose(1, 2)


def unheads(t):
    B, _, N, _ = t.shape
    return t.transpose(1, 2).reshape(B, N, -1)


def jitter(module, scale=0.1):
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn_like(p))
    return module


def mixer(name, **kw):
    torch.manual_seed(0)
    return jitter(flarepp.build_mixer(name, dim=C, heads=H, latents=M, **kw).double())


def masked(n_real_first=9, n=13):
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, n_real_first:] = False
    return mask


# ---------------------------------------------------------------------------------------
# The Transolver family


def physics_attention_reference(m, x, weights_fn, features, mask):
    """Slice, attend among slices, deslice, project (Wu et al., 2024, Sec. 3.1)."""
    w = weights_fn()
    if mask is not None:
        w = w * mask[:, None, :, None]
    s = torch.einsum("bhnm,bhnd->bhmd", w, features) / (w.sum(2)[..., None] + 1e-5)
    wq, wk, wv = m.state_qkv_proj.weight.chunk(3, dim=0)
    s = explicit_self_attention(s @ wq.T, s @ wk.T, s @ wv.T)
    y = unheads(torch.einsum("bhnm,bhmd->bhnd", w, s)) @ m.out_proj.weight.T + m.out_proj.bias
    return y if mask is None else y * mask[..., None]


def test_transolver_equals_physics_attention():
    """w = softmax_M((X W_x) W_s / tau), s = w-weighted mean of X W_f, attention among
    slices, deslice (float64, 1e-12); a failure points to a head split, the temperature or
    the slice normalisation."""
    m = mixer("transolver")
    x, mask = torch.randn(2, 13, C, dtype=torch.float64), masked()
    xm = x * mask[..., None]
    feats, slice_in = (heads(t) for t in (xm @ m.in_proj.weight.T + m.in_proj.bias).chunk(2, -1))
    tau = m.temperature.clamp(0.1, 5).view(1, H, 1, 1)

    def weights():
        return torch.softmax((slice_in @ m.slice_proj.weight.T + m.slice_proj.bias) / tau, -1)
    want = physics_attention_reference(m, xm, weights, feats, mask)
    torch.testing.assert_close(m(x, mask=mask), want, rtol=1e-12, atol=1e-12)


def test_transolver3_is_transolver_in_the_associative_order():
    """Transolver-3's faster slice/deslice (project the M states, not the N tokens) equals
    Transolver with the same weights; with the feature bias at zero the two differ only by
    rounding (the bias meets eps differently otherwise)."""
    t1, t3 = mixer("transolver"), mixer("transolver3")
    t3.load_state_dict(t1.state_dict())
    with torch.no_grad():
        for m in (t1, t3):
            m.in_proj.bias[:C].zero_()
    x, mask = torch.randn(2, 13, C, dtype=torch.float64), masked()
    torch.testing.assert_close(t3(x, mask=mask), t1(x, mask=mask), rtol=1e-12, atol=1e-12)


def transolverpp_reference(m, x, noise):
    h = heads(x @ m.in_proj.weight.T + m.in_proj.bias)                       # eidetic x~
    a1, a2 = m.temperature_net[0], m.temperature_net[2]
    tau = F.gelu(F.gelu(h @ a1.weight.T + a1.bias) @ a2.weight.T + a2.bias)
    tau = (tau + m.base_temperature.view(1, H, 1, 1)).clamp(min=0.01)        # Ada-Temp
    logits = h @ m.slice_proj.weight.T + m.slice_proj.bias
    return physics_attention_reference(
        m, x, lambda: torch.softmax((logits + noise) / tau, dim=-1), h, None)  # Rep-Slice


def test_transolverpp_gumbel_slicing_and_adaptive_temperature(monkeypatch):
    """Training mode: w = softmax((logits + g) / tau_i) with per-token tau_i; eval mode: the
    same with g = 0, deterministic (Luo et al., 2025, Sec. 3.2)."""
    m = mixer("transolver++")
    x = torch.randn(2, 13, C, dtype=torch.float64)
    noise = torch.randn(2, H, 13, M, dtype=torch.float64)
    monkeypatch.setattr(transolver_module, "gumbel_noise", lambda like: noise)
    torch.testing.assert_close(m.train()(x), transolverpp_reference(m, x, noise),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.eval()(x), transolverpp_reference(m, x, 0.0),
                               rtol=1e-12, atol=1e-12)


def test_transolverpp_training_is_random_eval_is_not():
    """Fresh Gumbel noise per training call (a fixed noise would be a bias, not Rep-Slice)."""
    m = mixer("transolver++")
    x = torch.randn(1, 30, C, dtype=torch.float64)
    assert not torch.allclose(m.train()(x), m(x))
    assert torch.equal(m.eval()(x), m(x))


def test_gumbel_noise_has_the_gumbel_distribution():
    """-log(-log u): mean = Euler's gamma, variance = pi^2 / 6."""
    torch.manual_seed(0)
    g = transolver_module.gumbel_noise(torch.empty(400_000, dtype=torch.float64))
    assert abs(g.mean().item() - 0.5772156649) < 0.01
    assert abs(g.var().item() - math.pi ** 2 / 6) < 0.02


# ---------------------------------------------------------------------------------------
# AB-UPT


def test_abupt_with_every_token_an_anchor_is_full_attention():
    """N <= anchors: all real tokens are anchors, so the mixer is exactly the attention
    mixer with the same weights (same projections, Table 10's equal counts)."""
    ab, attn = mixer("abupt"), mixer("attention")
    attn.load_state_dict(ab.state_dict())
    x, mask = torch.randn(2, 13, C, dtype=torch.float64), masked()
    torch.testing.assert_close(ab(x, mask=mask), attn(x, mask=mask), rtol=1e-12, atol=1e-12)


def test_abupt_tokens_attend_to_the_sampled_anchors_only():
    """A < N: every token's output is softmax attention over the anchor tokens only."""
    ab = mixer("abupt", anchors=5).eval()
    x, mask = torch.randn(2, 13, C, dtype=torch.float64), masked()
    index, valid = ab.anchor_indices(mask, 2, 13, x.device)
    assert index.shape == (2, 5) and valid.all()
    assert torch.gather(mask, 1, index).all(), "an anchor was a padding token"
    q, k, v = (heads(t) for t in ((x * mask[..., None]) @ ab.qkv_proj.weight.T).chunk(3, -1))
    g = index[:, None, :, None].expand(-1, H, -1, D)
    scores = q @ torch.gather(k, 2, g).transpose(-1, -2) / math.sqrt(D)
    y = torch.softmax(scores, -1) @ torch.gather(v, 2, g)
    want = (unheads(y) @ ab.out_proj.weight.T + ab.out_proj.bias) * mask[..., None]
    torch.testing.assert_close(ab(x, mask=mask), want, rtol=1e-12, atol=1e-12)


def test_abupt_eval_anchors_are_deterministic_and_ignore_padding():
    """Eval anchors depend on (anchor_seed, n_real) only: repeated calls, other blocks
    (another instance), padding and batching all see the same anchors."""
    ab = mixer("abupt", anchors=5).eval()
    other = mixer("abupt", anchors=5).eval()
    a, b = torch.randn(1, 11, C, dtype=torch.float64), torch.randn(1, 17, C, dtype=torch.float64)
    batch = torch.zeros(2, 20, C, dtype=torch.float64)
    batch[0, :11], batch[1, :17] = a[0], b[0]
    batch[:, 17:] = 1e6                                         # junk in the padding
    batch[0, 11:17] = -1e6
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[0, :11], mask[1, :17] = True, True
    y = ab(batch, mask=mask)
    torch.testing.assert_close(y[0:1, :11], ab(a), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y[1:2, :17], ab(b), rtol=1e-12, atol=1e-12)
    assert (y[~mask] == 0).all()
    assert torch.equal(ab(a), ab(a))
    assert torch.equal(ab.anchor_indices(None, 1, 17, a.device)[0],
                       other.anchor_indices(None, 1, 17, a.device)[0])
    reseeded = mixer("abupt", anchors=5, anchor_seed=1).eval()
    assert not torch.equal(ab.anchor_indices(None, 1, 17, a.device)[0].sort().values,
                           reseeded.anchor_indices(None, 1, 17, a.device)[0].sort().values)


def test_abupt_training_draws_fresh_anchors_among_real_tokens():
    ab = mixer("abupt", anchors=4).train()
    mask = masked(9, 40)
    draws = [ab.anchor_indices(mask, 2, 40, torch.device("cpu")) for _ in range(5)]
    for index, valid in draws:
        assert valid.all() and torch.gather(mask, 1, index).all()
        assert (index[0] < 9).all()
    assert len({tuple(i[1].sort().values.tolist()) for i, _ in draws}) > 1


# ---------------------------------------------------------------------------------------
# Luna


def test_luna_layer_without_its_own_packed_sequence_says_how_to_use_it():
    m = flarepp.build_mixer("luna", dim=C, heads=H, latents=M, learned_packed=False)
    with pytest.raises(ValueError, match="pack_unpack"):
        m(torch.randn(1, 5, C))


def test_luna_model_carries_the_packed_stream():
    """Per block: Y_P = Attn(LN_P(P) W_pq, X W_pk, X W_pv), Y_X = Attn(X W_q, Y_P W_k,
    Y_P W_v) W_o with X = LN(H); H += Y_X, P += Y_P, H += FFN(LN(H)) (Ma et al., 2021).
    A failure means the packed stream is not carried or pack/unpack swapped operands."""
    torch.manual_seed(0)
    model = jitter(flarepp.build_model(arch="luna", in_dim=3, out_dim=2, dim=C, heads=H,
                                       blocks=2, latents=M).double(), 0.05)
    x, mask = torch.randn(2, 13, 3, dtype=torch.float64), masked()
    xm = x * mask[..., None]
    h = model.in_proj(xm)
    p = model.packed_init.expand(2, -1, -1)
    key_mask = mask[:, None, None, :]
    s = 1 / math.sqrt(D)
    for block in model.blocks:
        luna = block.mixer
        xn, pn = block.mixer_norm(h) * mask[..., None], luna.packed_norm(p)
        pq = heads(pn @ luna.packed_query_proj.weight.T + luna.packed_query_proj.bias)
        pk, pv = (heads(t) for t in luna.token_key_value_proj(xn).chunk(2, -1))
        yp = unheads(masked_softmax(s * pq @ pk.transpose(-1, -2), key_mask) @ pv)
        q = heads(luna.query_proj(xn))
        k, v = (heads(t) for t in luna.packed_key_value_proj(yp).chunk(2, -1))
        yx = luna.out_proj(unheads(torch.softmax(s * q @ k.transpose(-1, -2), -1) @ v))
        h = h + yx * mask[..., None]
        p = p + yp
        h = h + block.ffn(block.ffn_norm(h))
    want = model.out_proj(model.out_norm(h)) * mask[..., None]
    torch.testing.assert_close(model(x, mask=mask), want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------
# Set Transformer and GNOT


def test_isab_equals_lee_et_al():
    """ISAB(X) = MAB(X, MAB(I, X)), MAB(X, Y) = LN(H + GELU(H W_o)), H = LN(X W_q +
    Multihead(X W_q, Y W_k, Y W_v)) (Lee et al., 2019, Sec. 3)."""
    torch.manual_seed(0)
    model = jitter(flarepp.build_model(arch="set-transformer", in_dim=3, out_dim=2, dim=C,
                                       heads=H, blocks=1, latents=M).double(), 0.05)
    isab = model.blocks[0].isab
    x = torch.randn(2, 13, C, dtype=torch.float64)

    def mab(mod, queries, keys):
        q = mod.query_proj(queries)
        k, v = mod.key_value_proj(keys).chunk(2, -1)
        a = torch.softmax(heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(D), -1) @ heads(v)
        hh = mod.attn_norm(q + unheads(a))
        return mod.out_norm(hh + F.gelu(mod.row_ff(hh), approximate="tanh"))
    want = mab(isab.scatter, x, mab(isab.gather, isab.inducing_points.expand(2, -1, -1), x))
    torch.testing.assert_close(isab(x, None), want, rtol=1e-12, atol=1e-12)


def test_gnot_normalized_attention_equals_its_definition():
    """z_t = sum_i (q~_t . k~_i) v_i / sum_j (q~_t . k~_j), q~ = softmax_D(q), k~ =
    softmax_D(k), padding keys excluded (Hao et al., 2023), against the O(N^2) form."""
    torch.manual_seed(0)
    attn = jitter(NormalizedAttention(C, H).double())
    x, y, mask = (torch.randn(2, 13, C, dtype=torch.float64),
                  torch.randn(2, 13, C, dtype=torch.float64), masked())
    q = heads(attn.query_proj(x)).softmax(-1)
    k = heads(attn.key_proj(y)).softmax(-1)
    v = heads(attn.value_proj(y))
    a = (q @ k.transpose(-1, -2)) * mask[:, None, None, :]
    z = (a / a.sum(-1, keepdim=True)) @ v
    torch.testing.assert_close(attn(x, y, mask), attn.out_proj(unheads(z)),
                               rtol=1e-12, atol=1e-12)
