"""Studies that choose settings on validation and say how sure they are (issue 21): the
validation split carved from the training data (``val_fraction``), the constant predictor
that "did not fit" is measured against, the ``selection`` and ``paired`` report plug-ins
against hand computations, and one tiny ``flarepp sweep`` over settings, mixers, seeds
and data draws."""

import csv
import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from flarepp.data import DatasetSplits, MeshSamples, Normalizer, validation_indices
from flarepp.experiments.reports.stats import (choose_setting, interval, length_report,
                                              paired_differences,
                                              paired_report, selection_report)
from flarepp.experiments.reports import Report, Row, did_not_fit
from flarepp.storage.config import FILE_SECTIONS, RunConfig
from flarepp.tasks.fields import FieldTask
from flarepp.train import validate, get_preset


def splits(n_train=10, n_test=3, n_points=12, seed=0) -> DatasetSplits:
    """Point clouds whose training targets drift with the sample index, so normalisers
    fitted on a subset differ from those fitted on all of them."""
    rng = np.random.default_rng(seed)

    def make(count, drift):
        x = rng.random((count, n_points, 2)).astype(np.float32)
        y = np.sin(3 * x[..., :1]) + drift[:, None, None]
        return MeshSamples(x=x, y=y.astype(np.float32))
    return DatasetSplits("cloud", make(n_train, np.arange(n_train, dtype=float)),
                         make(n_test, np.zeros(n_test)), source="test cloud").validate()


def config(**kw):
    base = dict(name="val-test", dataset="npz", data_root="unused", input_norm="standard",
                model=dict(mixer="flarepp", dim=8, heads=2, latents=4, blocks=1), epochs=1,
                batch_size=2, device="cpu")
    return validate(RunConfig(**{**base, **kw}))


# -- the validation split ----------------------------------------------------------------------

def test_validation_split_is_carved_from_training_data_the_same_for_every_seed():
    """ceil(f n) training samples are held out, disjoint from those trained on, the same
    whatever the run's seed; normalisers see only the rest. A failure here means the
    choice of a setting could see the samples it is scored on, or differ between the
    points of one study."""
    data = splits()
    kept, held = validation_indices(10, 0.25)
    assert len(held) == 3 and len(kept) == 7
    assert sorted([*kept, *held]) == list(range(10))
    assert np.array_equal(held, validation_indices(10, 0.25)[1])
    tasks = [FieldTask(config(val_fraction=0.25, seed=seed), "unused", splits=data)
             for seed in (0, 7)]
    for task in tasks:
        assert task.eval_splits == ("test", "train", "val")
        np.testing.assert_array_equal(task.samples("val").x, data.train.x[held])
        np.testing.assert_array_equal(task.samples("train").y, data.train.y[kept])
        assert task.num_samples("train") == 7 and task.num_samples("val") == 3
        fitted = Normalizer.fit(data.train.y[kept], None, what="output")
        np.testing.assert_allclose(task.y_norm.mean, fitted.mean)
        np.testing.assert_allclose(task.x_norm.std,
                                   Normalizer.fit(data.train.x[kept], None).std)
        assert not np.allclose(task.y_norm.mean,
                               Normalizer.fit(data.train.y, None, what="output").mean)
        assert task.describe_data()["validation"] == {"fraction": 0.25, "samples": 3}
    assert tasks[0].data_identity() == tasks[1].data_identity()


def test_no_validation_fraction_is_the_task_as_before():
    """val_fraction 0 (the default) trains on the whole training split, fingerprints the
    same data, and has no val split (the golden darcy-tiny curves check the numbers)."""
    data = splits()
    task = FieldTask(config(), "unused", splits=data)
    assert task.splits is data and task.eval_splits == ("test", "train")
    assert "validation" not in task.describe_data()
    np.testing.assert_allclose(task.y_norm.mean,
                               Normalizer.fit(data.train.y, None, what="output").mean)
    with pytest.raises(ValueError, match="'val' with val_fraction > 0"):
        task.samples("val")
    carved = FieldTask(config(val_fraction=0.3), "unused", splits=data)
    assert carved.data_identity() == task.data_identity()  # the data, not its use


