"""Training, checkpoints, resume and evaluation on a tiny generated Darcy set."""

import json
import subprocess
import sys

import pytest
import torch

from flarepp.cli import main as cli
from flarepp.train import CheckpointError, get_preset, latest_checkpoint, train

TINY = ["epochs=3", "checkpoint_every=1", "batch_size=4",
        "dataset_options={'resolution': 8, 'n_train': 12, 'n_test': 4}",
        "model.dim=16", "model.heads=2", "model.blocks=2", "model.latents=4"]


@pytest.mark.slow
def test_resume_is_bitwise_identical(darcy_dir, tmp_path):
    """A run stopped after one epoch and resumed ends exactly where an uninterrupted run
    ends (CPU, FP32): a difference means some state (RNG, EMA, scheduler) is not saved."""
    config = get_preset("darcy-tiny", TINY)
    full = train(config, tmp_path / "full", data_root=darcy_dir, progress=False)
    assert train(config, tmp_path / "cut", data_root=darcy_dir, progress=False,
                 stop_after=1) is None
    resumed = train(config, tmp_path / "cut", data_root=darcy_dir, progress=False,
                    resume=True)
    for key in ("test_rel_l2", "train_rel_l2", "epochs", "params"):
        assert resumed[key] == full[key], key
    a = torch.load(latest_checkpoint(tmp_path / "full"), weights_only=True)
    b = torch.load(latest_checkpoint(tmp_path / "cut"), weights_only=True)
    for k in a["ema"]:
        assert torch.equal(a["ema"][k], b["ema"][k]), k
    log = [json.loads(x) for x in (tmp_path / "cut" / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [1, 2, 3]


@pytest.mark.slow
def test_eval_reproduces_metrics_from_checkpoint(darcy_dir, tmp_path):
    """`flarepp eval` on the last checkpoint gives metrics.json's test_rel_l2 to 1e-6."""
    config = get_preset("darcy-tiny", TINY)
    metrics = train(config, tmp_path / "run", data_root=darcy_dir, progress=False)
    assert 0.01 < metrics["test_rel_l2"] < 1.5  # 3 epochs of a 16-wide model: far from 0
    out = tmp_path / "eval.json"
    assert cli(["eval", str(latest_checkpoint(tmp_path / "run")), "--data", str(darcy_dir),
                "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert abs(got["test_rel_l2"] - metrics["test_rel_l2"]) < 1e-6
    assert set(got) >= {"test_rel_l2", "train_rel_l2", "epochs", "params"}
    assert cli(["plot", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "curves.png").is_file()
    assert list((tmp_path / "run").glob("case_*.png"))


@pytest.mark.slow
def test_plot_of_a_stopped_run_predicts_from_its_checkpoint(darcy_dir, tmp_path, capsys):
    """`flarepp plot --device cpu` on a run stopped with --stop-after (no final outputs)
    predicts the test split from the newest checkpoint, says so with the checkpoint's test
    metric (equal to `flarepp eval`'s), and draws the cases; with no checkpoint either it
    is an error sentence."""
    from flarepp.train import evaluate_checkpoint
    config = get_preset("darcy-tiny", TINY)
    run = tmp_path / "stopped"
    assert train(config, run, data_root=darcy_dir, progress=False, stop_after=1) is None
    assert not (run / "metrics.json").exists() and not (run / "test_predictions.npz").exists()
    assert cli(["plot", str(run), "--device", "cpu", "--cases", "2"]) == 0
    err = capsys.readouterr().err
    assert "is unfinished: predicted its outputs from" in err
    expected = evaluate_checkpoint(latest_checkpoint(run), device="cpu")["test_rel_l2"]
    assert f"test_rel_l2 {expected:.6g}" in err
    assert (run / "test_predictions.npz").is_file()
    assert len(list(run.glob("case_*.png"))) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((run / "config.json").read_text())
    assert cli(["plot", str(empty)]) != 0
    assert "no readable checkpoint" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_training_runs(darcy_dir, tmp_path, precision):
    """bf16/fp16 autocast (with a gradient scaler for fp16) trains with RMSNorm to finite
    metrics."""
    config = get_preset("darcy-tiny", TINY + ["epochs=1", f"precision={precision}"])
    assert config.model_kwargs()["norm"] == "rmsnorm"
    metrics = train(config, tmp_path / precision, data_root=darcy_dir, progress=False)
    assert torch.isfinite(torch.tensor(metrics["test_rel_l2"]))


@pytest.mark.slow
def test_bad_inputs_fail_clearly(darcy_dir, tmp_path, capsys):
    """Unknown preset, missing data directory, corrupt checkpoint, config mismatch on
    resume: non-zero exit / clear error naming the problem, earlier checkpoints intact."""
    assert cli(["train", "no-such-preset", "--out", str(tmp_path / "x")]) == 2
    assert "known presets" in capsys.readouterr().err
    assert cli(["train", "darcy-tiny", "--data", str(tmp_path / "missing"),
                "--out", str(tmp_path / "y")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()
    assert cli(["train", "darcy-tiny", "--data", str(darcy_dir), "--set", "nope=1"]) == 2
    assert "unknown key" in capsys.readouterr().err

    config = get_preset("darcy-tiny", TINY + ["epochs=2"])
    train(config, tmp_path / "run", data_root=darcy_dir, progress=False)
    last = latest_checkpoint(tmp_path / "run")
    bad = tmp_path / "run" / "checkpoints" / "epoch_0099.pt"
    bad.write_bytes(last.read_bytes()[:1000])
    assert cli(["eval", str(bad), "--data", str(darcy_dir)]) == 1
    assert "corrupt" in capsys.readouterr().err
    bad.unlink()
    other = get_preset("darcy-tiny", TINY + ["epochs=4", "lr=0.01"])
    with pytest.raises(CheckpointError, match="different config"):
        train(other, tmp_path / "run", data_root=darcy_dir, progress=False, resume=True)
    torch.load(last, weights_only=True)  # the earlier checkpoint is intact
    with pytest.raises(ValueError, match="already holds a run"):
        train(config, tmp_path / "run", data_root=darcy_dir, progress=False)


@pytest.mark.slow
def test_console_script_help():
    """The `flarepp` entry point lists its commands."""
    out = subprocess.run([sys.executable, "-m", "flarepp", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for command in ("train", "eval", "plot", "demo"):
        assert command in out


@pytest.mark.slow
def test_runtime_settings_do_not_change_a_run(darcy_dir, tmp_path):
    """A run with loader worker processes, stopped and resumed in one process with a
    checkpoint that says it was written on a GPU (device cuda, a CUDA RNG state), ends
    bitwise where an uninterrupted single-process run ends: the device and the loader are
    runtime settings, not part of what a run computes. A failure points to worker-dependent
    batches or to a resume check that compares runtime fields."""
    config = get_preset("darcy-tiny", TINY + ["device=cpu"])
    full = train(config, tmp_path / "full", data_root=darcy_dir, progress=False)
    workers = get_preset("darcy-tiny", TINY + ["device=cpu", "loader_workers=1"])
    assert train(workers, tmp_path / "cut", data_root=darcy_dir, progress=False,
                 stop_after=1) is None
    path = latest_checkpoint(tmp_path / "cut")
    state = torch.load(path, weights_only=True)
    state["config"]["device"] = "cuda:0"
    state["rng"]["cuda"] = torch.zeros(16, dtype=torch.uint8)
    torch.save(state, path)
    resumed = train(get_preset("darcy-tiny", TINY + ["device=auto"]), tmp_path / "cut",
                    data_root=darcy_dir, progress=False, resume=True, device="cpu")
    for key in ("test_rel_l2", "train_rel_l2"):
        assert resumed[key] == full[key], key
    assert resumed["device"] == "cpu"


def test_unknown_device_is_a_sentence(darcy_dir, tmp_path, capsys):
    """--device with a device this machine lacks fails before any work, naming it."""
    assert cli(["train", "darcy-tiny", "--data", str(darcy_dir), "--out",
                str(tmp_path / "x"), "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert cli(["train", "darcy-tiny", "--data", str(darcy_dir), "--out",
                    str(tmp_path / "x"), "--device", "cuda"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
