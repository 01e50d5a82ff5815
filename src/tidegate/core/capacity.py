"""Capacity decisions of the profiler: when a point is measured, when to stop, where the knee is.

Design note. A replica's operating point is a trade: a larger batch or more requests in flight
raise throughput until the engine saturates, and latency rises all along. The knee is the
configuration with the highest throughput whose tail latency meets the SLO; when a smaller
configuration comes within ``tie_tolerance`` (5%) of that throughput it wins instead, because
it buys the same work with less latency, less memory and more headroom. Three rules:

- ``decide_point``: a point is measured in windows, and is done once the last
  ``num_windows`` (3) agree within ``tolerance`` (10%) on throughput and on p95, and at least
  ``min_seconds`` have passed; past ``max_seconds`` it is given up as unstable (still kept).
- ``decide_climb``: a sweep stops climbing when the last point broke the SLO (larger
  configurations only add latency), or when none of the last ``steps`` (4) points raised the
  best throughput by ``min_gain`` (5%) over the best before them (a plateau).
- ``find_knee``: the knee as above, or ``NoKnee`` with the point closest to the SLO.

Invariants: pure (no clock, no I/O); the knee is one of the points given and meets the SLO;
its throughput is within ``tie_tolerance`` of the best point that meets the SLO, and no
smaller point that meets the SLO is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency targets at the 95th percentile; None: no target on that measure."""

    p95_ms: float | None = None  # end to end (embeddings, or whole completions)
    ttft_p95_ms: float | None = None  # generation: time to first token
    itl_p95_ms: float | None = None  # generation: inter-token latency
    max_error_rate: float = 0.01  # a point failing more requests than this never qualifies

    @property
    def has_latency_target(self) -> bool:
        return any(v is not None for v in (self.p95_ms, self.ttft_p95_ms, self.itl_p95_ms))


@dataclass(frozen=True, slots=True)
class CapacityPoint:
    """What ``find_knee`` compares: one measured configuration."""

    size: float  # the configuration: batch size, concurrency or window; smaller is cheaper
    throughput_per_s: float  # requests/s (embeddings) or output tokens/s (generation)
    p95_ms: float  # end-to-end latency p95; inf when nothing completed
    ttft_p95_ms: float | None = None
    itl_p95_ms: float | None = None
    error_rate: float = 0.0


def meets_slo(point: CapacityPoint, slo: Slo) -> bool:
    """Every target that is set holds; a target on a measure the point lacks does not."""
    if point.error_rate > slo.max_error_rate:
        return False
    pairs = (
        (slo.p95_ms, point.p95_ms),
        (slo.ttft_p95_ms, point.ttft_p95_ms),
        (slo.itl_p95_ms, point.itl_p95_ms),
    )
    return all(target is None or (value is not None and value <= target) for target, value in pairs)


def slo_gap(point: CapacityPoint, slo: Slo) -> float:
    """How far a point is from the SLO: the largest ratio of a measure to its target.

    Without latency targets only the error rate can fail a point: then it is the gap.
    """
    pairs = (
        (slo.p95_ms, point.p95_ms),
        (slo.ttft_p95_ms, point.ttft_p95_ms),
        (slo.itl_p95_ms, point.itl_p95_ms),
    )
    ratios = [
        (math.inf if value is None else value / target)
        for target, value in pairs
        if target is not None and target > 0
    ]
    return max(ratios, default=point.error_rate)


# ----------------------------------------------------------------------------- the knee
@dataclass(frozen=True, slots=True)
class Knee:
    point: CapacityPoint  # the chosen configuration
    best: CapacityPoint  # the highest throughput under the SLO (the point itself unless a
    # smaller configuration came within the tolerance of it)
    reason: str


@dataclass(frozen=True, slots=True)
class NoKnee:
    reason: str
    closest: CapacityPoint | None  # the point nearest to meeting the SLO; None: no points


