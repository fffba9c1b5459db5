"""Causal decoders (flarepp.mixers.causal) and the causal language model.

The chunked parallel forms are checked against the recurrent step forms and against the
N x N causal routing written out in tests/reference.py; decoding state sizes are measured.
"""

import pytest
import torch

import flarepp
from flarepp.ops.causal import (LatentState, _prepare, causal_flare, merge_states,
                                online_softmax_step)
from flarepp.models.causal_lm import generate
from flarepp.ops import AttentionBackend, merge_partials
from reference import (explicit_causal_routing, reference_causal_mixer)

CAUSAL = ["flare-causal", "flarepp-causal", "attention-causal"]
CHUNKED = ["flare-causal", "flarepp-causal"]
# (mixer, chunk length of the parallel form); attention has no chunks
FORMS = [(n, c) for n in CHUNKED for c in (1, 7, 64)] + [("attention-causal", None)]
SMALL = dict(dim=16, heads=2, latents=4)
TOL = {torch.float32: 1e-6, torch.float64: 1e-10}


def make(name, dtype=torch.float64, chunk=7, **kw):
    torch.manual_seed(0)
    options = {} if chunk is None or name == "attention-causal" else {"chunk_size": chunk}
    mixer = flarepp.build_mixer(name, **{**SMALL, **options, **kw}).to(dtype)
    with torch.no_grad():  # away from the init so every term matters
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mixer


def run_steps(mixer, x, state):
    ys = []
    for t in range(x.shape[1]):
        y_t, state = mixer.step(x[:, t], state)
        ys.append(y_t)
    return torch.stack(ys, dim=1), state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name,chunk", FORMS)
def test_parallel_form_equals_recurrent_form(name, chunk, dtype):
    """Chunked training form == one token at a time from the empty state, and == a
    prefill of a prefix continued by steps (1e-6 float32, 1e-10 float64); N = 150 spans
    several chunks of 64 with a ragged last one. A failure points to the chunk merge
    (eq. 33), the within-chunk part, or a step that updates the state differently."""
    mixer = make(name, dtype, chunk)
    x = torch.randn(2, 150, SMALL["dim"], dtype=dtype)
    tol = TOL[dtype]
    with torch.no_grad():
        parallel = mixer(x)
        stepped, _ = run_steps(mixer, x, mixer.initial_state(2))
        head, state = mixer.prefill(x[:, :61])
        tail, _ = run_steps(mixer, x[:, 61:], state)
    torch.testing.assert_close(stepped, parallel, rtol=tol, atol=tol)
    torch.testing.assert_close(torch.cat([head, tail], dim=1), parallel, rtol=tol, atol=tol)


@pytest.mark.parametrize("name,chunk", FORMS)
def test_future_tokens_never_change_the_past(name, chunk):
    """Outputs at t <= t0 do not change when tokens after t0 change (to rounding: the
    chunk's reference maximum may see them) and their gradients with respect to later
    tokens are exactly zero; a failure is a leak of the future."""
    mixer = make(name, chunk=chunk)
    x = torch.randn(2, 90, SMALL["dim"], dtype=torch.float64, requires_grad=True)
    t0 = 37
    y = mixer(x)
    grad, = torch.autograd.grad(y[:, :t0 + 1].sum(), x)
    assert (grad[:, t0 + 1:] == 0).all()
    changed = x.detach().clone()
    changed[:, t0 + 1:] = 100 * torch.randn_like(changed[:, t0 + 1:])
    torch.testing.assert_close(mixer(changed)[:, :t0 + 1], y[:, :t0 + 1].detach(),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("name,chunk", FORMS)
def test_equals_explicit_causal_routing(name, chunk, norm):
    """Forward and every gradient equal the N x N causal forms of tests/reference.py
    (float64, 1e-10), with right padding and a masked token inside a sequence. A failure
    names a mismatch with the definition: prefix log-normalisers, per-token synthesized
    queries (flarepp-causal), or masks."""
    mixer = make(name, chunk=chunk, norm=norm)
    x = torch.randn(2, 23, SMALL["dim"], dtype=torch.float64)
    mask = torch.ones(2, 23, dtype=torch.bool)
    mask[1, 15:] = False
    mask[0, 4] = False
    params = list(mixer.parameters())
    for m in (None, mask):
        outs = []
        for fn in (lambda xi: mixer(xi, mask=m),
                   lambda xi: reference_causal_mixer(name, mixer, xi, m)):
            xi = x.clone().requires_grad_(True)
            y = fn(xi)
            cot = torch.sin(torch.arange(y.numel(), dtype=y.dtype)).view_as(y)
            outs.append((y, torch.autograd.grad(y, [xi] + params, cot)))
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-10, atol=1e-10)
        for a, b in zip(outs[0][1], outs[1][1]):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype,factor", [(torch.float64, 300.0), (torch.float32, 40.0)],
                         ids=["float64", "float32"])
