"""Contract tests generated from the mixer registry: every registered mixer gets them.

A mixer may declare ``supports_mask = False`` as a class attribute; it is then checked for
a clear error instead of the property. One that declares ``permutation_equivariant = False``
is checked for the symmetry its definition keeps instead (ORDER_SYMMETRIES). One that
declares ``stochastic_in_training = True`` is checked in eval mode.
"""

import copy

import pytest
import torch

import flarepp
from flarepp.mixers import MIXERS
from reference import assert_backend_parity

NAMES = MIXERS.names()
EQUIVARIANT = [n for n in NAMES if getattr(MIXERS.get(n), "permutation_equivariant", True)]
ORDER_DEPENDENT = [n for n in NAMES if n not in EQUIVARIANT]
SMALL = dict(dim=16, heads=2, latents=4)
# Transolver++ evaluates with seeded Gumbel noise drawn per position (as its release draws
# noise in every forward), which no permutation keeps; equivariance is a property of its
# noise-free evaluation. The noisy one is checked in test_comparison_models.py.
NOISE_FREE_EVAL = {"transolver++": {"eval_noise": False}}


def make(name, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    mixer = flarepp.build_mixer(name, **{**SMALL, **kw}).to(dtype)
    # A mixer that samples in training mode (Gumbel noise, random anchors) declares
    # stochastic_in_training = True and is checked in eval mode, where it is deterministic.
    return mixer.eval() if getattr(mixer, "stochastic_in_training", False) else mixer


def supports_mask(mixer):
    return getattr(mixer, "supports_mask", True)


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


@pytest.mark.parametrize("name", EQUIVARIANT)
def test_permutation_equivariance(name):
    """Permuting the tokens permutes the outputs: mesh points carry no order. A mixer that
    declares ``permutation_equivariant = False`` is checked by the next test instead."""
    mixer = make(name, **NOISE_FREE_EVAL.get(name, {}))
    x = torch.randn(2, 21, SMALL["dim"], dtype=torch.float64)
    perm = torch.randperm(21)
    torch.testing.assert_close(mixer(x)[:, perm], mixer(x[:, perm]), rtol=1e-10, atol=1e-10)


# An order-dependent mixer is not equivariant under every permutation, but under a known
# subgroup, which follows from its definition. Each entry maps (mixer, N, generator) to
# checks ``(what, perm, positions, permuted_mixer)``: ``permuted_mixer(x[:, perm])`` equals
# ``mixer(x)[:, perm]`` at ``positions``. A new order-dependent mixer must say here which
# symmetry it keeps.

def _within(blocks: list[torch.Tensor], n: int, generator: torch.Generator) -> torch.Tensor:
    """A permutation of range(n) that shuffles the positions of each block among themselves."""
    perm = torch.arange(n)
    for block in blocks:
        perm[block] = block[torch.randperm(len(block), generator=generator)]
    return perm


def _future_never_reaches_the_past(mixer, n, generator):
    t0 = n // 2
    return [("shuffling the tokens after t0 leaves outputs before t0 unchanged",
             _within([torch.arange(t0, n)], n, generator), torch.arange(t0), mixer)]


def _past_is_a_set(mixer, n, generator):
    # Causal attention and causal FLARE: Y_t depends on x_t and on the set {x_u : u < t},
    # a softmax (or latent encode) summed over the prefix with no positional term.
    # Not causal FLARE++: it scores token u with the routing query synthesised from the
    # tokens before u, so the order of the past matters there.
    t0 = n // 2
    return _future_never_reaches_the_past(mixer, n, generator) + [
        ("shuffling the tokens before t0 leaves outputs from t0 on unchanged",
         _within([torch.arange(t0)], n, generator), torch.arange(t0, n), mixer)]


def _anchor_set_symmetry(mixer, n, generator):
    # Anchors are picked by position; a permutation mapping the anchor positions onto
    # themselves (and the rest onto the rest) keeps the anchor set and the queries' set.
    index = mixer.anchor_indices(None, 1, n, torch.device("cpu"))[0][0]
    rest = torch.tensor(sorted(set(range(n)) - set(index.tolist())))
    return [("permuting anchors among anchors and the rest among the rest",
             _within([index, rest], n, generator), torch.arange(n), mixer)]


def _reversal_symmetry(mixer, n, generator):
    # cosFormer's weight between tokens i and j is relu(q_i).relu(k_j) cos(pi (i - j) / 2M):
    # it depends on |i - j|, so reversing the sequence is a symmetry.
    return [("reversing the sequence", torch.arange(n - 1, -1, -1), torch.arange(n), mixer)]


def _segment_symmetry(mixer, n, generator):
    # Landmarks are means over M contiguous segments (n a multiple of M here): shuffling
    # tokens inside a segment leaves every landmark, hence every output, in place.
    M = mixer.config.latents
    assert n % M == 0
    return [("shuffling tokens within each landmark segment",
             _within(list(torch.arange(n).view(M, -1)), n, generator), torch.arange(n), mixer)]


def _projection_column_symmetry(mixer, n, generator):
    # Column j of E and F belongs to position j: permuting the tokens together with those
    # columns leaves E K and F V, hence every token's output, unchanged.
    perm = torch.randperm(n, generator=generator)
    permuted = copy.deepcopy(mixer)
    with torch.no_grad():
        for projection in (permuted.key_projection, permuted.value_projection):
            if projection is not None:
                projection[:, :, :n] = projection[:, :, perm].clone()
    return [("permuting the tokens with the columns of E and F", perm, torch.arange(n),
             permuted)]


ORDER_SYMMETRIES = {
    "attention-causal": _past_is_a_set,
    "flare-causal": _past_is_a_set,
    "flarepp-causal": _future_never_reaches_the_past,
    "abupt": _anchor_set_symmetry,
    "cosformer": _reversal_symmetry,
    "nystromformer": _segment_symmetry,
    "linformer": _projection_column_symmetry,
    "linformer-kv": _projection_column_symmetry,
}
ORDER_OPTIONS = {"abupt": {"anchors": 5}}  # fewer anchors than tokens, else it is attention


@pytest.mark.parametrize("name", ORDER_DEPENDENT)
def test_order_dependent_mixer_keeps_its_symmetry(name):
    """A mixer declared ``permutation_equivariant = False`` is (a) really order-dependent:
    a random permutation of 20 tokens changes its outputs by more than 1e-3 -- a failure
    means the positional part was lost (a causal mask dropped, AB-UPT attending to every token, cosFormer's
    angles constant) or the declaration is wrong; and (b) equivariant, to 1e-10 in
    float64, under the permutations its definition allows (ORDER_SYMMETRIES: for causal
    mixers the future never reaches the past) -- a failure means a leak of the future, an
    off-by-one in a causal mask, or anchors, segments or projection columns that do not
    sit where the definition puts them."""
    assert name in ORDER_SYMMETRIES, (
        f"{name} declares permutation_equivariant = False: add the permutations it is still "
        "equivariant under to ORDER_SYMMETRIES")
    mixer = make(name, **ORDER_OPTIONS.get(name, {}))
    n = 20
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, n, SMALL["dim"], dtype=torch.float64)
    y = mixer(x)
    shuffled = torch.randperm(n, generator=generator)
    change = (mixer(x[:, shuffled]) - y[:, shuffled]).abs().max()
    assert change > 1e-3, f"{name}: a random permutation changed the outputs by {change:.1e}"
    for what, perm, positions, permuted_mixer in ORDER_SYMMETRIES[name](mixer, n, generator):
        assert not torch.equal(perm, torch.arange(n)), what
        got = permuted_mixer(x[:, perm])[:, positions]
        torch.testing.assert_close(got, y[:, perm][:, positions], rtol=1e-10, atol=1e-10,
                                   msg=lambda m: f"{name}, {what}: {m}")


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


# Quadratic in N on the CPU (4096 x 4096 scores; AB-UPT's 4096 x 512): seconds each.
QUADRATIC = {"attention", "attention-causal", "abupt"}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in QUADRATIC
                                  else n for n in NAMES])
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
