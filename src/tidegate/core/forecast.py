"""Seasonal forecast: the replicas a model needed at the same hour yesterday and last week.

Design note. Tidal traffic repeats by day and by week, so the count a model needed an hour
from now yesterday (and on this weekday last week) is a good floor for the next hour: capacity
is warm before the peak arrives instead of chasing it. It is only ever a floor (passed to
``decide_scale`` as ``forecast_replicas``): it never scales anything down, and with no history
it says nothing.

History is kept per hour of wall time (``hour index = epoch seconds // 3600``) as the highest
count the autoscaler decided in that hour, for ``KEPT_HOURS`` (eight days). The shell passes
wall-clock epoch seconds; nothing here reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

HOUR_S = 3600
DAY_HOURS = 24
WEEK_HOURS = 7 * DAY_HOURS
KEPT_HOURS = WEEK_HOURS + DAY_HOURS


@dataclass(frozen=True, slots=True)
class SeasonalHistory:
    """Highest decided count per wall-clock hour, oldest first, at most KEPT_HOURS."""

    hours: tuple[tuple[int, int], ...] = ()  # (hour index, highest replicas)


def record_hour(history: SeasonalHistory, at_s: float, replicas: int) -> SeasonalHistory:
    """Remember ``replicas`` for the hour of ``at_s`` (the highest of that hour is kept)."""
    hour = int(at_s // HOUR_S)
    hours = history.hours
    if hours and hours[-1][0] == hour:
        if replicas <= hours[-1][1]:
            return history
        hours = (*hours[:-1], (hour, replicas))
    else:
        hours = (*hours, (hour, replicas))
    oldest = hour - KEPT_HOURS
    return SeasonalHistory(tuple(entry for entry in hours if entry[0] > oldest))


def forecast_floor(history: SeasonalHistory, at_s: float, lead_s: float = 0.0) -> int | None:
    """The floor for ``at_s``: the max over yesterday's and last week's count for the hour
    that starts ``lead_s`` from now (a replica takes that long to be ready). None: no history.
    """
    hour = int((at_s + lead_s) // HOUR_S)
    seen = dict(history.hours)
    past = [seen[h] for h in (hour - DAY_HOURS, hour - WEEK_HOURS) if h in seen]
    return max(past) if past else None
