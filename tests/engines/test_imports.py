"""The engine modules import one another in one direction: no circle, lazy imports included.

A circle between two modules works only while one side imports lazily, inside a function;
the shared piece belongs in a third module both import (``hf_runtime`` for what the
transformers engines share).

Heavy libraries stay off the paths that do not use them: core, gateway and simulator never
import torch, and the modules ``tidegate serve`` and ``tidegate worker`` import before they
serve (the command's own imports, read from cli.py) load no aiohttp, and for the gateway no
numpy either: each start of a test's server would pay for them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import tidegate.cli
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


def tidegate_imports(path: Path) -> set[str]:
    """The tidegate modules ``path`` imports, at the top or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tidegate."):
            found.add(node.module or "")
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("tidegate."))
    return found


def test_engines_stand_below_the_simulator_and_the_servers() -> None:
    """An engine may use core and errors, never what runs it: the worker loads the simulated
    engine, and importing the simulator there pulled its whole package and the config in
    (0.6 s of every simulated worker's start). What both sides charge lives in engines.cost."""
    above = {
        f"{path.stem}: {module}"
        for path in ROOT.glob("*.py")
        for module in tidegate_imports(path)
        if not module.startswith(("tidegate.engines", "tidegate.core", "tidegate.errors"))
    }
    assert tidegate_imports(ROOT / "simulated.py") >= {"tidegate.engines.cost"}  # walk works
    assert not above, sorted(above)


def test_find_circle_finds_a_lazy_circle() -> None:
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def command_imports(command: str) -> list[str]:
    """The tidegate modules that the CLI function ``command`` imports in its body."""
    tree = ast.parse(Path(tidegate.cli.__file__).read_text())
    (function,) = (
        node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == command
    )
    modules = (node.module for node in ast.walk(function) if isinstance(node, ast.ImportFrom))
    return [module for module in modules if module and module.startswith("tidegate.")]


def packages_after(statement: str) -> set[str]:
    """The top-level packages that a fresh interpreter holds after running ``statement``."""
    script = f"{statement}\nimport sys\nprint(*sorted({{n.split('.')[0] for n in sys.modules}}))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


# The worker also runs its app and, here, the simulated engine, which serve_worker and
# build_engine import when called.
WORKER_CALLS = ("tidegate.worker.app", "tidegate.engines.simulated")


@pytest.mark.parametrize(
    ("command", "called", "must_not", "loads"),
    [
        ("serve", (), {"numpy", "aiohttp", "torch", "transformers"}, {"fastapi", "httpx"}),
        ("worker", WORKER_CALLS, {"aiohttp", "torch", "transformers"}, {"fastapi", "numpy"}),
    ],
)
def test_command_start_path_leaves_heavy_libraries_unloaded(
    command: str, called: tuple[str, ...], must_not: set[str], loads: set[str]
) -> None:
    modules = command_imports(command)
    assert "tidegate.worker.server" in modules  # the walk sees the command's imports
    loaded = packages_after("import " + ", ".join(["tidegate.cli", *modules, *called]))
    assert loads <= loaded  # the imports ran
    assert not must_not & loaded, sorted(must_not & loaded)


def test_core_gateway_and_sim_do_not_import_torch() -> None:
    loaded = packages_after(
        "import importlib, pkgutil\n"
        "for name in ('tidegate.core', 'tidegate.gateway', 'tidegate.sim'):\n"
        "    package = importlib.import_module(name)\n"
        "    for module in pkgutil.walk_packages(package.__path__, name + '.'):\n"
        "        importlib.import_module(module.name)"
    )
    assert "fastapi" in loaded  # the gateway's modules ran
    assert not {"torch", "transformers"} & loaded