def test_val_fraction_is_versioned_checked_and_refused_where_not_carved():
    """A stored config of an earlier version trained on its whole training split; a bad
    fraction or one that leaves nothing to train on is refused, and so is a task that
    cannot carve one."""
    file = config(val_fraction=0.2).to_file()
    assert file["data"]["val_fraction"] == 0.2 and "val_fraction" in FILE_SECTIONS["data"]
    for version in (1, 2, 3):
        old = {k: v for k, v in config().to_dict().items() if k != "val_fraction"}
        if version == 1:
            old.pop("config_version")
        else:
            old["config_version"] = version
        assert RunConfig.from_stored(old).val_fraction == 0.0
    assert RunConfig.from_stored(file).val_fraction == 0.2
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="val_fraction must be in"):
            config(val_fraction=bad)
    with pytest.raises(ValueError, match="leaving none to train on"):
        FieldTask(config(val_fraction=0.95), "unused", splits=splits())
    with pytest.raises(ValueError, match="does not carve a validation split"):
        get_preset("lm-tiny", ["val_fraction=0.2"])


def test_constant_predictor_is_the_best_fixed_prediction():
    """train_constant_rel_l2 against a float64 loop: the fixed per-point prediction
    sum_b w_b y_b / sum_b w_b (w_b = 1 / ||y_b||^2), no worse than the training mean,
    with masked points left out of both sums."""
    data = splits(n_train=5, n_points=4, seed=3)
    data.train.mask = np.ones((5, 4), bool)
    data.train.mask[1, 3] = data.train.mask[4, 0] = False
    y, m = data.train.y.astype(np.float64), data.train.mask
    w = [1.0 / sum(y[b, n, 0] ** 2 for n in range(4) if m[b, n]) for b in range(5)]
    c = [sum(w[b] * y[b, n, 0] for b in range(5) if m[b, n])
         / sum(w[b] for b in range(5) if m[b, n]) for n in range(4)]

    def rel(pred):
        return np.mean([math.sqrt(sum((pred[n] - y[b, n, 0]) ** 2 for n in range(4) if m[b, n])
                                  * w[b]) for b in range(5)])
    task = FieldTask(config(), "unused", splits=data)
    got = task.baseline_metrics()["train_constant_rel_l2"]
    assert got == pytest.approx(rel(c), rel=1e-12)
    assert got <= rel([y[m][:, 0].mean()] * 4)


def test_the_constant_baseline_is_left_out_of_a_training_split_too_large(monkeypatch):
    """Above BASELINE_MAX_ROWS training rows the baseline (two passes over the whole split,
    float64 accumulators as wide as its widest sample) is left out of the metrics: the 8 GB
    store's end-of-run evaluation ran out of a 3 GiB address space in it."""
    from flarepp.tasks import fields
    task = FieldTask(config(), "unused", splits=splits(n_train=5, n_points=4, seed=3))
    assert "train_constant_rel_l2" in task.baseline_metrics()
    monkeypatch.setattr(fields, "BASELINE_MAX_ROWS", 19)
    assert task.baseline_metrics() == {}


# -- the report plug-ins on hand-made rows -----------------------------------------------------

def row(mixer, seed, draw, val, test, *, lr="1e-3", status="done", train=0.05,
        constant=0.5) -> Row:
    r = Row(point=f"{lr}_{mixer}_{seed}_{draw}", mixer=mixer, seed=seed, status=status,
            labels={"model.mixer": mixer, "seed": str(seed), "data_root": draw, "lr": lr},
            metric="rel_l2", lower_is_better=True, val_value=val, value=test,
            train_value=train, train_constant=constant)
    if status != "done":
        r.val_value = r.value = r.train_value = None
    r.did_not_fit = did_not_fit(r)
    return r


def changed(r: Row, **changes) -> Row:
    """``r`` with fields or (any other name) labels changed; ``did_not_fit`` recomputed."""
    fields = {f.name for f in dataclasses.fields(Row)}
    out = dataclasses.replace(r, **{k: v for k, v in changes.items() if k in fields},
                              labels={**r.labels, **{k: v for k, v in changes.items()
                                                     if k not in fields}})
    out.did_not_fit = did_not_fit(out)
    return out


