"""The LRA sequence task (flarepp.tasks.sequence), its presets, `flarepp lra train` and
`flarepp lra compare`, on a generated ListOps set of a few dozen sequences and a tiny
Retrieval pickle written in the FLARE study's format."""

import json
import math
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flarepp.cli import main as cli
from flarepp.data.lra import make_listops
from flarepp.train.lra_benchmarks import LRA_BENCHMARKS
from flarepp.tasks import TASKS, build_task
from flarepp.train import PRESETS, apply_overrides
from flarepp.train.presets import lra_run_config

TINY_MODEL = ["model.dim=16", "model.heads=2", "model.blocks=1", "model.latents=4",
              "batch_size=8"]
SMALL = ["--limit", "train=24", "--limit", "val=12", "--limit", "test=12", "--steps", "9"]


@pytest.fixture(scope="module")
def listops(tmp_path_factory):
    """48 / 12 / 12 ListOps expressions of 11-59 tokens in the release's TSV format."""
    root = tmp_path_factory.mktemp("listops")
    make_listops(root, n_train=48, n_val=12, n_test=12, min_length=10, max_length=60,
                 progress=False)
    return root


def listops_config(root, *extra, mixer="flarepp"):
    config = lra_run_config("listops", "tiny", mixer, steps=9,
                            split_limits={"train": 24, "val": 12, "test": 12},
                            data_root=str(root))
    return apply_overrides(config, [*TINY_MODEL, *extra])


def train_args(root, out, *extra):
    sets = [a for item in TINY_MODEL for a in ("--set", item)]
    return ["lra", "train", "listops", "--data", str(root), "--out", str(out), "--quiet",
            "--device", "cpu", *SMALL, *sets, *extra]


def test_presets_read_the_task_table():
    """Every LRA task has a paper and a tiny preset whose settings are the table's (with
    FLARE-family overrides), steps turned into whole epochs, EMA off. A failure means a
    preset drifted from flarepp.data.lra.LRA_BENCHMARKS."""
    for task in LRA_BENCHMARKS.names():
        spec = LRA_BENCHMARKS.get(task)
        for size, name in (("paper", f"lra-{task}"), ("tiny", f"lra-{task}-tiny")):
            config, s = PRESETS.get(name), spec.settings(size)
            assert config.task == "sequence" and config.model["mixer"] == "flarepp"
            assert config.ema_decay == 0.0 and config.batch_size == s.batch_size
            assert (config.lr, config.weight_decay, config.grad_clip) == \
                (s.lr, s.weight_decay, s.clip_grad_norm)
            assert config.final_div_factor == s.final_div_factor
            assert config.model["heads"] == s.flare_family.get("heads", s.heads)
            assert config.precision == ("bf16" if s.mixed_precision else "fp32")
            if s.steps is not None:
                per_epoch = math.ceil(s.train_samples / s.batch_size)
                assert config.epochs == math.ceil(s.steps / per_epoch)
                assert (config.epochs - 1) * per_epoch < s.steps <= config.epochs * per_epoch
            else:
                assert config.epochs == s.epochs
    attention = lra_run_config("listops", "paper", "attention")
    assert attention.model["heads"] == LRA_BENCHMARKS.get("listops").paper.heads
    assert attention.model["attn_scale"] is None


def test_task_contract_and_config_checks(listops):
    """Accuracy is the headline and higher is better; a config with a non-LRA dataset, a
    model key the data decides, or another architecture fails with the key named."""
    task_cls = TASKS.get("sequence")
    assert task_cls.headline == "accuracy" and task_cls.lower_is_better is False
    assert task_cls.eval_splits == ("val", "test")
    config = listops_config(listops)
    with pytest.raises(ValueError, match="model.vocab_size comes from the data"):
        apply_overrides(config, ["model.vocab_size=20"])
    with pytest.raises(ValueError, match="Long Range Arena dataset"):
        apply_overrides(config, ["dataset=darcy", "dataset_options={}"])
    with pytest.raises(ValueError, match="split_limit"):
        apply_overrides(config, ["dataset_options.split_limit={'train': 3}"])


