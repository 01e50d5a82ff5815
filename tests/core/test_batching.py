"""plan_batch rules, one scenario per row."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tidegate.core.batching import (
    BatchConfig,
    BatchView,
    Release,
    WaitUntil,
    plan_batch,
)
from tidegate.core.queue import Admitted, WaitQueue
from tidegate.core.request import Request

from .conftest import req


@dataclass(frozen=True)
class BatchScenario:
    name: str
    head: list[Request]
    num_queued: int
    config: BatchConfig
    now: float
    expected: Release | WaitUntil


def _r(i: int, at: float, tokens: int = 1) -> Request:
    return req(f"r{i}", 0, at, tokens=tokens)


CFG = BatchConfig(max_batch_size=4, batch_window_ms=10.0)
FOUR = [_r(i, 1.0) for i in range(4)]
SCENARIOS = [
    BatchScenario("empty_queue_waits_for_an_arrival", [], 0, CFG, 1.0, WaitUntil(None)),
    BatchScenario(
        "partial_batch_waits_until_oldest_window_ends",
        [_r(0, 1.000), _r(1, 1.004)],
        2,
        CFG,
        1.005,
        WaitUntil(1.010),
    ),
    BatchScenario(
        "partial_batch_released_when_window_passed",
        [_r(0, 1.000), _r(1, 1.004)],
        2,
        CFG,
        1.010,
        Release((_r(0, 1.000), _r(1, 1.004)), "window"),
    ),
    BatchScenario(
        "full_by_count_released_at_once",
        FOUR,
        4,
        CFG,
        1.0,
        Release(tuple(FOUR), "full_size"),
    ),
    BatchScenario(
        "more_than_a_full_batch_releases_a_full_one_now",
        [*FOUR, _r(4, 1.0)],
        9,
        CFG,
        1.0,
        Release(tuple(FOUR), "full_size"),
    ),
    BatchScenario(
        "full_by_tokens_released_at_once",
        [_r(0, 1.0, 6), _r(1, 1.0, 6)],
        2,
        BatchConfig(max_batch_size=4, max_batch_tokens=10, batch_window_ms=10.0),
        1.0,
        Release((_r(0, 1.0, 6),), "full_tokens"),
    ),
    BatchScenario(
        "exactly_spent_token_budget_is_full",
        [_r(0, 1.0, 10)],
        1,
        BatchConfig(max_batch_size=4, max_batch_tokens=10, batch_window_ms=10.0),
        1.0,
        Release((_r(0, 1.0, 10),), "full_tokens"),
    ),
    BatchScenario(
        "short_view_of_a_deeper_queue_releases_backlog",
        [_r(0, 1.0)],
        3,
        CFG,
        1.0,
        Release((_r(0, 1.0),), "backlog"),
    ),
    BatchScenario(
        "zero_window_releases_immediately",
        [_r(0, 1.0)],
        1,
        BatchConfig(max_batch_size=4, batch_window_ms=0.0),
        1.0,
        Release((_r(0, 1.0),), "window"),
    ),
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_plan_batch(scenario: BatchScenario) -> None:
    view = BatchView(scenario.head, scenario.num_queued)
    assert plan_batch(view, scenario.config, scenario.now) == scenario.expected


def test_released_batch_is_what_the_queue_pops() -> None:
    queue = WaitQueue()
    for i, level in enumerate([2, 0, 1, 0, 2, 1]):
        assert isinstance(queue.admit(req(f"r{i}", level, i * 0.001), i * 0.001), Admitted)
    config = BatchConfig(max_batch_size=4, batch_window_ms=5.0)
    now = 0.01
    plan = plan_batch(BatchView(queue.peek(5, now), len(queue)), config, now)
    assert isinstance(plan, Release)
    assert queue.pop(len(plan.batch), now, config.max_batch_tokens) == plan.batch
    assert [r.id for r in plan.batch] == ["r1", "r3", "r2", "r5"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"batch_window_ms": -1.0}, "batch_window_ms"),
        ({"max_batch_tokens": 0}, "max_batch_tokens"),
    ],
)
def test_invalid_batch_config_is_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchConfig(**kwargs)  # type: ignore[arg-type]
