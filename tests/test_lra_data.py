"""Long Range Arena data: generators checked against the task definitions, readers on small
files written in each release's exact format, the in-memory containers and the CLI.

ListOps labels are recomputed by a stack machine over the token string (not the
generator's recursion); Pathfinder labels by a flood fill of the rendered pixels.
"""

from __future__ import annotations

import csv
import gzip
import pickle
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import ndimage

from flarepp.cli import main as cli_main
from flarepp.data.base import DataError
from flarepp.data.lra import LRA_DATASETS, TokenSequences, collate, load_lra
from flarepp.train.lra_benchmarks import LRA_BENCHMARKS
from flarepp.data.lra.images import load_cifar10, load_fashion_mnist, read_idx
from flarepp.data.lra.listops import (
    TOKEN_IDS,
    generate_listops,
    load_listops,
    make_listops,
    sample_expression,
    tokenize,
)
from flarepp.data.lra.pathfinder import (
    DIFFICULTIES,
    MARKER_VALUE,
    PATH_VALUE,
    PathfinderRules,
    generate_pathfinder,
    load_pathfinder,
    make_pathfinder,
)
from flarepp.data.lra.pickles import load_reference_pickles
from flarepp.data.lra.text import load_aan, load_imdb

EIGHT = np.ones((3, 3), int)


# ---------------------------------------------------------------------------------------------
# ListOps

def evaluate_listops(source: str) -> tuple[int, int, list[int], int]:
    """Stack machine over the release's token string: (value, depth, argument counts,
    length). Parentheses are layout only; ``[OP`` opens a frame, ``]`` closes it."""
    stack: list[tuple[str, list[int]]] = []
    depth, counts, length, result = 0, [], 0, None
    for token in source.split():
        if token in ("(", ")"):
            continue
        length += 1
        if token.startswith("["):
            stack.append((token, []))
            depth = max(depth, len(stack))
        elif token == "]":
            op, args = stack.pop()
            counts.append(len(args))
            value = {"[MIN": min, "[MAX": max, "[SM": lambda a: sum(a) % 10,
                     "[MED": lambda a: int(statistics.median(a))}[op](args)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
        else:
            digit = int(token)
            if stack:
                stack[-1][1].append(digit)
                depth = max(depth, len(stack) + 1)
            else:
                result, depth = digit, 1
    assert not stack, "unbalanced expression"
    return result, depth, counts, length


def test_listops_labels_match_an_independent_evaluator():
    """Every generated label equals the stack machine's value; lengths, depth and argument
    counts obey the rules; no expression repeats. A failure points to the generator's
    operator semantics (MED of an even count) or its length bookkeeping."""
    rows = generate_listops(300, seed=3, max_depth=6, max_args=5, min_length=20,
                            max_length=120)
    assert len({source for source, _ in rows}) == len(rows)
    for source, label in rows:
        value, depth, counts, length = evaluate_listops(source)
        assert value == label, source
        assert 20 < length < 120 and depth <= 6
        assert all(2 <= c <= 5 for c in counts)
    assert {label for _, label in rows} == set(range(10))


def test_listops_even_median_is_floored_mean_of_middle_pair():
    """[MED 1 4 ] is 2 (LRA's int(np.median)), not 1 or 4."""
    assert evaluate_listops("( ( ( [MED 1 ) 4 ) ] )")[0] == 2
    from flarepp.data.lra.listops import apply_operator
    for args in ([1, 4], [0, 9, 3, 8], [5, 5, 6, 7], [2, 7, 1]):
        assert apply_operator("[MED", args) == int(np.median(args))


def test_listops_tree_statistics_follow_the_lra_rules():
    """Without a length filter: the root is an operator with probability 0.25 and an
    operator has randint(2, max_args) arguments (seeded, so deterministic)."""
    import random
    rng = random.Random(0)
    roots, counts = 0, []
    for _ in range(4000):
        source, _, _ = sample_expression(rng, max_depth=3, max_args=4, length_limit=10**6)
        _, depth, c, _ = evaluate_listops(source)
        roots += depth > 1
        counts.extend(c)
    assert abs(roots / 4000 - 0.25) < 3 * np.sqrt(0.25 * 0.75 / 4000)
    share = np.bincount(counts, minlength=5)[2:] / len(counts)
    np.testing.assert_allclose(share, 1 / 3, atol=0.05)


