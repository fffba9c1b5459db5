"""Other FLARE implementations' checkpoints in flarepp: exact, and usable everywhere.

The fixtures in ``tests/fixtures/interop`` were made by the real packages
(``scripts/make_import_fixtures.py``, provenance in ``provenance.json``): NVIDIA PhysicsNeMo
2.2.2's ``FLARE`` and its pull request's ``FLAREPlusPlus`` (``Module.save``), and the FLARE
authors' ``FLAREModel`` / ``FLAREPPModel`` at a pinned commit (their case directories), each
with its own float64 forward and input gradient on a fixed input. Neither package is
installed here: flarepp reads the files alone. A failure of the first tests points at the
weight maps of ``flarepp.interop`` (or a mixer / backbone change that altered the function).
"""

from __future__ import annotations

import io
import json
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import flarepp
from flarepp.cli import main
from flarepp.distributed import context_parallel, run_on_ranks, stream_forward
from flarepp.interop import (InteropError, import_checkpoint, import_flare_py, import_mdlus)
from flarepp.interop.physicsnemo import export_mdlus, normalizers_path
from flarepp.models import build_model
from flarepp.storage.checkpoint import read_checkpoint, rebuild_model

FIXTURES = Path(__file__).parent / "fixtures" / "interop"
CASES = {"physicsnemo_flare": ("physicsnemo", "physicsnemo_flare.mdlus", "flare"),
         "physicsnemo_flareplusplus": ("physicsnemo", "physicsnemo_flareplusplus.mdlus",
                                       "flarepp-v1"),
         "flare_py_flare": ("flare-py", "flare_py_flare", "flare"),
         "flare_py_flarepp": ("flare-py", "flare_py_flarepp", "flarepp")}
READERS = {"physicsnemo": import_mdlus, "flare-py": import_flare_py}
TOL = 1e-12


def imported(name: str):
    fmt, source, _ = CASES[name]
    return READERS[fmt](FIXTURES / source)


def output_and_input_gradient(model, data) -> tuple[np.ndarray, np.ndarray]:
    x = torch.from_numpy(data["x"]).requires_grad_(True)
    y = model(x)
    (torch.from_numpy(data["w"]) * y).sum().backward()
    return y.detach().numpy(), x.grad.numpy()


def assert_matches(model, npz: Path) -> None:
    data = np.load(npz)
    y, x_grad = output_and_input_gradient(model, data)
    scale = max(1.0, float(np.abs(data["y"]).max()))
    assert np.abs(y - data["y"]).max() <= TOL * scale, f"{npz.name}: outputs differ"
    assert np.abs(x_grad - data["x_grad"]).max() <= TOL * scale, f"{npz.name}: input gradients"


@pytest.mark.parametrize("name", list(CASES))
def test_imported_model_equals_theirs_in_float64(name):
    """Outputs and input gradients of their own float64 forward, to 1e-12: the maps
    (composed per-head projections, seeds, norms, gate, scale) are exact."""
    model = imported(name)
    assert model.model_config["mixer"] == CASES[name][2]
    assert_matches(model.model(), FIXTURES / f"{name}.npz")


def test_their_ema_weights_import_too():
    """The authors' trainer's EMA shadow becomes the run's ``ema`` weights."""
    model = imported("flare_py_flare")
    assert model.ema is not None
    assert_matches(model.model("ema"), FIXTURES / "flare_py_flare_ema.npz")


@pytest.mark.parametrize("name", ["physicsnemo_flare", "flare_py_flarepp"])
def test_the_run_directory_holds_the_same_function(name, tmp_path):
    """Written through RunDir and the checkpoint writer, rebuilt by ``rebuild_model`` in
    float64: still their function to 1e-12 (the weights are stored in float64)."""
    fmt, source, _ = CASES[name]
    report = import_checkpoint(fmt, FIXTURES / source, tmp_path / "run", normalizers="identity")
    state = read_checkpoint(report.checkpoint)
    assert state["imported_from"]["sha256"] and state["imported_from"]["format"] == fmt
    assert_matches(rebuild_model(state, report.checkpoint, dtype=torch.float64),
                   FIXTURES / f"{name}.npz")


