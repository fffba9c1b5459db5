"""The report package: the typed row and ``results.csv`` (written from rows, read back into
the same rows), the explicit list of plug-ins, and the plug-ins that read curves from run
directories (``rollout``, ``growth``) against computations written here. The studies are
made by :mod:`report_fixtures` (runs written, not trained)."""

from __future__ import annotations

import csv
import dataclasses
import inspect
import json
import math

import numpy as np
import pytest

from flarepp.experiments.engine import run_dir
from flarepp.experiments.reports import (REPORTS, Row, collect, read_results, status_counts,
                                         training_hours, write_report)
from flarepp.experiments.reports import cost, curves, runs, search, stats, tables
from flarepp.experiments.reports.rows import results_text
from flarepp.experiments.studies import SWEEP_REPORTS
from flarepp.storage.rundir import RunDir
from report_fixtures import fake_studies


def _same(a: Row, b: Row) -> bool:
    """Field by field, NaN equal to NaN (a failed run's non-finite value)."""
    def equal(x, y):
        return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x)
                          and math.isnan(y))
    return all(equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(Row))


@pytest.mark.parametrize("kind", ["settings", *[pytest.param(k, marks=pytest.mark.slow)
                                                 for k in ("compare", "pareto")]])  # figures
def test_rows_round_trip_through_results_csv(kind, tmp_path):
    """``results.csv`` holds every row's fields, labels and plug-in columns: read back
    (:func:`read_results`, labels typed from the study) they are the rows the report wrote,
    and written again they are the same bytes. A failure points to a column the record
    drops or a type it loses (a sweep's text labels, Table 1's integer seeds, the cost
    plug-in's hours)."""
    out = fake_studies(tmp_path, (kind,))[kind]
    paths = write_report(out)
    _, rows = collect(out)
    back = read_results(out)
    header = next(csv.reader(open(paths["csv"])))
    assert len(back) == len(rows) and header[:2] == list(rows[0].labels)[:2]
    if kind == "pareto":   # the cost plug-in's columns, added as it ran
        assert {"hours", "estimate", "error_p_s"} <= set(back[0].extra)
        rows = back  # collect alone does not run plug-ins
    assert all(_same(a, b) for a, b in zip(rows, back))
    assert results_text(back, list(back[0].labels)) == paths["csv"].read_text()
    failed = [r for r in back if r.status == "failed"]
    assert (kind != "settings") or (len(failed) == 1 and "nan" in failed[0].error)


def test_a_label_shows_in_its_column_and_measured_fields_win():
    """A grid's ``seed`` label (text) is what the seed column shows, while the field keeps
    the config's integer; an ``epochs`` label never hides the epochs a run trained. A
    failure means grouping by a label reads the wrong value."""
    row = Row(point="p", mixer="flare", seed=0, epochs=7, status="done", metric="rel_l2",
              value=0.5, labels={"seed": "0", "epochs": "8", "lr": "1e-3"})
    columns = row.columns()
    assert (row.seed, row.get("seed"), columns["seed"]) == (0, "0", "0")
    assert row.get("epochs") == 7 and row.get("lr") == "1e-3"
    assert row.get("test_rel_l2") == 0.5 and list(columns)[:7] == [
        "point", "mixer", "blocks", "latents", "precision", "seed", "sdpa_scale"]
    rows = [row, dataclasses.replace(row, status="failed", seconds=3600.0),
            dataclasses.replace(row, status="pending", seconds=1800.0)]
    assert status_counts(rows) == {"done": 1, "failed": 1, "pruned": 0, "pending": 1}
    assert training_hours(rows) == pytest.approx(1.5)


