"""ListOps (Nangia and Bowman 2018) with the Long Range Arena rules (Tay et al. 2021).

A sequence is a random expression tree over the digits 0..9 and four list operators,
written in prefix form with brackets, e.g. ``[MAX 2 9 [MIN 4 7 ] 0 ]`` = 9; the label is its
value (10 classes)::

    MAX, MIN   the largest / smallest argument
    MED        the median, int(numpy.median(args)): the floor of the mean of the two middle
               values for an even count
    SM         the sum modulo 10

Generation (LRA's ``lra_benchmarks/data/listops.py``): the root has depth 1; a node of
depth ``d < max_depth`` is an operator with probability 0.25 and a digit otherwise; a node
at ``max_depth`` is a digit. An operator draws its operator uniformly and ``randint(2,
max_args)`` arguments, each a node of depth ``d + 1``; digits are uniform. A tree's length
counts its digits, operators and closing brackets (not the parentheses of the file format)
and is kept iff ``min_length < length < max_length``, without duplicates. The LRA release
used max depth 10, max args 10, lengths 500-2000 and 96,000 / 2,000 / 2,000 sequences.

File format (the LRA release, ``listops-1000/basic_{train,val,test}.tsv``): tab-separated,
a header ``Source<TAB>Target``, one expression per row written with LRA's binary
nesting, ``( ( ( [MAX 2 ) 9 ) ] )``: an operator with ``k`` arguments opens ``k + 1``
parentheses, each argument closes one, and ``] )`` ends it. Rows end in ``\\r\\n`` (Python's
``csv`` writer, as LRA wrote them); the reader accepts ``\\n`` too.

Tokenisation (LRA's ``listops/input_pipeline.py``): parentheses are deleted, ``]`` becomes
``X``, the rest splits on whitespace. The 15 tokens get fixed ids 1..15 here (0 is padding):
LRA's encoder numbers them in Python set order, which differs between runs; any fixed
numbering is equivalent for a learned embedding.
"""

from __future__ import annotations

import csv
import io
import random
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from flarepp.data.base import DataError
from flarepp.data.generators._io import refuse_existing, write_atomically
from flarepp.data.lra.base import LRADataset, LRASplit, TokenSequences, missing

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
CLOSE = "]"
OPERATOR_PROBABILITY = 0.25  # LRA's VALUE_P: a node below max depth is an operator w.p. 0.25
DIGITS = tuple(str(d) for d in range(10))
VOCABULARY = ("<pad>",) + DIGITS + OPERATORS + ("X",)  # id = position; "X" is the renamed "]"
TOKEN_IDS = {token: i for i, token in enumerate(VOCABULARY)}
NUM_CLASSES = 10
SPLIT_FILES = {"train": "basic_train.tsv", "val": "basic_val.tsv", "test": "basic_test.tsv"}


def apply_operator(operator: str, args: list[int]) -> int:
    """The value of ``operator`` on the digit list ``args`` (module docstring)."""
    if operator == "[MIN":
        return min(args)
    if operator == "[MAX":
        return max(args)
    if operator == "[SM":
        return sum(args) % 10
    ordered = sorted(args)
    return (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) // 2


def sample_expression(rng: random.Random, *, max_depth: int, max_args: int,
                      length_limit: int) -> tuple[str, int, int] | None:
    """One random tree as ``(source, value, length)`` in the release's text format, or
    ``None`` once it reaches ``length_limit`` tokens (it would be rejected anyway, so the
    rest of it is not drawn; the accepted trees keep their distribution)."""
    length = 0

    def node(depth: int) -> tuple[str, int] | None:
        nonlocal length
        if depth >= max_depth or rng.random() > OPERATOR_PROBABILITY:
            length += 1
            value = rng.randrange(10)
            return str(value), value
        count = rng.randint(2, max_args)
        length += 2  # the operator and its closing bracket
        parts, values = [], []
        for _ in range(count):
            child = node(depth + 1)
            if child is None or length >= length_limit:
                return None
            parts.append(child[0] + " )")
            values.append(child[1])
        operator = OPERATORS[rng.randrange(len(OPERATORS))]
        source = "( " * (count + 1) + operator + " " + " ".join(parts) + " ] )"
        return source, apply_operator(operator, values)

    tree = node(1)
    if tree is None or length >= length_limit:
        return None
    return tree[0], tree[1], length


