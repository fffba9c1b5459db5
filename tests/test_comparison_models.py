"""The comparison mixers and models against their papers' equations, written out explicitly.

Transolver / Transolver-3 / Transolver++ (physics attention, Ada-Temp, Rep-Slice), AB-UPT
anchor attention and its anchor sampling, Luna's nested attention with the carried packed
stream, GNOT's normalized attention; and the complete architectures (GNOT, PerceiverIO,
LNO, Set Transformer, Transolver++ as evaluated) against references written from their
authors' equations, forward and input gradient, with and without padding; float64, tiny
sizes.
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
    """Training mode: w = softmax((logits + g) / tau_i) with per-token tau_i (Luo et al.,
    2025, Sec. 3.2); ``eval_noise=False``, flarepp's noise-free evaluation: the same with
    g = 0. The default evaluation (seeded noise) is checked with the complete models below."""
    m = mixer("transolver++", eval_noise=False)
    x = torch.randn(2, 13, C, dtype=torch.float64)
    noise = torch.randn(2, H, 13, M, dtype=torch.float64)
    monkeypatch.setattr(transolver_module, "gumbel_noise", lambda like: noise)
    torch.testing.assert_close(m.train()(x), transolverpp_reference(m, x, noise),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.eval()(x), transolverpp_reference(m, x, 0.0),
                               rtol=1e-12, atol=1e-12)


def test_transolverpp_training_is_random_eval_is_seeded():
    """Fresh Gumbel noise per training call (a fixed noise would be a bias, not Rep-Slice);
    evaluation draws it too, as the release does, from a seeded generator: repeated
    evaluations agree, another ``eval_noise_seed`` gives another draw, and the draw is not
    the noise-free output."""
    m = mixer("transolver++")
    x = torch.randn(1, 30, C, dtype=torch.float64)
    assert not torch.allclose(m.train()(x), m(x))
    assert torch.equal(m.eval()(x), m(x))
    other = mixer("transolver++", eval_noise_seed=1).eval()
    quiet = mixer("transolver++", eval_noise=False).eval()
    assert not torch.allclose(other(x), m(x)) and not torch.allclose(quiet(x), m(x))


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
# GNOT's attention


def test_gnot_normalized_attention_equals_its_definition():
    """z_t = q~_t + sum_i (q~_t . k~_i) v_i / sum_j (q~_t . k~_j), q~ = softmax_D(q), k~ =
    softmax_D(k), padding keys excluded (Hao et al., 2023), against the O(N^2) form."""
    torch.manual_seed(0)
    attn = jitter(NormalizedAttention(C, H).double())
    x, y, mask = (torch.randn(2, 13, C, dtype=torch.float64),
                  torch.randn(2, 13, C, dtype=torch.float64), masked())
    q = heads(attn.query_proj(x)).softmax(-1)
    k = heads(attn.key_proj(y)).softmax(-1)
    v = heads(attn.value_proj(y))
    a = (q @ k.transpose(-1, -2)) * mask[:, None, None, :]
    z = (a / a.sum(-1, keepdim=True)) @ v + q
    torch.testing.assert_close(attn(x, y, mask), attn.out_proj(unheads(z)),
                               rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------
# The complete comparison architectures against their authors' equations
#
# Each reference below is written from the equations of the model's authors and of the
# FLARE study's copy (the model behind Table 1's row), one sample at a time and without a
# mask: a padded batch must give, at its real points, what the sample alone gives, and
# zero elsewhere, forward and input gradient alike. Two blocks, weights and biases moved
# to O(1) off the init, so that a dropped term, a wrong activation or a wrong scale shows.

REF_C, REF_H, REF_IN, REF_OUT = 16, 2, 3, 2
REF_D = REF_C // REF_H
REF_TINY = dict(dim=REF_C, heads=REF_H, blocks=2)


def lin(module, t):
    return t @ module.weight.T + (0.0 if module.bias is None else module.bias)


def ln(module, t):
    return F.layer_norm(t, (t.shape[-1],), module.weight, module.bias, module.eps)


def exact_gelu(t):
    return 0.5 * t * (1.0 + torch.erf(t / math.sqrt(2.0)))


def tanh_gelu(t):
    return 0.5 * t * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * t ** 3)))


def residual_mlp(mlp, t, act, *, input_residual=False, output_residual=False):
    """``h = act(t W_in + b)`` (``+ t`` with an input residual), ``h += act(h W + b)`` per
    hidden layer, ``h W_out + b`` (``+ h`` with an output residual)."""
    h = act(lin(mlp.fc_in, t))
    if input_residual and h.shape == t.shape:
        h = t + h
    for layer in mlp.hidden:
        h = h + act(lin(layer, h))
    out = lin(mlp.fc_out, h)
    return h + out if output_residual and out.shape == h.shape else out


def per_head(t):                                   # [L, C] -> [H, L, D]
    return t.view(t.shape[0], REF_H, -1).transpose(0, 1)


def all_heads(t):                                  # [H, L, D] -> [L, C]
    return t.transpose(0, 1).reshape(t.shape[1], -1)


def softmax_attention(q, k, v, scale):
    """Multi-head softmax attention of ``[L, C]`` projections, ``[L, C]`` out."""
    q, k, v = per_head(q), per_head(k), per_head(v)
    return all_heads(torch.softmax(scale * q @ k.transpose(-1, -2), dim=-1) @ v)


def latent_block(block, z, act, scale):
    """``z + MHSA(LN(z)) W_O``, ``z + MLP(LN(z))`` (PerceiverIO's and LNO's latent block)."""
    q, k, v = lin(block.qkv_proj, ln(block.attn_norm, z)).chunk(3, dim=-1)
    z = z + lin(block.out_proj, softmax_attention(q, k, v, scale))
    fc1, fc2 = block.mlp[0], block.mlp[2]
    return z + lin(fc2, act(lin(fc1, ln(block.mlp_norm, z))))


def gnot_attention(attn, x, y):
    """Hao et al. (2023): ``z_t = q~_t + sum_i (q~_t . k~_i) v_i / sum_j (q~_t . k~_j)``,
    ``q~, k~`` softmaxed over each head's D channels; the O(N^2) form."""
    q = per_head(lin(attn.query_proj, x)).softmax(-1)
    k = per_head(lin(attn.key_proj, y)).softmax(-1)
    v = per_head(lin(attn.value_proj, y))
    a = q @ k.transpose(-1, -2)
    return lin(attn.out_proj, all_heads(a @ v / a.sum(-1, keepdim=True) + q))


