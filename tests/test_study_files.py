"""A study's files read as a hostile user leaves them (issue 34): a hand-edited or cut
``study.json`` / ``metrics.json`` / event line, point names that leave the study, a grid
whose values read alike or come in another order, a held study lock, a moved study, data
regenerated at a study's path, a corrupt newest checkpoint, ``plot`` of a run holding
another run's checkpoint, ``data make`` counts beyond any disk. Each is a sentence naming
the file or value (exit 1 runtime, 2 usage), never a traceback, a hang or a wrong number."""

import ast
import errno
import json
import os
import re
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from flarepp.cli import main
from flarepp.experiments import engine
from flarepp.experiments.engine import (StudyConflict, create_study, open_study, read_events,
                                        run_study)
from flarepp.experiments.reports import collect
from flarepp.experiments.studies import parse_axes, sweep_study
from flarepp.io import UnreadableFile
from flarepp.storage.locks import Lease, RunLocked
from flarepp.storage.rundir import RunDir
from flarepp.storage.studydir import Point, Study, StudyDir

SRC = Path(__file__).resolve().parents[1] / "src" / "flarepp"

TINY = ["epochs=2", "checkpoint_every=1", "model.dim=8", "model.heads=2", "model.latents=4",
        "batch_size=4", "pct_start=0.3", "device=cpu", "keep_checkpoints=None"]
QUIET = dict(log=lambda _: None)


