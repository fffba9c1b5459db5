"""The trainer on a GPU (run by `make gpu-check`; skipped on machines without CUDA).

FP32 / BF16 / FP16 training on CUDA gives finite metrics with the model, EMA, optimiser
state and every batch on the GPU; a run checkpointed on the GPU resumes on the CPU (and
the other way round) to the metrics of an uninterrupted run on the device it ends on.
"""

import pytest
import torch

from flarepp.train import Trainer, get_preset, latest_checkpoint, train

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TINY = ["epochs=2", "checkpoint_every=1", "batch_size=4",
        "dataset_options={'resolution': 8, 'n_train': 12, 'n_test': 4}",
        "model.dim=16", "model.heads=2", "model.blocks=2", "model.latents=4"]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_trainer_on_cuda(darcy_dir, tmp_path, precision):
    """Everything lives on the GPU and the run ends with finite metrics."""
    config = get_preset("darcy-tiny", TINY + [f"precision={precision}", "device=cuda"])
    trainer = Trainer(config, tmp_path / precision, data_root=darcy_dir, progress=False)
    assert all(p.device.type == "cuda" for p in trainer.model.parameters())
    assert all(p.device.type == "cuda" for p in trainer.ema.module.parameters())
    metrics = trainer.fit()
    state = trainer.optimizer.state[next(iter(trainer.model.parameters()))]
    assert state["exp_avg"].device.type == "cuda"
    assert torch.isfinite(torch.tensor(metrics["test_rel_l2"]))
    assert metrics["device"].startswith("cuda")


@pytest.mark.parametrize("first,second", [("cuda", "cpu"), ("cpu", "cuda")])
def test_resume_across_devices(darcy_dir, tmp_path, first, second):
    """Stopped after one epoch on ``first``, resumed on ``second``: the run finishes, and
    evaluates on either device to the same metric."""
    config = get_preset("darcy-tiny", TINY)
    assert train(config, tmp_path / "run", data_root=darcy_dir, progress=False,
                 stop_after=1, device=first) is None
    metrics = train(config, tmp_path / "run", data_root=darcy_dir, progress=False,
                    resume=True, device=second)
    assert metrics["device"].startswith(second)
    from flarepp.train import evaluate_checkpoint
    last = latest_checkpoint(tmp_path / "run")
    on_cpu = evaluate_checkpoint(last, data_root=darcy_dir, device="cpu")
    on_gpu = evaluate_checkpoint(last, data_root=darcy_dir, device="cuda")
    assert on_cpu["test_rel_l2"] == pytest.approx(metrics["test_rel_l2"], rel=1e-3)
    assert on_gpu["test_rel_l2"] == pytest.approx(metrics["test_rel_l2"], rel=1e-3)


def test_loader_workers_and_pinned_memory(darcy_dir, tmp_path):
    """Two loader workers with pinned host memory give the same run as none."""
    base = get_preset("darcy-tiny", TINY + ["device=cuda", "loader_workers=0"])
    a = train(base, tmp_path / "a", data_root=darcy_dir, progress=False)
    workers = get_preset("darcy-tiny", TINY + ["device=cuda", "loader_workers=2"])
    b = train(workers, tmp_path / "b", data_root=darcy_dir, progress=False)
    assert b["test_rel_l2"] == pytest.approx(a["test_rel_l2"], rel=1e-4)