def test_loss_is_the_summed_cross_entropy_with_padding(listops):
    """loss / loss_count equals the mean of -log softmax(logits)[label] written out in
    float64, on a batch of different lengths; each sample's logits equal those of the
    sample alone (padding changes nothing). A failure points to a wrong normaliser or to
    padding reaching the classifier."""
    task = build_task(listops_config(listops), listops)
    torch.manual_seed(0)
    model = task.build_model().double()
    items = [task.get("train", i, seed=0) for i in range(6)]
    assert len({len(it["tokens"]) for it in items}) > 1
    batch = task.collate(items)
    assert batch["mask"].sum(1).tolist() == [len(it["tokens"]) for it in items]
    logits = task.forward(model, batch)
    by_hand = torch.stack([-(logits[b] - logits[b].exp().sum().log())[batch["label"][b]]
                           for b in range(6)])
    loss = task.loss(logits, batch, lambda x: x) / task.loss_count(batch, lambda x: x)
    torch.testing.assert_close(loss, by_hand.mean(), rtol=1e-12, atol=1e-12)
    for b, item in enumerate(items):
        alone = task.forward(model, task.collate([item]))
        torch.testing.assert_close(alone[0], logits[b], rtol=1e-10, atol=1e-10)
    same = task.collate([items[0], items[0]])
    assert "mask" not in same  # every token real: the unmasked path, same logits
    torch.testing.assert_close(task.forward(model, same)[1], logits[0], rtol=1e-10,
                               atol=1e-10)
    records = task.eval_records(logits, batch)
    metrics = task.summarize("train", records)
    assert metrics["accuracy"] == np.mean(records["predicted"] == records["label"])
    assert metrics["cross_entropy"] == pytest.approx(float(by_hand.mean().detach()), rel=1e-12)
    assert metrics["chance"] == 0.1


def write_retrieval_pickles(root, rng):
    """``lra-retrieval.{train,dev,test}.pickle``: dicts of two zero-padded byte documents
    (ids + 1, 0 = padding) of one length per file, and a 0/1 label."""
    for split, count in (("train", 8), ("dev", 4), ("test", 4)):
        samples = []
        for _ in range(count):
            doc = {}
            for key in ("input_ids_0", "input_ids_1"):
                ids = np.zeros(24, np.int64)
                n = int(rng.integers(3, 24))
                ids[:n] = rng.integers(1, 257, n)
                doc[key] = ids
            samples.append({**doc, "label": int(rng.integers(0, 2))})
        with open(root / f"lra-retrieval.{split}.pickle", "wb") as handle:
            pickle.dump(samples, handle)


@pytest.mark.slow
def test_retrieval_batches_go_through_two_towers(tmp_path):
    """A two-document batch (the reference's pickles) runs the shared encoder on each
    document and classifies [u, v]: the task's logits equal the towers run one document at
    a time, and one training run finishes. A failure means the second document is dropped
    or the towers see each other's padding."""
    write_retrieval_pickles(tmp_path, np.random.default_rng(0))
    config = apply_overrides(lra_run_config("retrieval", "tiny", data_root=str(tmp_path)),
                             ["dataset=lra-pickle", "dataset_options={'task': 'retrieval'}",
                              "epochs=1", "batch_size=4", *TINY_MODEL])
    task = build_task(config, tmp_path)
    assert task.model_sizes()["two_tower"] and task.data.num_classes == 2
    torch.manual_seed(0)
    model = task.build_model().double()
    batch = task.collate([task.get("train", i, seed=0) for i in range(4)])
    assert {"tokens", "mask", "tokens_1", "mask_1", "label"} <= set(batch)
    logits = task.forward(model, batch)
    assert logits.shape == (4, 2)
    for b in range(4):
        u = model.encode(batch["tokens"][b:b + 1, :int(batch["mask"][b].sum())], None)
        v = model.encode(batch["tokens_1"][b:b + 1, :int(batch["mask_1"][b].sum())], None)
        expected = model.head(model.pooled_norm(torch.cat([u, v], -1)))
        torch.testing.assert_close(logits[b:b + 1], expected, rtol=1e-10, atol=1e-10)
    from flarepp.train import Trainer
    metrics = Trainer(config, tmp_path / "run", task=task, progress=False,
                      device="cpu").fit()
    assert 0.0 <= metrics["test_accuracy"] <= 1.0 and metrics["epochs"] == 1


