"""The seasonal forecast floor: same hour yesterday and last week, never more than seen."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.core.forecast import (
    DAY_HOURS,
    HOUR_S,
    KEPT_HOURS,
    SeasonalHistory,
    forecast_floor,
    record_hour,
)

DAY_S = DAY_HOURS * HOUR_S


def test_no_history_gives_no_floor() -> None:
    assert forecast_floor(SeasonalHistory(), 10 * DAY_S) is None


def test_the_same_hour_yesterday_is_the_floor() -> None:
    history = record_hour(SeasonalHistory(), 9 * DAY_S + 14 * HOUR_S + 10, 6)
    assert forecast_floor(history, 10 * DAY_S + 14 * HOUR_S + 1800) == 6
    assert forecast_floor(history, 10 * DAY_S + 15 * HOUR_S) is None


def test_the_lead_looks_at_the_next_hour_so_capacity_is_warm_at_the_peak() -> None:
    history = record_hour(SeasonalHistory(), 9 * DAY_S + 15 * HOUR_S, 8)
    just_before = 10 * DAY_S + 15 * HOUR_S - 120
    assert forecast_floor(history, just_before) is None
    assert forecast_floor(history, just_before, lead_s=180) == 8


def test_last_week_counts_too_and_the_higher_wins() -> None:
    history = record_hour(SeasonalHistory(), 3 * DAY_S + 9 * HOUR_S, 5)  # a week before
    history = record_hour(history, 9 * DAY_S + 9 * HOUR_S, 3)  # yesterday
    assert forecast_floor(history, 10 * DAY_S + 9 * HOUR_S) == 5


def test_an_hour_keeps_its_highest_count() -> None:
    history = SeasonalHistory()
    for replicas in (2, 7, 4):
        history = record_hour(history, 5 * HOUR_S + replicas, replicas)
    assert history.hours == ((5, 7),)


@given(st.lists(st.tuples(st.integers(0, 400), st.integers(0, 50)), max_size=60))
@settings(deadline=None)  # a busy machine makes an example slow, never wrong
def test_history_is_bounded_and_the_floor_is_a_count_that_was_seen(
    samples: list[tuple[int, int]],
) -> None:
    history = SeasonalHistory()
    at_s = 0.0
    for step_hours, replicas in samples:
        at_s += step_hours * 60.0  # minutes, in order
        history = record_hour(history, at_s, replicas)
    assert len(history.hours) <= KEPT_HOURS
    floor = forecast_floor(history, at_s + DAY_S)
    assert floor is None or floor in {r for _, r in samples}