@pytest.mark.parametrize("name", list(CASES))
def test_padded_batch_with_mask_equals_each_mesh_alone(name):
    """What only flarepp adds: meshes of different sizes in one padded batch with a mask
    give each mesh's own outputs (their models take no mask)."""
    model = imported(name).model()
    x = torch.from_numpy(np.load(FIXTURES / f"{name}.npz")["x"])
    lengths = [37, 23]
    batch = torch.zeros(2, 37, x.shape[-1], dtype=torch.float64)
    mask = torch.zeros(2, 37, dtype=torch.bool)
    for i, n in enumerate(lengths):
        batch[i, :n], mask[i, :n] = x[i, :n], True
    with torch.no_grad():
        y = model(batch, mask)
        for i, n in enumerate(lengths):
            alone = model(x[i:i + 1, :n])
            assert torch.allclose(y[i:i + 1, :n], alone, rtol=0, atol=TOL), f"mesh {i}"
            assert (y[i, n:] == 0).all()


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_forward_equals_the_plain_one(name):
    """Exact streaming in chunks (App. B): the same outputs as one pass."""
    model = imported(name).model()
    x = torch.from_numpy(np.load(FIXTURES / f"{name}.npz")["x"])
    with torch.no_grad():
        plain = model(x)
        streamed = stream_forward(model, x, None, chunk_size=5, device=torch.device("cpu"))
    assert torch.allclose(streamed, plain, rtol=0, atol=TOL)


def sharded_program(group, name: str) -> dict:
    model = imported(name).model()
    x = torch.from_numpy(np.load(FIXTURES / f"{name}.npz")["x"])
    with torch.no_grad(), context_parallel(model, group) as cp:
        y = cp.gather(model(cp.shard(x)))
    return {"y": y.numpy()}


@pytest.mark.slow
def test_two_rank_token_sharded_forward_equals_the_plain_one():
    """Exact token sharding over 2 gloo ranks (App. B) of the imported FLARE and FLARE++."""
    for name in ("physicsnemo_flare", "flare_py_flarepp"):
        results = run_on_ranks(sharded_program, 2, name, timeout_s=90)
        with torch.no_grad():
            plain = imported(name).model()(
                torch.from_numpy(np.load(FIXTURES / f"{name}.npz")["x"])).numpy()
        for r in results:
            assert np.abs(r["y"] - plain).max() <= TOL, name


# ---------------------------------------------------------------------------------------------
# what cannot be represented is refused, one sentence naming the argument

def mdlus_with(tmp_path: Path, **changes) -> Path:
    """The FLARE fixture with ``args.json``'s arguments changed (refusals only look at
    the arguments)."""
    out = tmp_path / "changed.mdlus"
    with zipfile.ZipFile(FIXTURES / "physicsnemo_flare.mdlus") as src, \
            zipfile.ZipFile(out, "w") as dst:
        for item in src.namelist():
            data = src.read(item)
            if item == "args.json":
                header = json.loads(data)
                header["__args__"].update(changes)
                data = json.dumps(header).encode()
            dst.writestr(item, data)
    return out


@pytest.mark.parametrize("arg, value", [("unified_pos", True), ("structured_shape", [8, 8]),
                                        ("time_input", True), ("use_te", True),
                                        ("act", "relu"), ("future_option", 1)])
def test_physicsnemo_arguments_flarepp_cannot_represent_are_refused(tmp_path, arg, value):
    with pytest.raises(InteropError) as err:
        import_mdlus(mdlus_with(tmp_path, **{arg: value}))
    message = str(err.value)
    assert arg in message and "\n" not in message


def case_with(tmp_path: Path, name: str, **changes) -> Path:
    case = tmp_path / name
    shutil.copytree(FIXTURES / name, case)
    config = yaml.safe_load((case / "config.yaml").read_text())
    config["model"].update(changes)
    (case / "config.yaml").write_text(yaml.safe_dump(config))
    return case


@pytest.mark.parametrize("name, key, value", [
    ("flare_py_flare", "num_layers_k_proj", 3), ("flare_py_flare", "num_layers_v_proj", 1),
    ("flare_py_flare", "qk_norm", True), ("flare_py_flare", "act", "silu"),
    ("flare_py_flare", "num_layers_ffn", 3), ("flare_py_flare", "ffn_mlp_ratio", 1.0),
    ("flare_py_flarepp", "share_k0_v0", False), ("flare_py_flarepp", "k_norm", False),
    ("flare_py_flarepp", "q_fixed_norm", False), ("flare_py_flarepp", "out_proj_norm", False),
    ("flare_py_flarepp", "model", "transolver")])
