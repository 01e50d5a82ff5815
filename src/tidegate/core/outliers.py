"""decide_outlier: passive failure detection, as Envoy's consecutive-5xx outlier detection.

Design note. A health check sees only ``/health``; a replica that answers it 200 while it
answers every request 500 stays in rotation. So every answer of a replica is also a vote:
``consecutive_failures`` failures in a row (a 5xx, no connection, an answer cut short) eject
it for ``base_ejection_s`` times the number of times it has been ejected, capped at
``max_ejection_s``. When that time has passed it gets traffic again, half-open: its next
answer decides, a success puts it back for good, a failure ejects it again (for longer).
The multiplier falls back to zero once it has answered well for ``max_ejection_s`` after
its return. An ejection that would leave more than ``max_ejection_percent`` of a model's
replicas ejected is not made: a model is never ejected empty by a failing backend of its
own (with one replica and the default 50%, nothing is ever ejected).

Routing prefers replicas that are not ejected (``routable_views``): an ejected replica is
out of rotation while every level its pool serves has a ready replica that is not ejected.
When it is the last hope of a level (every ready replica there is ejected), it stays in
rotation: a suspect replica is better than none (Envoy's panic routing).

Answers that arrive while a replica is ejected (sent before the ejection) change nothing.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tidegate.core.routing import PoolSpec, ReplicaView


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    consecutive_failures: int = 5  # failed answers in a row that eject a replica
    base_ejection_s: float = 30.0  # the n-th ejection lasts n times this ...
    max_ejection_s: float = 300.0  # ... at most this
    max_ejection_percent: float = 50.0  # of a model's replicas ejected at once, at most

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1:
            raise ValueError("consecutive_failures must be >= 1")
        if not 0 < self.base_ejection_s <= self.max_ejection_s:
            raise ValueError("need 0 < base_ejection_s <= max_ejection_s")
        if not 0 <= self.max_ejection_percent <= 100:
            raise ValueError("max_ejection_percent must be within 0..100")


@dataclass(frozen=True, slots=True)
class OutlierState:
    consecutive_failures: int = 0  # failed answers since the last good one
    num_ejections: int = 0  # the multiplier of the next ejection's length, minus one
    ejected_until: float | None = None  # monotonic s; set until its first answer after it
    returned_at: float | None = None  # when it answered well after its last ejection

    def ejected(self, now: float) -> bool:
        """Out of rotation at ``now``."""
        return self.ejected_until is not None and now < self.ejected_until

    def half_open(self, now: float) -> bool:
        """Back in rotation after an ejection, its next answer not yet known."""
        return self.ejected_until is not None and now >= self.ejected_until

    def describe(self, now: float) -> dict[str, object]:
        return {
            "ejected": self.ejected(now),
            "ejected_for_s": (
                round(self.ejected_until - now, 3)
                if self.ejected_until is not None and self.ejected(now)
                else 0.0
            ),
            "half_open": self.half_open(now),
            "consecutive_failures": self.consecutive_failures,
            "ejections": self.num_ejections,
        }


class OutlierAction(enum.Enum):
    NONE = "none"  # counted, nothing else
    EJECT = "eject"  # out of rotation until ``ejected_until``
    REFUSED = "refused"  # would eject, but max_ejection_percent forbids it
    RETURN = "return"  # half-open and it answered well: in rotation for good


def ejection_s(num_ejections: int, config: OutlierConfig) -> float:
    """How long the ``num_ejections``-th ejection (1-based) lasts."""
    return min(config.base_ejection_s * max(1, num_ejections), config.max_ejection_s)


def may_eject(num_ejected: int, num_replicas: int, config: OutlierConfig) -> bool:
    """Whether one more ejection keeps at most ``max_ejection_percent`` of replicas out.

    ``num_ejected`` counts the model's other replicas ejected now.
    """
    return 100 * (num_ejected + 1) <= config.max_ejection_percent * num_replicas


def decide_outlier(
    state: OutlierState,
    *,
    failed: bool,
    now: float,
    num_ejected: int,
    num_replicas: int,
    config: OutlierConfig,
) -> tuple[OutlierState, OutlierAction]:
    """A replica answered (``failed``: 5xx, no connection or cut short): its new state."""
    if state.ejected(now):
        return state, OutlierAction.NONE  # sent before the ejection: already judged
    if state.half_open(now):
        if not failed:
            return (
                OutlierState(num_ejections=state.num_ejections, returned_at=now),
                OutlierAction.RETURN,
            )
        # Why at once, not after N more: the trial answer of a half-open replica failed.
        return _eject(state, now, num_ejected, num_replicas, config)
    if not failed:
        if state.returned_at is not None and now - state.returned_at >= config.max_ejection_s:
            return OutlierState(), OutlierAction.NONE  # good long enough: forget its past
        if state.consecutive_failures == 0:
            return state, OutlierAction.NONE  # the common case: nothing to forget
        return dataclasses.replace(state, consecutive_failures=0), OutlierAction.NONE
    counted = dataclasses.replace(state, consecutive_failures=state.consecutive_failures + 1)
    if counted.consecutive_failures < config.consecutive_failures:
        return counted, OutlierAction.NONE
    return _eject(counted, now, num_ejected, num_replicas, config)


def _eject(
    state: OutlierState, now: float, num_ejected: int, num_replicas: int, config: OutlierConfig
) -> tuple[OutlierState, OutlierAction]:
    if not may_eject(num_ejected, num_replicas, config):
        # Kept in rotation; the count stays at the threshold so that the next failure
        # tries again (another replica may have come back meanwhile).
        kept = dataclasses.replace(
            state,
            consecutive_failures=max(state.consecutive_failures, config.consecutive_failures),
            ejected_until=None,
        )
        return kept, OutlierAction.REFUSED
    times = state.num_ejections + 1
    ejected = OutlierState(
        consecutive_failures=0,
        num_ejections=times,
        ejected_until=now + ejection_s(times, config),
        returned_at=None,
    )
    return ejected, OutlierAction.EJECT


def routable_views(
    views: Iterable[ReplicaView], ejected: frozenset[str], pools: Mapping[str, PoolSpec]
) -> list[ReplicaView]:
    """``views`` with the ejected replicas marked not ready, unless one is the last hope of
    a level its pool serves (no ready replica that is not ejected serves that level)."""
    views = list(views)
    if not ejected:
        return views
    covered: set[int] = set()  # levels a ready, not ejected replica serves
    for view in views:
        if view.ready and view.id not in ejected and view.pool in pools:
            covered |= pools[view.pool].priorities
    routable = []
    for view in views:
        if view.id in ejected and view.ready:
            served = pools[view.pool].priorities if view.pool in pools else frozenset()
            if served <= covered:
                view = dataclasses.replace(view, ready=False)
        routable.append(view)
    return routable
