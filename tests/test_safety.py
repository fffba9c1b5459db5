"""Nothing lost, nothing executed, every error a sentence (issue 10, library side).

Atomic durable writes, checkpoints read with ``weights_only=True``, falling back to the newest
readable checkpoint, stale temporaries, the run-directory lock (with real second processes
and a SIGKILLed holder), the data fingerprint, and the data loaders' messages for broken
files. Each test's docstring names the defect it reproduces.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from flarepp.data import DataError, MeshSamples, Normalizer, load_dataset
from flarepp.io import atomic_write_json, is_temporary
from flarepp.data.fingerprint import DataMismatch, check_same_data, data_fingerprint
from flarepp.storage.checkpoint import (CheckpointError, atomic_write, newest_readable_checkpoint,
                                        read_checkpoint, remove_stale_temporaries,
                                        save_checkpoint)
from flarepp.storage.rundir import RunLock, RunLocked

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _python(code: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _wait_for_line(proc: subprocess.Popen, expected: str) -> None:
    line = proc.stdout.readline().strip()
    if line != expected:
        proc.kill()
        raise AssertionError(f"helper process said {line!r}, stderr: {proc.stderr.read()}")


def _minimal_state(epoch: int) -> dict:
    return {"config": {"name": "t"}, "model_config": {"arch": "surrogate"},
            "model": {"w": torch.ones(2)}, "ema": {"w": torch.ones(2)}, "epoch": epoch,
            "normalizers": {"x": {"mean": [0.0], "std": [1.0]}}}


# ---------------------------------------------------------------------------------------------
# one atomic writer, with fsync

def test_atomic_write_gives_umask_permissions_like_any_new_file(tmp_path):
    """A checkpoint or JSON written atomically gets the mode ``open(path, "w")`` would give
    (0666 filtered by the umask), and a replaced file keeps its mode. Fails before the
    change: tempfile.mkstemp made every atomically written file 0600 while PNGs were 0644."""
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "a.pt", lambda tmp: torch.save({"w": torch.ones(1)}, tmp))
        (tmp_path / "plain.txt").write_text("x")
        target = tmp_path / "keep.json"
        target.write_text("{}")
        target.chmod(0o640)
        atomic_write_json(target, {"a": 1})
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "a.pt").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == 0o644
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "keep.json", "plain.txt"]


def test_atomic_write_syncs_the_file_and_its_directory(tmp_path, monkeypatch):
    """The temporary's data and the rename are made durable: os.fsync is called on the file
    and on the directory. Fails before the change: the checkpoint writer never fsynced (a
    power loss could leave an empty checkpoint under its final name)."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    atomic_write(tmp_path / "log.jsonl", lambda tmp: Path(tmp).write_text("{}\n"))
    assert synced == ["file", "dir"]


@pytest.mark.slow
def test_stale_temporaries_of_a_killed_write_are_removed(tmp_path):
    """A process SIGKILLed while writing a checkpoint leaves ``.epoch_0002.pt.<tag>.tmp``;
    remove_stale_temporaries deletes it (and the mkstemp-named leftovers of older versions)
    and nothing else. Fails before the change: no function removed them, and the directory
    was stuck between "already holds a run" and "no checkpoint"."""
    out = tmp_path / "run"
    writer = _python(f"""
        import time
        from pathlib import Path
        from flarepp.io import atomic_write
        def slow(tmp):
            Path(tmp).write_bytes(b"half a checkpoint")
            print("writing", flush=True)
            time.sleep(60)
        atomic_write(Path({str(out)!r}) / "checkpoints" / "epoch_0002.pt", slow)
    """)
    _wait_for_line(writer, "writing")
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    (out / "checkpoints" / ".epoch_0001.pt.k2j_x9ab.tmp").write_bytes(b"older version")
    (out / "log.jsonl").write_text("{}\n")
    (out / "notes.tmp").write_text("a user's file")
    left = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(left) == 2 and all(is_temporary(name) for name in left)
    removed = remove_stale_temporaries(out)
    assert sorted(p.name for p in removed) == left
    assert list((out / "checkpoints").iterdir()) == []
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "log.jsonl", "notes.tmp"]


# ---------------------------------------------------------------------------------------------
# checkpoints: weights_only=True, refusal of code, fallback to the newest readable one

