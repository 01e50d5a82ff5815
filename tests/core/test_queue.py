"""WaitQueue rules, one scenario per row."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from tidegate.core.queue import (
    Admitted,
    AgingConfig,
    LevelSpec,
    QueueConfig,
    Rejected,
    WaitQueue,
    aged_level,
    effective_priority,
    reaches_level_at,
    unreachable_levels,
)
from tidegate.core.request import Request, RequestState

from .conftest import req


def ids(requests: tuple[Request, ...]) -> list[str]:
    return [r.id for r in requests]


def admit_all(queue: WaitQueue, *requests: Request, saturation: float = 0.0) -> None:
    for r in requests:
        assert isinstance(queue.admit(r, r.arrival_at, saturation), Admitted), r.id


# ----------------------------------------------------------------------------- pick order
@dataclass(frozen=True)
class OrderScenario:
    name: str
    arrivals: list[Request]
    pick_at: float
    expected: list[str]
    aging: AgingConfig = field(default_factory=AgingConfig)


ORDER_SCENARIOS = [
    OrderScenario(
        "strict_priority_before_aging",
        [req("low", 2, 0.0), req("med", 1, 1.0), req("high", 0, 2.0)],
        pick_at=3.0,
        expected=["high", "med", "low"],
    ),
    OrderScenario(
        "fifo_within_a_level",
        [req("a", 1, 0.0), req("b", 1, 1.0), req("c", 1, 2.0)],
        pick_at=3.0,
        expected=["a", "b", "c"],
    ),
    OrderScenario(
        # At 33.5 s the low request has aged 3.5 s past the threshold: 2 - 1.75 = 0.25 < 1.
        "aged_low_overtakes_new_medium",
        [req("low", 2, 0.0), req("med", 1, 32.0)],
        pick_at=33.5,
        expected=["low", "med"],
    ),
    OrderScenario(
        # At 31 s the low request is at 1.5: still behind medium.
        "low_just_past_threshold_stays_behind_medium",
        [req("low", 2, 0.0), req("med", 1, 30.5)],
        pick_at=31.0,
        expected=["med", "low"],
    ),
    OrderScenario(
        # Both at the floor (0): the earlier arrival wins the tie.
        "aged_to_top_level_ties_go_to_earlier_arrival",
        [req("low", 2, 0.0), req("high", 0, 40.0)],
        pick_at=40.0,
        expected=["low", "high"],
    ),
    OrderScenario(
        "aging_disabled_keeps_strict_priority",
        [req("low", 2, 0.0), req("high", 0, 500.0)],
        pick_at=1000.0,
        expected=["high", "low"],
        aging=AgingConfig(threshold_s=30.0, rate_per_s=0.0),
    ),
]


@pytest.mark.parametrize("scenario", ORDER_SCENARIOS, ids=lambda s: s.name)
def test_pick_order(scenario: OrderScenario) -> None:
    queue = WaitQueue(QueueConfig(aging=scenario.aging))
    admit_all(queue, *scenario.arrivals)
    assert ids(queue.peek(10, scenario.pick_at)) == scenario.expected
    assert ids(queue.pop(10, scenario.pick_at)) == scenario.expected
    assert len(queue) == 0


@pytest.mark.parametrize(
    ("level", "wait_s", "expected"),
    [(2, 0.0, 2.0), (2, 30.0, 2.0), (2, 31.0, 1.5), (2, 34.0, 0.0), (2, 100.0, 0.0), (0, 99, 0)],
)
def test_effective_priority_formula(level: int, wait_s: float, expected: float) -> None:
    assert effective_priority(level, 0.0, wait_s, AgingConfig()) == expected


# ----------------------------------------------------------------------------- admission
@dataclass(frozen=True)
class AdmitScenario:
    name: str
    config: QueueConfig
    queued: list[Request]
    arrival: Request
    saturation: float
    expected: RequestState  # QUEUED or a REJECTED_* reason
    shed: list[str] = field(default_factory=list)


SMALL = QueueConfig(max_size=3)
ADMIT_SCENARIOS = [
    AdmitScenario(
        "room_left_admits",
        SMALL,
        [req("a", 2)],
        req("b", 2, 1.0),
        0.0,
        RequestState.QUEUED,
    ),
    AdmitScenario(
        "full_queue_urgent_arrival_sheds_newest_of_least_urgent_level",
        SMALL,
        [req("low1", 2, 0.0), req("low2", 2, 1.0), req("med", 1, 2.0)],
        req("high", 0, 3.0),
        0.0,
        RequestState.QUEUED,
        shed=["low2"],
    ),
    AdmitScenario(
        "full_queue_without_low_sheds_newest_medium",
        SMALL,
        [req("m1", 1, 0.0), req("m2", 1, 1.0), req("h", 0, 2.0)],
        req("h2", 0, 3.0),
        0.0,
        RequestState.QUEUED,
        shed=["m2"],
    ),
    AdmitScenario(
        "full_queue_same_level_arrival_is_refused",
        SMALL,
        [req("l1", 2), req("l2", 2), req("l3", 2)],
        req("l4", 2, 1.0),
        0.0,
        RequestState.REJECTED_FULL,
    ),
    AdmitScenario(
        "full_queue_of_more_urgent_work_refuses_low",
        SMALL,
        [req("h1", 0), req("h2", 0), req("m", 1)],
        req("l", 2, 1.0),
        0.0,
        RequestState.REJECTED_FULL,
    ),
    AdmitScenario(
        "full_level_refuses_even_with_total_room",
        QueueConfig(levels=(LevelSpec("high"), LevelSpec("low", max_size=1)), max_size=10),
        [req("l1", 1)],
        req("l2", 1, 1.0),
        0.0,
        RequestState.REJECTED_FULL,
    ),
    AdmitScenario(
        "low_held_back_above_70_percent",
        QueueConfig(),
        [],
        req("l", 2),
        0.75,
        RequestState.REJECTED_HOLDBACK,
    ),
    AdmitScenario(
        "medium_still_admitted_at_75_percent",
        QueueConfig(),
        [],
        req("m", 1),
        0.75,
        RequestState.QUEUED,
    ),
    AdmitScenario(
        "medium_held_back_above_90_percent",
        QueueConfig(),
        [],
        req("m", 1),
        0.95,
        RequestState.REJECTED_HOLDBACK,
    ),
    AdmitScenario(
        "high_never_held_back",
        QueueConfig(),
        [],
        req("h", 0),
        1.0,
        RequestState.QUEUED,
    ),
]


@pytest.mark.parametrize("scenario", ADMIT_SCENARIOS, ids=lambda s: s.name)
def test_admission(scenario: AdmitScenario) -> None:
    queue = WaitQueue(scenario.config)
    admit_all(queue, *scenario.queued)
    decision = queue.admit(scenario.arrival, scenario.arrival.arrival_at, scenario.saturation)
    if scenario.expected is RequestState.QUEUED:
        assert isinstance(decision, Admitted)
        assert ids(decision.shed) == scenario.shed
        assert scenario.arrival.id in queue
        assert all(rid not in queue for rid in scenario.shed)
    else:
        assert isinstance(decision, Rejected)
        assert decision.reason is scenario.expected
        assert decision.message
        assert scenario.arrival.id not in queue
    assert len(queue) <= scenario.config.max_size


def _queue_draining_at_one_per_s(num_queued_high: int) -> WaitQueue:
    queue = WaitQueue(QueueConfig())
    admit_all(queue, *(req(f"h{i}", 0, 10.0) for i in range(num_queued_high)))
    for second in range(10):
        queue.drain.record(float(second))
    return queue


def test_predicted_wait_beyond_deadline_is_refused_with_retry_after() -> None:
    queue = _queue_draining_at_one_per_s(5)
    decision = queue.admit(req("late", 0, 10.0, deadline_at=12.0), 10.0)
    assert isinstance(decision, Rejected)
    assert decision.reason is RequestState.REJECTED_DEADLINE
    assert decision.retry_after_s == pytest.approx(5.0)


def test_predicted_wait_within_deadline_is_admitted() -> None:
    queue = _queue_draining_at_one_per_s(5)
    assert isinstance(queue.admit(req("ok", 0, 10.0, deadline_at=20.0), 10.0), Admitted)


def test_less_urgent_backlog_does_not_count_towards_predicted_wait() -> None:
    queue = _queue_draining_at_one_per_s(0)
    admit_all(queue, *(req(f"l{i}", 2, 10.0) for i in range(50)))
    assert queue.predicted_wait_s(0, 10.0) == 0.0
    assert isinstance(queue.admit(req("h", 0, 10.0, deadline_at=11.0), 10.0), Admitted)


def test_without_a_drain_estimate_deadline_arrivals_are_admitted() -> None:
    queue = WaitQueue(QueueConfig())
    admit_all(queue, *(req(f"h{i}", 0) for i in range(100)))
    assert queue.predicted_wait_s(0, 0.0) is None
    assert isinstance(queue.admit(req("x", 0, 0.0, deadline_at=0.5), 0.0), Admitted)


def test_drain_rate_forgets_completions_outside_its_window() -> None:
    queue = _queue_draining_at_one_per_s(5)
    assert queue.drain.rate_per_s(10.0) == pytest.approx(1.0)
    assert queue.drain.rate_per_s(100.0) is None


def test_level_timeout_is_used_for_deadline_admission() -> None:
    config = QueueConfig(levels=(LevelSpec("high", timeout_s=2.0), LevelSpec("low")))
    queue = WaitQueue(config)
    admit_all(queue, *(req(f"h{i}", 0, 10.0) for i in range(5)))
    for second in range(10):
        queue.drain.record(float(second))
    decision = queue.admit(req("h", 0, 10.0), 10.0)
    assert isinstance(decision, Rejected)
    assert decision.reason is RequestState.REJECTED_DEADLINE


def test_duplicate_id_is_a_bug() -> None:
    queue = WaitQueue()
    admit_all(queue, req("a", 0))
    with pytest.raises(ValueError, match="already queued"):
        queue.admit(req("a", 0), 0.0)


def test_unknown_level_is_a_bug() -> None:
    with pytest.raises(ValueError, match="out of range"):
        WaitQueue().admit(req("a", 7), 0.0)


# ----------------------------------------------------------------------------- deadlines
def test_level_timeout_expires_requests_at_their_deadline() -> None:
    config = QueueConfig(levels=(LevelSpec("high"), LevelSpec("medium", timeout_s=10.0)))
    queue = WaitQueue(config)
    admit_all(queue, req("m", 1, 0.0), req("h", 0, 0.0))
    assert queue.next_deadline_at() == 10.0
    assert queue.expire(9.9) == ()
    assert ids(queue.expire(10.0)) == ["m"]
    assert ids(queue.pop(5, 10.0)) == ["h"]
    assert queue.next_deadline_at() is None


def test_own_deadline_earlier_than_level_timeout_wins() -> None:
    config = QueueConfig(levels=(LevelSpec("high", timeout_s=10.0),))
    queue = WaitQueue(config)
    decision = queue.admit(req("a", 0, 0.0, deadline_at=3.0), 0.0)
    assert isinstance(decision, Admitted)
    assert decision.deadline_at == 3.0
    assert ids(queue.expire(3.0)) == ["a"]


def test_expired_cancelled_and_popped_requests_do_not_expire_again() -> None:
    queue = WaitQueue()
    admit_all(queue, *(req(f"r{i}", 0, 0.0, deadline_at=5.0) for i in range(3)))
    queue.cancel("r0")
    queue.pop(1, 1.0)
    assert ids(queue.expire(6.0)) == ["r2"]
    assert queue.expire(7.0) == ()


# ----------------------------------------------------------------------------- cancel, pop
def test_cancel_removes_from_the_middle_and_pop_skips_it() -> None:
    queue = WaitQueue()
    admit_all(queue, req("a", 1), req("b", 1), req("c", 1))
    cancelled = queue.cancel("b")
    assert cancelled is not None
    assert cancelled.id == "b"
    assert queue.cancel("b") is None
    assert queue.cancel("never") is None
    assert queue.depths() == (0, 2, 0)
    assert ids(queue.pop(5, 0.0)) == ["a", "c"]


def test_pop_stops_at_token_budget_in_priority_order() -> None:
    queue = WaitQueue()
    admit_all(queue, req("a", 0, tokens=5), req("b", 0, tokens=8), req("c", 1, tokens=1))
    # c would fit beside a, but b is more urgent: the batch stops instead of reordering.
    assert ids(queue.pop(5, 0.0, max_tokens=12)) == ["a"]
    assert ids(queue.pop(5, 0.0, max_tokens=12)) == ["b", "c"]


def test_first_request_over_budget_is_taken_alone() -> None:
    queue = WaitQueue()
    admit_all(queue, req("big", 0, tokens=100), req("small", 0, tokens=1))
    assert ids(queue.pop(5, 0.0, max_tokens=10)) == ["big"]


def test_pop_restricted_to_levels_of_a_pool() -> None:
    queue = WaitQueue()
    admit_all(queue, req("low", 2, 0.0), req("high", 0, 1.0))
    assert ids(queue.pop(5, 2.0, levels=[1, 2])) == ["low"]
    assert ids(queue.pop(5, 2.0, levels=[1, 2])) == []
    assert ids(queue.pop(5, 2.0, levels=[0])) == ["high"]


# ------------------------------------------------------------- pools that serve some levels
# Default aging: threshold 30 s, 0.5 level/s. A medium request reaches high 32 s after its
# arrival, a low one reaches medium at 32 s and high at 34 s.
@dataclass(frozen=True)
class PoolPickScenario:
    name: str
    arrivals: list[Request]
    served: frozenset[int]  # the levels of the pools with a free slot
    pick_at: float
    expected: list[str]  # what pop(10) returns, in order
    next_eligible_at: float | None  # what the caller's timer is set to, after the pop
    aging: AgingConfig = field(default_factory=AgingConfig)


POOL_PICK_SCENARIOS = [
    PoolPickScenario(
        "medium_not_yet_aged_waits_for_a_high_only_pool",
        [req("med", 1, 0.0)],
        frozenset({0}),
        pick_at=31.9,
        expected=[],
        next_eligible_at=32.0,
    ),
    PoolPickScenario(
        "medium_aged_to_high_runs_in_a_high_only_pool",
        [req("med", 1, 0.0)],
        frozenset({0}),
        pick_at=32.0,
        expected=["med"],
        next_eligible_at=None,
    ),
    PoolPickScenario(
        "low_half_aged_still_waits_for_a_high_only_pool",
        [req("low", 2, 0.0)],
        frozenset({0}),
        pick_at=33.0,
        expected=[],
        next_eligible_at=34.0,
    ),
    PoolPickScenario(
        "low_aged_to_medium_runs_in_a_medium_only_pool",
        [req("low", 2, 0.0)],
        frozenset({1}),
        pick_at=32.0,
        expected=["low"],
        next_eligible_at=None,
    ),
    PoolPickScenario(
        # Aged to high, medium ties with high at the top level: the earlier arrival first.
        "aged_medium_goes_before_a_later_high",
        [req("med", 1, 0.0), req("high", 0, 31.0)],
        frozenset({0}),
        pick_at=33.0,
        expected=["med", "high"],
        next_eligible_at=None,
    ),
    PoolPickScenario(
        "aged_medium_goes_after_an_earlier_high",
        [req("high", 0, 0.0), req("med", 1, 0.0)],
        frozenset({0}),
        pick_at=33.0,
        expected=["high", "med"],
        next_eligible_at=None,
    ),
    PoolPickScenario(
        # Only the oldest medium has aged: the next one's time is the timer.
        "only_aged_requests_of_a_level_are_taken",
        [req("m1", 1, 0.0), req("m2", 1, 5.0), req("m3", 1, 10.0)],
        frozenset({0}),
        pick_at=37.0,
        expected=["m1", "m2"],
        next_eligible_at=42.0,
    ),
    PoolPickScenario(
        "aging_disabled_never_brings_medium_to_high",
        [req("med", 1, 0.0)],
        frozenset({0}),
        pick_at=1e6,
        expected=[],
        next_eligible_at=None,
        aging=AgingConfig(threshold_s=30.0, rate_per_s=0.0),
    ),
    PoolPickScenario(
        # Aging goes towards high only: a high request never runs in a low-only pool.
        "high_never_runs_in_a_low_only_pool",
        [req("high", 0, 0.0), req("low", 2, 1.0)],
        frozenset({2}),
        pick_at=1e6,
        expected=["low"],
        next_eligible_at=None,
    ),
    PoolPickScenario(
        "served_level_is_taken_without_waiting",
        [req("med", 1, 0.0), req("low", 2, 0.0)],
        frozenset({1}),
        pick_at=1.0,
        expected=["med"],
        next_eligible_at=32.0,
    ),
]


@pytest.mark.parametrize("scenario", POOL_PICK_SCENARIOS, ids=lambda s: s.name)
def test_pick_for_pools_uses_the_aged_level(scenario: PoolPickScenario) -> None:
    queue = WaitQueue(QueueConfig(aging=scenario.aging))
    admit_all(queue, *scenario.arrivals)
    assert ids(queue.peek(10, scenario.pick_at, levels=scenario.served)) == scenario.expected
    first = queue.peek(1, scenario.pick_at, levels=scenario.served)
    assert ids(first) == scenario.expected[:1]  # the dispatcher's one-at-a-time pick agrees
    assert ids(queue.pop(10, scenario.pick_at, levels=scenario.served)) == scenario.expected
    assert queue.next_eligible_at(scenario.served) == scenario.next_eligible_at


@pytest.mark.parametrize(
    ("level", "wait_s", "expected"),
    [(2, 0.0, 2), (2, 31.9, 2), (2, 32.0, 1), (2, 33.9, 1), (2, 34.0, 0), (2, 1e9, 0), (0, 5, 0)],
)
def test_aged_level_is_the_whole_level_reached(level: int, wait_s: float, expected: int) -> None:
    queue = WaitQueue()
    assert queue.aged_level(req("r", level, 100.0), 100.0 + wait_s) == expected


def test_aged_level_agrees_with_eligibility_at_awkward_times() -> None:
    # Rates and arrivals whose sums do not round exactly: aged_level and the pick must agree
    # on the very instant reaches_level_at names, or a timer would fire a moment too early.
    aging = AgingConfig(threshold_s=0.1, rate_per_s=3.0)
    for arrival_at in (0.1, 0.7, 1e6 + 0.3, 123456.789):
        at = reaches_level_at(2, 0, arrival_at, aging)
        assert at is not None
        assert aged_level(2, arrival_at, at, aging) == 0
        assert aged_level(2, arrival_at, math.nextafter(at, -math.inf), aging) == 1
        queue = WaitQueue(QueueConfig(aging=aging))
        admit_all(queue, req("r", 2, arrival_at))
        assert queue.next_eligible_at({0}) == at
        assert ids(queue.peek(1, math.nextafter(at, -math.inf), levels={0})) == []
        assert ids(queue.peek(1, at, levels={0})) == ["r"]


@pytest.mark.parametrize(
    ("served", "aging", "expected"),
    [
        ({0, 1, 2}, AgingConfig(), ()),
        ({0}, AgingConfig(), ()),  # medium and low age into high
        ({1}, AgingConfig(), (0,)),  # high is more urgent than anything served
        ({2}, AgingConfig(), (0, 1)),
        ({0}, AgingConfig(rate_per_s=0.0), (1, 2)),  # aging disabled: only served levels run
        ((), AgingConfig(), (0, 1, 2)),
    ],
    ids=["all", "high_only", "medium_only", "low_only", "aging_off", "nothing"],
)
def test_unreachable_levels(
    served: set[int], aging: AgingConfig, expected: tuple[int, ...]
) -> None:
    assert unreachable_levels(served, 3, aging) == expected


def test_requeue_puts_a_retried_request_first_in_its_level() -> None:
    queue = WaitQueue()
    admit_all(queue, req("a", 1, 0.0), req("b", 1, 1.0))
    (first,) = queue.pop(1, 2.0)
    queue.requeue(first, 3.0)
    assert ids(queue.pop(5, 3.0)) == ["a", "b"]


def test_depths_tokens_and_outcome_counts() -> None:
    queue = WaitQueue(QueueConfig(max_size=2))
    admit_all(queue, req("l", 2, tokens=3), req("m", 1, tokens=4))
    queue.admit(req("h", 0, tokens=5), 0.0)
    assert queue.depths() == (1, 1, 0)
    assert queue.num_tokens == 9
    queue.pop(1, 0.0)
    counts = queue.outcome_counts()
    assert counts[(2, RequestState.SHED)] == 1
    assert counts[(0, RequestState.DISPATCHED)] == 1
    assert counts[(1, RequestState.QUEUED)] == 1
    assert queue.oldest_arrival_at() == 0.0


def test_many_cancellations_keep_memory_bounded() -> None:
    queue = WaitQueue(QueueConfig(max_size=100_000))
    admit_all(queue, req("keep", 2, 0.0))
    for i in range(5000):
        queue.admit(req(f"x{i}", 2, 0.0, deadline_at=1e9), 0.0)
        queue.cancel(f"x{i}")
    assert len(queue._fifos[2]) < 200  # compaction ran
    assert len(queue._deadlines) < 200
    assert ids(queue.pop(5, 0.0)) == ["keep"]


def test_popped_entries_leave_their_fifo_at_once() -> None:
    # Dead entries left at the front would make every later pick step over them.
    queue = WaitQueue(QueueConfig(max_size=10_000))
    admit_all(queue, *(req(f"r{i}", i % 3) for i in range(3000)))
    for _ in range(1000):
        queue.pop(2, 0.0)
    assert sum(len(fifo) for fifo in queue._fifos) == len(queue) == 1000
