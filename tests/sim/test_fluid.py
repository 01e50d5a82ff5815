"""The fleet-level simulator (``sim.fluid``): work is conserved, the controller is the core's
``decide_scale`` fed what the fluid measured, drains pick the core's victims, and the GPU
inventory is never over-committed."""

from __future__ import annotations

import dataclasses
import itertools
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tidegate.cli import app
from tidegate.core.autoscale import (
    AutoscaleConfig,
    DemandSample,
    ScaleInputs,
    ScaleState,
    decide_scale,
)
from tidegate.core.placement import Placement, VictimCandidate, pick_victims
from tidegate.sim import autoscale  # noqa: F401  (registers the autoscalers)
from tidegate.sim.autoscale import CoreAutoscaler
from tidegate.sim.fleet import Lifecycle
from tidegate.sim.fleetfile import load_fleet, read_aggregate, segments_of
from tidegate.sim.fluid import (
    READY,
    STARTING,
    EngineCurve,
    FleetGroup,
    FleetResult,
    FleetScenario,
    FleetSimulation,
    holdback_saturation,
)
from tidegate.sim.fluid_ttft import routed_replicas, routed_ttft
from tidegate.sim.inventory import GpuInventory, Inventory
from tidegate.sim.service import load_service
from tidegate.sim.synthetic import LognormalLengths, Segment

from .conftest import FIXTURES, config_of, flat_step_service

MIX = (("high", 0.2), ("medium", 0.3), ("low", 0.5))
PERF = FIXTURES / "perf_model_slice.csv"


def model(name: str = "m", **autoscaling: Any) -> dict[str, Any]:
    return {
        "name": name,
        "task": "generate",
        "engine": "simulated",
        "replicas": 2,
        "batching": {"max_num_seqs": 16},
        "queue": {"max_size": 500},
        "autoscaling": {
            "min_replicas": 1,
            "max_replicas": 40,
            "target_per_replica": 12,
            "panic": {"threshold": 2, "window_s": 15},
            **autoscaling,
        },
    }


def scenario(
    rates: list[Segment], inventory: Inventory | None = None, **changes: Any
) -> FleetScenario:
    service = load_service(f"{PERF}#llama2-70b/a100-80gb/8")
    base = FleetScenario(
        config_of({"models": [model()]}),
        [FleetGroup("m", rates, service)],
        inventory=inventory or Inventory(nodes=100),
        mix=MIX,
        lifecycle=Lifecycle(cold_start_s=30, warmup_s=5, drain_timeout_s=30),
    )
    return dataclasses.replace(base, **changes)


# A quiet start, a surge far above what 40 replicas serve (the queue fills: holdback,
# refusals, shedding), then a trough (drains) and silence (the work in flight finishes).
SURGE = [
    Segment(0, 600, 2.0),
    Segment(600, 1200, 60.0),
    Segment(1200, 1800, 400.0),
    Segment(1800, 2400, 1.0),
    Segment(2400, 3600, 0.0),
]


Call = tuple[float, int, int, float, float, float | None, int]


@dataclasses.dataclass(frozen=True)
class SurgeRun:
    result: FleetResult
    # the autoscaler's calls: (now, replicas, ready, queued, in_flight, arrived, delta)
    calls: list[Call]
    config: AutoscaleConfig


@pytest.fixture(scope="module")
def surge() -> SurgeRun:
    """One run of SURGE (the slowest simulation here) for the tests that only read it: the
    autoscaler's calls recorded on the way, which changes none of them."""
    sim = FleetSimulation(scenario(SURGE))
    autoscaler = sim.groups[0].autoscaler
    assert isinstance(autoscaler, CoreAutoscaler)
    calls: list[Call] = []
    measured = autoscaler.scale_delta

    def recording(*args: Any) -> int:  # the fluid passes all six positionally
        delta: int = measured(*args)
        calls.append((*args, delta))
        return delta

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(autoscaler, "scale_delta", recording)
        result = sim.run()
    return SurgeRun(result, calls, autoscaler.config)


def test_work_is_conserved_per_level(surge: SurgeRun) -> None:
    result = surge.result
    group = result.groups[0]
    totals: dict[str, float] = {}
    for name, stats in group.summary(result.end_s)["levels"].items():
        outcomes = sum(
            stats[key]
            for key in (
                "completed",
                "refused_holdback",
                "refused_full",
                "unavailable",
                "shed",
                "failed",
                "queued",
                "in_flight",
            )
        )
        assert abs(outcomes - stats["requests"]) <= 1e-6 * stats["requests"], name
        assert stats["completed"] >= 0
        totals[name] = stats["requests"]
    expected = sum((s.end_s - s.start_s) * s.arrivals_per_s for s in SURGE)
    assert abs(sum(totals.values()) - expected) <= 1e-6 * expected
    levels = group.summary(result.end_s)["levels"]
    # the surge went through every path: refused, shed, drained
    assert levels["low"]["refused_holdback"] > 0
    assert levels["low"]["shed"] > 0 or levels["medium"]["refused_holdback"] > 0
    assert group.stopped > 0
    # the last 20 minutes bring nothing: everything ended
    assert all(level["queued"] == 0 and level["in_flight"] < 1e-9 for level in levels.values())


