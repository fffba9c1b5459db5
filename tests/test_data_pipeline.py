"""Issue 30's pipeline end to end: a finite-element solver writes one VTU per case (the
elasticity unit cell under a random load, the load as field data), `flarepp data convert`,
`flarepp train` with and without the load as a condition, `flarepp eval`."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pyvista")
pytest.importorskip("skfem")

from flarepp.cli import main  # noqa: E402
from flarepp.data.generators.elasticity import make_elasticity_mesh  # noqa: E402

SMALL = ["--set", "epochs=12", "--set", "model.dim=32", "--set", "model.blocks=2",
         "--set", "model.latents=16", "--set", "checkpoint_every=12", "--quiet"]


@pytest.mark.slow
def test_solver_files_to_a_model_that_uses_the_load(tmp_path, capsys):
    """The stress is linear in the load, so without it a model cannot know the stress's
    magnitude: trained on the converted store, the conditioned model's test error (from
    `flarepp eval` of its checkpoint) is well below the same network's without the
    condition, which is no better than predicting a fixed field. A failure points to
    conditions that do not reach the model, or a pipeline stage that loses the data."""
    cases, store = tmp_path / "cases", tmp_path / "store"
    make_elasticity_mesh(cases, n_train=64, n_test=8, progress=False)
    assert main(["data", "convert", str(cases), "--out", str(store), "--targets", "von_mises",
                 "--conditions", "load", "--test-pattern", "test/*", "--quiet"]) == 0
    assert "conditions: load ['load']" in capsys.readouterr().out
    errors = {}
    for preset, extra in (("store-conditioned-tiny", []),
                          ("store-tiny", ["--set", "dataset_options.conditions=[]"])):
        run = tmp_path / preset
        assert main(["train", preset, "--data", str(store), "--out", str(run), *SMALL,
                     *extra]) == 0
        assert main(["eval", str(run / "checkpoints" / "epoch_0012.pt"), "--json",
                     str(run / "eval.json")]) == 0
        metrics = json.loads((run / "eval.json").read_text())
        stored = json.loads((run / "metrics.json").read_text())
        assert metrics["test_rel_l2"] == pytest.approx(stored["test_rel_l2"], rel=1e-6)
        errors[preset] = (metrics["test_rel_l2"], stored["train_constant_rel_l2"])
    with_load, _ = errors["store-conditioned-tiny"]
    without, constant = errors["store-tiny"]
    assert with_load < 0.85 * without, errors
    assert without > 0.8 * constant, errors