def test_listops_tokenizer_matches_the_lra_rule():
    """Vectorised tokenisation == deleting parentheses, ']' -> 'X', whitespace split."""
    rows = generate_listops(50, seed=1, min_length=5, max_length=200)
    tokens = tokenize([s for s, _ in rows])
    for i, (source, _) in enumerate(rows):
        words = source.replace("(", "").replace(")", "").replace("]", "X").split()
        assert tokens[i].tolist() == [TOKEN_IDS[w] for w in words]


def write_listops_tsv(path: Path, rows: list[tuple[str, int]]) -> None:
    """The release's writer: csv, tab delimiter, header, \\r\\n line ends."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t")
        writer.writerow(["Source", "Target"])
        writer.writerows(rows)


def test_listops_reader_on_release_format(tmp_path):
    rows = [("( ( ( [MAX 2 ) 9 ) ] )", 9), ("( ( ( [SM 8 ) ( ( ( [MIN 4 ) 7 ) ] ) ) ] )", 2)]
    for split in ("train", "val", "test"):
        write_listops_tsv(tmp_path / f"basic_{split}.tsv", rows)
    data = load_listops(tmp_path)
    ids = [TOKEN_IDS[t] for t in ("[MAX", "2", "9", "X")]
    assert data.splits["val"].documents[0][0].tolist() == ids
    assert data.splits["test"].labels.tolist() == [9, 2]
    assert (data.vocab_size, data.num_classes) == (16, 10)
    assert load_listops(tmp_path, max_length=3).splits["train"].documents[0].lengths.tolist() \
        == [3, 3]


def test_listops_reader_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="listops-1000.*flarepp lra data make listops"):
        load_listops(tmp_path)
    (tmp_path / "basic_train.tsv").write_text("Src\tTgt\n1\t1\n")
    with pytest.raises(DataError, match="basic_train.tsv.*Source<TAB>Target"):
        load_listops(tmp_path, splits=("train",))
    write_listops_tsv(tmp_path / "basic_train.tsv", [("( ( ( [MAX 2 ) 12 ) ] )", 2)])
    with pytest.raises(DataError, match="unknown ListOps token '12'"):
        load_listops(tmp_path, splits=("train",))


def test_make_listops_writes_disjoint_release_files(tmp_path):
    paths = make_listops(tmp_path, n_train=30, n_val=5, n_test=5, min_length=5,
                         max_length=60, progress=False)
    assert [p.name for p in paths] == ["basic_train.tsv", "basic_val.tsv", "basic_test.tsv"]
    raw = (tmp_path / "basic_val.tsv").read_bytes()
    assert raw.startswith(b"Source\tTarget\r\n") and raw.count(b"\r\n") == 6
    data = load_listops(tmp_path)
    sources = [tuple(s.documents[0][i]) for s in data.splits.values() for i in range(len(s))]
    assert len(set(sources)) == 40
    with pytest.raises(FileExistsError):
        make_listops(tmp_path, n_train=1, n_val=1, n_test=1, min_length=5, max_length=60,
                     progress=False)


# ---------------------------------------------------------------------------------------------
# Pathfinder

def connected_by_flood_fill(image: np.ndarray) -> bool:
    """Whether the two marker blobs (pixels == 255) lie in one 8-connected component of
    the non-zero pixels."""
    components, _ = ndimage.label(image > 0, structure=EIGHT)
    markers, count = ndimage.label(image == MARKER_VALUE, structure=EIGHT)
    assert count == 2, f"expected two marker blobs, found {count}"
    assert np.bincount(markers.ravel())[1:].tolist() == [9, 9], "markers are 3 x 3 blocks"
    first, second = set(components[markers == 1]), set(components[markers == 2])
    assert len(first) == len(second) == 1
    return first == second


@pytest.mark.parametrize("difficulty", list(DIFFICULTIES))
def test_pathfinder_labels_match_a_flood_fill(difficulty):
    """Positive iff the dots are joined by contour pixels, for every image; both labels
    occur about equally; the marked snake has at least contour_length paddles of pixels.
    A failure points to the clearance check (objects touching) or the marker placement."""
    rules = PathfinderRules(contour_length=DIFFICULTIES[difficulty])
    images, labels = generate_pathfinder(160, rules=rules, seed=7, batch=200)
    assert images.shape == (160, 32, 32) and images.dtype == np.uint8
    assert set(np.unique(images)) <= {0, PATH_VALUE, MARKER_VALUE}
    for image, label in zip(images, labels):
        assert connected_by_flood_fill(image) == bool(label)
    assert 0.35 < labels.mean() < 0.65
    for image in images[labels == 1][:20]:
        components, _ = ndimage.label(image > 0, structure=EIGHT)
        snake = components == components[image == MARKER_VALUE][0]
        assert snake.sum() >= 2 * rules.contour_length + 9


def test_pathfinder_release_layout_round_trip(tmp_path):
    images, labels = generate_pathfinder(20, seed=2, batch=50)
    make_pathfinder(tmp_path, count=20, difficulty="curv_contour_length_14", seed=2,
                    batch=50, progress=False)
    line = (tmp_path / "curv_contour_length_14/metadata/0.npy").read_text().splitlines()[0]
    assert line.split()[:4] == ["imgs/0", "sample_0.png", "0", str(labels[0])]
    data = load_lra("pathfinder", tmp_path)
    assert [len(s) for s in data.splits.values()] == [16, 2, 2]
    tokens = np.concatenate([s.documents[0].tokens for s in data.splits.values()])
    np.testing.assert_array_equal(tokens, images.reshape(-1))
    assert np.concatenate([s.labels for s in data.splits.values()]).tolist() == labels.tolist()
    with pytest.raises(FileExistsError):
        make_pathfinder(tmp_path, count=20, progress=False)


def test_pathfinder_reader_accepts_text_and_numpy_metadata(tmp_path):
    """The release's metadata '*.npy' are text lines; a real .npy of strings (what
    snakes2.py's np.save writes) is read too. Files sort numerically (2 before 10)."""
    from PIL import Image
    root = tmp_path / "curv_baseline"
    rng = np.random.default_rng(0)
    images, lines = [], {2: [], 10: []}
    for batch, index, label in ((2, 0, 1), (2, 1, 0), (10, 0, 0)):
        folder = root / "imgs" / str(batch)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (32, 32), dtype=np.uint8)
        Image.fromarray(pixels, mode="L").save(folder / f"sample_{index}.png")
        images.append(pixels.ravel())
        lines[batch].append([f"imgs/{batch}", f"sample_{index}.png", str(index), str(label),
                             "1.0", "6", "2", "2", "0.5", "1", "1"])
    (root / "metadata").mkdir()
    (root / "metadata" / "2.npy").write_text("\n".join(" ".join(f) for f in lines[2]) + "\n")
    np.save(root / "metadata" / "10.npy", np.array(lines[10]))
    data = load_pathfinder(tmp_path, difficulty="curv_baseline", fractions=(0.34, 0.67))
    for split, image, label in zip(("train", "val", "test"), images, (1, 0, 0)):
        np.testing.assert_array_equal(data.splits[split].documents[0][0], image)
        assert data.splits[split].labels.tolist() == [label]
    assert data.max_length == 1024


