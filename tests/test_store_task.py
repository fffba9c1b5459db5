"""The fields task on a store: the same task as on the same data in memory, random point
subsets per step with evaluation on every point, per-sample conditions into a conditioned
model, the layout in checkpoints, the DrivAerML cache as a store; a store's manifest edited
by hand, and a store without test samples, refused in a sentence."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
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


# ---------------------------------------------------------------------------------------------
# `flarepp infer` of a store or an .npz against the run's stored layout (issue 41: 13;
# issue 39: conditions in an .npz)

@pytest.fixture(scope="module")
def store_run(tmp_path_factory):
    """Elasticity VTU cases, their store (``load`` a condition) and a conditioned run on
    it: ``(cases, store, run)``."""
    pytest.importorskip("pyvista")
    from tiny_runs import tiny_store_run
    return tiny_store_run(tmp_path_factory.mktemp("store-run"))


@pytest.mark.slow
def test_infer_checks_a_store_against_the_layout_the_run_stored(store_run, tmp_path, capsys):
    """The run's own store is predicted with its errors. A store whose target is another
    field, or the same in other units (x1e-6: "mean relative L2 92454356%"), is predicted
    with a warning and no error; a renamed condition, a condition in other units and cell
    rows where the run trained on point rows are refused in a sentence (exit 2) and
    nothing is written: infer compared channel counts only. Its lines say points (the
    store's rows) and no nmse (the surface task's metric, printed for store runs too). A
    failure points to data read against another layout than the run's."""
    from flarepp.cli import main
    from flarepp.data.convert import convert
    from flarepp.data.spec import parse_spec
    cases, store, run = store_run
    out = tmp_path / "p.npz"

    def converted(name, **spec):
        base = {"targets": ["von_mises"], "conditions": ["load"], "split": {"test": "test/*"}}
        convert(cases, tmp_path / name, parse_spec({**base, **spec}), progress=False)
        return tmp_path / name

    def infer(data):
        out.unlink(missing_ok=True)
        code = main(["infer", str(run), "--data", str(data), "--out", str(out), "--device",
                     "cpu"])
        return code, capsys.readouterr()

    code, said = infer(store)
    assert code == 0 and "mean relative L2" in said.out and "warning" not in said.err
    assert " points in " in said.out and "nmse" not in said.out   # the surface task's metric
    for name, target in (("other", {"array": "von_mises", "name": "stress"}),
                         ("scaled", {"array": "von_mises", "scale": 1e-6})):
        code, said = infer(converted(name, targets=[target]))
        assert code == 0 and "no error is computed" in said.err
        assert "relative L2" not in said.out
        with np.load(out) as f:
            assert "rel_l2" not in f and len(f["cases"]) == 2
    refused = {"renamed": ({"conditions": [{"array": "load", "name": "force"}]},
                           "conditioned on ['load'], which the store does not hold"),
               "units": ({"conditions": [{"array": "load", "scale": 10.0}]},
                         "the store's conditions are load [load] from load x10"),
               "cells": ({"association": "cell", "targets": []},
                         "the store's rows are its meshes' cells, the run trained on points")}
    for name, (spec, message) in refused.items():
        code, said = infer(converted(name, **spec))
        assert code == 2 and message in said.err and not out.exists(), said.err


@pytest.mark.slow
def test_infer_of_an_npz_takes_per_sample_conditions(store_run, tmp_path, capsys):
    """An ``.npz`` of inputs with ``conditions [S, C]`` (or ``[S, K, C]``) is predicted
    with them, equal to ``flarepp.load(run).predict`` (1e-6); without conditions, with a
    NaN one, or of another width, a sentence (the npz path could carry none: "data gives
    none"). A failure points to the conditions lost between the file and the model."""
    import flarepp
    from flarepp.cli import main
    _, store, run = store_run
    x = MeshStore(store).split("test").sample(0)[0][None]
    loads = np.array([[1.3]], np.float32)
    want = flarepp.load(run, device="cpu").predict(x, conditions=loads)
    for i, conditions in enumerate((loads, loads[:, None, :])):
        np.savez(tmp_path / f"c{i}.npz", x=x, conditions=conditions)
        assert main(["infer", str(run), "--data", str(tmp_path / f"c{i}.npz"), "--out",
                     str(tmp_path / f"p{i}.npz"), "--device", "cpu"]) == 0
        with np.load(tmp_path / f"p{i}.npz") as f:
            np.testing.assert_allclose(f["pred"], want, rtol=1e-6, atol=1e-6)
    bad = {"none": ({}, "the data gives none"),
           "nan": ({"conditions": np.array([[np.nan]], np.float32)}, "NaN or inf"),
           "wide": ({"conditions": np.ones((1, 2), np.float32)}, "conditions of [1, 2]")}
    for name, (extra, message) in bad.items():
        np.savez(tmp_path / f"{name}.npz", x=x, **extra)
        assert main(["infer", str(run), "--data", str(tmp_path / f"{name}.npz"), "--out",
                     str(tmp_path / "bad.npz"), "--device", "cpu"]) == 2
        assert message in capsys.readouterr().err and not (tmp_path / "bad.npz").exists()