class _CreatesAFile:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (str(self.target), "w"))


@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_a_crafted_pickle_is_refused_and_runs_nothing(tmp_path, writer):
    """A ``.pt`` whose unpickling would create a file is refused with a CheckpointError
    sentence and the file never appears. Fails before the change: read_checkpoint used
    weights_only=False and created the file."""
    evil, target = tmp_path / "evil.pt", tmp_path / "PWNED"
    payload = {"format_version": 1, "hook": _CreatesAFile(target)}
    if writer == "pickle":
        evil.write_bytes(pickle.dumps(payload))
    else:
        torch.save(payload, evil)
    with pytest.raises(CheckpointError, match=r"evil\.pt' was refused: .*could run arbitrary"):
        read_checkpoint(evil)
    assert not target.exists()


@pytest.mark.slow
def test_flarepp_eval_refuses_a_crafted_pickle(tmp_path):
    """``flarepp eval evil.pt`` exits non-zero with the refusal and creates nothing (the
    issue's check). Fails before the change: the pickle ran."""
    evil, target = tmp_path / "evil.pt", tmp_path / "PWNED"
    torch.save({"format_version": 1, "hook": _CreatesAFile(target)}, evil)
    proc = _python(f"""
        import sys
        from flarepp.cli import main
        sys.exit(main(["eval", {str(evil)!r}, "--data", {str(tmp_path)!r}]))
    """)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "refused" in err and "Traceback" not in err, err
    assert not target.exists()


def test_own_checkpoints_load_with_weights_only(tmp_path):
    """Everything save_checkpoint writes reads back with torch.load(weights_only=True):
    numpy scalars and arrays become Python numbers and tensors, paths strings, tuples,
    torch.Size, dtypes and devices stay. Fails before the change: a numpy float in the
    history (what np.mean returns) made the checkpoint unreadable without pickle."""
    state = _minimal_state(3)
    state["history"] = [{"epoch": 1, "test_rel_l2": np.float64(0.25), "n": np.int64(4)}]
    state["extra"] = {"mean": np.arange(3, dtype=np.float32), "path": tmp_path,
                      "betas": (0.9, 0.999), "size": torch.Size([2, 3]),
                      "dtype": torch.bfloat16, "device": torch.device("cpu")}
    path = tmp_path / "checkpoints" / "epoch_0003.pt"
    save_checkpoint(path, state)
    raw = torch.load(path, weights_only=True)
    assert raw["history"][0] == {"epoch": 1, "test_rel_l2": 0.25, "n": 4}
    assert type(raw["history"][0]["test_rel_l2"]) is float
    assert torch.equal(raw["extra"]["mean"], torch.arange(3, dtype=torch.float32))
    assert raw["extra"]["path"] == str(tmp_path) and raw["extra"]["betas"] == (0.9, 0.999)
    assert raw["extra"]["size"] == torch.Size([2, 3])
    assert read_checkpoint(path)["epoch"] == 3


def test_save_checkpoint_refuses_objects_it_could_not_read_back(tmp_path):
    """An object outside plain data is named by its key at save time instead of making an
    unreadable checkpoint. Fails before the change: it was pickled silently."""
    state = _minimal_state(1)
    state["history"] = [{"epoch": 1, "callback": object()}]
    with pytest.raises(CheckpointError, match=r"state\.history\[0\]\.callback holds a "
                                              r"builtins\.object"):
        save_checkpoint(tmp_path / "epoch_0001.pt", state)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_trained_run_checkpoint_reads_with_weights_only(tmp_path):
    """A real run's checkpoint (config dicts, optimizer, scheduler, scaler, EMA, both RNG
    states, history, normalizers) loads with weights_only=True and rebuilds the model.
    A failure points to a state entry that is not plain data."""
    from flarepp.data.generators.darcy import make_darcy
    from flarepp.train import get_preset, latest_checkpoint, load_trained_model, train
    make_darcy(tmp_path / "darcy", n_train=4, n_test=2, resolution=8, seed=1, progress=False)
    config = get_preset("darcy-tiny", [
        "epochs=1", "checkpoint_every=1", "batch_size=2",
        "dataset_options={'resolution': 8, 'n_train': 4, 'n_test': 2}", "model.dim=8",
        "model.heads=2", "model.blocks=1", "model.latents=2"])
    train(config, tmp_path / "run", data_root=tmp_path / "darcy", progress=False)
    path = latest_checkpoint(tmp_path / "run")
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert {"optimizer", "scheduler", "rng", "history", "normalizers"} <= set(state)
    assert load_trained_model(path).epoch == 1


