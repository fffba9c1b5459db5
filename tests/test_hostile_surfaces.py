"""The hostile probe of issue 34 over the surfaces of issues 30-32: `data convert`, the store,
`export` / `eval` / `flarepp.load` on copied or moved runs, the predictor's inputs, the
launcher's options. Each case here was a defect: a silent wrong file read, a store a later
command refused, numpy's words, or a traceback in a thread."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import pytest

from flarepp.cli import CLIError, main
from flarepp.data import DataError
from flarepp.data.spec import SplitSpec, SpecError
from flarepp.data.store import StoreWriter
from flarepp.inference.predictor import PredictorError
from flarepp.storage.rundir import RunDir

NAMES = ["test/case_0", "test/case_1", "train/case_0", "train/case_1", "train/case_2"]


@pytest.mark.parametrize("split, said", [
    (SplitSpec(test="*"), "the split leaves no training case"),
    (SplitSpec(test="zzz*"), "matches none of the 5 cases"),
    (SplitSpec(test="test/*", val="train/*"), "the split leaves no training case"),
])
def test_a_split_that_leaves_a_split_empty_is_refused(split, said):
    """`data convert --test-pattern '*'` wrote a store of 0 training samples with exit 0
    (training then failed on "no values to compute statistics from"); a pattern matching
    nothing wrote one without test samples. Both are a usage sentence before any sample."""
    with pytest.raises(SpecError, match=said):
        split.assign(NAMES)
    assert SplitSpec(test="test/*").assign(NAMES) == {"train": NAMES[2:], "test": NAMES[:2]}


def test_a_store_of_no_sample_yet_is_replaced_by_another_spec(tmp_path):
    """A conversion that failed before its first sample (a misspelt array) left a store of
    only convert.json, and the corrected command was refused ("holds a store made
    otherwise ... --overwrite"). With nothing to lose it is replaced; a store holding
    samples is still refused."""
    root = tmp_path / "store"
    StoreWriter(root, {"spec": "misspelt"}).close()
    with StoreWriter(root, {"spec": "corrected"}) as writer:
        writer.write("train/a", {"u": np.zeros((3, 1), np.float32)}, {"source": {}})
    with pytest.raises(DataError, match="holds a store made otherwise"):
        StoreWriter(root, {"spec": "another"})


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from tests.tiny_runs import tiny_darcy_run
    return tiny_darcy_run(tmp_path_factory.mktemp("run"))[1]


@pytest.mark.slow
def test_a_copied_run_reads_its_own_checkpoint(tiny_run, tmp_path, capsys):
    """metrics.json stores the absolute path of the reported checkpoint: a copy of a run
    (`cp -r run copy`) read the original's file in `export`, `flarepp.load` and `infer`,
    so a corrupt or edited copy was exported from the original with exit 0. The reported
    checkpoint is always the run directory's own file of that name."""
    copy = tmp_path / "copy"
    shutil.copytree(tiny_run, copy)
    named = RunDir(copy).read_metrics()["checkpoint"]
    assert Path(named).is_file() and not Path(named).is_relative_to(copy)
    assert RunDir(copy).reported_checkpoint() == copy / "checkpoints" / Path(named).name
    own = copy / "checkpoints" / Path(named).name
    own.write_bytes(own.read_bytes()[:1000])
    assert main(["export", str(copy), "--format", "safetensors",
                 "--out", str(tmp_path / "m.safetensors")]) == 1
    err = capsys.readouterr().err
    assert str(own) in err and "corrupt, truncated" in err
    assert not (tmp_path / "m.safetensors").exists()


@pytest.mark.slow
def test_eval_takes_a_run_directory_as_infer_export_and_load_do(tiny_run, tmp_path):
    """`flarepp eval RUN` evaluates the run's reported checkpoint: the metrics of `eval
    RUN/checkpoints/<reported>`. It was refused ("is a directory; give a checkpoint file")
    where `infer`, `export` and `flarepp.load` take a run directory (issue 41, 24)."""
    import json
    reported = RunDir(tiny_run).reported_checkpoint()
    assert main(["eval", str(tiny_run), "--device", "cpu", "--json",
                 str(tmp_path / "dir.json")]) == 0
    assert main(["eval", str(reported), "--device", "cpu", "--json",
                 str(tmp_path / "file.json")]) == 0
    by_dir, by_file = (json.loads((tmp_path / f).read_text()) for f in ("dir.json", "file.json"))
    assert by_dir["test_rel_l2"] == by_file["test_rel_l2"] and by_dir.keys() == by_file.keys()
    assert main(["eval", str(tmp_path / "absent")]) == 1


@pytest.mark.slow
def test_export_of_a_checkpoint_writes_beside_it_outside_a_run(tiny_run, tmp_path):
    """`export dir/inner/ckpt.pt` without --out writes dir/inner/model.<format> (beside
    the checkpoint, as no run holds it), where it wrote into dir/; a run's own checkpoint
    still exports into the run directory (issue 41, 24)."""
    inner = tmp_path / "dir" / "inner"
    inner.mkdir(parents=True)
    shutil.copy(RunDir(tiny_run).reported_checkpoint(), inner / "ckpt.pt")
    assert main(["export", str(inner / "ckpt.pt"), "--format", "safetensors"]) == 0
    assert (inner / "model.safetensors").is_file()
    assert not (tmp_path / "dir" / "model.safetensors").exists()
    assert main(["export", str(RunDir(tiny_run).reported_checkpoint()), "--format",
                 "safetensors"]) == 0
    assert (tiny_run / "model.safetensors").is_file()


@pytest.mark.slow
def test_export_never_replaces_the_runs_own_files(tiny_run, tmp_path):
    """`export --out RUN/checkpoints/epoch_N.pt` replaced the run's checkpoint (the file it
    read) with the export, `--out RUN/config.json` its config, each with exit 0 (the serve
    and import probe of issue 41); a checkpoint outside any run is refused as --out too."""
    run = RunDir(tiny_run)
    checkpoint = run.reported_checkpoint()
    kept = {p: p.read_bytes() for p in (checkpoint, run.config_path)}
    for out in (checkpoint, run.config_path):
        assert main(["export", str(tiny_run), "--format", "safetensors", "--out",
                     str(out)]) == 2
    shutil.copy(checkpoint, tmp_path / "ckpt.pt")
    assert main(["export", str(tmp_path / "ckpt.pt"), "--format", "safetensors", "--out",
                 str(tmp_path / "ckpt.pt")]) == 2
    assert all(p.read_bytes() == data for p, data in kept.items())


@pytest.mark.slow
def test_the_predictor_refuses_an_empty_batch_and_complex_numbers(tiny_run):
    """`predict` of a batch of 0 meshes raised numpy's "need at least one array to
    concatenate"; complex inputs lost their imaginary parts with only a ComplexWarning."""
    import flarepp
    predictor = flarepp.load(tiny_run, device="cpu")
    points = np.random.rand(2, 81, 2).astype(np.float32)
    features = np.random.rand(2, 81, 1).astype(np.float32)
    assert predictor.predict(points, features=features).shape == (2, 81, 1)
    with pytest.raises(PredictorError, match="a batch of 0 meshes"):
        predictor.predict(points[:0], features=features[:0])
    with pytest.raises(PredictorError, match="points: complex numbers"):
        predictor.predict(points + 1j, features=features)


@pytest.mark.parametrize("grace", ["inf", "nan", "0", "-1"])
def test_claim_grace_must_be_finite_and_positive(grace):
    """`--claim-grace inf` trained with a traceback from the heartbeat thread (a wait of
    inf / 10 s overflows time_t): a usage error, as 0 and NaN are."""
    from flarepp.cli.launcher import launch_spec
    args = argparse.Namespace(claim_grace=float(grace), launcher=None, workers=None,
                              time=None, partition=None, account=None, qos=None,
                              gpus_per_task=None, cpus_per_task=None, sbatch=None,
                              wait=False)
    with pytest.raises(CLIError, match="finite number of seconds > 0"):
        launch_spec(args, [])


@pytest.mark.slow
def test_a_safetensors_export_has_the_mode_of_any_written_file(tiny_run, tmp_path):
    """safetensors' own writer recreated the file with mode 0600 (pt2 and ONNX files got
    0666 filtered by the umask, as every file flarepp writes): now the same."""
    pytest.importorskip("safetensors")
    import os
    out = tmp_path / "m.safetensors"
    assert main(["export", str(tiny_run), "--format", "safetensors", "--out", str(out)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("text, said", [
    ("x\n", "holds no search"), ("[]\n", "not an Optuna journal"),
    ('{"op_code": 99}\n', "not an Optuna journal"),
    ("x\n" + '{"op_code": 0, "worker_id": "w", "study_name": "s", "directions": [1]}\n',
     "not an Optuna journal (JSONDecodeError")])
def test_an_overwritten_optuna_journal_is_a_sentence_naming_it(tmp_path, capsys, text, said):
    """An `optuna.journal` overwritten or edited by hand gave the JSON parser's words
    ("Expecting value: line 1 column 1", exit 2), an assertion from Optuna's replay, or
    (a lone line Optuna skips as cut short) a KeyError traceback in `sweep report`: exit 1
    naming the file."""
    pytest.importorskip("optuna")
    from flarepp.experiments.engine import create_study
    from flarepp.experiments.search import search_spec
    from flarepp.experiments.studies import parse_axes, sweep_study
    out = tmp_path / "search"
    point = sweep_study("npz", parse_axes(["seed=0,1"]), data="d.npz").points[0]
    spec = search_spec("npz", parse_axes(["lr=1e-4:1e-2:log"]), data="d.npz")
    create_study(out, spec.study([point], 2, out))
    (out / "optuna.journal").write_text(text)
    assert main(["sweep", "report", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"flarepp sweep: error: {out / 'optuna.journal'}: ") and said in err


def test_search_choices_that_read_alike_are_one_value():
    """`--search optuna --grid lr=0.001,1e-3` offered one config twice as two choices
    (weighting the sampler toward it), as the grid did before: refused, naming both."""
    pytest.importorskip("optuna")
    from flarepp.experiments.search import search_spec
    from flarepp.experiments.studies import parse_axes
    with pytest.raises(ValueError, match="choices 0.001 and 1e-3 read as the same config"):
        search_spec("npz", parse_axes(["lr=0.001,1e-3"]), data="d.npz")
    search_spec("npz", parse_axes(["lr=0.001,2e-3"]), data="d.npz")


def test_a_plan_checks_claim_grace_before_anything(tmp_path, capsys):
    """`sweep --plan FILE --claim-grace inf` skipped the check the grid's options get;
    nothing is made before it."""
    plan = Path(__file__).resolve().parents[1] / "docs" / "results" / "plan.json"
    assert main(["sweep", "--plan", str(plan), "--out", str(tmp_path / "studies"),
                 "--claim-grace", "inf"]) == 2
    assert "--claim-grace must be a finite number" in capsys.readouterr().err
    assert not (tmp_path / "studies").exists()
