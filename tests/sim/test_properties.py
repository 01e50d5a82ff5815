"""Whatever the workload and the settings: every request ends exactly once, no time runs
backwards, and the same inputs give the same outcome."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.workload import Arrival, Listed

from .conftest import config_of, flat_batch_service, flat_step_service

LEVELS = ("high", "medium", "low")

arrivals = st.lists(
    st.tuples(
        st.floats(0.0, 5.0, allow_nan=False),
        st.integers(1, 300),
        st.integers(0, 40),
        st.sampled_from(LEVELS),
    ),
    max_size=80,
)


@st.composite
def setups(draw: st.DrawFn) -> dict[str, Any]:
    task = draw(st.sampled_from(["embeddings", "generate"]))
    timeouts = draw(st.dictionaries(st.sampled_from(LEVELS), st.floats(0.05, 3.0), max_size=2))
    two_pools = draw(st.booleans())  # a dedicated pool for high, and a shared one
    return {
        "task": task,
        "two_pools": two_pools,
        "policy": draw(st.sampled_from(["priority", "fifo"])),
        "replicas": {"dedicated": 1, "shared": draw(st.integers(1, 2))}
        if two_pools
        else {"shared": draw(st.integers(1, 3))},
        "service_ms": draw(st.floats(1.0, 200.0)),
        "model": {
            "name": "m",
            "task": task,
            "engine": "simulated",
            "slots": draw(st.integers(1, 8)),
            "batching": {
                "max_batch_size": draw(st.integers(1, 8)),
                "batch_window_ms": draw(st.sampled_from([0.0, 5.0, 50.0])),
                "max_batch_tokens": draw(st.sampled_from([None, 200, 1000])),
                "max_num_seqs": draw(st.integers(1, 8)),
            },
            "queue": {"max_size": draw(st.integers(1, 50)), "timeout_s": timeouts},
        },
    }


@settings(max_examples=60, deadline=None)
@given(setups(), arrivals)
def test_every_request_ends_exactly_once(setup: dict[str, Any], raw: list[Any]) -> None:
    generate = setup["task"] == "generate"
    workload = [
        Arrival(at, prompt, max(1, output) if generate else 0, level)
        for at, prompt, output, level in sorted(raw)
    ]
    service = (flat_step_service if generate else flat_batch_service)(setup["service_ms"])
    data: dict[str, Any] = {"models": [setup["model"]]}
    if setup["two_pools"]:
        data["pools"] = {"dedicated": {"priorities": ["high"]}, "shared": None}
    scenario = Scenario(
        config_of(data, setup["policy"]),
        "m",
        service,
        Listed("p", workload),
        setup["replicas"],
        keep_requests=True,
    )
    simulation = Simulation(scenario)
    result = simulation.run()
    records = result.recorder.requests
    assert records is not None
    assert sorted(int(r.id) for r in records) == list(range(len(workload)))
    for record in records:
        if record.outcome == "completed":
            assert record.wait_s is not None
            assert record.ttft_s is not None
            assert record.e2e_s is not None
            assert 0.0 <= record.wait_s <= record.ttft_s <= record.e2e_s + 1e-12
    counted = sum(sum(c.outcomes.values()) for c in result.recorder.classes)
    assert counted == len(workload) == result.num_requests
    # Nothing is left behind: queues empty, every slot given back.
    assert len(simulation.gateway.queue) == 0
    assert simulation.fleet.in_flight == 0
    again = Simulation(scenario).run()
    assert again.recorder.requests == records
