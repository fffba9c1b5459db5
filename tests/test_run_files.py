"""One owner for a run directory (flarepp.storage.rundir.RunDir): no other module of the
package spells a run file's name, every stored config is read through
``RunConfig.from_stored``, and the owner's files and provenance are what it says.

A failure of the scan names the module, the line and the literal: a file name written
outside the owner is a second place that must change when the layout does (the bug the
owner exists to prevent)."""

from __future__ import annotations

import ast
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from flarepp.storage.rundir import RunDir, provenance

SRC = Path(__file__).resolve().parents[1] / "src" / "flarepp"
OWNER = SRC / "storage" / "rundir.py"
LEASES = SRC / "locks.py"  # names the lease file RunDir.LOCK reuses


def run_file_patterns() -> list[tuple[re.Pattern, bool]]:
    """``(pattern, whole)`` per file name :class:`RunDir` declares: a file name matches a
    word of a literal (or of an f-string's piece) ending in it, after a ``/`` or alone; a
    name with ``{fields}`` by its fixed end (``_predictions.npz``); a folder or figure stem
    (``checkpoints``, ``curves``, words of prose too) only as a whole literal (``whole``) or
    as a path part after a ``/``."""
    patterns = []
    for key, name in vars(RunDir).items():
        if not (key.isupper() and isinstance(name, str)):
            continue
        if "{" in name:
            tail = re.split(r"\{[^}]*\}", name)[-1]
            if "." in tail and len(tail) > 4:
                patterns.append((re.compile(re.escape(tail) + r"$"), False))
        elif "." in name:
            patterns.append((re.compile(r"(^|/)" + re.escape(name) + r"$"), False))
        else:
            patterns.append((re.compile(r"^" + re.escape(name) + r"$"), True))
            patterns.append((re.compile(r"/" + re.escape(name) + r"(/|$)"), False))
    return patterns


