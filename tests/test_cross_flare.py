"""Cross FLARE (flarepp.mixers.cross) and the conditioned surrogate's three schemes
(flarepp.models.conditioned), against explicit float64 forms."""

import pytest
import torch
from reference import ExplicitBackend, _heads, _lin, _split_weights, _unheads, reference_mixer

import flarepp
from flarepp.mixers.cross import joint_tokens
from flarepp.models.conditioned import CONDITIONING
from flarepp.ops import AttentionBackend

SMALL = dict(dim=16, heads=2, latents=4)
CROSS = ["flare-cross", "flarepp-cross"]


def make(name, **kw):
    torch.manual_seed(0)
    mixer = flarepp.build_mixer(name, **{**SMALL, **kw}).double()
    with torch.no_grad():  # away from the near-identity init so every term matters
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mixer


def inputs(B=2, N=13, K=5, junk=True):
    """Mesh tokens and conditioning tokens with masks; masked entries hold junk (1e3)."""
    x = torch.randn(B, N, SMALL["dim"], dtype=torch.float64)
    c = torch.randn(B, K, SMALL["dim"], dtype=torch.float64)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, 9:] = False
    c_mask = torch.ones(B, K, dtype=torch.bool)
    c_mask[0, 3:] = False
    if junk:
        x[~mask], c[~c_mask] = 1e3, -1e3
    return x, mask, c, c_mask


def explicit_cross_flare(mixer, x, mask, c, c_mask):
    """Cross FLARE written out: K = [X; c] W_K, V = [X; c] W_V, Z = softmax_{N+K}(s Q K^T) V
    over real tokens, Y = softmax_M(s K_X Q^T) Z for the mesh tokens, Y W_O, masked rows 0."""
    H, s = mixer.config.heads, mixer.config.attn_scale
    s = (SMALL["dim"] // H) ** -0.5 if s is None else s
    joint = torch.cat([x * mask[..., None], c * c_mask[..., None]], dim=1)
    real = torch.cat([mask, c_mask], dim=1)
    (wk, bk), (wv, bv) = _split_weights(mixer.key_value_proj, 2)
    K, V = _heads(_lin(joint, wk, bk), H), _heads(_lin(joint, wv, bv), H)
    Q = mixer.fixed_queries.unsqueeze(0)                                     # [1, H, M, D]
    scores = (s * Q @ K.transpose(-1, -2)).masked_fill(~real[:, None, None], float("-inf"))
    Z = torch.softmax(scores, dim=-1) @ V                                    # [B, H, M, D]
    KX = K[:, :, :x.shape[1]]
    Y = torch.softmax(s * KX @ Q.transpose(-1, -2), dim=-1) @ Z              # [B, H, N, D]
    out = _lin(_unheads(Y), mixer.out_proj.weight, mixer.out_proj.bias)
    return out * mask[..., None]


def _grads(out, tensors):
    cot = torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out)
    return torch.autograd.grad(out, tensors, cot)


