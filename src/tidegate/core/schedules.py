"""Time-of-day floors: at least ``min_replicas`` over a window of the local week.

Design note. Tidal traffic is known in advance: the morning peak arrives every weekday. A
schedule raises the autoscaler's floor over a window so the capacity is there when the
peak starts, instead of one cold start after it. The window opens ``lead_minutes`` early
(the measured cold start, rounded up to a minute) and closes on time: capacity leaves
through the ordinary scale-down window and rate policies.

Times are the shell's: it converts its clock to the configured time zone and passes
``(weekday, minute of the day)``; nothing here knows about clocks or zones. A window belongs
to the day it starts, so Friday 22:00-02:00 holds until Saturday 02:00, and a lead can start
Monday's 00:00 window on Sunday evening.

Invariants: pure; ``schedule_floor`` is 0 when no window is active, else the largest
``min_replicas`` among the active ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

MINUTES_PER_DAY = 24 * 60
MINUTES_PER_WEEK = 7 * MINUTES_PER_DAY


@dataclass(frozen=True, slots=True)
class Schedule:
    """A floor of ``min_replicas`` on ``days`` over [from_minute, to_minute) local time.

    ``days`` are the days a window *starts* (0 = Monday .. 6 = Sunday); minutes are of the
    local day; ``to_minute <= from_minute`` wraps past midnight (22:00-06:00), and
    ``to_minute`` may be 1440 (until midnight).
    """

    days: tuple[int, ...]
    from_minute: int
    to_minute: int
    min_replicas: int

    def __post_init__(self) -> None:
        if not self.days or any(not 0 <= day <= 6 for day in self.days):
            raise ValueError(f"schedule days must be 0 (Monday)..6 (Sunday), got {self.days}")
        if not 0 <= self.from_minute < MINUTES_PER_DAY:
            raise ValueError(f"schedule from_minute must be in [0, 1440), got {self.from_minute}")
        if not 0 <= self.to_minute <= MINUTES_PER_DAY or self.to_minute == self.from_minute:
            raise ValueError(
                f"schedule to_minute must be in [0, 1440] and differ from from_minute, "
                f"got {self.from_minute}-{self.to_minute}"
            )
        if self.min_replicas < 0:
            raise ValueError(f"schedule min_replicas must be >= 0, got {self.min_replicas}")

    @property
    def length_minutes(self) -> int:
        span = self.to_minute - self.from_minute
        return span if span > 0 else span + MINUTES_PER_DAY

    def is_active(self, weekday: int, minute: int, lead_minutes: int = 0) -> bool:
        """Whether the floor holds at this local time, the window opening ``lead_minutes`` early."""
        now = weekday * MINUTES_PER_DAY + minute
        for day in self.days:
            opens = day * MINUTES_PER_DAY + self.from_minute - lead_minutes
            # Minutes since it opened, modulo the week: Sunday-to-Monday wraps for free.
            if (now - opens) % MINUTES_PER_WEEK < self.length_minutes + lead_minutes:
                return True
        return False


def lead_minutes(cold_start_s: float) -> int:
    """How early windows open: the cold start, rounded up to whole minutes."""
    return math.ceil(cold_start_s / 60)


def schedule_floor(
    schedules: Iterable[Schedule], weekday: int, minute: int, lead_minutes: int = 0
) -> int:
    """The largest ``min_replicas`` of the schedules active now; 0 when none is."""
    return max(
        (s.min_replicas for s in schedules if s.is_active(weekday, minute, lead_minutes)),
        default=0,
    )
