"""The server's autoscaler in virtual time: bursts, windows, schedules, the baselines."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime
from typing import Any

import pytest

from tidegate.core.autoscale import AutoscaleConfig, ScaleReason
from tidegate.sim.autoscale import CoreAutoscaler, compress
from tidegate.sim.fleet import Lifecycle
from tidegate.sim.run import RunResult, Scenario, Simulation
from tidegate.sim.workload import Arrival, Listed

from .conftest import autoscaled_data, config_of, flat_batch_service

LIFECYCLE = Lifecycle(cold_start_s=5.0, warmup_s=1.0, drain_timeout_s=5.0)


def _burst() -> Listed:
    """10 req/s for 60 s, 60 req/s for 60 s, 10 req/s for 240 s (a flat 100 ms per batch of
    up to 4 serves about 40 req/s per replica)."""
    arrivals: list[Arrival] = []
    t = 0.0
    for rate, length_s in ((10, 60), (60, 60), (10, 240)):
        end = t + length_s
        while t < end:
            arrivals.append(Arrival(t, 16, 0, "high"))
            t += 1.0 / rate
    return Listed("burst", arrivals)


def _run(controller: str, **autoscaling: Any) -> tuple[RunResult, Simulation]:
    scenario = Scenario(
        config_of(autoscaled_data(**autoscaling)),
        "m",
        flat_batch_service(100.0),
        _burst(),
        {"shared": 1},
        controller=controller,
        lifecycle=LIFECYCLE,
    )
    simulation = Simulation(scenario)
    return simulation.run(), simulation


def _decisions(simulation: Simulation) -> list[tuple[float, int, int]]:
    controller = simulation.controller
    assert isinstance(controller, CoreAutoscaler)
    return [(d.decided_at, d.current_replicas, d.desired_replicas) for d in controller.decisions]


def test_a_burst_scales_up_at_once_and_down_only_after_the_window() -> None:
    window_s = 30.0
    result, simulation = _run(
        "tidegate",
        scale_down={
            "stabilization_window_s": window_s,
            "select_policy": "max",
            "policies": [{"type": "pods", "value": 1, "period_s": 1}],
        },
    )
    controller = simulation.controller
    assert isinstance(controller, CoreAutoscaler)
    changes = controller.decisions
    ups = [d for d in changes if d.desired_replicas > d.current_replicas]
    downs = [d for d in changes if d.desired_replicas < d.current_replicas]
    assert ups[0].decided_at <= 64  # within a few periods of the burst at t=60
    assert max(d.desired_replicas for d in changes) >= 2
    # Every scale-in is one the down window allowed: nothing recommended in the last 30 s
    # asked for more than the count it went to.
    assert downs
    assert all(d.window_highest is not None for d in downs)
    assert all(d.window_highest <= d.desired_replicas for d in downs)  # type: ignore[operator]
    # Back to one replica only once the burst (until t=120) is a window behind.
    back_to_one = min(d.decided_at for d in downs if d.desired_replicas == 1)
    assert back_to_one >= 120 + window_s - 1
    assert changes[-1].desired_replicas == 1
    outcomes = sum((c.outcomes for c in result.recorder.classes), Counter[str]())
    assert outcomes == Counter({"completed": result.num_requests})


def test_static_peak_holds_max_replicas_and_costs_more_than_tidegate() -> None:
    tidegate, _ = _run("tidegate")
    static, _ = _run("static-peak")
    # static-peak starts the rest of max_replicas at the first period: 6 replicas all day.
    assert static.replica_seconds > 5 * 300
    assert tidegate.replica_seconds < static.replica_seconds


def test_hpa_default_keeps_the_bounds_but_not_the_behavior() -> None:
    _, simulation = _run("hpa-default", scale_to_zero=False)
    controller = simulation.controller
    assert isinstance(controller, CoreAutoscaler)
    assert controller.config.scale_down.stabilization_window_s == 300
    assert (controller.config.min_replicas, controller.config.max_replicas) == (1, 6)
    assert controller.config.schedules == ()


def test_compress_divides_every_duration_but_not_the_schedules() -> None:
    config = AutoscaleConfig(interval_s=15, cold_start_s=120, stable_window_s=60)
    fast = compress(config, 10)
    assert (fast.interval_s, fast.stable_window_s) == (1.5, 6)
    assert fast.cold_start_s == 120  # a lead in wall time, like the schedules
    assert fast.scale_down.stabilization_window_s == config.scale_down.stabilization_window_s / 10
    assert [p.period_s for p in fast.scale_up.policies] == [1.5, 1.5]
    assert fast.schedules == config.schedules


@pytest.mark.parametrize("speedup", [1.0, 60.0])
def test_a_schedule_opens_early_by_the_cold_start_in_wall_time(speedup: float) -> None:
    # Virtual time 0 is Monday 07:50 UTC; a weekday floor of 3 from 08:00 with a 5-minute
    # cold start opens at 07:55, i.e. 300 s of the day (300 / speedup virtual seconds) in.
    start = datetime(2026, 11, 30, 7, 50, tzinfo=UTC).timestamp()
    data = autoscaled_data(
        schedules=[{"days": "weekdays", "from": "08:00", "to": "18:00", "min_replicas": 3}],
        cold_start_s=300,
        interval_s=15,
    )
    arrivals = [Arrival(i * 10.0 / speedup, 16, 0, "high") for i in range(120)]
    scenario = Scenario(
        config_of(data),
        "m",
        flat_batch_service(10.0),
        Listed("trickle", arrivals),
        {"shared": 1},
        controller="tidegate",
        lifecycle=LIFECYCLE,
        start_wall_s=start,
        speedup=speedup,
    )
    simulation = Simulation(scenario)
    simulation.run()
    controller = simulation.controller
    assert isinstance(controller, CoreAutoscaler)
    (first, *_) = controller.decisions
    assert first.desired_replicas == 3
    assert first.reason == ScaleReason.SCHEDULE
    assert 300 / speedup <= first.decided_at <= (300 + 15) / speedup


def test_a_rate_target_follows_the_arrivals_in_virtual_time() -> None:
    # 25 arrivals/s per replica: 10 req/s wants 1, the burst's 60 req/s wants 3 (a replica
    # serves about 40), and the count comes back to 1 once the window has passed.
    result, simulation = _run(
        "tidegate",
        target_rate_per_replica=25,
        stable_window_s=5,
        scale_down={
            "stabilization_window_s": 10,
            "select_policy": "max",
            "policies": [{"type": "pods", "value": 1, "period_s": 1}],
        },
    )
    controller = simulation.controller
    assert isinstance(controller, CoreAutoscaler)
    rates = [d.rate for d in controller.decisions if d.rate is not None]
    assert rates  # the changes were sized on the rate
    burst = [d for d in controller.decisions if 60 < d.decided_at <= 120]
    assert max(d.desired_replicas for d in burst) == 3
    assert controller.decisions[-1].desired_replicas == 1
    assert all(d.recommendation is None or d.recommendation <= 3 for d in controller.decisions)
    assert result.num_requests == len(_burst().arrivals)
