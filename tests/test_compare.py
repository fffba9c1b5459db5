"""``flarepp compare`` end to end on a few generated Darcy samples (1 epoch, tiny models)."""

import csv

import pytest

from flarepp.cli import main
from flarepp.data.generators.darcy import make_darcy
from flarepp.experiments import create_study, run_study
from flarepp.experiments.engine import StudyConflict
from flarepp.experiments.studies import compare_study

SMALL = ["dataset_options.n_train=4", "dataset_options.n_test=2", "batch_size=2",
         "model.dim=16", "model.heads=2", "model.blocks=1", "model.latents=4"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_darcy(root / "darcy", n_train=4, n_test=2, resolution=22, seed=0, progress=False)
    return root


@pytest.mark.slow
def test_compare_writes_table1_shaped_outputs(data_root, tmp_path, capsys):
    """Two models x two seeds: one CSV line per run, a Markdown table with one row per
    model (Table 1 labels, mean ± spread in %), a table CSV and a chart."""
    out = tmp_path / "cmp"
    argv = ["compare", "--models", "flarepp,transolver", "--datasets", "darcy",
            "--epochs", "1", "--seeds", "2", "--data-root", str(data_root), "--out", str(out),
            "--quiet"] + [a for item in SMALL for a in ("--set", item)]
    assert main(argv) == 0
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert sorted((r["model"], r["seed"]) for r in rows) == [
        ("flarepp", "0"), ("flarepp", "1"), ("transolver", "0"), ("transolver", "1")]
    assert all(0 < float(r["test_rel_l2"]) < 10 for r in rows)
    table = (out / "table.md").read_text()
    assert "| Model | darcy (484 points) |" in table
    assert table.index("| Transolver |") < table.index("FLARE++")  # Table 1's row order
    assert " ± " in table
    wide = list(csv.DictReader(open(out / "table.csv")))
    assert [w["model"] for w in wide] == ["transolver", "flarepp"]
    assert all(w["darcy_seeds"] == "2" for w in wide)
    assert (out / "comparison.png").stat().st_size > 0
    assert "FLARE++" in capsys.readouterr().out


@pytest.mark.slow
def test_finished_runs_are_reused(data_root, tmp_path):
    """A second call finds each run finished (its config and data unchanged) and trains
    nothing again; another config in the same directory is refused, never a stale table
    entry."""
    kw = dict(epochs=1, seeds=1, data_root=data_root, overrides=SMALL)
    study = create_study(tmp_path, compare_study(["flare"], ["darcy"], **kw))
    assert run_study(study, tmp_path, log=lambda _: None)["finished"] == ["darcy/flare/seed0"]
    stamp = (tmp_path / "runs/darcy/flare/seed0/metrics.json").stat().st_mtime_ns
    assert run_study(study, tmp_path, log=lambda _: None)["reused"] == ["darcy/flare/seed0"]
    assert (tmp_path / "runs/darcy/flare/seed0/metrics.json").stat().st_mtime_ns == stamp
    with pytest.raises(StudyConflict, match="epochs differ"):
        create_study(tmp_path, compare_study(["flare"], ["darcy"], **{**kw, "epochs": 2}))


def test_unknown_model_and_missing_data_are_named(tmp_path):
    assert main(["compare", "--models", "flare,nope", "--out", str(tmp_path)]) == 2
    with pytest.raises(FileNotFoundError, match="flarepp data make darcy"):
        compare_study(["flare"], ["darcy"], data_root=tmp_path / "none")
