"""The byte-level language-model task (flarepp.tasks.language), `flarepp generate` and
`flarepp bench generate` on a tiny corpus written here."""

import json
import math

import numpy as np
import pytest
import torch

from flarepp.cli import main as cli
from flarepp.tasks import build_task
from flarepp.tasks.language import held_out_fraction, load_text_files, window
from flarepp.train import get_preset

OPTIONS = {"context": 24, "n_train": 16, "n_test": 8, "test_fraction": 0.3}
TINY_MODEL = ["model.dim=16", "model.heads=2", "model.blocks=1", "model.latents=4"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 small Python files, one in a site-packages folder (to be skipped), one .txt."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        folder = root / f"pkg{i % 3}"
        folder.mkdir(exist_ok=True)
        (folder / f"mod{i}.py").write_text(
            "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(6)))
    (root / "site-packages").mkdir()
    (root / "site-packages" / "vendored.py").write_text("x = 1\n" * 100)
    (root / "notes.txt").write_text("not python\n")
    return root


def make_task(root, overrides=()):
    config = get_preset("lm-tiny", [f"dataset_options={OPTIONS!r}", *TINY_MODEL, *overrides])
    return build_task(config, root)


def test_split_by_file_is_deterministic_and_disjoint(corpus):
    """Every .py file outside site-packages is in exactly one split, decided by its own path
    (the same split whatever other files exist). A failure means the held-out bytes may
    leak into training or change when a file is added."""
    data = load_text_files(corpus, **OPTIONS)
    train, test = set(data.train.files), set(data.test.files)
    assert not train & test and len(train | test) == 40
    assert all(not f.startswith("site-packages") and f.endswith(".py") for f in train | test)
    assert test == {f for f in train | test if held_out_fraction(f) < OPTIONS["test_fraction"]}
    assert 0 < len(test) < 40
    expected = b"".join((corpus / f).read_bytes() for f in sorted(train))
    assert data.train.data.tobytes() == expected
    (corpus / "pkg0" / "zz_new.py").write_text("y = 2\n")
    try:
        again = load_text_files(corpus, **OPTIONS)
        assert set(again.test.files) - {"pkg0/zz_new.py"} == test
    finally:
        (corpus / "pkg0" / "zz_new.py").unlink()


def test_windows_are_deterministic_in_the_seed(corpus):
    """An item is a window of context + 1 bytes whose offset depends on the seed alone: the
    same seed gives the same bytes (any worker, any epoch), other seeds other windows."""
    task = make_task(corpus)
    a = task.get("train", 3, seed=1234, training=True)
    b = task.get("train", 3, seed=1234, training=True)
    np.testing.assert_array_equal(a["ids"], b["ids"])
    assert a["ids"].shape == (OPTIONS["context"] + 1,) and a["ids"].dtype == np.int64
    others = {task.get("train", 3, seed=s)["ids"].tobytes() for s in range(20)}
    assert len(others) > 10
    data = task.corpus.train.data.tobytes()
    assert bytes(a["ids"].astype(np.uint8)) in data
    np.testing.assert_array_equal(window(task.corpus.test, 24, 7),
                                  task.get("test", 0, seed=7)["ids"])


def test_loss_is_the_summed_next_byte_cross_entropy(corpus):
    """loss / loss_count equals -log softmax of the logits at every next byte, written out in
    float64 by hand; bits per byte is that in base 2. A failure points to a shifted target
    (predicting the current byte) or a wrong normaliser."""
    task = make_task(corpus)
    torch.manual_seed(0)
    model = task.build_model().double()
    batch = task.collate([task.get("train", i, seed=i) for i in range(3)])
    with torch.no_grad():
        logits = task.forward(model, batch)
    assert logits.shape == (3, OPTIONS["context"], 256)
    def ident(t):  # one process: token sums are the identity
        return t

    total, count = task.loss(logits, batch, ident), task.loss_count(batch, ident)
    ids = batch["ids"]
    by_hand = 0.0
    for b in range(3):
        for t in range(OPTIONS["context"]):
            row = logits[b, t].double()
            by_hand += float(torch.log(torch.exp(row - row.max()).sum()) + row.max()
                             - row[ids[b, t + 1]])
    assert float(count) == 3 * OPTIONS["context"]
    assert math.isclose(float(total), by_hand, rel_tol=1e-9)
    records = task.eval_records(logits, batch)
    metrics = task.summarize("test", records)
    assert math.isclose(metrics["bits_per_byte"], by_hand / float(count) / math.log(2),
                        rel_tol=1e-9)


@pytest.mark.slow
def test_train_then_generate_and_bench(corpus, tmp_path, capsysbinary):
    """A tiny lm run trains through the one trainer, and `flarepp generate` continues the
    prompt from its checkpoint: greedy output is the prompt plus the requested bytes, written
    as they are (not decoded), and equals the parallel form's argmax. `flarepp bench
    generate` reports a FLARE state that does not grow with the context and a KV cache that
    does."""
    out = tmp_path / "run"
    assert cli(["train", "lm-tiny", "--data", str(corpus), "--out", str(out), "--quiet",
                "--set", f"dataset_options={OPTIONS!r}", "--set", "epochs=2",
                *[a for s in TINY_MODEL for a in ("--set", s)]]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["task"] == "lm" and 0 < metrics["test_bits_per_byte"] < 8.5
    assert (out / "curves.png").is_file()
    capsysbinary.readouterr()
    ckpt = sorted((out / "checkpoints").glob("*.pt"))[-1]
    assert cli(["generate", str(ckpt), "--prompt", "def ", "--max-new-tokens", "12",
                "--temperature", "0", "--device", "cpu"]) == 0
    captured = capsysbinary.readouterr()
    assert captured.out.startswith(b"def ") and b"flare-causal" in captured.err

    from flarepp.models.causal_lm import generate
    from flarepp.storage.checkpoint import load_causal_lm
    model = load_causal_lm(ckpt, device=torch.device("cpu"))
    ids = generate(model, torch.tensor([list(b"def ")]), 12, temperature=0)
    with torch.no_grad():
        greedy = model(ids[:, :-1]).argmax(-1)
    assert torch.equal(greedy[:, 3:], ids[:, 4:])
    assert captured.out == bytes(ids[0].tolist()) + b"\n"

    report = tmp_path / "bench.json"
    assert cli(["bench", "generate", "--contexts", "16,64", "--steps", "2", "--dim", "16",
                "--heads", "2", "--blocks", "1", "--latents", "4", "--prefill-limit", "32",
                "--json", str(report), "--device", "cpu"]) == 0
    points = {(p["mixer"], p["context"]): p for p in json.loads(report.read_text())["points"]}
    flare = [points["flare-causal", n]["state_bytes"] for n in (16, 64)]
    cache = [points["attention-causal", n]["state_bytes"] for n in (16, 64)]
    assert flare[0] == flare[1] == 1 * 2 * 4 * (8 + 2) * 4        # B H M (D + 2) float32
    assert cache == [n * (2 * 2 * 8 * 4 + 1) for n in (16, 64)]  # 2 H D float32 + a flag
    assert points["attention-causal", 64]["prefill"] == "synthetic cache"
