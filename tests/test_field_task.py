"""The PDE field task: per-batch padding, micro-batches, zero-norm targets, batch equivalence."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from flarepp.train import RunConfig, Trainer
from flarepp.inference.batching import micro_batches


def write_npz(root, sizes_train, sizes_test, zero_test: int | None = None, seed: int = 0):
    rng = np.random.default_rng(seed)
    for split, sizes in (("train", sizes_train), ("test", sizes_test)):
        arrays = {}
        for i, n in enumerate(sizes):
            pts = rng.random((n, 2)).astype(np.float32)
            arrays[f"x_{i}"] = pts
            y = np.sin(3 * pts[:, :1]) * np.cos(2 * pts[:, 1:])
            if split == "test" and i == zero_test:
                y = np.zeros_like(y)
            arrays[f"y_{i}"] = y.astype(np.float32)
        np.savez(root / f"{split}.npz", **arrays)
    return root


def config(data, **kw):
    base = dict(name="field-test", dataset="npz", data_root=str(data),
                model=dict(mixer="flarepp", dim=16, heads=2, latents=4, blocks=2), epochs=1,
                batch_size=4, checkpoint_every=1, device="cpu")
    return RunConfig(**{**base, **kw})


def test_micro_batches_bound_padding_by_real_tokens():
    """Equal sizes stay one batch; a large mesh trains alone and the small ones together,
    never padded beyond the batch's real token count."""
    assert micro_batches([5, 5, 5]) == [[0, 1, 2]]
    groups = micro_batches([60, 200_000, 60, 60])
    assert groups == [[1], [0, 2, 3]]
    sizes = [60, 200_000, 60, 60]
    for g in groups:
        assert len(g) * max(sizes[i] for i in g) <= sum(sizes)
    assert sorted(i for g in micro_batches([3, 9, 4, 9, 1]) for i in g) == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_zero_norm_target_is_reported_not_averaged(tmp_path):
    """A test sample whose target is identically zero has no relative error: it is left out
    of the headline mean (which stayed ~1e151 % before) and reported with its absolute
    error under test_zero_target_samples."""
    data = write_npz(tmp_path, [20, 25, 30, 22], [21, 24, 26], zero_test=1)
    metrics = Trainer(config(data), tmp_path / "run", progress=False).fit()
    assert np.isfinite(metrics["test_rel_l2"]) and metrics["test_rel_l2"] < 5
    zero = metrics["test_zero_target_samples"]
    assert list(zero) == [1] and np.isfinite(zero[1]) and zero[1] > 0
    stored = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert stored["test_zero_target_samples"] == {"1": zero[1]}


def test_micro_batched_step_equals_one_padded_batch(tmp_path):
    """The gradient of a batch split into micro-batches (accumulated) equals the gradient of
    the batch padded to its longest mesh (float64): micro-batching changes memory, not math."""
    data = write_npz(tmp_path, [7, 40, 9, 11], [10])
    trainer = Trainer(config(data), tmp_path / "run", progress=False)
    trainer.model.double()
    task = trainer.task
    items = [task.get("train", i, 0, training=True) for i in range(4)]
    for it in items:
        it["x"], it["y"] = it["x"].astype(np.float64), it["y"].astype(np.float64)
    whole = [task.collate(items)]
    split = [task.collate([items[i] for i in g]) for g in micro_batches([7, 40, 9, 11])]
    assert len(split) > 1
    grads = []
    for micro in (whole, split):
        count = sum(task.loss_count(b, lambda t: t) for b in micro)
        trainer.model.zero_grad()
        for b in micro:
            (task.loss(trainer.model(b["x"], mask=b["mask"]), b, lambda t: t) / count).backward()
        grads.append([p.grad.clone() for p in trainer.model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


PEAK = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[3])
    from test_field_task import config, write_npz
    from pathlib import Path
    from flarepp.bench.memory import peak_rss_since, reset_peak_rss
    from flarepp.train import Trainer
    import torch
    torch.set_num_threads(1)
    root = Path(sys.argv[1])
    trainer = Trainer(config(root, batch_size=4), root / "run", progress=False)
    base = reset_peak_rss()
    trainer.train_epoch()
    print(json.dumps(peak_rss_since(base)))
""")


@pytest.mark.slow
def test_one_large_mesh_among_small_ones_costs_about_that_mesh(tmp_path):
    """One 30K-point mesh among ten of 60 points: a training epoch's peak memory is within
    2x of an epoch holding that mesh alone (padding every sample to the largest mesh made
    it ~4x at batch size 4)."""
    import os
    tests_dir = os.path.dirname(__file__)
    peaks = {}
    for name, sizes in (("mixed", [60] * 5 + [30_000] + [60] * 5), ("alone", [30_000])):
        root = tmp_path / name
        root.mkdir()
        write_npz(root, sizes, [60, 60])
        out = subprocess.run([sys.executable, "-c", PEAK, str(root), "x", tests_dir],
                             capture_output=True, text=True, check=True)
        peaks[name] = json.loads(out.stdout.strip().splitlines()[-1])
    assert peaks["mixed"] < 2 * peaks["alone"], peaks


def test_far_outside_test_inputs_warn_when_the_task_is_built(tmp_path):
    """A standardised test input channel 40 training stds away is named in a warning when
    the task is made (train, eval and infer all build it); in-range data is silent."""
    import warnings

    from flarepp.tasks.fields import FieldTask
    data = write_npz(tmp_path, [20, 20, 20], [20, 20])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FieldTask(config(data, input_norm="standard"), data)
    with np.load(data / "test.npz") as z:
        arrays = dict(z)
    arrays["x_1"][3, 1] += 40.0
    np.savez(data / "test.npz", **arrays)
    with pytest.warns(UserWarning, match=r"test inputs: channel 1 reaches \|z\| = "):
        task = FieldTask(config(data, input_norm="standard"), data)
    assert list(task._check_test_range()) == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # raw inputs are not in std units: not checked
        FieldTask(config(data, input_norm="none"), data)


def test_evaluation_norms_are_summed_in_blocks_of_rows(monkeypatch):
    """The per-sample norms of the evaluation (relative L2, the target's norm, the absolute
    error) are float64 sums over blocks of rows, equal to the explicit whole-sample float64
    formula with a mask, so a million-row sample never has a float64 copy of its fields."""
    from flarepp.tasks import fields
    monkeypatch.setattr(fields, "NORM_ROWS", 7)
    gen = torch.Generator().manual_seed(0)
    pred, true = torch.randn(3, 50, 4, generator=gen), torch.randn(3, 50, 4, generator=gen)
    mask = torch.rand(3, 50, generator=gen) > 0.3
    err, ref = fields.squared_norms(pred, true, mask)
    real = mask[..., None].double()
    want_err = ((pred - true).double().square() * real).sum((1, 2))
    want_ref = (true.double().square() * real).sum((1, 2))
    torch.testing.assert_close(err, want_err, rtol=1e-14, atol=0)
    torch.testing.assert_close(ref, want_ref, rtol=1e-14, atol=0)
    torch.testing.assert_close(fields.relative_l2(pred, true, mask),
                               (want_err / want_ref).sqrt(), rtol=1e-14, atol=0)