# ---------------------------------------------------------------------------------------------
# a manifest edited by hand, a store without test samples

MANIFEST_EDITS = {
    "no layout": (lambda m: m.pop("layout"), "'layout' is None, not an object"),
    "layout a list": (lambda m: m.update(layout=[]), "'layout' is [], not an object"),
    "inputs not a list": (lambda m: m["layout"].update(inputs=3), "layout.inputs is 3"),
    "group without channels": (lambda m: m["layout"]["targets"][0].pop("channels"),
                               "layout.targets[0] is not a channel group"),
    "group scale a string": (lambda m: m["layout"]["targets"][0].update(scale="x"),
                             "layout.targets[0] is not a channel group"),
    "no splits": (lambda m: m.pop("splits"), "'splits' is None, not an object"),
    "splits a list": (lambda m: m.update(splits=[]), "'splits' is [], not an object"),
    "a split naming no sample": (lambda m: m["splits"]["train"].append("nope"),
                                 "splits['train'] names 'nope', which is not one of its"),
    "no samples": (lambda m: m.pop("samples"), "'samples' is None, not an object"),
    "a sample not an object": (lambda m: m["samples"].update({"train/case_0": 5}),
                               "samples['train/case_0'] is 5, not an object"),
    "rows a string": (lambda m: m["samples"]["train/case_0"].update(rows="x"),
                      "samples['train/case_0'].rows is 'x', not a positive integer"),
    "rows -5": (lambda m: m["samples"]["train/case_0"].update(rows=-5),
                "samples['train/case_0'].rows is -5, not a positive integer"),
    "conditions ragged": (lambda m: m["samples"]["train/case_0"].update(conditions=[[1], 2]),
                          "samples['train/case_0'].conditions is [[1], 2], not a list of 1"),
    "no stored": (lambda m: m["samples"]["train/case_0"].pop("stored"),
                  "samples['train/case_0'].stored is None"),
    "a stored record without bytes": (
        lambda m: m["samples"]["train/case_0"]["stored"]["u"].pop("bytes"),
        "samples['train/case_0'].stored['u'] is not an array record"),
    "an array of the layout not stored": (
        lambda m: m["samples"]["train/case_0"]["stored"].pop("u"),
        "samples['train/case_0'].stored has no record of array 'u'"),
    "a digest not hexadecimal": (lambda m: m["samples"]["train/case_0"].update(digest="zz"),
                                 "samples['train/case_0'].digest is 'zz'"),
    "a sample named '.'": (lambda m: m["samples"].update({".": m["samples"]["train/case_0"]}),
                           "sample name '.' is not a relative path inside"),
    "a sample named manifest.json": (
        lambda m: m["samples"].update({"manifest.json": m["samples"]["train/case_0"]}),
        "'manifest.json' cannot name a sample: it is a file of the store"),
}


