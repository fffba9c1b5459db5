"""Every command a sentence, every output trustworthy (issue 20): the surfaces added since the
previous reliability round, tried with hostile input.

Each test reproduces one defect of the issue (named in its docstring) and fails on the
code before its fix: a silently wrong result, unbounded work, a traceback, or a message that
misleads. A sentence names the file, key or value; exit status 1 is a runtime error, 2 a
usage error.
"""

from __future__ import annotations

import json
import math
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

def _lm_checkpoint(path: Path, mixer: str, **config) -> Path:
    """An untrained byte-level causal LM of ``mixer`` saved as a run's checkpoint (what
    generation needs is the format, not good text); ``config`` replaces run-config keys."""
    from flarepp.models import build_model
    from flarepp.train import get_preset
    model = build_model("causal-lm", mixer=mixer, dim=16, heads=2, blocks=1, latents=4)
    weights = model.state_dict()
    save_checkpoint(path, {"config": {**get_preset("lm-tiny").to_dict(), **config},
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
    it needs, how much may still be allocated (and under which bound) and how many tokens
    fit. Causal FLARE's state has a fixed size, so only time bounds its request."""
    checkpoint = _lm_checkpoint(tmp_path / "attention.pt", "attention-causal")
    code = cli(["generate", str(checkpoint), "--max-new-tokens", str(10 ** 12), "--device",
                "cpu"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--max-new-tokens 1000000000000: attention-causal's KV cache" in err
    assert "GiB free memory" in err and "leaves on cpu; at most" in err
    assert "new tokens fit" in err


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


# =============================================================================================
# issue 34: memory-mapped state on a full disk, the config version, generate's limits,
# temperature and bytes, object and empty .npz data

def _full_filesystem(tmp_path: Path, size: str = "64k") -> Path:
    """A tmpfs of ``size`` mounted at ``tmp_path/full`` (a real full file system; root in a
    sandbox may mount one). Skips where mounting is refused: the RLIMIT_FSIZE case of the
    same test still runs. Unmount with :func:`_unmount`."""
    folder = tmp_path / "full"
    folder.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(folder)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"cannot mount a tmpfs here ({err})")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
    return folder


def _unmount(folder: Path) -> None:
    subprocess.run(["umount", str(folder)], check=True, timeout=30)


def _infer_child(checkpoint: Path, data: Path, out: Path, memmap_dir: Path, chunk: int,
                 fsize: int | None = None) -> subprocess.Popen:
    """`flarepp infer --chunk-size CHUNK --hidden-on memmap --memmap-dir DIR` in a child,
    under a file-size limit of ``fsize`` bytes when given."""
    limit = "" if fsize is None else (f"import resource; resource.setrlimit("
                                      f"resource.RLIMIT_FSIZE, ({fsize}, {fsize}))")
    return _python(f"""
        import sys
        {limit}
        from flarepp.cli import main
        sys.exit(main(["infer", {str(checkpoint)!r}, "--data", {str(data)!r}, "--out",
                       {str(out)!r}, "--chunk-size", "{chunk}", "--hidden-on", "memmap",
                       "--memmap-dir", {str(memmap_dir)!r}, "--device", "cpu"]))
    """)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["tmpfs", "RLIMIT_FSIZE"])
def test_memmap_hidden_state_on_a_full_disk_is_a_sentence(darcy_run, tmp_path, how):
    """`infer --hidden-on memmap --memmap-dir DIR` with DIR on a full file system died of
    SIGBUS (exit 135, no message) at the first page of its sparse state file that could not
    be stored, and left `flarepp-hidden-*/hidden.bin` behind. Now the file's space is
    reserved first: exit 1 naming DIR, the bytes needed and the bytes free (or the
    file-size limit), and nothing left in DIR. `tmpfs`: a real 64 KiB file system;
    `RLIMIT_FSIZE`: the kernel's file-size limit, which refuses the reservation alike."""
    _, _, checkpoint = darcy_run
    data = tmp_path / "mesh.npz"
    np.savez(data, x=np.random.default_rng(0).random((1, 100_000, 3), dtype=np.float32))
    need = 100_000 * 8 * 4                                # h [1, N, C=8] in float32
    folder = _full_filesystem(tmp_path) if how == "tmpfs" else tmp_path / "scratch"
    folder.mkdir(exist_ok=True)
    try:
        proc = _infer_child(checkpoint, data, tmp_path / "pred.npz", folder, 1000,
                            fsize=None if how == "tmpfs" else 65536)
        _, err = proc.communicate(timeout=300)
        left = os.listdir(folder)
    finally:
        if how == "tmpfs":
            _unmount(folder)
    err = err.decode()
    assert proc.returncode == 1, err
    assert "Traceback" not in err
    assert (f"flarepp infer: error: {folder}: no room for the hidden state [1, 100000, 8] "
            f"float32 as a memory-mapped file: it needs {need:,} bytes") in err
    assert ("its file system has 65,536 bytes (0.1 MiB) free" if how == "tmpfs" else
            "the file-size limit (ulimit -f) refuses a file that large") in err
    assert left == [] and not (tmp_path / "pred.npz").exists()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_memmap_inference_leaves_no_state_file(darcy_run, tmp_path, sig):
    """The memory-mapped hidden state was a file in `flarepp-hidden-*/` removed only when
    `infer` ended by itself: SIGKILL (and SIGBUS) left it, gigabytes on a real mesh. Now the
    file is deleted as soon as it is mapped, so a kill while the state is in use, SIGKILL
    included, leaves nothing (the kernel frees the space with the mapping)."""
    _, _, checkpoint = darcy_run
    data = tmp_path / "mesh.npz"
    np.savez(data, x=np.random.default_rng(0).random((1, 300_000, 3), dtype=np.float32))
    folder = tmp_path / "scratch"
    folder.mkdir()
    proc = _infer_child(checkpoint, data, tmp_path / "pred.npz", folder, 200)
    seen = b""
    try:
        while b"hidden state: memmap" not in seen:   # the progress bar, once h is allocated
            chunk = os.read(proc.stderr.fileno(), 4096)
            assert chunk, f"infer ended before its state was allocated: {seen.decode()}"
            seen += chunk
        proc.send_signal(sig)
        proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 143)
    assert os.listdir(folder) == []


@pytest.mark.parametrize("fallocate", ["unsupported", "absent"])
def test_memmap_state_without_fallocate_checks_the_free_space(tmp_path, monkeypatch,
                                                              fallocate):
    """Where the file system (EOPNOTSUPP) or the platform (macOS: no os.posix_fallocate)
    offers no fallocate, the free space is compared with the state's size before the file
    is extended: too little is the same sentence, enough gives a mapped array of the asked
    size, already deleted from the directory."""
    import errno

    import flarepp.distributed.streaming as streaming

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    if fallocate == "absent":
        monkeypatch.delattr(os, "posix_fallocate")
    else:
        monkeypatch.setattr(os, "posix_fallocate", unsupported)
    free = 10_000
    monkeypatch.setattr(streaming.shutil, "disk_usage",
                        lambda path: type("usage", (), {"free": free})())
    with pytest.raises(OSError) as err:
        streaming.memmap_scratch(tmp_path, 20_000, "the hidden state")
    assert str(err.value) == (f"[Errno 28] no room for the hidden state as a memory-mapped "
                              f"file: it needs 20,000 bytes (0.0 MiB) and its file system "
                              f"has 10,000 bytes (0.0 MiB) free; free space there or give "
                              f"another directory (--memmap-dir): '{tmp_path}'")
    assert os.listdir(tmp_path) == []
    free = 1 << 40
    array = streaming.memmap_scratch(tmp_path, 20_000, "the hidden state")
    array[:] = 7
    assert array.shape == (20_000,) and int(array.sum()) == 140_000
    assert os.listdir(tmp_path) == []


def test_memmap_state_over_a_disk_quota_is_a_sentence(tmp_path, monkeypatch):
    """A quota (EDQUOT from fallocate) is named as such, with the directory and the bytes
    needed, and leaves no file."""
    import errno

    from flarepp.distributed.streaming import memmap_scratch

    def over_quota(fd, offset, length):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(os, "posix_fallocate", over_quota)
    with pytest.raises(OSError, match=r"no room for the hidden state as a memory-mapped "
                                      r"file: it needs 4,096 bytes \(0.0 MiB\) and a disk "
                                      r"quota refuses it") as err:
        memmap_scratch(tmp_path, 4096, "the hidden state")
    assert err.value.filename == str(tmp_path) and os.listdir(tmp_path) == []


def test_memmap_scratch_left_by_a_dead_process_is_removed(tmp_path):
    """A SIGKILL between the state file's creation and its mapping (while its space is
    reserved) can leave `flarepp-hidden-<host>-<pid>-*.bin`. The next memory-mapped state
    in that directory removes such files of this host whose process is gone, and keeps a
    running process's and another host's (which cannot be told from here)."""
    import socket

    from flarepp.distributed.streaming import memmap_scratch
    host, gone = socket.gethostname(), 4_194_305       # above the kernel's largest pid
    names = [f"flarepp-hidden-{host}-{gone}-abc_1.bin", f"flarepp-hidden-{host}-"
             f"{os.getpid()}-def2.bin", f"flarepp-hidden-elsewhere-{gone}-ghi3.bin",
             "unrelated.bin"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    memmap_scratch(tmp_path, 16, "a test array")
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])


