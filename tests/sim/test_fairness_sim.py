"""Fair sharing in the simulator: workload tenants reach the core queue, and a flooding
tenant does not delay a light one under VTC as it does first come, first served, nor keep
the sequence slots it took beyond its share when a light one waits."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.sim.recorder import RequestRecord
from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.service import ServiceModel
from tidegate.sim.traces import open_trace
from tidegate.sim.workers import SequenceWorker
from tidegate.sim.workload import Arrival, Limited, Listed

from .conftest import FIXTURES, config_of, flat_batch_service, flat_step_service, run_records


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


def _generation(fair: bool) -> dict[str, Any]:
    return {
        "models": [
            {
                "name": "m",
                "task": "generate",
                "engine": "simulated",
                "replicas": 1,
                "batching": {"max_num_seqs": 4},
            }
        ],
        "tenancy": {"fair_sharing": fair},
    }


def _run_generation(
    data: dict[str, Any], arrivals: list[Arrival], slot_shares: bool = True
) -> tuple[Simulation, dict[str, RequestRecord]]:
    """``arrivals`` on ``data``'s generation model (10 ms a step); every one completes."""
    scenario = Scenario(
        config_of(data),
        "m",
        flat_step_service(10.0),
        Listed("test", arrivals),
        {"shared": 1},
        keep_requests=True,
    )
    simulation = Simulation(scenario)
    simulation.gateway.slot_shares = slot_shares
    result = simulation.run()
    assert result.recorder.requests is not None
    records = {record.id: record for record in result.recorder.requests}
    assert all(record.outcome == "completed" for record in records.values())
    return simulation, records


# At t=0: light's long request (4,000 prompt tokens: its counter is far above heavy's) and
# heavy's ten; the 4 sequence slots go to light 1, heavy 3. At t=0.5 light's short one.
GENERATION = [Arrival(0.0, 4000, 200, None, "light")] + [
    Arrival(0.001 * (i + 1), 10, 200, None, "heavy") for i in range(10)
]
GENERATION.append(Arrival(0.5, 10, 5, None, "light"))
SHORT, HEAVY_NEXT = str(len(GENERATION) - 1), "4"  # light's short one, heavy's 4th


@pytest.mark.parametrize(("slot_shares", "first"), [(True, SHORT), (False, HEAVY_NEXT)])
def test_a_freed_sequence_slot_goes_to_the_tenant_under_its_share(
    slot_shares: bool, first: str
) -> None:
    """Light's long request ends first (t=2.0), freeing one slot: heavy holds 3, over its
    share of 2, so light's short request takes it, though heavy's counter is lower; without
    slot shares heavy's counter takes it. Every slot is given back at the end."""
    simulation, records = _run_generation(_generation(True), GENERATION, slot_shares)
    dispatched_at = {
        rid: GENERATION[int(rid)].arrival_s + (records[rid].wait_s or 0.0)
        for rid in (SHORT, HEAVY_NEXT)
    }
    assert min(dispatched_at, key=dispatched_at.__getitem__) == first
    assert dispatched_at[first] == pytest.approx(2.0, abs=0.005)
    tenants = simulation.gateway.queue.tenants()
    assert all(tenant["in_flight"] == 0 for tenant in tenants.values())


# Heavy alone sends ten at t=0 (200 output tokens each: 2 s of decode); light one at t=0.5.
FLOOD_THEN_LIGHT = [Arrival(0.001 * i, 10, 200, None, "heavy") for i in range(10)]
FLOOD_THEN_LIGHT.append(Arrival(0.5, 10, 5, None, "light"))


@pytest.mark.parametrize(
    ("reserve_fraction", "heavy_started", "light_waits"), [(0.25, 3, False), (0.0, 4, True)]
)
def test_the_slot_reserve_starts_a_newcomer_at_once(
    reserve_fraction: float, heavy_started: int, light_waits: bool
) -> None:
    """4 sequence slots, a quarter reserved: heavy, alone, starts 3 and light's request
    takes the fourth on arrival; without the reserve heavy starts 4 and light waits for the
    first to end (t=2). Every request completes and every slot is given back."""
    data = _generation(True)
    data["tenancy"]["slot_reserve_fraction"] = reserve_fraction
    simulation, records = _run_generation(data, FLOOD_THEN_LIGHT)
    started = sum((records[str(i)].wait_s or 0.0) < 0.1 for i in range(10))
    assert started == heavy_started
    light_wait_s = records[str(len(FLOOD_THEN_LIGHT) - 1)].wait_s or 0.0
    assert (light_wait_s > 1.0) == light_waits, light_wait_s
    tenants = simulation.gateway.queue.tenants()
    assert all(tenant["in_flight"] == 0 for tenant in tenants.values())


