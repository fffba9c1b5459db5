"""The floors of ``src/flarepp`` import only downward, and no module imports itself back.

Read from the source (AST), every import counted, those inside functions too (a lazy
import hides a circle from Python, not from the design). A failure names the importing
module, the imported one and their floors: the fix is to move the concept to the floor
that owns it (docs/architecture.md), not to add an exception here.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Floors from the ground up; a module may import its own floor and those before it.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("flarepp.registry", "flarepp.validate", "flarepp.device", "flarepp.io",
              "flarepp.paper", "flarepp.allocator")),
    ("ops", ("flarepp.ops",)),
    ("mixers", ("flarepp.mixers",)),
    ("models", ("flarepp.models", "flarepp.rank_growth")),
    ("distributed", ("flarepp.distributed",)),
    ("data", ("flarepp.data",)),
    ("plots", ("flarepp.plots", "flarepp.plots3d")),
    ("storage", ("flarepp.storage",)),
    ("tasks", ("flarepp.tasks",)),
    ("inference", ("flarepp.inference",)),
    ("train", ("flarepp.train",)),
    ("experiments", ("flarepp.experiments", "flarepp.bench")),
    ("cli", ("flarepp.cli", "flarepp.__main__")),
]
PACKAGE_ROOT = "models"   # `import flarepp` gives the public API: mixers, models, ops


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def floor_of(module: str) -> int:
    if module == "flarepp":
        return [name for name, _ in FLOORS].index(PACKAGE_ROOT)
    best = None
    for i, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    if best is None:
        raise AssertionError(f"module {module} is on no floor: add it to FLOORS in "
                             f"{Path(__file__).name}")
    return best[0]


def import_graph() -> dict[str, set[str]]:
    """``{module: modules it imports}`` over ``src/flarepp`` (modules of the package only)."""
    paths = sorted((SRC / "flarepp").rglob("*.py"))
    modules = {module_name(p): p for p in paths}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [f"{target}.{a.name}" for a in node.names]
                hits = [n for n in names if n in modules]
                found.update(hits or ([target] if target in modules else []))
                if not hits and target not in modules and target.startswith("flarepp"):
                    raise AssertionError(f"{module} imports {target}, which does not exist")
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in modules)
        graph[module] = found - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v), on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


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
