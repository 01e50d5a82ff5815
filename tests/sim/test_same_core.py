"""The simulator runs the server's own core policies: none is written again in ``sim/``.

Three checks, each of which fails if a rule is reimplemented there:
- by source: ``sim/`` imports ``WaitQueue``, ``plan_batch``, ``pick_replica`` and
  ``servable_levels`` from ``tidegate.core``, defines nothing named like a core policy or
  a ``WaitQueue`` method, and reads no attribute that only a reimplemented rule would
  need (aging, holdback, batch window, the router's load);
- by identity: the names the simulator calls are the core's objects;
- by behaviour: a run calls the core's admission, pick, batching and routing functions
  once per decision it makes (counted through wrappers around the real functions).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

import tidegate.core.batching
import tidegate.core.queue
import tidegate.core.routing
import tidegate.sim.gateway
import tidegate.sim.workers
from tidegate.core.queue import WaitQueue
from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.workload import Arrival, Listed

from .conftest import config_of, flat_batch_service

SRC = Path(tidegate.sim.gateway.__file__).resolve().parents[1]
SIM_FILES = sorted((SRC / "sim").glob("*.py"))
CORE_FILES = sorted((SRC / "core").glob("*.py"))

REQUIRED_IMPORTS = {
    "tidegate.core.queue": {"WaitQueue"},
    "tidegate.core.batching": {"plan_batch"},
    "tidegate.core.routing": {"pick_replica", "servable_levels"},
}
# Attributes only a reimplemented rule would read: aging, holdback and timeouts (queue),
# the batch window (plan_batch), eligibility and load (routing).
RULE_ATTRIBUTES = {
    "aging",
    "threshold_s",
    "rate_per_s",
    "holdback_above",
    "timeout_s",
    "batch_window_ms",
    "has_free_slot",
    "load",
}
POLICY_PREFIXES = ("plan_", "pick_", "decide_")
QUEUE_CLASSES = {"WaitQueue", "DrainRate"}


def _trees() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), filename=str(path))) for path in SIM_FILES]


def _core_names() -> set[str]:
    """Public functions and classes of core/, and every method of the queue's classes."""
    names: set[str] = set()
    for path in CORE_FILES:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                names.add(node.name)
            if isinstance(node, ast.ClassDef) and node.name in QUEUE_CLASSES:
                names |= {
                    item.name
                    for item in node.body
                    if isinstance(item, ast.FunctionDef) and not item.name.startswith("__")
                }
    return names


def test_sim_imports_the_core_policies() -> None:
    imported: dict[str, set[str]] = {}
    for _, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.setdefault(node.module, set()).update(a.name for a in node.names)
    for module, names in REQUIRED_IMPORTS.items():
        assert names <= imported.get(module, set()), f"sim/ must import {names} from {module}"


def test_sim_defines_nothing_named_like_a_core_policy() -> None:
    core = _core_names()
    assert {"WaitQueue", "plan_batch", "pick_replica", "effective_priority", "_select"} <= core
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                assert node.name not in core, f"{path.name}:{node.lineno} redefines {node.name}"
                assert not node.name.startswith(POLICY_PREFIXES), (
                    f"{path.name}:{node.lineno}: {node.name} is named like a policy; "
                    "policies live in tidegate.core"
                )


def test_sim_reads_no_attribute_of_a_rule() -> None:
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                assert node.attr not in RULE_ATTRIBUTES, (
                    f"{path.name}:{node.lineno} reads .{node.attr}: that rule belongs to "
                    "tidegate.core; call it instead"
                )


def test_the_simulator_holds_the_core_objects() -> None:
    assert tidegate.sim.gateway.WaitQueue is tidegate.core.queue.WaitQueue
    assert tidegate.sim.gateway.pick_replica is tidegate.core.routing.pick_replica
    assert tidegate.sim.gateway.servable_levels is tidegate.core.routing.servable_levels
    assert tidegate.sim.workers.WaitQueue is tidegate.core.queue.WaitQueue
    assert tidegate.sim.workers.plan_batch is tidegate.core.batching.plan_batch


@pytest.mark.spies  # counts the core's calls by patching its classes
def test_a_run_makes_every_decision_through_the_core(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, int] = {"admit": 0, "pop": 0, "plan_batch": 0, "pick_replica": 0}

    def counted(name: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(WaitQueue, "admit", counted("admit", WaitQueue.admit))
    monkeypatch.setattr(WaitQueue, "pop", counted("pop", WaitQueue.pop))
    monkeypatch.setattr(
        tidegate.sim.workers, "plan_batch", counted("plan_batch", tidegate.sim.workers.plan_batch)
    )
    monkeypatch.setattr(
        tidegate.sim.gateway,
        "pick_replica",
        counted("pick_replica", tidegate.sim.gateway.pick_replica),
    )
    data = {
        "models": [
            {
                "name": "emb",
                "task": "embeddings",
                "engine": "simulated",
                "replicas": 2,
                "batching": {"max_batch_size": 4, "batch_window_ms": 2},
            }
        ]
    }
    arrivals = [Arrival(i * 0.001, 10, 0, ("high", "medium", "low")[i % 3]) for i in range(60)]
    scenario = Scenario(
        config_of(data), "emb", flat_batch_service(5.0), Listed("t", arrivals), {"shared": 2}
    )
    result = Simulation(scenario).run()
    completed = sum(stats.outcomes["completed"] for stats in result.recorder.classes)
    batches = sum(result.recorder.batch_sizes.values())
    assert completed == 60
    assert calls["admit"] == 2 * 60  # the gateway's queue, then the worker's
    assert calls["pick_replica"] == 60  # one route per dispatched request
    assert calls["pop"] >= batches  # every batch is popped from the worker's queue
    assert calls["plan_batch"] >= batches  # and was released by plan_batch
