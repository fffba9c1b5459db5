"""``flarepp sweep``: the grid, kill-and-resume, several processes on one directory, the
report (tables, Figure 4 / 7 data, Table 11 statistics) and the SDPA scale in reports."""

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from flarepp.experiments.compare import markdown_table
from flarepp.experiments.sweep import (SweepSpec, grid_points, open_sweep, parse_axes,
                                       precision_ratios, seed_table, split_values)
from flarepp.train import get_preset

TINY = ["epochs=8", "checkpoint_every=1", "model.dim=8", "model.heads=2", "model.latents=4",
        "batch_size=4"]
GRID = ["model.mixer=flare,flarepp", "model.blocks=1,2", "seed=0,1"]


def test_grid_parsing_and_point_names():
    assert split_values("flare,flarepp") == ["flare", "flarepp"]
    assert split_values("[none,none,standard],standard") == ["[none,none,standard]",
                                                             "standard"]
    axes = parse_axes(["model.mixer=flare,flarepp", "seed=0,1,2"])
    points = grid_points(axes)
    assert [p.name for p in points][:2] == ["mixer-flare_seed-0", "mixer-flare_seed-1"]
    assert len(points) == 6 and points[-1].overrides == ["model.mixer=flarepp", "seed=2"]
    for bad in (["seed"], ["seed=0,,1"], ["seed=0,0"], ["seed=0", "seed=1"]):
        with pytest.raises(ValueError):
            parse_axes(bad)


def test_a_bad_point_fails_before_training(tmp_path):
    """Every point's config is checked when the sweep starts; a directory holding another
    sweep is refused."""
    spec = SweepSpec(get_preset("npz"), parse_axes(["model.latnts=2,4"]), "d.npz")
    with pytest.raises(ValueError, match="latnts"):
        open_sweep(tmp_path / "a", spec)
    open_sweep(tmp_path / "b", SweepSpec(get_preset("npz"), parse_axes(["seed=0,1"]), "d"))
    with pytest.raises(ValueError, match="another sweep"):
        open_sweep(tmp_path / "b", SweepSpec(get_preset("npz"), parse_axes(["seed=0,2"]), "d"))
    # a sweep stored before a config field existed is the same sweep for this version
    stored = json.loads((tmp_path / "b" / "sweep.json").read_text())
    del stored["base"]["eval_chunk_size"]
    (tmp_path / "b" / "sweep.json").write_text(json.dumps(stored))
    open_sweep(tmp_path / "b", SweepSpec(get_preset("npz"), parse_axes(["seed=0,1"]), "d"))


def test_seed_table_and_precision_ratio_statistics():
    """Table 11 uses the sample standard deviation (ddof 1); Figure 7's ratio is the mean
    16-bit error over the mean FP32 error of the same mixer, depth and budget."""
    rows = [dict(status="done", mixer="flare", sdpa_scale="1", blocks=2, latents=8,
                 precision=p, seed=s, test_rel_l2=t, train_rel_l2=t / 2,
                 **{"model.mixer": "flare"})
            for p, s, t in [("fp32", 0, 0.10), ("fp32", 1, 0.14), ("fp16", 0, 0.15),
                            ("fp16", 1, 0.21)]]
    table = {t["precision"]: t for t in seed_table(rows, ["model.mixer", "precision", "seed"])}
    assert table["fp32"]["test_mean"] == pytest.approx(0.12)
    assert table["fp32"]["test_std"] == pytest.approx(math.sqrt(0.0008))
    assert table["fp16"]["seeds"] == 2 and table["fp16"]["train_mean"] == pytest.approx(0.09)
    (ratio,) = precision_ratios(rows)
    assert ratio["ratio"] == pytest.approx(0.18 / 0.12)


def test_compare_table_states_the_scales():
    results = [dict(model=m, label=m, dataset="darcy", seed=0, sdpa_scale=s, test_rel_l2=0.1,
                    train_rel_l2=0.1, params=1, seconds=1, epochs=1, n_points=484)
               for m, s in (("flare", "1"), ("flarepp", "1/sqrt(16)"))]
    table = markdown_table(results)
    assert "SDPA scale each model ran with" in table
    assert "FLARE 1" in table and "FLARE++ 1/sqrt(16)" in table


def _sweep_cmd(*args):
    return [sys.executable, "-m", "flarepp", "sweep", *args, "--quiet"]


def _events(out):
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_killed_sweep_resumes_and_two_processes_share_it(tmp_path):
    """A 2 x 2 x 2 sweep is SIGKILLed while a point is half-trained (it has a checkpoint, no
    metrics), then continued by two processes at once: every point ends exactly once, the
    half-trained one resumes from its checkpoint, finished points are not redone, each
    run's log holds every epoch once, and the report's tables and Figure 4 exist."""
    rng = np.random.default_rng(0)
    x = rng.random((24, 40, 2)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=(np.sin(3 * x[..., :1]) + x[..., 1:] ** 2))
    out = tmp_path / "sw"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = _sweep_cmd("npz", "--data", str(tmp_path / "d.npz"), "--out", str(out),
                       *[a for s in TINY for a in ("--set", s)], "--grid", *GRID)
    first = subprocess.Popen(start, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    half = None
    deadline = time.monotonic() + 600
    while half is None and first.poll() is None and time.monotonic() < deadline:
        finished = {e["point"] for e in _events(out) if e["event"] == "finish"}
        for run in (out / "runs").glob("*") if (out / "runs").exists() else []:
            if finished and run.name not in finished and any(run.glob("checkpoints/*.pt")):
                half = run.name
                break
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert half is not None, "the first process ended before it could be killed mid-point"
    done_before = {e["point"] for e in _events(out) if e["event"] == "finish"}
    second = subprocess.Popen(start, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    third = subprocess.Popen(_sweep_cmd("--out", str(out)), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    for proc in (second, third):
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err.decode()[-2000:]
    events = _events(out)
    names = [p.name for p in grid_points(parse_axes(GRID))]
    finishes = [e["point"] for e in events if e["event"] == "finish"]
    assert sorted(finishes) == sorted(names)  # every point exactly once
    assert any(e["point"] == half and e["event"] == "resume" for e in events)
    later = [e for e in events if e["pid"] not in (first.pid,)]
    assert not any(e["point"] in done_before and e["event"] in ("start", "resume")
                   for e in later)
    for name in names:
        log = [json.loads(line) for line in (out / "runs" / name / "log.jsonl").read_text()
               .splitlines()]
        assert [r["epoch"] for r in log] == list(range(1, 9))
    report = subprocess.run(_sweep_cmd("report", str(out)), env=env, capture_output=True)
    assert report.returncode == 0, report.stderr.decode()[-2000:]
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert len(rows) == 8 and all(r["status"] == "done" for r in rows)
    assert {r["mixer"]: r["sdpa_scale"] for r in rows} == {"flare": "1",
                                                            "flarepp": "1/sqrt(4)"}
    text = (out / "report.md").read_text()
    assert "Table 11" in text and "± " in text and "Figure 4" in text
    assert (out / "fig4_depth_latents.png").stat().st_size > 0
