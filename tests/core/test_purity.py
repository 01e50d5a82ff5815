"""The functional core imports only the standard library and itself, and never reads a clock."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "src" / "tidegate" / "core"
CORE_FILES = sorted(CORE.glob("*.py"))
# Calls that read the wall or monotonic clock, or sleep.
CLOCK_ATTRS = {
    "time",
    "monotonic",
    "monotonic_ns",
    "perf_counter",
    "perf_counter_ns",
    "time_ns",
    "sleep",
    "process_time",
}
DATETIME_NOW = {"now", "utcnow", "today"}


def _imported_modules(tree: ast.AST) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "core uses absolute imports"
            names.append(node.module or "")
    return names


def test_core_has_modules() -> None:
    assert {p.name for p in CORE_FILES} >= {"request.py", "queue.py", "batching.py", "routing.py"}


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: p.name)
def test_core_imports_only_stdlib_and_core(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    for module in _imported_modules(tree):
        top = module.split(".")[0]
        if module == "tidegate.core" or module.startswith("tidegate.core."):
            continue
        assert top in sys.stdlib_module_names, f"{path.name} imports {module}"
        assert top not in {"asyncio", "time", "datetime", "threading", "socket", "os"}, (
            f"{path.name} imports {module}: core takes time as an argument and does no I/O"
        )


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: p.name)
def test_core_reads_no_clock(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner, attr = node.value.id, node.attr
            assert not (owner == "time" and attr in CLOCK_ATTRS), f"{path.name}: time.{attr}"
            assert not (owner in {"datetime", "date"} and attr in DATETIME_NOW), (
                f"{path.name}: {owner}.{attr}"
            )
        if isinstance(node, (ast.AsyncFunctionDef, ast.Await, ast.AsyncWith, ast.AsyncFor)):
            pytest.fail(f"{path.name}: async code in the core (line {node.lineno})")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in {"open", "print", "input"}, (
                f"{path.name}: {node.func.id}() is I/O"
            )