def _npz(path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    x = rng.random((24, 40, 2)).astype(np.float32)
    np.savez(path, x=x, y=(np.sin(3 * x[..., :1]) + x[..., 1:] ** 2))
    return path


def _study(tmp_path: Path, grid=("seed=0,1",), sets=TINY):
    return sweep_study("npz", parse_axes(list(grid)), data=str(tmp_path / "d.npz"),
                       sets=list(sets))


# ---------------------------------------------------------------------------------------------
# the grid


@pytest.mark.parametrize("axis", ["seed=0,00", "lr=0.001,1e-3", "model.latents=4,+4"])
def test_grid_values_that_read_alike_are_one_value(axis, capsys):
    """`--grid seed=0,00` and `lr=0.001,1e-3` passed the repeated-value check (it compared
    the text): one config trained twice and the report showed "2 seeds, x ± 0". A failure
    points to values compared before parsing."""
    with pytest.raises(ValueError, match="are the same run"):
        sweep_study("npz", parse_axes([axis]), data="d.npz")
    assert main(["sweep", "npz", "--data", "d.npz", "--out", "sw", "--grid", axis]) == 2
    assert "are the same run" in capsys.readouterr().err and not Path("sw").exists()


def test_the_same_grid_in_another_order_is_the_same_study(tmp_path):
    """Axis values (`seed=1,0`) or axes (`lr=... seed=...`) in another order ask for the same
    points: the stored study is joined, its point names kept (it was refused as "other
    labels or timing runs" / "points ... not asked for"). Growing it in another order keeps
    the stored names too. A failure points to an order-sensitive identity."""
    stored = create_study(tmp_path / "sw", _study(tmp_path, ["seed=0,1", "lr=0.001,0.002"]))
    names = sorted(p.name for p in stored.points)
    for grid in (["seed=1,0", "lr=0.002,0.001"], ["lr=0.001,0.002", "seed=0,1"]):
        joined = create_study(tmp_path / "sw", _study(tmp_path, grid))
        assert sorted(p.name for p in joined.points) == names
    grown = create_study(tmp_path / "sw", _study(tmp_path, ["lr=0.001,0.002", "seed=0,1,2"]))
    assert set(names) < {p.name for p in grown.points}
    with pytest.raises(StudyConflict, match="another study"):
        create_study(tmp_path / "sw", _study(tmp_path, ["seed=0,5"]))


# ---------------------------------------------------------------------------------------------
# hand-edited files


def _edit_points_x(d):
    d["points"] = "x"


def _edit_no_kind(d):
    del d["kind"]


def _edit_point_name(d):
    d["points"][0]["name"] = "../../x"


def _edit_config(d):
    d["points"][0]["config"] = {"lr": "fast"}


@pytest.mark.parametrize("edit, said", [
    (_edit_points_x, "its 'points' is not a list of point objects"),
    (_edit_no_kind, "key 'kind' is missing"),
    (_edit_point_name, "point name '../../x' is not a relative path inside the study"),
    (_edit_config, "not a study"),
    ("[]", "it holds a JSON list, not an object"),
    ('{"kind": ', "not valid JSON at line 2"),
])
def test_a_hand_edited_study_json_is_a_sentence_naming_it(tmp_path, capsys, edit, said):
    """`"points": "x"`, no `"kind"`, a cut file (the JSON parser's words, exit 2, no file),
    a point name `../../x` (a run directory made outside the study): `sweep --out` and
    `sweep report` exit 1 naming study.json and what is wrong, before anything is written.
    A failure points to Study.from_stored reached without StudyDir.read_study."""
    out = tmp_path / "sw"
    create_study(out, _study(tmp_path))
    path = out / "study.json"
    if isinstance(edit, str):
        path.write_text(edit + "\n")
    else:
        stored = json.loads(path.read_text())
        edit(stored)
        path.write_text(json.dumps(stored))
    for argv in (["sweep", "--out", str(out), "--quiet"], ["sweep", "report", str(out)]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"flarepp sweep: error: {path}: ") and said in err, err
        assert err.count("\n") == 1
    assert not (out / "runs").exists() and not (tmp_path / "x").exists()
    with pytest.raises(UnreadableFile):
        open_study(out)


@pytest.mark.parametrize("text, said", [("[]", "holds a JSON list"),
                                        ('{"test_rel', "not valid JSON")])
def test_a_corrupt_metrics_json_is_a_sentence_naming_it(tmp_path, capsys, text, said):
    """A cut or hand-edited `metrics.json` exited 2 with the parser's words (a list was
    shown as a failed run "test rel_l2 is None"): exit 1 naming the file."""
    out = tmp_path / "sw"
    study = create_study(out, _study(tmp_path))
    run = RunDir(out / "runs" / study.points[0].name)
    run.write_config(study.points[0].config)
    run.metrics_path.write_text(text)
    assert main(["sweep", "report", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"flarepp sweep: error: {run.metrics_path}: ") and said in err


def test_event_lines_that_are_not_records_are_left_out_and_named(tmp_path, capsys):
    """An events line `[]` or one without `"event"` was a traceback in `sweep report`: it is
    left out, named by file and line, and the report is written."""
    out = tmp_path / "sw"
    create_study(out, _study(tmp_path))
    (out / "events").mkdir()
    (out / "events" / "h-1.jsonl").write_text(
        '[]\n{"point": "seed-0", "time": 1}\n{"point": "seed-0", "event": "start", '
        '"time": 2}\n')
    said = []
    assert [e["event"] for e in read_events(out, unreadable=said.append)] == ["start"]
    assert [s.split(" is not")[0] for s in said] == [
        f"{out / 'events' / 'h-1.jsonl'} line 1", f"{out / 'events' / 'h-1.jsonl'} line 2"]
    assert main(["sweep", "report", str(out)]) == 0
    assert "line 2 is not an event record" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# locks, moves, hints


def test_a_held_study_lock_is_waited_for_with_a_message_and_a_bound(tmp_path, capsys,
                                                                   monkeypatch):
    """A process holding `.study.lock` (stopped with Ctrl-Z while creating the study) made
    `sweep --out` wait silently: it says whom it waits for and for how long, and then stops
    with a sentence naming the holder (exit 1)."""
    monkeypatch.setattr(engine, "STUDY_LOCK_WAIT_S", 0.3)
    out = tmp_path / "sw"
    out.mkdir()
    holder = Lease(out / ".study.lock", heartbeat=False).acquire()
    try:
        with pytest.raises(RunLocked, match="waited 0 s for the study's lock.*kill -CONT"):
            create_study(out, _study(tmp_path))
        err = capsys.readouterr().err
        assert "waiting up to 0 s for" in err and f"pid {os.getpid()}" in err.replace(
            "process ", "pid ")
    finally:
        holder.release()
    assert create_study(out, _study(tmp_path)).kind == "sweep"


def test_a_full_disk_while_taking_a_lock_names_the_lock_file(tmp_path, capsys, monkeypatch):
    """ENOSPC while writing a lease said only "[Errno 28] No space left on device": the
    sentence names the lease file (exit 1) and nothing is trained."""
    real_write = os.write

    def full(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".lock"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    out = tmp_path / "sw"
    assert main(["sweep", "npz", "--data", str(tmp_path / "d.npz"), "--out", str(out),
                 "--grid", "seed=0,1", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"cannot take the lease {str(out / '.study.lock')!r}: No space left" in err
    assert "free some space" in err and "exclusive create" not in err
    assert not (out / ".study.lock").exists() and not (out / "runs").exists()


def test_a_moved_study_names_where_it_is_now(tmp_path, monkeypatch, capsys):
    """The continue hint named the study's old directory after a move (study.json's stored
    command) and read "run ``" from a launch: every hint names the directory given now."""
    create_study(tmp_path / "old", _study(tmp_path))
    shutil.move(tmp_path / "old", tmp_path / "new")
    new = tmp_path / "new"
    assert open_study(new).continue_with == f"flarepp sweep --out {new}"
    with pytest.raises(StudyConflict, match=f"continue it with `flarepp sweep --out {new}`"):
        create_study(new, _study(tmp_path, ["seed=7,8"]))
    assert main(["sweep", "report", str(new)]) == 0
    assert f"Continue with `flarepp sweep --out {new}`" in (new / "report.md").read_text()
    from flarepp.cli import launcher
    from flarepp.experiments import launch as launching
    done = launching.LaunchOutcome([types.SimpleNamespace(job_id=1)], tmp_path,
                                   {"done": [], "failed": [], "pending": ["seed-0"]}, [])
    monkeypatch.setattr(launching, "launch", lambda *a, **k: done)
    spec = types.SimpleNamespace(launcher="local")
    assert launcher.run_launched(_study(tmp_path), new, spec, wait=True, report=False) == 1
    assert f"or run `flarepp sweep --out {new}`) to finish them" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# trained studies


@pytest.mark.slow
def test_data_regenerated_at_a_study_path_retrains_its_points(tmp_path):
    """Data regenerated at a study's path: the finished runs' checkpoints were resumed and
    refused the new data at every rerun (exit 1 forever) while `sweep report` counted them
    done with the old data's numbers. The report shows them pending (of other data); the
    rerun keeps the old runs under superseded/ and trains the points afresh; the same holds
    for an unfinished run of the old data."""
    data = _npz(tmp_path / "d.npz")
    out = tmp_path / "sw"
    study = _study(tmp_path, ["seed=0,1"])
    assert run_study(study, out, **QUIET)["finished"] == ["seed-0", "seed-1"]
    (out / "runs" / "seed-1" / "metrics.json").unlink()  # as if killed before its end
    _npz(data, seed=1)
    rows = collect(out)[1]
    assert [r.status for r in rows] == ["pending", "pending"]
    assert "reuse: the run was trained on the data" in rows[0].error
    done = run_study(study, out, **QUIET)
    assert done["finished"] == ["seed-0", "seed-1"] and done["error"] == []
    kept = sorted((out / "superseded").glob("*/*"))
    assert [p.parent.name for p in kept] == ["seed-0", "seed-1"]
    assert (kept[0] / "metrics.json").is_file()  # nothing thrown away
    assert [r.status for r in collect(out)[1]] == ["done", "done"]
    assert any(e["event"] == "superseded" for e in read_events(out))
    assert run_study(study, out, **QUIET)["reused"] == ["seed-0", "seed-1"]


@pytest.mark.slow
def test_a_finished_point_with_a_corrupt_newest_checkpoint_is_reused(tmp_path):
    """A finished point whose newest checkpoint is corrupt stayed in error at every rerun:
    its data is checked against the newest readable checkpoint, as --resume falls back."""
    _npz(tmp_path / "d.npz")
    out = tmp_path / "sw"
    study = _study(tmp_path, ["seed=0"])
    assert run_study(study, out, **QUIET)["finished"] == ["seed-0"]
    newest = sorted((out / "runs" / "seed-0" / "checkpoints").glob("*.pt"))[-1]
    newest.write_bytes(newest.read_bytes()[:100])
    assert run_study(study, out, **QUIET)["reused"] == ["seed-0"]


@pytest.mark.slow
def test_plot_refuses_a_checkpoint_of_another_run(tmp_path, capsys):
    """`flarepp plot RUN` of an unfinished run predicted from whatever checkpoint was newest
    in RUN/checkpoints, another run's included (its figures, exit 0): refused, naming the
    checkpoint and the differing keys, with nothing written."""
    from tests.tiny_runs import tiny_darcy_run
    from flarepp.train import get_preset, train
    from tests.tiny_runs import TINY as DARCY
    data, run = tiny_darcy_run(tmp_path)
    train(get_preset("darcy-tiny", [*DARCY, "seed=9"]), tmp_path / "other", data_root=data,
          progress=False)
    RunDir(run).metrics_path.unlink()
    for f in RunDir(run).path.glob("*.npz"):
        f.unlink()
    foreign = sorted((tmp_path / "other" / "checkpoints").glob("*.pt"))[-1]
    shutil.copy(foreign, run / "checkpoints" / "epoch_0099.pt")
    assert main(["plot", str(run), "--cases", "1"]) == 1
    err = capsys.readouterr().err
    assert "epoch_0099.pt" in err and "is not" in err and "seed differ" in err
    assert not list(run.glob("*.npz")) and not list(run.glob("*.png"))


# ---------------------------------------------------------------------------------------------
# data make


@pytest.mark.parametrize("argv, said", [
    (["surface-flow", "--train", "1000000000000"], "samples need at least"),
    (["laplace-store", "--train", "1000000000000"], "samples need at least"),
    (["elasticity-mesh", "--train", "1000000000000"], "samples need at least"),
    (["surface-flow", "--resolution", "1000000000000", "--train", "1", "--test", "1"],
     "samples need at least"),
    (["darcy", "--resolution", "1000000000000", "--train", "1", "--test", "1"],
     "more than a 64-bit address space holds"),
])
def test_data_make_counts_beyond_any_disk_or_memory_are_a_sentence(tmp_path, capsys, argv,
                                                                    said):
    """`data make surface-flow --train 10^12` built a job list until the kernel killed it;
    `--resolution 10^12` gave numpy's "array is too big": each is one sentence (exit 1)
    saying what is needed and what there is, before anything is written."""
    if argv[0] == "surface-flow":
        pytest.importorskip("vtk")
    if argv[0] == "elasticity-mesh":
        pytest.importorskip("meshio")
    out = tmp_path / "gen"
    assert main(["data", "make", *argv, "--out", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("flarepp data: error: ") and said in err and err.count("\n") == 1
    assert not out.exists() or not any(out.rglob("*.npy")) and not any(out.rglob("*.vtp"))


# ---------------------------------------------------------------------------------------------
# one owner of a study's files

HOMONYMS = {"runs": "the report plug-in that lists every point",
            "tensorboard": "a tracker and its package", "launch": "a function",
            "superseded": "the event of a run set aside"}
"""Study folder names that are also the names of other things: for these a literal counts
only where it is a path part (``/runs/``), never alone."""


def study_file_patterns() -> list[tuple[re.Pattern, bool]]:
    """``(pattern, whole)`` per name :class:`StudyDir` declares: a file name (``study.json``)
    matches a word of a literal ending in it, after a ``/`` or alone; a folder (``claims``)
    a whole literal (``whole``; not for :data:`HOMONYMS`) or a path part after a ``/``."""
    patterns = []
    for key, value in vars(StudyDir).items():
        if not key.isupper():
            continue
        for name in value.values() if isinstance(value, dict) else [value]:
            if "." in name:
                patterns.append((re.compile(r"(^|/)" + re.escape(name) + r"$"), False))
                continue
            if name not in HOMONYMS:
                patterns.append((re.compile(r"^" + re.escape(name) + r"$"), True))
            patterns.append((re.compile(r"/" + re.escape(name) + r"(/|$)"), False))
    return patterns


def _prose(tree: ast.AST) -> set[int]:
    """String constants that are not paths: docstrings, ``__all__`` entries (names of
    Python objects) and text with white space (a help text or message naming a file for its
    reader)."""
    found = {id(node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                                for t in node.targets):
            found |= {id(c) for c in ast.walk(node.value)}
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and re.search(r"\s", node.value):
            found.add(id(node))
    return found


def study_name_hits(path: Path, root: Path = SRC) -> list[str]:
    """``module:line: literal`` for every literal of ``path`` that names a study file."""
    tree = ast.parse(path.read_text(), str(path))
    skip, patterns = _prose(tree), study_file_patterns()
    return [f"{path.relative_to(root.parent)}:{node.lineno}: {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in skip
            and any(p.search(node.value) if whole else any(p.search(w) for w in node.value.split())
                    for p, whole in patterns)]


def test_no_study_file_name_outside_its_owner():
    """Every literal of the package that names a file or folder StudyDir declares
    (study.json, claims, events, optuna.journal, .study.lock, ...) is in
    storage/studydir.py. A failure names the module and line: use the StudyDir method (a
    second place that spells a study's layout is a second place to change with it)."""
    assert len(study_file_patterns()) > 15
    owner = SRC / "storage" / "studydir.py"
    hits = [hit for path in sorted(SRC.rglob("*.py")) if path != owner
            for hit in study_name_hits(path)]
    assert not hits, "study-file names outside StudyDir:\n  " + "\n  ".join(hits)


def test_the_study_scan_finds_a_planted_name(tmp_path):
    """The scan itself sees study names in a plain literal, an f-string's piece and a path
    part, and not in a docstring, a message or ``__all__`` (so the test above cannot pass by
    reading nothing)."""
    planted = tmp_path / "flarepp" / "planted.py"
    planted.parent.mkdir()
    planted.write_text('"""Reads study.json."""\nA = "study.json"\nB = f"{out}/claims/{p}"\n'
                       'C = "claims"\nD = "see optuna.journal"\n__all__ = ["launch"]\n'
                       'E = f"{x}/runs/{y}"\nF = "runs"\n')
    hits = study_name_hits(planted, tmp_path / "flarepp")
    assert sorted(int(h.split(":")[1]) for h in hits) == [2, 3, 4, 7]


def test_study_dir_confines_point_names_and_reads_configs_as_stored(tmp_path):
    """A point name that would leave the study (``../x``, ``/x``, a link planted under
    ``runs/``) is refused by every StudyDir path of a point, and ``study.json``'s configs are
    read as stored (``RunConfig.from_stored``): a version-2 config without ``eval_weights``
    reads ``ema``, as its runs trained, where ``from_dict`` would give today's ``raw``."""
    from flarepp.io import UnsafeName
    out = StudyDir(tmp_path / "sw")
    (out.path / "runs").mkdir(parents=True)
    (out.path / "runs" / "link").symlink_to(tmp_path)
    for name in ("../x", "/x", "a/../../x", "link/x"):
        for where in (out.run_path, out.claim, out.tensorboard_path, out.set_aside):
            if name != "link/x" or where in (out.run_path, out.set_aside):  # under runs/
                with pytest.raises(UnsafeName, match="point name"):
                    where(name)
    assert not (tmp_path / "x").exists()
    study = _study(tmp_path)
    stored = study.to_dict()
    for p in stored["points"]:
        p["config"]["config_version"] = 2
        del p["config"]["eval_weights"]
    out.study_path.write_text(json.dumps(stored))
    assert {p.config.eval_weights for p in out.read_study().points} == {"ema"}
    assert isinstance(out.read_study().points[0], Point) and out.read_study().kind == "sweep"
    assert Study.from_stored(stored).identity() == out.read_study().identity()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