def report(rows, tmp_path) -> Report:
    labels = {k: None for k in ("lr", "model.mixer", "seed", "data_root")}
    study = SimpleNamespace(points=[SimpleNamespace(labels=labels)])
    return Report(study, rows, Path(tmp_path))


def grid_rows(cells):
    """{(lr, mixer): [val per (seed, draw)]} with test values that would choose the other
    setting: test = 1 - val."""
    pairs = [(s, d) for s in (0, 1) for d in ("A", "B")]
    return [row(mixer, s, d, v, 1.0 - v, lr=lr) for (lr, mixer), vals in cells.items()
            for (s, d), v in zip(pairs, vals)]


def test_selection_takes_the_mean_over_mixers_on_validation_never_test(tmp_path):
    """lr 3e-3 has the lower mean over mixers (0.14 against 0.15) although FLARE alone is
    better at 1e-3 (no per-mixer tuning) and the test values favour 1e-3 (never used); a
    setting with a failed run is not eligible however good its finished runs. A failure
    means the preset study would choose on the wrong numbers."""
    rows = grid_rows({("1e-3", "flare"): [0.09, 0.11, 0.10, 0.10],
                      ("1e-3", "flarepp"): [0.20, 0.20, 0.21, 0.19],
                      ("3e-3", "flare"): [0.16, 0.16, 0.15, 0.17],
                      ("3e-3", "flarepp"): [0.12, 0.12, 0.12, 0.12],
                      ("1e-2", "flare"): [0.01, 0.01, 0.01],
                      ("1e-2", "flarepp"): [0.01, 0.01, 0.01, 0.01]})
    rows.append(row("flare", 1, "B", None, None, lr="1e-2", status="failed"))
    result = choose_setting(rows, ["lr"])
    assert result["scores"][("1e-3",)] == pytest.approx(0.15)
    assert result["scores"][("3e-3",)] == pytest.approx(0.14)
    assert result["chosen"] == ("3e-3",)
    assert "1 of its 8 runs failed" in result["why_not"][("1e-2",)]
    assert choose_setting(rows, ["lr"], value="value")["chosen"] != ("3e-3",)  # test differs
    rep = report(rows, tmp_path)
    selection_report(rep)
    text = "\n".join(rep.lines)
    assert "Chosen: `lr` = 3e-3" in text and "never used to choose" in text
    table = list(csv.DictReader(open(tmp_path / "selection.csv")))
    assert {r["lr"] for r in table if r["chosen"] == "1"} == {"3e-3"}
    flare = next(r for r in table if (r["lr"], r["mixer"]) == ("1e-3", "flare"))
    assert float(flare["val_mean"]) == pytest.approx(0.10)
    assert float(flare["test_mean"]) == pytest.approx(0.90)


def test_a_study_still_running_chooses_nothing_yet(tmp_path):
    """With runs of a setting still pending, no setting is chosen (the untrained one could
    win); the best complete setting so far is named as such. A failure means a partial
    preset study would announce a choice."""
    rows = grid_rows({("1e-3", "flare"): [0.10] * 4, ("1e-3", "flarepp"): [0.10] * 4,
                      ("3e-3", "flare"): [0.20] * 4})
    rows += [row("flarepp", s, "A", None, None, lr="3e-3", status="pending") for s in (0, 1)]
    result = choose_setting(rows, ["lr"])
    assert result["chosen"] is None and result["best_so_far"] == ("1e-3",)
    assert result["pending"] == 2
    rep = report(rows, tmp_path)
    selection_report(rep)
    text = "\n".join(rep.lines)
    assert "No choice yet: 2 run(s) of the study are still pending" in text
    assert "best complete setting so far: `lr` = 1e-3" in text and "Chosen:" not in text


