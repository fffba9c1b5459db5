"""The rollout task (flarepp.tasks.rollout) on tiny generated advection-diffusion data."""

import json

import numpy as np
import pytest
import torch

from flarepp.cli import main as cli
from flarepp.data.generators.advection_diffusion import make_advection_diffusion
from flarepp.tasks import build_task
from flarepp.train import get_preset

OPTIONS = {"n_train": 3, "n_test": 2, "history": 2, "patches": 2, "unroll": 2, "horizon": 5}
TINY = ["model.dim=16", "model.heads=2", "model.blocks=1", "model.latents=4", "epochs=2",
        "batch_size=8", "eval_every=1", f"dataset_options={OPTIONS!r}"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("advection")
    make_advection_diffusion(root, n_train=3, n_test=2, resolution=8, seed=1, progress=False)
    return root


def make_task(root, preset="rollout-tiny"):
    return build_task(get_preset(preset, TINY), root)


def test_items_and_conditioning_tokens(data_dir):
    """Training windows start at every state 0..T-U of every trajectory; the history before
    t = 0 is masked out of the conditioning; patch tokens hold the patch means of the
    earlier states (oldest first), the global token the time and parameters."""
    task = make_task(data_dir)
    T = task.data.steps
    assert task.num_samples("train") == 3 * (T - 2 + 1) and task.num_samples("test") == 2
    first, later = task.get("train", 0, 0), task.get("train", 5, 0)
    assert first["states"].shape == (2 + 1 + 2, 64) and not first["lag_valid"].any()
    assert later["lag_valid"].all() and later["time"] == pytest.approx(5 * task.dt)
    u = task.data.train.u[0]
    np.testing.assert_array_equal(later["states"], u[3:8].reshape(5, 64))
    np.testing.assert_array_equal(first["states"][:3], u[[0, 0, 0]].reshape(3, 64))
    batch = task.collate([first, later])
    s = task.stats
    history = (batch["states"][:, :2] - s["u_mean"]) / s["u_std"]
    tokens, mask = task.conditioning(batch["time"], batch["params"], history,
                                     batch["lag_valid"])
    assert tokens.shape == (2, task.cond_tokens, 7) and task.cond_tokens == 1 + 2 * 4
    assert mask[0].tolist() == [True] + [False] * 8 and mask[1].all()
    assert tokens[1, 0, 1] == pytest.approx(5 * task.dt)
    lag2 = (u[3] - s["u_mean"]) / s["u_std"]                    # state 3 = two before 5
    patch_means = lag2.reshape(2, 4, 2, 4).mean((1, 3)).reshape(-1)
    np.testing.assert_allclose(tokens[1, 1:5, 6].numpy(), patch_means, rtol=1e-5, atol=1e-6)
    assert tokens[1, 1:5, 5].tolist() == [1.0] * 4 and tokens[1, 5:, 5].tolist() == [0.5] * 4


def test_rollout_feeds_predictions_back_and_loss_by_hand(data_dir):
    """A rollout of S steps equals S one-step calls, each given the previous prediction as
    its state and the shifted history (a failure means the loop reads the truth instead
    of its own predictions); the loss is the summed squared error in units of the
    one-step change, counted per value."""
    task = make_task(data_dir)
    torch.manual_seed(0)
    model = task.build_model().double()
    batch = task.collate([task.get("test", 0, 0)])
    batch = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}
    with torch.no_grad():
        rolled = task.forward(model, batch)                     # [1, 5, N]
        states = batch["states"].clone()
        valid = batch["lag_valid"].clone()
        for step in range(5):
            window = {**batch, "states": states[:, step:step + 4], "lag_valid": valid,
                      "time": batch["time"] + step * task.dt}
            one = task.forward(model, window)[:, 0]
            torch.testing.assert_close(one, rolled[:, step], rtol=1e-12, atol=1e-12)
            states[:, step + 3] = one                            # feed the prediction back
            valid = torch.cat([valid[:, 1:], torch.ones_like(valid[:, :1])], dim=1)
    def ident(t):  # one process: token sums are the identity
        return t

    train_batch = task.collate([task.get("train", i, 0) for i in (0, 7)])
    with torch.no_grad():
        pred = task.forward(model.float(), train_batch)
    by_hand = (((pred - train_batch["states"][:, 3:]) / task.stats["delta_std"]) ** 2).sum()
    torch.testing.assert_close(task.loss(pred, train_batch, ident), by_hand)
    assert float(task.loss_count(train_batch, ident)) == 2 * 2 * 64


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["rollout-tiny", "rollout-tiny-concat",
                                    "rollout-tiny-adaln"])
def test_tiny_rollout_run_end_to_end(data_dir, tmp_path, preset, capsys):
    """Each conditioning scheme trains through the one trainer (2-step unrolled windows),
    is evaluated by rollouts over the horizon, writes per-step errors and plots, and
    `flarepp eval` of its checkpoint reproduces the reported rollout error."""
    out = tmp_path / "run"
    assert cli(["train", preset, "--data", str(data_dir), "--out", str(out), "--quiet",
                *[a for s in TINY for a in ("--set", s)]]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["task"] == "rollout" and np.isfinite(metrics["test_rollout_rel_l2"])
    with np.load(out / "test_rollout.npz") as f:
        assert f["rel_l2"].shape == (2, 5)
        assert f["pred"].shape == (2, 5, 8, 8) and f["true"].shape == (2, 6, 8, 8)
        assert f["rel_l2"].mean() == pytest.approx(metrics["test_rollout_rel_l2"])
    for name in ("curves.png", "rollout_error.png", "rollout_cases.png"):
        assert (out / name).is_file(), name
    capsys.readouterr()
    ckpt = sorted((out / "checkpoints").glob("*.pt"))[-1]
    assert cli(["eval", str(ckpt), "--device", "cpu"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["test_rollout_rel_l2"] == pytest.approx(metrics["test_rollout_rel_l2"],
                                                         rel=1e-6)
