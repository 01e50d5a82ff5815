"""The engine modules import one another in one direction: no circle, lazy imports included.

A circle between two modules works only while one side imports lazily, inside a function;
the shared piece belongs in a third module both import (``hf_runtime`` for what the
transformers engines share).
"""

from __future__ import annotations

import ast
from pathlib import Path

import tidegate.engines

PACKAGE = "tidegate.engines"
ROOT = Path(tidegate.engines.__file__).parent


def engine_imports(path: Path) -> set[str]:
    """The engine modules that ``path`` imports, at the top or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
            found.update(a.name for a in node.names if (ROOT / f"{a.name}.py").is_file())
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE + "."):
            found.add((node.module or "").removeprefix(PACKAGE + ".").split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(
                a.name.removeprefix(PACKAGE + ".").split(".")[0]
                for a in node.names
                if a.name.startswith(PACKAGE + ".")
            )
    return found


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path that ends where it starts, or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for imported in sorted(graph.get(module, ())):
            circle = visit(imported, [*path, module])
            if circle is not None:
                return circle
        done.add(module)
        return None

    for module in sorted(graph):
        circle = visit(module, [])
        if circle is not None:
            return circle
    return None


def test_engine_modules_import_each_other_in_one_direction() -> None:
    graph = {
        path.stem: engine_imports(path) for path in ROOT.glob("*.py") if path.stem != "__init__"
    }
    assert graph["generation"] >= {"tiny_llama", "hf_runtime"}  # the walk sees imports
    assert find_circle(graph) is None, " -> ".join(find_circle(graph) or [])


def test_find_circle_finds_a_lazy_circle() -> None:
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
