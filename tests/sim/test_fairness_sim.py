"""Fair sharing in the simulator: workload tenants reach the core queue, and a flooding
tenant does not delay a light one under VTC as it does first come, first served."""

from __future__ import annotations

from typing import Any

import pytest

from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.traces import open_trace
from tidegate.sim.workload import Arrival, Limited

from .conftest import FIXTURES, config_of, flat_batch_service, run_records


def _data(fair: bool) -> dict[str, Any]:
    return {
        "models": [
            {
                "name": "m",
                "task": "embeddings",
                "engine": "simulated",
                "replicas": 1,
                "slots": 1,
                "batching": {"max_batch_size": 1, "batch_window_ms": 0},
            }
        ],
        "tenancy": {"fair_sharing": fair},
    }


# A burst of 40 from "heavy" at t=0..0.039, then one request of "light" at 0.05.
ARRIVALS = [Arrival(i * 0.001, 10, 0, None, "heavy") for i in range(40)] + [
    Arrival(0.05, 10, 0, None, "light")
]


@pytest.mark.parametrize(("fair", "max_wait_s"), [(False, 0.3), (True, 0.03)])
def test_a_light_tenant_waits_behind_the_flood_only_without_fairness(
    fair: bool, max_wait_s: float
) -> None:
    records = run_records(_data(fair), flat_batch_service(10.0), ARRIVALS)
    light = records[str(len(ARRIVALS) - 1)]
    assert light.outcome == "completed"
    assert light.wait_s is not None
    if fair:  # served as soon as the request running ends, or one after (ties: 10 ms each)
        assert light.wait_s <= max_wait_s
    else:  # behind every heavy request still queued at 0.05: about 35 x 10 ms
        assert light.wait_s >= max_wait_s
    assert all(record.outcome == "completed" for record in records.values())


def test_per_client_trace_tenants_reach_the_queue() -> None:
    """ServeGen per-client files: each chunk is a tenant, and the queue counts each one."""
    workload = Limited(open_trace(str(FIXTURES / "servegen")), 1800.0)
    tenants = {arrival.tenant for arrival in workload}
    assert len(tenants) >= 2
    scenario = Scenario(
        config_of(_data(True)), "m", flat_batch_service(10.0), workload, {"shared": 1}
    )
    simulation = Simulation(scenario)
    simulation.run()
    assert set(simulation.gateway.queue.tenants()) == tenants
