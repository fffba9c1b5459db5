"""Both weights reported: every evaluation scores the raw (trained) weights and their EMA
copy; ``metrics.json``, the log, ``flarepp eval`` and the curves carry both, and the run
config's ``eval_weights`` names the headline (``raw`` by default, as the FLARE study reports;
``ema`` for runs stored before the field existed). A failure points to the trainer's
evaluation (flarepp.train.loop), ``evaluate_checkpoint`` (flarepp.inference.evaluate), the
reading of stored configs (``RunConfig.from_stored``) or the curve series (flarepp.plots)."""

from __future__ import annotations

import csv
import dataclasses
import json
import shutil
from pathlib import Path

import matplotlib.figure
import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from flarepp.plots import Panel, plot_curves, weight_series
from flarepp.storage.config import VERSION_KEY, RunConfig
from flarepp.train import evaluate_checkpoint, get_preset, latest_checkpoint, train

TINY = ["epochs=3", "checkpoint_every=1", "batch_size=4",
        "dataset_options={'resolution': 8, 'n_train': 12, 'n_test': 4}",
        "model.dim=16", "model.heads=2", "model.blocks=2", "model.latents=4"]
OLD_RUN = Path(__file__).resolve().parent / "fixtures" / "main_958c132"


@pytest.mark.slow
def test_a_short_run_reports_both_weights_and_names_the_headline(darcy_dir, tmp_path):
    """After 3 epochs the raw and the EMA errors differ (decay 0.99 still weighs the initial
    weights); metrics.json holds both per split, names the headline's weights, and its
    headline is that weights' value; each log record holds both; `flarepp eval` of the last
    checkpoint gives the same numbers. With eval_weights=ema only the headline moves."""
    metrics = train(get_preset("darcy-tiny", TINY), tmp_path / "raw", data_root=darcy_dir,
                    progress=False)
    assert json.loads((tmp_path / "raw" / "metrics.json").read_text()) == metrics
    assert metrics["eval_weights"] == "raw"
    for split in ("test", "train"):
        key = f"{split}_rel_l2"
        assert metrics[key] == metrics[f"{key}_raw"]
        assert abs(metrics[f"{key}_raw"] - metrics[f"{key}_ema"]) > 1e-3 * metrics[key]
    log = [json.loads(line) for line in
           (tmp_path / "raw" / "log.jsonl").read_text().splitlines()]
    assert len(log) == 3
    for record in log:
        assert record["eval_weights"] == "raw"
        assert record["test_rel_l2"] == record["test_rel_l2_raw"] != record["test_rel_l2_ema"]
    assert log[-1]["test_rel_l2_ema"] == metrics["test_rel_l2_ema"]

    evaluated = evaluate_checkpoint(latest_checkpoint(tmp_path / "raw"), device="cpu")
    assert evaluated["eval_weights"] == "raw"
    for key in ("test_rel_l2", "test_rel_l2_raw", "test_rel_l2_ema", "train_rel_l2_raw",
                "train_rel_l2_ema"):
        assert evaluated[key] == pytest.approx(metrics[key], rel=1e-6), key

    ema = train(get_preset("darcy-tiny", TINY + ["eval_weights=ema"]), tmp_path / "ema",
                data_root=darcy_dir, progress=False)
    assert ema["eval_weights"] == "ema" and ema["test_rel_l2"] == ema["test_rel_l2_ema"]
    for key in ("test_rel_l2_raw", "test_rel_l2_ema", "train_rel_l2_raw", "train_rel_l2_ema"):
        assert ema[key] == metrics[key], key   # the same training, only the headline moved


def test_stored_configs_without_the_field_report_ema():
    """A config stored before eval_weights existed (unversioned, or version 2) reads as
    ``ema``, what those runs reported; a config written today, or a user's file without
    the field, gets ``raw``; another value is refused."""
    fresh = get_preset("darcy-tiny")
    assert fresh.eval_weights == "raw"
    assert RunConfig.from_stored(json.loads(json.dumps(fresh.to_file()))).eval_weights == "raw"
    version2 = fresh.to_file()
    version2[VERSION_KEY] = 2
    del version2["protocol"]["eval_weights"]
    assert RunConfig.from_stored(version2).eval_weights == "ema"
    assert RunConfig.from_dict(version2).eval_weights == "raw"
    old = json.loads((OLD_RUN / "run" / "config.json").read_text())
    assert VERSION_KEY not in old and RunConfig.from_stored(old).eval_weights == "ema"
    with pytest.raises(ValueError, match="eval_weights must be one of raw, ema"):
        get_preset("darcy-tiny", ["eval_weights=last"])


def test_stored_configs_without_final_eval_train_read_as_auto():
    """``final_eval_train`` (issue 38) is a runtime field with a default: a config stored
    before it (today's format without the key, or the unversioned fixture) loads as
    ``auto`` with the identity it had, so resuming and evaluating old runs still work; an
    unknown word or a count below 1 is refused naming the option."""
    fresh = get_preset("darcy-tiny")
    stored = json.loads(json.dumps(fresh.to_file()))
    del stored["runtime"]["final_eval_train"]
    assert RunConfig.from_stored(stored).final_eval_train == "auto"
    assert RunConfig.from_stored(stored).identity() == fresh.identity()
    old = json.loads((OLD_RUN / "run" / "config.json").read_text())
    assert RunConfig.from_stored(old).final_eval_train == "auto"
    assert get_preset("darcy-tiny", ["final_eval_train=3"]).final_eval_train == 3
    for bad in ("final_eval_train=some", "final_eval_train=0"):
        with pytest.raises(ValueError, match="final_eval_train must be one of auto, all, none"):
            get_preset("darcy-tiny", [bad])