def generate_listops(count: int, *, seed: int = 0, max_depth: int = 10, max_args: int = 10,
                     min_length: int = 500, max_length: int = 2000,
                     progress: bool = False) -> list[tuple[str, int]]:
    """``count`` distinct expressions with ``min_length < length < max_length`` tokens, as
    ``(source, value)`` rows of the release's TSV (module docstring)."""
    if not (0 <= min_length < max_length - 1) or max_depth < 1 or max_args < 2 or count < 0:
        raise ValueError(f"ListOps needs 0 <= min_length < max_length - 1, max_depth >= 1, "
                         f"max_args >= 2 and count >= 0; got min_length={min_length}, "
                         f"max_length={max_length}, max_depth={max_depth}, "
                         f"max_args={max_args}, count={count}")
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[tuple[str, int]] = []
    with tqdm(total=count, desc="listops", disable=not progress) as bar:
        while len(rows) < count:
            tree = sample_expression(rng, max_depth=max_depth, max_args=max_args,
                                     length_limit=max_length)
            if tree is None or tree[2] <= min_length or tree[0] in seen:
                continue
            seen.add(tree[0])
            rows.append((tree[0], tree[1]))
            bar.update(1)
    return rows


def _tsv_bytes(rows: list[tuple[str, int]]) -> bytes:
    text = io.StringIO()
    writer = csv.writer(text, delimiter="\t")
    writer.writerow(["Source", "Target"])
    writer.writerows(rows)
    return text.getvalue().encode("ascii")


def make_listops(out: str | Path, *, n_train: int = 96_000, n_val: int = 2_000,
                 n_test: int = 2_000, seed: int = 0, max_depth: int = 10, max_args: int = 10,
                 min_length: int = 500, max_length: int = 2000, progress: bool = True,
                 overwrite: bool = False) -> list[Path]:
    """Write ``basic_{train,val,test}.tsv`` into ``out`` (LRA's defaults reproduce the
    release's sizes); the three splits share no expression. Every split needs at least one
    expression: an empty split would be a file that trains or scores nothing."""
    for name, value in (("n_train", n_train), ("n_val", n_val), ("n_test", n_test)):
        if value < 1:
            raise ValueError(f"ListOps {name} must be at least 1, got {value}")
    out = Path(out)
    paths = {split: out / name for split, name in SPLIT_FILES.items()}
    refuse_existing(list(paths.values()), overwrite)
    rows = generate_listops(n_train + n_val + n_test, seed=seed, max_depth=max_depth,
                            max_args=max_args, min_length=min_length, max_length=max_length,
                            progress=progress)
    parts = {"train": rows[:n_train], "val": rows[n_train:n_train + n_val],
             "test": rows[n_train + n_val:]}
    return write_atomically({paths[s]: (lambda h, r=parts[s]: h.write(_tsv_bytes(r)))
                             for s in SPLIT_FILES})


def _token_codes(tokens: tuple[str, ...]) -> np.ndarray:
    """Each token's first four bytes as one big-endian uint32 (shorter ones zero-padded)."""
    raw = np.zeros((len(tokens), 4), np.uint8)
    for i, token in enumerate(tokens):
        raw[i, :len(token)] = np.frombuffer(token.encode("ascii"), np.uint8)
    return raw.astype(np.uint32) @ np.array([1 << 24, 1 << 16, 1 << 8, 1], np.uint32)


_FILE_TOKENS = DIGITS + OPERATORS + (CLOSE,)  # as written in the file: "]" before renaming
_FILE_CODES = _token_codes(_FILE_TOKENS)
_FILE_IDS = np.array([TOKEN_IDS["X" if t == CLOSE else t] for t in _FILE_TOKENS])


