"""decide_scale sized on the arrival rate (``target_rate_per_replica``): the recommendation
follows arrivals per second from the samples' counters; panic mode and a sample without a
counter stay on the queue."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidegate.core.autoscale import (
    AutoscaleConfig,
    DemandSample,
    ScaleDecision,
    ScaleInputs,
    ScaleReason,
    ScaleState,
    decide_scale,
)


def config(**overrides: object) -> AutoscaleConfig:
    base: dict[str, object] = {
        "min_replicas": 1,
        "max_replicas": 20,
        "target_per_replica": 48.0,
        "target_rate_per_replica": 100.0,
        "stable_window_s": 30.0,
    }
    return AutoscaleConfig(**{**base, **overrides})


def run(
    ticks: Sequence[tuple[float, float, float | None]], cfg: AutoscaleConfig, start: int = 4
) -> list[ScaleDecision]:
    """Decide at each (time, queued, arrived so far); the count becomes what was decided."""
    state, replicas, out = ScaleState(), start, []
    for at, queued, arrived in ticks:
        sample = DemandSample(at, queued, 0.0, arrived)
        decision, state = decide_scale(ScaleInputs(replicas, replicas, sample), state, cfg, at)
        replicas = decision.desired_replicas
        out.append(decision)
    return out


def test_the_recommendation_follows_arrivals_per_second_not_the_queue() -> None:
    # 650 arrivals/s for a target of 100/s: 7 replicas, whatever the queue holds (a quiet 10).
    ticks = [(15.0 * i, 10.0, 650.0 * 15 * i) for i in range(4)]
    decisions = run(ticks, config())
    assert decisions[0].rate is None  # one counter: no rate yet, the queue (10 / 48: 1)
    assert [d.rate for d in decisions[1:]] == pytest.approx([650.0] * 3)
    assert decisions[1].recommendation == 7
    assert decisions[-1].desired_replicas == 7
    assert "650 arrivals/s on" in decisions[-1].describe()
    # The same queue on the queue signal asks for one replica.
    queue_only = run(ticks, config(target_rate_per_replica=None))
    assert queue_only[1].recommendation == 1
    assert all(d.rate is None for d in queue_only)


def test_the_rate_counts_from_the_last_counter_before_the_window() -> None:
    # Samples every 15 s, a 30 s window: the rate spans the last 30 s (three counters kept),
    # so a burst of 3,000 arrivals in one interval reads as 100/s, not 200/s.
    counts = [0.0, 0.0, 0.0, 3000.0]
    decisions = run([(15.0 * i, 0.0, c) for i, c in enumerate(counts)], config())
    assert decisions[-1].rate == pytest.approx(100.0)


def test_a_window_of_zero_takes_the_rate_since_the_previous_decision() -> None:
    decisions = run(
        [(0.0, 0.0, 0.0), (15.0, 0.0, 1500.0), (30.0, 0.0, 6000.0)], config(stable_window_s=0.0)
    )
    assert [d.rate for d in decisions[1:]] == pytest.approx([100.0, 300.0])


def test_a_sample_without_a_counter_sizes_on_the_queue() -> None:
    decisions = run([(0.0, 480.0, None), (15.0, 480.0, None)], config(), start=4)
    assert all(d.rate is None for d in decisions)
    assert decisions[-1].recommendation == 10  # 480 / 48


def test_panic_stays_on_the_queue() -> None:
    # The rate says 2 replicas; a queue of 1,000 on 2 ready is 10x its target of 48: panic.
    cfg = config(panic_threshold=2.0, panic_window_s=15.0)
    decisions = run([(0.0, 0.0, 0.0), (15.0, 0.0, 3000.0), (30.0, 1000.0, 6000.0)], cfg, 2)
    assert decisions[1].recommendation == 2
    assert decisions[2].reason in (ScaleReason.PANIC, ScaleReason.RATE_LIMITED)
    assert decisions[2].desired_replicas > 2


def test_a_target_rate_must_be_a_positive_number() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="target_rate_per_replica"):
            config(target_rate_per_replica=bad)


@given(
    rate=st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
    target=st.floats(min_value=1e-3, max_value=1e4, allow_nan=False),
)
def test_any_rate_recommends_what_it_takes(rate: float, target: float) -> None:
    cfg = config(target_rate_per_replica=target, max_replicas=10**9, tolerance=0.0)
    decision = run([(0.0, 0.0, 0.0), (15.0, 0.0, rate * 15.0)], cfg, start=1)[1]
    assert decision.rate is not None
    assert decision.rate == pytest.approx(rate)
    expected = math.ceil(decision.rate / target)
    assert decision.recommendation == (max(1, expected) if decision.rate > 0 else 0)
    assert decision.desired_replicas >= 1  # min_replicas
