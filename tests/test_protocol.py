"""The training protocol options (loss, input_norm, weight-decay groups, momentum cycling,
SDPA scale) against float64 hand computations and the FLARE study's rules."""

import json
import math

import numpy as np
import pytest
import torch

from flarepp.data import DatasetSplits, MeshSamples
from flarepp.tasks.fields import (FieldTask, fit_input_normalizer, gradient_relative_l2_sum,
                                  relative_l2_sum, resolve_input_norm)
from flarepp.train import RunConfig, Trainer, validate, get_preset
from flarepp.storage.config import CONFIG_VERSION, LEGACY_PROTOCOL, VERSION_KEY
from flarepp.train.optim import build_optimizer, build_scheduler, split_decay

def IDENTITY(t):
    """token_sum on one device."""
    return t


def grid_splits(n_train=6, n_test=3, grid=(5, 4), masked=False, seed=0) -> DatasetSplits:
    """Darcy-like data on an n1 x n2 grid: inputs (x, y, a), a smooth target that is zero on
    the boundary (the Dirichlet condition), optionally with masked-out nodes."""
    rng = np.random.default_rng(seed)
    n1, n2 = grid
    t1, t2 = np.meshgrid(np.linspace(0, 1, n1), np.linspace(0, 1, n2), indexing="ij")

    def make(count):
        a = rng.uniform(3, 12, (count, n1 * n2, 1))
        amp = rng.uniform(0.5, 2.0, (count, 1, 1))
        y = amp * (np.sin(np.pi * t1) * np.sin(np.pi * t2) * (1 + t1)).reshape(1, -1, 1)
        x = np.concatenate([np.broadcast_to(np.stack([t1.ravel(), t2.ravel()], -1),
                                            (count, n1 * n2, 2)), a], -1)
        mask = None
        if masked:
            mask = np.ones((count, n1 * n2), bool)
            mask[:, [6, 9]] = False
        return MeshSamples(x=x.astype(np.float32), y=y.astype(np.float32), mask=mask,
                           grid_shape=grid)
    return DatasetSplits("grid", make(n_train), make(n_test), source="test grid").validate()


def run_config(**kw):
    base = dict(name="protocol-test", dataset="npz", data_root="unused",
                model=dict(mixer="flarepp", dim=8, heads=2, latents=4, blocks=1), epochs=2,
                batch_size=3, device="cpu")
    return validate(RunConfig(**{**base, **kw}))


# -- hand computations (float64, loops) ------------------------------------------------------

def hand_rel_l2(pred, true, mask):
    """mean over samples of sqrt(sum_real (p - t)^2 / sum_real t^2)."""
    out = []
    for b in range(pred.shape[0]):
        num = den = 0.0
        for n in range(pred.shape[1]):
            if mask is None or mask[b, n]:
                num += float(((pred[b, n] - true[b, n]) ** 2).sum())
                den += float((true[b, n] ** 2).sum())
        out.append(math.sqrt(num / den))
    return np.array(out)


def hand_grad_rel_l2(pred, true, grid, mask):
    """The study's darcy_deriv_loss by loops: prediction's boundary ring zeroed, central
    differences with zero outside the grid (and at masked nodes), relative L2 per axis."""
    n1, n2 = grid
    out = []
    for b in range(pred.shape[0]):
        p = pred[b].reshape(n1, n2, -1).copy()
        t = true[b].reshape(n1, n2, -1).copy()
        real = np.ones((n1, n2), bool) if mask is None else mask[b].reshape(n1, n2)
        p[0], p[-1], p[:, 0], p[:, -1] = 0, 0, 0, 0
        p[~real], t[~real] = 0, 0

        def at(u, i, j):
            return u[i, j] if 0 <= i < n1 and 0 <= j < n2 else np.zeros(u.shape[-1])
        total = 0.0
        for di, dj in ((1, 0), (0, 1)):
            num = den = 0.0
            for i in range(n1):
                for j in range(n2):
                    if not real[i, j]:
                        continue
                    dp = at(p, i + di, j + dj) - at(p, i - di, j - dj)
                    dt = at(t, i + di, j + dj) - at(t, i - di, j - dj)
                    num += float(((dp - dt) ** 2).sum())
                    den += float((dt ** 2).sum())
            total += math.sqrt(num / den)
        out.append(total)
    return np.array(out)


