"""WaitQueue: the per-model queue of admitted requests, by priority level, with aging.

Design note. One FIFO per level. Within a level the oldest request is always the most aged,
so the most urgent request overall is the best of the level heads: a pick costs O(levels)
and the queue is never sorted. Effective priority is
``max(0, level - rate_per_s * max(0, wait_s - threshold_s))``; ties go to the earlier arrival.
A pick restricted to the levels some pools serve takes a request when one of them lies
between its aged level (the most urgent whole level it has reached) and its own: a medium
request aged to high may run in a high-only pool. Since aging only moves towards the top,
the head of a FIFO is also the first of it to become eligible, so this too is decided on
the heads alone, and ``next_eligible_at`` (a timer for the caller) is O(levels) as well.
Eligibility is decided by comparing ``now`` with ``reaches_level_at``, the same float the
timer is set to, so a timer never fires a moment before the pick it is for would succeed.
Removal from the middle (cancel, shed, expire) is lazy: the entry is marked dead and dropped
when it reaches either end of its FIFO, and the FIFOs are compacted when dead entries
outnumber live ones, so every operation is O(1) amortised (deadlines: O(log n)).

Fair sharing inside a level (``QueueConfig.fairness``, core.fairness): each level also keeps
one FIFO per tenant (the same entries), and a pick composes aging with virtual token counters
(VTC) thus: aging decides the level, exactly as above (the level heads' keys, eligibility by
``reaches_level_at``); VTC then decides the tenant within it: the backlogged tenant of that
level with the least counter gives its oldest request (ties: the earlier head). Two
exceptions keep aging's promise, both decided on the level head, which is also its oldest
request: when the head is eligible only by aging (a pick for more urgent pools), or when its
level won over a more urgent level's head by aging, the head itself is taken: an aged request
is always taken once past its level, never replaced by a fresh one of another tenant. With
one tenant in the level, the level keeps no per-tenant FIFOs and the pick is the FIFO's; the
counters hear of a tenant's backlog only when one of its levels fills or empties (``arrive``
and ``leave`` count levels, not requests), so a steady single-tenant admission or pick costs
no call into them but the pick's charge. A pick charges the tenant its request's estimate;
``settle`` corrects that with the tokens served. With fair sharing, admission sheds by
tenant too (``admit``).

Slot shares (fair sharing, ``set_slots``): a pick also gives its tenant a slot, until the
caller says the request ended (``vacate``) or puts it back (``requeue``). Inside the level,
while a tenant under its slot share (core.fairness: slots x share / active shares, at least
1) waits, the tenants over theirs are passed over, and the least counter of the others
goes; when none is under, the counters alone decide, so a pick never returns nothing while
the level waits (work-conserving). The aged head keeps its exception above: aging's bound
on the wait comes first.

The slot reserve (``FairnessConfig.reserve_fraction``, core.fairness): while only the
reserve's slots are free, a tenant at or over its slot share gets none (``may_take``), at any
level, sole tenant or not. A pick then tries the eligible level heads in effective-priority
order and takes the first that a tenant under its share may have; none: it returns nothing
(the caller waits for a slot to free or a request to arrive). An aged head is still taken
whatever its tenant, so a pick that returns nothing leaves no head eligible by aging.

Invariants:
- every admitted request leaves exactly once: popped, shed, expired or cancelled;
- ``len(queue) <= max_size`` and ``depth(level) <= level.max_size`` after every admission
  (a retried request put back with ``requeue`` may exceed them: it had already been admitted);
- callers admit requests in arrival order (the gateway stamps ``arrival_at`` on receipt), so
  each FIFO is ordered by arrival;
- the queue decides, the caller acts: nothing here reads a clock or performs I/O.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Final

from tidegate.core.fairness import FairnessConfig, VirtualTokenCounters
from tidegate.core.request import Request, RequestState

# Final: a compiled build reads these as constants, not from the module's dict per use
_STATES: Final = tuple(RequestState)
_STATE_INDEX: Final = {state: index for index, state in enumerate(_STATES)}
_QUEUED: Final = _STATE_INDEX[RequestState.QUEUED]
_DISPATCHED: Final = _STATE_INDEX[RequestState.DISPATCHED]

# Compact a FIFO once it holds this many more dead entries than live ones.
_COMPACT_SLACK: Final = 64


@dataclass(frozen=True, slots=True)
class AgingConfig:
    threshold_s: float = 30.0  # wait before a request starts to gain priority
    rate_per_s: float = 0.5  # levels gained per second of wait beyond the threshold


@dataclass(frozen=True, slots=True)
class LevelSpec:
    name: str
    max_size: int | None = None  # bound on this level's depth; None: only the total bounds it
    timeout_s: float | None = None  # queue timeout: expired when still queued this long
    holdback_above: float | None = None  # saturation (0..1) above which arrivals are refused


DEFAULT_LEVELS: tuple[LevelSpec, ...] = (
    LevelSpec("high"),
    LevelSpec("medium", holdback_above=0.9),
    LevelSpec("low", holdback_above=0.7),
)


@dataclass(frozen=True, slots=True)
class QueueConfig:
    levels: tuple[LevelSpec, ...] = DEFAULT_LEVELS
    max_size: int = 1000  # bound on the total depth
    aging: AgingConfig = AgingConfig()
    drain_window_s: float = 30.0  # completions older than this do not inform the drain rate
    min_drain_samples: int = 5  # fewer completions than this in the window: no prediction
    fairness: FairnessConfig | None = None  # None: first come, first served inside a level

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("queue needs at least one priority level")
        if self.max_size < 1:
            raise ValueError(f"queue max_size must be >= 1, got {self.max_size}")
        names = [spec.name for spec in self.levels]
        if len(set(names)) != len(names):
            raise ValueError(f"priority level names must be unique, got {names}")

    def level_of(self, name: str) -> int:
        """The level index of a priority name; ValueError names the valid ones."""
        for index, spec in enumerate(self.levels):
            if spec.name == name:
                return index
        valid = ", ".join(spec.name for spec in self.levels)
        raise ValueError(f"unknown priority {name!r}; expected one of: {valid}")


@dataclass(frozen=True, slots=True, init=False)
class Admitted:
    request: Request
    deadline_at: float | None  # the earlier of the request's own deadline and its level timeout
    shed: tuple[Request, ...] = ()  # evicted to make room: each ends as SHED

    # written out for a compiled build, as Request's __init__ (core/request.py)
    def __init__(
        self, request: Request, deadline_at: float | None, shed: tuple[Request, ...] = ()
    ) -> None:
        object.__setattr__(self, "request", request)
        object.__setattr__(self, "deadline_at", deadline_at)
        object.__setattr__(self, "shed", shed)


@dataclass(frozen=True, slots=True, init=False)
class Rejected:
    request: Request
    reason: RequestState  # REJECTED_FULL, REJECTED_DEADLINE or REJECTED_HOLDBACK
    retry_after_s: float | None  # predicted time until the work ahead has drained, if known
    message: str

    # written out for a compiled build, as Request's __init__ (core/request.py)
    def __init__(
        self, request: Request, reason: RequestState, retry_after_s: float | None, message: str
    ) -> None:
        object.__setattr__(self, "request", request)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "retry_after_s", retry_after_s)
        object.__setattr__(self, "message", message)


Admission = Admitted | Rejected


def effective_priority(level: int, arrival_at: float, now: float, aging: AgingConfig) -> float:
    """The level a request competes at after aging; never below the top level (0)."""
    waited_beyond_s = max(0.0, now - arrival_at - aging.threshold_s)
    return max(0.0, level - aging.rate_per_s * waited_beyond_s)


def reaches_level_at(
    level: int, target: int, arrival_at: float, aging: AgingConfig
) -> float | None:
    """When a request of ``level`` arrived at ``arrival_at`` has aged to ``target``.

    At arrival for ``target >= level``; None when aging never gets it there (aging disabled,
    or a target more urgent than the top level).
    """
    if target >= level:
        return arrival_at
    if target < 0 or aging.rate_per_s <= 0:
        return None
    return arrival_at + aging.threshold_s + (level - target) / aging.rate_per_s


def aged_level(level: int, arrival_at: float, now: float, aging: AgingConfig) -> int:
    """The most urgent whole level a request has reached by aging (0 <= result <= level).

    ``effective_priority`` rounded up, but decided by ``reaches_level_at`` so that it agrees
    with the queue's eligibility to the last bit: the estimate is corrected by a step or two.
    """
    if level == 0 or aging.rate_per_s <= 0:
        return level
    gained = (now - arrival_at - aging.threshold_s) * aging.rate_per_s
    reached = level if not gained >= 1.0 else max(0, level - int(min(gained, level)))
    while reached > 0 and now >= _reached_at(level, reached - 1, arrival_at, aging):
        reached -= 1
    while reached < level and now < _reached_at(level, reached, arrival_at, aging):
        reached += 1
    return reached


def unreachable_levels(
    served: Iterable[int], num_levels: int, aging: AgingConfig
) -> tuple[int, ...]:
    """Levels whose requests no level of ``served`` can ever take, however long they wait.

    A request runs at its own level or, aged, at any more urgent one down to the top; so a
    level is reachable when it is served, or when aging is on and some more urgent level is.
    """
    served_set = set(served)
    unreachable = []
    most_urgent_served: int | None = None
    for level in range(num_levels):
        if level in served_set:
            if most_urgent_served is None:
                most_urgent_served = level
            continue
        if most_urgent_served is None or aging.rate_per_s <= 0:
            unreachable.append(level)
    return tuple(unreachable)


def _reached_at(level: int, target: int, arrival_at: float, aging: AgingConfig) -> float:
    at = reaches_level_at(level, target, arrival_at, aging)
    return float("inf") if at is None else at


class DrainRate:
    """Requests drained per second over a sliding window, fed by the caller with completions."""

    __slots__ = ("_events", "_first_at", "_min_samples", "_total", "_window_s")

    def __init__(self, window_s: float, min_samples: int) -> None:
        self._window_s = window_s
        self._min_samples = min_samples
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0
        self._first_at: float | None = None

    def record(self, now: float, count: int = 1) -> None:
        if self._first_at is None:
            self._first_at = now
        self._events.append((now, count))
        self._total += count

    def rate_per_s(self, now: float) -> float | None:
        """None while there is too little evidence to predict anything."""
        horizon = now - self._window_s
        while self._events and self._events[0][0] < horizon:
            self._total -= self._events.popleft()[1]
        if self._first_at is None or self._total < self._min_samples:
            return None
        # Before a full window has passed, divide by the time actually observed.
        span_s = min(self._window_s, now - self._first_at)
        return self._total / span_s if span_s > 0 else None


class _Entry:
    __slots__ = ("alive", "deadline_at", "request", "seq")

    def __init__(self, request: Request, deadline_at: float | None, seq: int) -> None:
        self.request = request
        self.deadline_at = deadline_at
        self.seq = seq
        self.alive = True


class WaitQueue:
    """Admitted requests of one model, waiting for a replica. See the module docstring."""

    def __init__(self, config: QueueConfig | None = None) -> None:
        self.config = config or QueueConfig()
        num_levels = len(self.config.levels)
        self._fifos: list[deque[_Entry]] = [deque() for _ in range(num_levels)]
        self._depths = [0] * num_levels
        self._live: dict[str, _Entry] = {}
        self._deadlines: list[tuple[float, int, _Entry]] = []  # heap, lazy deletion
        self._num_tokens = 0
        self._seq = 0
        # Counts per level and state (indices of _STATES): a list, since hashing an Enum
        # member on every admission and pick is a measurable share of the simulator's time.
        self._tally: list[list[int]] = [[0] * len(_STATES) for _ in range(num_levels)]
        self.drain = DrainRate(self.config.drain_window_s, self.config.min_drain_samples)
        fairness = self.config.fairness
        self.fair = None if fairness is None else VirtualTokenCounters(fairness)
        # Fair sharing only: per level, tenant -> its FIFO (front always alive) and live depth,
        # kept once a second tenant joined the level until it is empty again; None while one
        # tenant (``_sole``) holds it all: its FIFO is the level's (the single-tenant path).
        self._tenant_fifos: list[dict[str, deque[_Entry]] | None] = [None] * num_levels
        self._tenant_depths: list[dict[str, int] | None] = [None] * num_levels
        self._sole = [""] * num_levels

    # ----------------------------------------------------------------- views
    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    @property
    def num_levels(self) -> int:
        return len(self._fifos)

    @property
    def num_tokens(self) -> int:
        """Sum of the cost estimates of everything queued."""
        return self._num_tokens

    def depth(self, level: int) -> int:
        return self._depths[level]

    def depths(self) -> tuple[int, ...]:
        return tuple(self._depths)

    def outcome_counts(self) -> dict[tuple[int, RequestState], int]:
        """How many requests of each level this queue sent to each state, since creation."""
        return {
            (level, _STATES[index]): count
            for level, counts in enumerate(self._tally)
            for index, count in enumerate(counts)
            if count
        }

    def tenants(self) -> dict[str, dict[str, float | int]]:
        """Per tenant: its virtual token counter, queued requests and slots; {} without
        fairness."""
        if self.fair is None:
            return {}
        described = self.fair.describe()
        queued: dict[str, int] = {}
        for level in range(len(self._fifos)):
            for tenant, depth in self.tenant_depths(level).items():
                queued[tenant] = queued.get(tenant, 0) + depth
        for tenant, state in described.items():
            state["queued"] = queued.get(tenant, 0)  # the counters count levels, not requests
        return described

    def tenant_depths(self, level: int) -> dict[str, int]:
        """Queued requests per tenant at ``level`` ({} without fairness)."""
        if self.fair is None:
            return {}
        depths = self._tenant_depths[level]
        if depths is None:
            return {self._sole[level]: self._depths[level]} if self._depths[level] else {}
        return dict(depths)

    def oldest_arrival_at(self) -> float | None:
        fronts = [self._front(level) for level in range(len(self._fifos))]
        arrivals = [entry.request.arrival_at for entry in fronts if entry is not None]
        return min(arrivals) if arrivals else None

    def next_deadline_at(self) -> float | None:
        """When ``expire`` will next have something to return: a timer for the caller."""
        while self._deadlines and not self._deadlines[0][2].alive:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def next_eligible_at(self, levels: Iterable[int] | None = None) -> float | None:
        """The earliest time a queued request of a level not in ``levels`` has aged into one.

        A timer for the caller, whose free slots serve ``levels``: after a pick restricted to
        them found nothing, it lies in the future. None when no queued request outside
        ``levels`` ever reaches one of them (or ``levels`` is None: every level is served).
        Requests at a served level do not count: they are eligible from their arrival.
        """
        if levels is None:
            return None
        served = _as_set(levels)
        aging = self.config.aging
        target = -1  # the least urgent served level at or above the current one
        earliest: float | None = None
        for level in range(len(self._fifos)):
            if level in served:
                target = level
                continue
            if target < 0:
                continue
            head = self._front(level)
            if head is None:
                continue
            at = reaches_level_at(level, target, head.request.arrival_at, aging)
            if at is not None and (earliest is None or at < earliest):
                earliest = at
        return earliest

    def aged_level(self, request: Request, now: float) -> int:
        """The most urgent whole level ``request`` has reached by aging: what routing uses."""
        return aged_level(request.priority, request.arrival_at, now, self.config.aging)

    def unreachable_levels(self, served: Iterable[int]) -> tuple[int, ...]:
        """Levels no level of ``served`` can ever take under this queue's aging."""
        return unreachable_levels(served, len(self._fifos), self.config.aging)

    def predicted_wait_s(self, level: int, now: float) -> float | None:
        """Time to drain what would be picked before a new arrival at ``level``.

        Counts requests at the same or a more urgent level (aging of less urgent ones is
        ignored); None when the drain rate is not yet known.
        """
        ahead = sum(self._depths[: level + 1])
        if ahead == 0:
            return 0.0
        rate = self.drain.rate_per_s(now)
        return ahead / rate if rate else None

    # ------------------------------------------------------------- admission
    def admit(self, request: Request, now: float, saturation: float = 0.0) -> Admission:
        """Decide whether ``request`` may wait here; on success it is queued.

        Checks, in order: graded holdback, a deadline the predicted wait already misses,
        then capacity (shedding the newest request of the least urgent level present when
        the arrival is more urgent). With fair sharing, where holdback, a full level or a
        full queue would refuse it, the tenant holding the most of its level gives up its
        newest request instead, when it holds at least two more than the arrival's tenant.
        """
        level = self._check_level(request)
        if request.id in self._live:
            raise ValueError(f"request {request.id} is already queued")
        spec = self.config.levels[level]
        deadline_at = _earliest(request.deadline_at, spec.timeout_s, request.arrival_at)

        # Fair sharing: a tenant holding more of this level than the arrival's tenant gives up
        # its newest place instead of the arrival being refused (``_heavier_tenant``).
        held = spec.holdback_above is not None and saturation > spec.holdback_above
        level_full = spec.max_size is not None and self._depths[level] >= spec.max_size
        full = held or level_full or len(self._live) >= self.config.max_size
        heavier = None if self.fair is None or not full else self._heavier_tenant(request)
        if held and heavier is None:
            return self._reject(
                request,
                RequestState.REJECTED_HOLDBACK,
                self.predicted_wait_s(level, now),
                f"priority {spec.name} is held back at saturation {saturation:.2f} "
                f"(limit {spec.holdback_above:.2f})",
            )
        if deadline_at is not None:  # the prediction costs a drain-rate update: only if used
            wait_s = self.predicted_wait_s(level, now)
            if wait_s is not None and now + wait_s > deadline_at:
                return self._reject(
                    request,
                    RequestState.REJECTED_DEADLINE,
                    wait_s,
                    f"predicted queue wait {wait_s:.1f}s exceeds the deadline "
                    f"({max(0.0, deadline_at - now):.1f}s away)",
                )
        if level_full and heavier is None:
            return self._reject(
                request,
                RequestState.REJECTED_FULL,
                self.predicted_wait_s(level, now),
                f"queue for priority {spec.name} is full ({spec.max_size})",
            )
        shed: tuple[Request, ...] = ()
        if heavier is not None and (held or level_full):
            shed = (self._evict_newest_of(level, heavier),)
        elif len(self._live) >= self.config.max_size:
            victim = self._evict_newest_below(level)
            if victim is None and heavier is not None:
                victim = self._evict_newest_of(level, heavier)
            if victim is None:
                return self._reject(
                    request,
                    RequestState.REJECTED_FULL,
                    self.predicted_wait_s(level, now),
                    f"queue is full ({self.config.max_size}) with nothing less urgent to shed",
                )
            shed = (victim,)
        self._insert(request, deadline_at)
        counts = self._tally[level]
        counts[_QUEUED] = counts[_QUEUED] + 1  # (+=: a generic add, compiled)
        return Admitted(request, deadline_at, shed)

    def requeue(self, request: Request, now: float) -> None:
        """Put back a dispatched request whose replica failed before it started.

        It goes back to its place by arrival, near the front of its level, and skips
        admission: it was admitted once, and refusing it now would lose it.
        """
        level = self._check_level(request)
        if request.id in self._live:
            raise ValueError(f"request {request.id} is already queued")
        spec = self.config.levels[level]
        deadline_at = _earliest(request.deadline_at, spec.timeout_s, request.arrival_at)
        fair = self.fair
        if fair is not None:  # not served after all: its pick's charge is refunded
            fair.charge(request.tenant, -fair.estimate(request.cost_tokens))
        self._insert(request, deadline_at)
        if fair is not None:  # and its slot given back, once it is in the backlog again
            fair.vacate(request.tenant)
        counts = self._tally[level]
        counts[_QUEUED] = counts[_QUEUED] + 1  # (+=: a generic add, compiled)

    def set_slots(self, slots: int) -> None:
        """Fair sharing's slot bound: the model's in-flight slots now (its ready replicas'
        slots together); 0: none (the counters alone order tenants). No-op without fairness."""
        if self.fair is not None:
            self.fair.slots = slots

    def vacate(self, request: Request) -> None:
        """``request``, picked before, gave its slot back (it ended, or failed): its tenant
        holds one slot less (no-op without fairness). ``requeue`` does this itself."""
        if self.fair is not None:
            self.fair.vacate(request.tenant)

    def settle(self, request: Request, input_tokens: int, output_tokens: int) -> None:
        """``request`` completed having been served these tokens: its tenant's counter is
        corrected from the estimate charged at its pick (no-op without fairness)."""
        if self.fair is not None:
            self.fair.settle(request.tenant, request.cost_tokens, input_tokens, output_tokens)

    # ------------------------------------------------------------- removal
    def peek(
        self,
        n: int,
        now: float,
        max_tokens: int | None = None,
        levels: Iterable[int] | None = None,
    ) -> tuple[Request, ...]:
        """The requests ``pop`` would return, without removing them."""
        return tuple(entry.request for entry in self._select(n, now, max_tokens, levels))

    def pop(
        self,
        n: int,
        now: float,
        max_tokens: int | None = None,
        levels: Iterable[int] | None = None,
    ) -> tuple[Request, ...]:
        """Remove up to ``n`` requests in effective-priority order.

        ``max_tokens`` bounds the sum of their cost estimates; the first request is taken
        even when it alone is over the budget, or it could never be served. ``levels``
        restricts the pick to requests that the levels some pools serve can take: at their
        own level, or at one they have aged to (module docstring). Stops at the first
        request that does not fit, so a cheap request never overtakes a more urgent one.
        """
        chosen = self._select(n, now, max_tokens, levels)
        fair = self.fair
        for entry in chosen:
            if fair is not None:  # charged and holding a slot before it leaves the backlog
                fair.picked(entry.request.tenant, entry.request.cost_tokens)
            self._remove(entry)  # (fair sharing: the tenant leaves the backlog there)
            counts = self._tally[entry.request.priority]
            counts[_DISPATCHED] = counts[_DISPATCHED] + 1  # (+=: a generic add, compiled)
        # Picked entries were at the fronts of their FIFOs: drop them now, so dead entries
        # never pile up where every later pick would have to step over them.
        if len(chosen) == 1:  # the dispatcher's pick: no set of levels to build
            self._front(chosen[0].request.priority)
        else:
            for level in {entry.request.priority for entry in chosen}:
                self._front(level)
        return tuple(entry.request for entry in chosen)

    def preempt(
        self, now: float, levels: Iterable[int] | None = None
    ) -> tuple[Request, str] | None:
        """Fair sharing with preemption, no slot free (core.fairness ``victim``): remove and
        return the request that may take a slot by pausing one of another tenant's, with
        that tenant; None when none may. The most urgent level (of ``levels``, at its own
        level: aging does not preempt) where a tenant under its slot share waits, its
        least-served such tenant's oldest request; charged and holding a slot, as ``pop``."""
        fair = self.fair
        if fair is None or not fair.config.preemption or not len(self._live):
            return None
        served = None if levels is None else _as_set(levels)
        counter = fair.counter
        for level in range(len(self._fifos)):
            if not self._depths[level] or (served is not None and level not in served):
                continue
            fifos = self._tenant_fifos[level]
            heads = (
                {self._sole[level]: self._front(level)}
                if fifos is None
                else {tenant: tenant_fifo[0] for tenant, tenant_fifo in fifos.items()}
            )
            best: tuple[float, float, int] | None = None
            choice: tuple[_Entry, str] | None = None
            for tenant, head in heads.items():
                if head is None:
                    continue
                victim = fair.victim(tenant)
                if victim is None:
                    continue
                key = (counter(tenant), head.request.arrival_at, head.seq)
                if best is None or key < best:
                    best, choice = key, (head, victim)
            if choice is not None:
                entry, victim = choice
                self._take(entry)
                return entry.request, victim
        return None

    def take(self, request_id: str) -> Request | None:
        """Remove a queued request as a pick of it alone (charged and holding a slot with
        fair sharing, counted dispatched); None when it is not queued. For a worker that
        gives a request the slot a preemption freed (core.fairness), whatever the order."""
        entry = self._live.get(request_id)
        if entry is None:
            return None
        self._take(entry)
        return entry.request

    def _take(self, entry: _Entry) -> None:
        if self.fair is not None:
            self.fair.picked(entry.request.tenant, entry.request.cost_tokens)
        self._remove(entry)
        level = entry.request.priority
        counts = self._tally[level]
        counts[_DISPATCHED] = counts[_DISPATCHED] + 1  # (+=: a generic add, compiled)
        self._front(level)

    def cancel(self, request_id: str) -> Request | None:
        """Remove a queued request in O(1); None when it is not queued (any more)."""
        entry = self._live.get(request_id)
        if entry is None:
            return None
        self._remove(entry)
        self._count(entry.request.priority, RequestState.CANCELLED)
        return entry.request

    def expire(self, now: float) -> tuple[Request, ...]:
        """Remove and return every queued request whose deadline is at or before ``now``."""
        expired: list[Request] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            entry = heapq.heappop(self._deadlines)[2]
            if entry.alive:
                self._remove(entry)
                self._count(entry.request.priority, RequestState.EXPIRED)
                expired.append(entry.request)
        return tuple(expired)

    # ------------------------------------------------------------- internals
    def _check_level(self, request: Request) -> int:
        if request.priority >= len(self._fifos):
            raise ValueError(
                f"request {request.id}: priority level {request.priority} out of range "
                f"0..{len(self._fifos) - 1}"
            )
        return request.priority

    def _reject(
        self, request: Request, reason: RequestState, retry_after_s: float | None, message: str
    ) -> Rejected:
        self._count(request.priority, reason)
        return Rejected(request, reason, retry_after_s, message)

    def _count(self, level: int, state: RequestState) -> None:
        counts = self._tally[level]
        index = _STATE_INDEX[state]
        counts[index] = counts[index] + 1  # (+=: a generic add, compiled)

    def _insert(self, request: Request, deadline_at: float | None) -> None:
        entry = _Entry(request, deadline_at, self._seq)
        self._seq += 1
        level = request.priority
        fifo = self._fifos[level]
        if not fifo or fifo[-1].request.arrival_at <= request.arrival_at:
            fifo.append(entry)  # the common case: a new arrival
        else:
            # A retried request: after every entry that arrived no later, so the FIFO stays
            # ordered by arrival. Only requeue gets here; it scans the few older entries.
            position = next(
                index
                for index, queued in enumerate(fifo)
                if queued.request.arrival_at > request.arrival_at
            )
            fifo.insert(position, entry)
        if self.fair is not None and not (  # the sole tenant's next request: nothing to tell
            self._tenant_fifos[level] is None
            and self._depths[level]
            and request.tenant == self._sole[level]
        ):
            self._insert_tenant(entry)
        self._live[request.id] = entry
        depths = self._depths
        depths[level] = depths[level] + 1  # (+=: a generic add, compiled)
        self._num_tokens += request.cost_tokens
        if deadline_at is not None:
            heapq.heappush(self._deadlines, (deadline_at, entry.seq, entry))

    def _insert_tenant(self, entry: _Entry) -> None:
        """Called with ``entry`` already in its level FIFO, before the depth counts it. The
        counters hear of it only when its tenant had nothing queued at its level."""
        request = entry.request
        tenant = request.tenant
        level = request.priority
        fair = self.fair
        assert fair is not None
        fifos = self._tenant_fifos[level]
        if fifos is None:
            if not self._depths[level]:
                self._sole[level] = tenant
                fair.arrive(tenant)
            elif tenant != self._sole[level]:
                self._split(level)  # counts ``entry``, already in the level FIFO
                fair.arrive(tenant)
            return  # (the sole tenant's next request: nothing to tell)
        depths = self._tenant_depths[level]
        assert depths is not None
        depth = depths.get(tenant, 0)
        if not depth:
            fair.arrive(tenant)
        depths[tenant] = depth + 1
        fifo = fifos.get(tenant)
        if fifo is None:
            fifos[tenant] = deque((entry,))
        elif fifo[-1].request.arrival_at <= request.arrival_at:
            fifo.append(entry)
        else:  # a retried request, as in _insert
            position = next(
                index
                for index, queued in enumerate(fifo)
                if queued.request.arrival_at > request.arrival_at
            )
            fifo.insert(position, entry)

    def _split(self, level: int) -> None:
        """A second tenant joined ``level``: one FIFO per tenant from the level's, O(depth)
        once; kept until the level is empty, so tenants coming and going do not repeat it."""
        fifos: dict[str, deque[_Entry]] = {}
        depths: dict[str, int] = {}
        for entry in self._fifos[level]:
            if entry.alive:
                tenant = entry.request.tenant
                fifo = fifos.get(tenant)
                if fifo is None:
                    fifos[tenant] = deque((entry,))
                    depths[tenant] = 1
                else:
                    fifo.append(entry)
                    depths[tenant] += 1
        self._tenant_fifos[level] = fifos
        self._tenant_depths[level] = depths

    def _remove_tenant(self, entry: _Entry) -> None:
        """Keeps each tenant FIFO's front alive, so a pick reads it without a scan."""
        tenant = entry.request.tenant
        level = entry.request.priority
        assert self.fair is not None
        fifos = self._tenant_fifos[level]
        assert fifos is not None
        depths = self._tenant_depths[level]
        assert depths is not None
        left = depths[tenant] - 1
        if left:
            depths[tenant] = left
            fifo = fifos[tenant]
            while not fifo[0].alive:
                fifo.popleft()
            if len(fifo) > 2 * left + _COMPACT_SLACK:
                fifos[tenant] = deque(e for e in fifo if e.alive)
        else:
            del depths[tenant]
            del fifos[tenant]
            self.fair.leave(tenant)  # its last request at this level
            if not depths:  # the level is empty: back to the single-tenant path
                self._tenant_fifos[level] = self._tenant_depths[level] = None

    def _remove(self, entry: _Entry) -> None:
        entry.alive = False
        del self._live[entry.request.id]
        level = entry.request.priority
        if self.fair is not None:
            if self._tenant_fifos[level] is None:  # one tenant in the level: no FIFO of its own
                if self._depths[level] == 1:  # its last request here
                    self.fair.leave(entry.request.tenant)
            else:
                self._remove_tenant(entry)
        depths = self._depths
        depths[level] = depths[level] - 1  # (-=: a generic subtract, compiled)
        self._num_tokens -= entry.request.cost_tokens
        fifo = self._fifos[level]
        if len(fifo) > 2 * self._depths[level] + _COMPACT_SLACK:
            self._fifos[level] = deque(e for e in fifo if e.alive)
        if len(self._deadlines) > 2 * len(self._live) + _COMPACT_SLACK:
            self._deadlines = [item for item in self._deadlines if item[2].alive]
            heapq.heapify(self._deadlines)

    def _evict_newest_below(self, level: int) -> Request | None:
        """Shed the newest request of the least urgent level that is less urgent than ``level``."""
        for victim_level in range(len(self._fifos) - 1, level, -1):
            if self._depths[victim_level] == 0:
                continue
            fifo = self._fifos[victim_level]
            while not fifo[-1].alive:
                fifo.pop()
            entry = fifo.pop()
            self._remove(entry)
            self._count(victim_level, RequestState.SHED)
            return entry.request
        return None

    def _heavier_tenant(self, request: Request) -> str | None:
        """Fair sharing: the tenant holding the most of ``request``'s level, when it holds
        at least two more than ``request``'s tenant (so a shed never just swaps places).

        Why: without it a flooding tenant fills the queue (or its level, or the room that
        holdback leaves) and every other tenant of its level is refused at the door, which
        no pick order can undo.
        """
        level = request.priority
        depths = self._tenant_depths[level]
        if depths is None:  # one tenant holds the level
            sole = self._sole[level]
            return sole if sole != request.tenant and self._depths[level] > 1 else None
        if not depths:
            return None
        heaviest = max(depths, key=depths.__getitem__)
        if depths[heaviest] <= depths.get(request.tenant, 0) + 1:
            return None
        return heaviest

    def _evict_newest_of(self, level: int, tenant: str) -> Request:
        """Shed ``tenant``'s newest request at ``level`` (it has one)."""
        fifos = self._tenant_fifos[level]
        fifo = self._fifos[level] if fifos is None else fifos[tenant]
        while not fifo[-1].alive:
            fifo.pop()
        entry = fifo[-1]
        self._remove(entry)
        self._count(level, RequestState.SHED)
        return entry.request

    def _front(self, level: int) -> _Entry | None:
        """The oldest live entry of ``level``, dropping dead entries ahead of it."""
        fifo = self._fifos[level]
        while fifo:  # (one test and one read of the front per step: compiled, generic calls)
            entry = fifo[0]
            if entry.alive:
                return entry
            fifo.popleft()
        return None

    def _select(
        self, n: int, now: float, max_tokens: int | None, levels: Iterable[int] | None
    ) -> list[_Entry]:
        """Merge the level FIFOs by (effective priority, arrival, seq), stopping early.

        Each candidate is (key, level, entry, cursor); keys are unique (seq), so ``min``
        never compares past the key. A level leaves the merge at its first entry that is not
        eligible: those behind it arrived later, so they have aged less.
        """
        if n == 1:
            return self._select_one(now, levels)
        fair = self.fair
        if fair is not None and (
            fair.in_reserve(n - 1)  # the batch's last pick would find only the reserve free
            or (
                any(fifos is not None and len(fifos) > 1 for fifos in self._tenant_fifos)
                and not (n >= len(self._live) and max_tokens is None and levels is None)
            )
        ):
            return self._select_fair(n, now, max_tokens, levels)
        if levels is None:
            in_order = self._select_unaged(n, now, max_tokens)
            if in_order is not None:
                return in_order
        # None: every level served, so every entry is eligible at its own level (no check)
        targets = None if levels is None else self._targets(levels)
        heads: list[tuple[tuple[float, float, int], int, _Entry, Iterator[_Entry]]] = []
        for level in range(len(self._fifos)):
            target = level if targets is None else targets[level]
            if target < 0:
                continue
            head = self._front(level)
            if head is None or (targets is not None and not self._eligible(head, target, now)):
                continue
            cursor = iter(self._fifos[level])
            for _ in cursor:  # the head itself (next(): a builtin looked up per call, compiled)
                break
            heads.append(self._candidate(head, cursor, now))
        chosen: list[_Entry] = []
        tokens = 0
        while heads and len(chosen) < n:
            index = _smallest_key(heads)  # what min(heads) is (keys are unique), by position
            best = heads[index]
            entry = best[2]
            cost = entry.request.cost_tokens
            if max_tokens is not None and chosen and tokens + cost > max_tokens:
                break
            chosen.append(entry)
            tokens += cost
            following = _next_alive(best[3])
            if following is None or (
                targets is not None and not self._eligible(following, targets[best[1]], now)
            ):
                del heads[index]
            else:
                heads[index] = self._candidate(following, best[3], now)
        return chosen

    def _select_unaged(self, n: int, now: float, max_tokens: int | None) -> list[_Entry] | None:
        """``_select`` with every level served, while no level head has waited past the aging
        threshold (None otherwise): every queued request's effective priority is then its
        own level, so the merge's order is the level FIFOs one after the other (each in
        (arrival, seq) order already), and it is taken so, without a key per request."""
        aging = self.config.aging
        threshold_s = aging.threshold_s
        for level in range(len(self._fifos)):
            head = self._front(level)
            if head is None:
                continue
            arrival_at = head.request.arrival_at
            # the head waited longest in its level: if it has not aged, none behind it has
            if now - arrival_at - threshold_s > 0.0 or effective_priority(
                level, arrival_at, now, aging
            ) != float(level):
                return None
        chosen: list[_Entry] = []
        tokens = 0
        for fifo in self._fifos:
            for entry in fifo:
                if len(chosen) >= n:
                    return chosen
                if not entry.alive:
                    continue
                cost = entry.request.cost_tokens
                if max_tokens is not None and chosen and tokens + cost > max_tokens:
                    return chosen  # stops at the first that does not fit, as the merge
                chosen.append(entry)
                tokens += cost
        return chosen

    def _select_one(self, now: float, levels: Iterable[int] | None) -> list[_Entry]:
        """``_select`` for one pick (the dispatcher's case): the best eligible level head."""
        aging = self.config.aging
        served = None if levels is None else _as_set(levels)
        best: _Entry | None = None
        # the best head's key (effective priority, arrival, seq), compared field by field:
        # compiled, a key tuple per head and the tuples' comparison are generic calls
        best_priority = best_arrival = 0.0
        best_seq = 0
        best_aged = False  # the head won by aging: it is taken, whatever its tenant
        target = -1  # the least urgent served level at or above the current one
        for level in range(len(self._fifos)):
            if served is None or level in served:
                target = level
            elif target < 0:
                continue  # nothing served at or above it: aging cannot get it anywhere
            head = self._front(level)
            if head is None:
                continue
            request = head.request
            arrival = request.arrival_at
            if target != level:
                # Why: it runs only once aged to ``target``; time decides, not the float key.
                at = reaches_level_at(level, target, arrival, aging)
                if at is None or now < at:
                    continue
            priority = effective_priority(request.priority, arrival, now, aging)
            seq = head.seq
            if (
                best is None
                or priority < best_priority
                or (
                    priority == best_priority
                    and (arrival < best_arrival or (arrival == best_arrival and seq < best_seq))
                )
            ):
                best_aged = target != level or best is not None
                best, best_priority, best_arrival, best_seq = head, priority, arrival, seq
        if best is None:
            return []
        fair = self.fair
        if fair is not None and not best_aged:
            fifos = self._tenant_fifos[best.request.priority]
            if fifos is not None and len(fifos) > 1:
                chosen = self._least_served_head(fifos, frozenset(), {}, {}, 0)
                if chosen is not None:
                    return [chosen]
            elif fair.may_take(best.request.tenant):
                return [best]
            # Why: the reserve holds the free slots and this level's tenants are at or over
            # their shares; a less urgent level may have a tenant under its share.
            picked = self._pick_fair(now, served, frozenset(), {}, {}, 0)
            return [] if picked is None else [picked]
        return [best]

    def _least_served_head(
        self,
        fifos: dict[str, deque[_Entry]],
        taken: frozenset[int] | set[int],
        extra: dict[str, float],
        extra_held: dict[str, int],
        extra_total: int,
    ) -> _Entry | None:
        """The oldest request of the level's least-served tenant (ties: the earlier head),
        passing over the tenants over their slot share while one under its share waits;
        while only the reserve is free, over those at their share too (None: all are).

        ``taken`` (seqs), ``extra`` (counter increments), ``extra_held`` (slots per tenant)
        and ``extra_total`` (slots) are a batch pick's own choices so far: ``_select_fair``.
        """
        fair = self.fair
        assert fair is not None
        counter = fair.counter
        standing = fair.slot_standing
        reserved = fair.in_reserve(extra_total)
        best: _Entry | None = None  # of all
        best_key: tuple[float, float, int] | None = None
        within: _Entry | None = None  # of those not over their slot share
        within_key: tuple[float, float, int] | None = None
        any_under = False
        for tenant, fifo in fifos.items():
            head = fifo[0] if not taken else _first_untaken(fifo, taken)
            if head is None:
                continue
            held = standing(tenant, extra_held.get(tenant, 0))
            if reserved and held >= 0:
                continue  # only a tenant under its share may have a reserved slot
            key = (counter(tenant) + extra.get(tenant, 0.0), head.request.arrival_at, head.seq)
            if best_key is None or key < best_key:
                best, best_key = head, key
            if held <= 0 and (within_key is None or key < within_key):
                within, within_key = head, key
            any_under = any_under or held < 0
        return within if any_under and within is not None else best

    def _select_fair(
        self, n: int, now: float, max_tokens: int | None, levels: Iterable[int] | None
    ) -> list[_Entry]:
        """``_select`` with fair sharing and several tenants: ``n`` single picks in a row,
        each as ``_select_one`` would make it after the ones before (O(n * depth scanned))."""
        fair = self.fair
        assert fair is not None
        served = None if levels is None else _as_set(levels)
        taken: set[int] = set()
        extra: dict[str, float] = {}
        extra_held: dict[str, int] = {}
        chosen: list[_Entry] = []
        tokens = 0
        while len(chosen) < n:
            best = self._pick_fair(now, served, taken, extra, extra_held, len(chosen))
            if best is None:
                break
            cost = best.request.cost_tokens
            if max_tokens is not None and chosen and tokens + cost > max_tokens:
                break
            chosen.append(best)
            taken.add(best.seq)
            tokens += cost
            tenant = best.request.tenant
            extra[tenant] = extra.get(tenant, 0.0) + fair.scaled(tenant, fair.estimate(cost))
            extra_held[tenant] = extra_held.get(tenant, 0) + 1
        return chosen

    def _pick_fair(
        self,
        now: float,
        served: set[int] | frozenset[int] | None,
        taken: set[int] | frozenset[int],
        extra: dict[str, float],
        extra_held: dict[str, int],
        extra_total: int,
    ) -> _Entry | None:
        """One pick as ``_select_one`` makes it, after a batch's own choices (``taken``,
        ``extra``, ``extra_held``, ``extra_total``: ``_least_served_head``), trying the
        eligible level heads in key order until one may take a slot (the slot reserve)."""
        fair = self.fair
        assert fair is not None
        aging = self.config.aging
        heads: list[tuple[tuple[float, float, int], int, _Entry, bool]] = []
        target = -1
        for level in range(len(self._fifos)):
            if served is None or level in served:
                target = level
            elif target < 0:
                continue
            head = _first_untaken(self._fifos[level], taken)
            if head is None:
                continue
            request = head.request
            if target != level:
                at = reaches_level_at(level, target, request.arrival_at, aging)
                if at is None or now < at:
                    continue
            key = (
                effective_priority(request.priority, request.arrival_at, now, aging),
                request.arrival_at,
                head.seq,
            )
            heads.append((key, level, head, target != level))
        for key, level, head, aged in sorted(heads, key=lambda item: item[0]):
            # Aged: eligible only by aging, or ahead of a more urgent level's head by it.
            if aged or any(other[0] > key for other in heads if other[1] < level):
                return head
            fifos = self._tenant_fifos[level]
            if fifos is not None and len(fifos) > 1:
                chosen = self._least_served_head(fifos, taken, extra, extra_held, extra_total)
                if chosen is not None:
                    return chosen
            elif fair.may_take(
                head.request.tenant, extra_held.get(head.request.tenant, 0), extra_total
            ):
                return head
        return None

    def _targets(self, levels: Iterable[int] | None) -> list[int]:
        """Per level, the least urgent served level at or above it in urgency; -1 for none."""
        if levels is None:
            return list(range(len(self._fifos)))
        served = _as_set(levels)
        targets = []
        target = -1
        for level in range(len(self._fifos)):
            if level in served:
                target = level
            targets.append(target)
        return targets

    def _eligible(self, entry: _Entry, target: int, now: float) -> bool:
        request = entry.request
        if target == request.priority:
            return True
        at = reaches_level_at(request.priority, target, request.arrival_at, self.config.aging)
        return at is not None and now >= at

    def _candidate(
        self, entry: _Entry, cursor: Iterator[_Entry], now: float
    ) -> tuple[tuple[float, float, int], int, _Entry, Iterator[_Entry]]:
        request = entry.request
        effective = effective_priority(request.priority, request.arrival_at, now, self.config.aging)
        return ((effective, request.arrival_at, entry.seq), request.priority, entry, cursor)


