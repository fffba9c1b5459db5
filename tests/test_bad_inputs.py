"""Every command a sentence, every output trustworthy (issue 20): the surfaces added since the
previous reliability round, tried with hostile input.

Each test reproduces one defect of the issue (named in its docstring) and fails on the
code before its fix: a silently wrong result, unbounded work, a traceback, or a message that
misleads. A sentence names the file, key or value; exit status 1 is a runtime error, 2 a
usage error.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from flarepp.cli import main as cli
from flarepp.storage.checkpoint import CheckpointError, read_checkpoint, save_checkpoint

SRC = str(Path(__file__).resolve().parents[1] / "src")
from tiny_runs import TINY  # noqa: E402  (tests/ is on sys.path: conftest)


def sets(items):
    return [a for t in items for a in ("--set", t)]


def usage_error(argv, capsys) -> str:
    """argparse's exit status 2 and its sentence (stderr) for ``flarepp ARGV``."""
    with pytest.raises(SystemExit) as exit_:
        cli(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def _python(code: str, **kwargs) -> subprocess.Popen:
    """A Python child with SIGINT at its default: a suite started in the background (``make
    test &`` in a script) inherits SIGINT ignored, and Python then installs no
    KeyboardInterrupt handler, so the signal tests would wait for nothing."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            **kwargs)


@pytest.fixture(scope="module")
def darcy_run(tmp_path_factory):
    """A 2-epoch darcy-tiny run at 9 x 9 (data, run directory, final checkpoint)."""
    from tiny_runs import tiny_darcy_run
    data, run = tiny_darcy_run(tmp_path_factory.mktemp("darcy"))
    return data, run, run / "checkpoints" / "epoch_0002.pt"


# ---------------------------------------------------------------------------------------------
# silently wrong results

@pytest.mark.slow
def test_infer_refuses_targets_of_another_channel_count(darcy_run, tmp_path, capsys):
    """A 1-channel model against 2-channel targets printed "mean relative L2 99.356%" with
    exit 0 (rel_l2 broadcast the prediction over the targets' channels); `eval` refused the
    same data. Now a usage error naming both channel counts, and no output file."""
    _, _, checkpoint = darcy_run
    data = tmp_path / "two_channels.npz"
    np.savez(data, x=np.random.rand(10, 81, 3).astype("f4"),
             y=np.random.rand(10, 81, 2).astype("f4"))
    code = cli(["infer", str(checkpoint), "--data", str(data), "--dataset", "npz",
                "--out", str(tmp_path / "pred.npz")])
    err = capsys.readouterr().err
    assert code == 2
    assert "two_channels.npz: targets have 2 channels" in err and "predicts 1" in err
    assert not (tmp_path / "pred.npz").exists()


@pytest.mark.slow
def test_infer_refuses_nan_inputs(darcy_run, tmp_path, capsys):
    """NaN inputs gave all-NaN predictions with exit 0 and no word; now exit 1 naming the
    file, the sample and the point."""
    _, _, checkpoint = darcy_run
    x = np.random.rand(2, 81, 3).astype("f4")
    x[1, 7, 0] = np.nan
    data = tmp_path / "inputs.npz"
    np.savez(data, x=x)
    code = cli(["infer", str(checkpoint), "--data", str(data), "--out",
                str(tmp_path / "pred.npz")])
    err = capsys.readouterr().err
    assert code == 1
    assert "inputs.npz: the inputs x hold non-finite values" in err
    assert "first at sample 1, point 7" in err
    assert not (tmp_path / "pred.npz").exists()


@pytest.mark.parametrize("argv, named", [
    (["--n-train", "-3"], "argument --n-train: must be an integer >= 1, got -3"),
    (["--n-val", "0"], "argument --n-val: must be an integer >= 1, got 0"),
    (["--n-test", "0"], "argument --n-test: must be an integer >= 1, got 0"),
])
def test_listops_counts_below_one_are_usage_errors(tmp_path, capsys, argv, named):
    """`lra data make listops --n-train -3` exited 0 and wrote a 1,994-row training file and
    an empty validation split (a negative count sliced the rows from the end); a count of 0
    wrote a header-only file. Now exit 2 naming the option, and nothing written."""
    err = usage_error(["lra", "data", "make", "listops", "--out", str(tmp_path / "lo"),
                       "--size", "tiny", "--quiet", *argv], capsys)
    assert named in err
    assert not (tmp_path / "lo").exists()


def test_listops_generator_refuses_empty_splits(tmp_path):
    """The library function itself refuses what the command line now refuses."""
    from flarepp.data.lra.listops import make_listops
    from flarepp.data.lra.pathfinder import make_pathfinder
    with pytest.raises(ValueError, match="ListOps n_val must be at least 1, got 0"):
        make_listops(tmp_path, n_train=4, n_val=0, n_test=2, progress=False)
    with pytest.raises(ValueError, match="Pathfinder count must be at least 1, got -1"):
        make_pathfinder(tmp_path, count=-1, progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, named", [
    (["train", "darcy-tiny", "--stop-after", "0"],
     "argument --stop-after: must be an integer >= 1, got 0"),
    (["train", "darcy-tiny", "--workers", "-5"],
     "argument --workers: must be an integer >= 0, got -5"),
    (["plot", "run", "--cases", "-1"], "argument --cases: must be an integer >= 0, got -1"),
    (["infer", "c.pt", "--data", "d", "--out", "o.npz", "--batch-size", "0"],
     "argument --batch-size: must be an integer >= 1, got 0"),
    (["eval", "c.pt", "--chunk-size", "0"],
     "argument --chunk-size: must be an integer >= 1, got 0"),
    (["generate", "c.pt", "--temperature", "nan"],
     "argument --temperature: must be a finite number >= 0, got 'nan'"),
    (["generate", "c.pt", "--max-new-tokens", "-1"],
     "argument --max-new-tokens: must be an integer >= 0, got -1"),
])
def test_out_of_range_options_are_usage_errors(capsys, argv, named):
    """`--stop-after 0` trained one epoch and reported "stopped after 0 epoch(s)";
    `--workers -5` meant automatic; `plot --cases -1` drew 2 cases (a negative slice);
    `infer --batch-size 0` said "range() arg 3 must not be zero"; `generate --temperature
    nan` was a traceback. Each is now exit 2 naming the option and the value."""
    assert named in usage_error(argv, capsys)


@pytest.mark.parametrize("item, named", [
    ("latent_schedule='4,8@50'", "the growth at epoch 50 never happens in a run of epochs=2"),
    ("loader_workers=-5", "loader_workers must be -1 (automatic) or a count >= 0, got -5"),
    ("keep_checkpoints=0", "keep_checkpoints must be at least 1"),
])
def test_config_values_that_would_be_ignored_are_refused(item, named):
    """`latent_schedule=4,8@50` with 2 epochs never grew and said nothing; `--set
    loader_workers=-5` meant automatic. Now the config names them."""
    from flarepp.train import get_preset
    with pytest.raises(ValueError) as err:
        get_preset("darcy-tiny", ["epochs=2", item])
    assert named in str(err.value) and "(with --set epochs, " in str(err.value)


@pytest.mark.parametrize("patches", [0, -2])
def test_rollout_patches_below_one_are_refused_before_any_work(patches):
    """`dataset_options.patches=0` was a ZeroDivisionError traceback and -2 failed later
    with a confusing message; now the config names the key and the value."""
    from flarepp.train import get_preset
    with pytest.raises(ValueError, match=f"dataset_options.patches must be at least 1 for "
                                         f"task rollout, got {patches}"):
        get_preset("rollout-tiny", [f"dataset_options.patches={patches}"])


# ---------------------------------------------------------------------------------------------
# checkpoints: corruption named as such, a full disk, retention

def test_random_bytes_are_called_corruption_not_code(tmp_path):
    """A checkpoint of random bytes was described as an attempt to run code (torch's
    weights-only loader refuses both alike); it is corruption, and now says so. A crafted
    pickle is still refused as code (tests/test_safety.py), a plain pickle named as such."""
    noise = tmp_path / "noise.pt"
    noise.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(noise)
    assert "noise.pt' is corrupt or not a checkpoint" in str(err.value)
    assert "arbitrary code" not in str(err.value)
    plain = tmp_path / "plain.pt"
    plain.write_bytes(pickle.dumps({"a": 1}, protocol=4))
    with pytest.raises(CheckpointError, match="plain.pt' is a pickle in a form torch's safe "
                                              "loader does not read"):
        read_checkpoint(plain)


@pytest.mark.slow
def test_a_full_disk_is_a_sentence_and_keeps_the_earlier_checkpoint(tmp_path):
    """Training onto a full disk ended in torch's raw RuntimeError ("unexpected pos ...").
    A real failed write (the file-size limit makes the kernel refuse it, as a full disk
    does): CheckpointError naming the file and the free space, no temporary left, the
    previous checkpoint intact."""
    folder = tmp_path / "checkpoints"
    save_checkpoint(folder / "epoch_0001.pt", {"w": torch.ones(4)})
    proc = _python(f"""
        import resource, signal, torch
        from flarepp.storage.checkpoint import CheckpointError, save_checkpoint
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
        try:
            save_checkpoint({str(folder / 'epoch_0002.pt')!r}, {{"w": torch.ones(100000)}})
        except CheckpointError as err:
            print(err)
    """, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "could not write checkpoint" in out and "epoch_0002.pt" in out
    assert "MiB free on its file system" in out and "--resume" in out
    assert sorted(p.name for p in folder.iterdir()) == ["epoch_0001.pt"]
    assert torch.equal(torch.load(folder / "epoch_0001.pt")["w"], torch.ones(4))


@pytest.mark.slow
def test_training_keeps_the_newest_k_checkpoints_and_the_best(tmp_path):
    """A run wrote a checkpoint every epoch and never deleted one (a tiny LRA run kept 200;
    a full disk follows on real runs). With keep_checkpoints=2 and a checkpoint per epoch,
    6 epochs leave the 2 newest plus the best by the recorded metric, and --resume still
    continues from the newest."""
    from flarepp.data.generators.darcy import make_darcy
    from flarepp.storage.checkpoint import checkpoints_newest_first
    from flarepp.train import get_preset, train
    make_darcy(tmp_path / "data", n_train=8, n_test=4, resolution=9, seed=3, progress=False)
    config = get_preset("darcy-tiny", TINY + ["epochs=6", "checkpoint_every=1",
                                              "keep_checkpoints=2", "lr=0.05"])
    out = tmp_path / "run"
    assert train(config, out, data_root=tmp_path / "data", progress=False,
                 stop_after=5) is None
    history = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    scores = {r["epoch"]: r["test_rel_l2"] for r in history}
    best = min(scores, key=lambda e: (scores[e], -e))
    kept = {p.name for p in checkpoints_newest_first(out)}
    assert kept == {"epoch_0005.pt", "epoch_0004.pt", f"epoch_{best:04d}.pt"}
    metrics = train(config, out, data_root=tmp_path / "data", progress=False, resume=True)
    assert metrics["epochs"] == 6
    assert len(checkpoints_newest_first(out)) <= 3
    assert (out / "checkpoints" / "epoch_0006.pt").is_file()


# ---------------------------------------------------------------------------------------------
# tracebacks that are now sentences

def test_infer_with_a_checkpoint_of_another_task_is_a_sentence(tmp_path, capsys):
    """`infer` with an lm, rollout or LRA checkpoint was `KeyError: 'x'` (their tasks store
    no input/output normalisers); now exit 1 naming the checkpoint, its task and the
    commands that take it."""
    from flarepp.train import get_preset
    checkpoint = tmp_path / "lm.pt"
    save_checkpoint(checkpoint, {"config": get_preset("lm-tiny").to_dict(),
                                 "model_config": {"arch": "causal-lm"}, "model": {},
                                 "ema": {}, "epoch": 1, "normalizers": {}})
    code = cli(["infer", str(checkpoint), "--data", str(tmp_path), "--out",
                str(tmp_path / "pred.npz")])
    err = capsys.readouterr().err
    assert code == 1
    assert "lm.pt' is a run of the 'lm' task" in err and "flarepp generate" in err


@pytest.mark.slow
def test_infer_with_a_dataset_of_another_task_is_a_sentence(darcy_run, tmp_path, capsys):
    """`infer --dataset advection-diffusion` with a fields checkpoint was an AttributeError
    (the rollout dataset has no x/y samples); now exit 2 naming the dataset."""
    from flarepp.data.generators import make_advection_diffusion
    _, _, checkpoint = darcy_run
    make_advection_diffusion(tmp_path / "ad", n_train=1, n_test=1, resolution=8,
                             progress=False)
    code = cli(["infer", str(checkpoint), "--data", str(tmp_path / "ad"), "--dataset",
                "advection-diffusion", "--out", str(tmp_path / "pred.npz")])
    err = capsys.readouterr().err
    assert code == 2
    assert "--dataset 'advection-diffusion' is not read as (x, y) samples" in err


@pytest.mark.parametrize("extra, named", [
    (["--hidden-on", "memmap"], "--hidden-on and --memmap-dir place a streamed mesh's hidden "
                                "state: they need --chunk-size"),
    (["--chunk-size", "8", "--memmap-dir", "absent"], "--memmap-dir absent: no such directory"),
])
def test_infer_hidden_state_options_are_checked_before_work(tmp_path, capsys, extra, named):
    """`infer --hidden-on memmap` without `--chunk-size` would run unchunked and ignore it;
    a missing `--memmap-dir` failed after the model had embedded every point. Both are exit 2
    naming the option, before any checkpoint is read."""
    code = cli(["infer", str(tmp_path / "c.pt"), "--data", str(tmp_path), "--out",
                str(tmp_path / "pred.npz"), *extra])
    assert code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "pred.npz").exists()


def test_data_make_beyond_memory_says_how_much_it_needs(tmp_path, capsys):
    """`data make darcy` at a resolution that cannot fit memory was numpy's
    `_ArrayMemoryError` traceback; now exit 1 saying how much one array needs and how much
    memory there is."""
    code = cli(["data", "make", "darcy", "--out", str(tmp_path / "d"), "--resolution",
                "10000000", "--train", "2", "--test", "1", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1
    assert "darcy at --resolution 10000000 needs an array of" in err
    assert "GiB is available; choose a smaller --resolution" in err


# ---------------------------------------------------------------------------------------------
# messages that mislead

@pytest.mark.parametrize("preset, hint", [
    ("drivaerml-tiny", "flarepp data make surface-flow --out"),
    ("lra-listops-tiny", "flarepp lra data make listops --out"),
    ("darcy-tiny", "flarepp data make darcy --out"),
])
def test_missing_data_hints_name_commands_that_exist(tmp_path, capsys, preset, hint):
    """The hint for missing data named `flarepp data make drivaerml` (and `listops`,
    `text-files`), generators that do not exist; now it names one that does, or says there
    is none."""
    code = cli(["train", preset, "--data", str(tmp_path / "absent"), "--out",
                str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and hint in err
    from flarepp.data.generators import how_to_get
    assert "has no generator for 'text-files'" in how_to_get("text-files", "data")


def test_json_decoding_errors_name_the_file(tmp_path, capsys):
    """A corrupt config.json or log.jsonl gave "Expecting value: line 2 column 1" with no
    file named, and exit 2 (a usage error); now exit 1 naming the file and line."""
    (tmp_path / "config.json").write_text('{"name": ')
    (tmp_path / "metrics.json").write_text("{}")
    assert cli(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'config.json'}: not valid JSON at line 1, column 10" in err
    from flarepp.io import UnreadableFile, read_json_lines
    log = tmp_path / "log.jsonl"
    log.write_text('{"epoch": 1}\n{"epoch": 2\n')
    with pytest.raises(UnreadableFile, match=r"log.jsonl: line 2 is not valid JSON"):
        read_json_lines(log)


def test_tsv_decoding_errors_name_the_file(tmp_path, capsys):
    """A ListOps TSV with a non-ASCII byte gave "'ascii' codec can't decode byte 0xff" with
    no file named; now exit 1 naming the file and the byte."""
    from flarepp.data.lra.listops import SPLIT_FILES
    for name in SPLIT_FILES.values():
        (tmp_path / name).write_bytes(b"Source\tTarget\n( [MAX 2 3 ] )\t3\n")
    (tmp_path / SPLIT_FILES["train"]).write_bytes(b"Source\tTarget\n( [MAX 2 \xff ] )\t3\n")
    assert cli(["lra", "data", "check", "listops", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / SPLIT_FILES['train']}: byte 23 (b'\\xff') is not ASCII" in err


# ---------------------------------------------------------------------------------------------
# surface files: corrupt connectivity, a stale cache

def _surface(tmp_path, faces=None):
    from test_drivaerml_data import CUBE_FACES, write_run, write_split
    root = tmp_path / "cars"
    path, pressure, _ = write_run(root, 3, faces=CUBE_FACES if faces is None else faces,
                                  seed=3, compressed=False)
    write_run(root, 4, seed=4)
    split = write_split(tmp_path / "split.json", train=[3], test=[4])
    return root, split, path, pressure


@pytest.mark.parametrize("index, named", [(-1, "cell 1 refers to point -1"),
                                          (99, "cell 1 refers to point 99")])
def test_vtp_vertex_index_outside_the_points_is_named(tmp_path, index, named):
    """A `.vtp` connectivity index of -1 wrapped to the last point (a wrong centre and
    normal, trained on without a word); one past the points was an IndexError traceback.
    Now a DataError naming the file, the cell and the index."""
    pytest.importorskip("vtkmodules")
    from flarepp.data import DataError
    from flarepp.data.drivaerml import DrivAerMLSurfaces
    from test_drivaerml_data import CUBE_FACES
    faces = [list(f) for f in CUBE_FACES]
    faces[1][2] = index
    root, split, path, _ = _surface(tmp_path, faces)
    with pytest.raises(DataError) as err:
        DrivAerMLSurfaces(root, split_file=split).load("run_3")
    assert str(path) in str(err.value) and named in str(err.value)


def test_vtp_cache_sees_an_edit_that_kept_size_and_time(tmp_path):
    """The `.vtp` cache was trusted on the source's size and modification time alone: an
    edited file with both restored was read from the stale cache. The cache now also keys
    on a hash of the header and sampled blocks (here, a small file: all of it)."""
    pytest.importorskip("vtkmodules")
    from flarepp.data.drivaerml import DrivAerMLSurfaces, SurfacePolygons, write_vtp
    from test_drivaerml_data import CUBE_FACES, CUBE_POINTS, cube_fields
    root, split, path, _ = _surface(tmp_path)
    pressure, shear = cube_fields(3)
    offsets = np.concatenate([[0], np.cumsum([len(f) for f in CUBE_FACES])])
    write_vtp(path, SurfacePolygons(CUBE_POINTS, offsets, np.concatenate(CUBE_FACES), {
        "pMeanTrim": pressure, "wallShearStressMeanTrim": shear}))   # raw appended data
    surfaces = DrivAerMLSurfaces(root, split_file=split)
    np.testing.assert_array_equal(surfaces.load("run_3").fields[:, 0], pressure)
    raw, stat = path.read_bytes(), path.stat()
    edited = (pressure * 2).astype(np.float32)
    assert raw.count(pressure.tobytes()) == 1
    path.write_bytes(raw.replace(pressure.tobytes(), edited.tobytes()))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    np.testing.assert_array_equal(surfaces.load("run_3").fields[:, 0], edited)


# ---------------------------------------------------------------------------------------------
# generate: streamed, bounded, stopped cleanly

def _lm_checkpoint(path: Path, mixer: str) -> Path:
    """An untrained byte-level causal LM of ``mixer`` saved as a run's checkpoint (what
    generation needs is the format, not good text)."""
    from flarepp.models import build_model
    from flarepp.train import get_preset
    model = build_model("causal-lm", mixer=mixer, dim=16, heads=2, blocks=1, latents=4)
    weights = model.state_dict()
    save_checkpoint(path, {"config": get_preset("lm-tiny").to_dict(),
                           "model_config": model.config.to_dict(), "model": weights,
                           "ema": weights, "epoch": 1, "normalizers": {}})
    return path


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, name", [(signal.SIGTERM, 143, "SIGTERM"),
                                             (signal.SIGINT, 130, "SIGINT")])
def test_generate_streams_and_stops_cleanly_on_a_signal(tmp_path, sig, code, name):
    """`generate --max-new-tokens 1000000000` printed nothing until it ended, grew memory
    without bound and lost everything on SIGTERM. Now every byte is written as it is
    sampled (the prompt and the first bytes arrive while it runs) and a signal ends it with
    its exit status, the bytes so far on stdout and their count on stderr."""
    checkpoint = _lm_checkpoint(tmp_path / "lm.pt", "flare-causal")
    proc = _python(f"""
        import sys
        from flarepp.cli import main
        sys.exit(main(["generate", {str(checkpoint)!r}, "--prompt", "hello",
                       "--max-new-tokens", "1000000000", "--device", "cpu"]))
    """)
    try:
        first = proc.stdout.read(64)        # blocks until 64 bytes were streamed
        assert first.startswith(b"hello")
        proc.send_signal(sig)
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = err.decode()
    assert proc.returncode == code, err
    assert "Traceback" not in err
    produced = int(err.split(f"stopped by {name} after ")[1].split(" of ")[0])
    assert produced >= 19                  # 59 bytes of text: at most 3 per sampled byte
    assert (first + rest).endswith(b"\n")


def test_generate_refuses_a_kv_cache_beyond_memory(tmp_path, capsys):
    """With causal attention, `--max-new-tokens 1000000000000` reserved a KV cache for
    every token up front (64 TB asked of the allocator); now a usage error saying how much
    it needs, how much is free and how many tokens fit. Causal FLARE's state has a fixed
    size, so only time bounds its request."""
    checkpoint = _lm_checkpoint(tmp_path / "attention.pt", "attention-causal")
    code = cli(["generate", str(checkpoint), "--max-new-tokens", str(10 ** 12), "--device",
                "cpu"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--max-new-tokens 1000000000000: attention-causal's KV cache" in err
    assert "GiB free on cpu; at most" in err and "new tokens fit" in err


def test_a_relative_split_file_is_never_taken_from_the_working_directory(tmp_path):
    """A surface-flow directory killed mid-generation (no `split.json`, which is written
    last) trained without complaint when a `split.json` sat in the working directory: a
    relative split file was looked for there too. Now only in the data directory, and its
    absence is a DataError saying the directory was not finished."""
    pytest.importorskip("vtkmodules")
    from flarepp.data import DataError, load_dataset
    root, split, _, _ = _surface(tmp_path)
    Path("split.json").write_text(split.read_text())     # the test's own working directory
    with pytest.raises(DataError) as err:
        load_dataset("drivaerml", root, split_file="split.json")
    assert f"'split.json' is missing from the data directory {str(root)!r}" in str(err.value)
    (root / "split.json").write_text(split.read_text())
    assert load_dataset("drivaerml", root, split_file="split.json").cars("train") == ["run_3"]
