"""The planner's modules import each other without a circle, deferred imports included."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import tidegate.profile

PACKAGE = "tidegate.profile"


def imports_of(path: Path) -> set[str]:
    """The modules of the package ``path`` imports, wherever in the file (functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith(f"{PACKAGE}.")}


def test_the_planner_modules_import_no_circle() -> None:
    folder = Path(tidegate.profile.__file__).parent
    graph = {f"{PACKAGE}.{path.stem}": imports_of(path) for path in folder.glob("*.py")}
    assert f"{PACKAGE}.report" in graph[f"{PACKAGE}.outputs"]  # the graph is the real one
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError with the circle
