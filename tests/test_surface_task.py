"""The full-surface DrivAerML task (paper Sec. 4.2, C.1) on generated surface-flow surfaces.

Inputs and targets against a float64 hand computation from the raw ``.vtp`` arrays; the loss
(sum / count) and its gradient against float64; the per-step cell subsets; the full-surface
metric against a hand mean over every cell of every test car; streamed against unchunked
evaluation; training, evaluation, the saved figure case, ``flarepp eval``, ``flarepp infer``
and the pictures end to end; 2-rank context-parallel training against one process; the
Pareto study (Figure 5); options refused before any work.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vtkmodules", reason="the surface task reads .vtp files with VTK "
                                         "(pip install 'flarepp[surface]')")

from flarepp.data import DataError  # noqa: E402
from flarepp.data.drivaerml import (PRESSURE_ARRAY, WALL_SHEAR_ARRAY,  # noqa: E402
                                    polygon_centres_and_normals, read_vtp)
from flarepp.data.generators import make_surface_flow  # noqa: E402
from flarepp.distributed import run_on_ranks  # noqa: E402
from flarepp.tasks import build_task  # noqa: E402
from flarepp.plots3d import CASE_FILE  # noqa: E402
from flarepp.tasks.surface import ERRORS_FILE, subset_cells  # noqa: E402
from flarepp.train import Engine, RunConfig, Trainer, validate  # noqa: E402
from flarepp.inference.batching import epoch_keys  # noqa: E402
from flarepp.inference.execution import Execution  # noqa: E402
from flarepp.train.loop import epoch_seed  # noqa: E402

CELLS = 1500          # per generated surface
STEP_CELLS = 256      # cells drawn per training step


def config(data: str, **kw) -> RunConfig:
    options = {"split_file": "split.json", "cells_per_step": STEP_CELLS,
               **kw.pop("dataset_options", {})}
    model = {"mixer": "flarepp", "dim": 16, "heads": 2, "blocks": 2, "latents": 4,
             **kw.pop("model", {})}
    return validate(RunConfig(**{
        "name": "surface-test", "task": "surface", "dataset": "drivaerml", "data_root": data,
        "dataset_options": options, "model": model, "epochs": 2, "batch_size": 1, "lr": 3e-3,
        "weight_decay": 1e-4, "ema_decay": 0.9, "device": "cpu", "checkpoint_every": 1,
        **kw}))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """2 training and 2 test surfaces of ~1.5K cells, converted and with statistics."""
    root = tmp_path_factory.mktemp("surfaces") / "surface-flow"
    make_surface_flow(root, n_train=2, n_test=2, resolution=CELLS, seed=3, progress=False)
    build_task(config(str(root)), root)      # the cache and statistics, before any rank
    return str(root)


def raw_surface(root: str, run: str):
    """Centres, normals (float64) and the 4 fields of a run, straight from its .vtp."""
    path = f"{root}/{run}/boundary_{run[4:]}.vtp"
    surface = read_vtp(path, [PRESSURE_ARRAY, WALL_SHEAR_ARRAY])
    centres, normals, _ = polygon_centres_and_normals(surface.points, surface.offsets,
                                                      surface.connectivity)
    fields = np.concatenate([surface.cell_arrays[PRESSURE_ARRAY].reshape(-1, 1),
                             surface.cell_arrays[WALL_SHEAR_ARRAY]], axis=1).astype(np.float64)
    return centres, normals, fields


def cell_count(root: str, run: str) -> int:
    return len(raw_surface(root, run)[0])


def hand_normalisation(root: str, task):
    """The training split's bounding box and per-channel mean and std, in float64."""
    train = [raw_surface(root, r) for r in task.data.cars("train")]
    centres = np.concatenate([c for c, _, _ in train])
    fields = np.concatenate([f for _, _, f in train])
    low, high = centres.min(0), centres.max(0)

    def inputs(c, n):
        return np.concatenate([(c - low) / (high - low), n], axis=1)

    def targets(f):
        return (f - fields.mean(0)) / fields.std(0)
    return inputs, targets


