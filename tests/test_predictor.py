"""The one predictor (flarepp.inference.predictor), the Python API ``flarepp.load`` and
``flarepp export``.

A failure of the API tests points to the predictor's normalise / run / de-normalise path
or to the input layout the run stored; of the export tests, to the normalisers inside the
exported graph, to a dynamic dimension fixed at the example's size (pytorch issue 152018)
or to an exported file that needs flarepp to load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import flarepp
from flarepp.cli import main as cli
from flarepp.data import Normalizer
from flarepp.inference.execution import Execution
from flarepp.inference.predictor import InputLayout, Predictor, PredictorError
from flarepp.models import Surrogate
from flarepp.storage.checkpoint import unit_maps

@pytest.fixture(scope="module")
def darcy_run(tmp_path_factory):
    """A 2-epoch FLARE++ darcy-tiny run at 9 x 9 (width 16): (data, run directory)."""
    from tiny_runs import tiny_darcy_run
    return tiny_darcy_run(tmp_path_factory.mktemp("darcy"), "model.dim=16")


def new_mesh(n: int, samples: int | None = None, seed: int = 7) -> tuple[np.ndarray, ...]:
    """Points in the unit square and a coefficient per point: a mesh the run never saw."""
    rng = np.random.default_rng(seed)
    shape = (n,) if samples is None else (samples, n)
    points = rng.uniform(0, 1, (*shape, 2)).astype(np.float32)
    coefficient = rng.choice([3.0, 12.0], (*shape, 1)).astype(np.float32)
    return points, coefficient


@pytest.mark.slow
def test_load_predicts_a_new_mesh_as_infer_does(darcy_run, tmp_path):
    """``flarepp.load(run).predict(points, features=a)`` on a 57-point mesh equals ``flarepp
    infer``'s ``pred`` for the same inputs to 1e-6, for one mesh and for a padded batch,
    streamed or not, as NumPy or torch; the layout is the one the run stored (2 coordinate
    channels, 1 feature)."""
    _, run = darcy_run
    p = flarepp.load(run, device="cpu")
    assert isinstance(p, flarepp.Predictor)
    assert (p.layout.coordinates, p.layout.features, p.layout.field_names) == (
        2, 1, ("pressure u",))
    points, a = new_mesh(57)
    one = p.predict(points, features=a)
    assert one.shape == (57, 1) and one.dtype == np.float32
    np.savez(tmp_path / "mesh.npz", x=np.concatenate([points, a], -1)[None])
    assert cli(["infer", str(run), "--data", str(tmp_path / "mesh.npz"), "--out",
                str(tmp_path / "pred.npz"), "--device", "cpu"]) == 0
    with np.load(tmp_path / "pred.npz") as inferred:
        np.testing.assert_allclose(one, inferred["pred"][0], rtol=1e-6, atol=1e-6)

    batch_points, batch_a = new_mesh(40, samples=3)
    mask = np.ones((3, 40), bool)
    mask[1, 25:] = False
    batch = p.predict(batch_points, features=batch_a, mask=mask)
    assert batch.shape == (3, 40, 1) and not batch[1, 25:].any()
    for b in range(3):
        real = mask[b]
        alone = p.predict(batch_points[b, real], features=batch_a[b, real])
        np.testing.assert_allclose(batch[b, real], alone, rtol=1e-5, atol=1e-6)
    streamed = p.predict(batch_points, features=batch_a, mask=mask, chunk_size=7,
                         as_torch=True)
    assert isinstance(streamed, torch.Tensor)
    np.testing.assert_allclose(streamed.numpy(), batch, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_api_bad_inputs_are_sentences(darcy_run, tmp_path):
    """Wrong channel counts, a missing feature, a mask of the wrong shape, conditions for an
    unconditioned model, a directory that is no run and a checkpoint of a task without
    meshes: one sentence each, naming what is wrong."""
    from flarepp.storage.checkpoint import CheckpointError, save_checkpoint
    from flarepp.storage.rundir import NotARunDirectory
    from flarepp.train import get_preset
    _, run = darcy_run
    p = flarepp.load(run, device="cpu")
    points, a = new_mesh(10)
    with pytest.raises(PredictorError, match="points have 3 channels, but this run's model "
                                             r"takes 2 coordinate channels \(x, y\) and 1 "
                                             "feature channel"):
        p.predict(np.concatenate([points, a], -1))
    with pytest.raises(PredictorError, match="give the 1 feature channel"):
        p.predict(points)
    with pytest.raises(PredictorError, match="features have 2 channels"):
        p.predict(points, features=np.concatenate([a, a], -1))
    with pytest.raises(PredictorError, match=r"mask must be \[B, N\] = \[1, 10\]"):
        p.predict(points, features=a, mask=np.ones(9, bool))
    with pytest.raises(PredictorError, match="takes no conditions"):
        p.predict(points, features=a, conditions=np.ones((1, 2)))
    with pytest.raises(NotARunDirectory, match="is not a flarepp run directory"):
        flarepp.load(tmp_path)
    with pytest.raises(NotARunDirectory, match="does not exist"):
        flarepp.load(tmp_path / "absent")
    lm = tmp_path / "lm.pt"
    save_checkpoint(lm, {"config": get_preset("lm-tiny").to_dict(),
                         "model_config": {"arch": "causal-lm"}, "model": {}, "ema": {},
                         "epoch": 1, "normalizers": {}})
    with pytest.raises(CheckpointError, match="is a run of the 'lm' task, whose model does "
                                              "not map mesh points to fields"):
        flarepp.load(lm)


def test_conditions_are_normalised_through_the_same_path():
    """A conditioned model gets its conditions normalised by the stored map and fed as
    ``conditioning``; the prediction equals the explicit composition decode(model(encode(x),
    conditioning=encode(c))); conditions of the wrong shape, or none, are refused."""
    from flarepp.models import model_from_config
    model = model_from_config({"arch": "conditioned", "in_dim": 2, "out_dim": 1,
                               "cond_dim": 3, "cond_tokens": 2, "conditioning": "concat",
                               "mixer": "flarepp", "dim": 16, "heads": 2, "blocks": 1,
                               "latents": 4}).eval()
    maps = {name: Normalizer(np.array(mean, np.float32), np.array(std, np.float32))
            for name, mean, std in (("x", [0.5, -1.0], [2.0, 0.5]), ("y", [3.0], [4.0]),
                                    ("c", [1.0, 2.0, 3.0], [0.5, 1.0, 2.0]))}
    p = Predictor(Surrogate(model, **unit_maps(maps)), Execution("cpu"),
                  layout=InputLayout(2, 1, coordinates=2, conditions=(2, 3)))
    rng = np.random.default_rng(0)
    x, c = rng.normal(size=(2, 11, 2)).astype("f4"), rng.normal(size=(2, 2, 3)).astype("f4")
    got = p.predict(x, conditions=c)
    with torch.no_grad():
        raw = model(torch.from_numpy(maps["x"].encode(x)),
                    conditioning=torch.from_numpy(maps["c"].encode(c)))
    np.testing.assert_allclose(got, maps["y"].decode(raw.numpy()), rtol=1e-6, atol=1e-6)
    with pytest.raises(PredictorError, match=r"conditioned on 2 token\(s\) of 3 features"):
        p.predict(x)
    with pytest.raises(PredictorError, match=r"conditions must be \[B, K, C\] = \[2, 2, 3\]"):
        p.predict(x, conditions=c[:, :1])


def test_conditions_by_name_in_the_stored_order_and_never_nan():
    """``layout.describe()`` of a conditioned run names its conditions in the order the
    model takes them; ``conditions={name: value}`` equals the array in that order; a NaN
    or inf condition is refused (it made every prediction of the sample NaN). A failure
    points to conditions fed in another order, or a NaN passed on."""
    from flarepp.models import model_from_config
    model = model_from_config({"arch": "conditioned", "in_dim": 2, "out_dim": 1,
                               "cond_dim": 2, "cond_tokens": 1, "conditioning": "concat",
                               "mixer": "flarepp", "dim": 16, "heads": 2, "blocks": 1,
                               "latents": 4}).eval()
    maps = {name: Normalizer(np.zeros(k, np.float32), np.ones(k, np.float32))
            for name, k in (("x", 2), ("y", 1), ("c", 2))}
    layout = InputLayout(2, 1, coordinates=2, names=("x", "y"), conditions=(1, 2),
                         condition_names=("load", "speed"))
    assert layout.describe() == ("2 coordinate channels (x, y); and per sample 1 token of 2 "
                                 "conditions (load, speed), in that order")
    p = Predictor(Surrogate(model, **unit_maps(maps)), Execution("cpu"), layout=layout)
    x = np.random.default_rng(0).normal(size=(2, 9, 2)).astype("f4")
    by_name = p.predict(x, conditions={"speed": [3.0, 4.0], "load": [1.0, 2.0]})
    np.testing.assert_array_equal(by_name, p.predict(x, conditions=[[1.0, 3.0], [2.0, 4.0]]))
    assert not np.array_equal(by_name, p.predict(x, conditions=[[3.0, 1.0], [4.0, 2.0]]))
    for bad in (np.nan, np.inf):
        with pytest.raises(PredictorError, match="conditions hold NaN or inf"):
            p.predict(x, conditions={"load": [1.0, bad], "speed": [3.0, 4.0]})


@pytest.mark.slow
def test_infer_of_an_npz_predicts_every_sample_it_holds(darcy_run, tmp_path, capsys):
    """A run trained on an ``.npz`` (the npz dataset), given an ``.npz`` holding x and y
    of 3 samples, predicts the 3 samples, each with its relative L2 against its y, equal
    to ``flarepp.load(run).predict``; it read the file as a dataset and predicted its test
    split only (1 of 3), saying "1 case(s)". With ``conditions`` beside x, a run that
    takes none refuses them in a sentence. A failure points to the file read as a
    dataset again."""
    from tiny_runs import TINY
    points, a = new_mesh(30, samples=3)
    x = np.concatenate([points, a], -1)
    y = np.random.default_rng(2).normal(size=(3, 30, 1)).astype("f4")
    np.savez(tmp_path / "cases.npz", x=x, y=y)
    run = tmp_path / "run"
    assert cli(["train", "--data", str(tmp_path / "cases.npz"), "--out", str(run), "--quiet",
                *[arg for t in TINY[:-1] for arg in ("--set", t)]]) == 0
    capsys.readouterr()
    assert cli(["infer", str(run), "--data", str(tmp_path / "cases.npz"), "--out",
                str(tmp_path / "pred.npz"), "--device", "cpu"]) == 0
    said = capsys.readouterr().out
    assert "pred [3, 30, 1]" in said and "pred.npz: 3 case(s)" in said   # was "1 case(s)"
    predictor = flarepp.load(run, device="cpu")
    assert predictor.layout.coordinates is None       # an npz without coords: all as points
    want = predictor.predict(x)
    with np.load(tmp_path / "pred.npz") as f:
        np.testing.assert_allclose(f["pred"], want, rtol=1e-6, atol=1e-6)
        rel = np.linalg.norm((want - y).reshape(3, -1), axis=1) / np.linalg.norm(
            y.reshape(3, -1), axis=1)
        np.testing.assert_allclose(f["rel_l2"], rel, rtol=1e-5)
    np.savez(tmp_path / "conditioned.npz", x=x, conditions=np.ones((3, 1), "f4"))
    assert cli(["infer", str(run), "--data", str(tmp_path / "conditioned.npz"), "--out",
                str(tmp_path / "c.npz"), "--device", "cpu"]) == 2
    assert "takes none" in capsys.readouterr().err and not (tmp_path / "c.npz").exists()


@pytest.mark.slow
def test_infer_into_a_closed_pipe_still_writes_its_file(darcy_run, tmp_path):
    """``flarepp infer ... | head -c 0``: the reader is gone before the first line, yet
    the output .npz is written whole and the command exits 0 (the closed stdout was taken
    for a failure of the output file, and nothing was written)."""
    _, run = darcy_run
    points, a = new_mesh(30, samples=2)
    np.savez(tmp_path / "cases.npz", x=np.concatenate([points, a], -1))
    read, write = os.pipe()
    os.close(read)                                  # the reader has gone away
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run([sys.executable, "-m", "flarepp", "infer", str(run), "--data",
                               str(tmp_path / "cases.npz"), "--out", str(tmp_path / "p.npz"),
                               "--device", "cpu"], stdout=write, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=300)
    finally:
        os.close(write)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with np.load(tmp_path / "p.npz") as f:
        assert f["pred"].shape == (2, 30, 1)


# ---------------------------------------------------------------------------------------------
# export

def _reference(run, n: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Physical inputs at ``n`` points (3 samples, the last padded) and the predictor's
    outputs in PyTorch (FP32)."""
    points, a = new_mesh(n, samples=3, seed=11)
    mask = np.ones((3, n), bool)
    mask[2, n // 2:] = False
    x = np.concatenate([points, a], -1) * mask[..., None]
    want = flarepp.load(run, device="cpu", precision="fp32").predict(points, features=a,
                                                                      mask=mask)
    return torch.from_numpy(x), torch.from_numpy(mask), want


@pytest.mark.slow
def test_pt2_export_agrees_and_loads_without_flarepp(darcy_run, tmp_path):
    """``flarepp export --format pt2`` of a FLARE++ run, loaded with torch alone in a
    process that cannot import flarepp, gives the PyTorch predictor's outputs to 1e-5 at
    N = 83 (traced at 64) with padding."""
    _, run = darcy_run
    out = tmp_path / "model.pt2"
    assert cli(["export", str(run), "--format", "pt2", "--out", str(out)]) == 0
    x, mask, want = _reference(run, 83)
    np.savez(tmp_path / "inputs.npz", x=x.numpy(), mask=mask.numpy())
    code = textwrap.dedent(f"""
        import sys
        sys.path = [p for p in sys.path if p and not __import__("os").path.isdir(
            __import__("os").path.join(p, "flarepp"))]
        sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        try:
            import flarepp
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit("flarepp is importable")
        import numpy as np, torch
        inputs = np.load({str(tmp_path / "inputs.npz")!r})
        module = torch.export.load({str(out)!r}).module()
        y = module(torch.from_numpy(inputs["x"]), torch.from_numpy(inputs["mask"]))
        np.save({str(tmp_path / "y.npy")!r}, y.detach().numpy())
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = np.load(tmp_path / "y.npy")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not got[2, 83 // 2:].any()


@pytest.mark.slow
def test_onnx_export_agrees_under_onnxruntime_at_another_point_count(darcy_run, tmp_path):
    """``flarepp export --format onnx`` (dynamo exporter) run by onnxruntime on the CPU at
    N = 83 and 130 (traced at 64; pytorch issue 152018 fixes such dimensions through SDPA)
    with padding gives the PyTorch predictor's outputs to 1e-5; safetensors holds the
    weights, normalisers and model config."""
    import onnxruntime
    _, run = darcy_run
    out = tmp_path / "model.onnx"
    assert cli(["export", str(run), "--format", "onnx", "--out", str(out)]) == 0
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["x", "mask"]
    for n in (83, 130):
        x, mask, want = _reference(run, n)
        got = session.run(["y"], {"x": x.numpy(), "mask": mask.numpy()})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert cli(["export", str(run), "--format", "safetensors"]) == 0
    from safetensors import safe_open
    with safe_open(str(run / "model.safetensors"), "pt") as f:
        config = json.loads(f.metadata()["model_config"])
        assert config["mixer"] == "flarepp" and "input_shift" in f.keys()


@pytest.mark.slow
def test_a_model_that_cannot_be_exported_is_a_sentence(tmp_path):
    """A Linformer (its projections fix the number of points) is refused naming the model,
    the mixer and the exporter's reason, and nothing is written."""
    from flarepp.inference.export import ExportError, export_pt2
    model = flarepp.build_model(mixer="linformer", in_dim=3, out_dim=1, dim=16, heads=2,
                                blocks=1, latents=4).eval()
    module = Surrogate(model, inputs=(np.zeros(3), np.ones(3)),
                       outputs=(np.zeros(1), np.ones(1)))
    with pytest.raises(ExportError, match="torch.export cannot export this 'surrogate' model "
                                          r"\(mixer 'linformer'\) with dynamic batch"):
        export_pt2(module, tmp_path / "m.pt2")
    assert not list(tmp_path.iterdir())


def test_a_missing_extra_says_which_to_install(monkeypatch, tmp_path):
    """Without onnxscript, ``--format onnx`` is one sentence naming the module and
    ``pip install 'flarepp[export]'``, before any export work."""
    from flarepp.inference.export import ExportError, export_onnx
    monkeypatch.setitem(sys.modules, "onnxscript", None)
    module = Surrogate(torch.nn.Identity(), inputs=(np.zeros(1), np.ones(1)),
                       outputs=(np.zeros(1), np.ones(1)))
    with pytest.raises(ExportError, match=r"needs onnxscript .* pip install 'flarepp\[export\]'"):
        export_onnx(module, tmp_path / "m.onnx")
    assert not list(tmp_path.iterdir())
