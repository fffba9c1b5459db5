"""Nothing lost, nothing executed, every error a sentence: the trainer and CLI side of it.

Each test reproduces one defect found in the previous version (named in its docstring).
"""

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from flarepp.cli import main as cli
from flarepp.train import Trainer, get_preset, latest_checkpoint, train
from flarepp.train.loop import TrainingInterrupted

TINY = ["epochs=3", "checkpoint_every=5", "batch_size=4",
        "dataset_options={'resolution': 8, 'n_train': 12, 'n_test': 4}",
        "model.dim=16", "model.heads=2", "model.blocks=2", "model.latents=4", "device=cpu"]


def sets(items):
    return [a for t in items for a in ("--set", t)]


def run_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "flarepp", *map(str, args)],
                          capture_output=True, text=True, **kw)


@pytest.mark.slow
def test_stop_after_writes_the_checkpoint_it_promises(darcy_dir, tmp_path, capsys):
    """--stop-after 1 with checkpoint_every=5 used to write nothing, so --resume failed
    with "no checkpoint"; now the stop epoch is always checkpointed."""
    out = tmp_path / "run"
    assert cli(["train", "darcy-tiny", "--data", str(darcy_dir), "--out", str(out),
                "--quiet", "--stop-after", "1", *sets(TINY)]) == 0
    assert "--resume" in capsys.readouterr().out
    assert (out / "checkpoints" / "epoch_0001.pt").is_file()
    assert cli(["train", "darcy-tiny", "--data", str(darcy_dir), "--out", str(out),
                "--quiet", "--resume", *sets(TINY)]) == 0
    assert json.loads((out / "metrics.json").read_text())["epochs"] == 3


@pytest.mark.slow
def test_second_process_on_one_run_directory_is_refused(darcy_dir, tmp_path):
    """Two `flarepp train` into one --out both exited 0 and interleaved log.jsonl; now the
    second fails at once (exit 1), naming the first one's pid and host."""
    out = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "flarepp", "train", "darcy-tiny", "--data", str(darcy_dir),
         "--out", str(out), "--quiet", *sets(TINY + ["epochs=400"])],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / ".lock").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        second = run_cli("train", "darcy-tiny", "--data", darcy_dir, "--out", out, "--quiet",
                         *sets(TINY), timeout=120)
        assert second.returncode == 1, second.stderr
        assert f"process {first.pid}" in second.stderr and "host" in second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=120)
    assert first.returncode == 143, stderr
    assert "terminated" in stderr or ("--resume" in stderr and "SIGTERM" in stderr)