@pytest.mark.parametrize("masked", [False, True])
def test_relative_l2_and_gradient_terms_match_loops(masked):
    """relative_l2_sum and gradient_relative_l2_sum equal the loop forms of the study's
    RelL2Loss and darcy_deriv_loss in float64, with and without masked nodes: a failure
    points to a wrong norm, stencil, boundary ring or mask in tasks/fields.py."""
    rng = np.random.default_rng(1)
    grid = (5, 4)
    pred = rng.normal(size=(3, 20, 2))
    true = rng.normal(size=(3, 20, 2))
    mask = None
    if masked:
        mask = np.ones((3, 20), bool)
        mask[0, [3, 7]] = mask[2, [0, 19]] = False
    t_mask = None if mask is None else torch.from_numpy(mask)
    got = relative_l2_sum(torch.from_numpy(pred), torch.from_numpy(true), t_mask, IDENTITY)
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.item(), hand_rel_l2(pred, true, mask).sum(), rtol=1e-12)
    got = gradient_relative_l2_sum(torch.from_numpy(pred), torch.from_numpy(true), grid, t_mask)
    np.testing.assert_allclose(got.item(), hand_grad_rel_l2(pred, true, grid, mask).sum(),
                               rtol=1e-12)


def test_gradient_term_refuses_a_token_shard():
    """The stencil needs a sample's whole grid: a batch holding part of its points (as a
    context-parallel rank does) is refused with a sentence, never computed wrongly."""
    pred = torch.zeros(2, 10, 1)
    with pytest.raises(ValueError, match="context parallelism"):
        gradient_relative_l2_sum(pred, pred, (5, 4))


@pytest.mark.parametrize("masked", [False, True])
def test_field_task_darcy_loss_is_the_reference_formula(masked):
    """The task's loss / count on a batch equals mean_b [rel_b + 0.1 (rel(d1)_b +
    rel(d2)_b)] of the DE-normalised prediction (float64), masks included; training
    items carry physical targets and, for a masked grid, the whole grid."""
    splits = grid_splits(masked=masked)
    task = FieldTask(run_config(loss="rel_l2_grad", grad_loss_weight=0.1), "unused",
                     splits=splits)
    items = [task.get("train", i, 0, training=True) for i in range(3)]
    batch = task.collate(items)
    assert batch["x"].shape[1] == 20
    np.testing.assert_array_equal(batch["y"].numpy(), splits.train.y[:3])
    pred = torch.randn(3, 20, 1, dtype=torch.float64)
    loss = task.loss(pred, {k: v.double() if v.is_floating_point() else v
                            for k, v in batch.items()}, IDENTITY)
    count = task.loss_count(batch, IDENTITY)
    mask = splits.train.mask[:3] if masked else None
    decoded = pred.numpy() * task.y_norm.std.astype(np.float64) + task.y_norm.mean
    if mask is not None:
        decoded = decoded * mask[..., None]
    true = splits.train.y[:3].astype(np.float64)
    want = (hand_rel_l2(decoded, true, mask)
            + 0.1 * hand_grad_rel_l2(decoded, true, (5, 4), mask)).mean()
    assert count.item() == 3
    np.testing.assert_allclose((loss / count).item(), want, rtol=1e-6)