@pytest.mark.slow
def test_an_old_run_still_reports_its_ema_error(tmp_path):
    """`evaluate_checkpoint` of a run directory written before eval_weights existed names
    EMA as its headline, whose value is the test error that run stored."""
    shutil.copytree(OLD_RUN, tmp_path / "old")
    stored = json.loads((tmp_path / "old" / "run" / "metrics.json").read_text())
    got = evaluate_checkpoint(tmp_path / "old" / "run" / "checkpoints" / "epoch_0002.pt",
                              data_root=tmp_path / "old" / "data", device="cpu")
    assert got["eval_weights"] == "ema"
    assert got["test_rel_l2"] == got["test_rel_l2_ema"]
    assert got["test_rel_l2"] == pytest.approx(stored["test_rel_l2"], rel=1e-5)
    assert got["test_rel_l2_raw"] != pytest.approx(stored["test_rel_l2"], rel=1e-5)


def test_curves_draw_both_weights_and_an_old_log_its_one_line(tmp_path, monkeypatch):
    """A log with both weights draws two lines (raw, EMA), not the headline a third time;
    a log written before holds only the headline key, drawn once as the EMA weights'."""
    drawn = []

    def record_lines(fig, path, **kw):
        drawn.append([line.get_label() for ax in fig.axes for line in ax.get_lines()])
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record_lines)
    panels = [Panel("test relative L2 [%]", weight_series("test_rel_l2", "test", 100.0))]
    new = {"epoch": 1, "train_loss": 1.0, "test_rel_l2": 0.2, "test_rel_l2_raw": 0.2,
           "test_rel_l2_ema": 0.5, "eval_weights": "raw"}
    old = {"epoch": 1, "train_loss": 1.0, "test_rel_l2": 0.5}
    for records in ([new], [old]):
        (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        plot_curves(tmp_path, panels)
    assert drawn == [["test (raw weights)", "test (EMA weights)"], ["test (EMA weights)"]]


def test_with_ema_decay_0_the_ema_copy_is_the_weights():
    """The trainer evaluates a run with ``ema_decay`` 0 (the LRA presets: no EMA) once and
    reports that value for both weights; this holds because the averaged copy then equals
    the weights bit for bit after every update."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 1))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.0), use_buffers=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        ema.update_parameters(model)
        for mine, averaged in zip(model.state_dict().values(),
                                  ema.module.state_dict().values()):
            assert torch.equal(mine, averaged)


def test_a_report_reads_the_headline_and_shows_both_weights(tmp_path):
    """A study holding a run finished before both weights were stored (its one test value
    is the EMA weights') and one after: results.csv and report.md give each run's headline,
    the weights it names, and raw and EMA columns where known (no training here)."""
    from flarepp.experiments.engine import Point, Study, create_study, run_dir
    from flarepp.experiments.reports import write_report
    base = get_preset("darcy-tiny")
    points = [Point(f"seed-{s}", dataclasses.replace(base, seed=s), {"seed": s})
              for s in (0, 1)]
    study = create_study(tmp_path, Study("sweep", points, ["runs", "seeds"]))
    stored = [{"test_rel_l2": 0.5, "train_rel_l2": 0.4},
              {"test_rel_l2": 0.2, "test_rel_l2_raw": 0.2, "test_rel_l2_ema": 0.3,
               "train_rel_l2": 0.1, "eval_weights": "raw"}]
    for point, metrics in zip(study.points, stored):
        directory = run_dir(tmp_path, point)
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps(point.config.to_file()))
        (directory / "metrics.json").write_text(json.dumps(metrics))
    paths = write_report(tmp_path)
    rows = list(csv.DictReader(open(paths["csv"])))
    assert [(r["weights"], r["value"], r["value_raw"], r["value_ema"]) for r in rows] == [
        ("ema", "0.5", "", "0.5"), ("raw", "0.2", "0.2", "0.3")]
    text = paths["markdown"].read_text()
    assert "| weights | raw | EMA |" in text and "| ema | - | 0.5 |" in text
    assert "| weights | test (raw) | test (EMA) |" in text
    assert "| ema/raw | 0.2 | 0.4 ± 0.1414 |" in text   # a mixed group says so


def test_eval_in_another_precision_names_it_and_stays_close(tmp_path):
    """`flarepp eval --precision bf16` of an FP32 run (the stored fixture run) runs the model
    under BF16 autocast: its metrics name the precision, differ from the FP32 ones (the
    products really ran in BF16) by far less than paper D.2's 8% budget, and an unknown
    precision is refused with the known ones named."""
    from flarepp.cli import main
    checkpoint = OLD_RUN / "run" / "checkpoints" / "epoch_0002.pt"
    got = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / f"{precision}.json"
        assert main(["eval", str(checkpoint), "--data", str(OLD_RUN / "data"), "--device",
                     "cpu", "--precision", precision, "--json", str(out)]) == 0
        got[precision] = json.loads(out.read_text())
        assert got[precision]["precision"] == precision
    fp32, bf16 = got["fp32"]["test_rel_l2"], got["bf16"]["test_rel_l2"]
    assert fp32 != bf16 and abs(bf16 / fp32 - 1) < 0.08
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, fp16"):
        evaluate_checkpoint(checkpoint, data_root=OLD_RUN / "data", device="cpu",
                            precision="fp8")
