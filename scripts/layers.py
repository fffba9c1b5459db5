"""The floors of ``src/flarepp`` and its import graph, read from the source (AST).

``python scripts/layers.py`` prints the floor-to-floor import counts (a markdown table) and
draws ``docs/figures/import_graph.png``; ``tests/test_layers.py`` checks with the same
reader that every import goes downward and that no module imports itself back. Every
import is counted, those inside functions too (a lazy import hides a circle from Python,
not from the design).
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Floors from the ground up; a module may import its own floor and those before it.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("flarepp.registry", "flarepp.validate", "flarepp.device", "flarepp.io",
              "flarepp.locks", "flarepp.paper", "flarepp.allocator", "flarepp.version",
              "flarepp.threads", "flarepp.values")),
    ("ops", ("flarepp.ops",)),
    ("mixers", ("flarepp.mixers",)),
    ("models", ("flarepp.models", "flarepp.rank_growth")),
    ("distributed", ("flarepp.distributed",)),
    ("data", ("flarepp.data",)),
    ("storage", ("flarepp.storage",)),
    ("interop", ("flarepp.interop",)),
    ("plots", ("flarepp.plots", "flarepp.plots3d")),
    ("tasks", ("flarepp.tasks",)),
    ("inference", ("flarepp.inference",)),
    ("serve", ("flarepp.serve",)),
    ("train", ("flarepp.train",)),
    ("experiments", ("flarepp.experiments", "flarepp.bench")),
    ("cli", ("flarepp.cli", "flarepp.__main__")),
    ("api", ("flarepp.api",)),
]
PACKAGE_ROOT = "api"   # `import flarepp`: the public API (mixers, models, ops, flarepp.load)


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


def floor_edges(graph: dict[str, set[str]]) -> Counter:
    """``{(floor, floor it imports): module imports}`` between different floors."""
    names = [name for name, _ in FLOORS]
    return Counter((names[floor_of(m)], names[floor_of(t)]) for m, targets in graph.items()
                   for t in targets if floor_of(m) != floor_of(t))


def floor_lines(graph: dict[str, set[str]]) -> dict[str, int]:
    """Lines of source per floor."""
    names = [name for name, _ in FLOORS]
    out = dict.fromkeys(names, 0)
    for m in graph:
        path = (SRC / Path(*m.split("."))).with_suffix(".py")
        if not path.is_file():
            path = SRC / Path(*m.split("."), "__init__.py")
        out[names[floor_of(m)]] += len(path.read_text().splitlines())
    return out


def draw(graph: dict[str, set[str]], path: Path) -> Path:
    """The floor-to-floor import matrix: row = importing floor, column = imported floor,
    the count of module imports in each cell; below the diagonal is downward, anything
    above it (an upward import) is drawn red."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    names = [name for name, _ in FLOORS]
    edges = floor_edges(graph)
    lines = floor_lines(graph)
    counts = np.zeros((len(names), len(names)))
    for (a, b), c in edges.items():
        counts[names.index(a), names.index(b)] = c
    fig, ax = plt.subplots(figsize=(8.5, 7), constrained_layout=True)
    ax.imshow(np.where(counts > 0, np.log1p(counts), np.nan), cmap="Greys", vmin=0,
              vmax=np.log1p(counts.max()) * 1.6)
    for i in range(len(names)):
        for j in range(len(names)):
            if counts[i, j]:
                ax.text(j, i, f"{counts[i, j]:.0f}", ha="center", va="center", fontsize=9,
                        color="red" if j > i else "black")
    ax.plot([-0.5, len(names) - 0.5], [-0.5, len(names) - 0.5], color="0.6", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
    ax.set_yticks(range(len(names)), [f"{n} ({lines[n]:,} lines)" for n in names])
    ax.set_xlabel("imported floor"), ax.set_ylabel("importing floor")
    upward = int(sum(counts[i, j] for i in range(len(names)) for j in range(i + 1, len(names))))
    ax.set_title(f"flarepp imports between floors, read from the code\n"
                 f"(ground first; {upward} upward, {len(circles(graph))} circles)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    graph = import_graph()
    names = [name for name, _ in FLOORS]
    edges = floor_edges(graph)
    print("| floor | imports (module imports) |\n|---|---|")
    for n in names:
        targets = ", ".join(f"{b} ({c})" for (a, b), c in sorted(
            edges.items(), key=lambda e: names.index(e[0][1])) if a == n)
        print(f"| {n} | {targets or '-'} |")
    found = circles(graph)
    print(f"\nimport circles: {len(found)}; upward imports: "
          f"{sum(c for (a, b), c in edges.items() if names.index(b) > names.index(a))}")
    root = Path(__file__).resolve().parents[1]
    print(draw(graph, root / "docs" / "figures" / "import_graph.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