@pytest.mark.parametrize("version, named", [
    (99, "key 'config_version': written by a newer flarepp (version 99 > {v}, the newest "
         "this flarepp reads); upgrade flarepp to use it"),
    ("next", "key 'config_version': written by a newer flarepp (version {n} > {v}"),
    (0, "key 'config_version' must be an integer >= 1 (the config format version flarepp "
        "writes, {v} today), got 0"),
    (-1, "key 'config_version' must be an integer >= 1 (the config format version flarepp "
         "writes, {v} today), got -1"),
    ("x", "key 'config_version' must be an integer >= 1 (the config format version "
          "flarepp writes, {v} today), got 'x'"),
    (True, "must be an integer >= 1 (the config format version flarepp writes, {v} today), "
           "got True"),
    (4.0, "must be an integer >= 1 (the config format version flarepp writes, {v} today), "
          "got 4.0"),
])
def test_config_versions_no_flarepp_wrote_or_a_newer_one_wrote_are_refused(version, named):
    """`config_version` was never checked: 99, 0 and -1 were read with today's meaning (a
    newer flarepp's config trained as if this one had written it) and "x" was a TypeError
    in `from_stored`. Both readers now refuse them, naming the key; a config without a
    version (stored before versions existed) still reads with the legacy protocol."""
    from flarepp.storage.config import CONFIG_VERSION, LEGACY_PROTOCOL, VERSION_KEY, RunConfig
    from flarepp.train import get_preset
    stored = get_preset("darcy-tiny").to_file()
    stored[VERSION_KEY] = CONFIG_VERSION + 1 if version == "next" else version
    named = named.format(v=CONFIG_VERSION, n=CONFIG_VERSION + 1)
    for read in (RunConfig.from_stored, RunConfig.from_dict):
        with pytest.raises(ValueError) as err:
            read(stored)
        assert str(err.value) == named or named in str(err.value)
    stored[VERSION_KEY] = CONFIG_VERSION
    assert RunConfig.from_stored(stored) == RunConfig.from_dict(stored) == \
        get_preset("darcy-tiny")
    del stored[VERSION_KEY]
    stored["protocol"] = {k: v for k, v in stored["protocol"].items()
                          if k not in LEGACY_PROTOCOL}
    legacy = RunConfig.from_stored(stored)
    assert {k: getattr(legacy, k) for k in LEGACY_PROTOCOL} == LEGACY_PROTOCOL