@pytest.mark.slow
def test_lra_train_resume_eval_and_plot(listops, tmp_path, capsys):
    """`flarepp lra train` end to end: a run stopped after one epoch and resumed ends
    bitwise equal to an uninterrupted one; `flarepp eval` on its checkpoint reproduces the
    accuracies; the EMA weights equal the weights (EMA off); `flarepp plot` draws the
    curves. A failure points to state missing from the checkpoint or to eval building
    another model or other data."""
    assert cli(train_args(listops, tmp_path / "whole")) == 0
    assert cli(train_args(listops, tmp_path / "split", "--stop-after", "1")) == 0
    assert not (tmp_path / "split" / "metrics.json").exists()
    assert cli(train_args(listops, tmp_path / "split", "--resume")) == 0
    whole = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    split = json.loads((tmp_path / "split" / "metrics.json").read_text())
    assert whole["epochs"] == 3  # 9 steps in batches of 8 of 24 samples: 3 epochs
    for key in ("val_accuracy", "test_accuracy"):
        assert whole[key] == split[key]
    a = torch.load(whole["checkpoint"], weights_only=True)
    b = torch.load(split["checkpoint"], weights_only=True)
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
        assert torch.equal(value, a["ema"][name]), name
    capsys.readouterr()
    assert cli(["eval", whole["checkpoint"], "--device", "cpu", "--json",
                str(tmp_path / "eval.json")]) == 0
    again = json.loads((tmp_path / "eval.json").read_text())
    assert again["test_accuracy"] == whole["test_accuracy"]
    assert again["val_accuracy"] == whole["val_accuracy"]
    predictions = (tmp_path / "whole" / "val_predictions.csv").read_text().splitlines()
    assert predictions[0] == "index,label,predicted,nats" and len(predictions) == 13
    assert cli(["plot", str(tmp_path / "whole")]) == 0
    assert (tmp_path / "whole" / "curves.png").stat().st_size > 0
    log = [json.loads(line) for line in (tmp_path / "whole" / "log.jsonl").open()]
    assert [r["epoch"] for r in log] == [1, 2, 3] and all("val_accuracy" in r for r in log)


@pytest.mark.slow
def test_compare_writes_table_and_reuses_runs(listops, tmp_path):
    """`flarepp lra compare` trains tasks x mixers x seeds, writes a Table 12-like table
    (mean and sample std over seeds from the runs' metrics, chance level stated), and a
    second call reuses every finished run. A failure points to a wrong aggregate or to
    runs being retrained."""
    out = tmp_path / "compare"
    sets = [a for item in TINY_MODEL for a in ("--set", item)]
    args = ["lra", "compare", "--tasks", "listops", "--mixers", "flarepp,linear-attention",
            "--seeds", "2", "--data", f"listops={listops}", "--out", str(out), "--quiet",
            "--device", "cpu", *SMALL, *sets]
    assert cli(args) == 0
    runs = sorted(out.glob("runs/listops/*/seed*/metrics.json"))
    assert len(runs) == 4
    stamps = [p.stat().st_mtime_ns for p in runs]
    table = (out / "table.md").read_text()
    for mixer in ("flarepp", "linear-attention"):
        acc = [100 * json.loads((out / f"runs/listops/{mixer}/seed{s}/metrics.json")
                                .read_text())["test_accuracy"] for s in (0, 1)]
        cell = f"{np.mean(acc):.2f} ± {np.std(acc, ddof=1):.2f}"
        assert f"| {mixer} |" in table and cell in table, (mixer, cell, table)
    assert "| *chance (1/K)* | 10.00 |" in table
    rows = (out / "results.csv").read_text().splitlines()
    assert rows[0].startswith("task,mixer,seed,test_accuracy") and len(rows) == 5
    assert cli(args) == 0
    assert [p.stat().st_mtime_ns for p in runs] == stamps
    from flarepp.experiments.engine import StudyConflict, create_study
    from flarepp.experiments.studies import lra_study
    with pytest.raises(StudyConflict, match="another study"):
        create_study(out, lra_study(["listops"], ["flarepp"], seeds=1, steps=18,
                                    split_limits={"train": 24, "val": 12, "test": 12},
                                    data_roots={"listops": str(listops)},
                                    overrides=TINY_MODEL))


@pytest.mark.slow
def test_compare_records_a_diverged_run_and_goes_on(listops, tmp_path):
    """A run whose loss becomes non-finite is recorded in failed.json, left out of the
    table and not retried, and the other runs of the grid still train. A failure means one
    diverging mixer would stop (or silently enter) the whole comparison."""
    from flarepp.experiments.engine import create_study, run_study
    from flarepp.experiments.studies import lra_study
    lines = []
    options = dict(seeds=1, steps=3, split_limits={"train": 24, "val": 12, "test": 12},
                   data_roots={"listops": str(listops)},
                   overrides=[*TINY_MODEL, "lr=1e30", "div_factor=1.0"])
    study = create_study(tmp_path, lra_study(["listops"], ["flarepp", "attention"], **options))
    done = run_study(study, tmp_path, log=lines.append)
    assert done["failed"] == ["listops/flarepp/seed0", "listops/attention/seed0"]
    assert any("failed" in line for line in lines)
    assert (tmp_path / "runs/listops/flarepp/seed0/failed.json").exists()
    assert (tmp_path / "runs/listops/attention/seed0/failed.json").exists()
    lines.clear()
    done = run_study(study, tmp_path, log=lines.append)
    assert done["failed"] == [] and done["finished"] == [] and len(lines) == 2
    assert lines[0].startswith("[1/2] listops/flarepp/seed0: failed before (final, not "
                               "retried): loss became")
