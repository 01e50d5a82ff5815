"""The oracle controller: the fewest replicas for the next interval's known arrivals."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tidegate.gateway.replicas import ReplicaState
from tidegate.sim.control import DrainReplica, FleetView, ReplicaStatus, StartReplica
from tidegate.sim.oracle import (
    OracleController,
    arrival_rates,
    batch_capacity_per_s,
    oracle_replicas,
)
from tidegate.sim.report import run_summary
from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.workload import Arrival, Listed

from .conftest import autoscaled_data, config_of, flat_batch_service, flat_step_service


@dataclass(frozen=True)
class Case:
    name: str
    arrivals_per_s: float
    target_utilisation: float
    expected: int


CASES = [
    Case("no_load_keeps_the_floor", 0.0, 1.0, 2),
    Case("exactly_full_replicas_need_no_extra", 300.0, 1.0, 3),
    Case("a_request_over_full_needs_one_more", 301.0, 1.0, 4),
    Case("lower_utilisation_adds_headroom", 300.0, 0.75, 4),
    Case("more_than_the_ceiling_stays_at_it", 5000.0, 1.0, 8),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_oracle_replicas_for_a_rate(case: Case) -> None:
    got = oracle_replicas(case.arrivals_per_s, 100.0, case.target_utilisation, 2, 8)
    assert got == case.expected


@pytest.mark.parametrize("utilisation", [0.0, 1.5])
def test_a_target_utilisation_outside_0_1_is_refused(utilisation: float) -> None:
    with pytest.raises(ValueError, match="target_utilisation"):
        oracle_replicas(10.0, 100.0, utilisation, 1, 4)


def test_arrival_rates_count_each_interval_from_time_0() -> None:
    # 2 arrivals in [0, 0.5), none in [0.5, 1), 3 in [1, 1.5): per second, x2.
    assert arrival_rates([0.0, 0.4, 1.0, 1.2, 1.49], 0.5) == (4.0, 0.0, 6.0)


def test_arrival_rates_of_an_empty_workload_are_empty() -> None:
    assert arrival_rates([], 1.0) == ()


def test_batch_capacity_is_the_best_throughput_over_batch_sizes() -> None:
    # A flat 100 ms per batch: the largest batch is the fastest, 4 / 0.1 s.
    assert batch_capacity_per_s(flat_batch_service(100.0), 4) == pytest.approx(40.0)


def test_batch_capacity_needs_a_request_level_service() -> None:
    with pytest.raises(ValueError, match="embeddings"):
        batch_capacity_per_s(flat_step_service(10.0), 4)


def _view(now: float, *in_flight: int) -> FleetView:
    replicas = tuple(
        ReplicaStatus(f"r{i}", "shared", ReplicaState.READY, load, 4, float(i))
        for i, load in enumerate(in_flight)
    )
    return FleetView(now, 0, (0, 0, 0), sum(in_flight), replicas)


def _oracle(rates: list[float]) -> OracleController:
    return OracleController(rates, 1.0, 10.0, 1.0, "shared", (1, 5))


def test_oracle_starts_warm_replicas_for_the_coming_interval() -> None:
    # Interval 1 brings 35 req/s: 4 replicas of 10 req/s, 2 more than now, ready at once.
    actions = _oracle([5.0, 35.0]).decide(_view(1.0, 0, 0))
    assert actions == [StartReplica("shared", warm=True)] * 2


def test_oracle_drains_the_least_busy_replicas_when_the_load_falls() -> None:
    actions = _oracle([5.0]).decide(_view(0.0, 3, 0, 1))
    assert actions == [DrainReplica("r1"), DrainReplica("r2")]


def test_oracle_past_the_end_of_the_workload_keeps_the_floor() -> None:
    oracle = _oracle([35.0])
    assert oracle.desired(7.0) == 1
    assert oracle.decide(_view(7.0, 0)) == ()


def test_oracle_in_the_simulation_follows_a_burst_without_cold_start() -> None:
    # 10 req/s, then 100 req/s for 5 s, then 10 again; a replica serves 40 req/s.
    arrivals = [Arrival(i / 10, 16, 0, "high") for i in range(50)]
    arrivals += [Arrival(5 + i / 100, 16, 0, "high") for i in range(500)]
    arrivals += [Arrival(10 + i / 10, 16, 0, "high") for i in range(50)]
    scenario = Scenario(
        config_of(autoscaled_data()),
        "m",
        flat_batch_service(100.0),
        Listed("burst", arrivals),
        {"shared": 1},
        controller="oracle",
    )
    simulation = Simulation(scenario)
    result = simulation.run()
    oracle = simulation.controller
    assert isinstance(oracle, OracleController)
    assert oracle.changes[0] == (5.0, 1, 3)  # 100 / 40 -> 3, at the burst's first tick
    assert max(count for _, _, count in oracle.changes) == 3
    assert oracle.changes[-1][2] == 1
    assert oracle.changes[-1][0] == 10.0
    assert run_summary(result)["classes"]["high"]["completed"] == 600