def test_every_plug_in_is_listed_once_and_every_listed_study_names_one():
    """The plug-ins are listed by name in one place (no import registers one): every
    ``*_report`` function of the plug-in modules is listed, and the plug-ins every kind of
    study names exist. A failure means a plug-in nobody can run, or a study whose report
    names an unknown one."""
    listed = {REPORTS.get(n) for n in REPORTS.names()}
    defined = {f for module in (cost, curves, runs, search, stats, tables)
               for name, f in inspect.getmembers(module, inspect.isfunction)
               if name.endswith("_report") and f.__module__ == module.__name__}
    assert listed == defined and len(REPORTS) == len(defined) == 13
    for name in (*SWEEP_REPORTS, "table1", "lra", "cost"):
        assert name in REPORTS


@pytest.mark.slow
def test_sweep_plug_ins_write_nothing_where_they_do_not_apply(tmp_path):
    """On a sweep over settings, mixers, seeds and draws, the depth, precision, length,
    rollout and growth plug-ins add no line and no file; a sweep started before the
    rollout and growth plug-ins existed still gets them in its report. A failure means a
    new plug-in changed every existing report."""
    from flarepp.experiments.reports import report_sections
    out = fake_studies(tmp_path, ("settings",))["settings"]
    for name in ("depth", "precision", "length", "rollout", "growth"):
        rep = report_sections(out, [name])
        assert rep.lines == [] and rep.paths == {}, name
    rollout = fake_studies(tmp_path, ("rollout",))["rollout"]
    stored = json.loads((rollout / "study.json").read_text())
    stored["reports"] = [r for r in stored["reports"] if r not in ("rollout", "growth")]
    (rollout / "study.json").write_text(json.dumps(stored))
    assert "rollout" in write_report(rollout)


@pytest.mark.slow
def test_rollout_error_by_step_is_the_mean_over_trajectories_then_seeds(tmp_path):
    """``rollout_steps.csv``: at each step the mean over seeds of each run's mean over its
    test trajectories, the band the lowest and highest seed, against the arrays read here;
    the table's headline is the mean ± std of the runs' own. A failure means the rollout
    figure of docs/extensions.md shows other numbers than its runs."""
    out = fake_studies(tmp_path, ("rollout",))["rollout"]
    paths = write_report(out)
    _, rows = collect(out)
    table = list(csv.DictReader(open(paths["rollout_csv"])))
    for preset in ("rollout-tiny", "rollout-tiny-adaln"):
        mine = [r for r in rows if r.labels["preset"] == preset]
        per_seed = []
        for r in mine:
            with np.load(RunDir(run_dir(out, r.point)).file(RunDir.ROLLOUT, split="test")) as f:
                per_seed.append([sum(col) / len(col) for col in f["rel_l2"].T])
        got = [line for line in table if line["preset"] == preset]
        assert len(got) == len(per_seed[0]) == 6
        for step, line in enumerate(got):
            at = [seed[step] for seed in per_seed]
            assert float(line["mean"]) == pytest.approx(sum(at) / len(at))
            assert (float(line["low"]), float(line["high"])) == (pytest.approx(min(at)),
                                                                 pytest.approx(max(at)))
    text = paths["markdown"].read_text()
    values = [r.value for r in rows if r.labels["preset"] == "rollout-tiny"]
    mean = sum(values) / 2
    std = abs(values[0] - values[1]) / math.sqrt(2)
    assert f"| rollout-tiny | 2 | {rows[0].params} | {mean:.4g} ± {std:.4g} |" in text
    assert paths["rollout"].stat().st_size > 0