@pytest.mark.slow
def test_inputs_targets_loss_and_gradient_match_float64(data):
    """Items are the bounding-box-scaled centres and normals and the standardised fields of
    the drawn cells; loss / count is 100 x the MSE over cells and channels, also for a
    padded batch of two surfaces of different sizes, and its gradient is 200 (y_hat - y) /
    count. A failure points to the normalisation, the subset, the mask or the x 100."""
    task = build_task(config(data), data)
    inputs, targets = hand_normalisation(data, task)
    run = task.data.cars("train")[1]
    centres, normals, fields = raw_surface(data, run)
    item = task.get("train", 1, seed=11, training=True)
    cells = subset_cells(len(centres), STEP_CELLS, 11)
    np.testing.assert_allclose(item["x"], inputs(centres[cells], normals[cells]), atol=2e-6)
    np.testing.assert_allclose(item["y"], targets(fields[cells]), rtol=2e-5, atol=2e-5)

    # a whole test surface and a training subset: a padded batch with a mask
    batch = task.collate([task.get("test", 0, seed=0), item])
    assert "mask" in batch and batch["mask"].sum() == cell_count(data, "run_3") + STEP_CELLS
    pred = torch.randn(batch["y"].shape, dtype=torch.float64, requires_grad=True)
    loss = task.loss(pred, batch, lambda t: t) / task.loss_count(batch, lambda t: t)
    loss.backward()
    truth = [targets(raw_surface(data, "run_3")[2]), targets(fields[cells])]
    errors = [pred.detach()[b, :len(t)].numpy() - t for b, t in enumerate(truth)]
    count = 4 * sum(len(t) for t in truth)
    expected = 100 * sum(np.square(e).sum() for e in errors) / count
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    for b, e in enumerate(errors):
        np.testing.assert_allclose(pred.grad[b, :len(e)].numpy(), 200 * e / count,
                                   rtol=1e-4, atol=1e-8)   # y is float32
        assert not pred.grad[b, len(e):].any()       # padding takes no gradient


@pytest.mark.slow
def test_subsets_are_seeded_uniform_without_replacement_and_fresh_every_step(data):
    """``subset_cells`` draws distinct cells, the same for the same seed and uniformly over
    many seeds; the trainer's per-step seeds differ between samples and between epochs, so
    each step sees a new subset. A failure points to replacement, a fixed subset or a seed
    shared by steps."""
    first = subset_cells(5000, 700, 3)
    assert len(np.unique(first)) == 700 and first.min() >= 0 and first.max() < 5000
    np.testing.assert_array_equal(first, subset_cells(5000, 700, 3))
    assert not np.array_equal(first, subset_cells(5000, 700, 4))
    np.testing.assert_array_equal(subset_cells(40, 100, 0), np.arange(40))
    counts = np.bincount(np.concatenate([subset_cells(50, 10, s) for s in range(2000)]),
                         minlength=50)
    assert np.abs(counts / 400.0 - 1).max() < 0.25          # 2000 x 10 / 50 = 400 expected

    task = build_task(config(data), data)
    seeds = {e: {k.index: k.seed for batch in epoch_keys(np.arange(2), 1, 0, 1,
                                                         epoch_seed(0, e)) for k in batch}
             for e in (0, 1)}
    drawn = {(e, i): tuple(np.round(task.get("train", i, s, training=True)["x"][:, 0], 6))
             for e, per_sample in seeds.items() for i, s in per_sample.items()}
    assert len(set(drawn.values())) == 4                    # 2 samples x 2 epochs: all new
    again = task.get("train", 0, seeds[0][0], training=True)["x"][:, 0]
    np.testing.assert_array_equal(np.round(again, 6), drawn[(0, 0)])


