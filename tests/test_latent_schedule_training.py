"""Rank-adaptive training in the trainer: ``latent_schedule`` grows M at epoch starts."""

import json

import pytest
import torch

from flarepp.train import Trainer, evaluate_checkpoint, get_preset, latest_checkpoint, train

TINY = ["epochs=3", "checkpoint_every=1", "batch_size=4", "device=cpu",
        "dataset_options={'resolution': 8, 'n_train': 12, 'n_test': 4}",
        "model.dim=16", "model.heads=2", "model.blocks=2", "model.mixer=flare",
        "latent_schedule=2,4@1,6@2"]


@pytest.mark.slow
def test_schedule_grows_model_ema_and_checkpoint(darcy_dir, tmp_path):
    """M follows the schedule (logged per epoch); the checkpoint rebuilds the grown model,
    and eval of it reproduces the run's metric."""
    config = get_preset("darcy-tiny", TINY)
    metrics = train(config, tmp_path / "run", data_root=darcy_dir, progress=False)
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["latents"] for r in log] == [2, 4, 6]
    got = evaluate_checkpoint(latest_checkpoint(tmp_path / "run"), data_root=darcy_dir,
                              device="cpu")
    assert got["test_rel_l2"] == pytest.approx(metrics["test_rel_l2"], rel=1e-9)
    state = torch.load(latest_checkpoint(tmp_path / "run"), weights_only=True)
    assert state["model_config"]["latents"] == 6
    assert state["model_config"]["mixer"] == "flare-rank-adaptive"


def test_growth_in_the_trainer_keeps_the_function(darcy_dir, tmp_path):
    """Right after the trainer grows M, the model and its EMA copy compute the same outputs
    as before (the optimizer state and DDP/CP wrapping follow without touching them)."""
    trainer = Trainer(get_preset("darcy-tiny", TINY), tmp_path / "run",
                      data_root=darcy_dir, progress=False)
    item = [trainer.task.get("train", i, 0, training=True) for i in range(3)]
    batch = trainer.task.collate(item)
    with torch.no_grad():
        before = trainer.model(batch["x"]), trainer.ema.module(batch["x"])
        trainer._grow(5)
        after = trainer.model(batch["x"]), trainer.ema.module(batch["x"])
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert trainer.model.config.latents == trainer.ema.module.config.latents == 5
    trainer.close()


@pytest.mark.slow
def test_resume_across_growth_is_bitwise(darcy_dir, tmp_path):
    """Stopped after epoch 1 (M = 2), resumed (grows to 4, then 6): the run ends exactly
    where an uninterrupted one ends."""
    config = get_preset("darcy-tiny", TINY)
    full = train(config, tmp_path / "full", data_root=darcy_dir, progress=False)
    train(config, tmp_path / "cut", data_root=darcy_dir, progress=False, stop_after=2)
    resumed = train(config, tmp_path / "cut", data_root=darcy_dir, progress=False,
                    resume=True)
    assert resumed["test_rel_l2"] == full["test_rel_l2"]


def test_bad_schedule_is_a_config_error():
    with pytest.raises(ValueError, match="latent schedule"):
        get_preset("darcy-tiny", ["latent_schedule=16,8x@3"])