def test_resume_falls_back_to_the_newest_readable_checkpoint(tmp_path):
    """With the latest checkpoint truncated and an empty one beside it, the newest readable
    checkpoint is found and each skipped one is reported with its reason. Fails before the
    change: a truncated latest checkpoint stopped --resume without offering the previous."""
    for epoch in (5, 10, 15, 20):
        save_checkpoint(tmp_path / "checkpoints" / f"epoch_{epoch:04d}.pt",
                        _minimal_state(epoch))
    latest = tmp_path / "checkpoints" / "epoch_0020.pt"
    latest.write_bytes(latest.read_bytes()[:300])
    (tmp_path / "checkpoints" / "epoch_0015.pt").write_bytes(b"")
    (tmp_path / "checkpoints" / "epoch_0100.pt.bak").write_bytes(b"not a checkpoint name")
    found = newest_readable_checkpoint(tmp_path)
    assert found.path == tmp_path / "checkpoints" / "epoch_0010.pt"
    assert found.state["epoch"] == 10
    assert [p.name for p, _ in found.unreadable] == ["epoch_0020.pt", "epoch_0015.pt"]
    assert "corrupt" in found.unreadable[0][1] and "is empty" in found.unreadable[1][1]
    assert "resuming from the newest readable one" in found.message()
    assert "epoch_0010.pt" in found.message()
    nothing = newest_readable_checkpoint(tmp_path / "no-run")
    assert nothing.path is None and nothing.unreadable == [] and nothing.message() == ""


# ---------------------------------------------------------------------------------------------
# the run-directory lock

_HOLD_LOCK = """
    import sys
    from flarepp.storage.rundir import RunLock
    with RunLock({out!r}):
        print("locked", flush=True)
        sys.stdin.readline()  # hold until the test closes stdin
"""


@pytest.mark.slow
def test_a_second_process_cannot_take_a_held_run_lock(tmp_path):
    """While one process holds the run directory, another gets RunLocked naming the holder's
    pid, host and command; once it exits the lock is free and its file gone. Fails before
    the change: two trainers wrote into one --out and both exited 0."""
    out = tmp_path / "run"
    holder = _python(_HOLD_LOCK.format(out=str(out)), stdin=subprocess.PIPE)
    try:
        _wait_for_line(holder, "locked")
        with pytest.raises(RunLocked) as err:
            RunLock(out).acquire()
        message = str(err.value)
        assert f"process {holder.pid} on host {socket.gethostname()!r}" in message
        assert "sys.stdin.readline()" in message and "choose another --out" in message
        second = _python(f"""
            from flarepp.storage.rundir import RunLock, RunLocked
            try:
                RunLock({str(out)!r}).acquire()
            except RunLocked as err:
                print("refused", err)
        """)
        said, _ = second.communicate(timeout=60)
        assert said.startswith("refused") and f"process {holder.pid}" in said
    finally:
        holder.stdin.close()  # the holder leaves its `with` block and exits normally
        assert holder.wait(timeout=60) == 0
    with RunLock(out) as lock:
        assert lock.held and lock.stale is None  # released cleanly: nothing stale
    assert not (out / ".lock").exists()


@pytest.mark.slow
def test_a_sigkilled_holder_never_blocks(tmp_path):
    """A holder killed with SIGKILL cannot clean up, but the kernel releases its flock: the
    next run takes the lock at once and learns which run died holding it. A failure points
    to a lock that outlives its process (a pid file without flock)."""
    out = tmp_path / "run"
    holder = _python(_HOLD_LOCK.format(out=str(out)), stdin=subprocess.PIPE)
    _wait_for_line(holder, "locked")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (out / ".lock").exists()
    with RunLock(out) as lock:
        assert lock.stale is not None and lock.stale.pid == holder.pid
        assert lock.stale.is_dead_here()