def test_selection_refuses_without_a_validation_metric(tmp_path):
    rows = [changed(r, val_value=None) for r in grid_rows({("1e-3", "flare"): [0.1] * 4,
                                                        ("3e-3", "flare"): [0.2] * 4})]
    rep = report(rows, tmp_path)
    selection_report(rep)
    text = "\n".join(rep.lines)
    assert "No choice: no run has a validation metric (`val_rel_l2`)" in text
    assert "Chosen" not in text and not (tmp_path / "selection.csv").exists()
    waiting = report([changed(r, status="pending") for r in rows], tmp_path)
    selection_report(waiting)
    assert "No choice yet: none of the 8 runs has finished." in waiting.lines


T_975 = {6: 2.5705818366147395, 5: 2.7764451051977987}  # n pairs: t.ppf(0.975, n - 1)


def test_paired_differences_and_their_interval_by_hand(tmp_path):
    """FLARE++ - FLARE and FLARE++ (simple) - FLARE per (seed, draw), against a hand
    computation: mean, sample std, n and mean +- t(0.975, n-1) std / sqrt(n). A failed run
    leaves its pair out; a run above the constant predictor's train error is counted as
    not fitted and kept. The interval that holds 0 is said to be not significant."""
    pairs = [(s, d) for s in (0, 1, 2) for d in ("A", "B")]
    flare = [0.100, 0.110, 0.090, 0.105, 0.095, 0.120]
    plus = [0.080, 0.100, 0.085, 0.090, 0.070, 0.100]       # clearly lower
    simple = [0.110, 0.100, 0.095, 0.100, 0.105, 0.115]     # either way
    rows = ([row("flare", s, d, None, v) for (s, d), v in zip(pairs, flare)]
            + [row("flarepp", s, d, None, v) for (s, d), v in zip(pairs, plus)]
            + [row("flarepp-simple", s, d, None, v) for (s, d), v in zip(pairs, simple)])
    rows[-1] = row("flarepp-simple", 2, "B", None, None, status="failed")
    rows[0] = changed(rows[0], train_value=0.7)
    for b, values, n in (("flarepp", plus, 6), ("flarepp-simple", simple[:5], 5)):
        diffs = np.asarray(values) - np.asarray(flare[:n])
        mean = sum(diffs) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (n - 1))
        half = T_975[n] * std / math.sqrt(n)
        got = interval(paired_differences(rows, "flare", b))
        assert got["n"] == n and got["mean"] == pytest.approx(mean)
        assert got["std"] == pytest.approx(std)
        assert (got["low"], got["high"]) == (pytest.approx(mean - half),
                                             pytest.approx(mean + half))
    rep = report([changed(r, lr=None) for r in rows], tmp_path)
    rep.study.points[0].labels = {"model.mixer": None, "seed": None, "data_root": None}
    paired_report(rep)
    text = "\n".join(rep.lines)
    table = {r["B"]: r for r in csv.DictReader(open(tmp_path / "paired.csv"))}
    assert table["flarepp"]["verdict"] == "flarepp better than flare at 95%"
    assert table["flarepp-simple"]["verdict"] == "not significant at 95%"
    assert "flarepp-simple - flare: the difference is not significant at 95%" in text
    assert "| flare | 6/6 |" in text and "| flarepp-simple | 5/6 |" in text
    flare_line = next(line for line in text.splitlines() if line.startswith("| flare | 6/6"))
    assert flare_line.endswith("| 1 | 0 |")  # one did not fit, none failed
    assert "1 of 18 runs did not fit their training data: 1e-3_flare_0_A." in text
    assert "1 of 18 runs failed: 1e-3_flarepp-simple_2_B." in text
    assert "flarepp - flare: the difference" not in text