def test_priority_keeps_high_within_its_slo_better_than_fifo() -> None:
    fixed: dict[str, Any] = {"min_replicas": 4, "max_replicas": 4}
    probe = FleetSimulation(scenario([Segment(0, 60, 1.0)])).groups[0].engine
    rates = [Segment(0, 1800, 1.6 * 4 * probe.capacity_per_s)]  # 60% over: a backlog
    priority = scenario(rates, config=config_of({"models": [model(**fixed)]}))
    fifo = scenario(rates, config=config_of({"models": [model(**fixed)]}, policy="fifo"))
    high = [FleetSimulation(s).run().attainment()["high"] for s in (priority, fifo)]
    assert high[0] is not None
    assert high[1] is not None
    assert high[0] > 0.9
    assert high[1] < 0.5


def test_the_controller_is_decide_scale_on_what_the_fluid_measured(surge: SurgeRun) -> None:
    calls = surge.calls
    assert len(calls) > 100
    assert any(delta > 0 for *_, delta in calls)
    assert any(delta < 0 for *_, delta in calls)
    # the same inputs into the core's decide_scale, from a fresh state: the same decisions
    state = ScaleState()
    assert all(arrived is not None for *_, arrived, _ in calls)  # the fluid's counter
    for now, replicas, ready, queued, in_flight, arrived, delta in calls:
        local = datetime.fromtimestamp(now, UTC)
        inputs = ScaleInputs(
            replicas=replicas,
            ready_replicas=ready,
            demand=DemandSample(now, queued, in_flight, arrived),
            local_time=(local.weekday(), local.hour * 60 + local.minute),
        )
        decision, state = decide_scale(inputs, state, surge.config, now)
        assert decision.desired_replicas - decision.current_replicas == delta
    # and the fluid applied each: the next call counts what the last one asked for
    for (_, replicas, *_, delta), (_, after, *_) in itertools.pairwise(calls):
        assert after == replicas + delta


def test_drains_take_the_core_victims() -> None:
    sim = FleetSimulation(scenario([Segment(0, 60, 10.0)]))
    group = sim.groups[0]
    for at in range(6):
        group.start(float(at), warm=True)
    for at in range(6, 10):
        group.start(float(at), warm=False)
    group.running = 3.0 * group.ready
    share = round(group.running / group.ready)
    everyone = [
        VictimCandidate(r.id, share if r.state == READY else 0, r.started_at)
        for r in group.replicas.values()
    ]
    expected = pick_victims(everyone, 7, Placement())
    before = set(group.replicas)
    group.drain(7, 10.0)
    drained = {
        rid
        for rid in before
        if rid not in group.replicas or group.replicas[rid].state not in (READY, STARTING)
    }
    assert drained == set(expected)


def test_holdback_thresholds_come_from_the_core_queue() -> None:
    config = config_of({"models": [model()]})
    queue = config.queue_config("m")
    found = [holdback_saturation(queue, level) for level in range(len(queue.levels))]
    assert found[0] is None
    assert found[1] is not None
    assert abs(found[1] - 0.9) < 1e-6
    assert found[2] is not None
    assert abs(found[2] - 0.7) < 1e-6


def test_a_full_inventory_refuses_replicas_and_never_over_commits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    small = Inventory(nodes=3, gpus_per_node=8)
    sim = FleetSimulation(scenario(SURGE, inventory=small))
    group = sim.groups[0]
    original = group.step

    def checked(now: float, dt: float) -> None:
        original(now, dt)
        assert sim.inventory.violations() == ()
        assert sim.inventory.used_gpus == 8 * len(group.replicas) <= small.gpus

    monkeypatch.setattr(group, "step", checked)
    result = sim.run()
    assert group.placement_refusals > 0
    assert max(used for _, used in result.gpus_in_use) == small.gpus


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(1, 8), st.integers(10_000, 81_920)),
        min_size=1,
        max_size=40,
    )
)
def test_the_inventory_places_whole_replicas_within_memory(
    ops: list[tuple[bool, int, int]],
) -> None:
    inventory = GpuInventory(Inventory(nodes=3, gpus_per_node=8, gpu_memory_mb=81_920))
    live: dict[str, int] = {}
    for index, (add, gpus, memory) in enumerate(ops):
        if add or not live:
            rid = f"r{index}"
            if inventory.put(rid, f"model{gpus}", "shared", gpus, memory):
                live[rid] = gpus
                node = inventory.where[rid]
                shards = [
                    p
                    for p in inventory.placements[node].placed
                    if p.ask.replica_id.startswith(f"{rid}/")
                ]
                assert len(shards) == gpus  # every shard, on one node
        else:
            rid = sorted(live)[index % len(live)]
            inventory.release(rid)
            del live[rid]
        assert inventory.violations() == ()
        used = sum(len(p.used_devices) for p in inventory.placements)
        assert inventory.used_gpus == used


