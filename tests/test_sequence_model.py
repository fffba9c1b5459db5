"""The LRA sequence classifier (paper Sec. 4.3, D.5): its contract for every registered
mixer, the reference's layout (positions before every block, pooling, two towers), config
round trips and the task table's settings.

Tiny sizes (C=16, H=2, M=4, two blocks) in float64, so the file runs in seconds.
"""

from __future__ import annotations

import math

import pytest
import torch

import flarepp
from flarepp.train.lra_benchmarks import LRA_BENCHMARKS
from flarepp.models.sequence import (
    SequenceClassifier,
    SequenceClassifierConfig,
    masked_max,
    masked_mean,
)

V, K, MAX_N = 23, 5, 40
TINY = {"vocab_size": V, "num_classes": K, "max_length": MAX_N, "dim": 16, "heads": 2,
        "blocks": 2, "latents": 4}
MIXERS = flarepp.list_mixers()


def make(dtype=torch.float64, **options) -> SequenceClassifier:
    """A tiny classifier moved off its init (zero biases, unit norms) so every term acts."""
    torch.manual_seed(0)
    model = flarepp.build_model("sequence-classifier", **{**TINY, **options}).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def tokens(B: int, N: int) -> torch.Tensor:
    return torch.randint(0, V, (B, N))


