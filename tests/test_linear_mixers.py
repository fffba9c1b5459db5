"""The efficient-attention baselines of the LRA comparison (paper D.5, Table 12) against their
papers' equations, written out with full N x N (or N x M) matrices in float64.

Linear attention (Katharopoulos et al., 2020), Performer FAVOR+ (Choromanski et al., 2021),
cosFormer (Qin et al., 2022), Nystromformer (Xiong et al., 2021) and Linformer (Wang et al.,
2020). Each reference below reads the mixer's weights, applies the paper's formula one
sample at a time on that sample's real tokens, and is compared with the mixer (forward and
the gradients of the input and of every parameter, 1e-10). The registry-generated contract
tests (test_mixer_contract.py) cover shapes, masks, permutation behaviour and 16-bit
autocast for these mixers like any other.
"""

import math
import re

import pytest
import torch
import torch.nn.functional as F

import flarepp
from flarepp.distributed import SHARDABLE_MIXERS, context_parallel
from flarepp.mixers import MIXERS
from flarepp.mixers.nystromformer import iterative_pinv, segment_means
from flarepp.ops import AttentionBackend, set_backend
from reference import ExplicitBackend

C, H, M = 16, 2, 4
D = C // H
NEW_MIXERS = ["cosformer", "linear-attention", "linformer", "linformer-kv", "nystromformer",
              "performer"]


def build(name, **kw):
    torch.manual_seed(0)
    mixer = flarepp.build_mixer(name, **{"dim": C, "heads": H, "latents": M, **kw}).double()
    with torch.no_grad():  # move off the init so every term matters
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mixer


def qkv(mixer, x):
    """``[B, H, N, D]`` queries, keys and values of ``[Q | K | V] = X W_QKV``."""
    wq, wk, wv = mixer.qkv_proj.weight.chunk(3, dim=0)
    B, N, _ = x.shape
    return [(x @ w.T).view(B, N, H, D).transpose(1, 2) for w in (wq, wk, wv)]


def output(mixer, y_BHND, mask):
    """``Y W_O + b_O`` with padding rows zero."""
    B, _, N, _ = y_BHND.shape
    out = y_BHND.transpose(1, 2).reshape(B, N, C) @ mixer.out_proj.weight.T
    out = out + mixer.out_proj.bias
    return out if mask is None else out * mask[..., None]


def per_sample(mixer, x, mask, attend):
    """Run ``attend(q, k, v) -> y`` ([H, n, D] each) on every sample's real tokens."""
    x = x if mask is None else x * mask[..., None]
    mask = torch.ones(x.shape[:2], dtype=torch.bool) if mask is None else mask
    q, k, v = qkv(mixer, x)
    y = torch.zeros_like(q)
    for b in range(x.shape[0]):
        real = mask[b]
        if real.any():
            y[b][:, real] = attend(q[b][:, real], k[b][:, real], v[b][:, real])
    return output(mixer, y, mask)


def kernel_ratio(similarity_HNN, v_HND, eps=0.0):
    """``y_i = sum_j sim_ij v_j / sum_j sim_ij`` (Katharopoulos et al. 2020, eq. 2)."""
    return similarity_HNN @ v_HND / similarity_HNN.sum(-1, keepdim=True).clamp_min(eps)


# ------------------------------------------------------------------ the explicit definitions

def linear_attention_reference(mixer, x, mask):
    """``sim(q, k) = phi(q).phi(k)``, ``phi(x) = elu(x) + 1`` written as exp(x) for x <= 0."""
    def phi(t):
        return torch.where(t > 0, t + 1.0, torch.exp(t))

    return per_sample(mixer, x, mask,
                      lambda q, k, v: kernel_ratio(phi(q) @ phi(k).transpose(-1, -2), v))


def performer_reference(mixer, x, mask):
    """Positive random features without any stabiliser (Performer Lemma 1):
    ``phi(x) = exp(W x - |x|^2/2) / sqrt(R)`` of ``x = s^(1/2) q``."""
    W = mixer.random_features                                                   # [H, R, D]
    s = 1 / math.sqrt(D) if mixer.config.attn_scale is None else mixer.config.attn_scale

    def phi(t):
        t = t * math.sqrt(s)
        return torch.exp(t @ W.transpose(-1, -2) - 0.5 * (t * t).sum(-1, keepdim=True)) \
            / math.sqrt(W.shape[1])

    return per_sample(mixer, x, mask,
                      lambda q, k, v: kernel_ratio(phi(q) @ phi(k).transpose(-1, -2), v))