def find_knee(
    points: Sequence[CapacityPoint], slo: Slo, tie_tolerance: float = 0.05
) -> Knee | NoKnee:
    """The best operating point under the SLO (see the module design note)."""
    if not points:
        return NoKnee("nothing was measured", None)
    meeting = [p for p in points if meets_slo(p, slo) and p.throughput_per_s > 0]
    if not meeting:
        # Why the closest and not the fastest: an operator who must run anyway wants the
        # configuration that misses the target by the least.
        closest = min(points, key=lambda p: (slo_gap(p, slo), p.size))
        return NoKnee("no measured point meets the SLO", closest)
    best = max(meeting, key=lambda p: (p.throughput_per_s, -p.size))
    floor = best.throughput_per_s * (1.0 - tie_tolerance)
    near = [p for p in meeting if p.throughput_per_s >= floor]
    chosen = min(near, key=lambda p: (p.size, -p.throughput_per_s))
    if chosen == best:
        reason = (
            "the highest throughput that meets the SLO"
            if slo.has_latency_target
            else "the highest throughput"
        )
    else:
        reason = (
            f"within {tie_tolerance:.0%} of the highest throughput ({best.throughput_per_s:.4g}/s "
            f"at size {best.size:g}) and smaller"
        )
    return Knee(chosen, best, reason)


# ----------------------------------------------------------------------------- climbing
@dataclass(frozen=True, slots=True)
class Climb:
    """Measure the next, larger configuration."""


@dataclass(frozen=True, slots=True)
class StopClimbing:
    reason: str  # "slo_broken" or "plateau"
    detail: str


def decide_climb(
    points: Sequence[CapacityPoint], slo: Slo, *, min_gain: float = 0.05, steps: int = 4
) -> Climb | StopClimbing:
    """Whether a sweep over growing configurations should go on (points in sweep order)."""
    if not points:
        return Climb()
    last = points[-1]
    if slo.has_latency_target and not meets_slo(last, slo):
        return StopClimbing("slo_broken", f"size {last.size:g} breaks the SLO")
    if len(points) <= steps:
        return Climb()
    before = max(p.throughput_per_s for p in points[:-steps])
    recent = max(p.throughput_per_s for p in points[-steps:])
    if recent < before * (1.0 + min_gain):
        return StopClimbing(
            "plateau",
            f"the last {steps} steps raised throughput by less than {min_gain:.0%} "
            f"({before:.4g} -> {recent:.4g})",
        )
    return Climb()


# ----------------------------------------------------------------------------- stability
@dataclass(frozen=True, slots=True)
class WindowStats:
    """One measurement window of a point."""

    throughput_per_s: float
    p95_ms: float  # inf when nothing completed in the window
    duration_s: float


@dataclass(frozen=True, slots=True)
class StabilityRule:
    num_windows: int = 3
    tolerance: float = 0.10  # the windows agree when max <= (1 + tolerance) * min
    min_seconds: float = 5.0
    max_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.num_windows < 1:
            raise ValueError(f"num_windows must be >= 1, got {self.num_windows}")
        if self.max_seconds < self.min_seconds:
            raise ValueError(
                f"max_seconds ({self.max_seconds}) must be >= min_seconds ({self.min_seconds})"
            )


class PointVerdict(Enum):
    MEASURE = "measure"  # another window
    STABLE = "stable"  # done: the last windows agree
    UNSTABLE = "unstable"  # done: out of time; terminal like STABLE


def _agree(values: Sequence[float], tolerance: float) -> bool:
    low, high = min(values), max(values)
    if not all(math.isfinite(v) for v in values) or low <= 0:
        return False
    return high <= low * (1.0 + tolerance)


def windows_agree(windows: Sequence[WindowStats], tolerance: float) -> bool:
    """Throughput and p95 each agree within the tolerance across the windows."""
    return bool(windows) and (
        _agree([w.throughput_per_s for w in windows], tolerance)
        and _agree([w.p95_ms for w in windows], tolerance)
    )


def decide_point(
    windows: Sequence[WindowStats], elapsed_s: float, rule: StabilityRule
) -> PointVerdict:
    """Measure another window, or stop: stable, or out of time (``max_seconds``)."""
    last = windows[-rule.num_windows :]
    if (
        elapsed_s >= rule.min_seconds
        and len(last) == rule.num_windows
        and windows_agree(last, rule.tolerance)
    ):
        return PointVerdict.STABLE
    if elapsed_s >= rule.max_seconds:
        return PointVerdict.UNSTABLE
    return PointVerdict.MEASURE