def tokenize(sources: list[str], *, where: str = "sources") -> TokenSequences:
    """LRA's ListOps tokenisation of many expressions at once (module docstring).

    Vectorised over all characters: parentheses are deleted, whitespace separates tokens,
    each token is identified by its (at most four) bytes. An unknown token is an error.
    """
    text = "\n".join(sources).encode("ascii", errors="replace")
    chars = np.frombuffer(text, np.uint8)
    chars = chars[(chars != ord("(")) & (chars != ord(")"))]
    is_space = np.isin(chars, np.frombuffer(b" \t\r\n", np.uint8))
    starts = np.flatnonzero(~is_space & np.concatenate([[True], is_space[:-1]]))
    ends = np.flatnonzero(~is_space & np.concatenate([is_space[1:], [True]])) + 1
    lengths = ends - starts
    padded = np.concatenate([chars, np.zeros(4, np.uint8)])
    window = padded[starts[:, None] + np.arange(4)].astype(np.uint32)
    window[np.arange(4)[None, :] >= lengths[:, None]] = 0
    codes = window @ np.array([1 << 24, 1 << 16, 1 << 8, 1], np.uint32)
    order = np.argsort(_FILE_CODES)
    slot = np.clip(np.searchsorted(_FILE_CODES[order], codes), 0, len(order) - 1)
    known = (_FILE_CODES[order][slot] == codes) & (lengths <= 4)
    if not known.all():
        bad = int(np.flatnonzero(~known)[0])
        token = bytes(chars[starts[bad]:ends[bad]]).decode("ascii", errors="replace")
        raise DataError(f"{where}: unknown ListOps token {token!r}; expected digits, "
                        f"{', '.join(OPERATORS)}, ']' and parentheses")
    newlines = np.flatnonzero(chars == ord("\n"))
    sequence_of_token = np.searchsorted(newlines, starts)
    counts = np.bincount(sequence_of_token, minlength=len(sources))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return TokenSequences(_FILE_IDS[order][slot].astype(np.uint8), offsets)


def read_listops_tsv(path: Path) -> tuple[list[str], np.ndarray]:
    """The ``Source`` strings and ``Target`` labels of one release TSV."""
    try:
        with open(path, newline="", encoding="ascii") as handle:
            rows = list(csv.reader(handle, delimiter="\t"))
    except UnicodeDecodeError as err:
        bad = err.object[err.start:err.start + 1]
        raise DataError(f"{path}: byte {err.start} ({bad!r}) is not ASCII; a ListOps TSV "
                        "holds ASCII text only") from None
    except csv.Error as err:
        raise DataError(f"{path}: not a readable TSV ({err})") from None
    if not rows or rows[0] != ["Source", "Target"]:
        raise DataError(f"{path}: expected the header 'Source<TAB>Target', "
                        f"got {rows[0] if rows else 'an empty file'}")
    bad = next((i for i, r in enumerate(rows[1:], 2) if len(r) != 2), None)
    if bad is not None:
        raise DataError(f"{path}: line {bad} does not have two tab-separated columns")
    try:
        labels = np.array([int(r[1]) for r in rows[1:]], dtype=np.int64)
    except ValueError as err:
        raise DataError(f"{path}: a Target is not an integer ({err})") from None
    return [r[0] for r in rows[1:]], labels


def load_listops(root: str | Path, *, max_length: int = 2000,
                 splits: tuple[str, ...] = ("train", "val", "test")) -> LRADataset:
    """The release's ``basic_{train,val,test}.tsv`` under ``root`` (``listops-1000/`` of
    ``lra_release``, or what ``flarepp lra data make listops`` wrote), tokenised as LRA
    does and truncated to ``max_length`` tokens as LRA does (release sequences are shorter)."""
    root = Path(root)
    out = {}
    for split in splits:
        path = root / SPLIT_FILES[split]
        if not path.is_file():
            raise missing(path, f"ListOps {split} split", "Unpack lra_release.gz and point at "
                          "its listops-1000/ folder, or generate one with `flarepp lra data "
                          "make listops --out DIR`")
        sources, labels = read_listops_tsv(path)
        documents = tokenize(sources, where=str(path))
        if (documents.lengths > max_length).any():
            documents = TokenSequences.from_sequences(
                documents[i][:max_length] for i in range(len(documents)))
        out[split] = LRASplit((documents,), labels)
    return LRADataset("listops", out, vocab_size=len(VOCABULARY), num_classes=NUM_CLASSES,
                      max_length=max_length, source=str(root)).validate()


__all__ = ["OPERATORS", "TOKEN_IDS", "VOCABULARY", "apply_operator", "generate_listops",
           "load_listops", "make_listops", "read_listops_tsv", "sample_expression", "tokenize"]