def test_pathfinder_missing_metadata_says_where(tmp_path):
    with pytest.raises(DataError, match="lra_release/pathfinder32.*flarepp lra data make"):
        load_pathfinder(tmp_path)


# ---------------------------------------------------------------------------------------------
# Image: CIFAR-10 python batches, Fashion-MNIST IDX

def write_cifar(root: Path, per_batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    root.mkdir(parents=True)
    written = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, per_batch).tolist()
        with open(root / name, "wb") as handle:
            pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": data,
                         b"filenames": [b"x.png"] * per_batch}, handle)
        written[name] = (data, labels)
    return written


def tf_gray(r: int, g: int, b: int) -> int:
    """TensorFlow's rgb_to_grayscale + convert_image_dtype for one pixel, in float32."""
    scale = np.float32(1.0 / 255.0)
    value = (np.float32(r) * scale * np.float32(0.2989) + np.float32(g) * scale
             * np.float32(0.5870) + np.float32(b) * scale * np.float32(0.1140))
    return int(np.float32(value) * np.float32(255.5))


def test_cifar10_reader_grayscale_and_split(tmp_path):
    rng = np.random.default_rng(0)
    written = write_cifar(tmp_path / "cifar-10-batches-py", 4, rng)
    data = load_cifar10(tmp_path)
    assert [len(s) for s in data.splits.values()] == [18, 2, 4]
    assert data.max_length == 1024 and data.vocab_size == 256
    rgb, labels = written["data_batch_1"]
    image = data.splits["train"].documents[0][1]
    for pixel in (0, 33, 517, 1023):
        r, g, b = rgb[1, pixel], rgb[1, 1024 + pixel], rgb[1, 2048 + pixel]
        assert abs(int(image[pixel]) - tf_gray(r, g, b)) <= 1
    assert data.splits["train"].labels[:4].tolist() == labels
    assert data.splits["test"].labels.tolist() == written["test_batch"][1]
    from flarepp.data.lra.images import rgb_to_gray
    corners = np.array([[[[255, 255, 255], [255, 0, 0], [0, 255, 0], [0, 0, 255]]]], np.uint8)
    assert rgb_to_gray(corners).ravel().tolist() == [255, 76, 149, 29]


