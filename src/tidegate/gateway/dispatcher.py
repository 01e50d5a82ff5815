"""One model's dispatcher: it owns the WaitQueue and hands requests to replicas.

Everything runs on the event loop thread, so the queue needs no lock: handlers call
``submit`` / ``cancel`` / ``release`` directly, and each of them dispatches at once. The
``run`` task covers what no handler triggers: deadlines and aging (one timer at the earlier
of the queue's next deadline and the moment a queued request ages into a level a free slot
serves, ``next_eligible_at``) and replicas that became ready (``wake``). No polling.

Dispatch rule (core): pop the most urgent request that the levels some ready replica with a
free slot serves (``servable_levels``) can take, at its own level or one it has aged to,
then route it with ``pick_replica``: to a pool of its own level, else (aged) to one of a
level it has reached. A replica holds only ``slots`` requests; the backlog waits here,
where priority and aging apply.

Replicas ejected by passive failure detection (``record_answer``, core.outliers) are left
out while others serve their levels (``routable_views``); the timer also wakes the task
when one returns.

Fair sharing (``tenancy.fair_sharing``): the queue picks inside a level by tenant (core.fairness);
a pick charges the request's token estimate, and ``settle`` replaces it with the answer's
``usage`` once a non-streamed answer is complete (a stream keeps its estimate). Each dispatch
tells the queue the ready replicas' slots (``set_slots``; of them, the slot reserve's are
kept for a tenant under its share), and a pick holds a slot of its tenant's share until
``release`` (``WaitQueue.vacate``). A release that does not name its
request (``request=None``) frees the slot of the oldest request dispatched to that replica
that is still there: exact with one slot per replica, a guess by dispatch order otherwise.
With preemption (``tenancy.preemption``, tidegate's own generation workers), when no slot is
free and a tenant under its slot share waits while another is over its own
(``WaitQueue.preempt``), its request goes past the slots to the replica holding the most of
that tenant's requests, naming it (``Ticket.preempt``, sent as ``X-Tidegate-Preempt``): the
worker pauses one of them for it. The paused request still holds its slot here until it
ends, so the replica's in-flight exceeds its slots until it does.

No ready replica: a request is still admitted and waits (bounded by its level's queue
timeout, 504 after) while one is coming (starting, warming, being restarted, or cold-started
on demand); when none is coming it gets 503 with a Retry-After of the model's measured
start-up time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from tidegate.clock import SYSTEM_CLOCK, Clock
from tidegate.core.outliers import OutlierAction, OutlierConfig, decide_outlier, routable_views
from tidegate.core.prefix import PrefixAffinity
from tidegate.core.queue import QueueConfig, Rejected, WaitQueue
from tidegate.core.request import Request
from tidegate.core.routing import PoolSpec, ReplicaView, pick_replica, servable_levels, serves
from tidegate.errors import InvalidRequest, NotReady, Overloaded, QueueTimeout
from tidegate.gateway.replicas import Replica, ReplicaState
from tidegate.metrics import GatewayMetrics

log = logging.getLogger("tidegate.gateway")
# Retry-After with no replica ready and none coming, before any start-up was measured: about
# the interval of the upstreams' health checks, which would see one come back.
NO_REPLICA_RETRY_AFTER_S = 2.0


@dataclass(eq=False)
class Ticket:
    """One admitted request's claim on a replica slot."""

    request: Request
    assigned: asyncio.Future[Replica] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    assigned_at: float | None = None
    prefix_key: int | None = None  # prefix-affinity routing: the prompt's leading blocks
    preempt: str | None = None  # fair sharing's preemption: the tenant it pauses one of
    avoided: frozenset[str] = frozenset()  # a retry: the replicas that failed it so far


