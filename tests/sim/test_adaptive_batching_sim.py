"""The simulator's workers batch through the same adaptive core: every request completes
exactly once whichever levers are on, and the levers change what they should."""

from __future__ import annotations

from typing import Any

import pytest

from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.workload import Arrival, Listed

from .conftest import config_of, flat_batch_service

LEVELS = ("high", "medium", "low")


def _run(batching: dict[str, Any], arrivals: list[Arrival]) -> Simulation:
    """Run one replica's scenario; the simulation keeps its recorder."""
    data = {
        "models": [
            {
                "name": "emb",
                "task": "embeddings",
                "engine": "simulated",
                "replicas": 1,
                "batching": {"max_batch_size": 4, "batch_window_ms": 5, **batching},
            }
        ]
    }
    scenario = Scenario(
        config_of(data), "emb", flat_batch_service(4.0), Listed("t", arrivals), {"shared": 1}
    )
    simulation = Simulation(scenario)
    simulation.run()
    return simulation


@pytest.mark.parametrize(
    "batching",
    [
        {"window_ms_by_priority": {}},
        {"window_ms_by_priority": {"high": 0}},
        {"load_aware_window": True},
        {"length_candidates": 16, "max_padding_ratio": 1.2},
        {"target_p99_ms": 5, "min_batch_size": 1},
    ],
    ids=["fixed", "level_windows", "load_aware", "length_aware", "aimd"],
)
def test_every_request_completes_once(batching: dict[str, Any]) -> None:
    arrivals = [
        Arrival(i * 0.0007, (10, 200, 40, 12, 90)[i % 5], 0, LEVELS[i % 3]) for i in range(300)
    ]
    simulation = _run(batching, arrivals)
    recorder = simulation.recorder
    completed = sum(stats.outcomes["completed"] for stats in recorder.classes)
    ended = sum(sum(stats.outcomes.values()) for stats in recorder.classes)
    assert completed == ended == 300
    assert sum(size * n for size, n in recorder.batch_sizes.items()) == 300


def test_high_requests_skip_the_window_at_low_load() -> None:
    # One request every 50 ms: no companion ever comes within the 5 ms window.
    arrivals = [Arrival(i * 0.05, 10, 0, LEVELS[i % 3]) for i in range(30)]
    p50 = {}
    for name, batching in (("fixed", {"window_ms_by_priority": {}}), ("adaptive", {})):
        recorder = _run(batching, arrivals).recorder
        high = next(stats for stats in recorder.classes if stats.name == "high")
        p50[name] = high.e2e.percentile(50)
    assert p50["fixed"] is not None
    assert p50["adaptive"] is not None
    assert p50["fixed"] - p50["adaptive"] == pytest.approx(0.005, abs=1e-3)