@pytest.mark.slow
def test_stale_temporary_does_not_block_the_directory(darcy_dir, tmp_path):
    """A SIGKILL during the first checkpoint write left checkpoints/.epoch_0002.pt.*.tmp:
    a fresh start then refused ("already holds a run") and --resume refused ("no
    checkpoint"). Leftover temporaries are removed at start."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    stale = out / "checkpoints" / ".epoch_0002.pt.4242.deadbeef.tmp"
    stale.write_bytes(b"half a checkpoint")
    config = get_preset("darcy-tiny", TINY + ["epochs=1"])
    assert train(config, out, data_root=darcy_dir, progress=False)["epochs"] == 1
    assert not stale.exists()


@pytest.mark.slow
def test_resume_refuses_other_data_and_eval_finds_the_runs_data(darcy_dir, tmp_path):
    """--resume with a different --data was accepted (and re-fitted the normalisers
    mid-run); eval without --data read the preset's default directory. Now resume names
    the mismatch and eval uses the data the run trained on."""
    from flarepp.data.generators.darcy import make_darcy
    other = tmp_path / "other"
    make_darcy(other, n_train=12, n_test=4, resolution=15, seed=4, progress=False)
    out = tmp_path / "run"
    config = get_preset("darcy-tiny", TINY)
    train(config, out, data_root=darcy_dir, progress=False, stop_after=1)
    from flarepp.data.fingerprint import DataMismatch
    with pytest.raises(DataMismatch, match="different training split"):
        train(config, out, data_root=other, progress=False, resume=True)
    metrics = train(config, out, data_root=darcy_dir, progress=False, resume=True)
    from flarepp.train import evaluate_checkpoint
    assert not Path(config.data_root).exists()  # the preset's default is not there
    got = evaluate_checkpoint(latest_checkpoint(out), device="cpu")
    assert got["test_rel_l2"] == pytest.approx(metrics["test_rel_l2"], rel=1e-6)


@pytest.mark.slow
def test_truncated_latest_checkpoint_falls_back(darcy_dir, tmp_path, capsys):
    """A truncated latest checkpoint stopped --resume; now the previous good one is used,
    with a message naming the skipped file."""
    out = tmp_path / "run"
    config = get_preset("darcy-tiny", TINY + ["checkpoint_every=1"])
    train(config, out, data_root=darcy_dir, progress=False, stop_after=2)
    last = out / "checkpoints" / "epoch_0002.pt"
    last.write_bytes(last.read_bytes()[:500])
    trainer = Trainer(config, out, data_root=darcy_dir, resume=True)
    assert trainer.epoch == 1
    assert "epoch_0002.pt" in capsys.readouterr().out
    trainer.close()


@pytest.mark.slow
def test_interrupted_mid_epoch_resumes_bitwise(darcy_dir, tmp_path):
    """A SIGINT after a step writes a mid-epoch checkpoint from which the run ends exactly
    where an uninterrupted run ends (CPU, FP32): nothing of the interrupted epoch is lost."""
    config = get_preset("darcy-tiny", TINY + ["batch_size=2"])
    full = train(config, tmp_path / "full", data_root=darcy_dir, progress=False)
    trainer = Trainer(config, tmp_path / "cut", data_root=darcy_dir, progress=False)
    step, calls = trainer.train_step, []

    def step_then_signal(*args):
        calls.append(1)
        if len(calls) == 8:  # in the second epoch (6 steps per epoch)
            trainer._stop_signal = signal.SIGINT
        return step(*args)
    trainer.train_step = step_then_signal
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    assert info.value.exit_code == 130
    assert info.value.checkpoint.name == "epoch_0001_step_000002.pt"
    resumed = train(config, tmp_path / "cut", data_root=darcy_dir, progress=False,
                    resume=True)
    for key in ("test_rel_l2", "train_rel_l2"):
        assert resumed[key] == full[key], key
    log = [json.loads(x) for x in (tmp_path / "cut" / "log.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (tmp_path / "full" / "log.jsonl").read_text().splitlines()]
    assert [r["train_loss"] for r in log] == [r["train_loss"] for r in ref]


@pytest.mark.slow
def test_sigint_exits_130_with_resume_hint(darcy_dir, tmp_path):
    """Ctrl-C gave a raw KeyboardInterrupt traceback; now the step finishes, a checkpoint is
    written and the command says how to continue (exit 130)."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flarepp", "train", "darcy-tiny", "--data", str(darcy_dir),
         "--out", str(out), *sets(TINY + ["epochs=400"])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not (out / "log.jsonl").exists() or not (out / "log.jsonl").read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "SIGINT" in stderr and "--resume" in stderr and "Traceback" not in stderr
    assert latest_checkpoint(out) is not None
    # Output is not a terminal: epoch lines, no progress-bar redraws.
    assert "\r" not in stderr and "epoch    1/400" in stdout


def test_malicious_checkpoint_is_refused_and_runs_nothing(tmp_path, capsys):
    """A crafted .pt handed to `flarepp eval` ran arbitrary code (weights_only=False)."""
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    bad = tmp_path / "evil.pt"
    with open(bad, "wb") as f:
        pickle.dump({"format_version": 1, "x": Exploit()}, f)
    assert cli(["eval", str(bad)]) == 1
    assert "refused" in capsys.readouterr().err
    assert not marker.exists()