def test_flare_py_settings_flarepp_cannot_represent_are_refused(tmp_path, name, key, value):
    with pytest.raises(InteropError) as err:
        import_flare_py(case_with(tmp_path, name, **{key: value}))
    message = str(err.value)
    assert (key in message or repr(value) in message) and "\n" not in message


def test_files_that_are_no_checkpoint_are_a_sentence(tmp_path):
    junk = tmp_path / "junk.mdlus"
    junk.write_bytes(b"not an archive")
    with pytest.raises(InteropError, match="neither a zip nor a tar"):
        import_mdlus(junk)
    with pytest.raises(InteropError, match="is a directory"):     # said "does not exist"
        import_mdlus(tmp_path)
    partial = tmp_path / "partial.mdlus"
    with zipfile.ZipFile(partial, "w") as z:
        z.writestr("args.json", "{}")
    with pytest.raises(InteropError, match="lacks"):
        import_mdlus(partial)
    with pytest.raises(InteropError, match="missing.yaml: not a readable YAML config"):
        import_flare_py(FIXTURES / "flare_py_flare" / "ckpt01" / "model.pt",
                        config=tmp_path / "missing.yaml")


# ---------------------------------------------------------------------------------------------
# the way back

def test_export_mdlus_round_trip(tmp_path):
    """An imported PhysicsNeMo FLARE written back as a .mdlus: its own import gives their
    original outputs (to the float32 rounding of the factored weights) and the normalisers
    are beside it. PhysicsNeMo's ``from_checkpoint`` loading the same kind of file is
    checked by the fixture script (provenance.json, ``round_trip``)."""
    import_checkpoint("physicsnemo", FIXTURES / "physicsnemo_flare.mdlus", tmp_path / "run",
                      normalizers="identity")
    written = export_mdlus(tmp_path / "run", tmp_path / "back.mdlus")
    assert written["deviation"] < 1e-6 and written["args"]["embedding_dim"] == 2
    data = np.load(FIXTURES / "physicsnemo_flare.npz")
    with torch.no_grad():
        back = import_mdlus(tmp_path / "back.mdlus").model()(torch.from_numpy(data["x"]))
    assert np.abs(back.numpy() - data["y"]).max() < 1e-5 * np.abs(data["y"]).max()
    assert json.loads(normalizers_path(tmp_path / "back.mdlus").read_text())["x"]["std"]
    recorded = json.loads((FIXTURES / "provenance.json").read_text())
    trip = recorded["fixtures"]["physicsnemo_flare"]["round_trip"]
    assert trip["from_checkpoint"].endswith("FLARE")
    assert trip["max_abs_difference_relative"] < 1e-6


def flarepp_run(tmp_path: Path, **model) -> Path:
    """A flarepp FLARE in the Transolver skeleton, written as an imported run would be."""
    from flarepp.interop.run import ImportedModel, read_normalizers, write_imported_run
    torch.manual_seed(0)
    net = build_model("transolver-backbone", in_dim=3, out_dim=2, dim=16, heads=4, blocks=2,
                      latents=4, **model)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1 * torch.randn_like(p))
    config = net.config.to_dict()
    run = tmp_path / "mine"
    write_imported_run(run, ImportedModel(config, net.state_dict(), {"format": "test"}),
                       read_normalizers("identity", 3, 2), source_file=Path(__file__))
    return run


@pytest.mark.parametrize("model, reason", [
    ({}, "rank"), ({"attn_scale": 0.5}, "scale"), ({"gelu": "tanh"}, "backbone"),
    ({"mixer": "flarepp"}, "backbone"), ({"input_mlp": "residual"}, "backbone")])
def test_export_mdlus_says_why_it_cannot(tmp_path, model, reason):
    """A model PhysicsNeMo's FLARE cannot compute is refused naming the reason: flarepp's
    independent per-head key and value maps (rank), another SDPA scale, another
    backbone; nothing is written."""
    run = flarepp_run(tmp_path, **model)
    with pytest.raises(InteropError, match=reason) as err:
        export_mdlus(run, tmp_path / "x.mdlus")
    assert "\n" not in str(err.value) and not (tmp_path / "x.mdlus").exists()