def test_length_plots_the_metric_against_epochs_per_mixer(tmp_path):
    """The `length` plug-in: per mixer and epoch count, mean +- sample std over (seed,
    draw) of the headline, raw and EMA test values, checked against numbers written here;
    a run that did not fit is counted at its length; the figure and CSV are written. With
    one length it writes nothing. A failure means the training-length figure of
    docs/results.md would show other numbers than its runs."""
    rows = []
    values = {("flare", 10): [0.30, 0.34], ("flare", 40): [0.20, 0.22],
              ("flarepp", 10): [0.28, 0.30], ("flarepp", 40): [0.15, 0.19]}
    for (mixer, epochs), tests in values.items():
        for seed, v in enumerate(tests):
            rows.append(changed(row(mixer, seed, "A", None, v), epochs=epochs, value_raw=v,
                                value_ema=v + 0.01, point=f"{mixer}_{epochs}_{seed}"))
    rows[1] = changed(rows[1], train_value=0.9)
    for status in ("failed", "pending"):  # counted at their length, no value
        rows.append(changed(row("flare", 7, "A", None, None, status=status), epochs=40,
                            point=f"flare_40_{status}"))
    rep = report(rows, tmp_path)
    rep.study.points[0].labels = {"epochs": None, "model.mixer": None, "seed": None}
    length_report(rep)
    table = {(r["mixer"], int(r["epochs"])): r
             for r in csv.DictReader(open(tmp_path / "length.csv"))}
    for key, tests in values.items():
        got = table[key]
        assert float(got["test_mean"]) == pytest.approx(sum(tests) / 2)
        assert float(got["test_std"]) == pytest.approx(abs(tests[0] - tests[1]) / math.sqrt(2))
        assert float(got["ema_mean"]) == pytest.approx(sum(tests) / 2 + 0.01)
        assert got["finished"] == "2"
    assert table[("flare", 10)]["did_not_fit"] == "1" and table[("flare", 40)]["did_not_fit"] == "0"
    assert (table[("flare", 40)]["runs"], table[("flare", 40)]["failed"]) == ("4", "1")
    assert table[("flarepp", 40)]["runs"] == "2"
    assert (tmp_path / "length.png").stat().st_size > 0
    assert "## The metric against training length" in "\n".join(rep.lines)
    one = report([r for r in rows if r.epochs == 10], tmp_path / "one")
    one.study.points[0].labels = rep.study.points[0].labels
    length_report(one)
    assert one.lines == [] and not (tmp_path / "one").exists()


# -- the study end to end ----------------------------------------------------------------------

@pytest.mark.slow
def test_a_sweep_over_settings_mixers_seeds_and_draws_chooses_and_pairs(tmp_path):
    """`flarepp sweep darcy-tiny --grid lr=.. model.mixer=.. seed=.. data_root=D0,D1 --set
    val_fraction=0.25` on two generated Darcy draws, then `flarepp sweep report`: every run
    stores its validation error, and the report holds the choice and the paired table."""
    from flarepp.cli import main
    draws = []
    for seed in (0, 1):
        root = tmp_path / f"draw{seed}"
        assert main(["data", "make", "darcy", "--out", str(root), "--train", "8", "--test",
                     "2", "--resolution", "6", "--seed", str(seed), "--quiet"]) == 0
        draws.append(str(root))
    out = tmp_path / "sw"
    sets = ["dataset_options.n_train=8", "dataset_options.n_test=2",
            "dataset_options.resolution=6", "model.dim=8", "model.heads=2", "model.blocks=1",
            "model.latents=4", "epochs=1", "batch_size=4", "val_fraction=0.25", "device=cpu"]
    assert main(["sweep", "darcy-tiny", "--grid", "lr=1e-3,3e-3", "model.mixer=flare,flarepp",
                 "seed=0,1", f"data_root={','.join(draws)}",
                 *[a for s in sets for a in ("--set", s)], "--out", str(out), "--quiet"]) == 0
    metrics = [json.loads(p.read_text()) for p in out.glob("runs/*/metrics.json")]
    assert len(metrics) == 16
    assert all(math.isfinite(m["val_rel_l2_raw"]) and "val_rel_l2_ema" in m
               and m["train_constant_rel_l2"] > 0 for m in metrics)
    assert main(["sweep", "report", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "## A setting chosen on validation" in text and "Chosen: `lr` = " in text
    assert "## Mixers compared, paired by seed and data draw" in text
    paired = list(csv.DictReader(open(out / "paired.csv")))
    assert [(r["lr"], r["B"], r["pairs"]) for r in paired] == [("1e-3", "flarepp", "4"),
                                                                ("3e-3", "flarepp", "4")]