@pytest.mark.slow
def test_a_stale_lock_held_by_an_orphan_does_not_block(tmp_path):
    """The lock file names a process that is dead on this host, yet the flock is held (a
    forked child inherited the descriptor and outlived its parent): the stale file is
    replaced and the run proceeds. A failure points to a dead run blocking its directory."""
    out = tmp_path / "run"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = _python(f"""
        import fcntl, json, os, socket, time
        os.makedirs({str(out)!r}, exist_ok=True)
        fd = os.open(os.path.join({str(out)!r}, ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({{"pid": {dead.pid}, "host": socket.gethostname(),
                                  "started": "earlier", "command": "flarepp train"}}).encode())
        print("locked", flush=True)
        time.sleep(120)
    """)
    try:
        _wait_for_line(orphan, "locked")
        with RunLock(out) as lock:
            assert lock.held
            with pytest.raises(RunLocked, match=f"process {os.getpid()} on host"):
                RunLock(out).acquire()  # and now the directory is ours
    finally:
        orphan.kill()
        orphan.wait()


# ---------------------------------------------------------------------------------------------
# the data a run was trained on

def test_data_fingerprint_identifies_the_training_split(tmp_path):
    """Same arrays -> same SHA-256 wherever they live; one changed value, a changed dtype
    or shape, or a changed mask -> a different one, and check_same_data names both paths.
    Fails before the change: a run stored no identity of its data, so --resume with other
    data was accepted."""
    rng = np.random.default_rng(0)
    x, y = rng.random((6, 10, 3), np.float32), rng.random((6, 10, 1), np.float32)
    base = data_fingerprint(MeshSamples(x, y), tmp_path / "a" / ".." / "a")
    assert base["path"] == str((tmp_path / "a").resolve())
    assert base["arrays"]["x"] == {"shape": [6, 10, 3], "dtype": "float32"}
    moved = data_fingerprint({"x": x.copy(), "y": y.copy()}, tmp_path / "b")
    check_same_data(base, moved)  # the same content elsewhere is the same data
    edited = x.copy()
    edited[3, 4, 1] += 1e-6
    mask = np.ones((6, 10), bool)
    mask[0, -1] = False
    variants = [MeshSamples(edited, y), MeshSamples(x.astype(np.float64), y),
                MeshSamples(x[:5], y[:5]), MeshSamples(x, y, mask=mask)]
    hashes = {data_fingerprint(v, tmp_path)["sha256"] for v in variants}
    assert len(hashes) == 4 and base["sha256"] not in hashes
    with pytest.raises(DataMismatch, match=r"--resume: the run was trained on the data at "
                                           r"'.*/a' .* but the data at '.*/c' holds a "
                                           r"different training split"):
        check_same_data(base, data_fingerprint(variants[0], tmp_path / "c"))


# ---------------------------------------------------------------------------------------------
# data errors: sentences naming the file and what is wrong