@pytest.mark.slow
def test_full_surface_metric_is_the_mean_over_cars_of_every_cell(data):
    """The test value: per car 100 x the mean over all its cells and 4 channels of the
    squared standardised error, averaged over the cars; per channel likewise. Computed here
    from the raw files and a plain forward of every cell. Records hold per-car numbers only
    (errors, forces), no per-cell arrays."""
    task = build_task(config(data), data)
    inputs, targets = hand_normalisation(data, task)
    torch.manual_seed(1)
    model = task.build_model().eval()
    metrics, records = Engine(task, Execution("cpu")).evaluate(
        model, "test", task.eval_batch_size())
    per_car = []
    for run in task.data.cars("test"):
        centres, normals, fields = raw_surface(data, run)
        x = torch.from_numpy(inputs(centres, normals).astype(np.float32))[None]
        with torch.no_grad():
            pred = model(x)[0].double().numpy()
        per_car.append(100 * np.square(pred - targets(fields)).mean(0))
    per_car = np.array(per_car)
    assert metrics["nmse"] == pytest.approx(per_car.mean(), rel=1e-4)
    assert metrics["per_sample"] == pytest.approx(per_car.mean(1).tolist(), rel=1e-4)
    assert list(metrics["nmse_channels"].values()) == pytest.approx(per_car.mean(0).tolist(),
                                                                    rel=1e-4)
    assert metrics["runs"] == task.data.cars("test")
    assert sorted(records) == ["cells", "force_pred", "force_true", "index", "rel_l2", "sse"]
    assert records["sse"].shape == (2, 4) and records["force_pred"].shape == (2, 3)


@pytest.mark.slow
def test_streamed_evaluation_equals_unchunked(data):
    """Evaluation streamed in chunks of 97 cells (and of 1000) gives the unchunked records;
    a failure points to the engine's streaming path or the exact block-wise streaming."""
    task = build_task(config(data), data)
    model = task.build_model().eval()
    plain_metrics, plain = Engine(task, Execution("cpu")).evaluate(model, "test", 1)
    for chunk in (97, 1000):
        metrics, records = Engine(task, Execution("cpu", chunk_size=chunk)).evaluate(
            model, "test", 1)
        np.testing.assert_allclose(records["sse"], plain["sse"], rtol=1e-4)
        assert metrics["nmse"] == pytest.approx(plain_metrics["nmse"], rel=1e-5)