@pytest.mark.parametrize("name", CROSS)
def test_cross_mixer_equals_explicit_form(name):
    """Forward and gradients (inputs, conditioning, every parameter) equal the explicit form
    in float64 to 1e-10, with masked mesh and conditioning tokens holding junk. For
    flare-cross the form is written out above; for both, the mesh rows of FLARE / FLARE++
    (tests/reference.py, Table 2) applied to the joint token set [X; c]. A failure points
    to the joint mask, to the decode reading conditioning keys, or to masked junk leaking."""
    mixer = make(name)
    x, mask, c, c_mask = inputs()
    x.requires_grad_(True)
    c.requires_grad_(True)
    params = [x, c] + list(mixer.parameters())
    got = mixer(x, mask, conditioning=c, conditioning_mask=c_mask)
    joint, joint_mask = joint_tokens(x, mask, c, c_mask)
    base = "flare" if name == "flare-cross" else "flarepp"
    wants = [reference_mixer(base, mixer, joint, joint_mask)[:, :x.shape[1]]]
    if name == "flare-cross":
        wants.append(explicit_cross_flare(mixer, x, mask, c, c_mask))
    got_grads = _grads(got, params)
    for want in wants:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        for a, b in zip(got_grads, _grads(want, params)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert (got[~mask] == 0).all()


@pytest.mark.parametrize("name", CROSS)
def test_encode_reads_mesh_and_conditioning_decode_mesh_only(name):
    """Every encode gathers from N + K tokens, every decode serves the N mesh tokens: the
    O(2MN + MK) cost of the talk's unified block (no attention among conditioning tokens)."""
    seen = []

    class Recording(ExplicitBackend):
        def encode(self, q, k, v, mask=None, *, scale=None):
            seen.append(("encode", k.shape[2]))
            return super().encode(q, k, v, mask, scale=scale)

        def decode(self, k, q, z, mask=None, *, scale=None):
            seen.append(("decode", k.shape[2]))
            return super().decode(k, q, z, mask, scale=scale)

    mixer = make(name)
    mixer.backend = Recording()
    x, mask, c, c_mask = inputs(N=11, K=4)
    mixer(x, mask, conditioning=c, conditioning_mask=c_mask)
    encodes = 1 if name == "flare-cross" else 2
    assert seen == [("encode", 15)] * encodes + [("decode", 11)]
    assert isinstance(mixer.backend, AttentionBackend)


@pytest.mark.parametrize("name", CROSS)
def test_conditioning_changes_outputs_and_masked_tokens_do_not(name):
    """Conditioning tokens change the mesh outputs; masked ones (whatever their values) do
    not; with every conditioning token masked, or none given, the mixer is FLARE / FLARE++
    with the same weights."""
    mixer = make(name)
    x, mask, c, c_mask = inputs()
    with torch.no_grad():
        y = mixer(x, mask, conditioning=c, conditioning_mask=c_mask)
        other = mixer(x, mask, conditioning=c + 0.5, conditioning_mask=c_mask)
        assert (y - other)[mask].abs().max() > 1e-3
        c2 = c.clone()
        c2[~c_mask] = 7.0
        torch.testing.assert_close(mixer(x, mask, conditioning=c2, conditioning_mask=c_mask),
                                   y, rtol=0, atol=1e-12)
        none = torch.zeros_like(c_mask)
        plain = flarepp.build_mixer(name.replace("-cross", ""), **SMALL).double()
        plain.load_state_dict(mixer.state_dict())
        want = plain(x, mask)
        torch.testing.assert_close(mixer(x, mask, conditioning=c, conditioning_mask=none),
                                   want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(mixer(x, mask), want, rtol=0, atol=0)


@pytest.mark.parametrize("name", CROSS)
def test_mesh_permutation_equivariance_and_conditioning_set_invariance(name):
    """Permuting mesh tokens permutes the outputs; permuting conditioning tokens changes
    nothing (they are a set, gathered by a softmax)."""
    mixer = make(name)
    x, _, c, _ = inputs(junk=False)
    with torch.no_grad():
        y = mixer(x, conditioning=c)
        perm, cperm = torch.randperm(x.shape[1]), torch.randperm(c.shape[1])
        torch.testing.assert_close(mixer(x[:, perm], conditioning=c)[:, :], y[:, perm],
                                   rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(mixer(x, conditioning=c[:, cperm]), y, rtol=1e-10,
                                   atol=1e-10)


SCHEMES = [("cross", "flare-cross"), ("concat", "flare"), ("adaln", "flare")]


def make_model(scheme, mixer, K=6, F=3):
    torch.manual_seed(0)
    model = flarepp.build_model("conditioned", in_dim=4, out_dim=2, cond_dim=F, cond_tokens=K,
                                conditioning=scheme, mixer=mixer, dim=16, heads=2, blocks=2,
                                latents=4).double()
    with torch.no_grad():  # off the zero / identity init (AdaLN-Zero starts as the identity)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("scheme,mixer", SCHEMES)
def test_conditioned_model_schemes(scheme, mixer):
    """Each scheme: [B, N, out], every parameter gets a gradient, outputs depend on the
    conditioning, padded points and masked conditioning tokens (junk) change nothing, mesh
    points stay permutation equivariant."""
    model = make_model(scheme, mixer)
    x = torch.randn(2, 9, 4, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, 6, 3, dtype=torch.float64)
    y = model(x, conditioning=c)
    assert y.shape == (2, 9, 2)
    y.square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"{scheme}: {pname}"
    with torch.no_grad():
        assert (model(x, conditioning=c + 1.0) - y).abs().max() > 1e-4
        perm = torch.randperm(9)
        torch.testing.assert_close(model(x[:, perm], conditioning=c), y[:, perm],
                                   rtol=1e-10, atol=1e-10)
        padded = torch.cat([x, torch.full((2, 4, 4), 1e3, dtype=torch.float64)], dim=1)
        mask = torch.arange(13)[None].expand(2, -1) < 9
        c_mask = torch.ones(2, 8, dtype=torch.bool)
        c_mask[:, 6:] = False
        c_junk = torch.cat([c, torch.full((2, 2, 3), -1e3, dtype=torch.float64)], dim=1)
        bigger = make_model(scheme, mixer, K=8)
        got = bigger(padded, mask, conditioning=c_junk, conditioning_mask=c_mask)
        assert (got[:, 9:] == 0).all()
        c_zero = torch.cat([c, torch.zeros(2, 2, 3, dtype=torch.float64)], dim=1)
        want = bigger(x, conditioning=c_zero, conditioning_mask=c_mask)
        torch.testing.assert_close(got[:, :9], want, rtol=1e-10, atol=1e-10)


def test_cross_scheme_needs_a_conditioning_mixer_and_presets_match_budgets():
    """conditioning='cross' with a mixer that cannot take conditioning tokens is refused by
    name; the three rollout presets' models are within 5 % of each other in parameters."""
    with pytest.raises(ValueError, match="needs a mixer that takes conditioning tokens"):
        flarepp.build_model("conditioned", in_dim=4, out_dim=1, cond_dim=3, cond_tokens=2,
                            conditioning="cross", mixer="flare")
    assert CONDITIONING.names() == ["adaln", "concat", "cross"]
    from flarepp.tasks.rollout import POINT_FEATURES, TOKEN_FEATURES
    from flarepp.train import get_preset
    counts = []
    for preset in ("rollout-tiny", "rollout-tiny-concat", "rollout-tiny-adaln"):
        config = get_preset(preset)
        options = config.dataset_options
        model = flarepp.build_model(in_dim=POINT_FEATURES, out_dim=1, cond_dim=TOKEN_FEATURES,
                                    cond_tokens=1 + options["history"] * options["patches"] ** 2,
                                    **config.model_kwargs())
        counts.append(sum(p.numel() for p in model.parameters()))
    assert max(counts) / min(counts) < 1.05, counts