def test_wide_score_range_takes_the_exact_log_space_path(dtype, factor):
    """Scores rising by more than half the exponent range inside a chunk would overflow
    the split ``exp(mu - L) exp(a - mu)``; those chunks are recomputed in log space.
    Forward and gradients stay finite and equal the explicit routing."""
    torch.manual_seed(1)
    a = (factor * torch.randn(2, 2, 40, 5, dtype=torch.float64)).requires_grad_(True)
    v = torch.randn(2, 2, 40, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 29:] = False
    assert _prepare(a.detach().to(dtype), v.detach().to(dtype), mask, 7).unsafe.any()
    y, _ = causal_flare(a.to(dtype), v.to(dtype), mask, chunk_size=7)
    ref = explicit_causal_routing(a, mask) @ v * mask[:, None, :, None]
    cot = torch.cos(torch.arange(ref.numel(), dtype=torch.float64)).view_as(ref)
    grads = torch.autograd.grad(y.double(), [a, v], cot)
    ref_grads = torch.autograd.grad(ref, [a, v], cot)
    tol = 1e-9 if dtype == torch.float64 else 1e-3  # float32 scores of size ~100
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, r, rtol=tol, atol=tol * factor)


def test_online_merge_matches_eq33_and_survives_empty_partials():
    """:func:`merge_states` equals ``ops.merge_partials`` (eq. 33); with both partials empty
    (chunks of padding) its gradients stay finite where ``merge_partials``' are NaN."""
    z = torch.randn(2, 1, 2, 3, 4, dtype=torch.float64)
    lse = torch.randn(2, 1, 2, 3, dtype=torch.float64)
    lse[:, 0, 1, 0] = float("-inf")          # one row empty in both partials
    lse[0, 0, 0, 1] = float("-inf")          # one row empty in one partial
    ref_z, ref_l = merge_partials(z, lse)
    z_in, l_in = z.clone().requires_grad_(True), lse.clone().requires_grad_(True)
    out_z, out_l = merge_states(z_in[0], l_in[0], z_in[1], l_in[1])
    torch.testing.assert_close(out_z, ref_z, rtol=1e-14, atol=1e-14)
    assert torch.equal(torch.isinf(out_l), torch.isinf(ref_l))
    torch.testing.assert_close(out_l[torch.isfinite(out_l)], ref_l[torch.isfinite(ref_l)])
    (out_z.sum() + torch.where(torch.isfinite(out_l), out_l, 0).sum()).backward()
    assert torch.isfinite(z_in.grad).all() and torch.isfinite(l_in.grad).all()


def test_online_softmax_step_is_the_prefix_softmax():
    """Stepping ``online_softmax_step`` over tokens gives ``Z_t = softmax_{u<=t}(a) V``."""
    a = torch.randn(1, 2, 9, 3, dtype=torch.float64)
    v = torch.randn(1, 2, 9, 4, dtype=torch.float64)
    state = LatentState.empty(1, 2, 3, 4, dtype=torch.float64)
    for t in range(9):
        state = online_softmax_step(state, a[:, :, t], v[:, :, t])
        expected = torch.softmax(a[:, :, :t + 1].transpose(-1, -2), dim=-1) @ v[:, :, :t + 1]
        torch.testing.assert_close(state.latents, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state.log_normaliser,
                                   torch.logsumexp(a[:, :, :t + 1], dim=2))


@pytest.mark.parametrize("name", CAUSAL)
def test_padded_prompt_state_is_the_state_after_the_last_real_token(name):
    """Prefilling right-padded prompts, then stepping, equals running each prompt alone:
    padded tokens never enter the state (FLARE) or the cache (attention)."""
    mixer = make(name)
    a = torch.randn(1, 9, SMALL["dim"], dtype=torch.float64)
    b = torch.randn(1, 14, SMALL["dim"], dtype=torch.float64)
    nxt = torch.randn(2, 3, SMALL["dim"], dtype=torch.float64)
    batch = torch.zeros(2, 14, SMALL["dim"], dtype=torch.float64)
    batch[0, :9], batch[1] = a[0], b[0]
    mask = torch.zeros(2, 14, dtype=torch.bool)
    mask[0, :9], mask[1] = True, True
    with torch.no_grad():
        _, state = mixer.prefill(batch, mask)
        together, _ = run_steps(mixer, nxt, state)
        for i, prompt in enumerate((a, b)):
            _, alone_state = mixer.prefill(prompt)
            alone, _ = run_steps(mixer, nxt[i:i + 1], alone_state)
            torch.testing.assert_close(together[i:i + 1], alone, rtol=1e-10, atol=1e-10)


def state_bytes(states):
    return sum(t.numel() * t.element_size() for s in states for t in s.tensors())