def test_mse_and_rel_l2_losses_with_padding():
    """mse: the squared error of normalised outputs summed over real points / their count;
    rel_l2: the per-sample relative error of decoded outputs averaged over samples; padded
    points count in neither."""
    rng = np.random.default_rng(2)
    sizes = [5, 8, 3]
    y = np.zeros((3, 8, 1), np.float32)
    x = np.zeros((3, 8, 2), np.float32)
    mask = np.zeros((3, 8), bool)
    for i, n in enumerate(sizes):
        y[i, :n] = rng.normal(1, 1, (n, 1))
        x[i, :n] = rng.random((n, 2))
        mask[i, :n] = True
    samples = MeshSamples(x=x, y=y, mask=mask)
    splits = DatasetSplits("pad", samples, samples.subset(slice(0, 2))).validate()
    for loss_name in ("mse", "rel_l2"):
        task = FieldTask(run_config(loss=loss_name), "unused", splits=splits)
        batch = task.collate([task.get("train", i, 0, training=True) for i in range(3)])
        pred = torch.randn(3, 8, 1, dtype=torch.float64)
        got = (task.loss(pred, batch, IDENTITY) / task.loss_count(batch, IDENTITY)).item()
        m = batch["mask"].numpy()
        if loss_name == "mse":
            z = (y - task.y_norm.mean) / task.y_norm.std
            err = (pred.numpy() - z) ** 2 * m[..., None]
            want = err.sum() / m.sum()
        else:
            decoded = (pred.numpy() * task.y_norm.std + task.y_norm.mean) * m[..., None]
            want = hand_rel_l2(decoded, y.astype(np.float64), m).mean()
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_relative_losses_refuse_undefined_training_data():
    """A training sample with an all-zero target (relative error undefined) is refused at
    task build with its index; so is a gradient loss on data without a grid."""
    splits = grid_splits()
    splits.train.y[2] = 0
    with pytest.raises(ValueError, match=r"sample\(s\) \[2\].*all-zero"):
        FieldTask(run_config(loss="rel_l2"), "unused", splits=splits)
    FieldTask(run_config(loss="mse"), "unused", splits=splits)
    flat = grid_splits()
    flat.train.grid_shape = None
    with pytest.raises(ValueError, match="grid_shape"):
        FieldTask(run_config(loss="rel_l2_grad"), "unused", splits=flat)


def test_input_norm_rules():
    """none keeps raw values, standard is (a - mean) / std, bbox maps the training box to
    [0, 1], each per channel over real points; reference follows the study per dataset
    (Darcy: raw positions, standardised coefficient); a rule list of the wrong length is
    an error naming the channel count. The paper presets follow the reference; darcy-tiny
    standardises every channel."""
    rng = np.random.default_rng(3)
    x = rng.normal(5, 2, (4, 6, 3)).astype(np.float32)
    mask = np.ones((4, 6), bool)
    mask[1, 4:] = False
    x[1, 4:] = 1e6  # padding must not enter the statistics
    norm = fit_input_normalizer(x, mask, ["none", "standard", "bbox"])
    real = x[mask].astype(np.float64)
    np.testing.assert_allclose(norm.mean, [0, real[:, 1].mean(), real[:, 2].min()], rtol=1e-6)
    np.testing.assert_allclose(norm.std, [1, real[:, 1].std(),
                                          real[:, 2].max() - real[:, 2].min()], rtol=1e-5)
    z = norm.encode(x)[mask]
    assert z[:, 2].min() == pytest.approx(0, abs=1e-6) and z[:, 2].max() == pytest.approx(1)
    assert resolve_input_norm(get_preset("darcy"), 3) == ["none", "none", "standard"]
    # the -tiny presets standardise every channel: chosen by the preset studies (docs/results.md)
    assert resolve_input_norm(get_preset("darcy-tiny"), 3) == ["standard"] * 3
    assert resolve_input_norm(get_preset("elasticity-tiny"), 2) == ["standard"] * 2
    assert resolve_input_norm(run_config(input_norm="reference", dataset="elasticity"), 2) \
        == ["none", "none"]
    assert resolve_input_norm(run_config(input_norm="reference"), 2) == ["standard"] * 2
    with pytest.raises(ValueError, match="3 input channels"):
        resolve_input_norm(run_config(input_norm=["none", "bbox"]), 3)
    with pytest.raises(ValueError, match="unknown rule"):
        run_config(input_norm="minmax")