def _npz_variants(tmp_path: Path) -> dict[str, Path]:
    good = tmp_path / "good.npz"
    np.savez(good, x=np.zeros((5, 4, 2), np.float32), y=np.zeros((5, 4, 1), np.float32))
    data = good.read_bytes()
    files = {"empty": b"", "half": data[: len(data) // 2], "tail cut": data[:-30],
             "random": np.random.default_rng(0).bytes(500)}
    paths = {}
    for name, content in files.items():
        paths[name] = tmp_path / f"{name.replace(' ', '_')}.npz"
        paths[name].write_bytes(content)
    return paths


@pytest.mark.parametrize("case, message", [
    ("empty", r"empty\.npz: the file is empty \(0 bytes\)"),
    ("half", r"half\.npz: the file is truncated or not a zip archive"),
    ("tail cut", r"tail_cut\.npz: the file is truncated or not a zip archive"),
    ("random", r"random\.npz: the file is truncated or not a zip archive"),
])
def test_broken_npz_files_are_named_sentences(tmp_path, case, message):
    """0-byte, truncated and random-byte ``.npz`` files raise DataError saying what is wrong
    with which file. Fails before the change: EOFError / BadZipFile tracebacks, and random
    bytes were reported as "pickled (object) data"."""
    path = _npz_variants(tmp_path)[case]
    with pytest.raises(DataError, match=message) as err:
        load_dataset("npz", path)
    assert "pickled" not in str(err.value)


def test_broken_drivaerml_run_file_is_named(tmp_path):
    """A truncated ``run_<id>.npz`` among DrivAerML's runs names that file. Fails before the
    change: BadZipFile traceback."""
    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        np.savez(tmp_path / split / "run_1.npz", surface_mesh_centers=np.zeros((4, 3)),
                 surface_fields=np.zeros((4, 4)))
    good = (tmp_path / "train" / "run_1.npz").read_bytes()
    (tmp_path / "train" / "run_2.npz").write_bytes(good[:100])
    with pytest.raises(DataError, match=r"run_2\.npz: the file is truncated or not a zip"):
        load_dataset("drivaerml-40k", tmp_path)


def test_broken_npy_files_are_named(tmp_path):
    """A 0-byte or truncated ``.npy`` of a benchmark layout names the file. Fails before the
    change: a 0-byte file raised a raw EOFError."""
    np.save(tmp_path / "Random_UnitCell_XY_10.npy", np.zeros((972, 2, 6)))
    (tmp_path / "Random_UnitCell_sigma_10.npy").write_bytes(b"")
    with pytest.raises(DataError, match=r"sigma_10\.npy: the file is empty \(0 bytes\)"):
        load_dataset("elasticity", tmp_path, n_train=3, n_test=3)
    np.save(tmp_path / "Random_UnitCell_sigma_10.npy", np.zeros((972, 6)))
    cut = (tmp_path / "Random_UnitCell_sigma_10.npy").read_bytes()[:500]
    (tmp_path / "Random_UnitCell_sigma_10.npy").write_bytes(cut)
    with pytest.raises(DataError, match=r"sigma_10\.npy: the file is truncated or not a "
                                        r"\.npy array"):
        load_dataset("elasticity", tmp_path, n_train=3, n_test=3)


@pytest.mark.parametrize("case, message", [
    ("empty", r"smooth1\.mat: the file is empty \(0 bytes\)"),
    ("v5 cut", r"smooth1\.mat: the file is truncated or not a MATLAB \.mat file"),
    ("v7.3 cut", r"smooth1\.mat: the file is truncated or not a valid MATLAB v7\.3 \(HDF5\)"),
])
def test_broken_mat_files_are_named_sentences(tmp_path, case, message):
    """0-byte, truncated v5 and truncated v7.3 (HDF5) Darcy files raise DataError naming the
    file. Fails before the change: MatReadError and h5py's OSError tracebacks."""
    import h5py
    import scipy.io
    train = tmp_path / "piececonst_r9_N2_smooth1.mat"
    arrays = {"coeff": np.ones((2, 9, 9)), "sol": np.ones((2, 9, 9))}
    scipy.io.savemat(tmp_path / "piececonst_r9_N2_smooth2.mat", arrays)
    if case == "v7.3 cut":
        with h5py.File(train, "w") as handle:
            for key, value in arrays.items():
                handle[key] = value.T
        train.write_bytes(train.read_bytes()[:1000])
    else:
        scipy.io.savemat(train, arrays)
        train.write_bytes(b"" if case == "empty" else train.read_bytes()[:200])
    with pytest.raises(DataError, match=message):
        load_dataset("darcy", tmp_path, resolution=9, n_train=2, n_test=2)


# ---------------------------------------------------------------------------------------------
# normalisation: constant channels and inputs far outside the training range

def test_a_channel_constant_in_training_is_centred_not_blown_up():
    """An input channel constant over the training split gets std 1 (the channel is only
    centred) and a warning naming it, so a test shift of 0.5 stays 0.5. Fails before the
    change: std was 1e-8 and the shift became 5e7 without a word."""
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.random((4, 8, 1)), np.full((4, 8, 1), 3.0)], -1).astype(np.float32)
    with pytest.warns(UserWarning, match=r"input channel 1 is constant \(3\) over the "
                                         r"training points"):
        norm = Normalizer.fit(x, what="input")
    assert norm.std[1] == 1.0 and norm.mean[1] == 3.0
    shifted = x.copy()
    shifted[..., 1] += 0.5
    np.testing.assert_allclose(norm.encode(shifted)[..., 1], 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Normalizer.fit(x[..., :1], what="input")  # a varying channel: no warning


def test_check_range_flags_inputs_far_outside_the_training_range():
    """Normalised values beyond 10 standard deviations are reported per channel with their
    max |z| (padding ignored); in-range data passes silently. Fails before the change: no
    such check existed."""
    rng = np.random.default_rng(2)
    train = rng.normal(size=(6, 20, 2)).astype(np.float32)
    norm = Normalizer.fit(train)
    test = train.copy()
    test[1, 3, 1] = norm.mean[1] + 40 * norm.std[1]
    mask = np.ones((6, 20), bool)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert norm.check_range(train, mask, "test inputs") == {}
    with pytest.warns(UserWarning, match=r"test inputs: channel 1 reaches \|z\| = 40\.0 "):
        found = norm.check_range(test, mask, "test inputs")
    assert list(found) == [1] and found[1] == pytest.approx(40.0, rel=1e-4)
    mask[1, 3] = False  # the outlier is padding: ignored
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert norm.check_range(test, mask, "test inputs") == {}


@pytest.mark.slow
def test_datasets_registry_is_complete_on_import():
    """``DATASETS`` lists every loader as soon as flarepp.data is imported, in a fresh
    interpreter. Fails before the change: it was empty until the first load_dataset."""
    proc = _python("""
        from flarepp.data import DATASETS
        print(" ".join(DATASETS.names()))
    """)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert {"airfoil", "darcy", "drivaerml-40k", "elasticity", "npz", "pipe"} <= set(out.split())


# ---------------------------------------------------------------------------------------------
# names that become paths: the one confinement every entry point uses (flarepp.io.confined)

@pytest.mark.parametrize("name", ["../x", "a/../../x", "/etc/passwd", "", ".", "a//b", "a/./b",
                                  "a\\..\\b", "a\0b", "a\nb", 3, None])
def test_a_name_that_leaves_its_directory_is_refused(tmp_path, name):
    """A name read from a file (a spec target, a manifest sample, a study point) that is
    absolute, climbs out, is empty or holds a control character never becomes a path; a
    failure here means a crafted file can write or read outside its directory."""
    from flarepp.io import UnsafeName, confined
    with pytest.raises(UnsafeName, match="sample"):
        confined(tmp_path, name, what="sample")


def test_a_link_out_of_the_directory_is_refused_and_plain_names_pass(tmp_path):
    """Plain nested names map under the root; a symbolic link planted under the root that
    leads out of it is refused (a link inside the root is followed)."""
    from flarepp.io import UnsafeName, confined
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "inner").mkdir(parents=True)
    outside.mkdir()
    assert confined(root, "test/case_0001") == root / "test" / "case_0001"
    (root / "out").symlink_to(outside)
    (root / "in").symlink_to(root / "inner")
    with pytest.raises(UnsafeName, match="symbolic link"):
        confined(root, "out/x", what="sample")
    assert confined(root, "in/x") == root / "in" / "x"


