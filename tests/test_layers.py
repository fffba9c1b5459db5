"""The floors of ``src/flarepp`` import only downward, and no module imports itself back.

The import graph is read from the source by ``scripts/layers.py`` (which also draws it). A
failure names the importing module, the imported one and their floors: the fix is to move
the concept to the floor that owns it (docs/architecture.md), not to add an exception.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from layers import FLOORS, circles, floor_of, import_graph  # noqa: E402

def test_imports_only_downward():
    """No module imports a floor above its own."""
    graph = import_graph()
    names = [name for name, _ in FLOORS]
    upward = [f"{m} ({names[floor_of(m)]}) imports {t} ({names[floor_of(t)]})"
              for m, targets in sorted(graph.items()) for t in sorted(targets)
              if floor_of(t) > floor_of(m)]
    assert not upward, "upward imports:\n  " + "\n  ".join(upward)


def test_no_import_circle():
    """No set of modules imports itself back. A package's ``__init__`` re-exporting its
    own submodules, which import the package's siblings by their full names, is not a
    circle; a submodule importing its package's ``__init__`` while that ``__init__``
    imports it is."""
    found = circles(import_graph())
    assert not found, "import circles:\n  " + "\n  ".join(" <-> ".join(c) for c in found)


@pytest.mark.slow
def test_every_dataset_is_registered_by_the_data_floor():
    """`import flarepp.data` alone registers every dataset a run config may name (no
    higher floor adds one)."""
    import subprocess
    import sys
    code = ("import flarepp.data as d, sys; before = set(d.DATASETS.names()); "
            "import flarepp.cli; after = set(d.DATASETS.names()); "
            "sys.exit(0 if before == after else print(sorted(after - before)) or 1)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"registered above the data floor: {proc.stdout}{proc.stderr}"


def test_the_check_names_an_upward_import():
    """The layering check itself catches a planted upward import and names it (so the
    test above cannot pass by reading nothing)."""
    graph = {"flarepp.data.x": {"flarepp.tasks.y"}, "flarepp.tasks.y": set()}
    names = [name for name, _ in FLOORS]
    upward = [f"{m} ({names[floor_of(m)]}) imports {t} ({names[floor_of(t)]})"
              for m, targets in graph.items() for t in targets if floor_of(t) > floor_of(m)]
    assert upward == ["flarepp.data.x (data) imports flarepp.tasks.y (tasks)"]
    assert circles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert len(import_graph()) > 100
