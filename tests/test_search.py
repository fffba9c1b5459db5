"""Adaptive search (``flarepp sweep --search optuna``): the space in the grid's syntax plus
ranges, one spec per study directory, trials recorded as the study's points, pruning
through the trainer's callback, several workers on one Optuna journal, and a worker that
dies mid-trial."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from flarepp.cli import main
from flarepp.experiments.engine import StudyConflict, read_events
from flarepp.experiments.search import (SearchSpec, counted, open_search, search_spec,
                                        spec_difference, suggest)
from flarepp.experiments.studies import Range, parse_axes, parse_range, sweep_study
from flarepp.io import read_json_lines

TINY = ["epochs=3", "checkpoint_every=1", "batch_size=1", "model.dim=16", "model.heads=2",
        "model.blocks=1", "model.latents=4", "val_fraction=0.25",
        "dataset_options={'resolution': 15, 'n_train': 12, 'n_test': 4}"]
BAD_LR = ["lr=3e-3,1,3,10", "seed=0..999"]
"""lr 1, 3 and 10 do not diverge here (gradients are clipped) but end epoch 1 with a
validation error of 10 to 10^5, against about 0.6 for 3e-3: a setting chosen to be bad."""


def _sets(items):
    return [a for s in items for a in ("--set", s)]


def _spec(data, grid=BAD_LR, sets=TINY, **options):
    return search_spec("darcy-tiny", parse_axes(grid), sets=sets, data=str(data), **options)


def test_ranges_are_parsed_and_only_a_search_samples_them():
    """`LOW:HIGH[:log]` is a real range, `LOW..HIGH[:log]` an integer one; anything else is
    a value; a grid refuses a range in a sentence, and a search refuses an empty or fixed
    space, keys it cannot vary and values the config refuses. A failure means a range is
    read as a literal value (one point trained at "1e-4:1e-2") or a typo trains."""
    assert parse_range("lr", "1e-4:1e-2:log") == Range(1e-4, 1e-2, integer=False, log=True)
    assert parse_range("m", "16..64") == Range(16, 64, integer=True, log=False)
    assert parse_range("d", "/a:b") is None and parse_range("x", "1:2:3") is None
    for bad in ("3..2", "-1:1:log", "1.5..3"):
        with pytest.raises(ValueError, match="--grid k="):
            parse_range("k", bad)
    with pytest.raises(ValueError, match="--search optuna"):
        sweep_study("npz", parse_axes(["lr=1e-4:1e-2"]), data="d.npz")
    for grid, match in ((["seed=0"], "no axis to search"), (["preset=a,b"], "keeps preset"),
                        (["model.latnts=2..8"], "latnts"), (["lr=a,b"], "lr")):
        with pytest.raises(ValueError, match=match):
            search_spec("darcy-tiny", parse_axes(grid), data="d")


def test_a_trial_is_a_grid_point_of_its_values(tmp_path):
    """A trial's values give the point (name, labels, config) that the grid point of those
    values is, real values to 4 significant digits, integers in range; the objective is the
    headline on the validation split when there is one, else on the first evaluation split.
    A failure means the report or a rerun could not match trials to grid-style points."""

    class Fixed:  # a trial that answers the middle of every range, the first choice
        def suggest_float(self, key, low, high, log):
            return (low * high) ** 0.5 if log else (low + high) / 2

        def suggest_int(self, key, low, high, log):
            return (low + high) // 2

        def suggest_categorical(self, key, choices):
            return choices[0]

    spec = _spec(tmp_path, grid=["lr=1e-4:1e-2:log", "model.latents=4..9", "seed=3,4"])
    values = suggest(Fixed(), spec.axes())
    assert values == {"lr": "0.001", "model.latents": "6", "seed": "3"}
    point = spec.point(values)
    (grid,) = sweep_study("darcy-tiny", [(k, [v]) for k, v in values.items()],
                          sets=TINY, data=str(tmp_path)).points
    assert (point.name, point.labels) == (grid.name, grid.labels)
    assert point.name == "lr-0.001_latents-6_seed-3" and point.config.lr == 0.001
    assert point.config.identity() == grid.config.identity()
    assert (spec.metric, spec.direction) == ("val_rel_l2", "minimize")
    no_val = _spec(tmp_path, sets=[s for s in TINY if not s.startswith("val_")])
    assert no_val.metric == "test_rel_l2"
    assert SearchSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_a_study_directory_keeps_one_search_space(tmp_path):
    """A second spec on the same directory (another range, another axis, another sampler)
    is refused naming what differs, and the stored spec is kept; the same spec joins. A
    failure means two searches would mix their trials in one Optuna study."""
    out = tmp_path / "s"
    open_search(_spec(tmp_path), out)
    open_search(_spec(tmp_path), out)  # the same command joins
    for grid, options, match in (
            (["lr=3e-3,1,3", "seed=0..999"], {}, "lr is 3e-3,1,3,10 there and 3e-3,1,3 here"),
            (["lr=3e-3,1,3,10"], {}, "seed is searched there"),
            (BAD_LR, {"sampler": "random"}, "its sampler differs: 'tpe' there, 'random'")):
        with pytest.raises(StudyConflict, match=match):
            open_search(_spec(tmp_path, grid=grid, **options), out)
    assert spec_difference(_spec(tmp_path).to_dict(), _spec(tmp_path).to_dict()) == "nothing"


def test_search_options_are_checked_and_a_missing_optuna_names_its_extra(tmp_path, monkeypatch,
                                                                        capsys):
    """Search options without --search, --search without --trials, and --search without
    Optuna installed are each one sentence (exit 2) before anything trains; the last names
    the extra to install. A failure means a user finds out from a traceback."""
    base = ["sweep", "darcy-tiny", "--data", str(tmp_path), "--out", str(tmp_path / "s"),
            "--grid", "lr=1e-3:1e-2"]
    assert main([*base, "--trials", "4"]) == 2
    assert "need --search optuna" in capsys.readouterr().err
    assert main([*base, "--search", "optuna"]) == 2
    assert "and --trials K" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna raises ImportError
    assert main([*base, "--search", "optuna", "--trials", "4"]) == 2
    assert "pip install 'flarepp[search]'" in capsys.readouterr().err
    assert not (tmp_path / "s" / "runs").exists()


def _worker(args, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "flarepp", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


@pytest.mark.slow
def test_an_8_trial_search_with_2_workers_prunes_the_bad_setting(tmp_path, darcy_dir):
    """The issue's test: an 8-trial search of darcy-tiny with two worker processes on one
    Optuna journal finishes with exactly 8 trials, each point trained once; a trial with a
    learning rate chosen to be bad is pruned after its first epoch (checkpointed, recorded
    `pruned`, no metrics), and the report names the best trial, a good one. The study knows
    two good settings first (enqueued, as a user seeds a search with the preset's own), so
    every later bad trial meets a completed median (each is bad with odds 3/4: none among
    six has odds 1/4096): without pruning through the callback, or with trials the engine
    does not see as points, this fails."""
    out = tmp_path / "s"
    spec = _spec(darcy_dir, sampler="random", startup_trials=1)
    study = open_search(spec, out)
    for seed in (0, 1):
        study.enqueue_trial({"lr": "3e-3", "seed": seed})
    command = ["sweep", "darcy-tiny", "--data", str(darcy_dir), "--out", str(out),
               "--search", "optuna", "--trials", "8", "--sampler", "random",
               "--startup-trials", "1", "--grid", *BAD_LR, *_sets(TINY), "--quiet"]
    workers = [_worker(command), _worker(command, cwd=tmp_path)]
    for proc in workers:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err.decode()[-3000:]
    trials = study.get_trials()
    assert len(trials) == len(counted(trials)) == 8
    bad = [t for t in trials if t.params["lr"] != "3e-3"]
    assert bad and {t.state.name for t in bad} == {"PRUNED"}, [t.state for t in trials]
    assert {t.params["lr"] for t in trials if t.state.name == "COMPLETE"} == {"3e-3"}
    pruned = [t for t in trials if t.state.name == "PRUNED"]  # a good lr's unlucky seed too
    events = read_events(out)
    starts = [e["point"] for e in events if e["event"] in ("start", "resume")]
    assert len(starts) == len(set(starts))  # nothing trained twice
    for trial in pruned:
        run = out / "runs" / trial.user_attrs["point"]
        assert not (run / "metrics.json").exists() and (run / "checkpoints").is_dir()
        epochs = [r["epoch"] for r in read_json_lines(run / "log.jsonl")]
        assert epochs == [1] if trial in bad else epochs in ([1], [1, 2])  # never the last
    assert main(["sweep", "report", str(out)]) == 0
    rows = {r["point"]: r for r in csv.DictReader(open(out / "results.csv"))}
    assert {rows[t.user_attrs["point"]]["status"] for t in pruned} == {"pruned"}
    text = (out / "report.md").read_text()
    best = study.best_trial
    assert best.params["lr"] == "3e-3"
    assert f"**Best trial: #{best.number}**, point `{best.user_attrs['point']}`" in text
    assert "| pruned |" in text
    assert main(["sweep", "darcy-tiny", "--data", str(darcy_dir), "--out", str(out),
                 "--grid", "seed=0,1"]) == 2  # a grid is refused there, naming the search


@pytest.mark.slow
def test_a_worker_killed_mid_trial_leaves_its_point_resumable(tmp_path, darcy_dir):
    """A worker is SIGKILLed while its trial's point is half-trained; the next worker
    (`flarepp sweep --out DIR --trials 3`: the stored search, given one more trial) fails
    that trial as stale, retries its values, which resume the point from its checkpoint,
    and finishes the search (TPE): each point's log holds every epoch once, the killed
    trial is failed and replaced, and the trial count counts the retry, not the stale
    trial. A failure means a dead worker's trial stays running forever, or its point is
    trained twice."""
    out = tmp_path / "s"
    sets = [*TINY, "epochs=10"]
    command = ["sweep", "darcy-tiny", "--data", str(darcy_dir), "--out", str(out),
               "--search", "optuna", "--trials", "2", "--grid", "lr=1e-3:1e-2:log",
               *_sets(sets), "--quiet"]
    first = _worker(command)
    half, deadline = None, time.monotonic() + 600
    while half is None and first.poll() is None and time.monotonic() < deadline:
        found = list(out.glob("runs/*/checkpoints/epoch_0002.pt"))
        half = found[0].parent.parent if found else None
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert half is not None and not (half / "metrics.json").exists(), \
        "the worker ended before it could be killed mid-trial"
    second = _worker(["sweep", "--out", str(out), "--trials", "3", "--quiet"])
    _, err = second.communicate(timeout=600)
    assert second.returncode == 0, err.decode()[-3000:]
    events = read_events(out)
    assert [e["event"] for e in events if e["point"] == half.name] == [
        "start", "stale", "resume", "finish"]
    for run in out.glob("runs/*"):
        assert [r["epoch"] for r in read_json_lines(run / "log.jsonl")] == list(range(1, 11))
    trials = open_search(_spec(darcy_dir, grid=["lr=1e-3:1e-2:log"], sets=sets), out
                         ).get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE", "COMPLETE", "COMPLETE"]
    assert trials[1].user_attrs["retry_of"] == 0 and trials[1].params == trials[0].params
    assert len(counted(trials)) == 3
    assert json.loads((out / "study.json").read_text())["info"]["trials"] == 3


# ---------------------------------------------------------------------------------------------
# a journal or a disk that is not what it should be (issue 41)


def _search_dir(tmp_path, out):
    """A search's directory as a worker leaves it after recording one trial's point."""
    from flarepp.experiments.engine import store_study
    spec = _spec(tmp_path)
    study = open_search(spec, out)
    store_study(out, spec.study([spec.point({"lr": "3e-3", "seed": "1"})], 2, out))
    return study


def test_a_journal_point_outside_the_study_is_refused(tmp_path, capsys):
    """A journal trial whose point is `../../../x` made `sweep --out` create that directory
    above the study (its claim was taken to judge the trial's worker): the journal is named
    in one sentence (exit 1) and nothing is made outside the study. A failure points to a
    journal name that becomes a path without flarepp.io.confined."""
    out = tmp_path / "a" / "b" / "s"
    trial = _search_dir(tmp_path, out).ask()
    trial.set_user_attr("point", "../../../x")
    assert main(["sweep", "--out", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"{out / 'optuna.journal'}: trial 0 records the point '../../../x'" in err
    assert err.count("\n") == 1 and not (tmp_path / "a" / "x").exists()


@pytest.mark.parametrize("journal", [b"", None])
def test_an_empty_or_missing_journal_beside_trials_is_refused(tmp_path, capsys, journal):
    """A 0-byte (or deleted) `optuna.journal` beside a study.json that holds trials was taken
    for a new search: the history was gone and trials trained again. It is refused in one
    sentence (exit 1) naming the journal, which is left as it is. A failure points to
    open_search creating a study where one was lost."""
    out = tmp_path / "s"
    _search_dir(tmp_path, out)
    journal_path = out / "optuna.journal"
    if journal is None:
        journal_path.unlink()
    else:
        journal_path.write_bytes(journal)
    assert main(["sweep", "--out", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    state = "is missing" if journal is None else "is empty (0 bytes)"
    assert f"{journal_path}: {state}, while study.json beside it holds 1 trials' points" in err
    assert (not journal_path.exists()) if journal is None else journal_path.read_bytes() == b""
    assert not (out / "runs").exists()


def test_a_trial_whose_point_cannot_be_recorded_is_retried_not_counted(tmp_path, monkeypatch,
                                                                      capsys):
    """A full disk at the write of study.json failed the trial just asked, which then counted
    towards --trials (a 2-trial search ended with one trained). The trial is failed with a
    retry of its values enqueued, so it does not count; the sentence names the file (exit
    1). A failure points to the search's bookkeeping of a trial that never started."""
    import errno
    real_replace = os.replace

    def full(src, dst, *args, **kwargs):
        if str(dst).endswith("study.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", full)
    out = tmp_path / "s"
    assert main(["sweep", "darcy-tiny", "--data", str(tmp_path), "--out", str(out),
                 "--search", "optuna", "--trials", "2", "--grid", *BAD_LR, *_sets(TINY),
                 "--quiet"]) == 1
    assert f"{out / 'study.json'}: No space left on device" in capsys.readouterr().err
    monkeypatch.setattr(os, "replace", real_replace)
    trials = open_search(_spec(tmp_path), out).get_trials()
    assert counted(trials) == []
    assert [t.state.name for t in trials] == ["FAIL", "WAITING"]
    assert trials[1].user_attrs["retry_of"] == 0
    assert "could not be recorded" in trials[1].user_attrs["retry_why"]