def _as_set(levels: Iterable[int]) -> set[int] | frozenset[int]:
    # a tuple of types, not ``set | frozenset``: compiled, that union is built per call
    return levels if isinstance(levels, (set, frozenset)) else set(levels)


def _first_untaken(fifo: deque[_Entry], taken: set[int] | frozenset[int]) -> _Entry | None:
    for entry in fifo:
        if entry.alive and entry.seq not in taken:
            return entry
    return None


def _smallest_key(
    heads: list[tuple[tuple[float, float, int], int, _Entry, Iterator[_Entry]]],
) -> int:
    """The position of the head with the smallest key: ``min`` and ``index`` in one scan
    that compares keys only (a compiled build boxes each whole candidate for those two)."""
    index = 0
    best_priority, best_arrival, best_seq = heads[0][0]
    for position in range(1, len(heads)):
        priority, arrival, seq = heads[position][0]
        # the tuples' order, spelled out: compiled, these are float and int comparisons
        if priority < best_priority or (
            priority == best_priority
            and (arrival < best_arrival or (arrival == best_arrival and seq < best_seq))
        ):
            index, best_priority, best_arrival, best_seq = position, priority, arrival, seq
    return index


def _next_alive(cursor: Iterator[_Entry]) -> _Entry | None:
    for entry in cursor:
        if entry.alive:
            return entry
    return None


def _earliest(deadline_at: float | None, timeout_s: float | None, start_at: float) -> float | None:
    """The earlier of an absolute deadline and ``start_at + timeout_s``; None if neither."""
    if timeout_s is None:
        return deadline_at
    level_deadline_at = start_at + timeout_s
    return level_deadline_at if deadline_at is None else min(deadline_at, level_deadline_at)