# ---------------------------------------------------------------------------------------------
# the imported run works everywhere a trained run does

def test_normalisers_from_a_statistics_file_are_applied(tmp_path):
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"x": {"mean": [0.5, -1.0, 2.0], "std": [2.0, 0.5, 1.0]},
                                 "y": {"mean": [1.0, 0.0], "std": [3.0, 0.25]},
                                 "coordinates": 2, "field_names": ["p", "q"]}))
    report = import_checkpoint("physicsnemo", FIXTURES / "physicsnemo_flare.mdlus",
                               tmp_path / "run", normalizers=str(stats))
    assert "statistics file" in report.normalizers.describe
    predictor = flarepp.load(tmp_path / "run", device="cpu")
    data = np.load(FIXTURES / "physicsnemo_flare.npz")
    x = data["x"][0].astype(np.float32)
    y = predictor.predict(x[:, :2], features=x[:, 2:])
    with torch.no_grad():
        z = (torch.from_numpy(x) - torch.tensor([0.5, -1.0, 2.0])) / torch.tensor([2.0, 0.5, 1.0])
        want = imported("physicsnemo_flare").model()(z.double()[None])[0].numpy()
    want = want * np.array([3.0, 0.25]) + np.array([1.0, 0.0])
    assert np.abs(y - want).max() < 1e-4 * np.abs(want).max()
    with pytest.raises(InteropError, match="x means"):
        stats.write_text(json.dumps({"x": {"mean": [0.0], "std": [1.0]},
                                     "y": {"mean": [0, 0], "std": [1, 1]}}))
        import_checkpoint("physicsnemo", FIXTURES / "physicsnemo_flare.mdlus",
                          tmp_path / "run2", normalizers=str(stats))


def write_store(root: Path) -> None:
    """A store whose samples have the fixtures' 3 inputs (x, y, a) and 2 targets (p, q)."""
    from flarepp.data import ChannelGroup, ChannelLayout
    from flarepp.data.store import StoreWriter
    layout = ChannelLayout(inputs=(ChannelGroup("coordinates", ("x", "y"), "points"),
                                   ChannelGroup("a", ("a",), "a")),
                           targets=(ChannelGroup("pq", ("p", "q"), "pq", units="Pa"),),
                           conditions=(), association="point", coordinates=2, dimensions=2)
    rng = np.random.default_rng(0)
    writer = StoreWriter(root, {"test": "store"})
    metas, names = {}, {}
    for split, count in (("train", 3), ("test", 2)):
        names[split] = [f"{split}/case_{i}" for i in range(count)]
        for name in names[split]:
            n = int(rng.integers(20, 30))
            arrays = {"coordinates": rng.random((n, 2)).astype(np.float32),
                      "a": rng.random((n, 1)).astype(np.float32) * 4 + 1,
                      "pq": rng.standard_normal((n, 2)).astype(np.float32) * 3 + 2}
            metas[name] = writer.write(name, arrays, {"source": None, "conditions": [],
                                                      "layout": layout.to_dict()})
    writer.finish(layout, names, metas)


def test_normalisers_and_layout_from_a_store(tmp_path):
    """``--normalizers STORE``: its training split's mean and std, its channel names and
    coordinates; ``flarepp infer`` then reads the store's samples with the imported run."""
    write_store(tmp_path / "store")
    report = import_checkpoint("physicsnemo", FIXTURES / "physicsnemo_flare.mdlus",
                               tmp_path / "run", normalizers=str(tmp_path / "store"))
    norms = report.normalizers
    assert "training split of store" in norms.describe and norms.coordinates == 2
    assert norms.field_names == ["p", "q"] and 1.0 < float(norms.x.mean[2]) < 5.0
    p = flarepp.load(tmp_path / "run", device="cpu")
    assert p.layout.describe().startswith("2 coordinate channels (x, y)")
    assert main(["infer", str(tmp_path / "run"), "--data", str(tmp_path / "store"), "--out",
                 str(tmp_path / "pred.npz"), "--device", "cpu", "--threads", "1",
                 "--chunk-size", "8"]) == 0
    assert np.load(tmp_path / "pred.npz")["cases"].size == 2


