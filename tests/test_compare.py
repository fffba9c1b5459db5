"""``flarepp compare`` end to end on a few generated Darcy samples (1 epoch, tiny models)."""

import csv

import pytest

from flarepp.cli import main
from flarepp.data.generators.darcy import make_darcy
from flarepp.experiments import run_comparison

SMALL = ["dataset_options.n_train=4", "dataset_options.n_test=2", "batch_size=2",
         "model.dim=16", "model.heads=2", "model.blocks=1", "model.latents=4"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_darcy(root / "darcy", n_train=4, n_test=2, resolution=22, seed=0, progress=False)
    return root


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


def test_finished_runs_are_reused(data_root, tmp_path):
    """A second call finds each run's metrics.json and trains nothing again."""
    kw = dict(epochs=1, seeds=1, data_root=data_root, overrides=SMALL, log=lambda _: None)
    first = run_comparison(["flare"], ["darcy"], tmp_path, **kw)
    stamp = (tmp_path / "runs/darcy/flare/seed0/metrics.json").stat().st_mtime_ns
    second = run_comparison(["flare"], ["darcy"], tmp_path, **kw)
    assert first == second
    assert (tmp_path / "runs/darcy/flare/seed0/metrics.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="different config"):  # never a stale result
        run_comparison(["flare"], ["darcy"], tmp_path, **{**kw, "epochs": 2})


def test_unknown_model_and_missing_data_are_named(tmp_path):
    assert main(["compare", "--models", "flare,nope", "--out", str(tmp_path)]) == 2
    with pytest.raises(FileNotFoundError, match="flarepp data make darcy"):
        run_comparison(["flare"], ["darcy"], tmp_path, data_root=tmp_path / "none",
                       log=lambda _: None)
