"""Tidal days for bench_autoscale: ServeGen's 10-minute rate windows made into rate curves.

A day is one ServeGen model's day of ``servegen/aggregate_rate_10min.csv`` (144 windows from
00:00). Its windows are mapped linearly onto ``[peak / PEAK_TO_TROUGH, peak]``: the
reference's quietest window becomes the trough, its busiest the peak. The reference is the
day itself, except for a dip day, whose reference is the whole 14-day series of its model:
a weekend day then peaks below the fleet's peak, as it does in the trace. A day may carry
a synthetic flash crowd (a rate multiplier over a span) on top of ServeGen's own spikes.
"""

from __future__ import annotations

import csv
import functools
import itertools
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tidegate.sim.synthetic import Segment

SERVEGEN = (
    Path(__file__).resolve().parent.parent.parent
    / "shared"
    / "traces"
    / "servegen"
    / "aggregate_rate_10min.csv"
)
PEAK_TO_TROUGH = 4.0
WINDOW_S = 600.0
DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class Flash:
    at_s: float  # from midnight
    length_s: float
    multiplier: float


@dataclass(frozen=True, slots=True)
class Day:
    name: str  # for the tables: what the day shows
    category: str
    model: str
    day: int
    flash: Flash | None = None
    against_series: bool = False  # map against the model's 14 days (a dip day), not its own


DAYS = (
    Day(
        "m-small d0, evening peak + flash", "language", "m-small", 0, Flash(11 * 3600.0, 900.0, 2.5)
    ),
    Day("m-mid d8, night peak", "language", "m-mid", 8),
    Day("m-large d9, evening spikes", "language", "m-large", 9),
    Day("deepseek-r1 d0, two peaks", "reason", "deepseek-r1", 0),
    Day("m-large d12, weekend dip", "language", "m-large", 12, against_series=True),
)


@functools.cache
def _series() -> dict[tuple[str, str], dict[int, list[tuple[float, float]]]]:
    """(category, model) -> day -> sorted (start_s from midnight, total rate)."""
    series: dict[tuple[str, str], dict[int, list[tuple[float, float]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    with SERVEGEN.open(newline="") as file:
        for row in csv.DictReader(file):
            start = float(row["window_start_s"]) % DAY_S
            rate = float(row["total_rate_rps"])
            series[(row["category"], row["model"])][int(row["day"])].append((start, rate))
    for days in series.values():
        for windows in days.values():
            windows.sort()
    return series


def windows(day: Day) -> list[tuple[float, float]]:
    """(start_s, ServeGen rate) of the day's 144 windows."""
    found = _series().get((day.category, day.model), {}).get(day.day, [])
    if len(found) != int(DAY_S / WINDOW_S):
        raise SystemExit(f"{SERVEGEN}: expected 144 windows of {day}, found {len(found)}")
    if any(rate <= 0 for _, rate in found):
        raise SystemExit(f"{SERVEGEN}: {day} has windows without data (rate 0); pick another")
    return found


def segments(day: Day, peak_per_s: float) -> list[Segment]:
    """The day's rate curve, its reference's busiest window at ``peak_per_s``."""
    own = windows(day)
    if day.against_series:
        every = _series()[(day.category, day.model)].values()
        rates = [rate for days in every for _, rate in days if rate > 0]
    else:
        rates = [rate for _, rate in own]
    low, high = min(rates), max(rates)
    trough_per_s = peak_per_s / PEAK_TO_TROUGH
    curve = []
    for start, rate in own:
        share = (rate - low) / (high - low)
        curve.append(
            Segment(start, start + WINDOW_S, trough_per_s + share * (peak_per_s - trough_per_s))
        )
    return _with_flash(curve, day.flash) if day.flash else curve


def _with_flash(curve: list[Segment], flash: Flash) -> list[Segment]:
    """``curve`` with the rate multiplied inside ``[at, at + length)`` (windows split there)."""
    end_at = flash.at_s + flash.length_s
    out = []
    for s in curve:
        cuts = sorted(
            {s.start_s, s.end_s, *(t for t in (flash.at_s, end_at) if s.start_s < t < s.end_s)}
        )
        for start, end in itertools.pairwise(cuts):
            inside = flash.at_s <= start < end_at
            out.append(
                Segment(start, end, s.arrivals_per_s * (flash.multiplier if inside else 1.0))
            )
    return out


def mean_per_s(curve: list[Segment]) -> float:
    return sum((s.end_s - s.start_s) * s.arrivals_per_s for s in curve) / DAY_S