def cosformer_reference(mixer, x, mask):
    """``sim_ij = relu(q_i).relu(k_j) cos(pi/2 (i - j)/M)``, positions 1..n of the real
    tokens, M = n; the denominator floored at 1e-6 as in the cosFormer release."""
    def attend(q, k, v):
        n = q.shape[1]
        i = torch.arange(1, n + 1, dtype=q.dtype)
        reweight = torch.cos(0.5 * math.pi * (i[:, None] - i[None, :]) / n)
        sim = (F.relu(q) @ F.relu(k).transpose(-1, -2)) * reweight
        return kernel_ratio(sim, v, eps=1e-6)

    return per_sample(mixer, x, mask, attend)


def newton_schulz_pinv(A, iterations):
    """Nystromformer Sec. 3: ``Z_0 = A^T / (||A||_1 ||A||_inf)``, then
    ``Z <- 1/4 Z (13 I - A Z (15 I - A Z (7 I - A Z)))``; A is [H, M, M]."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype)
    norm_1 = A.abs().sum(-2).max(-1).values
    norm_inf = A.abs().sum(-1).max(-1).values
    Z = A.transpose(-1, -2) / (norm_1 * norm_inf)[:, None, None]
    for _ in range(iterations):
        AZ = A @ Z
        Z = 0.25 * Z @ (13 * eye - AZ @ (15 * eye - AZ @ (7 * eye - AZ)))
    return Z


def nystromformer_reference(mixer, x, mask):
    """``Y = softmax(s Q K~^T) pinv(softmax(s Q~ K~^T)) softmax(s Q~ K^T) V`` with landmarks
    the means of segments ``[floor(j n/M), ceil((j+1) n/M))`` of the n real tokens, plus
    the optional depthwise convolution of V along the real tokens."""
    c = mixer.config
    s = 1 / math.sqrt(D) if c.attn_scale is None else c.attn_scale

    def attend(q, k, v):
        n = q.shape[1]
        bounds = [(j * n // c.latents, -(-(j + 1) * n // c.latents)) for j in range(c.latents)]
        q_land = torch.stack([q[:, lo:hi].mean(1) for lo, hi in bounds], dim=1)
        k_land = torch.stack([k[:, lo:hi].mean(1) for lo, hi in bounds], dim=1)
        f = torch.softmax(s * q @ k_land.transpose(-1, -2), dim=-1)              # [H, n, M]
        a = torch.softmax(s * q_land @ k_land.transpose(-1, -2), dim=-1)         # [H, M, M]
        b = torch.softmax(s * q_land @ k.transpose(-1, -2), dim=-1)              # [H, M, n]
        y = f @ newton_schulz_pinv(a, c.pinv_iterations) @ b @ v
        if c.conv_kernel:
            w, half = mixer.value_conv, c.conv_kernel // 2
            for i in range(n):
                for t in range(c.conv_kernel):
                    if 0 <= i + t - half < n:
                        y[:, i] = y[:, i] + w[:, t, None] * v[:, i + t - half]
        return y

    return per_sample(mixer, x, mask, attend)


def linformer_reference(mixer, x, mask):
    """``head_i = softmax(s Q_i (E_i K_i)^T) F_i V_i`` (Linformer eq. 7) with the first N
    columns of E, F, padding keys and values zeroed, padding outputs zero."""
    c = mixer.config
    s = 1 / math.sqrt(D) if c.attn_scale is None else c.attn_scale
    x = x if mask is None else x * mask[..., None]
    q, k, v = qkv(mixer, x)
    if mask is not None:
        k, v = k * mask[:, None, :, None], v * mask[:, None, :, None]
    N = x.shape[1]
    E = mixer.key_projection[:, :, :N].expand(H, -1, -1)                       # [H, M, N]
    Fv = E if mixer.value_projection is None else \
        mixer.value_projection[:, :, :N].expand(H, -1, -1)
    projected_k, projected_v = E @ k, Fv @ v                                    # [B, H, M, D]
    y = torch.softmax(s * q @ projected_k.transpose(-1, -2), dim=-1) @ projected_v
    return output(mixer, y, mask)


CASES = {
    "linear-attention": ("linear-attention", {}, linear_attention_reference),
    "performer": ("performer", {"features": 24}, performer_reference),
    "performer-scale": ("performer", {"features": 5, "attn_scale": 0.5}, performer_reference),
    "cosformer": ("cosformer", {}, cosformer_reference),
    "nystromformer": ("nystromformer", {}, nystromformer_reference),
    "nystromformer-conv": ("nystromformer", {"conv_kernel": 5, "latents": 6,
                                             "attn_scale": 0.7}, nystromformer_reference),
    "linformer": ("linformer", {"max_tokens": 40}, linformer_reference),
    "linformer-kv": ("linformer-kv", {"max_tokens": 40}, linformer_reference),
    "linformer-none": ("linformer", {"max_tokens": 40, "sharing": "none", "latents": 5},
                       linformer_reference),
}


def masks(kind, B=3, N=17):
    if kind == "none":
        return None
    mask = torch.ones(B, N, dtype=torch.bool)
    if kind == "end":      # samples of 17, 11 and 3 tokens (3 < M: repeated landmarks)
        mask[1, 11:], mask[2, 3:] = False, False
    else:                  # padding between real tokens; one sample with none real
        mask[0, ::3] = False
        mask[1, 4:9] = False
        mask[2] = False
    return mask


def grads(fn, params, x, cotangent):
    xi = x.clone().requires_grad_(True)
    y = fn(xi)
    g = torch.autograd.grad((y * cotangent).sum(), [xi] + params, allow_unused=True)
    return y.detach(), g


@pytest.mark.parametrize("mask_kind", ["none", "end", "between"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_explicit_definition(case, mask_kind):
    """The mixer equals its paper's formula (float64, 1e-10), forward and gradients of the
    input and every parameter, with and without padding. A failure points to a feature map,
    a normaliser, a position/landmark/projection rule or a mask leak in the mixer."""
    name, options, reference = CASES[case]
    mixer = build(name, **options)
    mask = masks(mask_kind)
    x = torch.randn(3, 17, C, dtype=torch.float64)
    cotangent = torch.randn(3, 17, C, dtype=torch.float64)
    params = list(mixer.parameters())
    y, g = grads(lambda t: mixer(t, mask=mask), params, x, cotangent)
    y_ref, g_ref = grads(lambda t: reference(mixer, t, mask), params, x, cotangent)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    if mask is not None:
        assert (y[~mask] == 0).all()


# ------------------------------------------------------------------ the approximations hold

def test_performer_features_estimate_the_softmax_kernel():
    """``phi(q).phi(k)`` estimates ``exp(s q.k)`` (Performer Lemma 1): with R = 16384
    orthogonal features the mean relative error over 64 pairs is under 3% (about 1% here;
    directions from a QR without the sign fix give 8%); the directions of each block of D
    rows are orthonormal and the rows' squared norms average D (Sec. 2.4). A failure points
    to the feature formula, the scale or the orthogonal draw."""
    torch.manual_seed(1)
    mixer = flarepp.build_mixer("performer", dim=8, heads=1, latents=4, features=16384).double()
    q, k = 0.5 * torch.randn(1, 1, 64, 8, dtype=torch.float64), \
        0.5 * torch.randn(1, 1, 64, 8, dtype=torch.float64)
    phi_q, phi_k = mixer.feature_maps(q, k, None)
    log_scale = (mixer.log_features(q).amax(-1, keepdim=True)
                 + mixer.log_features(k).amax(dim=(-2, -1), keepdim=True))   # undo stabilisers
    estimate = (phi_q * phi_k).sum(-1) * torch.exp(log_scale[..., 0])
    exact = torch.exp((q * k).sum(-1) / math.sqrt(8))
    assert ((estimate - exact).abs() / exact).mean() < 0.03
    W = mixer.random_features[0]
    directions = W[:8] / W[:8].norm(dim=1, keepdim=True)
    torch.testing.assert_close(directions @ directions.T, torch.eye(8, dtype=torch.float64),
                               rtol=0, atol=1e-6)
    assert abs(W.square().sum(1).mean().item() - 8) < 0.3


def test_iterative_pinv_converges_to_the_pseudo_inverse():
    """The Newton-Schulz iteration reaches ``torch.linalg.pinv`` for softmax matrices, also
    for a rank-deficient one (repeated landmarks): a failure points to the coefficients or
    the initial scaling."""
    torch.manual_seed(2)
    scores = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    a = torch.softmax(scores, dim=-1)
    torch.testing.assert_close(iterative_pinv(a, 40), torch.linalg.pinv(a), rtol=0, atol=1e-8)
    repeated = torch.softmax(scores[..., [0, 0, 1, 2, 3, 3], :][..., [0, 0, 1, 2, 3, 3]], -1)
    torch.testing.assert_close(iterative_pinv(repeated, 60), torch.linalg.pinv(repeated),
                               rtol=0, atol=1e-7)


def test_nystromformer_with_every_token_a_landmark_is_softmax_attention():
    """With M = N each segment is one token, so ``F~ A~^+ B~ = A A^+ A = A``: given enough
    pseudo-inverse steps the mixer equals full attention with the same weights."""
    nystrom = build("nystromformer", latents=7, pinv_iterations=60)
    attention = flarepp.build_mixer("attention", dim=C, heads=H, latents=7).double()
    attention.load_state_dict(nystrom.state_dict())
    x = torch.randn(2, 7, C, dtype=torch.float64)
    torch.testing.assert_close(nystrom(x), attention(x), rtol=0, atol=1e-7)


@pytest.mark.parametrize("n", [12, 11, 3])
def test_segment_means_are_the_paper_segments_or_adaptive_pooling(n):
    """For M | n the landmarks are the paper's segment means; otherwise the windows of
    adaptive average pooling (``F.adaptive_avg_pool1d``), an independent implementation."""
    x = torch.randn(2, 3, n, D, dtype=torch.float64)
    got = segment_means(x, torch.full((2,), n), 4)
    pooled = F.adaptive_avg_pool1d(x.transpose(-1, -2).reshape(6, D, n), 4)
    torch.testing.assert_close(got, pooled.view(2, 3, D, 4).transpose(-1, -2),
                               rtol=1e-12, atol=1e-12)
    if n % 4 == 0:
        torch.testing.assert_close(got, x.view(2, 3, 4, n // 4, D).mean(3))


# ------------------------------------------------------------------ interface and bookkeeping

def test_linformer_refuses_more_tokens_than_its_projections_cover():
    mixer = flarepp.build_mixer("linformer", dim=C, heads=H, latents=M, max_tokens=8)
    mixer(torch.randn(1, 8, C))
    with pytest.raises(ValueError, match="N=9 tokens.*max_tokens=8"):
        mixer(torch.randn(1, 9, C))
    with pytest.raises(ValueError, match="sharing"):
        flarepp.build_mixer("linformer", sharing="layerwise")


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="conv_kernel"):
        flarepp.build_mixer("nystromformer", conv_kernel=4)
    with pytest.raises(ValueError, match="features"):
        flarepp.build_mixer("performer", features=0)


FORMULAS = {  # weights without biases and norms; L = max_tokens, k = conv_kernel
    "linear-attention": lambda C, M, H, L: 4 * C * C,
    "performer": lambda C, M, H, L: 4 * C * C,
    "cosformer": lambda C, M, H, L: 4 * C * C,
    "nystromformer": lambda C, M, H, L: 4 * C * C,
    "linformer": lambda C, M, H, L: 4 * C * C + 2 * M * L,
    "linformer-kv": lambda C, M, H, L: 4 * C * C + M * L,
}


@pytest.mark.parametrize("C_,M_,H_", [(128, 64, 8), (64, 16, 4)])
@pytest.mark.parametrize("name", sorted(FORMULAS))
def test_parameter_formulas(name, C_, M_, H_):
    """Counts as stated in the docstrings; the projections equal full attention's ``4C^2``
    (plus the output bias C), so the baselines are comparable in size."""
    options = {"max_tokens": 1000} if name.startswith("linformer") else {}
    mixer = flarepp.build_mixer(name, dim=C_, heads=H_, latents=M_, **options)
    weights = sum(p.numel() for n, p in mixer.named_parameters() if not n.endswith("bias"))
    assert weights == FORMULAS[name](C_, M_, H_, 1000)
    assert sum(p.numel() for p in mixer.parameters()) == weights + C_
    attention = flarepp.build_mixer("attention", dim=C_, heads=H_, latents=M_)
    if name in ("linear-attention", "performer", "cosformer", "nystromformer"):
        assert sum(p.numel() for p in attention.parameters()) == weights + C_
    conv = flarepp.build_mixer("nystromformer", dim=C_, heads=H_, latents=M_, conv_kernel=35)
    assert sum(p.numel() for p in conv.parameters()) == 4 * C_ * C_ + C_ + H_ * 35
    none = flarepp.build_mixer("linformer", dim=C_, heads=H_, latents=M_, max_tokens=1000,
                               sharing="none")
    assert sum(p.numel() for p in none.parameters()) == 4 * C_ * C_ + C_ + 2 * H_ * M_ * 1000


def test_performer_features_are_a_fixed_buffer_saved_with_the_weights():
    """The random projection is drawn once and kept (no redraw): training-mode forwards are
    deterministic, and loading a state dict restores it (checkpoints rebuild the mixer)."""
    torch.manual_seed(3)
    a = flarepp.build_mixer("performer", dim=C, heads=H, latents=M).train()
    torch.manual_seed(4)
    b = flarepp.build_mixer("performer", dim=C, heads=H, latents=M)
    x = torch.randn(2, 9, C)
    torch.testing.assert_close(a(x), a(x), rtol=0, atol=0)
    assert "random_features" in a.state_dict()
    assert not torch.equal(a.random_features, b.random_features)
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)


def test_mixers_without_attention_backend_are_the_known_ones():
    """Only the kernelised mixers (no softmax: nothing for an explicit-softmax backend to
    replace) hold no attention backend; they are checked against their definitions above.
    Nystromformer and Linformer must really route their softmaxes through the backend, so
    the contract test's fused-vs-explicit parity is not vacuous for them."""
    without = sorted(n for n in MIXERS.names() if not isinstance(
        getattr(flarepp.build_mixer(n, dim=C, heads=H, latents=M), "backend", None),
        AttentionBackend))
    assert without == ["cosformer", "linear-attention", "performer"]

    calls = []

    class Counting(ExplicitBackend):
        def encode(self, *a, **k):
            calls.append("encode")
            return super().encode(*a, **k)

        def decode(self, *a, **k):
            calls.append("decode")
            return super().decode(*a, **k)

    for name, expected in [("nystromformer", ["encode", "decode"]), ("linformer", ["decode"])]:
        calls.clear()
        mixer = flarepp.build_mixer(name, dim=C, heads=H, latents=M)
        set_backend(mixer, Counting())
        mixer(torch.randn(1, 10, C))
        assert calls == expected, name