@pytest.mark.parametrize("mixer", MIXERS)
def test_padding_never_reaches_the_logits(mixer):
    """Appending masked junk tokens leaves every logit unchanged, and a padded batch equals
    its sequences run one at a time. A failure means padding leaks through the mixer, the
    positions, the pooling or the CLS handling."""
    for pooling in ("mean", "cls", "max"):
        model = make(mixer=mixer, pooling=pooling)
        a, b = tokens(1, 9), tokens(1, 14)
        batch = torch.cat([torch.cat([a, tokens(1, 5)], 1), b])
        mask = torch.ones(2, 14, dtype=torch.bool)
        mask[0, 9:] = False
        logits = model(batch, mask)
        assert logits.shape == (2, K)
        torch.testing.assert_close(logits[:1], model(a), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(logits[1:], model(b), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mixer", ["flare", "flarepp", "attention"])
@pytest.mark.parametrize("pooling", ["mean", "cls", "max"])
def test_every_parameter_gets_a_gradient(mixer, pooling):
    """A parameter without a gradient is dead code (e.g. a CLS token that is not read)."""
    for positional in ("learned", "sinusoidal"):
        model = make(torch.float32, mixer=mixer, pooling=pooling, positional=positional)
        mask = torch.ones(3, 12, dtype=torch.bool)
        mask[1, 7:] = False
        model(tokens(3, 12), mask).logsumexp(-1).sum().backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            assert p.grad.abs().sum() > 0 or name == "positions.table.weight", name


@pytest.mark.parametrize("mixer", ["flare", "flarepp", "attention"])
def test_two_towers_share_the_encoder(mixer):
    """Both documents go through one encoder (shared weights), padded to a common N inside;
    logits == head(norm(combine(encode(doc0), encode(doc1)))) computed one tower at a time,
    for both combinations; every parameter still gets a gradient."""
    for combine in ("concat", "lra"):
        model = make(mixer=mixer, two_tower=True, tower_combine=combine)
        t0, t1 = tokens(2, 11), tokens(2, 7)
        m0 = torch.ones(2, 11, dtype=torch.bool)
        m0[0, 8:] = False
        logits = model(t0, m0, tokens_1=t1)
        u, v = model.encode(t0, m0), model.encode(t1, None)
        expected = model.head(model.pooled_norm(model.combine(u, v)))
        torch.testing.assert_close(logits, expected, rtol=1e-10, atol=1e-10)
        assert logits.shape == (2, K)
        assert not torch.allclose(logits, model(t1, None, tokens_1=t0, mask_1=m0))
    model = make(torch.float32, mixer=mixer, two_tower=True)
    model(t0, m0, tokens_1=t1).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("mixer", ["flare", "flarepp", "attention"])
def test_rebuilds_from_its_config(mixer):
    """``model_from_config(model.config.to_dict())`` gives the same model (what a checkpoint
    stores); a failure means to_dict lost the arch name or a setting."""
    for options in ({"pooling": "cls", "positional": "sinusoidal"},
                    {"two_tower": True, "tower_combine": "lra", "head": "linear"}):
        model = make(mixer=mixer, **options)
        config = model.config.to_dict()
        assert config["arch"] == "sequence-classifier"
        clone = flarepp.model_from_config(config).to(torch.float64).eval()
        clone.load_state_dict(model.state_dict())
        t = tokens(2, 10)
        pair = {"tokens_1": tokens(2, 6)} if options.get("two_tower") else {}
        torch.testing.assert_close(model(t, **pair), clone(t, **pair), rtol=0, atol=0)


class Bypass(torch.nn.Module):
    """A block whose residual branches are zero: ``h -> h``."""

    def forward(self, h, mask=None):
        return h


def test_positions_are_added_before_every_block():
    """With blocks that return their input, the pooled state is ``mean(E + L * P)``: the
    reference adds the positional embedding before each of the L blocks, not once."""
    model = make(blocks=3, pooling="mean", positional="learned")
    model.blocks = torch.nn.ModuleList(Bypass() for _ in range(3))
    t = tokens(2, 8)
    expected = model.token_embedding(t) + 3 * model.positions.table.weight[:8]
    pooled = model.final_norm(expected).mean(dim=1)
    torch.testing.assert_close(model.encode(t, None), pooled, rtol=1e-12, atol=1e-12)


def test_sinusoidal_table_and_scale():
    """P[n, 2i] = sin(n w_i), P[n, 2i+1] = cos(n w_i), w_i = 10000^(-2i/C); scale C^-1/2."""
    model = make(positional="sinusoidal")
    C = TINY["dim"]
    for n, i in ((0, 0), (3, 1), (17, 5), (39, 7)):
        w = 10000.0 ** (-2 * i / C)
        assert math.isclose(model.positions.table[n, 2 * i].item(), math.sin(n * w),
                            abs_tol=1e-6)
        assert math.isclose(model.positions.table[n, 2 * i + 1].item(), math.cos(n * w),
                            abs_tol=1e-6)
    assert math.isclose(SequenceClassifier(SequenceClassifierConfig(
        **TINY, positional="sinusoidal")).positions.scale.item(), C ** -0.5, rel_tol=1e-6)


def test_masked_pooling_matches_explicit_loops():
    h = torch.randn(2, 5, 3, dtype=torch.float64)
    mask = torch.tensor([[True, True, False, True, False], [True] * 5])
    mean, top = masked_mean(h, mask), masked_max(h, mask)
    for b in range(2):
        real = h[b][mask[b]]
        torch.testing.assert_close(mean[b], real.sum(0) / len(real))
        torch.testing.assert_close(top[b], real.max(0).values)


def test_cls_token_is_prepended_and_read():
    """CLS pooling reads position 0 of a sequence one longer than the input; its position
    table has max_length + 1 rows."""
    model = make(pooling="cls")
    assert model.positions.table.weight.shape[0] == MAX_N + 1
    model(tokens(1, MAX_N))  # the longest input still has a position for every token


def test_bad_inputs_are_named():
    model = make()
    with pytest.raises(ValueError, match="integer token ids"):
        model(torch.randn(2, 5))
    with pytest.raises(ValueError, match="max_length=40"):
        model(tokens(1, MAX_N + 1))
    with pytest.raises(ValueError, match="mask of tokens must be bool"):
        model(tokens(2, 5), torch.ones(2, 5))
    with pytest.raises(ValueError, match="two-tower"):
        model(tokens(2, 5), tokens_1=tokens(2, 5))
    with pytest.raises(ValueError, match="two-tower"):
        make(two_tower=True)(tokens(2, 5))
    with pytest.raises(ValueError, match="unknown pooling 'first'"):
        SequenceClassifierConfig(**TINY, pooling="first")
    with pytest.raises(ValueError, match="dim=30 must be divisible by heads=4"):
        SequenceClassifierConfig(**{**TINY, "dim": 30, "heads": 4})


def test_not_token_shardable():
    """Context parallelism must refuse the classifier (its pooling and positions are
    global), with the registry's clear error."""
    from flarepp.distributed import context_parallel
    with pytest.raises(ValueError, match="cannot be split exactly|not known to be pointwise"):
        context_parallel(make(mixer="flare"), group=None)


@pytest.mark.parametrize("task", LRA_BENCHMARKS.names())
def test_task_table_builds_tiny_models(task):
    """Every task's tiny settings build a classifier for FLARE++, FLARE and attention and
    classify a small batch (two documents for Retrieval)."""
    entry = LRA_BENCHMARKS.get(task)
    for mixer in ("flarepp", "flare", "attention"):
        config = entry.model_config(vocab_size=V, num_classes=K, max_length=MAX_N,
                                    mixer=mixer, size="tiny")
        model = flarepp.model_from_config(config.to_dict())
        pair = {"tokens_1": tokens(2, 9)} if entry.two_tower else {}
        assert model(tokens(2, 12), **pair).shape == (2, K)
    paper = entry.model_config(vocab_size=V, num_classes=K, max_length=MAX_N, mixer="flarepp")
    assert paper.blocks == entry.paper.blocks and paper.two_tower == entry.two_tower