@pytest.mark.slow
def test_growth_reads_epochs_to_target_and_the_loss_around_each_growth(tmp_path):
    """The ``growth`` plug-in: epochs (seconds) until each run's logged test metric comes
    within x1.5 / x1.2 / x1.1 of the best group's mean headline, and the 10-step mean loss
    before and after each growth beside the run of the same seed at the initial M, against
    the logs read here. A failure means the rank-growth table of docs/extensions.md would
    not follow from its logs."""
    out = fake_studies(tmp_path, ("schedule",))["schedule"]
    paths = write_report(out)
    _, rows = collect(out)
    text = paths["markdown"].read_text()
    assert "## Rank growth against fixed latent budgets" in text
    groups = {}
    for r in rows:
        groups.setdefault(r.labels["latent_schedule"], []).append(r)
    best = min(sum(r.value for r in g) / len(g) for g in groups.values())

    def log(r):
        return [json.loads(x) for x in (run_dir(out, r.point) / "log.jsonl").read_text()
                .splitlines()]

    grown = groups["'4,8@2'"]
    cells = []
    for factor in curves.GROWTH_THRESHOLDS:
        hits = []
        for r in grown:
            records, elapsed = log(r), 0.0
            for record in records:
                elapsed += record["seconds"]
                if record["test_rel_l2"] <= factor * best:
                    hits.append(f"{record['epoch']} ({elapsed:.0f})")
                    break
            else:
                hits.append("-")
        cells.append(", ".join(hits))
    assert f"| '4,8@2' | 2 | " in text and " | ".join(cells) + " |" in text
    for r in grown:   # growth at epoch index 2: the steps of epochs 2 and 3 (1-based)
        fixed = next(f for f in groups["'4'"] if f.seed == r.seed)
        expect = []
        for run in (r, fixed):
            steps = [(x["epoch"], loss) for x in log(run) for loss in x["step_losses"]]
            before = [loss for e, loss in steps if e == 2][-10:]
            after = [loss for e, loss in steps if e == 3][:10]
            expect.append(f"{np.mean(before):.4f} / {np.mean(after):.4f}, {after[0]:.4f}")
        assert (f"| '4,8@2' | {r.seed} | 4 -> 8 (epoch 3) | {expect[0]} | {expect[1]} |"
                in text)
    assert paths["growth"].stat().st_size > 0


def test_paired_compares_any_axis_and_the_runs_of_two_studies(tmp_path, capsys):
    """`sweep report DIR --pair preset=A,B` pairs the runs of two presets by seed (what
    scripts/preset_margin.py did), and `--against OTHER` the runs of two studies of one grid
    (what scripts/before_after.py did: the same sweep by earlier code), each difference
    B - A per (setting, seed, draw) against the values read here. A failure means the
    paired plug-in compares mixers only, or pairs runs of different settings."""
    from flarepp.cli import main
    study = fake_studies(tmp_path / "a", ("rollout",))["rollout"]
    done = {(r.get("preset"), r.get("seed")): r.value for r in collect(study)[1]
            if r.status == "done"}
    assert main(["sweep", "report", str(study), "--pair",
                 "preset=rollout-tiny,rollout-tiny-adaln"]) == 0
    (line,) = csv.DictReader(open(study / "paired.csv"))
    diffs = [done["rollout-tiny-adaln", s] - done["rollout-tiny", s] for s in ("0", "1")]
    assert (line["A"], line["B"], int(line["pairs"])) == ("rollout-tiny", "rollout-tiny-adaln", 2)
    assert float(line["mean"]) == pytest.approx(np.mean(diffs))
    assert "## Values of `preset` compared, paired by seed" in (study / "report.md").read_text()
    later = fake_studies(tmp_path / "b", ("rollout",))["rollout"]
    for run in later.glob("runs/*/metrics.json"):  # the "after" runs: 1.5 times the error
        metrics = json.loads(run.read_text())
        run.write_text(json.dumps({k: v * 1.5 if k.startswith("test_") else v
                                   for k, v in metrics.items()}))
    capsys.readouterr()
    assert main(["sweep", "report", str(later), "--against", str(study)]) == 0
    said = capsys.readouterr().out
    table = {line["preset"]: line for line in csv.DictReader(
        open(later / f"paired-{study.name}.csv"))}
    for preset in ("rollout-tiny", "rollout-tiny-adaln"):
        line = table[preset]
        assert (line["A"], line["B"]) == (str(study), str(later))  # both named "rollout"
        assert float(line["mean"]) == pytest.approx(
            np.mean([0.5 * done[preset, s] for s in ("0", "1")]))
    assert "## Values of `study` compared" in said and not (later / "report.md").exists()