def gnot_reference(model, x, wiring):
    pos = x[:, :model.config.coordinate_channels]
    trunk = residual_mlp(model.query_mlp, pos, exact_gelu)
    stream = residual_mlp(model.input_mlp, x, exact_gelu)
    for block in model.blocks:
        g1, g2, g3 = block.gate_net[0], block.gate_net[2], block.gate_net[4]
        gate = torch.softmax(lin(g3, exact_gelu(lin(g2, exact_gelu(lin(g1, pos))))), -1)

        def experts(bank, t):
            return sum(gate[:, e:e + 1] * lin(f[2], exact_gelu(lin(f[0], t)))
                       for e, f in enumerate(bank.experts))
        u = trunk + gnot_attention(block.cross_attn, ln(block.cross_query_norm, trunk),
                                   ln(block.cross_input_norm, stream))
        u = u + ln(block.experts1_norm, experts(block.experts1, u))
        h = ln(block.self_norm, u)
        u = u + gnot_attention(block.self_attn, h, h)
        u = u + ln(block.experts2_norm, experts(block.experts2, u))
        if wiring == "flare-study":
            stream = u            # the trunk queries every block; the stream is carried
        else:
            trunk = u             # the branch is fixed; the query stream is carried
    out = stream if wiring == "flare-study" else trunk
    return lin(model.head[2], exact_gelu(lin(model.head[0], out)))


def perceiver_io_reference(model, x):
    """FLARE study: encode ``Z = Attn(L, LN(X) W_k, LN(X) W_v) W_e`` (no query residual),
    latent blocks with the tanh GELU and bias-free QKV, decode with the points as queries."""
    scale = 1 / math.sqrt(REF_D)
    tokens = residual_mlp(model.in_proj, x, tanh_gelu, output_residual=True)
    k, v = lin(model.encode_key_value_proj, ln(model.encode_norm, tokens)).chunk(2, -1)
    z = lin(model.encode_out_proj, softmax_attention(model.latent_array, k, v, scale))
    for block in model.blocks:
        z = latent_block(block, z, tanh_gelu, scale)
    q = lin(model.decode_query_proj, ln(model.decode_query_norm, tokens))
    k, v = lin(model.decode_key_value_proj, ln(model.decode_latent_norm, z)).chunk(2, -1)
    read = lin(model.decode_out_proj, softmax_attention(q, k, v, scale))
    return residual_mlp(model.out_proj, ln(model.out_norm, read), tanh_gelu,
                        input_residual=True)


def lno_reference(model, x):
    """Wang & Wang (2024): scores ``S = MLP_a(MLP_t(x))``; encode ``softmax_N(S)^T MLP_b(x)``,
    latent blocks, decode ``softmax_R(S) Z``, ``MLP_o``; exact GELU everywhere."""
    scores = residual_mlp(model.mode_projector, residual_mlp(model.trunk, x, exact_gelu),
                          exact_gelu)                                           # [n, R]
    z = torch.softmax(scores, 0).T @ residual_mlp(model.branch, x, exact_gelu)  # [R, C]
    for block in model.blocks:
        z = latent_block(block, z, exact_gelu, 1 / math.sqrt(REF_D))
    return residual_mlp(model.out_mlp, torch.softmax(scores, 1) @ z, exact_gelu)


def backbone_reference(model, x, block_fn):
    """The shared backbone (Table 7): ``in_proj``, blocks, ``out_proj(LN(h))``."""
    h = residual_mlp(model.in_proj, x, tanh_gelu, output_residual=True)
    for index, block in enumerate(model.blocks):
        h = block_fn(index, block, h)
    return residual_mlp(model.out_proj, ln(model.out_norm, h), tanh_gelu, input_residual=True)


