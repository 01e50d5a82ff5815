"""Adaptive batching: per-level windows, the load-aware window, length-aware formation,
the arrival-rate estimate and the AIMD cap. One scenario per row, then properties."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.core.batch_adapt import (
    AdaptiveCap,
    ArrivalRate,
    CapConfig,
    decide_batch_cap,
    p99,
)
from tidegate.core.batching import (
    RELEASE_REASONS,
    BatchConfig,
    BatchView,
    Release,
    WaitUntil,
    plan_batch,
)
from tidegate.core.request import Request

from .conftest import req


@dataclass(frozen=True)
class Scenario:
    name: str
    head: list[Request]
    config: BatchConfig
    now: float
    expected: Release | WaitUntil
    rate_per_s: float | None = None
    cap: int | None = None
    num_queued: int | None = None  # None: len(head)


def _r(i: int, level: int, at: float, tokens: int = 1) -> Request:
    return req(f"r{i}", level, at, tokens=tokens)


LEVELS = BatchConfig(max_batch_size=4, batch_window_ms=10.0, level_windows_ms=(0.0, 4.0))
LOAD = BatchConfig(max_batch_size=4, batch_window_ms=10.0, load_aware=True)
LENGTH = BatchConfig(max_batch_size=3, batch_window_ms=10.0, length_candidates=8)
SCENARIOS = [
    Scenario(
        "high_request_with_zero_window_goes_at_once",
        [_r(0, 0, 1.0)],
        LEVELS,
        1.0,
        Release((_r(0, 0, 1.0),), "level_window"),
    ),
    Scenario(
        "medium_request_waits_its_own_shorter_window",
        [_r(0, 1, 1.0)],
        LEVELS,
        1.001,
        WaitUntil(1.004),
    ),
    Scenario(
        "low_request_waits_the_full_window",
        [_r(0, 2, 1.0)],
        LEVELS,
        1.001,
        WaitUntil(1.010),
    ),
    Scenario(
        "a_batch_waits_as_long_as_its_most_urgent_member_allows",
        [_r(0, 0, 1.002), _r(1, 2, 1.0)],
        LEVELS,
        1.002,
        Release((_r(0, 0, 1.002), _r(1, 2, 1.0)), "level_window"),
    ),
    Scenario(
        "low_load_releases_at_once",
        [_r(0, 1, 1.0)],
        LOAD,
        1.0,
        Release((_r(0, 1, 1.0),), "no_companions"),
        rate_per_s=20.0,  # 0.2 expected in 10 ms
    ),
    Scenario(
        "high_load_waits_while_a_companion_is_expected",
        [_r(0, 1, 1.0)],
        LOAD,
        1.0,
        WaitUntil(1.010 - 1 / 500),
        rate_per_s=500.0,  # 5 expected in 10 ms: wait until 1 is left
    ),
    Scenario(
        "high_load_gives_up_when_under_one_is_left",
        [_r(0, 1, 1.0)],
        LOAD,
        1.009,
        Release((_r(0, 1, 1.0),), "no_companions"),
        rate_per_s=500.0,
    ),
    Scenario(
        "load_aware_without_a_rate_keeps_the_window",
        [_r(0, 1, 1.0)],
        LOAD,
        1.0,
        WaitUntil(1.010),
    ),
    Scenario(
        "adaptive_cap_makes_a_smaller_batch_full",
        [_r(i, 1, 1.0) for i in range(4)],
        BatchConfig(max_batch_size=4, batch_window_ms=10.0),
        1.0,
        Release((_r(0, 1, 1.0), _r(1, 1, 1.0)), "full_size"),
        cap=2,
    ),
    Scenario(
        "length_aware_takes_the_nearest_lengths_to_the_head",
        [_r(0, 1, 1.0, 60), _r(1, 1, 1.0, 10), _r(2, 1, 1.0, 64), _r(3, 1, 1.0, 58)],
        LENGTH,
        1.0,
        Release((_r(0, 1, 1.0, 60), _r(2, 1, 1.0, 64), _r(3, 1, 1.0, 58)), "full_size", False),
    ),
    Scenario(
        "length_aware_leaves_a_misfit_and_goes_at_once",
        [_r(0, 1, 1.0, 60), _r(1, 1, 1.0, 10), _r(2, 1, 1.0, 62)],
        LENGTH,
        1.0,
        Release((_r(0, 1, 1.0, 60), _r(2, 1, 1.0, 62)), "length", False),
    ),
    Scenario(
        "length_aware_partial_batch_of_similar_lengths_waits",
        [_r(0, 1, 1.0, 60), _r(1, 1, 1.0, 62)],
        LENGTH,
        1.001,
        WaitUntil(1.010),
    ),
    Scenario(
        "length_aware_head_always_goes_even_alone",
        [_r(0, 2, 1.0, 200), _r(1, 0, 1.0, 5)],
        LENGTH,
        1.0,
        Release((_r(0, 2, 1.0, 200),), "length"),
    ),
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_plan_batch_adaptive(scenario: Scenario) -> None:
    queued = len(scenario.head) if scenario.num_queued is None else scenario.num_queued
    view = BatchView(scenario.head, queued, scenario.rate_per_s, scenario.cap)
    plan = plan_batch(view, scenario.config, scenario.now)
    assert plan == scenario.expected
    if isinstance(plan, Release):
        assert plan.reason in RELEASE_REASONS


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"level_windows_ms": (20.0,)}, "level 0 window"),
        ({"level_windows_ms": (-1.0,)}, "level 0 window"),
        ({"length_candidates": -1}, "length_candidates"),
        ({"max_padding_ratio": 0.9}, "max_padding_ratio"),
    ],
)
def test_invalid_adaptive_config_is_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchConfig(batch_window_ms=10.0, **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- properties

requests = st.lists(
    st.tuples(st.integers(0, 2), st.floats(0.0, 0.02), st.integers(1, 300)),
    min_size=1,
    max_size=40,
)
configs = st.builds(
    BatchConfig,
    max_batch_size=st.integers(1, 8),
    max_batch_tokens=st.one_of(st.none(), st.integers(1, 1000)),
    batch_window_ms=st.just(10.0),
    level_windows_ms=st.lists(st.one_of(st.none(), st.floats(0.0, 10.0)), max_size=3).map(tuple),
    load_aware=st.booleans(),
    length_candidates=st.integers(0, 24),
    max_padding_ratio=st.floats(1.0, 3.0),
)


def _head(rows: list[tuple[int, float, int]]) -> list[Request]:
    # The pick order of a WaitQueue without aging: by level, then arrival.
    made = [req(f"r{i}", level, at, tokens=tokens) for i, (level, at, tokens) in enumerate(rows)]
    return sorted(made, key=lambda r: (r.priority, r.arrival_at, r.id))


@settings(max_examples=300, deadline=None)
@given(
    requests,
    configs,
    st.floats(0.0, 0.05),
    st.one_of(st.none(), st.floats(0.0, 5000.0)),
    st.one_of(st.none(), st.integers(1, 8)),
)
def test_adaptive_plan_keeps_the_batch_invariants(
    rows: list[tuple[int, float, int]],
    config: BatchConfig,
    now: float,
    rate: float | None,
    cap: int | None,
) -> None:
    head = _head(rows)
    plan = plan_batch(BatchView(head, len(head), rate, cap), config, now)
    if isinstance(plan, WaitUntil):
        assert plan.at is not None
        assert plan.at > now
        return
    batch = plan.batch
    size = config.max_batch_size if cap is None else min(cap, config.max_batch_size)
    assert batch
    assert batch[0] == head[0]
    assert len(batch) <= size
    assert len(set(batch)) == len(batch)
    positions = [head.index(r) for r in batch]
    assert positions == sorted(positions)  # in pick order
    assert max(positions) < max(size, config.length_candidates, 1)  # only candidates overtake
    assert plan.is_prefix == (positions == list(range(len(batch))))
    if config.max_batch_tokens is not None and len(batch) > 1:
        assert sum(r.cost_tokens for r in batch) <= config.max_batch_tokens
    if config.length_aware and len(batch) > 1:
        real = sum(max(1, r.cost_tokens) for r in batch)
        padded = len(batch) * max(max(1, r.cost_tokens) for r in batch)
        assert padded <= config.max_padding_ratio * real + 1e-9


@settings(max_examples=300, deadline=None)
@given(requests, configs, st.floats(0.0, 0.05), st.one_of(st.none(), st.floats(0.0, 5000.0)))
def test_adaptive_windows_never_wait_longer_than_the_fixed_rule(
    rows: list[tuple[int, float, int]], config: BatchConfig, now: float, rate: float | None
) -> None:
    head = _head(rows)
    fixed = BatchConfig(config.max_batch_size, config.max_batch_tokens, config.batch_window_ms)
    adaptive_config = BatchConfig(
        config.max_batch_size,
        config.max_batch_tokens,
        config.batch_window_ms,
        config.level_windows_ms,
        config.load_aware,
    )
    before = plan_batch(BatchView(head, len(head)), fixed, now)
    after = plan_batch(BatchView(head, len(head), rate), adaptive_config, now)
    if isinstance(before, Release):
        assert isinstance(after, Release)
        assert after.batch == before.batch
    elif isinstance(after, WaitUntil):
        assert before.at is not None
        assert after.at is not None
        assert after.at <= before.at


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=60),
    st.integers(1, 8),
    st.integers(2, 32),
    st.floats(1.0, 2.0),
)
def test_length_aware_releases_every_request_within_its_position(
    lengths: list[int], size: int, candidates: int, ratio: float
) -> None:
    """The bound of the module note: position p in pick order is batched within p releases."""
    config = BatchConfig(
        max_batch_size=size,
        batch_window_ms=0.0,
        length_candidates=candidates,
        max_padding_ratio=ratio,
    )
    queue = [req(f"r{i}", 1, i * 1e-6, tokens=n) for i, n in enumerate(lengths)]
    position = {r.id: p for p, r in enumerate(queue)}
    releases = 0
    while queue:
        plan = plan_batch(BatchView(queue, len(queue)), config, 1.0)
        assert isinstance(plan, Release)
        for request in plan.batch:
            assert releases <= position[request.id]
        queue = [r for r in queue if r not in plan.batch]
        releases += 1
    assert releases <= len(lengths)


# ---------------------------------------------------------------- estimators


def test_arrival_rate_estimates_a_steady_stream() -> None:
    rate = ArrivalRate(tau_s=1.0)
    assert rate.rate_per_s(0.0) is None
    for i in range(1000):
        rate.observe(i * 0.01)  # 100 per second for 10 s
    estimate = rate.rate_per_s(10.0)
    assert estimate is not None
    assert 90 <= estimate <= 110


def test_arrival_rate_forgets_a_burst() -> None:
    rate = ArrivalRate(tau_s=0.5)
    rate.observe(0.0, count=100)
    later = rate.rate_per_s(5.0)
    assert later is not None
    assert later < 0.01


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=50), st.floats(0.01, 5.0))
def test_arrival_rate_is_never_negative_and_decays_between_arrivals(
    times: list[float], tau_s: float
) -> None:
    rate = ArrivalRate(tau_s)
    for at in sorted(times):
        rate.observe(at)
    last = max(times)
    now_rate = rate.rate_per_s(last)
    later_rate = rate.rate_per_s(last + 1.0)
    assert now_rate is not None
    assert later_rate is not None
    assert 0 <= later_rate <= now_rate
    assert now_rate <= len(times) / tau_s + 1e-9


CAP = CapConfig(target_p99_s=0.1, max_batch_size=16, min_batch_size=2)


@pytest.mark.parametrize(
    ("cap", "p99_s", "expected"),
    [
        (16, 0.2, (8, "decrease")),  # over target: halve
        (3, 0.2, (2, "decrease")),  # not below the minimum
        (2, 0.2, (2, "hold")),  # at the minimum already
        (8, 0.05, (9, "increase")),  # well under: grow by one
        (16, 0.05, (16, "hold")),  # at the knee: no further
        (8, 0.09, (8, "hold")),  # in the dead band
    ],
    ids=["halve", "floor", "at_floor", "grow", "at_knee", "dead_band"],
)
def test_decide_batch_cap(cap: int, p99_s: float, expected: tuple[int, str]) -> None:
    assert decide_batch_cap(cap, p99_s, CAP) == expected


def test_adaptive_cap_shrinks_under_late_batches_and_grows_back() -> None:
    cap = AdaptiveCap(CapConfig(target_p99_s=0.1, max_batch_size=16, num_samples=10))
    for _ in range(20):
        cap.observe(0.5, 0.4)  # late, and mostly running: the batch is the latency
    assert cap.cap == 4
    assert cap.last_decision == "decrease"
    for _ in range(30):
        cap.observe(0.01, 0.01)
    assert cap.cap == 7
    assert cap.last_decision == "increase"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), max_size=300), st.integers(1, 8), st.integers(8, 64))
def test_adaptive_cap_stays_within_its_bounds(latencies: list[float], low: int, high: int) -> None:
    cap = AdaptiveCap(CapConfig(0.1, max_batch_size=high, min_batch_size=low, num_samples=7))
    for latency in latencies:
        cap.observe(latency, latency / 2)
        assert low <= cap.cap <= high


def test_p99_is_nearest_rank() -> None:
    assert p99([1.0]) == 1.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert math.isclose(p99([float(i) for i in range(1, 201)]), 198.0)


def test_adaptive_cap_holds_when_the_latency_is_queueing() -> None:
    """Late because waiting behind a backlog: a smaller batch would drain it slower."""
    cap = AdaptiveCap(CapConfig(target_p99_s=0.1, max_batch_size=16, num_samples=10))
    for _ in range(40):
        cap.observe(2.0, 0.05)
    assert cap.cap == 16
    assert cap.last_decision == "hold_queueing"


def test_decide_batch_cap_over_target_while_queueing_holds() -> None:
    assert decide_batch_cap(16, 0.2, CAP, queueing=True) == (16, "hold_queueing")