@pytest.mark.slow
def test_decoding_state_is_constant_in_length_for_flare_and_linear_for_attention():
    """Measured: the decoding state of every causal FLARE block holds the same number of
    bytes after 1K and 64K tokens (``B H M (D + 2)`` per state), and stays so after a
    step; the attention KV cache grows in proportion to the context."""
    torch.manual_seed(0)
    sizes = {}
    for mixer in CHUNKED:
        model = flarepp.build_model(arch="causal-lm", mixer=mixer, blocks=1, **SMALL)
        for n in (1024, 65536):
            ids = torch.randint(0, 256, (1, n))
            with torch.no_grad():
                _, states = model.prefill(ids)
                _, after = model.step(ids[:, -1], states)
            sizes[mixer, n] = state_bytes(states)
            assert state_bytes(after) == sizes[mixer, n]
        assert sizes[mixer, 1024] == sizes[mixer, 65536]
        per_state = 2 * 4 * (SMALL["latents"] * (SMALL["dim"] // SMALL["heads"] + 2))
        parts = 1 if mixer == "flare-causal" else 2  # + the synthesis state
        assert sizes[mixer, 1024] == parts * per_state  # B=1, H=2, float32
    model = flarepp.build_model(arch="causal-lm", mixer="attention-causal", blocks=1, **SMALL)
    cache = {}
    for n in (1024, 4096):
        with torch.no_grad():
            _, states = model.prefill(torch.randint(0, 256, (1, n)))
        cache[n] = state_bytes(states)
    assert cache[4096] > 3.9 * cache[1024]


@pytest.mark.parametrize("name", CAUSAL)
def test_greedy_generation_is_the_parallel_argmax(name):
    """Greedy ``generate`` (prefill, then one recurrent step per token) produces exactly the
    argmax of the parallel forward's logits at every generated position; top-k = 1
    sampling is greedy too. A failure means the step form and the parallel form disagree."""
    torch.manual_seed(0)
    options = {} if name == "attention-causal" else {"chunk_size": 5}
    model = flarepp.build_model(arch="causal-lm", mixer=name, dim=32, heads=4, blocks=2,
                                latents=8, mixer_options=options).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    prompt = torch.randint(0, 256, (3, 11))
    out = generate(model, prompt, 16, temperature=0)
    assert out.shape == (3, 27) and torch.equal(out[:, :11], prompt)
    with torch.no_grad():
        predicted = model(out)[:, 10:-1].argmax(dim=-1)
    assert torch.equal(predicted, out[:, 11:])
    sampled = generate(model, prompt, 16, temperature=0.7, top_k=1,
                       generator=torch.Generator().manual_seed(3))
    assert torch.equal(sampled, out)


def test_sampling_respects_top_k_and_is_reproducible():
    """Sampled tokens come from the top-k of the step's logits; same generator, same text."""
    torch.manual_seed(0)
    model = flarepp.build_model(arch="causal-lm", blocks=1, **SMALL)
    prompt = torch.randint(0, 256, (2, 5))
    runs = [generate(model, prompt, 12, temperature=1.5, top_k=3,
                     generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    with torch.no_grad():
        logits = model(runs[0])[:, 4:-1]
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == runs[0][:, 5:, None]).any(dim=-1).all()


class RaisingBackend(AttentionBackend):
    name = "raising"

    def encode(self, *args, **kwargs):
        raise AssertionError("encode called")

    decode = self_attention = encode


@pytest.mark.parametrize("name", CAUSAL)
def test_causal_mixers_call_no_attention_backend(name):
    """The causal mixers compute their attention themselves (no backend primitive has a
    causal form), so the registry's backend-parity test cannot check them: the explicit
    N x N tests above do. This pins that fact down."""
    mixer = make(name)
    flarepp.set_backend(mixer, RaisingBackend())
    assert torch.isfinite(mixer(torch.randn(1, 9, SMALL["dim"], dtype=torch.float64))).all()


def test_errors_name_what_is_wrong():
    mixer = make("flare-causal")
    with pytest.raises(ValueError, match=r"\[B, 16\]"):
        mixer.step(torch.randn(2, 1, 16, dtype=torch.float64), mixer.initial_state(2))
    with pytest.raises(ValueError, match="chunk_size"):
        flarepp.build_mixer("flare-causal", chunk_size=0)
    with pytest.raises(ValueError, match="causal mixers: .*flare-causal"):
        flarepp.build_model(arch="causal-lm", mixer="flare")
    model = flarepp.build_model(arch="causal-lm", blocks=1, **SMALL)
    with pytest.raises(ValueError, match=r"token ids.*\[B, N\]"):
        model(torch.randn(1, 5, 3))
    features = flarepp.build_model(arch="causal-lm", in_dim=3, out_dim=2, blocks=1, **SMALL)
    with pytest.raises(ValueError, match="token model"):
        generate(features, torch.zeros(1, 3, dtype=torch.long), 2)