def test_output_location_checked_before_work(darcy_dir, tmp_path, capsys):
    """--out that is a file failed with an OSError traceback after data and model were
    built; now it is a usage error (exit 2) before anything is read."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli(["train", "darcy-tiny", "--data", str(darcy_dir), "--out", str(afile)]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert cli(["infer", "x.pt", "--data", str(darcy_dir), "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    if os.geteuid() != 0:  # root writes anywhere, so read-only is only testable as a user
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        assert cli(["train", "darcy-tiny", "--data", str(darcy_dir), "--out",
                    str(ro / "run")]) == 2
        assert "no permission" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_with_wrong_channel_count_is_a_sentence(darcy_dir, tmp_path, capsys):
    """eval on data whose inputs have another channel count raised a RuntimeError from the
    first matmul; now it names both counts (exit 1)."""
    out = tmp_path / "run"
    train(get_preset("darcy-tiny", TINY + ["epochs=1"]), out, data_root=darcy_dir,
          progress=False)
    rng = np.random.default_rng(0)
    npz = tmp_path / "npz"
    npz.mkdir()
    for split in ("train", "test"):
        np.savez(npz / f"{split}.npz", x=rng.random((3, 10, 5), dtype=np.float32),
                 y=rng.random((3, 10, 1), dtype=np.float32))
    state = torch.load(latest_checkpoint(out), weights_only=True)
    state["config"]["dataset"], state["config"]["dataset_options"] = "npz", {}
    state["config"]["loss"] = "rel_l2"  # an .npz has no grid for Darcy's gradient loss
    torch.save(state, tmp_path / "as_npz.pt")
    assert cli(["eval", str(tmp_path / "as_npz.pt"), "--data", str(npz)]) == 1
    err = capsys.readouterr().err
    assert "5 input channels" in err or ("have 5 channels" in err and "takes 3" in err)


TORCH_ALLOCATOR = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
                   "allocate memory: you tried to allocate 490733568 bytes. Error code 12 "
                   "(Cannot allocate memory)")
NUMPY_ALLOCATOR = ("Unable to allocate 468. MiB for an array with shape (3, 1049580, 39) and "
                   "data type float32")


@pytest.mark.slow
@pytest.mark.parametrize("fail_at, error, stage", [
    (2, RuntimeError(TORCH_ALLOCATOR), "the validation after epoch 2"),
    (2, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 468.00 MiB"),
     "the validation after epoch 2"),
    (5, MemoryError(NUMPY_ALLOCATOR), "the end-of-run evaluation"),
], ids=["torch-cpu-validation", "torch-oom-validation", "numpy-end-of-run"])
def test_the_checkpoint_comes_first_whatever_fails_after_it(darcy_dir, tmp_path, capsys,
                                                          monkeypatch, fail_at, error, stage):
    """Issue 41 #11, issue 38 item 2: an allocation failure in the evaluation after an epoch
    (torch's host allocator, torch's OutOfMemoryError, numpy's MemoryError) lost the epoch
    (no checkpoint was written before the evaluation) and printed a raw traceback. Now the
    epoch's checkpoint is on disk first; the CLI says one sentence naming the stage, the
    bytes asked for (468 MiB), the option that bounds it and the checkpoint to continue
    from (exit 1); `--resume` trains no epoch again, redoes the lost evaluation and ends
    where an uninterrupted run ends (CPU, FP32)."""
    import flarepp.train.loop as loop
    items = TINY + ["checkpoint_every=1"]
    full = train(get_preset("darcy-tiny", items), tmp_path / "full", data_root=darcy_dir,
                 progress=False)
    real, calls = loop.evaluate_weights, []

    def failing(*args, **kwargs):  # calls 1-3: after epochs 1-3; 4-5: the end of the run
        calls.append(1)
        if len(calls) == fail_at:
            raise error
        return real(*args, **kwargs)
    monkeypatch.setattr(loop, "evaluate_weights", failing)
    out = tmp_path / "run"
    command = ["train", "darcy-tiny", "--data", str(darcy_dir), "--out", str(out), "--quiet",
               *sets(items)]
    assert cli(command) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"flarepp train: error: out of memory in {stage} (an allocation "
                          "of 468 MiB failed): bound it with eval_chunk_size (now unset"), err
    epoch = 2 if fail_at == 2 else 3
    checkpoint = out / "checkpoints" / f"epoch_{epoch:04d}.pt"
    assert f"continues from {str(checkpoint)!r}" in err and "--resume" in err
    assert torch.load(checkpoint, weights_only=True)["epoch"] == epoch
    monkeypatch.setattr(loop, "evaluate_weights", real)
    trained = []
    monkeypatch.setattr(loop.Trainer, "train_epoch", lambda self, _real=loop.Trainer.train_epoch:
                        trained.append(self.epoch) or _real(self))
    assert cli([*command, "--resume"]) == 0
    assert trained == list(range(epoch, 3))  # no epoch trained twice
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (tmp_path / "full" / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [1, 2, 3]
    assert [r["test_rel_l2"] for r in log] == [r["test_rel_l2"] for r in ref]
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("test_rel_l2", "train_rel_l2", "epochs"):
        assert metrics[key] == full[key], key


@pytest.mark.slow
def test_an_allocation_failure_in_training_names_its_stage(darcy_dir, tmp_path, monkeypatch):
    """Issue 38 item 2: a failed allocation in a training step or in the data loading was a
    raw traceback; now it is one sentence naming the stage and its epoch, the bytes asked
    for, the options that bound it (``batch_size``; a store's ``points_per_step``) and
    where the run continues from."""
    import flarepp.train.loop as loop
    from flarepp.allocator import OutOfMemory
    config = get_preset("darcy-tiny", TINY + ["checkpoint_every=1"])
    trainer = Trainer(config, tmp_path / "step", data_root=darcy_dir, progress=False)
    step, calls = trainer.train_step, []

    def failing_step(*args):
        calls.append(1)
        if len(calls) == 4:  # the first step of epoch 2 (3 steps per epoch)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return step(*args)
    trainer.train_step = failing_step
    with pytest.raises(OutOfMemory) as info:
        trainer.fit()
    first = tmp_path / "step" / "checkpoints" / "epoch_0001.pt"
    assert str(info.value) == (
        "out of memory in a training step of epoch 2 (an allocation of 2 GiB failed): bound "
        f"it with batch_size (now 4); the run continues from {str(first)!r} with the same "
        "command and --resume")

    def failing_loader(loader, device):
        yield next(iter(loader))
        raise MemoryError(NUMPY_ALLOCATOR)
    monkeypatch.setattr(loop, "to_device_prefetched", failing_loader)
    with pytest.raises(OutOfMemory, match=r"^out of memory in the data loading of epoch 1 "
                       r"\(an allocation of 468 MiB failed\): bound it with batch_size \(now "
                       r"4\) or loader_workers \(now -1\); no checkpoint was written yet"):
        train(config, tmp_path / "load", data_root=darcy_dir, progress=False)


@pytest.mark.slow
def test_a_run_whose_lease_is_taken_over_writes_nothing_more(darcy_dir, tmp_path):
    """Issue 41 #18: with one host id in two PID namespaces, a second process judged the
    holder of a run directory gone and took its lease; the first kept training until its
    heartbeat check (30 s) and log.jsonl ended with duplicated epochs. Now the lease is
    checked before every log line and checkpoint: after it is taken over (here: after
    epoch 1), the run writes no further line or checkpoint and stops."""
    from flarepp.storage.locks import LeaseLost, LockHolder
    from flarepp.train.callbacks import TrainerCallback
    out = tmp_path / "run"

    class TakeOver(TrainerCallback):
        def on_epoch_end(self, epoch, record):
            other = LockHolder.this_process()  # another token: the taker's record
            (out / ".lock").write_text(json.dumps(other.__dict__) + "\n")

    config = get_preset("darcy-tiny", TINY + ["checkpoint_every=1"])
    trainer = Trainer(config, out, data_root=darcy_dir, progress=False, callbacks=[TakeOver()])
    lost = []
    trainer.lock.on_lost = lambda lease, reason: lost.append(reason)  # instead of exit 75
    with pytest.raises(LeaseLost, match="took it over"):
        trainer.fit()
    assert lost and "took it over" in lost[0]
    assert [json.loads(x)["epoch"] for x in (out / "log.jsonl").read_text().splitlines()] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["epoch_0001.pt"]
    assert (out / ".lock").exists()  # the taker's lease is left to the taker
