"""The house's import rules, held by import analysis (issue 20): one direction, no cycles.

* no cycle between the sub-packages (and top-level modules) of ``hyfi_imaging``;
* ``geometry`` is the bottom: it imports nothing of the package but ``errors``;
* ``models`` knows nothing of parallelism, training or data.
"""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hyfi_imaging"


def _unit(parts: list[str]) -> str:
    """A sub-package's name, or a top-level module's."""
    return parts[0] if (PACKAGE / parts[0]).is_dir() else parts[0].removesuffix(".py")


def _imports() -> dict[str, dict[str, str]]:
    """unit -> {imported unit: a file that imports it} (every import, lazy ones included)."""
    edges: dict[str, dict[str, str]] = defaultdict(dict)
    for path in PACKAGE.rglob("*.py"):
        src = _unit(list(path.relative_to(PACKAGE).parts))
        if src == "__init__":  # the package's public face imports what it exports
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "hyfi_imaging" and len(parts) > 1:
                    target = _unit(parts[1:])
                    if target != src:
                        edges[src].setdefault(target, str(path.relative_to(PACKAGE)))
    return edges


def _cycle(edges: dict[str, dict[str, str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in edges.get(node, {}):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in list(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_cycle() -> None:
    edges = _imports()
    cycle = _cycle(edges)
    where = [edges[a][b] for a, b in itertools.pairwise(cycle)] if cycle else []
    assert cycle is None, f"import cycle {' -> '.join(cycle or [])} (in {where})"


def test_geometry_is_the_bottom() -> None:
    assert set(_imports().get("geometry", {})) <= {"errors"}


def test_models_know_nothing_of_parallelism_training_or_data() -> None:
    assert not set(_imports().get("models", {})) & {"parallel", "train", "data", "io", "cli"}


def test_every_module_is_named_in_the_architecture_page() -> None:
    """docs/architecture.md's layout names every module of the package by its file name, so
    the page cannot fall behind the code again (it once omitted 10 of 22 parallel/ files)."""
    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "architecture.md").read_text()
    missing = [
        str(p.relative_to(root / "hyfi_imaging"))
        for p in sorted((root / "hyfi_imaging").rglob("*.py"))
        if p.name != "__init__.py" and p.name not in text
    ]
    assert not missing, f"not named in docs/architecture.md: {missing}"
