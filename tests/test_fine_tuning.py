"""``flarepp train --init-from RUN``: a new run starting from another run's weights (new
optimiser, its own data), normalisers kept or refitted, recorded in the run; another
architecture refused in a sentence. A failure points to the weights loaded, the normaliser
option or the record in checkpoints, ``metrics.json`` and ``provenance.json``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flarepp.cli import main as cli
from flarepp.storage.checkpoint import CheckpointError, read_checkpoint, rebuild_model
from flarepp.storage.rundir import RunDir

from tiny_runs import TINY as BASE

TINY = [*BASE, "epochs=1", "model.dim=16"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 1-epoch darcy-tiny run (``root/run`` on ``root/data``) and a second data set of
    other coefficients (``root/other``)."""
    from flarepp.data.generators.darcy import make_darcy
    from tiny_runs import tiny_darcy_run
    root = tmp_path_factory.mktemp("tune")
    tiny_darcy_run(root, "epochs=1", "model.dim=16")
    make_darcy(root / "other", n_train=8, n_test=4, resolution=9, seed=5, progress=False)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("normalizers", ["keep", "refit"])
def test_init_from_starts_at_the_source_weights_and_is_recorded(source, normalizers):
    """The new run's model starts at the weights the source reports (before any step), on
    other data; ``keep`` carries the source's normalisers, ``refit`` fits them on the new
    data; the checkpoint, metrics.json and provenance.json name the source checkpoint."""
    from flarepp.train import Trainer, get_preset
    start = RunDir(source / "run").reported_checkpoint()
    out = source / f"tuned-{normalizers}"
    trainer = Trainer(get_preset("darcy-tiny", TINY), out, data_root=source / "other",
                      progress=False, init_from=source / "run", init_normalizers=normalizers)
    want = rebuild_model(read_checkpoint(start), start).state_dict()
    for name, value in trainer.model.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)
    stored = read_checkpoint(start)["normalizers"]
    same = np.array_equal(trainer.task.y_norm.mean, np.asarray(stored["y"]["mean"]))
    assert same == (normalizers == "keep")
    metrics = trainer.fit()
    record = metrics["init_from"]
    assert record["checkpoint"] == str(start.resolve()) and record["normalizers"] == normalizers
    run = RunDir(out)
    assert read_checkpoint(run.latest_checkpoint())["init_from"] == record
    assert run.read_provenance()[-1]["init_from"] == record
    # the suite's one thread per worker is a user's setting: kept, not measured
    assert run.read_provenance()[-1]["threads"]["how"] == "set by OMP_NUM_THREADS"


@pytest.mark.slow
def test_init_from_refuses_another_architecture_and_resume(source, tmp_path, capsys):
    """A source of another width is refused naming the differing key and both values (exit
    1, no run written); ``--init-from`` with ``--resume`` is a usage error (exit 2)."""
    args = ["train", "darcy-tiny", "--data", str(source / "data"), "--quiet",
            "--init-from", str(source / "run")]
    sets = [x for item in TINY for x in ("--set", item)]
    code = cli([*args, *sets, "--set", "model.dim=8", "--out", str(tmp_path / "wide")])
    err = capsys.readouterr().err
    assert code == 1 and "its model differs from this run's in dim 16 (this run: 8)" in err
    assert not RunDir(tmp_path / "wide").checkpoints()
    code = cli([*args, *sets, "--resume", "--out", str(tmp_path / "r")])
    assert code == 2 and "give one of them" in capsys.readouterr().err


def test_init_normalizers_is_checked():
    """An unknown ``init_normalizers`` is refused before anything is built."""
    from flarepp.train import Trainer, get_preset
    with pytest.raises(ValueError, match="init_normalizers must be one of keep, refit"):
        Trainer(get_preset("darcy-tiny", TINY), "unused", init_normalizers="fit")