def _docstrings(tree: ast.AST) -> set[int]:
    """The string constants that are documentation: bare string statements (docstrings of
    modules, classes, functions and of constants)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)}


def literal_hits(path: Path, patterns: list[tuple[re.Pattern, bool]]) -> list[str]:
    """``module:line: literal`` for every string constant of ``path`` (docstrings aside)
    that names a run file."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _docstrings(tree)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            words = re.split(r"[\s'\"`(),;:]+", node.value)
            if any((p.search(node.value) if whole else any(p.search(w) for w in words))
                   for p, whole in patterns):
                hits.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: {node.value!r}")
    return hits


def test_no_run_file_name_outside_its_owner():
    """Every literal of the package (docstrings aside) that ends in a name RunDir declares
    (config.json, metrics.json, log.jsonl, checkpoints, test_predictions.npz, ...) is in
    storage/rundir.py. A failure names the module and line: use the RunDir method."""
    patterns = run_file_patterns()
    assert len(patterns) > 12
    hits = [hit for path in sorted(SRC.rglob("*.py")) if path not in (OWNER, LEASES)
            for hit in literal_hits(path, patterns)]
    assert not hits, "run-file names outside RunDir:\n  " + "\n  ".join(hits)


def test_the_scan_finds_a_planted_name(tmp_path):
    """The scan itself sees a name in a plain literal and in an f-string, and not in a
    docstring (so the test above cannot pass by reading nothing)."""
    planted = tmp_path / "flarepp" / "planted.py"
    planted.parent.mkdir()
    planted.write_text('"""Reads metrics.json."""\nA = "runs/x/metrics.json"\n'
                       'B = f"{split}_predictions.npz"\n')
    global SRC
    old, SRC = SRC, tmp_path / "flarepp"
    try:
        hits = literal_hits(planted, run_file_patterns())
    finally:
        SRC = old
    assert [h.split(":")[1] for h in hits] == ["2", "3"]


def test_stored_configs_are_read_through_from_stored():
    """A stored config is read as stored: the owner reads ``config.json`` with
    ``RunConfig.from_stored`` (an old run keeps what it trained with), and no module builds a
    ``RunConfig`` from a file it read itself with ``from_dict`` (which gives today's
    defaults; with the scan above no other module can name the file). A failure names the
    module."""
    import inspect
    assert "RunConfig.from_stored(self.read_config_dict())" in inspect.getsource(RunDir)
    offenders = [str(path.relative_to(SRC.parent)) for path in sorted(SRC.rglob("*.py"))
                 if re.search(r"RunConfig\.from_dict\(\s*(json\.loads|read_json)\(",
                              path.read_text())]
    assert not offenders, offenders


def test_run_dir_names_reads_and_writes_its_files(tmp_path):
    """The owner's files round-trip: metrics, log (appended and rewritten), provenance
    (one record per session), the study engine's failure and cost; checkpoints are listed
    newest first and pruned to the newest K plus the best."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    assert not run.is_run()
    run.write_metrics({"test_rel_l2": 0.5})
    assert run.read_metrics() == {"test_rel_l2": 0.5}
    run.append_log({"epoch": 1}), run.append_log({"epoch": 2})
    assert [r["epoch"] for r in run.read_log()] == [1, 2]
    run.rewrite_log([{"epoch": 1}])
    assert run.read_log() == [{"epoch": 1}]
    run.record_provenance({"a": 1}), run.record_provenance({"a": 2})
    assert [r["a"] for r in run.read_provenance()] == [1, 2]
    run.amend_provenance({"threads": {"threads": 1}})  # measured once the run started
    assert run.read_provenance() == [{"a": 1}, {"a": 2, "threads": {"threads": 1}}]
    run.write_failure(FloatingPointError("loss became nan"))
    assert run.read_failure() == {"error": "loss became nan", "type": "FloatingPointError"}
    run.write_cost({"epoch_seconds": 1.0})
    assert run.read_cost() == {"epoch_seconds": 1.0}
    run.checkpoint_dir.mkdir()
    for epoch, step in ((1, None), (2, None), (2, 5), (3, None)):
        run.checkpoint(epoch, step).write_bytes(b"x")
    assert [p.name for p in run.checkpoints()] == [
        "epoch_0003.pt", "epoch_0002_step_000005.pt", "epoch_0002.pt", "epoch_0001.pt"]
    assert run.is_run()
    removed = run.prune_checkpoints(1, best=run.checkpoint(1))
    assert sorted(p.name for p in removed) == ["epoch_0002.pt", "epoch_0002_step_000005.pt"]
    assert run.reported_checkpoint() == run.checkpoint(3)   # metrics name none: the newest


def test_provenance_names_versions_devices_host_and_command():
    """A provenance record holds flarepp's version, the git commit of this checkout (the
    tests run from one), torch and CUDA versions, the device names, the host and the
    command line; it is plain JSON."""
    import torch

    import flarepp
    record = provenance(["cpu"], parallel="single process")
    assert record["flarepp"] == flarepp.__version__
    assert record["torch"] == torch.__version__ and record["cuda"] == torch.version.cuda
    assert re.fullmatch(r"[0-9a-f]{40}", record["git"]["commit"] or "")
    assert record["devices"][0].startswith("cpu (") and record["host"]
    assert record["command"] == shlex.join(sys.orig_argv)
    assert record["parallel"] == "single process"
    assert json.loads(json.dumps(record)) == record


def test_a_path_that_is_no_run_is_a_sentence(tmp_path):
    """``RunDir.require_run`` on a missing directory and on one without a run: one sentence
    each, naming the path."""
    from flarepp.storage.rundir import NotARunDirectory
    with pytest.raises(NotARunDirectory, match="does not exist"):
        RunDir(tmp_path / "absent").require_run()
    with pytest.raises(NotARunDirectory, match="is not a flarepp run directory"):
        RunDir(tmp_path).require_run()