def test_data_pickles_refuse_code(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("this ran",))
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(DataError, match="refusing to load builtins.print"):
        load_cifar10(tmp_path)


def write_idx(path: Path, array: np.ndarray, compress: bool) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, ">u4").tobytes()
    raw = header + array.astype(np.uint8).tobytes()
    (gzip.open if compress else open)(path, "wb").write(raw)


def test_fashion_mnist_idx_reader(tmp_path):
    rng = np.random.default_rng(1)
    train = rng.integers(0, 256, (10, 28, 28), dtype=np.uint8)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", train, True)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.arange(10) % 10, True)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", train[:3], False)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([3, 1, 4]), False)
    data = load_fashion_mnist(tmp_path)
    assert [len(s) for s in data.splits.values()] == [9, 1, 3]
    np.testing.assert_array_equal(data.splits["val"].documents[0][0], train[9].ravel())
    assert data.splits["test"].labels.tolist() == [3, 1, 4] and data.max_length == 784
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 5, 1]))
    with pytest.raises(DataError, match="declares shape \\[5\\]"):
        read_idx(tmp_path / "t10k-labels-idx1-ubyte")


def test_fashion_mnist_missing_says_how_to_install(tmp_path):
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist(tmp_path)


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_fashion_mnist_from_debian_package():
    data = load_lra("fashion-mnist")
    assert [len(s) for s in data.splits.values()] == [54_000, 6_000, 10_000]
    assert data.max_length == 784 and data.num_classes == 10
    assert data.splits["train"].labels[:5].tolist() == [9, 0, 0, 3, 0]


# ---------------------------------------------------------------------------------------------
# Text (IMDB) and Retrieval (AAN)