def test_cli_import_says_what_it_used_and_refuses_a_second_write(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["import", "flare-py", str(FIXTURES / "flare_py_flarepp"), "--out", str(out),
            "--normalizers", "identity"]
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "normalisers: the identity" in said and "'flarepp' mixer" in said
    assert main(args) == 2
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.slow
def test_infer_streamed_and_export_on_an_imported_run(tmp_path):
    """``flarepp infer --chunk-size`` and ``flarepp export --format pt2`` read the run."""
    run = tmp_path / "run"
    assert main(["import", "physicsnemo", str(FIXTURES / "physicsnemo_flare.mdlus"), "--out",
                 str(run), "--normalizers", "identity"]) == 0
    data = np.load(FIXTURES / "physicsnemo_flare.npz")
    np.savez(tmp_path / "cases.npz", x=data["x"].astype(np.float32))
    for chunk in ([], ["--chunk-size", "6"]):
        out = tmp_path / f"pred{len(chunk)}.npz"
        assert main(["infer", str(run), "--data", str(tmp_path / "cases.npz"), "--out",
                     str(out), "--device", "cpu", "--threads", "1", *chunk]) == 0
        assert np.abs(np.load(out)["pred"] - data["y"]).max() < 1e-4 * np.abs(data["y"]).max()
    assert main(["export", str(run), "--format", "pt2", "--out", str(tmp_path / "m.pt2")]) == 0


@pytest.mark.slow
def test_fine_tuning_starts_from_an_imported_run(tmp_path):
    """``train --init-from`` an imported run: the first evaluation is the imported model's
    (same architecture and weights), and training goes on from there."""
    from flarepp.train import RunConfig, Trainer
    run = tmp_path / "imported"
    import_checkpoint("flare-py", FIXTURES / "flare_py_flarepp", run, normalizers="identity")
    rng = np.random.default_rng(0)
    for split, count in (("train", 4), ("test", 2)):
        arrays = {}
        for i in range(count):
            x = rng.standard_normal((int(rng.integers(20, 30)), 3)).astype(np.float32)
            arrays[f"x_{i}"], arrays[f"y_{i}"] = x, np.sin(x[:, :2])
        np.savez(tmp_path / f"{split}.npz", **arrays)
    model = {k: v for k, v in read_checkpoint(run / "checkpoints" / "epoch_0000.pt")
             ["model_config"].items() if k not in ("in_dim", "out_dim")}
    config = RunConfig(name="tune", dataset="npz", data_root=str(tmp_path), model=model,
                       epochs=1, batch_size=2, checkpoint_every=1)
    trainer = Trainer(config, tmp_path / "tuned", progress=False, init_from=run)
    state = read_checkpoint(run / "checkpoints" / "epoch_0000.pt")
    before = rebuild_model(state, run).state_dict()
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, before[key]), key
    trainer.fit()
    assert (tmp_path / "tuned" / "checkpoints" / "epoch_0001.pt").is_file()


# ---------------------------------------------------------------------------------------------
# crafted files (the hostile probe of issue 41): one sentence naming the file, nothing built

def crafted_mdlus(tmp_path: Path, *, drop: str | None = None, metadata=None,
                  weight=None, **args) -> Path:
    """The FLARE fixture with an argument dropped or changed, metadata.json replaced, or
    one weight (the first block's out_linear) replaced by ``weight``."""
    out = tmp_path / "crafted.mdlus"
    with zipfile.ZipFile(FIXTURES / "physicsnemo_flare.mdlus") as src:
        files = {n: src.read(n) for n in src.namelist()}
    header = json.loads(files["args.json"])
    header["__args__"].update(args)
    header["__args__"].pop(drop, None)
    files["args.json"] = json.dumps(header).encode()
    if metadata is not None:
        files["metadata.json"] = json.dumps(metadata).encode()
    if weight is not None:
        state = torch.load(io.BytesIO(files["model.pt"]), weights_only=True)
        state["blocks.0.Attn.out_linear.weight"] = weight
        buffer = io.BytesIO()
        torch.save(state, buffer)
        files["model.pt"] = buffer.getvalue()
    with zipfile.ZipFile(out, "w") as dst:
        for name, data in files.items():
            dst.writestr(name, data)
    return out


NAN_WEIGHT = torch.full((16, 16), float("nan"))