def test_a_static_fleet_under_its_capacity_costs_its_gpus_and_waits_nothing() -> None:
    service = flat_step_service(20.0)
    config = config_of(
        {"models": [{**model(), "autoscaling": None, "replicas": 3}]}  # static
    )
    fleet = FleetScenario(
        config,
        [FleetGroup("m", [Segment(0, 3600, 1.0)], service, gpus=2)],
        controller="static",
        mix=MIX,
    )
    result = FleetSimulation(fleet).run()
    group = result.groups[0]
    assert result.gpu_hours == 3 * 2 * 1.0
    assert all(t.max_wait_s == 0 for t in group.tally)
    assert group.summary(result.end_s)["levels"]["high"]["refused_full"] == 0


def test_the_aggregate_holds_its_gaps_and_repeats_short_days(tmp_path: Path) -> None:
    csv = tmp_path / "aggregate.csv"
    csv.write_text(
        "category,model,window_start_s,day,hour_of_day,total_rate_rps,active_clients,n_clients\n"
        "a,x,0,0,0,5,1,1\na,x,600,0,0,0,0,1\na,x,1200,0,0,7,1,1\n"
    )
    curves = read_aggregate(csv)
    assert curves == {"a/x": [5.0, 5.0, 7.0]}
    segments = segments_of(curves["a/x"], days=1 / 24, window=(900.0, 3000.0))
    assert [(s.start_s, s.end_s, s.arrivals_per_s) for s in segments] == [
        (0.0, 300.0, 5.0),
        (300.0, 900.0, 7.0),
        (900.0, 1500.0, 5.0),
        (1500.0, 2100.0, 5.0),
    ]


FLEET = """\
trace: {trace}
profiles: {profiles}
inventory: {{nodes: 40, gpus_per_node: 8}}
days: 1
window: [0, 7200]
priority_mix: high=0.2,medium=0.3,low=0.5
groups:
  - {{model: big, rates: language/m-large, profile: llama2-70b/a100-80gb/8, replicas: 10}}
  - {{model: r1, rates: reason/deepseek-r1, profile: llama2-70b/a100-80gb/8, output: 300,
     replicas: 2}}
config:
  models:
    - &m
      name: big
      task: generate
      engine: simulated
      batching: {{max_num_seqs: 32}}
      autoscaling: {{min_replicas: 1, max_replicas: 30, target_per_replica: 24}}
    - {{<<: *m, name: r1}}
"""


def test_simulate_fleet_end_to_end(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET.format(trace=FIXTURES / "aggregate_rate_head.csv", profiles=PERF))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        ["simulate", "--fleet", str(fleet), "--compare", "tidegate,static-peak", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert "Fleet-level simulation (tidegate" in result.output
    runs = json.loads((out / "report.json").read_text())["runs"]
    assert [run["controller"] for run in runs] == ["tidegate", "static-peak"]
    tidegate, peak = runs
    assert set(tidegate["groups"]) == {"big", "r1"}
    assert 0 < tidegate["gpu_hours"] < peak["gpu_hours"]
    assert peak["groups"]["big"]["peak_replicas"] == 30
    assert tidegate["end_s"] == 300 * 24
    assert "| big | 8 |" in (out / "report.md").read_text()
    r1 = [s.arrivals_per_s for s in load_fleet(fleet).groups[1].rates]
    assert len(r1) == 12
    assert r1[:3] * 4 == r1  # deepseek-r1's 3 windows, repeated


def test_simulate_fleet_names_a_bad_key(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("trace: x.csv\ngroupz: []\n")
    result = CliRunner().invoke(app, ["simulate", "--fleet", str(fleet)])
    assert result.exit_code == 2
    assert "groupz" in result.output


def test_least_loaded_routing_keeps_long_prefills_apart() -> None:
    """The engine part of the TTFT is measured behind the router (``sim.fluid_ttft``): with
    2,000-token prompts, five replicas at a replica's rate each get more first tokens within
    a second than one alone, since the least loaded replica is rarely still prefilling the
    last arrival; and the table is the same for the same seed."""
    service = load_service(f"{PERF}#llama2-70b/a100-80gb/8")
    assert service.step is not None
    lengths = LognormalLengths(prompt_median=2000, output_median=100)
    engine = EngineCurve(service, lengths, 16, seed=0)
    rate = engine.mu[8]
    tables = {
        replicas: routed_ttft(service.step, lengths, 16, replicas, rate, 60.0, 1000, seed=0)
        for replicas in (1, 5)
    }

    def within(samples: list[float]) -> float:
        return sum(1 for s in samples if s <= 1.0) / len(samples)

    assert within(tables[5]) > within(tables[1]) + 0.02
    assert tables[5] == routed_ttft(service.step, lengths, 16, 5, rate, 60.0, 1000, seed=0)
    assert routed_replicas(3) == 3
    assert routed_replicas(1000) == routed_replicas(17)