def test_weight_decay_groups():
    """weights: decay on linear weight matrices only, none on biases, norm scales or the
    free parameters (FLARE++ fixed queries, synthesis seeds, gate logits); reference: the
    study's split as it acts (free parameters decayed, biases and norms not); all: one
    group with the decay (flarepp's original layout)."""
    from flarepp.models import build_model
    model = build_model(in_dim=2, out_dim=1, mixer="flarepp", dim=8, heads=2, blocks=1,
                        latents=4)
    decayed, spared = split_decay(model, "weights")
    free = {"blocks.0.mixer.fixed_queries", "blocks.0.mixer.synthesis_seeds",
            "blocks.0.mixer.gate_logit"}
    assert free <= set(spared)
    assert all(n.endswith(".weight") for n in decayed)
    assert not any(n.endswith("bias") or "norm" in n for n in decayed)
    assert "blocks.0.mixer.key_value_proj.weight" in decayed
    ref_decayed, ref_spared = split_decay(model, "reference")
    assert free <= set(ref_decayed)
    assert all(n.endswith("bias") or "norm" in n for n in ref_spared)
    groups = build_optimizer(model, run_config(weight_decay=0.5)).param_groups
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    single = build_optimizer(model, run_config(weight_decay=0.5, weight_decay_groups="all"))
    assert [g["weight_decay"] for g in single.param_groups] == [0.5]


def test_momentum_cycle():
    """With momentum_cycle (0.85, 0.95) beta1 starts at 0.95, reaches 0.85 at the peak
    learning rate and returns to 0.95; with None it stays betas[0]."""
    model = torch.nn.Linear(2, 2)
    cfg = run_config(pct_start=0.25)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, 40)
    betas, lrs = [], []
    for _ in range(40):
        betas.append(opt.param_groups[0]["betas"][0])
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert betas[0] == pytest.approx(0.95)
    peak = int(np.argmax(lrs))
    assert betas[peak] == pytest.approx(0.85, abs=1e-3) and betas[-1] > 0.949
    fixed = run_config(momentum_cycle=None)
    opt = build_optimizer(model, fixed)
    build_scheduler(opt, fixed, 40)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)


def test_attn_scale_per_mixer():
    """attn_scale="reference" gives FLARE the study's 1.0 and FLARE++ the paper's 1/sqrt(D)
    (the built mixers carry it); sqrt gives 1/sqrt(D) to both; a number to both; an
    explicit model.attn_scale wins."""
    from flarepp.models import build_model
    for mixer, scale, want in [("flare", "reference", 1.0), ("flarepp", "reference", None),
                               ("flare", "sqrt", None), ("flarepp", 0.5, 0.5)]:
        cfg = run_config(model=dict(mixer=mixer, dim=8, heads=2, latents=4, blocks=1),
                         attn_scale=scale)
        model = build_model(in_dim=2, out_dim=1, **cfg.model_kwargs())
        assert model.blocks[0].mixer.config.attn_scale == want, (mixer, scale)
        assert cfg.sdpa_scale() == (want if want is not None else 0.5)
    cfg = run_config(model=dict(mixer="flare", dim=8, heads=2, latents=4, blocks=1,
                                attn_scale=0.3))
    assert cfg.model_kwargs()["attn_scale"] == 0.3
    assert get_preset("darcy-tiny", ["model.mixer=flare"]).sdpa_scale_text() == "1"
    assert get_preset("darcy-tiny").sdpa_scale_text() == "1/sqrt(16)"


def test_stored_configs_without_protocol_fields_keep_their_protocol():
    """A config.json written before the protocol fields existed is read with the protocol
    it ran under (MSE, standard inputs, decay on all, fixed beta1, 1/sqrt(D))."""
    stored = get_preset("darcy-tiny").to_dict()
    for key in LEGACY_PROTOCOL:
        stored.pop(key)
    stored.pop(VERSION_KEY)    # as written before the version was
    config = RunConfig.from_stored(json.loads(json.dumps(stored)))
    assert {k: getattr(config, k) for k in LEGACY_PROTOCOL} == LEGACY_PROTOCOL
    fresh = get_preset("darcy-tiny")
    assert RunConfig.from_stored(json.loads(json.dumps(fresh.to_dict()))) == fresh
    assert RunConfig.from_stored(json.loads(json.dumps(fresh.to_file()))) == fresh