@pytest.mark.parametrize("edit", sorted(MANIFEST_EDITS))
def test_a_manifest_edited_by_hand_is_one_sentence(edit, data, capsys):
    """Hand-edited manifests gave KeyError, AttributeError and TypeError tracebacks in
    `data check`, numpy's words without the file, or were accepted (``rows: -5``; a sample
    named ``.``, whose write-mesh file landed beside the output directory): each form is
    one sentence naming ``manifest.json`` and the key, exit 1, from `data check`, and the
    same error from the loader `train` uses."""
    from flarepp.cli import main
    from flarepp.data.store import load_store
    store, _, _ = data
    path = store.root / "manifest.json"
    manifest = json.loads(path.read_text())
    change, said = MANIFEST_EDITS[edit]
    edited = copy.deepcopy(manifest)
    change(edited)
    path.write_text(json.dumps(edited))
    capsys.readouterr()
    assert main(["data", "check", str(store.root)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert str(path) in err and said in err, err
    with pytest.raises(DataError, match="manifest.json"):
        load_store(store.root)


def test_a_store_without_test_samples_is_refused_before_training(tmp_path):
    """A store of one case has an empty test split; `train` trained on it and failed
    afterwards on KeyError 'ref_norm', keeping no checkpoint. The task refuses it before
    any training, naming the split and how to give it test samples."""
    store = write_store(tmp_path / "store", {"train": make_samples([30, 41], 0), "test": []})
    with pytest.raises(DataError, match=r"test split is empty.* --test-pattern"):
        build_task(config(store.root), store.root)


@pytest.mark.slow
def test_bench_data_converts_each_cell_type_in_its_own_process(tmp_path, capsys):
    """`flarepp bench data --cell-types`: one file per cell type converted in a fresh
    process, with its cell count, time per cell, peak memory above the interpreter's and
    the stored arrays' bytes (5 float32 channels per cell); `--workers none` skips the
    loader. No timing is asserted."""
    import json
    pytest.importorskip("pyvista")
    from flarepp.cli import main
    out = tmp_path / "bench.json"
    assert main(["bench", "data", "--cases", "0", "--workers", "none", "--cell-types",
                 "hexahedron,mixed", "--cells", "2000", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "loader" not in result
    rows = {r["cell_type"]: r for r in result["cell_types"]}
    assert set(rows) == {"hexahedron", "mixed"} and rows["hexahedron"]["cells"] == 2197
    for r in rows.values():
        assert r["array_bytes"] >= 5 * 4 * r["cells"] and r["peak_bytes"] > 0
        assert r["us_per_cell"] == pytest.approx(1e6 * r["seconds"] / r["cells"])
    assert "us/cell" in capsys.readouterr().out


def test_a_laplace_store_of_many_fields_keeps_its_first_field_and_each_is_harmonic(tmp_path):
    """`make_laplace_store(fields=F)` (the large benchmark store's samples): targets
    u_1 .. u_F, u_1 the one-field store's u bit for bit (stores made before keep their
    values), the fields different from each other, and each harmonic: with the sample's own
    modes, the central differences u_xx + u_yy + u_zz cancel to 1% of their sizes (the
    differences' own error is 0.2%). A failure points to a changed random stream or a field
    that is not a solution."""
    from flarepp.data.generators.laplace import _harmonic, make_laplace_store
    make_laplace_store(tmp_path / "one", n_train=1, n_test=1, resolution=400, progress=False)
    make_laplace_store(tmp_path / "many", n_train=1, n_test=1, resolution=400, fields=4,
                       progress=False)
    one, many = MeshStore(tmp_path / "one"), MeshStore(tmp_path / "many")
    assert many.layout.target_channels == ["u_1", "u_2", "u_3", "u_4"]
    x1, y1 = one.split("train").sample(0)
    x4, y4 = many.split("train").sample(0)
    np.testing.assert_array_equal(x1, x4)
    np.testing.assert_array_equal(y1[:, 0], y4[:, 0])
    assert np.abs(np.corrcoef(y4.T)[np.triu_indices(4, 1)]).max() < 0.99
    h, centre = 1e-3, np.array([[0.4, 0.5, 0.3]])
    for field in (1, 2, 3):                                   # u_2 .. u_4 of train sample 0
        steps = np.concatenate([np.zeros((1, 3)), h * np.eye(3), -h * np.eye(3)])
        u = _harmonic(np.random.default_rng([0, 0, 0, field]), centre + steps)
        second = (u[1:4] + u[4:7] - 2 * u[0]) / h ** 2     # u_xx, u_yy, u_zz
        assert abs(second.sum()) < 0.01 * np.abs(second).sum()


# ---------------------------------------------------------------------------------------------
# evaluation that streams (issue 38 item 1): one sample at a time, large ones streamed, raw
# and EMA weights in one pass, records of per-sample numbers only

def test_streamed_evaluation_equals_whole_and_records_hold_no_points(data):
    """A store's split evaluated with every mesh streamed in chunks of 7 points (and with
    only the meshes above 30 points streamed, chunks of 30) gives the whole-mesh metrics to
    1e-6, and its records hold one number per sample, never a per-point array. A failure
    points to the engine's streamed path (flarepp.inference.execution.chunk_for) or to a
    task keeping its predictions in the records (memory growing with the split)."""
    from flarepp.inference import Engine, Execution
    store, _, _ = data
    task = build_task(config(store.root), store.root)
    torch.manual_seed(0)
    model = task.build_model().eval()
    whole, records = Engine(task, Execution("cpu")).evaluate(model, "train", 4)
    for execution in (Execution("cpu", chunk_size=7), Execution("cpu", stream_above=30)):
        streamed, again = Engine(task, execution).evaluate(model, "train", 4)
        np.testing.assert_allclose(again["rel_l2"], records["rel_l2"], rtol=1e-6)
        assert streamed["rel_l2"] == pytest.approx(whole["rel_l2"], rel=1e-6)
    assert {key: value.shape for key, value in records.items()} == {
        key: (6,) for key in ("index", "rel_l2", "ref_norm", "abs_l2")}


def test_raw_and_ema_weights_are_evaluated_in_one_pass_over_the_data(data, monkeypatch):
    """Both weights run on each sample as it is read: ``task.get`` is called once per
    sample however many weights are evaluated (twice before, one pass per weights), and
    each weights' metrics equal its own evaluation. With ``same`` (ema_decay 0) the copy
    is the raw weights' result. A failure points to flarepp.inference.evaluate.
    evaluate_weights or Engine.evaluate reading the split once per model."""
    from flarepp.inference import Engine, Execution
    from flarepp.inference.evaluate import evaluate_weights
    store, _, _ = data
    task = build_task(config(store.root), store.root)
    torch.manual_seed(0)
    models = {"raw": task.build_model(), "ema": task.build_model()}
    engine = Engine(task, Execution("cpu"))
    alone = {w: engine.evaluate(m, "train", 4)[0]["rel_l2"] for w, m in models.items()}
    reads = []
    real_get = task.get
    monkeypatch.setattr(task, "get", lambda *a, **k: reads.append(a[1]) or real_get(*a, **k))
    both = evaluate_weights(engine, "train", 4, models)
    assert sorted(reads) == list(range(6))
    assert {w: both[w][0]["rel_l2"] for w in models} == pytest.approx(alone, rel=1e-12)
    assert alone["raw"] != alone["ema"]
    reads.clear()
    once = evaluate_weights(engine, "train", 4, models, same=True)
    assert sorted(reads) == list(range(6)) and once["ema"] is once["raw"]


def test_a_conditioned_model_streams_where_its_scheme_is_exact(data):
    """A concat-conditioned model on a store streams its evaluation (eval_chunk_size 9)
    to the whole-mesh metrics; cross conditioning, whose encodes gather the conditions
    beside the points, is refused in a sentence saying why. A failure points to
    ConditionedSurrogate.streaming_plan or the fields task's check of eval_chunk_size."""
    from flarepp.inference import Engine, Execution
    store, _, _ = data
    model = dict(arch="conditioned", conditioning="concat", mixer="flarepp", dim=16, heads=2,
                 latents=4, blocks=2)
    task = build_task(config(store.root, model=model, dataset_options={},
                             eval_chunk_size=9), store.root)
    torch.manual_seed(0)
    net = task.build_model().eval()
    whole = Engine(task, Execution("cpu")).evaluate(net, "train", 4)[0]
    streamed = Engine(task, Execution("cpu", chunk_size=9)).evaluate(net, "train", 4)[0]
    assert streamed["per_sample"] == pytest.approx(whole["per_sample"], rel=1e-6)
    cross = dict(model, conditioning="cross", mixer="flare-cross")
    with pytest.raises(ValueError, match="model.conditioning='cross' gathers the conditions in "
                                         "every encode"):
        build_task(config(store.root, model=cross, dataset_options={}, eval_chunk_size=9),
                   store.root)


def test_evaluation_batches_follow_the_sample_sizes():
    """An evaluation batch holds at most its count of samples and its points budget
    (samples x the longest): small meshes batch, a large one goes alone, and without sizes
    the count alone cuts. A failure points to flarepp.inference.batching.eval_keys."""
    from flarepp.inference.batching import eval_keys

    def cut(keys):
        return [[k.index for k in batch] for batch in keys]
    sizes = np.array([10, 10, 10, 10, 10, 500, 10, 10])
    assert cut(eval_keys(8, 4, 0, 1, sizes=sizes, batch_points=100)) == [
        [0, 1, 2, 3], [4], [5], [6, 7]]
    assert cut(eval_keys(8, 4, 0, 1)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cut(eval_keys(np.array([1, 5, 6]), 4, 1, 2, sizes=sizes, batch_points=100)) == [[5]]


@pytest.mark.slow
def test_final_eval_train_chooses_the_training_samples_and_says_so(data, tmp_path, capsys):
    """``final_eval_train=2`` evaluates 2 evenly spaced training samples at the end of the
    run (test whole), says so on the console and records it in metrics.json; ``none``
    leaves the train metrics out; ``auto`` takes every sample of a small split. The
    written test predictions cover every test point, one sample at a time. A failure
    points to Trainer.finish or flarepp.inference.evaluate.final_eval_samples."""
    from flarepp.inference.evaluate import final_eval_samples
    store, _, _ = data
    metrics = Trainer(config(store.root, epochs=1, final_eval_train=2), tmp_path / "two").fit()
    assert metrics["final_eval_train"] == {
        "option": 2, "evaluated": 2, "samples": 6,
        "which": "train: 2 of 6 samples, evenly spaced (final_eval_train=2)"}
    assert "end-of-run evaluation: test: all 2 samples; train: 2 of 6 samples" in \
        capsys.readouterr().out
    assert json.loads((tmp_path / "two" / "metrics.json").read_text())["final_eval_train"] \
        == metrics["final_eval_train"]
    none = Trainer(config(store.root, epochs=1, final_eval_train="none"), tmp_path / "none",
                   progress=False).fit()
    assert "train_rel_l2" not in none and "test_rel_l2" in none
    assert none["final_eval_train"]["evaluated"] == 0
    with np.load(tmp_path / "none" / "test_predictions.npz") as f:
        assert f["pred"].shape == (2, 35, 1) and (f["pred"][f["mask"]] != 0).all()
        assert f["true"][0, :27, 0] == pytest.approx(data[2]["test"][0][1][:, 0])
    assert not list((tmp_path / "none").glob(".predictions-*"))
    assert final_eval_samples("auto", np.full(6, 10), 6)[0] is None
    chosen, which = final_eval_samples("auto", np.full(100, 2**20), 100)
    assert len(chosen) == 8 and chosen[0] == 0 and chosen[-1] == 99
    assert which.endswith("(final_eval_train=auto: the split holds 104.9M points)")


STREAMED_EVAL = """
import resource, sys
from flarepp.cli import main
import flarepp.inference, flarepp.train, torch

def vm(key):
    return int([l for l in open("/proc/self/status") if l.startswith(key)][0].split()[1])

limit = (vm("VmSize") + {extra_mib} * 1024) * 1024
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.exit(main(["eval", sys.argv[1], "--data", sys.argv[2], "--device", "cpu"]))
"""


@pytest.mark.slow
def test_a_store_of_large_meshes_is_evaluated_in_bounded_memory(tmp_path):
    """Issue 38: the evaluation of a store of large meshes held four whole meshes per batch
    and every prediction, more memory than the store. A run trained on small meshes is
    evaluated (``flarepp eval``) on a store of three 300K-point meshes with its address
    space limited to 600 MiB above what the interpreter holds after its imports: one
    sample at a time, streamed in chunks, it fits (about 270 MiB here); whole meshes two
    per batch needed about 900 MiB and failed (checked against main before this change).
    A failure points to an evaluation that holds more than one streamed sample."""
    rng = np.random.default_rng(0)

    def store(root, n):
        layout = ChannelLayout(inputs=(ChannelGroup("coordinates", ("x", "y", "z"), "xyz"),),
                               targets=(ChannelGroup("u", ("u",), "u"),),
                               association="point", coordinates=3, dimensions=3)
        writer, metas, names = StoreWriter(root, {"test": "large"}), {}, {}
        for split, count in (("train", 1), ("test", 2)):
            names[split] = [f"{split}/case_{i}" for i in range(count)]
            for name in names[split]:
                x = rng.random((n, 3), dtype=np.float32)
                y = (np.sin(3 * x[:, :1]) * np.cos(2 * x[:, 1:2]) + x[:, 2:]).astype(np.float32)
                metas[name] = writer.write(name, {"coordinates": x, "u": y},
                                           {"source": None, "conditions": [],
                                            "layout": layout.to_dict()})
        return writer.finish(layout, names, metas).root

    small, large = store(tmp_path / "small", 300), store(tmp_path / "large", 300_000)
    run = tmp_path / "run"
    Trainer(RunConfig(name="large-eval", dataset="store", data_root=str(small), epochs=1,
                      model=dict(mixer="flarepp", dim=32, heads=2, latents=8, blocks=1),
                      batch_size=1, ema_decay=0.0, device="cpu", loss="rel_l2",
                      input_norm="standard", plot_cases=0), run, progress=False).fit()
    script = tmp_path / "eval.py"
    script.write_text(STREAMED_EVAL.format(extra_mib=600))
    done = subprocess.run([sys.executable, str(script), str(run), str(large)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = json.loads(done.stdout[done.stdout.index("{"):done.stdout.rindex("}") + 1])
    assert np.isfinite(metrics["test_rel_l2"]) and np.isfinite(metrics["train_rel_l2"])
