"""`make gpu-check` as a script: what it runs and what it needs, checked without a GPU.

A failure here means the one GPU check silently skips tests (a cuda-marked file it does not
collect), or cannot start on an offline GPU machine (it reinstalls through pip).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _pytest_targets() -> list[str]:
    """The paths and the marker expression of the script's pytest call."""
    (line,) = [ln for ln in SCRIPT.read_text().splitlines()
               if "-m pytest" in ln and not ln.lstrip().startswith("#")]
    words = shlex.split(line.split("-m pytest", 1)[1])
    marker = words[words.index("-m") + 1]
    paths, skip_next = [], False
    for w in words:
        if skip_next:
            skip_next = False
        elif w in ("-m", "-p", "-k"):
            skip_next = True
        elif not w.startswith("-"):
            paths.append(w)
    return [marker] + paths


def test_gpu_check_runs_every_cuda_marked_file():
    """Every test file that marks tests `cuda` (tests/test_cuda_training.py among them:
    fp16 with the scaler, bf16, pinned loaders, GPU<->CPU resume) lies under a path the
    script hands pytest, with `-m cuda`."""
    marker, *paths = _pytest_targets()
    assert marker == "cuda"
    roots = [(ROOT / p).resolve() for p in paths]
    marked = [f for f in sorted((ROOT / "tests").glob("test_*.py"))
              if re.search(r"pytest\.mark\.cuda\b", f.read_text())]
    assert ROOT / "tests" / "test_cuda_training.py" in marked
    missed = [f.name for f in marked
              if not any(f == r or r in f.parents for r in roots)]
    assert not missed, f"gpu_check.sh does not run {missed}"


@pytest.mark.slow
@pytest.mark.slow  # starts make and Python
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_gpu_check_needs_no_pip_when_the_environment_is_set_up(tmp_path):
    """With an environment that imports flarepp and pytest, `make gpu-check` goes straight
    to the script (here: no GPU, exit 2 with its message) even when the install stamp is
    missing and pip would fail, as on an offline GPU machine. CUDA is hidden from the
    script, so on a GPU machine it stops at the same point instead of running the check."""
    import os
    import sys
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # on a GPU machine too: no sweep here
    done = subprocess.run(
        ["make", "-s", "gpu-check", f"PY={sys.executable}", "PIP=false",
         f"STAMP={tmp_path / 'never-installed'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert "nothing to check" in done.stderr, done.stdout + done.stderr
    assert done.returncode == 2