@pytest.mark.parametrize("crafted, said", [
    (dict(drop="out_dim"), "lacks the argument 'out_dim'"),          # was KeyError
    (dict(n_head=0), "n_head=0 must be an integer >= 1"),              # ZeroDivisionError
    (dict(n_hidden="abc"), "n_hidden='abc' must be an integer"),       # int()'s words only
    (dict(n_layers=10**9), "n_layers=1000000000 but model.pt holds 2"),  # killed for memory
    (dict(slice_num=10**12), "has shape [4, 6, 4] where the model"),   # 64 TB allocation
    (dict(metadata=[1]), "metadata.json is a list"),                   # AttributeError
    (dict(weight=torch.zeros(5, 7)), "'blocks.0.mixer.out_proj.weight' has shape [5, 7]"),
    (dict(weight=3), "is a int, not a real floating-point tensor"),   # AttributeError
    (dict(weight=torch.zeros(16, 16, dtype=torch.complex64)), "complex64"),  # imag dropped
    (dict(weight=NAN_WEIGHT), "holds NaN or infinite weights")])      # imported, NaN out
def test_a_crafted_mdlus_is_one_sentence_naming_the_file(tmp_path, crafted, said):
    path = crafted_mdlus(tmp_path, **crafted)
    with pytest.raises(InteropError) as err:
        import_checkpoint("physicsnemo", path, tmp_path / "run", normalizers="identity")
    message = str(err.value)
    assert said in message and str(path) in message and "\n" not in message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("stats, said", [
    ({"x": {"mean": [float("nan"), 0, 0], "std": [1, 1, 1]}}, "x.mean must be 3 finite"),
    ({"x": {"mean": [0, 0, 0], "std": [float("inf"), 1, 1]}}, "x.std must be 3 positive finite"),
    ({"x": {"mean": ["a", 0, 0], "std": [1, 1, 1]}}, "must be lists of numbers"),
    ({"coordinates": 99}, "coordinates=99 must be an integer from 0 to the model's 3"),
    ({"input_names": ["a"]}, "input_names must be 3 names")])
def test_a_statistics_file_that_cannot_be_the_models_is_refused(tmp_path, stats, said):
    """Accepted before: a run that no command could load (NaN/inf maps), one describing
    itself as '99 coordinate channels and -96 feature channels' and exported as a .mdlus of
    functional_dim=-96, or one naming its 3 inputs by 1 name."""
    good = {"x": {"mean": [0, 0, 0], "std": [1, 1, 1]}, "y": {"mean": [0, 0], "std": [1, 1]}}
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({**good, **stats}))
    with pytest.raises(InteropError, match=re.escape(said)) as err:
        import_checkpoint("physicsnemo", FIXTURES / "physicsnemo_flare.mdlus",
                          tmp_path / "run", normalizers=str(path))
    assert str(path) in str(err.value) and not (tmp_path / "run").exists()


@pytest.mark.parametrize("changes, said", [
    ({"channel_dim": None}, "lacks it"), ({"num_heads": 0}, "num_heads=0: must be an integer"),
    ({"num_blocks": 10**9}, "num_blocks=1000000000 but the state dict holds 2")])
def test_a_crafted_flare_py_config_is_one_sentence(tmp_path, changes, said):
    case = tmp_path / "case"
    shutil.copytree(FIXTURES / "flare_py_flarepp", case)
    config = yaml.safe_load((case / "config.yaml").read_text())
    for key, value in changes.items():
        config["model"][key] = value
        if value is None:
            del config["model"][key]
    (case / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(InteropError, match=re.escape(said)):
        import_flare_py(case)
    (case / "config.yaml").write_text("model: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(InteropError, match="not a readable YAML config") as err:
        import_flare_py(case)
    assert "\n" not in str(err.value)


def test_export_mdlus_writes_nothing_where_its_normalisers_cannot_go(tmp_path):
    """A folder at out.normalizers.json: the .mdlus was written and left without its
    normalisers, the error naming a temporary; now a sentence before anything is written."""
    import_checkpoint("physicsnemo", FIXTURES / "physicsnemo_flare.mdlus", tmp_path / "run",
                      normalizers="identity")
    normalizers_path(tmp_path / "x.mdlus").mkdir()
    with pytest.raises(InteropError, match="x.mdlus.normalizers.json, where the normalisers"):
        export_mdlus(tmp_path / "run", tmp_path / "x.mdlus")
    assert not (tmp_path / "x.mdlus").exists()