# The prefill budget (batching.max_prefill_tokens): heavy sends six of 100 prompt tokens at
# t=0..0.005 and light one at t=0.012; 8 sequence slots, so the gateway dispatches them all
# at once and the order is the worker's. Steps are 10 ms: heavy 0 is prefilled in [0, 0.01).
BUDGET_ARRIVALS = [Arrival(0.001 * i, 100, 50, None, "heavy") for i in range(6)]
BUDGET_ARRIVALS.append(Arrival(0.012, 100, 50, None, "light"))


def _first_token_at(records: dict[str, RequestRecord], rid: str) -> float:
    ttft = records[rid].ttft_s
    assert ttft is not None
    return BUDGET_ARRIVALS[int(rid)].arrival_s + ttft


@pytest.mark.parametrize(
    ("fair", "budget", "heavy_before_light"),
    [
        (True, 100, 2),  # one prompt per step; the worker's counters put light next: t=0.03
        (False, 100, 6),  # one prompt per step in arrival order: light last, t=0.07
        (True, 0, 6),  # no budget: heavy 1-5 joined the step at t=0.01 before light came
    ],
)
def test_with_a_prefill_budget_the_workers_fair_queue_orders_the_prefills(
    fair: bool, budget: int, heavy_before_light: int
) -> None:
    data = _generation(fair)
    data["models"][0]["batching"] = {"max_num_seqs": 8, "max_prefill_tokens": budget}
    data["tenancy"]["slot_reserve_fraction"] = 0.0
    simulation, records = _run_generation(data, BUDGET_ARRIVALS)
    light_at = _first_token_at(records, "6")
    assert sum(_first_token_at(records, str(i)) < light_at for i in range(6)) == (
        heavy_before_light
    )
    (replica,) = simulation.fleet.live.values()
    assert isinstance(replica.worker, SequenceWorker)
    assert replica.worker.pending_prefill == 0


class _StepSpy:
    """10 ms steps; remembers each step's prefill: (sequences, prompt tokens)."""

    def __init__(self) -> None:
        self.prefills: list[tuple[int, int]] = []

    def step_s(self, num_decode: int, num_prefill: int, prefill_tokens: int) -> float:
        if num_prefill:
            self.prefills.append((num_prefill, prefill_tokens))
        return 0.01


@settings(max_examples=40, deadline=None)
@given(
    budget=st.integers(min_value=1, max_value=400),
    fair=st.booleans(),
    arrivals=st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=0.2),
            st.integers(min_value=1, max_value=300),
            st.integers(min_value=1, max_value=20),
            st.sampled_from(["a", "b", "c"]),
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_a_prefill_step_holds_more_than_the_budget_only_as_one_prompt(
    budget: int, fair: bool, arrivals: list[tuple[float, int, int, str]]
) -> None:
    """Whatever arrives: a step prefills several prompts only within the budget (one alone
    may exceed it), every request completes, and nothing is left counted as pending."""
    data = _generation(fair)
    data["models"][0]["batching"] = {"max_num_seqs": 4, "max_prefill_tokens": budget}
    spy = _StepSpy()
    workload = [
        Arrival(at, prompt, output, None, tenant) for at, prompt, output, tenant in sorted(arrivals)
    ]
    scenario = Scenario(
        config_of(data),
        "m",
        ServiceModel("spy", "generate", step=spy),
        Listed("test", workload),
        {"shared": 1},
        keep_requests=True,
    )
    simulation = Simulation(scenario)
    result = simulation.run()
    assert result.recorder.requests is not None
    assert len(result.recorder.requests) == len(workload)
    assert all(record.outcome == "completed" for record in result.recorder.requests)
    assert all(count == 1 or tokens <= budget for count, tokens in spy.prefills)
    assert sum(count for count, _ in spy.prefills) == len(workload)
    for replica in simulation.fleet.live.values():
        assert isinstance(replica.worker, SequenceWorker)
        assert replica.worker.pending_prefill == 0