def test_a_flat_name_is_one_plain_part(tmp_path):
    """A name stored as one file (a spec's array name, ``<sample>/<name>.npy``) has no
    ``/``: ``sub/vm`` made a store that reported itself changed."""
    from flarepp.io import UnsafeName, check_name, confined
    assert confined(tmp_path, "vm.npy", flat=True) == tmp_path / "vm.npy"
    with pytest.raises(UnsafeName, match="'sub/vm' is not a plain file name"):
        check_name("sub/vm", what="array name", flat=True)


def test_a_short_write_without_errno_names_the_file(tmp_path):
    """numpy's ``tofile`` reports a failed write as ``OSError("8 requested and 0
    written")``, no errno and no file: the atomic writer names the target and says what
    stops a write short; nothing is left."""
    from flarepp.io import atomic_write

    def short(tmp):
        raise OSError("8 requested and 0 written")
    with pytest.raises(OSError) as failed:
        atomic_write(tmp_path / "a.npy", short)
    assert failed.value.filename == str(tmp_path / "a.npy")
    assert "the write stopped short (8 requested and 0 written)" in failed.value.strerror
    assert list(tmp_path.iterdir()) == []


def test_json_nested_too_deeply_is_an_unreadable_file(tmp_path):
    """A manifest or run file of arrays nested 100k deep raised RecursionError: it is an
    :class:`UnreadableFile` naming the file."""
    from flarepp.io import UnreadableFile, read_json
    path = tmp_path / "manifest.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UnreadableFile, match="manifest.json: JSON nested too deeply"):
        read_json(path)
