"""Config errors are sentences before any work; a run's config.json trains again; a user's
own npz trains without a preset."""

import json
import os
import resource
import subprocess
import sys

import numpy as np
import pytest

from flarepp.cli import main
from flarepp.train import get_preset

TINY = ["epochs=3", "model.dim=8", "model.heads=2", "model.latents=4", "model.blocks=1",
        "checkpoint_every=3"]


@pytest.mark.slow
def test_unknown_key_fails_before_data_is_touched(tmp_path):
    """`flarepp train darcy-tiny --set model.latnts=3` exits 2 naming latnts and the valid
    keys, before looking at the data (whose directory here does not exist: had the data
    been looked at first, the error would be about it). The bound is on the child's CPU
    time (dominated by `import torch`), loose enough for a loaded machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "flarepp", "train", "darcy-tiny", "--set",
                           "model.latnts=3", "--data", str(tmp_path / "absent"),
                           "--out", str(tmp_path / "run")],
                          capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 2
    assert "latnts" in proc.stderr and "latents" in proc.stderr and "blocks" in proc.stderr
    assert "Traceback" not in proc.stderr and "does not exist" not in proc.stderr
    assert not (tmp_path / "run").exists()
    assert cpu < 10, f"the config error took {cpu:.1f} s of CPU"


@pytest.mark.parametrize("item, named", [
    ("lr=fast", "lr must be of type float"),
    ("model.latents=8.5", "latents must be of type int"),
    ("model.latent=8", "['latent'] unknown to architecture 'surrogate'"),
    ("epochs=2.0", "epochs must be of type int"),
    ("dataset_options.reso=3", "['reso'] unknown to dataset 'darcy'; its options: n_test"),
    ("dataset_options.n_train=many", "n_train must be of type int"),
    ("model.mixer_options.gate=1", "['gate'] unknown to mixer 'flarepp'; its options: "
                                   "gate_logit_init"),
    ("model.mixer=flair", "unknown mixer 'flair'; known mixers:"),
    ("loss=l1", "unknown loss 'l1'; known losses: mse, rel_l2, rel_l2_grad"),
    ("input_norm=minmax", "unknown rule 'minmax'"),
    ("weight_decay_groups=some", "known weight_decay_groups rules: all, reference, weights"),
    ("momentum_cycle=(0.95,0.85)", "momentum_cycle must be (base, max)"),
    ("attn_scale=big", "attn_scale must be a positive number or one of reference, sqrt"),
    ("precision=fp8", "precision must be one of"),
    ("nonsense=1", "unknown key; known keys:"),
    ("model.dim.x=1", "'model.dim' is not a section"),
])
def test_bad_overrides_are_named(item, named):
    with pytest.raises(ValueError) as err:
        get_preset("darcy-tiny", [item])
    assert named in str(err.value)
    assert item.split("=")[0] in str(err.value)


def test_cli_config_errors_are_sentences(tmp_path, capsys):
    assert main(["train", "darcy-tiny", "--set", "lr=fast"]) == 2
    assert "flarepp train: error: run config: lr must be of type float" in \
        capsys.readouterr().err
    assert main(["train"]) == 2
    assert "give a preset" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert main(["train", "--config", str(tmp_path / "bad.json")]) == 2
    assert "expected a JSON object" in capsys.readouterr().err


@pytest.mark.slow
def test_own_npz_trains_and_config_json_feeds_back(tmp_path, capsys):
    """`flarepp train --data my.npz` uses the npz preset; the run's config.json given to
    `--config` trains the same config again (with --set on top)."""
    rng = np.random.default_rng(0)
    x = rng.random((20, 30, 2)).astype(np.float32)
    np.savez(tmp_path / "my.npz", x=x, y=np.cos(2 * x[..., :1]) + x[..., 1:])
    sets = [a for item in TINY for a in ("--set", item)]
    first = tmp_path / "first"
    assert main(["train", "--data", str(tmp_path / "my.npz"), "--out", str(first), "--quiet",
                 *sets]) == 0
    stored = json.loads((first / "config.json").read_text())
    assert stored["name"] == "npz" and stored["data"]["dataset"] == "npz"
    assert stored["protocol"]["loss"] == "rel_l2" and stored["model"]["dim"] == 8
    second = tmp_path / "second"
    assert main(["train", "--config", str(first / "config.json"), "--data",
                 str(tmp_path / "my.npz"), "--out", str(second), "--quiet",
                 "--set", "seed=1"]) == 0
    again = json.loads((second / "config.json").read_text())
    assert again == {**stored, "seed": 1}
    capsys.readouterr()
    assert main(["train", "--config", str(first / "config.json"), "--set",
                 "model.latnts=2"]) == 2
    assert "latnts" in capsys.readouterr().err
    assert main(["train", "darcy-tiny", "--config", str(first / "config.json")]) == 2


@pytest.mark.parametrize("item", ["dataset_options.points_per_step=0",
                                  "dataset_options.n_train=-1", "eval_chunk_size=0"])
def test_a_store_option_out_of_range_is_a_usage_error(tmp_path, capsys, item):
    """Issue 41 #24: `--set dataset_options.points_per_step=0` exited 1 (a data error, raised
    when the store was opened) where every other bad value exits 2; now the config's check
    refuses it before any data is read (exit 2), naming the key, as it does a bad
    `eval_chunk_size`."""
    assert main(["train", "store-tiny", "--data", str(tmp_path), "--out",
                 str(tmp_path / "run"), "--set", item]) == 2
    err = capsys.readouterr().err
    key = item.split("=")[0]
    assert f"{key.split('.')[-1]} must be" in err and f"(with --set {key})" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