class ModelDispatcher:
    def __init__(
        self,
        model: str,
        queue: QueueConfig,
        pools: dict[str, PoolSpec],
        replicas: Sequence[Replica],
        metrics: GatewayMetrics,
        clock: Clock = SYSTEM_CLOCK,
        on_release: Callable[[], None] | None = None,
        outliers: OutlierConfig | None = None,
        affinity: PrefixAffinity | None = None,
    ) -> None:
        self.model = model
        self.affinity = affinity  # prefix-affinity routing (core.prefix); None: least loaded
        self.outliers = outliers or OutlierConfig()  # when a failing replica is ejected
        self.on_release = on_release  # tells a draining gateway that work finished
        self.queue = WaitQueue(queue)
        self._fair = self.queue.fair is not None
        self._preemptive = self._fair and queue.fairness is not None and queue.fairness.preemption
        self.num_preemptions = 0  # requests sent past the slots to pause another tenant's
        self.num_arrived = 0  # requests submitted while open (a counter)
        # Fair sharing: per replica id, the tenants of the requests dispatched there and not
        # yet released, oldest first (whose slot an unnamed release frees).
        self._holders: dict[str, deque[str]] = {}
        self.pools = pools
        self.replicas = replicas  # live: the orchestrator adds and changes them
        self.metrics = metrics
        self.clock = clock
        self.level_names = [spec.name for spec in queue.levels]
        self._tickets: dict[str, Ticket] = {}
        # A retried request's replica that just failed it: its next pick goes elsewhere
        # when another replica has a free slot (Envoy's "previous hosts" retry predicate).
        self._avoid: dict[str, frozenset[str]] = {}
        self._wake = asyncio.Event()
        self._timer_at: float | None = None  # the deadline or aging the owner task sleeps until
        self._choices = itertools.count()
        self.closed: str | None = None  # why new requests are refused, once shutting down
        self._unservable: frozenset[int] = frozenset()  # levels no pool of it ever takes
        self._served_names = ""
        # Set by the controller for an autoscaled model: with no replica ready, requests
        # wait in the queue (with their deadlines) while one cold-starts, and on_demand
        # tells the controller there is demand (scale from zero) at once.
        self.on_demand: Callable[[], None] | None = None

    def refuse_unservable(self, served: frozenset[int]) -> None:
        """Refuse at once the levels that no pool in ``served`` takes, even after aging.

        Why: such a request could only wait until its queue timeout or its client gave up
        (`tidegate config check` warns about the config); a 400 that names the levels
        served tells the client what to ask for instead.
        """
        self._unservable = frozenset(self.queue.unreachable_levels(served))
        self._served_names = ", ".join(self.level_names[level] for level in sorted(served))

    # ----------------------------------------------------------------- handlers' side
    def saturation(self) -> float:
        """How full the queue is (0..1): what graded holdback compares with."""
        return len(self.queue) / self.queue.config.max_size

    def submit(self, request: Request, prefix_key: int | None = None) -> Ticket:
        """Admit and queue, or raise Overloaded (429) / NotReady (503). ``prefix_key``: the
        prompt's prefix key, for a model routed by prefix affinity (``affinity``)."""
        if self.closed is not None:
            raise NotReady(self.closed, code="shutting_down", retry_after_s=1.0)
        self.num_arrived += 1  # offered load, refused or not: the autoscaler's arrival rate
        if request.priority in self._unservable:
            raise InvalidRequest(
                f"{self.model}: no pool serves priority {self.level_names[request.priority]}, "
                f"even after aging; it serves: {self._served_names or 'none'}",
                param="priority",
                code="priority_not_served",
            )
        if not any(replica.ready for replica in self.replicas) and not self._coming():
            # Why not queue: nothing is ready and nothing is on its way, so no wait can be
            # promised; the client learns it now, and when a start would be done.
            raise NotReady(
                f"{self.model}: no ready replica, and none starting",
                code="no_ready_replica",
                retry_after_s=self.startup_estimate_s(),
            )
        now = self.clock.now()
        decision = self.queue.admit(request, now, self.saturation())
        if isinstance(decision, Rejected):
            raise Overloaded(
                f"{self.model}: {decision.message}",
                code=decision.reason.value,
                retry_after_s=decision.retry_after_s or 1.0,
            )
        for victim in decision.shed:
            self._fail(
                victim,
                Overloaded(
                    f"{self.model}: shed from a full queue for a more urgent request",
                    code="shed",
                    retry_after_s=self.queue.predicted_wait_s(victim.priority, now) or 1.0,
                ),
            )
        ticket = Ticket(request, prefix_key=prefix_key)
        self._tickets[request.id] = ticket
        self._dispatch(now)
        if (
            decision.deadline_at is not None
            and request.id in self.queue
            and (self._timer_at is None or decision.deadline_at < self._timer_at)
        ):
            self._wake.set()  # an earlier deadline than the armed timer: re-arm it
        return ticket

    def _coming(self) -> bool:
        """Whether a request may wait for a replica that is (about to be) starting.

        One is starting, warming or restarting (a crashed worker comes back by itself:
        the wait is bounded by the level's queue timeout), or the controller cold-starts
        one on demand (told at once).
        """
        if self.on_demand is not None:
            self.on_demand()
            return True
        return any(replica.coming for replica in self.replicas)

    def startup_estimate_s(self) -> float:
        """How long a start of this model's replicas takes: the longest measured, else a
        default (no replica measured yet, or upstreams, which tidegate does not start)."""
        measured = [r.startup_s for r in self.replicas if r.startup_s is not None]
        return max(measured) if measured else NO_REPLICA_RETRY_AFTER_S

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: drop it from the queue, or give back its slot."""
        if self.queue.cancel(ticket.request.id) is not None:
            del self._tickets[ticket.request.id]
            self._avoid.pop(ticket.request.id, None)
            self._notify()
            return
        assigned = ticket.assigned
        if assigned.done() and not assigned.cancelled() and assigned.exception() is None:
            self.release(assigned.result(), completed=False, request=ticket.request)

    def release(
        self, replica: Replica, *, completed: bool = True, request: Request | None = None
    ) -> None:
        """A dispatched request (``request``, when the caller names it) finished or failed:
        its slot is free again."""
        replica.in_flight -= 1
        if request is not None:
            replica.tokens = max(0, replica.tokens - request.cost_tokens)
        if completed:
            self.queue.drain.record(self.clock.now())
        fair = self.queue.fair
        if fair is not None:
            tenant = self._unhold(replica, request)
            if tenant is not None:
                fair.vacate(tenant)
        self._dispatch(self.clock.now())
        self._notify()

    def _unhold(self, replica: Replica, request: Request | None) -> str | None:
        """Fair sharing: the tenant whose slot on ``replica`` a release frees (the module
        docstring); None when none is recorded there."""
        holders = self._holders.get(replica.id)
        if not holders:
            return None
        if request is None or request.tenant == holders[0]:
            return holders.popleft()
        try:
            holders.remove(request.tenant)
        except ValueError:
            return holders.popleft()
        return request.tenant

    def settle(self, request: Request, body: bytes | None) -> None:
        """A completed answer's ``usage`` (prompt and completion tokens) settles its tenant's
        fair-share counter in place of the estimate charged at its pick. No-op without fair
        sharing, or when the answer has no usage to read."""
        if self.queue.fair is None or body is None:
            return
        usage = _usage(body)
        if usage is not None:
            self.queue.settle(request, *usage)

    def describe_tenants(self) -> dict[str, object]:
        """Fair sharing's state: per tenant its virtual token counter, queued and share;
        the slots and, of them, the reserve's."""
        fair = self.queue.fair
        return {
            "fair_sharing": fair is not None,
            "slots": 0 if fair is None else fair.slots,
            "reserve_slots": 0 if fair is None else fair.reserve,
            "preemption": self._preemptive,
            "preemptions": self.num_preemptions,
            "tenants": self.queue.tenants(),
        }

    def _notify(self) -> None:
        if self.on_release is not None:
            self.on_release()

    def record_answer(self, replica: Replica, *, ok: bool) -> None:
        """What ``replica`` answered a forwarded request: ``ok`` (below 500) or not (5xx, no
        connection, cut short). Consecutive failures eject it from routing for a while."""
        now = self.clock.now()
        live = [r for r in self.replicas if r.state is not ReplicaState.STOPPED]
        state, action = decide_outlier(
            replica.outlier,
            failed=not ok,
            now=now,
            num_ejected=sum(r.outlier.ejected(now) for r in live if r is not replica),
            num_replicas=len(live),
            config=self.outliers,
        )
        replica.outlier = state
        if action is OutlierAction.EJECT:
            assert state.ejected_until is not None
            self.metrics.ejections.labels(self.model, replica.id).inc()
            log.warning(
                "replica %s ejected for %.0fs after %d failed answers in a row (ejection %d)",
                replica.id,
                state.ejected_until - now,
                self.outliers.consecutive_failures,
                state.num_ejections,
            )
            self._wake.set()  # re-arm the owner task's timer for its return
        elif action is OutlierAction.RETURN:
            log.info("replica %s answered well after its ejection: back in rotation", replica.id)

    def retry(self, ticket: Ticket, failed: Replica) -> Ticket:
        """Put a request whose replica failed before any byte back in front of its level.

        Its next pick avoids ``failed`` (and the replicas that failed it before) while
        another ready replica serves its level: it waits for a free slot there rather than go
        back to one that just failed it (a replica whose node went refuses every connection
        until it is replaced, and a node takes all its replicas with it).
        """
        failed.in_flight -= 1
        failed.tokens = max(0, failed.tokens - ticket.request.cost_tokens)
        if self._fair:
            self._unhold(failed, ticket.request)  # requeue gives its tenant's slot back
        request = dataclasses.replace(ticket.request, attempt=ticket.request.attempt + 1)
        self.queue.requeue(request, self.clock.now())
        again = Ticket(request, prefix_key=ticket.prefix_key, avoided=ticket.avoided | {failed.id})
        self._tickets[request.id] = again
        self._avoid[request.id] = again.avoided
        self._dispatch(self.clock.now())
        return again

    def wake(self) -> None:
        self._wake.set()

    # ----------------------------------------------------------------- the owner task
    async def run(self) -> None:
        while True:
            now = self.clock.now()
            for request in self.queue.expire(now):
                self._fail(
                    request,
                    QueueTimeout(
                        f"{self.model}: waited in the queue past its deadline "
                        f"({now - request.arrival_at:.1f}s)"
                    ),
                )
            levels = self._dispatch(now)
            self._wake.clear()
            wake_at = self._timer_at = _earliest(
                self.queue.next_deadline_at(),
                self.queue.next_eligible_at(levels) if levels and len(self.queue) else None,
                self._next_return_at(now) if len(self.queue) else None,
            )
            timeout = None if wake_at is None else max(0.0, wake_at - now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _dispatch(self, now: float) -> frozenset[int]:
        """Dispatch what free slots can take; returns the levels still servable then."""
        if not len(self.queue):
            return frozenset()  # nothing waits (a release with an empty queue): no views
        ejected = frozenset(r.id for r in self.replicas if r.outlier.ejected(now))
        views = {
            view.id: view
            for view in routable_views((r.view() for r in self.replicas), ejected, self.pools)
        }
        by_id = {replica.id: replica for replica in self.replicas}
        if self._fair:  # fair sharing's slot shares are of the slots ready now
            self.queue.set_slots(sum(view.slots for view in views.values() if view.ready))
        levels: frozenset[int] = frozenset()
        while len(self.queue):
            levels = servable_levels(views.values(), self.pools)
            popped = self.queue.pop(1, now, levels=levels) if levels else ()
            if not popped:
                if self._preemptive:
                    self._preempt(now, views, by_id)
                self._wake_for_aging(levels)
                return levels
            (request,) = popped
            # Its aged level matters only where its own level has no free slot (core.routing).
            aged = None if request.priority in levels else self.queue.aged_level(request, now)
            avoid = self._avoid.pop(request.id, None)
            ticket = self._tickets.pop(request.id)
            view = None
            if avoid is not None:  # a retry: another replica if one has a free slot
                others = [v for v in views.values() if v.id not in avoid]
                view = self._pick(others, request, aged, ticket.prefix_key)
                if view is None and self._served_by(others, request.priority, aged):
                    # They are full: wait for one, first in its level as it was.
                    self.queue.requeue(request, now)
                    self._avoid[request.id] = avoid
                    self._tickets[request.id] = ticket
                    return levels
            if view is None:
                view = self._pick(views.values(), request, aged, ticket.prefix_key)
            assert view is not None  # a servable level has an eligible replica
            self._assign(ticket, by_id[view.id], views, now)
        return levels

    def _preempt(
        self, now: float, views: dict[str, ReplicaView], by_id: dict[str, Replica]
    ) -> None:
        """No slot free for the queue: send the requests that may preempt (module docstring)
        to the replicas holding the most of their victims' requests."""
        while True:
            taken = self.queue.preempt(now)
            if taken is None:
                return
            request, victim = taken
            best: ReplicaView | None = None
            most = 0
            for view in views.values():
                held = self._holders.get(view.id)
                if not held or not self._served_by((view,), request.priority, None):
                    continue
                count = held.count(victim)
                if count > most:
                    best, most = view, count
            if best is None:  # none of its replicas serves this level: it waits
                self.queue.requeue(request, now)
                return
            self.num_preemptions += 1
            ticket = self._tickets.pop(request.id)
            self._avoid.pop(request.id, None)
            ticket.preempt = victim
            self._assign(ticket, by_id[best.id], views, now)

    def _assign(
        self, ticket: Ticket, replica: Replica, views: dict[str, ReplicaView], now: float
    ) -> None:
        """``ticket`` goes to ``replica``: it holds a slot there (and, with fair sharing,
        its tenant is one of the replica's holders) and its handler goes on."""
        replica.in_flight += 1
        replica.tokens += ticket.request.cost_tokens
        if self._fair:
            self._holders.setdefault(replica.id, deque()).append(ticket.request.tenant)
        views[replica.id] = replica.view()
        ticket.assigned_at = now
        ticket.assigned.set_result(replica)

    def _served_by(self, views: Iterable[ReplicaView], priority: int, aged: int | None) -> bool:
        """Whether a ready replica among ``views`` serves ``priority`` (free slot or not)."""
        return any(
            view.ready and view.pool in self.pools and serves(self.pools[view.pool], priority, aged)
            for view in views
        )

    def _pick(
        self,
        views: Collection[ReplicaView],
        request: Request,
        aged: int | None,
        prefix_key: int | None,
    ) -> ReplicaView | None:
        return pick_replica(
            views,
            request.priority,
            self.pools,
            aged_level=aged,
            choice_key=next(self._choices),
            prefix_key=prefix_key,
            affinity=self.affinity,
            tokens=request.cost_tokens,
        )

    def _wake_for_aging(self, levels: frozenset[int]) -> None:
        """Re-arm the owner task's timer when a queued request ages into ``levels`` sooner.

        Why here: a free slot in a pool that serves only some levels (a release, a new
        replica) or a new head of a level changes when the next request becomes eligible.
        """
        if not levels:
            return
        eligible_at = self.queue.next_eligible_at(levels)
        if eligible_at is not None and (self._timer_at is None or eligible_at < self._timer_at):
            self._wake.set()

    def _next_return_at(self, now: float) -> float | None:
        """When the next ejected replica gets traffic again (None: none is ejected)."""
        return _earliest(
            *(r.outlier.ejected_until for r in self.replicas if r.outlier.ejected(now))
        )

    def fail_all(self, error: Exception) -> int:
        """Answer everything still queued with ``error`` (shutdown). Returns how many."""
        requests = self.queue.pop(len(self.queue) or 1, self.clock.now())
        for request in requests:
            self._fail(request, error)
        return len(requests)

    def _fail(self, request: Request, error: Exception) -> None:
        """The waiting handler gets ``error``: it answers and counts the outcome."""
        ticket = self._tickets.pop(request.id, None)
        self._avoid.pop(request.id, None)
        if ticket is not None and not ticket.assigned.done():
            ticket.assigned.set_exception(error)
        self._notify()

    # ----------------------------------------------------------------- views
    def num_in_flight(self) -> int:
        return sum(replica.in_flight for replica in self.replicas)

    def refresh_gauges(self) -> None:
        for name, depth in zip(self.level_names, self.queue.depths(), strict=True):
            self.metrics.queue_depth.labels(self.model, name).set(depth)
        ready = 0
        states: dict[tuple[str, str], int] = {}
        for replica in self.replicas:
            self.metrics.inflight.labels(self.model, replica.id).set(replica.in_flight)
            ejected = replica.outlier.ejected(self.clock.now())
            self.metrics.ejected.labels(self.model, replica.id).set(ejected)
            ready += replica.ready
            key = (replica.pool, replica.state.value)
            states[key] = states.get(key, 0) + 1
        for (pool, state), count in states.items():
            self.metrics.replicas.labels(self.model, pool, state).set(count)
        demand = len(self.queue) + self.num_in_flight()
        self.metrics.queue_depth_per_replica.labels(self.model).set(demand / max(1, ready))

    def describe_replica(self, replica: Replica) -> dict[str, object]:
        """A replica for /admin/replicas: its state, start-up time and outlier record."""
        return {
            **replica.describe(),
            "startup_s": None if replica.startup_s is None else round(replica.startup_s, 3),
            "outlier": replica.outlier.describe(self.clock.now()),
        }


_USAGE_KEY = b'"usage"'
_DECODER = json.JSONDecoder()


def _usage(body: bytes) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) of an OpenAI answer's ``usage``, read from its last
    ``"usage"`` key only (an embeddings answer's vectors are not parsed); None when absent."""
    at = body.rfind(_USAGE_KEY)
    if at < 0:
        return None
    text = body[at + len(_USAGE_KEY) :].decode("utf-8", "replace").lstrip()
    if not text.startswith(":"):
        return None
    try:
        usage, _ = _DECODER.raw_decode(text[1:].lstrip())
    except ValueError:
        return None
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens", 0)
    if type(prompt) is int and type(completion) is int and prompt >= 0 and completion >= 0:
        return prompt, completion  # not bool, a subclass of int
    return None


def _earliest(*times: float | None) -> float | None:
    known = [at for at in times if at is not None]
    return min(known) if known else None