def feed_forward(block, norm, h):
    return h + lin(block.ffn[2], tanh_gelu(lin(block.ffn[0], ln(norm, h))))


def set_transformer_reference(model, x):
    """Lee et al. (2019): ``MAB(X, Y) = LN(H + act(H W_o + b_o))``, ``H = LN(X W_q +
    Attn(X W_q, Y W_k, Y W_v))`` with scale ``1/sqrt(C)``, ``ISAB(X) = MAB(X, MAB(I, X))``;
    ``act`` the exact GELU (the paper's own Set Transformer runs)."""
    def mab(mod, queries, keys):
        q = lin(mod.query_proj, queries)
        k, v = lin(mod.key_value_proj, keys).chunk(2, -1)
        h = ln(mod.attn_norm, q + softmax_attention(q, k, v, 1 / math.sqrt(REF_C)))
        return ln(mod.out_norm, h + exact_gelu(lin(mod.row_ff, h)))

    def block_fn(index, block, h):
        xn = ln(block.isab_norm, h)
        h = h + mab(block.isab.scatter, xn, mab(block.isab.gather,
                                                block.isab.inducing_points, xn))
        return feed_forward(block, block.ffn_norm, h)
    return backbone_reference(model, x, block_fn)


def transolverpp_eval_reference(model, x):
    """Luo et al. (2025), evaluated as the release does: Gumbel noise in every forward, here
    the seeded draw (uniforms token by token from ``eval_noise_seed + 1_000_003 * block``)."""
    def block_fn(index, block, h):
        m = block.mixer
        t = per_head(lin(m.in_proj, ln(block.mixer_norm, h)))                   # [H, n, D]
        a1, a2 = m.temperature_net[0], m.temperature_net[2]
        tau = exact_gelu(lin(a2, exact_gelu(lin(a1, t)))) + m.base_temperature.view(-1, 1, 1)
        u = torch.rand((t.shape[1], REF_H, M), dtype=torch.float64,
                       generator=torch.Generator().manual_seed(1_000_003 * index))
        g = -torch.log(-torch.log(u)).transpose(0, 1)                           # [H, n, M]
        w = torch.softmax((lin(m.slice_proj, t) + g) / tau.clamp(min=0.01), -1)
        s = w.transpose(-1, -2) @ t / (w.sum(1)[..., None] + 1e-5)              # [H, M, D]
        wq, wk, wv = m.state_qkv_proj.weight.chunk(3, dim=0)
        s = torch.softmax((s @ wq.T) @ (s @ wk.T).transpose(-1, -2) / math.sqrt(REF_D),
                          -1) @ (s @ wv.T)
        h = h + lin(m.out_proj, all_heads(w @ s))
        return feed_forward(block, block.ffn_norm, h)
    return backbone_reference(model, x, block_fn)


# name -> (build_model keywords, reference(model, x_nIn) -> y_nOut)
ARCHITECTURE_REFERENCES = {
    "gnot": (dict(arch="gnot"), lambda m, x: gnot_reference(m, x, "flare-study")),
    "gnot-query-stream": (dict(arch="gnot", wiring="query-stream"),
                          lambda m, x: gnot_reference(m, x, "query-stream")),
    "perceiver-io": (dict(arch="perceiver-io", latents=M), perceiver_io_reference),
    "lno": (dict(arch="lno", latents=M), lno_reference),
    "set-transformer": (dict(arch="set-transformer", latents=M), set_transformer_reference),
    "transolver++-eval": (dict(mixer="transolver++", latents=M), transolverpp_eval_reference),
}


def reference_model(name):
    torch.manual_seed(0)
    options, _ = ARCHITECTURE_REFERENCES[name]
    model = flarepp.build_model(in_dim=REF_IN, out_dim=REF_OUT, **REF_TINY, **options)
    return jitter(model.double(), 0.3).eval()


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("name", list(ARCHITECTURE_REFERENCES))
def test_architecture_equals_its_reference(name, padded):
    """Forward and input gradient against the float64 reference, per sample; with a
    padding mask (junk at the padding) the real points match the sample alone."""
    model, reference = reference_model(name), ARCHITECTURE_REFERENCES[name][1]
    torch.manual_seed(1)
    x = torch.randn(2, 13, REF_IN, dtype=torch.float64)
    mask = masked() if padded else torch.ones(2, 13, dtype=torch.bool)
    x = x.masked_fill(~mask[..., None], 1e3).requires_grad_()
    probe = torch.randn(2, 13, REF_OUT, dtype=torch.float64)
    y = model(x, mask=mask if padded else None)
    (grad,) = torch.autograd.grad((y * probe).sum(), x)
    for b in range(2):
        n = int(mask[b].sum())
        xb = x[b, :n].detach().clone().requires_grad_()
        want = reference(model, xb)
        (want_grad,) = torch.autograd.grad((want * probe[b, :n]).sum(), xb)
        torch.testing.assert_close(y[b, :n], want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(grad[b, :n], want_grad, rtol=1e-10, atol=1e-10)
    assert (y[~mask] == 0).all() and (grad[~mask] == 0).all()
