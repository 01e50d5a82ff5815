"""Adaptive batching: per-level windows, the load-aware window, length-aware formation,
the arrival-rate estimate and the AIMD cap. One scenario per row, then properties."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.core.batch_adapt import (
    CAP_DECISIONS,
    AdaptiveCap,
    ArrivalRate,
    BatchPlanner,
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
# On cost: a batch's overhead is 30 tokens of work; padding within (members - 1) x 30.
COST = BatchConfig(
    max_batch_size=3, batch_window_ms=10.0, length_candidates=8, batch_overhead_tokens=30.0
)
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
        "ratio_rule_refuses_two_short_inputs_padded_by_half",
        [_r(0, 1, 1.0, 10), _r(1, 1, 1.0, 30)],
        LENGTH,
        1.0,
        Release((_r(0, 1, 1.0, 10),), "length"),
    ),
    Scenario(
        "cost_rule_pairs_two_short_inputs_padded_by_less_than_a_batch_costs",
        [_r(0, 1, 1.0, 10), _r(1, 1, 1.0, 30)],
        COST,
        1.001,
        WaitUntil(1.010),  # 20 padding tokens < 30: one batch of two, waiting for a third
    ),
    Scenario(
        "ratio_rule_pairs_two_long_inputs_within_its_ratio",
        [_r(0, 1, 1.0, 200), _r(1, 1, 1.0, 160)],
        LENGTH,
        1.001,
        WaitUntil(1.010),
    ),
    Scenario(
        "cost_rule_refuses_two_long_inputs_padded_by_more_than_a_batch_costs",
        [_r(0, 1, 1.0, 200), _r(1, 1, 1.0, 160)],
        COST,
        1.0,
        Release((_r(0, 1, 1.0, 200),), "length"),  # 40 padding tokens > 30
    ),
    Scenario(
        "cost_rule_lets_a_third_in_on_the_two_overheads_it_saves",
        [_r(0, 1, 1.0, 60), _r(1, 1, 1.0, 10), _r(2, 1, 1.0, 64)],
        COST,
        1.0,
        # 3 x 64 - 134 = 58 padding tokens <= 2 x 30: cheaper than three batches
        Release((_r(0, 1, 1.0, 60), _r(1, 1, 1.0, 10), _r(2, 1, 1.0, 64)), "full_size"),
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
        ({"batch_overhead_tokens": -1.0}, "batch_overhead_tokens"),
        ({"batch_overhead_tokens": math.nan}, "batch_overhead_tokens"),
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
    batch_overhead_tokens=st.one_of(st.none(), st.floats(0.0, 200.0)),
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
        overhead = config.batch_overhead_tokens
        if overhead is None:
            assert padded <= config.max_padding_ratio * real + 1e-9
        else:
            # On cost: one padded batch is predicted to cost no more than its members apart.
            assert overhead + padded <= len(batch) * overhead + real + 1e-9


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
    st.one_of(st.none(), st.floats(0.0, 100.0)),
)
def test_length_aware_releases_every_request_within_its_position(
    lengths: list[int], size: int, candidates: int, ratio: float, overhead: float | None
) -> None:
    """The bound of the module note: position p in pick order is batched within p releases,
    under either rule."""
    config = BatchConfig(
        max_batch_size=size,
        batch_window_ms=0.0,
        length_candidates=candidates,
        max_padding_ratio=ratio,
        batch_overhead_tokens=overhead,
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
    ("cap", "p99_s", "queueing", "backlogged", "full", "expected"),
    [
        (16, 0.2, False, False, False, (8, "decrease")),  # late from the run, no backlog: halve
        (3, 0.2, False, False, False, (2, "decrease")),  # not below the minimum
        (2, 0.2, False, False, False, (2, "hold")),  # at the minimum already
        (8, 0.05, False, False, False, (9, "increase")),  # well under: grow by one
        (16, 0.05, False, False, False, (16, "hold")),  # at the knee: no further
        (8, 0.09, False, False, False, (8, "hold")),  # in the dead band
        (
            8,
            0.2,
            True,
            False,
            False,
            (9, "increase_queueing"),
        ),  # late from waiting: the cap is not it
        (16, 0.2, True, False, False, (16, "hold_queueing")),  # ... and at the knee already
        (2, 0.2, False, True, False, (4, "grow_backlog")),  # a backlog: double, even when late
        (4, 0.09, True, True, False, (8, "grow_backlog")),  # ... whatever the latency says
        (2, 0.05, False, True, False, (4, "grow_backlog")),  # ... faster than the slack's +1
        (12, 0.2, False, True, False, (16, "grow_backlog")),  # ... up to the knee
        (16, 0.2, False, True, False, (16, "hold_backlog")),  # at the knee: hold, never shrink
        (8, 0.2, False, False, True, (8, "hold_full")),  # late from the run, batches fill it
        (2, 0.2, False, False, True, (2, "hold_full")),  # ... saturated: never shrink it
        (4, 0.2, True, False, True, (5, "increase_queueing")),  # full, and late from waiting
        (4, 0.2, False, True, True, (8, "grow_backlog")),  # full, and a cap's worth waits
        (4, 0.05, False, False, True, (5, "increase")),  # full, with slack: grow
    ],
    ids=[
        "halve",
        "floor",
        "at_floor",
        "grow",
        "at_knee",
        "dead_band",
        "late_queueing_grows_by_one",
        "late_queueing_at_knee",
        "backlog_doubles",
        "backlog_doubles_whatever_p99",
        "backlog_beats_slack",
        "backlog_up_to_knee",
        "backlog_at_knee",
        "full_holds",
        "full_holds_at_any_cap",
        "full_late_queueing_grows",
        "full_backlog_grows",
        "full_slack_grows",
    ],
)
def test_decide_batch_cap(
    cap: int,
    p99_s: float,
    queueing: bool,
    backlogged: bool,
    full: bool,
    expected: tuple[int, str],
) -> None:
    assert decide_batch_cap(cap, p99_s, CAP, queueing, backlogged, full) == expected
    assert expected[1] in CAP_DECISIONS


@pytest.mark.parametrize(
    ("cap", "largest", "expected"),
    [
        (8, 5, (4, "decrease")),  # a batch of 5 would have been cut to 4
        (8, 4, (8, "hold_short")),  # no batch over 4: a cap of 4 would bind nothing
        (8, 1, (8, "hold_short")),  # batches of 1 at low load, late from their own run
        (8, None, (4, "decrease")),  # unknown: as if larger
    ],
    ids=["binds", "would_not_bind", "low_load", "unknown"],
)
def test_decrease_only_where_the_smaller_cap_would_bind(
    cap: int, largest: int | None, expected: tuple[int, str]
) -> None:
    config = CapConfig(target_p99_s=0.1, max_batch_size=8)
    assert decide_batch_cap(cap, 0.2, config, largest=largest) == expected


def test_a_slow_batch_of_one_at_low_load_does_not_shrink_the_cap() -> None:
    """Measured on a slow machine: one request's own batch ran past the target at low load;
    halving the cap would have cut nothing then, and throughput when the load rose."""
    cap = AdaptiveCap(CapConfig(target_p99_s=0.1, max_batch_size=8, num_samples=10))
    for _ in range(30):
        cap.released(1, 0)
        cap.observe(0.11, 0.1)
    assert cap.cap == 8
    assert cap.last_decision == "hold_short"


def test_backlog_grows_at_least_by_one_with_a_small_factor() -> None:
    config = CapConfig(target_p99_s=0.1, max_batch_size=16, backlog_grow_factor=1.0)
    assert decide_batch_cap(3, 0.5, config, backlogged=True) == (4, "grow_backlog")


def test_backlog_grow_factor_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="backlog_grow_factor"):
        CapConfig(target_p99_s=0.1, max_batch_size=16, backlog_grow_factor=0.5)


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


# One event for the cap: ("latency", seconds, share of it the batch ran) or ("release",
# requests left waiting behind it, the batch's size).
cap_events = st.lists(
    st.one_of(
        st.tuples(st.just("latency"), st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
        st.tuples(st.just("release"), st.integers(0, 100), st.integers(1, 64)),
    ),
    max_size=300,
)


def _feed(cap: AdaptiveCap, events: list[tuple[str, float, float]]) -> None:
    for kind, value, other in events:
        if kind == "latency":
            cap.observe(value, value * other)
        else:
            cap.released(int(other), int(value))


@settings(max_examples=200, deadline=None)
@given(cap_events, st.integers(1, 8), st.integers(8, 64), st.floats(1.0, 4.0))
def test_adaptive_cap_stays_within_its_bounds(
    events: list[tuple[str, float, float]], low: int, high: int, factor: float
) -> None:
    cap = AdaptiveCap(
        CapConfig(
            0.1,
            max_batch_size=high,
            min_batch_size=low,
            num_samples=7,
            backlog_grow_factor=factor,
        )
    )
    for event in events:
        _feed(cap, [event])
        assert low <= cap.cap <= high
        assert cap.last_decision in CAP_DECISIONS
    assert sum(cap.decisions.values()) == sum(1 for e in events if e[0] == "latency") // 7


@settings(max_examples=200, deadline=None)
@given(
    cap_events,
    st.integers(1, 4),
    st.integers(4, 64),
    st.floats(1.0, 4.0),
    st.lists(st.floats(0.0, 5.0), min_size=1, max_size=10),
    st.floats(0.0, 1.0),
)
def test_a_sustained_backlog_brings_the_cap_to_its_knee(
    history: list[tuple[str, float, float]],
    low: int,
    high: int,
    factor: float,
    latencies: list[float],
    share: float,
) -> None:
    """Whatever came before and whatever the latencies: every release leaving a cap's worth
    waiting brings the cap to max_batch_size within that many decisions, and keeps it."""
    config = CapConfig(
        0.1, max_batch_size=high, min_batch_size=low, num_samples=5, backlog_grow_factor=factor
    )
    cap = AdaptiveCap(config)
    _feed(cap, history)
    for decision in range(high + 1):
        for i in range(config.num_samples):
            cap.released(cap.cap, cap.cap + i)  # full, a cap's worth or more behind it
            latency = latencies[(decision + i) % len(latencies)]
            cap.observe(latency, latency * share)
        if decision:  # the first decision may still count what the history left pending
            assert cap.last_decision in ("grow_backlog", "hold_backlog")
    assert cap.cap == high
    assert cap.last_decision == "hold_backlog"


# Over target from the batch's own run: a fed cap, its floor and top, the latency, the run's
# share of it, and how many requests each release leaves behind.
over_target_from_the_run = given(
    cap_events,
    st.integers(1, 4),
    st.integers(4, 64),
    st.floats(0.11, 5.0),
    st.floats(0.5, 1.0),
    st.integers(0, 3),
)


def _fed_cap(history: list[tuple[str, float, float]], low: int, high: int) -> AdaptiveCap:
    """A cap of 5 samples a decision between ``low`` and ``high``, after ``history``."""
    cap = AdaptiveCap(CapConfig(0.1, max_batch_size=high, min_batch_size=low, num_samples=5))
    _feed(cap, history)
    return cap


@settings(max_examples=200, deadline=None)
@over_target_from_the_run
def test_late_from_its_own_run_without_a_backlog_the_cap_shrinks(
    history: list[tuple[str, float, float]],
    low: int,
    high: int,
    latency: float,
    share: float,
    left: int,
) -> None:
    """Over target, the batch's run at least half the latency, batches just under the cap
    with fewer than a cap's worth behind them: every decision shrinks the cap, while the
    batches are larger than the smaller cap (a cap of 2 over batches of 1 holds)."""
    cap = _fed_cap(history, low, high)
    for decision in range(high + 1):
        before = cap.cap
        for _ in range(cap.config.num_samples):
            cap.released(max(1, cap.cap - 1), min(left, cap.cap - 1))
            cap.observe(latency, latency * share)
        if not decision:
            continue  # the first decision may still count what the history left pending
        if before - 1 > max(low, before // 2):
            assert cap.cap < before
            assert cap.last_decision == "decrease"
        else:
            assert cap.cap == before
            assert cap.last_decision in ("hold", "hold_short", "hold_full")  # full: a cap of 1
    assert cap.cap - 1 <= max(low, cap.cap // 2)  # it shrank as far as batches would feel


@settings(max_examples=200, deadline=None)
@over_target_from_the_run
def test_batches_that_fill_the_cap_never_shrink_it(
    history: list[tuple[str, float, float]],
    low: int,
    high: int,
    latency: float,
    share: float,
    left: int,
) -> None:
    """Over target from the run, but every batch fills the cap (saturated, the backlog out
    of sight behind a gateway): a smaller cap would serve less than arrives, so it holds."""
    cap = _fed_cap(history, low, high)
    for decision in range(high + 1):
        before = cap.cap
        for _ in range(cap.config.num_samples):
            cap.released(cap.cap, min(left, cap.cap - 1))
            cap.observe(latency, latency * share)
        if decision:  # the first decision may still count what the history left pending
            assert cap.cap == before
            assert cap.last_decision == "hold_full"


def test_a_cap_halved_early_grows_back_under_the_backlog_it_causes() -> None:
    """The measured failure: halved while batches were short and late from their run, the
    cap then held under the backlog it caused. Now the backlog grows it back to the knee."""
    config = CapConfig(target_p99_s=0.1, max_batch_size=8, num_samples=10)
    cap = AdaptiveCap(config)
    for _ in range(20):  # partial batches, late from their own run, nothing waiting
        cap.released(cap.cap - 1, 0)
        cap.observe(0.3, 0.2)
    assert cap.cap == 2
    assert cap.last_decision == "decrease"
    for _ in range(20):  # a backlog builds behind batches of 2: late from waiting
        cap.released(2, 40)
        cap.observe(2.0, 0.05)
    assert cap.cap == 8
    assert cap.last_decision == "grow_backlog"
    assert {k: v for k, v in cap.decisions.items() if v} == {"decrease": 2, "grow_backlog": 2}


def test_only_most_releases_leaving_a_backlog_count_as_one() -> None:
    config = CapConfig(target_p99_s=0.1, max_batch_size=8, num_samples=4)
    cap = AdaptiveCap(config)
    cap.cap = 4
    for size, left in ((4, 10), (3, 0), (3, 0)):  # one in three full, or left a backlog
        cap.released(size, left)
    for _ in range(4):
        cap.observe(0.3, 0.2)
    assert (cap.cap, cap.last_decision) == (2, "decrease")
    for left in (2, 0):  # half the releases left a cap's worth (2) waiting: a backlog
        cap.released(2, left)
    for _ in range(4):
        cap.observe(0.3, 0.2)
    assert (cap.cap, cap.last_decision) == (4, "grow_backlog")


def test_planner_tells_the_cap_what_each_release_left_waiting() -> None:
    """Through plan_batch as the worker and the simulator call it: a queue of 20 with a cap
    of 2 leaves 18, 16, ... behind each batch, a backlog: the first 10 high latencies (late,
    from waiting) grow the cap; /stats and explain count each decision."""
    config = BatchConfig(max_batch_size=4, batch_window_ms=0.0)
    planner = BatchPlanner(config, CapConfig(target_p99_s=0.1, max_batch_size=4, num_samples=10))
    assert planner.cap is not None
    planner.cap.cap = 2
    queue = [req(f"r{i}", 0, 0.0) for i in range(20)]
    now = 1.0
    while queue:
        plan = plan_batch(planner.view(queue[: planner.peek_size], len(queue), now), config, now)
        assert isinstance(plan, Release)
        planner.released(plan)
        queue = queue[len(plan.batch) :]
        planner.finished(plan.batch, now + 0.5, now + 0.45)  # late (0.5 s), from waiting
        now += 0.05
    described = planner.describe(now)
    assert described["max_batch_size"] == 4
    # Then the backlog is drained (one release in three left a cap's worth): late from
    # waiting at the knee, the cap holds.
    assert described["adaptive_cap"]["decisions"] == {"grow_backlog": 1, "hold_queueing": 1}
    assert described["adaptive_cap"]["last_decision"] == "hold_queueing"


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


@pytest.mark.parametrize(
    ("config", "rule"),
    [
        (COST, "cost: padding within (members - 1) x 30 tokens"),
        (LENGTH, "ratio: padded tokens within 1.25 x real"),
        (LEVELS, None),
    ],
    ids=["on_cost", "on_ratio", "off"],
)
def test_stats_say_which_rule_lets_padding_in(config: BatchConfig, rule: str | None) -> None:
    assert BatchPlanner(config).describe(0.0)["length_rule"] == rule