@pytest.mark.parametrize("name", NEW_MIXERS)
def test_masked_bf16_autocast_is_finite_and_close(name):
    """Under bf16 autocast with padding, outputs and gradients are finite and within 5% (in
    norm) of float32: the sums over N and the pseudo-inverse run in float32."""
    torch.manual_seed(0)
    mixer = flarepp.build_mixer(name, dim=32, heads=4, latents=16)
    x = torch.randn(2, 300, 32, requires_grad=True)
    mask = torch.ones(2, 300, dtype=torch.bool)
    mask[1, 170:] = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mixer(x, mask=mask).float()
    y.square().mean().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in mixer.parameters())
    exact = mixer(x, mask=mask)
    assert (y - exact).norm() / exact.norm() < 0.05


@pytest.mark.parametrize("name", NEW_MIXERS)
def test_backbone_builds_and_context_parallel_refuses(name):
    """``build_model(mixer=NAME)`` gives a working surrogate with padding; context
    parallelism refuses it with an error naming the mixer (none of these is declared
    token-shardable, although linear attention's sums could be split)."""
    assert name not in SHARDABLE_MIXERS
    model = flarepp.build_model(mixer=name, in_dim=3, out_dim=2, dim=C, heads=H, latents=M,
                                blocks=2)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[0, 9:] = False
    y = model(torch.randn(2, 13, 3), mask=mask)
    assert y.shape == (2, 13, 2) and torch.isfinite(y).all() and (y[0, 9:] == 0).all()
    label = rf"mixer '[^']*\b{re.escape(name)}\b[^']*'"  # Linformer's class has two names
    with pytest.raises(ValueError, match=label + ".*cannot be split exactly"):
        context_parallel(model, group=None)
