"""Kubernetes HPA ``behavior``: stabilization windows and rate policies, to the letter.

Design note. The HPA turns a metric recommendation into a replica count in two steps, and
this module is those two steps as pure functions, so that tidegate's autoscaler and the HPA
it renders for Kubernetes agree replica for replica:

1. ``stabilize``: the count moves from ``current`` only as far as every recommendation of the
   window allows. Up to the *lowest* recommendation of the scale-up window, down to the
   *highest* of the scale-down window: a single high sample does not scale up when the up
   window is long, a single low sample does not scale down while the down window remembers
   a higher one. Every recommendation is recorded, stabilized or not.
2. ``scale_limit``: each policy is measured from the replica count
   at the *start of its own period* (the replicas added within the period count against it,
   those removed count for it): ``pods`` adds or removes ``value`` replicas per period,
   ``percent`` ``value`` % of that count (rounded up when adding, so that 1 replica can grow;
   truncated when removing, exactly as the HPA's ``int32()`` does). ``select_policy`` takes
   the policy allowing the largest change (``max``), the smallest (``min``), or none
   (``disabled``: that direction never moves).

Float arithmetic matches the HPA's float64 arithmetic operation for operation (a 10 %
policy on 50 replicas allows 56, not 55: ``50 * 1.1`` is 55.00000000000001), so replays
agree exactly.

Invariants: pure; histories only grow by one entry per call and forget what no window or
period can see any more; a limit behind ``current`` means "no move this period", never a
move the other way (the caller clamps it to ``current``, as the HPA does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

POLICY_KINDS = ("pods", "percent")
SELECT_POLICIES = ("max", "min", "disabled")
MAX_PERIOD_S = 1800.0  # HPA: periodSeconds <= 1800
MAX_WINDOW_S = 3600.0  # HPA: stabilizationWindowSeconds <= 3600


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    """HPA ``HPAScalingPolicy``: at most ``value`` pods, or percent, per ``period_s``."""

    kind: str  # "pods" | "percent"
    value: int  # replicas (pods) or percent of the replicas at the period's start (percent)
    period_s: float  # the window the policy must hold over, looking back from now

    def __post_init__(self) -> None:
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"policy kind must be one of {POLICY_KINDS}, got {self.kind!r}")
        if self.value <= 0:
            raise ValueError(f"policy value must be > 0, got {self.value}")
        if not 0 < self.period_s <= MAX_PERIOD_S:
            raise ValueError(f"policy period_s must be in (0, {MAX_PERIOD_S}], got {self.period_s}")


@dataclass(frozen=True, slots=True)
class ScalingRules:
    """HPA ``HPAScalingRules`` for one direction."""

    stabilization_window_s: float
    policies: tuple[ScalingPolicy, ...]
    select_policy: str = "max"  # "max" | "min" | "disabled"
    tolerance: float | None = None  # this direction's dead band; None: the config's (HPA 1.33)

    def __post_init__(self) -> None:
        if self.select_policy not in SELECT_POLICIES:
            raise ValueError(
                f"select_policy must be one of {SELECT_POLICIES}, got {self.select_policy!r}"
            )
        if not 0 <= self.stabilization_window_s <= MAX_WINDOW_S:
            raise ValueError(
                f"stabilization_window_s must be in [0, {MAX_WINDOW_S}], "
                f"got {self.stabilization_window_s}"
            )
        if not self.policies and self.select_policy != "disabled":
            raise ValueError(
                "scaling rules need at least one policy unless select_policy is disabled"
            )
        if self.tolerance is not None and not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")

    @property
    def longest_period_s(self) -> float:
        return max((policy.period_s for policy in self.policies), default=0.0)


# Kubernetes' defaults (also tidegate's for scaling up): x2 or +4 every 15 s, no window.
DEFAULT_SCALE_UP = ScalingRules(
    stabilization_window_s=0.0,
    policies=(ScalingPolicy("percent", 100, 15.0), ScalingPolicy("pods", 4, 15.0)),
    select_policy="max",
)
# tidegate's scale-down: remember the highest recommendation of 10 minutes, then shed at most
# 10% per minute (at least one replica: int(n * 0.9) < n for every n <= 10).
DEFAULT_SCALE_DOWN = ScalingRules(
    stabilization_window_s=600.0,
    policies=(ScalingPolicy("percent", 10, 60.0),),
    select_policy="max",
)
# Kubernetes' own scale-down default: a 5-minute window, then everything at once.
HPA_DEFAULT_SCALE_DOWN = ScalingRules(
    stabilization_window_s=300.0,
    policies=(ScalingPolicy("percent", 100, 15.0),),
    select_policy="max",
)


@dataclass(frozen=True, slots=True)
class Recommendation:
    """One unstabilized recommendation, as the HPA records it every period."""

    at: float
    replicas: int


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    """A change that was made: ``change`` replicas added (up) or removed (down), > 0."""

    at: float
    change: int


@dataclass(frozen=True, slots=True)
class Stabilized:
    replicas: int  # ``current`` brought within [lowest, highest]
    lowest: int  # lowest recommendation of the scale-up window, this one included
    highest: int  # highest recommendation of the scale-down window, this one included


def stabilize(
    recommendation: int,
    current: int,
    history: Sequence[Recommendation],
    up: ScalingRules,
    down: ScalingRules,
    now: float,
) -> Stabilized:
    """Move ``current`` toward ``recommendation`` only as far as both windows allow."""
    up_cutoff = now - up.stabilization_window_s
    down_cutoff = now - down.stabilization_window_s
    lowest = highest = recommendation
    for past in history:
        # Strictly after the cutoff, as the HPA's time.After: a window of 0 sees only now.
        if past.at > up_cutoff:
            lowest = min(lowest, past.replicas)
        if past.at > down_cutoff:
            highest = max(highest, past.replicas)
    return Stabilized(min(max(current, lowest), highest), lowest, highest)


def record_recommendation(
    history: Sequence[Recommendation],
    recommendation: int,
    up: ScalingRules,
    down: ScalingRules,
    now: float,
) -> tuple[Recommendation, ...]:
    """``history`` with ``recommendation`` appended and what no window can see dropped."""
    horizon = now - max(up.stabilization_window_s, down.stabilization_window_s)
    kept = tuple(past for past in history if past.at > horizon)
    return (*kept, Recommendation(now, recommendation))


def scale_limit(
    current: int,
    up_events: Sequence[ScaleEvent],
    down_events: Sequence[ScaleEvent],
    rules: ScalingRules,
    now: float,
    *,
    up: bool,
) -> int:
    """Up: the most replicas the policies allow now; down: the fewest.

    The limit may lie behind ``current`` (the period's budget is spent): no move then.
    """
    if rules.select_policy == "disabled":
        return current
    proposals: list[int] = []
    for policy in rules.policies:
        cutoff = now - policy.period_s
        added = sum(event.change for event in up_events if event.at > cutoff)
        removed = sum(event.change for event in down_events if event.at > cutoff)
        start = current - added + removed  # the count when the policy's period began
        if policy.kind == "pods":
            proposals.append(start + policy.value if up else start - policy.value)
        elif up:
            # Rounded up, or 1 replica at 10% would never grow (the HPA's rule and reason).
            proposals.append(math.ceil(start * (1 + policy.value / 100)))
        else:
            proposals.append(int(start * (1 - policy.value / 100)))  # truncated, as int32()
    largest_change, smallest_change = (max, min) if up else (min, max)
    return smallest_change(proposals) if rules.select_policy == "min" else largest_change(proposals)


def record_event(
    events: Sequence[ScaleEvent], change: int, rules: ScalingRules, now: float
) -> tuple[ScaleEvent, ...]:
    """``events`` with a change of ``change`` replicas at ``now``; older than any period dropped."""
    horizon = now - rules.longest_period_s
    kept = tuple(event for event in events if event.at > horizon)
    return (*kept, ScaleEvent(now, change))
