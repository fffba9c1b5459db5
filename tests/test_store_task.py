"""The fields task on a store: the same task as on the same data in memory, random point
subsets per step with evaluation on every point, per-sample conditions into a conditioned
model, the layout in checkpoints, the DrivAerML cache as a store."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from flarepp.data import ChannelGroup, ChannelLayout, DataError, DataWarning
from flarepp.data.store import MeshStore, StoreWriter
from flarepp.tasks import build_task
from flarepp.train import RunConfig, Trainer

LAYOUT = ChannelLayout(inputs=(ChannelGroup("coordinates", ("x", "y"), "point positions"),),
                       targets=(ChannelGroup("u", ("u",), "u", units="m"),),
                       conditions=(ChannelGroup("load", ("load",), "load"),),
                       association="point", coordinates=2, dimensions=2)


def make_samples(sizes, seed=0):
    """Point clouds with ``u = load * sin(3 x) cos(2 y)``: the condition scales the field."""
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        x = rng.random((n, 2)).astype(np.float32)
        load = float(rng.uniform(0.5, 2.0))
        y = (load * np.sin(3 * x[:, :1]) * np.cos(2 * x[:, 1:]) + 0.1).astype(np.float32)
        out.append((x, y, load))
    return out


def write_store(root, splits):
    writer = StoreWriter(root, {"test": "store"})
    metas, names = {}, {}
    for split, samples in splits.items():
        names[split] = []
        for i, (x, y, load) in enumerate(samples):
            name = f"{split}/case_{i}"
            metas[name] = writer.write(name, {"coordinates": x, "u": y},
                                       {"source": None, "conditions": [load],
                                        "layout": LAYOUT.to_dict()})
            names[split].append(name)
    return writer.finish(LAYOUT, names, metas)


def write_npz(root, splits):
    for split, samples in splits.items():
        arrays = {}
        for i, (x, y, _) in enumerate(samples):
            arrays[f"x_{i}"], arrays[f"y_{i}"] = x, y
        np.savez(root / f"{split}.npz", **arrays)
    return root


@pytest.fixture
def data(tmp_path):
    splits = {"train": make_samples([30, 41, 25, 33, 38, 29], 0),
              "test": make_samples([27, 35], 1)}
    return write_store(tmp_path / "store", splits), write_npz(tmp_path, splits), splits


def config(data_root, dataset="store", **kw):
    base = dict(name="store-test", dataset=dataset, data_root=str(data_root),
                model=dict(mixer="flarepp", dim=16, heads=2, latents=4, blocks=2), epochs=2,
                batch_size=3, checkpoint_every=1, device="cpu", loss="rel_l2",
                input_norm="standard", ema_decay=0.9)
    if dataset == "store":
        base["dataset_options"] = {"conditions": []}
    return RunConfig(**{**base, **kw})


def test_store_task_equals_the_in_memory_task_on_the_same_data(data):
    """On the same samples, the store's task (statistics streamed, samples read one at a
    time) has the in-memory task's normalisers, items and constant baseline. A failure
    points to the lazy path diverging from the reference (padding, order, statistics)."""
    store, npz, _ = data
    lazy = build_task(config(store.root), store.root)
    memory = build_task(config(npz, "npz", dataset_options={}), npz)
    for a, b in ((lazy.x_norm, memory.x_norm), (lazy.y_norm, memory.y_norm)):
        np.testing.assert_allclose(a.mean, b.mean, rtol=1e-6)
        np.testing.assert_allclose(a.std, b.std, rtol=1e-6)
    for split in ("train", "test"):
        assert lazy.num_samples(split) == memory.num_samples(split)
        for i in range(lazy.num_samples(split)):
            got, want = lazy.get(split, i, 0), memory.get(split, i, 0)
            np.testing.assert_allclose(got["x"], want["x"], rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(got["y"], want["y"])
    assert lazy.baseline_metrics()["train_constant_rel_l2"] == pytest.approx(
        memory.baseline_metrics()["train_constant_rel_l2"], rel=1e-10)
    assert lazy.describe_data()["layout"]["input_channels"] == ["x", "y"]
    assert lazy.describe_data()["layout"]["coordinates"] == 2


def test_points_per_step_subsets_for_training_every_point_for_evaluation(data):
    """A training item is a random subset of ``points_per_step`` of the sample's rows,
    new per seed and the same for the same seed; evaluation items hold every row. A
    failure points to a subset that is not the sample's own rows, or evaluation on a
    subset."""
    store, _, splits = data
    task = build_task(config(store.root, dataset_options={"points_per_step": 10,
                                                          "conditions": []}), store.root)
    x_all = task.x_norm.encode(splits["train"][1][0])
    first, again = task.get("train", 1, 7, training=True), task.get("train", 1, 7, training=True)
    other = task.get("train", 1, 8, training=True)
    assert first["x"].shape == (10, 2)
    np.testing.assert_array_equal(first["x"], again["x"])
    assert not np.array_equal(first["x"], other["x"])
    rows = [int(np.flatnonzero((np.abs(x_all - r) < 1e-6).all(1))[0]) for r in first["x"]]
    assert rows == sorted(set(rows))
    np.testing.assert_allclose(first["y"][:, 0], splits["train"][1][1][rows, 0])
    assert task.get("train", 1, 7)["x"].shape == (41, 2)
    assert task.get("test", 0, 0)["x"].shape == (27, 2)


def test_conditions_feed_a_conditioned_model_and_travel_with_the_checkpoint(data):
    """Each item carries its standardised conditions, a batch [B, K]; the model gets them
    as one conditioning token; the task's state holds their normaliser (``c``); a batch
    without them is a sentence; a plain model on the same data warns that it trains
    without them. A failure points to conditions that never reach the model."""
    store, _, splits = data
    model = dict(arch="conditioned", conditioning="concat", mixer="flarepp", dim=16, heads=2,
                 latents=4, blocks=2)
    task = build_task(config(store.root, model=model, dataset_options={}), store.root)
    loads = np.array([load for _, _, load in splits["train"]])
    np.testing.assert_allclose(task.c_norm.mean, [loads.mean()], rtol=1e-6)
    item = task.get("train", 2, 0)
    np.testing.assert_allclose(item["conditions"], (loads[2] - loads.mean()) / loads.std(),
                               rtol=1e-5)
    batch = task.collate([task.get("train", i, 0) for i in range(3)])
    assert batch["conditions"].shape == (3, 1)
    net = task.build_model()
    assert net.config.cond_dim == 1 and net.config.cond_tokens == 1
    out = task.forward(net, batch)
    shifted = dict(batch, conditions=batch["conditions"] + 1.0)
    assert out.shape == (3, 41, 1) and not torch.allclose(out, task.forward(net, shifted))
    assert set(task.state_dict()) == {"x", "y", "c"}
    assert task.describe_data()["conditions"] == ["load"]
    del batch["conditions"]
    with pytest.raises(DataError, match=r"trained with per-sample conditions \['load'\]"):
        task.forward(net, batch)
    with pytest.raises(ValueError, match="takes conditioning tokens .* none were given"):
        net(torch.zeros(1, 5, 2))
    with pytest.warns(DataWarning, match=r"per-sample conditions \['load'\].*trains without"):
        build_task(config(store.root, dataset_options={}), store.root)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataWarning)
        build_task(config(store.root), store.root)      # conditions=[]: nothing to warn


def test_drivaerml_cache_is_a_store(tmp_path):
    """After ``prepare()``, the DrivAerML cache opens as a store: cell data, centres and
    normals as inputs (3 leading coordinates), the 4 fields as targets, the split file's
    runs; its samples are the cars the surface task reads. A failure points to two
    formats for one kind of data."""
    pytest.importorskip("vtkmodules")
    from flarepp.data.drivaerml import DrivAerMLSurfaces
    from test_drivaerml_data import write_run, write_split
    root = tmp_path / "cars"
    for run in (3, 8, 10):
        write_run(root, run, seed=run)
    surfaces = DrivAerMLSurfaces(root, split_file=write_split(tmp_path / "s.json", [3, 8], [10]))
    surfaces.prepare(progress=False)
    store = MeshStore(root / ".flarepp_cache")
    assert store.layout.association == "cell" and store.layout.coordinates == 3
    assert store.layout.target_channels == ["p_s", "tau_x", "tau_y", "tau_z"]
    assert store.splits == {"train": ["run_3", "run_8"], "test": ["run_10"]}
    x, y = store.split("train").sample(1)
    car = surfaces.load("run_8")
    np.testing.assert_array_equal(x, np.concatenate([car.centres, car.normals], axis=1))
    np.testing.assert_array_equal(y, car.fields)


@pytest.mark.slow
def test_training_on_a_store_equals_training_in_memory(data, tmp_path):
    """Two epochs on the store and on the same data as npz give the same losses and test
    error (the loader, batches and micro-batches are shared); with points_per_step the run
    trains on subsets and still scores every test point (the written predictions cover
    every real point). A failure points to the store path diverging in training."""
    store, npz, _ = data
    lazy = Trainer(config(store.root), tmp_path / "lazy", progress=False).fit()
    memory = Trainer(config(npz, "npz", dataset_options={}), tmp_path / "memory",
                     progress=False).fit()
    assert lazy["test_rel_l2"] == pytest.approx(memory["test_rel_l2"], rel=1e-4)
    sub = Trainer(config(store.root, dataset_options={"points_per_step": 8, "conditions": []}),
                  tmp_path / "sub", progress=False).fit()
    assert np.isfinite(sub["test_rel_l2"])
    with np.load(tmp_path / "sub" / "test_predictions.npz") as f:
        assert f["pred"].shape == (2, 35, 1) and f["mask"].sum() == 27 + 35
        assert (f["pred"][f["mask"]] != 0).all()


@pytest.mark.slow
def test_bench_data_runs_and_reports_both_figures(tmp_path, capsys):
    """`flarepp bench data` at tiny sizes: the conversion's rows per second (cells and
    points) and the loader's share of step time, in [0, 1], written as JSON. No timing is
    asserted (the suite's machine is shared)."""
    import json
    pytest.importorskip("pyvista")
    from flarepp.cli import main
    out = tmp_path / "bench.json"
    assert main(["bench", "data", "--cases", "1", "--cells", "600", "--samples", "4",
                 "--points", "100", "--steps", "2", "--workers", "0", "--json",
                 str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["conversion"]["cell"]["rows"] > 500 and result["conversion"]["point"]["rows"]
    assert 0.0 <= result["loader"][0]["loader_share"] <= 1.0
    assert "waiting for batches" in capsys.readouterr().out
