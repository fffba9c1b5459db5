"""Growing M during training (flarepp.rank_growth, flarepp.mixers.rank_adaptive)."""

import copy

import pytest
import torch

import flarepp
from flarepp.rank_growth import (LatentSchedule, LatentSplit, extend_optimizer_state,
                                 grow_latents, grow_mixer)
from reference import assert_backend_parity

TINY = dict(in_dim=3, out_dim=2, dim=16, heads=2, blocks=2, latents=4)
GROWABLE = ["flare", "flarepp"]


def make_model(mixer, norm="layernorm", dtype=torch.float64):
    torch.manual_seed(0)
    model = flarepp.build_model(mixer=mixer, norm=norm, **TINY).to(dtype)
    with torch.no_grad():  # away from the init (zero biases, unit norms)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def inputs():
    x = torch.randn(2, 19, 3, dtype=torch.float64)
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[1, 13:] = False
    return x, mask


def latent_grads(model):
    """``{(block, name): grad}`` of every latent parameter."""
    return {(i, n): getattr(b.mixer, n).grad.clone() for i, b in enumerate(model.blocks)
            for n in ("fixed_queries", "synthesis_seeds") if hasattr(b.mixer, n)}


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("mixer", GROWABLE)
def test_growth_preserves_the_function(mixer, norm):
    """4 -> 8 -> 11 -> 24 latents (even splits, uneven splits, a latent split in 6) inside
    a model: outputs equal before and after every growth (float64, 1e-12), with a padding
    mask. A failure means a copy's decode offset or a copied row is wrong."""
    model = make_model(mixer, norm)
    x, mask = inputs()
    before = model(x, mask=mask).detach()
    for new_m in (8, 11, 24):
        grow_latents(model, new_m)
        assert model.config.latents == new_m
        assert model.config.mixer == f"{mixer}-rank-adaptive"
        assert all(b.mixer.config.latents == new_m for b in model.blocks)
        assert model.blocks[0].mixer.fixed_queries.shape == (2, new_m, 8)
        torch.testing.assert_close(model(x, mask=mask), before, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mixer", GROWABLE)
def test_rank_adaptive_mixer_with_zero_offsets_is_the_plain_mixer(mixer):
    """The offset buffer starts at zero, and then the mixer is FLARE / FLARE++ itself."""
    torch.manual_seed(0)
    plain = flarepp.build_mixer(mixer, dim=16, heads=2, latents=4).double()
    adaptive = flarepp.build_mixer(f"{mixer}-rank-adaptive", dim=16, heads=2, latents=4).double()
    missing, unexpected = adaptive.load_state_dict(plain.state_dict(), strict=False)
    assert missing == ["decode_logit_offset"] and not unexpected
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    torch.testing.assert_close(adaptive(x), plain(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("mixer", GROWABLE)
def test_grown_model_matches_the_explicit_backend(mixer):
    """After growth (non-zero offsets) every attention call, the decode with its appended
    offset column included, equals an explicit softmax (float64, 1e-10, all gradients)."""
    model = make_model(mixer)
    grow_latents(model, 7)
    x, mask = inputs()
    assert_backend_parity(model, x, mask)


@pytest.mark.parametrize("mixer", GROWABLE)
def test_each_copy_gets_one_over_c_of_the_gradient(mixer):
    """At the split, a latent copied c times gives each copy exactly 1/c of its gradient,
    and every other parameter keeps its gradient: the fact behind the optimizer rule."""
    model = make_model(mixer)
    x, mask = inputs()
    cot = torch.cos(torch.arange(19 * 2 * 2, dtype=torch.float64)).view(2, 19, 2)
    (model(x, mask=mask) * cot).sum().backward()
    before = latent_grads(model)
    shared = {n: p.grad.clone() for n, p in model.named_parameters()
              if "queries" not in n and "seeds" not in n}
    model.zero_grad(set_to_none=True)
    grow_latents(model, 10)                      # latents 0, 1 in 3 copies; 2, 3 in 2
    (model(x, mask=mask) * cot).sum().backward()
    split = LatentSplit.round_robin(4, 10)
    for key, grad in latent_grads(model).items():
        expected = before[key][:, split.sources] / split.copies_per_new().view(1, -1, 1)
        torch.testing.assert_close(grad, expected.to(grad.dtype), rtol=1e-10, atol=1e-12)
    for n, p in model.named_parameters():
        if n in shared:
            torch.testing.assert_close(p.grad, shared[n], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mixer", GROWABLE)
def test_optimizer_state_grows_consistently_and_training_continues(mixer):
    """AdamW after three steps, grown 4 -> 8: the grown parameters replace the old ones in
    the param groups; ``step`` is kept, ``exp_avg_sq`` is ``v/c^2`` for every copy,
    ``exp_avg`` is ``m/c`` for the original rows and 0 for the new copies. The next step
    runs, and moves the copies apart (the symmetry is broken by the optimizer)."""
    model = make_model(mixer)
    x, mask = inputs()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(x, mask=mask).square().mean().backward()
        opt.step()
    old = model.blocks[0].mixer.fixed_queries
    old_state = {k: v.clone() for k, v in opt.state[old].items()}
    grow_latents(model, 8, opt)
    new = model.blocks[0].mixer.fixed_queries
    assert any(p is new for g in opt.param_groups for p in g["params"])
    assert not any(p is old for g in opt.param_groups for p in g["params"])
    state = opt.state[new]
    assert torch.equal(state["step"], old_state["step"])
    assert state["exp_avg"].shape == state["exp_avg_sq"].shape == new.shape == (2, 8, 8)
    torch.testing.assert_close(state["exp_avg_sq"], old_state["exp_avg_sq"].repeat(1, 2, 1) / 4)
    torch.testing.assert_close(state["exp_avg"][:, :4], old_state["exp_avg"] / 2)
    assert (state["exp_avg"][:, 4:] == 0).all()
    assert torch.equal(new[:, :4], new[:, 4:])
    opt.zero_grad()
    loss = model(x, mask=mask).square().mean()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert not torch.allclose(new[:, :4], new[:, 4:], rtol=0, atol=1e-6)


def test_checkpoint_rebuilds_the_grown_model_and_optimizer():
    """``model_from_config(model.config.to_dict())`` + ``load_state_dict`` rebuilds the grown
    model (its mixer name, M and offsets); the optimizer state loads into a fresh AdamW."""
    model = make_model("flarepp")
    x, mask = inputs()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(x, mask=mask).square().mean().backward()
    opt.step()
    grow_latents(model, 12, opt)
    model(x, mask=mask).square().mean().backward()
    opt.step()
    saved = {"model_config": model.config.to_dict(), "model": model.state_dict(),
             "optimizer": opt.state_dict()}
    rebuilt = flarepp.model_from_config(saved["model_config"]).to(torch.float64)
    rebuilt.load_state_dict(saved["model"])
    torch.testing.assert_close(rebuilt(x, mask=mask), model(x, mask=mask), rtol=0, atol=0)
    fresh = torch.optim.AdamW(rebuilt.parameters(), lr=1e-3)
    fresh.load_state_dict(saved["optimizer"])
    q = rebuilt.blocks[1].mixer.synthesis_seeds
    assert fresh.state[q]["exp_avg_sq"].shape == q.shape == (2, 12, 8)


@pytest.mark.parametrize("mixer", GROWABLE)
def test_symmetric_perturbation_changes_the_function_at_second_order(mixer):
    """``perturbation=delta`` moves the copies' fixed queries by zero-sum noise; the first
    order cancels, so halving delta divides the output change by ~4 (measured, not 2)."""
    model = make_model(mixer)
    x, _ = inputs()
    before = model(x).detach()
    change = []
    for delta in (1e-2, 5e-3):
        grown = grow_latents(copy.deepcopy(model), 16, perturbation=delta,
                             generator=torch.Generator().manual_seed(0))
        change.append((grown(x) - before).abs().max().item())
    assert change[1] > 0 and 3.5 < change[0] / change[1] < 4.5, change


def test_latent_schedule():
    """Parsing, lookup, growth at milestones only, resume after growth, round trip."""
    schedule = LatentSchedule.parse("4,8@2,16@5")
    assert schedule.milestones == ((0, 4), (2, 8), (5, 16))
    assert [schedule.latents_at(e) for e in range(7)] == [4, 4, 8, 8, 8, 16, 16]
    assert LatentSchedule.from_dict(schedule.to_dict()) == schedule
    model = make_model("flare")
    grew = [schedule.grow_if_due(model, e) for e in range(7)]
    assert grew == [False, False, True, False, False, True, False]
    assert model.config.latents == 16
    resumed = flarepp.model_from_config(model.config.to_dict())
    assert not schedule.grow_if_due(resumed, 6)
    for bad in ("4,8", "8,4@2", "4,8@2,16@2", "x", "4@1,8@2"):
        with pytest.raises(ValueError, match="latent schedule|increase|epoch 0"):
            LatentSchedule.parse(bad)
    with pytest.raises(ValueError, match="never shrink"):
        LatentSchedule.parse("2,3@1").grow_if_due(model, 3)


def test_growth_errors_name_the_problem():
    model = make_model("flare")
    with pytest.raises(ValueError, match="only grow"):
        grow_latents(model, 2)
    with pytest.raises(ValueError, match="no flare / flarepp mixer"):
        grow_latents(flarepp.build_model(mixer="attention", **TINY), 8)
    with pytest.raises(ValueError, match="cannot grow.*SynthesizedQueryFLARE"):
        grow_mixer(flarepp.build_mixer("flarepp-simple", dim=16, heads=2, latents=4), 8)
    opt = torch.optim.Adagrad(model.parameters())
    x, _ = inputs()
    model(x).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="'sum'.*growth rule is unknown"):
        grow_latents(model, 8, opt)


def test_extend_optimizer_state_needs_the_parameter_in_the_optimizer():
    mixer = flarepp.build_mixer("flare", dim=16, heads=2, latents=4)
    _, growth, _ = grow_mixer(mixer, 8)
    unrelated = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="not in the optimizer"):
        extend_optimizer_state(unrelated, growth)
