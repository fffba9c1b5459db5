"""Run directories written by earlier versions of flarepp still open: evaluated, plotted and
resumed by today's code exactly as they trained (tests/fixtures/main_958c132, written at
commit 958c132, before run configs carried a format version). A failure points to a change
of the checkpoint format, of how a stored config is read (``RunConfig.from_stored``), or of
the numbers a stored model computes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flarepp.cli import main
from flarepp.storage.config import LEGACY_PROTOCOL, VERSION_KEY, RunConfig

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "main_958c132"


@pytest.fixture
def old_run(tmp_path) -> Path:
    shutil.copytree(FIXTURE, tmp_path / "old")
    return tmp_path / "old"


def test_an_old_config_reads_as_it_trained(old_run):
    """The unversioned config.json of an old run is read with the values it trained with;
    the same dict as a user's file gets today's defaults for what it leaves out."""
    stored = json.loads((old_run / "run" / "config.json").read_text())
    assert VERSION_KEY not in stored
    config = RunConfig.from_stored(stored)
    for key, value in stored.items():
        got = getattr(config, key)
        assert (list(got) if isinstance(got, tuple) else got) == value, key
    partial = {k: v for k, v in stored.items() if k not in LEGACY_PROTOCOL}
    assert ({k: getattr(RunConfig.from_stored(partial), k) for k in LEGACY_PROTOCOL}
            == LEGACY_PROTOCOL)


@pytest.mark.slow
def test_an_old_run_evaluates_to_its_stored_metrics(old_run, tmp_path):
    """`flarepp eval` of the old run's last checkpoint gives the test error it stored."""
    stored = json.loads((old_run / "run" / "metrics.json").read_text())
    out = tmp_path / "eval.json"
    assert main(["eval", str(old_run / "run" / "checkpoints" / "epoch_0002.pt"),
                 "--data", str(old_run / "data"), "--device", "cpu", "--json", str(out)]) == 0
    metrics = json.loads(out.read_text())
    assert metrics["test_rel_l2"] == pytest.approx(stored["test_rel_l2"], rel=1e-5)
    assert metrics["train_rel_l2"] == pytest.approx(stored["train_rel_l2"], rel=1e-5)


@pytest.mark.slow
def test_an_old_run_plots_and_resumes(old_run):
    """`flarepp plot` draws the old run's figures; the run stopped after epoch 1 resumes
    from its own config.json to the epoch-2 error it stored."""
    run = old_run / "run"
    assert main(["plot", str(run), "--cases", "1"]) == 0
    assert (run / "curves.png").stat().st_size > 10_000
    stored = json.loads((run / "metrics.json").read_text())
    (run / "checkpoints" / "epoch_0002.pt").unlink()
    (run / "metrics.json").unlink()
    assert main(["train", "--config", str(run / "config.json"), "--data",
                 str(old_run / "data"), "--out", str(run), "--resume", "--quiet"]) == 0
    resumed = json.loads((run / "metrics.json").read_text())
    assert resumed["test_rel_l2"] == pytest.approx(stored["test_rel_l2"], rel=1e-5)