def test_imdb_reader_byte_ids(tmp_path):
    reviews = {("train", "pos"): ["Great film.", "Süß!"], ("train", "neg"): ["Dull."],
               ("test", "pos"): ["Yes"], ("test", "neg"): ["No <br /> way"]}
    for (split, polarity), texts in reviews.items():
        folder = tmp_path / "aclImdb" / split / polarity
        folder.mkdir(parents=True)
        for i, text in enumerate(texts):
            (folder / f"{i}_{7 + i}.txt").write_text(text, encoding="utf-8")
    data = load_imdb(tmp_path, max_length=4)
    train = data.splits["train"]
    assert train.labels.tolist() == [0, 1, 1]
    assert train.documents[0][2].tolist() == [b + 1 for b in "Süß!".encode()[:4]]
    assert data.splits["val"].labels.tolist() == data.splits["test"].labels.tolist() == [0, 1]
    assert data.vocab_size == 257
    with pytest.raises(DataError, match="aclImdb"):
        load_imdb(tmp_path / "nowhere")


def test_aan_reader_release_tsv(tmp_path):
    rows = [("1.0", "P1", "P2", 'text "one"', "cited\x01"), ("0", "P3", "P4", "a", "bb")]
    for name in ("train", "eval", "test"):
        lines = ["\t".join(r) for r in rows]
        (tmp_path / f"new_aan_pairs.{name}.tsv").write_bytes(("\n".join(lines) + "\n").encode())
    data = load_aan(tmp_path)
    split = data.splits["val"]
    assert split.labels.tolist() == [1, 0] and data.two_documents
    assert split.documents[0][0].tolist() == [b + 1 for b in b'text "one"']
    assert split.documents[1][1].tolist() == [99, 99]
    batch = split.batch(np.array([0, 1]))
    assert batch["tokens_1"].shape == (2, 6) and batch["mask_1"].sum().item() == 8
    (tmp_path / "new_aan_pairs.eval.tsv").write_text("1\tP1\tP2\tonly four\n")
    with pytest.raises(DataError, match="eval.tsv: line 1 has 4 tab-separated fields"):
        load_aan(tmp_path)


# ---------------------------------------------------------------------------------------------
# The FLARE study's pickles

def test_reference_pickles(tmp_path):
    def dump(name, samples):
        with open(tmp_path / name, "wb") as handle:
            pickle.dump(samples, handle)
    padded = lambda ids, n: np.array(ids + [0] * (n - len(ids)), np.int32)
    dump("lra-listops.train.pickle", [{"input_ids_0": padded([3, 5, 15], 8), "label": 7},
                                      {"input_ids_0": padded([11, 1, 2, 15], 8), "label": 1}])
    dump("lra-listops.dev.pickle", [{"input_ids_0": padded([4], 8), "label": np.int32(3)}])
    data = load_reference_pickles(tmp_path, task="listops")
    assert set(data.splits) == {"train", "val"}
    assert data.splits["train"].documents[0].lengths.tolist() == [3, 4]
    assert (data.vocab_size, data.num_classes, data.max_length) == (16, 8, 4)
    pixels = np.arange(16, dtype=np.uint8) * 0  # a black image: zeros are pixels, not padding
    for split in ("train", "dev", "test"):
        dump(f"lra-image.{split}.pickle", [{"input_ids_0": pixels, "label": 1},
                                           {"input_ids_0": pixels + 9, "label": 0}])
        dump(f"lra-retrieval.{split}.pickle",
             [{"input_ids_0": padded([5, 6], 4), "input_ids_1": padded([7], 4), "label": 1}])
    assert load_lra("lra-pickle", tmp_path, task="image").splits["test"].documents[0] \
        .lengths.tolist() == [16, 16]
    retrieval = load_lra("lra-pickle", tmp_path, task="retrieval").splits["val"]
    assert [d.lengths.tolist() for d in retrieval.documents] == [[2], [1]]
    with pytest.raises(DataError, match="lra-text.train.pickle"):
        load_reference_pickles(tmp_path, task="text")


# ---------------------------------------------------------------------------------------------
# containers, registry, task table, CLI

