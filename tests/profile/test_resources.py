"""Reading a worker's batch counters, and what a stretch between two snapshots cost."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tidegate.engines.steps import StepTally, StepTotals
from tidegate.profile.options import ProfileOptions, powers_of_two
from tidegate.profile.resources import Counters, Snapshot, parse_counters, usage_between
from tidegate.worker.step_metrics import StepCollector

WORKER_METRICS = """\
# HELP tidegate_batch_size Inputs per batch.
# TYPE tidegate_batch_size histogram
tidegate_batch_size_bucket{le="8.0",model="minilm"} 10.0
tidegate_batch_size_bucket{le="+Inf",model="minilm"} 10.0
tidegate_batch_size_count{model="minilm"} 10.0
tidegate_batch_size_sum{model="minilm"} 80.0
# HELP tidegate_batch_duration_seconds Engine time per batch.
# TYPE tidegate_batch_duration_seconds histogram
tidegate_batch_duration_seconds_bucket{le="+Inf",model="minilm"} 10.0
tidegate_batch_duration_seconds_count{model="minilm"} 10.0
tidegate_batch_duration_seconds_sum{model="minilm"} 0.36
# HELP tidegate_engine_memory_bytes Engine memory: weights and peak.
# TYPE tidegate_engine_memory_bytes gauge
tidegate_engine_memory_bytes{device="cpu",kind="weights",model="minilm"} 9.1226112e+07
tidegate_engine_memory_bytes{device="cpu",kind="peak",model="minilm"} 5.24288e+08
"""


def test_worker_metrics_give_batches_and_memory() -> None:
    counters = parse_counters(WORKER_METRICS)
    assert counters == Counters(
        num_batches=10.0,
        batched_inputs=80.0,
        batch_seconds=0.36,
        reported_peak_mb=500.0,
        weights_mb=pytest.approx(87.0),  # type: ignore[arg-type]
    )


def test_a_fresh_worker_has_counters_at_zero() -> None:
    fresh = (
        "# HELP tidegate_worker_ready 1 once warm-up succeeded.\n"
        "# TYPE tidegate_worker_ready gauge\n"
        'tidegate_worker_ready{model="m"} 1.0\n'
    )
    assert parse_counters(fresh) == Counters(0.0, 0.0, 0.0, None, None)


def test_another_server_has_no_counters() -> None:
    vllm = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3.0\n"
    assert parse_counters(vllm) is None


def snap(
    at: float,
    own: float,
    worker: float | None,
    busy: float | None,
    batches: float,
    inputs: float,
    seconds: float,
) -> Snapshot:
    return Snapshot(at, own, worker, busy, 100.0, Counters(batches, inputs, seconds, None, None))


def test_usage_between_two_snapshots() -> None:
    usage = usage_between(
        snap(10, 1.0, 5.0, 50.0, 10, 80, 0.4), snap(12, 1.2, 8.6, 54.0, 60, 480, 2.4)
    )
    assert usage.worker_cpu_cores == pytest.approx(1.8)
    assert usage.loadgen_cpu_cores == pytest.approx(0.1)
    assert usage.other_cpu_cores == pytest.approx(0.1)  # 2.0 busy - 1.8 - 0.1
    assert usage.batch_latency_ms == pytest.approx(40.0)
    assert usage.mean_batch_size == pytest.approx(8.0)


def test_usage_without_a_local_worker_or_batches() -> None:
    usage = usage_between(snap(0, 0, None, None, 5, 5, 1), snap(1, 0.1, None, None, 5, 5, 1))
    assert (usage.worker_cpu_cores, usage.other_cpu_cores) == (None, None)
    assert (usage.batch_latency_ms, usage.mean_batch_size) == (None, None)


@pytest.mark.parametrize(
    ("most", "values"),
    [(1, [1]), (8, [1, 2, 4, 8]), (48, [1, 2, 4, 8, 16, 32, 48])],
    ids=["one", "power_of_two", "not_a_power_of_two"],
)
def test_sweeps_climb_in_powers_of_two(most: int, values: list[int]) -> None:
    assert powers_of_two(most) == values


def test_the_concurrency_sweep_is_bounded_by_max_concurrency() -> None:
    options = ProfileOptions(model="m", out=Path("unused"), max_concurrency=16)
    assert options.concurrency_levels(4 * 8) == [1, 2, 4, 8, 16]
    assert options.window_s() == pytest.approx(5.0 / 3)


def test_a_generation_worker_s_steps_price_a_join_between_two_snapshots() -> None:
    """The engine's step table as the worker exports it, read back by the planner."""
    tally = StepTally()
    registry = CollectorRegistry()
    registry.register(StepCollector("chat", tally))
    tally.add(0, 1, 0.120)  # alone on an idle engine
    tally.add(1, 0, 0.050)
    before = parse_counters(generate_latest(registry).decode())
    for _ in range(4):
        tally.add(2, 0, 0.060)  # two decoding: 60 ms a step
    tally.add(1, 1, 0.160)  # one joins the one decoding: 100 ms over a decode step of 2
    tally.add(0, 2, 0.200)  # an idle engine again: not a join
    after = parse_counters(generate_latest(registry).decode())
    assert before is not None
    assert after is not None
    assert after.steps[("start", 2)] == StepTotals(1, pytest.approx(0.2), 2)  # type: ignore[arg-type]
    first = Snapshot(0, 0, None, None, None, before)
    usage = usage_between(first, Snapshot(1, 0, None, None, None, after))
    assert usage.join is not None
    assert usage.join.num_joins == 1
    assert usage.join.join_ms == pytest.approx(100.0)
    assert usage.join.decode_ms == pytest.approx(60.0)
    assert usage_between(first, first).join is None  # nobody joined in between
