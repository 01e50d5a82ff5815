"""Pools that serve only some levels, in virtual time: aged requests run there, and a run
with requests that can never run ends, counting them (``sim.run``'s termination rules)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import yaml

from tidegate.sim.command import SimulateOptions, simulate
from tidegate.sim.control import CONTROLLERS, ControllerContext, FleetAction, FleetView
from tidegate.sim.report import terminal
from tidegate.sim.run import RunResult, Scenario, Simulation
from tidegate.sim.service import default_service
from tidegate.sim.workload import Arrival, Listed

from .conftest import FIXTURES, config_of, flat_batch_service

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MIX = "high=0.2,medium=0.5,low=0.3"
LEVELS = ("high", "medium", "low")


@contextlib.contextmanager
def wall_limit(seconds: float) -> Iterator[None]:
    """Fail, instead of hanging, when a run does not end (the bug this file is about)."""

    def expired(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"the simulation did not end within {seconds} s of wall time")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def outcomes(result: RunResult) -> dict[str, dict[str, int]]:
    return {stats.name: dict(stats.outcomes) for stats in result.recorder.classes}


def assert_every_request_counted_once(result: RunResult) -> None:
    counted = sum(sum(stats.outcomes.values()) for stats in result.recorder.classes)
    assert counted == result.num_requests
    if result.recorder.requests is not None:
        ids = [record.id for record in result.recorder.requests]
        assert sorted(ids, key=int) == [str(i) for i in range(result.num_requests)]


# ----------------------------------------------------------------------------- the example
def test_autoscaling_example_with_mixed_priorities_ends_with_every_request_served() -> None:
    """``chat`` lives in a pool that serves only ``high``: medium and low run there once
    aged to high (32 s and 34 s with the default aging), static or autoscaled."""
    options = SimulateOptions(
        trace=str(FIXTURES / "azure_conv_head.csv"),
        config=str(EXAMPLES / "autoscaling.yaml"),
        priority_mix=MIX,
        compare=("priority", "tidegate"),
    )
    with wall_limit(60):
        results, report = simulate(options)
    for result in results:
        assert_every_request_counted_once(result)
        assert result.stopped is None
        counts = outcomes(result)
        assert all(set(counts[level]) == {"completed"} for level in LEVELS), counts
        assert sum(counts[level]["completed"] for level in LEVELS) == 300
        waits = {stats.name: stats.max_wait_s for stats in result.recorder.classes}
        assert waits["medium"] >= 32.0
        assert waits["low"] >= 34.0
    for run in report["runs"]:
        assert run["stopped"] is None
        assert all(c["unservable"] == 0 and c["stranded"] == 0 for c in run["classes"].values())
    assert not report["warnings"]


def _example_with(**priorities: Any) -> dict[str, Any]:
    data = yaml.safe_load((EXAMPLES / "autoscaling.yaml").read_text())
    data["priorities"] = priorities
    return data


def _mixed(num: int = 90, gap_s: float = 0.5) -> Listed:
    return Listed("mixed", [Arrival(i * gap_s, 64, 16, LEVELS[i % 3]) for i in range(num)])


def test_aging_off_ends_the_run_and_counts_the_levels_no_pool_serves_as_unservable() -> None:
    config = config_of(_example_with(aging={"rate_per_s": 0}))
    scenario = Scenario(
        config,
        "chat",
        default_service("generate"),
        _mixed(),
        {"dedicated": 2},
        keep_requests=True,
    )
    with wall_limit(60):
        result = Simulation(scenario).run()
    assert_every_request_counted_once(result)
    counts = outcomes(result)
    assert counts["high"] == {"completed": 30}
    assert counts["medium"] == {"unservable": 30}
    assert counts["low"] == {"unservable": 30}
    assert result.stopped is not None
    assert "60 unservable: no pool of dedicated serves medium, low" in result.stopped
    # The run ends with the work that could be done, not days of virtual time later.
    assert result.end_at < 45.0 + 60.0
    records = [r for r in result.recorder.requests or () if r.outcome == "unservable"]
    assert len(records) == 60
    assert all(r.wait_s is not None for r in records)


# ----------------------------------------------------------------------------- small configs
def _data(rate_per_s: float, model_pools: Sequence[str]) -> dict[str, Any]:
    return {
        "priorities": {"aging": {"threshold_s": 30, "rate_per_s": rate_per_s}},
        "pools": {
            "dedicated": {"priorities": ["high"], "devices": ["cpu"]},
            "shared": {"priorities": ["high", "medium", "low"], "devices": ["cpu"]},
        },
        "models": [
            {
                "name": "m",
                "task": "embeddings",
                "engine": "simulated",
                "pools": list(model_pools),
                "slots": 2,
                "batching": {"max_batch_size": 2, "batch_window_ms": 0},
            }
        ],
    }


def _run(
    data: dict[str, Any],
    arrivals: list[Arrival],
    replicas: dict[str, int],
    controller: str = "static",
    max_stall_s: float | None = None,
) -> RunResult:
    scenario = Scenario(
        config_of(data),
        "m",
        flat_batch_service(100.0),
        Listed("test", arrivals),
        replicas,
        controller=controller,
        keep_requests=True,
        max_stall_s=max_stall_s,
    )
    with wall_limit(60):
        result = Simulation(scenario).run()
    assert_every_request_counted_once(result)
    return result


def test_an_aged_request_is_dispatched_by_a_timer_at_the_moment_it_reaches_the_pool() -> None:
    # Nothing else happens after the arrival: only the gateway's aging timer can wake it.
    result = _run(_data(0.5, ["dedicated"]), [Arrival(0.0, 16, 0, "medium")], {"dedicated": 1})
    (record,) = result.recorder.requests or ()
    assert record.outcome == "completed"
    assert record.wait_s == pytest.approx(32.0)  # threshold 30 s + 1 level at 0.5/s


def test_a_static_fleet_that_can_never_serve_a_level_strands_it_without_waiting() -> None:
    # The model could run medium in ``shared``, but the static fleet has none there and
    # aging is off: nothing will ever change.
    arrivals = [Arrival(i * 1.0, 16, 0, LEVELS[i % 2]) for i in range(10)]
    result = _run(_data(0.0, ["dedicated", "shared"]), arrivals, {"dedicated": 1})
    counts = outcomes(result)
    assert counts["high"] == {"completed": 5}
    assert counts["medium"] == {"stranded": 5}
    assert result.stopped is not None
    assert "5 stranded: the fleet is static" in result.stopped
    assert result.end_at < 10.0 + 1.0


class _Idle:
    """A controller that never acts (and is not the static one): only the guard can tell."""

    interval_s = 15.0

    def __init__(self, context: ControllerContext) -> None:
        pass

    def decide(self, view: FleetView) -> Sequence[FleetAction]:
        return ()


def test_the_stall_guard_ends_a_run_where_nothing_is_dispatched_for_max_stall_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(CONTROLLERS, "idle", _Idle)
    arrivals = [Arrival(i * 1.0, 16, 0, LEVELS[i % 2]) for i in range(10)]
    result = _run(
        _data(0.0, ["dedicated", "shared"]), arrivals, {"dedicated": 1}, "idle", max_stall_s=600
    )
    counts = outcomes(result)
    assert counts["medium"] == {"stranded": 5}
    assert result.stopped is not None
    assert "nothing was dispatched for 6" in result.stopped
    assert result.end_at < 10.0 + 1.0  # the span is that of the work done, not of the wait


def test_report_counts_what_never_ran_and_warns(tmp_path: Path) -> None:
    trace = tmp_path / "mixed.csv"
    rows = [f"{i * 0.5},64,16,{LEVELS[i % 3]}," for i in range(60)]
    trace.write_text("arrival_s,prompt_tokens,output_tokens,priority,tenant\n" + "\n".join(rows))
    config = tmp_path / "aging-off.yaml"
    config.write_text(yaml.safe_dump(_example_with(aging={"rate_per_s": 0})))
    with wall_limit(60):
        _, report = simulate(SimulateOptions(trace=str(trace), config=str(config)))
    (run,) = report["runs"]
    assert run["classes"]["medium"]["unservable"] == 20
    assert run["classes"]["low"]["unservable"] == 20
    assert run["classes"]["high"]["completed"] == 20
    assert "40 unservable" in run["stopped"]
    assert any("requests never ran" in warning for warning in report["warnings"])
    assert "warning: priority: requests never ran: 40 unservable" in terminal(report)


def test_a_workload_at_one_level_is_warned_about() -> None:
    options = SimulateOptions(
        trace=str(FIXTURES / "azure_conv_head.csv"), compare=("fifo", "priority")
    )
    with wall_limit(60):
        _, report = simulate(options)
    assert any("every request is at priority medium" in w for w in report["warnings"])
    assert "--priority-mix" in terminal(report)
    mixed = SimulateOptions(
        trace=str(FIXTURES / "azure_conv_head.csv"), compare=("fifo", "priority"), priority_mix=MIX
    )
    with wall_limit(60):
        _, report = simulate(mixed)
    assert report["warnings"] == []