def test_token_sequences_pad_and_subset():
    seqs = TokenSequences.from_sequences([[1, 2, 3], [4], [5, 6]])
    ids, mask = seqs.pad(np.array([2, 0]))
    assert ids.tolist() == [[5, 6, 0], [1, 2, 3]]
    assert mask.tolist() == [[True, True, False], [True, True, True]]
    assert seqs.subset(np.array([1, 2])).tokens.tolist() == [4, 5, 6]
    assert seqs.tokens.dtype == np.uint8
    with pytest.raises(DataError, match="offsets"):
        TokenSequences(np.zeros(3, np.uint8), np.array([0, 2]))


def test_batch_equals_collate_of_items():
    rows = generate_listops(12, seed=0, min_length=3, max_length=50)
    split = load_lra_from_rows(rows)
    indices = np.array([5, 0, 7])
    batch = split.batch(indices)
    items = collate([split.item(i) for i in indices])
    assert batch.keys() == items.keys()
    for key in batch:
        assert torch.equal(batch[key], items[key])


def load_lra_from_rows(rows):
    from flarepp.data.lra.base import LRASplit
    return LRASplit((tokenize([s for s, _ in rows]),), np.array([v for _, v in rows]))


def test_limited_keeps_a_seeded_subset(tmp_path):
    rng = np.random.default_rng(0)
    write_cifar(tmp_path / "c", 4, rng)
    data = load_cifar10(tmp_path / "c").limited({"train": 5})
    assert len(data.splits["train"]) == 5 and len(data.splits["test"]) == 4
    with pytest.raises(ValueError, match="no split"):
        data.limited({"dev": 1})


def test_registry_names_and_task_table():
    assert LRA_DATASETS.names() == sorted(["listops", "pathfinder", "cifar10", "fashion-mnist",
                                           "imdb", "aan", "lra-pickle"])
    assert LRA_BENCHMARKS.names() == ["image", "listops", "pathfinder32", "retrieval", "text"]
    for name in LRA_BENCHMARKS.names():
        task = LRA_BENCHMARKS.get(name)
        assert task.dataset in LRA_DATASETS
        assert task.tiny_dataset is None or task.tiny_dataset in LRA_DATASETS
    listops = LRA_BENCHMARKS.get("listops").paper
    assert (listops.blocks, listops.dim, listops.steps, listops.lr) == (4, 128, 10_000, 5e-4)
    assert listops.model_options("flarepp")["attn_scale"] == 1.0
    assert listops.model_options("attention")["attn_scale"] is None
    with pytest.raises(ValueError, match="unknown LRA dataset 'mnist'"):
        load_lra("mnist", "x")


def test_task_load_applies_tiny_options(tmp_path):
    """``LRA_BENCHMARKS[...].load("tiny", ...)`` reads the offline data with the table's loader
    options (ListOps capped at 300 tokens) and split limits (Image: 10k / 1k / 2k)."""
    make_listops(tmp_path, n_train=8, n_val=2, n_test=2, min_length=5, max_length=40,
                 progress=False)
    data = LRA_BENCHMARKS.get("listops").load("tiny", tmp_path)
    assert data.max_length == 300 and len(data.splits["train"]) == 8
    assert LRA_BENCHMARKS.get("listops").load("paper", tmp_path).max_length == 2000
    if Path("/usr/share/datasets/fashion-mnist").is_dir():
        image = LRA_BENCHMARKS.get("image").load("tiny")
        assert [len(s) for s in image.splits.values()] == [10_000, 1_000, 2_000]


def test_cli_make_and_check(tmp_path, capsys):
    out = tmp_path / "listops"
    assert cli_main(["lra", "data", "make", "listops", "--out", str(out), "--n-train", "20",
                     "--n-val", "4", "--n-test", "4", "--min-length", "5", "--max-length",
                     "60", "--quiet"]) == 0
    assert cli_main(["lra", "data", "check", "listops", str(out)]) == 0
    text = capsys.readouterr().out
    assert "train: 20 samples" in text and "vocabulary 16" in text
    assert cli_main(["lra", "data", "make", "listops", "--out", str(out), "--n-train", "2",
                     "--quiet"]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