def test_a_newer_config_version_names_the_file(tmp_path, capsys):
    """Each command that reads a stored config names the file: `train --config FILE`
    (a user's file and a run directory's own, exit 2), and `generate`, `eval` and `infer`
    of a checkpoint whose run config is a newer flarepp's (exit 1, like any checkpoint this
    flarepp cannot read)."""
    from flarepp.storage.config import CONFIG_VERSION, VERSION_KEY
    from flarepp.train import get_preset
    newer = f"written by a newer flarepp (version 99 > {CONFIG_VERSION}"
    config = get_preset("darcy-tiny").to_file()
    config[VERSION_KEY] = 99
    for folder in (tmp_path / "mine", tmp_path / "run"):
        (folder / "checkpoints").mkdir(parents=True) if folder.name == "run" else \
            folder.mkdir()
        path = folder / "config.json"
        path.write_text(json.dumps(config))
        assert cli(["train", "--config", str(path), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert f"flarepp train: error: --config {str(path)!r}: key 'config_version': " \
               f"{newer}" in err
    checkpoint = _lm_checkpoint(tmp_path / "lm.pt", "flare-causal", config_version=99)
    for argv in (["generate"], ["eval", "--data", str(tmp_path)],
                 ["infer", "--data", str(tmp_path), "--out", str(tmp_path / "out.npz")]):
        assert cli([*argv, str(checkpoint), "--device", "cpu"]) == 1
        err = capsys.readouterr().err
        assert (f"flarepp {argv[0]}: error: checkpoint {str(checkpoint)!r}: its run config's "
                f"key 'config_version': {newer}") in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.npz").exists()


@pytest.mark.slow
def test_resume_from_a_newer_flarepps_checkpoint_names_it(darcy_run, tmp_path, capsys):
    """`train --resume` read a checkpoint whose run config a newer flarepp wrote as if this
    one had: now no checkpoint reads, and the sentence names the file and the version."""
    import shutil
    data, run, _ = darcy_run
    shutil.copytree(run, tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoints" / "epoch_0002.pt"
    state = torch.load(checkpoint, weights_only=True)
    state["config"]["config_version"] = 99
    torch.save(state, checkpoint)
    assert cli(["train", "--config", str(tmp_path / "run" / "config.json"), "--out",
                str(tmp_path / "run"), "--resume", "--data", str(data)]) == 1
    err = capsys.readouterr().err
    assert (f"flarepp train: error: --resume: no checkpoint reads: checkpoint "
            f"{str(checkpoint)!r}: its run config's key 'config_version': written by a newer "
            f"flarepp (version 99 > ") in err


def test_sampling_probabilities_match_an_explicit_softmax():
    """`generate --temperature 5e-324` passed "finite and >= 0", then logits / 5e-324
    overflowed to inf and torch.multinomial raised on NaN probabilities. Sampling now
    shifts the logits by their maximum first: at ordinary temperatures the probabilities
    are softmax(logits / T) in float64 (the explicit reference), at any T too small for
    logits / T to be finite the most likely byte has probability 1 (the limit, greedy), and
    at a huge T the top-k bytes are equally likely."""
    from flarepp.models.causal_lm import _sample, sampling_probabilities
    g = torch.Generator().manual_seed(0)
    logits = 10 * torch.randn(3, 256, generator=g)
    for top_k in (None, 5):
        keep = torch.ones_like(logits, dtype=torch.bool) if top_k is None else \
            logits >= logits.topk(top_k, dim=-1).values[:, -1:]
        for t in (0.3, 1.0, 2.5):
            scaled = torch.where(keep, logits.double() / t, -math.inf)
            want = scaled.exp() / scaled.exp().sum(-1, keepdim=True)
            got = sampling_probabilities(logits, t, top_k)
            assert got.dtype == torch.float64
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
        for t in (5e-324, 1e-300, 1e-38):
            assert torch.isinf(logits / t).any() or t == 1e-38
            greedy = torch.nn.functional.one_hot(logits.argmax(-1), 256).double()
            assert torch.equal(sampling_probabilities(logits, t, top_k), greedy)
            assert torch.equal(_sample(logits, t, top_k, g), logits.argmax(-1))
        uniform = keep.double() / keep.sum(-1, keepdim=True)
        torch.testing.assert_close(sampling_probabilities(logits, 1e308, top_k), uniform)


def _sampled_bytes(checkpoint: Path, prompt: bytes, n: int, temperature: float) -> bytes:
    """The library's own continuation of ``prompt`` (what `generate` must write)."""
    from flarepp.models.causal_lm import generate
    from flarepp.storage.checkpoint import load_causal_lm
    model = load_causal_lm(checkpoint, device=torch.device("cpu"))
    ids = generate(model, torch.tensor([list(prompt)]), n, temperature=temperature,
                   generator=torch.Generator().manual_seed(0))
    return bytes(ids[0].tolist())


def test_generate_writes_the_sampled_bytes_themselves(tmp_path, capsysbinary):
    """`generate` wrote a UTF-8 decoding of the sampled bytes with errors replaced (29,866 of
    72,312 bytes became U+FFFD) while stderr said "all written". Now stdout is the prompt
    and the sampled bytes exactly, then a newline. An untrained byte model samples
    invalid UTF-8 on almost every step, so the comparison sees any decoding."""
    checkpoint = _lm_checkpoint(tmp_path / "lm.pt", "flare-causal")
    assert cli(["generate", str(checkpoint), "--prompt", "héllo", "--max-new-tokens", "300",
                "--device", "cpu"]) == 0
    out = capsysbinary.readouterr().out
    want = _sampled_bytes(checkpoint, "héllo".encode(), 300, 0.8)
    assert out == want + b"\n"
    with pytest.raises(UnicodeDecodeError):
        want.decode("utf-8")


def test_generate_with_a_tiny_temperature_is_greedy(tmp_path, capsysbinary):
    """`generate --temperature 5e-324` ended in a RuntimeError traceback ("probability
    tensor contains either inf, nan or element < 0"); now it writes what --temperature 0
    (greedy) writes."""
    checkpoint = _lm_checkpoint(tmp_path / "lm.pt", "flare-causal")
    outputs = []
    for t in ("5e-324", "0"):
        assert cli(["generate", str(checkpoint), "--max-new-tokens", "40", "--temperature",
                    t, "--device", "cpu"]) == 0
        outputs.append(capsysbinary.readouterr().out)
    assert outputs[0] == outputs[1] == _sampled_bytes(checkpoint, b"def ", 40, 0) + b"\n"


@pytest.mark.slow
def test_generate_with_an_ascii_stdout_writes_its_bytes(tmp_path):
    """With `PYTHONIOENCODING=ascii`, `generate` exited 2 with "'ascii' codec can't encode
    character '\\ufffd'"; the bytes themselves need no encoding: exit 0, every byte."""
    checkpoint = _lm_checkpoint(tmp_path / "lm.pt", "flare-causal")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "ascii"}
    proc = subprocess.run([sys.executable, "-m", "flarepp", "generate", str(checkpoint),
                           "--max-new-tokens", "200", "--device", "cpu"],
                          capture_output=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout == _sampled_bytes(checkpoint, b"def ", 200, 0.8) + b"\n"
    assert max(proc.stdout) >= 128


def _generate_under_a_limit(tmp_path: Path, limit: str, cap: int, then: str = ""
                            ) -> tuple[int, str]:
    """Exit status and stderr of `generate` asking causal attention for 10^8 new tokens
    (a 12 GiB KV cache) in a child under ``resource.<limit>`` of ``cap`` bytes; ``then``
    runs after the limit is set."""
    checkpoint = _lm_checkpoint(tmp_path / "attention.pt", "attention-causal")
    proc = _python(f"""
        import resource, sys
        resource.setrlimit(resource.{limit}, ({cap}, {cap}))
        {then}
        from flarepp.cli import main
        sys.exit(main(["generate", {str(checkpoint)!r}, "--max-new-tokens", "100000000",
                       "--device", "cpu"]))
    """)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err.decode()


@pytest.mark.slow
@pytest.mark.parametrize("limit, named", [("RLIMIT_AS", "the address-space limit"),
                                          ("RLIMIT_DATA", "the data limit")])
def test_generate_reads_the_process_memory_limits(tmp_path, limit, named):
    """Under an address-space (or data) limit, causal attention's KV cache check read free
    memory only: a cache that fit `MemAvailable` but not the limit ended in the allocator's
    RuntimeError traceback. Now the tightest bound is named with how many tokens fit."""
    cap = 3 * 2**30
    code, err = _generate_under_a_limit(tmp_path, limit, cap)
    assert code == 2, err
    assert "Traceback" not in err
    assert (f"attention-causal's KV cache for 100000004 tokens needs 12.0 GiB, more than "
            f"the") in err
    assert f"GiB {named} ({limit} {cap}) leaves on cpu; at most " in err
    fits = int(err.split("at most ")[1].split()[0])
    assert 0 < fits * 129 < cap                           # 129 bytes per token here


@pytest.mark.slow
def test_generate_turns_a_failed_allocation_into_a_sentence(tmp_path):
    """Should the decoding state still not fit (other allocations than the cache), the
    allocator's RuntimeError was a traceback; now it is an out-of-memory sentence naming the
    tokens and the device. (Here the bounds are made to report plenty under a real
    address-space limit, so the allocation itself fails.)"""
    code, err = _generate_under_a_limit(tmp_path, "RLIMIT_AS", 3 * 2**30, then=(
        "import flarepp.device; "
        "flarepp.device.memory_bounds = lambda device: {'plenty': 2**50}"))
    assert code == 1, err
    assert "Traceback" not in err
    assert ("flarepp generate: error: out of memory: the decoding state for 100000004 "
            "tokens could not be allocated on cpu") in err


def _cgroup_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_cgroup_memory_limits_are_read_up_the_hierarchy(tmp_path):
    """The tightest cgroup limit on the process, v2 and v1, is its limit less its usage net
    of inactive file pages, taken over its cgroup and every ancestor (a parent's limit bounds
    the child); an unlimited cgroup (v2 `max`, v1's LONG_MAX) bounds nothing."""
    from flarepp.device import cgroup_memory_bound
    gib = 2**30
    v2 = _cgroup_tree(tmp_path / "v2", {
        "user.slice/memory.max": f"{4 * gib}\n", "user.slice/memory.current": f"{3 * gib}\n",
        "user.slice/memory.stat": f"anon 1\ninactive_file {gib // 2}\n",
        "user.slice/job/memory.max": "max\n", "user.slice/job/memory.current": "5\n"})
    assert cgroup_memory_bound(v2, "0::/user.slice/job\n") == (
        f"the cgroup memory limit ({v2 / 'user.slice' / 'memory.max'})", gib + gib // 2)
    _cgroup_tree(v2, {"user.slice/job/memory.max": f"{gib}\n",
                      "user.slice/job/memory.current": f"{gib // 4}\n"})
    assert cgroup_memory_bound(v2, "0::/user.slice/job\n")[1] == 3 * gib // 4
    v1 = _cgroup_tree(tmp_path / "v1", {
        "memory/docker/abc/memory.limit_in_bytes": f"{2 * gib}\n",
        "memory/docker/abc/memory.usage_in_bytes": f"{3 * gib // 2}\n",
        "memory/docker/abc/memory.stat": f"inactive_file 1\ntotal_inactive_file {gib // 2}\n",
        "memory/docker/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/docker/memory.usage_in_bytes": "7\n"})
    membership = "9:name=systemd:/\n4:memory:/docker/abc\n0::/\n"
    assert cgroup_memory_bound(v1, membership) == (
        f"the cgroup memory limit ({v1 / 'memory/docker/abc/memory.limit_in_bytes'})", gib)
    assert cgroup_memory_bound(tmp_path / "v1" / "memory", "4:cpu:/x\n") is None
    _cgroup_tree(v1, {"memory/docker/abc/memory.limit_in_bytes": "9223372036854771712\n"})
    assert cgroup_memory_bound(v1, membership) is None


def test_generate_names_a_cgroup_limit_and_the_tokens_that_fit(tmp_path, capsys,
                                                              monkeypatch):
    """A cgroup limit below the free memory bounded nothing: the KV cache check read
    `MemAvailable` only. Here /proc and the cgroup mount are fake files (a 512 MiB limit
    with 256 MiB used, 64 GiB free): refused naming the limit file and exactly how many
    tokens fit in what it leaves."""
    import flarepp.device as device
    gib = 2**30
    proc = _cgroup_tree(tmp_path / "proc", {
        "meminfo": f"MemTotal: {128 * gib // 1024} kB\nMemAvailable: {64 * gib // 1024} kB\n",
        "self/status": "VmSize: 1000 kB\n", "self/cgroup": "0::/job\n"})
    cgroups = _cgroup_tree(tmp_path / "cgroup", {"job/memory.max": f"{gib // 2}\n",
                                                 "job/memory.current": f"{gib // 4}\n"})
    real = device.memory_bounds
    monkeypatch.setattr(device, "memory_bounds", lambda d: real(d, cgroup_root=cgroups,
                                                                proc=proc))
    checkpoint = _lm_checkpoint(tmp_path / "attention.pt", "attention-causal")
    code = cli(["generate", str(checkpoint), "--prompt", "hi", "--max-new-tokens",
                str(10**8), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2
    assert (f"more than the 0.2 GiB the cgroup memory limit ({cgroups / 'job' / 'memory.max'})"
            f" leaves on cpu; at most {gib // 4 // 129 - 2} new tokens fit") in err


class _CreatesAFile:
    """An object whose unpickling creates ``target`` (what a crafted object array does)."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (str(self.target), "w"))


def _npz_without_data(tmp_path: Path, case: str) -> tuple[Path, str]:
    """An `.npz` of the given kind and the sentence flarepp says about it."""
    path = tmp_path / f"{case}.npz"
    if case == "objects":
        np.savez(path, x=np.array([_CreatesAFile(tmp_path / "PWNED"), 1], dtype=object))
        return path, f"{path}: key 'x' holds Python objects (an object array), which are " \
                     "not read (unpickling them could run code)"
    if case == "no arrays":
        np.savez(path)
        return path, f"{path}: the archive holds no arrays"
    if case == "no samples":
        np.savez(path, x=np.zeros((0, 81, 3), np.float32))
        return path, f"{path}: key 'x' is empty (shape [0, 81, 3]): every sample, point " \
                     "and channel count must be at least 1"
    np.savez(path, x=np.zeros((2, 0, 3), np.float32))          # no points
    return path, f"{path}: key 'x' is empty (shape [2, 0, 3])"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["objects", "no arrays", "no samples", "no points"])
def test_infer_names_an_npz_of_objects_or_of_nothing(darcy_run, tmp_path, capsys, case):
    """`infer --data x.npz` read an inputs-only file with numpy directly: an object array
    gave numpy's "Object arrays cannot be loaded when allow_pickle=False", 0 samples "need
    at least one array to concatenate", and 0 points wrote predictions of nothing with exit
    0. Now the file and key are named (exit 1), no output is written, and the object array
    is never unpickled."""
    _, _, checkpoint = darcy_run
    path, said = _npz_without_data(tmp_path, case)
    code = cli(["infer", str(checkpoint), "--data", str(path), "--out",
                str(tmp_path / "pred.npz")])
    err = capsys.readouterr().err
    assert code == 1 and f"flarepp infer: error: {said}" in err, err
    assert not (tmp_path / "pred.npz").exists() and not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("case", ["objects", "no arrays", "no samples", "no points"])
def test_data_commands_name_an_npz_of_objects_or_of_nothing(tmp_path, capsys, case):
    """`data check npz` and `train --data` on an object array said "the file is truncated
    or corrupt (DataError: ... holds Python objects ...)", calling a well-formed file
    corrupt; an archive without arrays, or with an array of no samples or points, was told
    only by later checks or not at all. Each is now one sentence naming the file and key,
    exit 1, and the object array is never unpickled."""
    path, said = _npz_without_data(tmp_path, case)
    assert cli(["data", "check", "npz", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"flarepp data: error: {said}" in err and "corrupt" not in err, err
    assert cli(["train", "--data", str(path), "--out", str(tmp_path / "run"), "--set",
                "device=cpu"]) == 1
    err = capsys.readouterr().err
    assert f"flarepp train: error: {said}" in err and "corrupt" not in err, err
    assert not (tmp_path / "PWNED").exists()
