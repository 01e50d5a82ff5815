"""Requests and their lifecycle.

A :class:`Request` is an immutable value: what the scheduler knows about one call when it
arrives. Its :class:`RequestState` moves only along the edges of ``_TRANSITIONS``; every
accepted request ends in exactly one terminal state, and a terminal state never changes.
``advance`` is the single place that checks an edge, so a bug in a shell that tries to
complete a request twice fails loudly instead of being counted twice.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestState(enum.Enum):
    """Where a request is. Terminal states are listed in ``TERMINAL_STATES``."""

    NEW = "new"  # received, admission not yet decided
    QUEUED = "queued"  # admitted, waiting in a WaitQueue
    DISPATCHED = "dispatched"  # handed to a replica, running
    # Terminal outcomes.
    COMPLETED = "completed"
    SHED = "shed"  # admitted, then evicted by a more urgent arrival
    REJECTED_FULL = "rejected_full"  # queue (or its level) full, nothing less urgent to evict
    REJECTED_DEADLINE = "rejected_deadline"  # predicted wait already beyond its deadline
    REJECTED_HOLDBACK = "rejected_holdback"  # its level is held back at this saturation
    EXPIRED = "expired"  # still queued when its deadline passed
    CANCELLED = "cancelled"  # the client went away
    FAILED = "failed"  # the replica failed it

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES: frozenset[RequestState] = frozenset(
    {
        RequestState.COMPLETED,
        RequestState.SHED,
        RequestState.REJECTED_FULL,
        RequestState.REJECTED_DEADLINE,
        RequestState.REJECTED_HOLDBACK,
        RequestState.EXPIRED,
        RequestState.CANCELLED,
        RequestState.FAILED,
    }
)

_S = RequestState
_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    _S.NEW: frozenset(
        {_S.QUEUED, _S.REJECTED_FULL, _S.REJECTED_DEADLINE, _S.REJECTED_HOLDBACK, _S.CANCELLED}
    ),
    _S.QUEUED: frozenset({_S.DISPATCHED, _S.SHED, _S.EXPIRED, _S.CANCELLED, _S.FAILED}),
    # DISPATCHED -> QUEUED: a replica crashed before the first byte; the request is retried.
    _S.DISPATCHED: frozenset({_S.COMPLETED, _S.FAILED, _S.CANCELLED, _S.QUEUED}),
    **{terminal: frozenset() for terminal in TERMINAL_STATES},
}


class IllegalTransition(ValueError):
    """A shell tried to move a request along an edge that does not exist (a bug)."""


def advance(current: RequestState, target: RequestState) -> RequestState:
    """Return ``target`` if ``current -> target`` is a legal edge, else raise."""
    if target not in _TRANSITIONS[current]:
        raise IllegalTransition(f"request cannot go from {current.value} to {target.value}")
    return target


@dataclass(frozen=True, slots=True, init=False)
class Request:
    """What the scheduler knows about one call.

    ``priority`` is a level index: 0 is the most urgent. Times are monotonic seconds.
    """

    id: str
    model: str
    priority: int
    arrival_at: float
    deadline_at: float | None = None  # the caller's own deadline; the level's timeout also applies
    cost_tokens: int = 1  # estimated prompt + output tokens, for token budgets
    attempt: int = field(default=0, compare=False)  # 1 on the retry after a replica crash
    tenant: str = ""  # who it is for (fair sharing inside a level); "": the anonymous tenant

    # Written out (``init=False``), as for the core's other per-request objects: a compiled
    # build (tidegate.native) runs it natively, where the dataclass-made one stays interpreted
    # (~15x slower per object there). Same fields, order and defaults as declared above.
    def __init__(
        self,
        id: str,
        model: str,
        priority: int,
        arrival_at: float,
        deadline_at: float | None = None,
        cost_tokens: int = 1,
        attempt: int = 0,
        tenant: str = "",
    ) -> None:
        if priority < 0:
            raise ValueError(f"request {id}: priority must be >= 0, got {priority}")
        if cost_tokens < 0:
            raise ValueError(f"request {id}: cost_tokens must be >= 0")
        # object.__setattr__ spelled out each time: mypyc compiles that to a plain store
        # (a name bound to it stays a generic call, ~18x slower)
        object.__setattr__(self, "id", id)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "priority", priority)
        object.__setattr__(self, "arrival_at", arrival_at)
        object.__setattr__(self, "deadline_at", deadline_at)
        object.__setattr__(self, "cost_tokens", cost_tokens)
        object.__setattr__(self, "attempt", attempt)
        object.__setattr__(self, "tenant", tenant)