@pytest.mark.slow
def test_train_evaluate_infer_and_plot_end_to_end(data, tmp_path):
    """Two epochs, then: the per-car errors file, the median case saved in physical units
    (its error recomputed from the saved arrays equals its evaluated error), ``flarepp
    eval`` and ``flarepp infer --chunk-size`` on the checkpoint giving the same metric, the
    case predicted again from the checkpoint (what ``flarepp drivaerml figures`` does for a
    run that saved another car), and the Figure 13-14 pictures and curves drawn from the run
    directory."""
    from flarepp.cli import main
    from flarepp.inference.surface import predict_car
    from flarepp.plots3d import plot_surface_run
    out = tmp_path / "run"
    metrics = Trainer(config(data), out, progress=False).fit()
    assert np.isfinite(metrics["test_nmse"]) and metrics["task"] == "surface"
    errors = json.loads((out / ERRORS_FILE).read_text())
    cases = errors["cases"]
    assert [c["run"] for c in cases] == ["run_3", "run_4"]
    assert errors["nmse"] == pytest.approx(metrics["test_nmse"])
    lower_median = min(cases, key=lambda c: c["nmse"])        # median of 2: the lower
    assert errors["figure_case"] == lower_median["run"]
    with np.load(out / CASE_FILE) as case:
        pred, truth = case["pred"], case["truth"]
        assert str(case["run"]) == lower_median["run"] and pred.shape == (lower_median["cells"], 4)
    std = build_task(config(data), data).y_norm.std.astype(np.float64)
    recomputed = 100 * np.mean(np.square((pred.astype(np.float64) - truth) / std))
    assert recomputed == pytest.approx(lower_median["nmse"], rel=1e-4)

    checkpoint = out / "checkpoints" / "epoch_0002.pt"
    assert main(["eval", str(checkpoint), "--device", "cpu", "--json",
                 str(tmp_path / "eval.json")]) == 0
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    assert evaluated["test_nmse"] == pytest.approx(metrics["test_nmse"], rel=1e-5)
    for key in ("test_rel_l2", "test_drag_r2", "test_lift_r2"):   # beside the headline
        assert evaluated[key] == pytest.approx(metrics[key], rel=1e-5, nan_ok=True)
    assert {"drag_pred", "drag_true", "lift_pred", "lift_true"} <= set(cases[0])
    assert cases[0]["quantity"] == "per unit dynamic pressure (m^2)"  # generated: U stated
    (tmp_path / "hidden").mkdir()
    assert main(["infer", str(checkpoint), "--data", data, "--chunk-size", "300",
                 "--hidden-on", "memmap", "--memmap-dir", str(tmp_path / "hidden"),
                 "--device", "cpu", "--out", str(tmp_path / "pred.npz")]) == 0
    assert list((tmp_path / "hidden").iterdir()) == []  # the hidden state's file is gone
    with np.load(tmp_path / "pred.npz") as inferred:
        assert list(inferred["cases"]) == ["run_3", "run_4"]
        assert inferred["nmse"].mean() == pytest.approx(metrics["test_nmse"], rel=1e-4)
        np.testing.assert_allclose(inferred[f"pred_{lower_median['run']}"], pred,
                                   rtol=1e-4, atol=1e-3)

    # on the mesh: each car's .vtp with pred_/true_/error_ cell arrays and a picture; then
    # the surface alone (--geometry: its .vtp, and a triangulated STL of it) is predicted
    # from its cell centres and normals, the same numbers for the same cells
    pv = pytest.importorskip("pyvista")
    run = lower_median["run"]
    assert main(["infer", str(checkpoint), "--data", data, "--device", "cpu", "--out",
                 str(tmp_path / "m.npz"), "--write-mesh", str(tmp_path / "mesh")]) == 0
    car = pv.read(tmp_path / "mesh" / f"{run}.vtp")
    names = ("p_s", "tau_x", "tau_y", "tau_z")
    on_mesh = np.stack([car.cell_data[f"pred_{n}"] for n in names], axis=1)
    np.testing.assert_allclose(on_mesh, pred, rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(np.stack([car.cell_data[f"true_{n}"] for n in names], 1),
                                  truth.astype(np.float32))
    assert (tmp_path / "mesh" / f"{run}.png").stat().st_size > 10_000
    vtp = Path(data) / run / f"boundary_{run[4:]}.vtp"
    pv.read(vtp).triangulate().save(tmp_path / "car.stl")
    assert main(["infer", str(checkpoint), "--geometry", str(vtp), "--device", "cpu",
                 "--out", str(tmp_path / "g.npz")]) == 0
    with np.load(tmp_path / "g.npz") as alone:
        np.testing.assert_array_equal(alone[f"pred_{vtp.stem}"], on_mesh)
    assert main(["infer", str(checkpoint), "--geometry", str(tmp_path / "car.stl"), "--device",
                 "cpu", "--out", str(tmp_path / "s.npz"), "--write-mesh",
                 str(tmp_path / "stl")]) == 0
    stl = pv.read(tmp_path / "stl" / "car.vtp")
    assert stl.n_cells == pv.read(tmp_path / "car.stl").n_cells > len(pred)
    assert "pred_p_s" in stl.cell_data and "true_p_s" not in stl.cell_data

    # another run's figures predict this car again from the checkpoint: the same numbers
    again, reference, _ = predict_car(out, lower_median["run"], chunk_size=500,
                                           device="cpu")
    np.testing.assert_allclose(again, pred, rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(reference, truth)

    paths = plot_surface_run(out, backend="matplotlib")
    assert [p.name for p in paths] == [f"surface_pressure_{lower_median['run']}.png",
                                       f"surface_wall_shear_{lower_median['run']}.png",
                                       "curves.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def _train_on_ranks(group, data: str, out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from flarepp.distributed.mesh import plan_for_mesh
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp"))
    trainer = Trainer(config(data, epochs=1), out, progress=False,
                      parallel=plan_for_mesh(mesh))
    return _trained(trainer)


def _trained(trainer) -> dict:
    trainer.train_epoch()
    trainer.epoch = 1
    return {"losses": list(trainer.step_losses),
            "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "metrics": trainer.finish()}


@pytest.mark.slow
def test_context_parallel_training_equals_single_process(data, tmp_path):
    """2 gloo ranks splitting every step's cells (and every test surface) give the
    single-process step losses, weights and full-surface metric; a failure points to the
    loss's token sums or the count.

    The split sums in another order, and AdamW divides by |g| + 1e-8, so a gradient entry
    near 0 carries the rounding into the weights at lr / 1e-8 times it: over the kernel
    choices of an AMD EPYC (ATEN_CPU_CAPABILITY=default|avx2|avx512, MKL_CBWR=COMPATIBLE|
    AVX2|AVX512) the weights differed by up to 9.1e-7 (1.35e-6 on an Intel Xeon), the
    step losses by 8.3e-8 relative, the metric by 3.4e-9. The weights are held to 5x the
    largest measured spread, 5e-6; an entry whose gradient has the wrong sign moves by
    up to 2 lr = 6e-3 per step (AdamW's first steps are lr in size)."""
    reference = _trained(Trainer(config(data, epochs=1), tmp_path / "single", progress=False))
    results = run_on_ranks(_train_on_ranks, 2, data, str(tmp_path / "cp"), timeout_s=240)
    assert len(reference["losses"]) == 2
    for r in results:
        np.testing.assert_allclose(r["losses"], reference["losses"], rtol=1e-5)
        for name, value in reference["params"].items():
            torch.testing.assert_close(r["params"][name], value, rtol=0, atol=5e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
        assert r["metrics"]["test_nmse"] == pytest.approx(reference["metrics"]["test_nmse"],
                                                          rel=1e-5)
    with np.load(tmp_path / "cp" / CASE_FILE) as cp_case, \
            np.load(tmp_path / "single" / CASE_FILE) as one_case:
        np.testing.assert_allclose(cp_case["pred"], one_case["pred"], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_pareto_study_trains_the_grid_and_marks_the_front(data, tmp_path):
    """The grid's points; FLARE, FLARE++ and AB-UPT (its anchors fixed) at one depth, one
    epoch each: every run is timed (its cost from a separate timing run) and finishes,
    a second pass redoes nothing, the report has the matched ratios, and the front is the
    non-dominated set."""
    from flarepp.experiments.engine import create_study, open_study, run_study
    from flarepp.experiments.reports.cost import pareto_front
    from flarepp.experiments.reports import write_report
    from flarepp.experiments.studies import pareto_study
    assert pareto_front([1, 2, 3, 4, 2], [5, 4, 4.5, 1, 4]) == [0, 1, 3]
    study = pareto_study(config(data, epochs=1), ["flare", "flarepp", "abupt"], [1], [2, 4],
                         [0], anchors=64, timing_epochs=1)
    assert [p.name for p in study.points] == [
        "flare_B-1_M-2_seed-0", "flare_B-1_M-4_seed-0", "flarepp_B-1_M-2_seed-0",
        "flarepp_B-1_M-4_seed-0", "abupt_B-1_A-64_seed-0"]
    # 3 runs: FLARE, FLARE++, AB-UPT
    study.points = [p for p in study.points if "M-4" not in p.name]
    out = tmp_path / "pareto"
    done = run_study(create_study(out, study), out, log=lambda _: None)
    assert sorted(done["finished"]) == sorted(p.name for p in study.points)
    paths = write_report(out)
    report = paths["markdown"].read_text()
    assert "FLARE++ is lower in" in report and paths["figure5"].stat().st_size > 10_000
    with open(paths["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert all(float(r["hours"]) > 0 and r["status"] == "done" for r in rows)
    assert all(r["estimate"] == "timing run, CPU time" for r in rows)   # cost.json of each
    assert run_study(open_study(out), out, log=lambda _: None)["finished"] == []


@pytest.mark.parametrize("change, message", [
    ({"dataset_options": {"test_split": "train"}}, "test_split must be one of test, val"),
    ({"dataset_options": {"cells_per_step": 0}}, "cells_per_step must be a positive"),
    ({"dataset_options": {"cell_count": 5}}, "unknown to dataset 'drivaerml'"),
    ({"loss": "mse"}, "leave loss at 'reference'"),
])
def test_bad_options_fail_before_any_data_is_read(change, message):
    """A bad option of the task or its dataset fails when the config is made, naming it."""
    with pytest.raises(ValueError, match=message):
        config("/nonexistent", **change)


@pytest.mark.slow
def test_missing_split_file_and_runs_are_named(data, tmp_path):
    """A split file that is nowhere, or a split listing a run without its file, is a
    DataError naming the file."""
    with pytest.raises(DataError, match="nowhere.json"):
        build_task(config(data, dataset_options={"split_file": "nowhere.json"}), data)
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": ["run_1"], "test": ["run_77"]}))
    with pytest.raises(DataError, match="run_77"):
        build_task(config(data, dataset_options={"split_file": str(split)}), data)