def test_a_users_partial_config_gets_todays_defaults(tmp_path):
    """A hand-written config.json (no version) trains with today's defaults, not the legacy
    protocol; the run's own config.json names the version that wrote it, in sections."""
    user = RunConfig.from_dict({"dataset": "darcy", "model": {"mixer": "flare"}})
    defaults = RunConfig(name="darcy", dataset="darcy", model={"mixer": "flare"})
    assert user == defaults
    assert {k: getattr(user, k) for k in LEGACY_PROTOCOL} != LEGACY_PROTOCOL
    written = defaults.to_file()
    assert written[VERSION_KEY] == CONFIG_VERSION
    assert written["protocol"]["loss"] == "reference" and written["data"]["dataset"] == "darcy"
    assert RunConfig.from_dict(written) == defaults
    with pytest.raises(ValueError, match="both in section 'data' and at the top"):
        RunConfig.from_dict({"dataset": "darcy", "data": {"dataset": "darcy"}})


@pytest.mark.slow
def test_trainer_writes_param_groups(tmp_path):
    """A run's directory names the parameters of each weight-decay group."""
    splits = grid_splits(n_train=6, n_test=2)
    cfg = run_config(epochs=3, weight_decay=1e-3, checkpoint_every=3)
    Trainer(cfg, tmp_path / "run", splits=splits, progress=False).fit()
    groups = json.loads((tmp_path / "run" / "param_groups.json").read_text())["groups"]
    assert [g["weight_decay"] for g in groups] == [1e-3, 0.0]
    assert "blocks.0.mixer.gate_logit" in groups[1]["names"]
    assert "blocks.0.mixer.out_proj.weight" in groups[0]["names"]


@pytest.mark.slow
def test_golden_darcy_tiny_curves(tmp_path):
    """The seeded darcy-tiny curves (FLARE++ and FLARE, tests/golden/darcy_tiny.json, made
    by scripts/golden_darcy_tiny.py) are reproduced to the relative tolerance the file
    states per curve and weights: 5x the spread measured over the CPU kernel choices
    (ATEN_CPU_CAPABILITY, MKL_CBWR), so that another CPU passes, and below what the
    smallest protocol change moves (see the script). A failure means the training
    protocol, the model or the data generator changed: if intended, regenerate the file
    and say why."""
    import importlib.util
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("golden", root / "scripts" /
                                                  "golden_darcy_tiny.py")
    golden = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(golden)
    stored = json.loads((root / "tests" / "golden" / "darcy_tiny.json").read_text())
    rtol = stored.pop(golden.TOLERANCE)["rtol"]
    assert set(stored) == set(golden.CURVES) == set(rtol)
    for name, extra in golden.CURVES.items():
        got = golden.golden_run(tmp_path, extra, run_name=name)
        assert got["overrides"] == stored[name]["overrides"]
        assert set(got) == set(stored[name])
        for key in sorted(set(got) - {"overrides"}):
            np.testing.assert_allclose(got[key], stored[name][key],
                                       rtol=rtol[name][golden.weights_of(key)],
                                       err_msg=f"{name} {key}")


def test_gradient_loss_refuses_a_target_constant_along_an_axis():
    """A training target whose zero-padded central differences vanish along a grid axis
    (on the 5 x 4 grid: 1 on even rows, 0 on odd ones) has no relative gradient error:
    refused at task build, naming the sample."""
    splits = grid_splits()
    rows = np.zeros((5, 4), np.float32)
    rows[::2] = 1.0
    splits.train.y[4] = rows.reshape(20, 1)
    with pytest.raises(ValueError, match=r"sample\(s\) \[4\].*constant along a grid axis"):
        FieldTask(run_config(loss="rel_l2_grad"), "unused", splits=splits)
