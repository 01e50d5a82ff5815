"""One model's dispatcher: it owns the WaitQueue and hands requests to replicas.

Everything runs on the event loop thread, so the queue needs no lock: handlers call
``submit`` / ``cancel`` / ``release`` directly, and each of them dispatches at once. The
``run`` task covers what no handler triggers: deadlines (a timer at the queue's next
deadline) and replicas that became ready (``wake``). No polling.

Dispatch rule (core): pop the most urgent request among the levels that some ready replica
with a free slot serves (``servable_levels``), then route it with ``pick_replica``. A replica
holds only ``slots`` requests; the backlog waits here, where priority and aging apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tidegate.clock import SYSTEM_CLOCK, Clock
from tidegate.core.queue import QueueConfig, Rejected, WaitQueue
from tidegate.core.request import Request
from tidegate.core.routing import PoolSpec, pick_replica, servable_levels
from tidegate.errors import NotReady, Overloaded, QueueTimeout
from tidegate.gateway.replicas import Replica
from tidegate.metrics import GatewayMetrics

log = logging.getLogger("tidegate.gateway")
NO_REPLICA_RETRY_AFTER_S = 2.0  # about the time a crashed worker takes to come back


@dataclass(eq=False)
class Ticket:
    """One admitted request's claim on a replica slot."""

    request: Request
    assigned: asyncio.Future[Replica] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    assigned_at: float | None = None


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
    ) -> None:
        self.model = model
        self.on_release = on_release  # tells a draining gateway that work finished
        self.queue = WaitQueue(queue)
        self.pools = pools
        self.replicas = replicas  # live: the orchestrator adds and changes them
        self.metrics = metrics
        self.clock = clock
        self.level_names = [spec.name for spec in queue.levels]
        self._tickets: dict[str, Ticket] = {}
        self._wake = asyncio.Event()
        self._timer_at: float | None = None  # the deadline the owner task sleeps until
        self._choices = itertools.count()
        self.closed: str | None = None  # why new requests are refused, once shutting down
        # Set by the controller for an autoscaled model: with no replica ready, requests
        # wait in the queue (with their deadlines) while one cold-starts, and on_demand
        # tells the controller there is demand (scale from zero) at once.
        self.on_demand: Callable[[], None] | None = None

    # ----------------------------------------------------------------- handlers' side
    def saturation(self) -> float:
        """How full the queue is (0..1): what graded holdback compares with."""
        return len(self.queue) / self.queue.config.max_size

    def submit(self, request: Request) -> Ticket:
        """Admit and queue, or raise Overloaded (429) / NotReady (503)."""
        if self.closed is not None:
            raise NotReady(self.closed, code="shutting_down", retry_after_s=1.0)
        if not any(replica.ready for replica in self.replicas) and not self._cold_starting():
            # Why not queue: with nothing ready there is no drain rate to promise a wait
            # from; the client learns it now and when to come back.
            raise NotReady(
                f"{self.model}: no ready replica (starting, restarting or failed)",
                code="no_ready_replica",
                retry_after_s=NO_REPLICA_RETRY_AFTER_S,
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
        ticket = Ticket(request)
        self._tickets[request.id] = ticket
        self._dispatch(now)
        if (
            decision.deadline_at is not None
            and request.id in self.queue
            and (self._timer_at is None or decision.deadline_at < self._timer_at)
        ):
            self._wake.set()  # an earlier deadline than the armed timer: re-arm it
        return ticket

    def _cold_starting(self) -> bool:
        """Whether a request may wait for a replica that is (about to be) starting."""
        if self.on_demand is None:
            return False
        self.on_demand()
        return True

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: drop it from the queue, or give back its slot."""
        if self.queue.cancel(ticket.request.id) is not None:
            del self._tickets[ticket.request.id]
            self._notify()
            return
        assigned = ticket.assigned
        if assigned.done() and not assigned.cancelled() and assigned.exception() is None:
            self.release(assigned.result(), completed=False)

    def release(self, replica: Replica, *, completed: bool = True) -> None:
        """A dispatched request finished (or failed): its slot is free again."""
        replica.in_flight -= 1
        if completed:
            self.queue.drain.record(self.clock.now())
        self._dispatch(self.clock.now())
        self._notify()

    def _notify(self) -> None:
        if self.on_release is not None:
            self.on_release()

    def retry(self, ticket: Ticket, failed: Replica) -> Ticket:
        """Put a request whose replica failed before any byte back in front of its level."""
        failed.in_flight -= 1
        request = dataclasses.replace(ticket.request, attempt=ticket.request.attempt + 1)
        self.queue.requeue(request, self.clock.now())
        again = Ticket(request)
        self._tickets[request.id] = again
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
            self._dispatch(now)
            self._wake.clear()
            deadline_at = self._timer_at = self.queue.next_deadline_at()
            timeout = None if deadline_at is None else max(0.0, deadline_at - now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _dispatch(self, now: float) -> None:
        views = {replica.id: replica.view() for replica in self.replicas}
        by_id = {replica.id: replica for replica in self.replicas}
        while len(self.queue):
            levels = servable_levels(views.values(), self.pools)
            popped = self.queue.pop(1, now, levels=levels) if levels else ()
            if not popped:
                return
            (request,) = popped
            view = pick_replica(
                views.values(), request.priority, self.pools, choice_key=next(self._choices)
            )
            assert view is not None  # a servable level has an eligible replica
            replica = by_id[view.id]
            replica.in_flight += 1
            views[replica.id] = replica.view()
            ticket = self._tickets.pop(request.id)
            ticket.assigned_at = now
            ticket.assigned.set_result(replica)

    def fail_all(self, error: Exception) -> int:
        """Answer everything still queued with ``error`` (shutdown). Returns how many."""
        requests = self.queue.pop(len(self.queue) or 1, self.clock.now())
        for request in requests:
            self._fail(request, error)
        return len(requests)

    def _fail(self, request: Request, error: Exception) -> None:
        """The waiting handler gets ``error``: it answers and counts the outcome."""
        ticket = self._tickets.pop(request.id, None)
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
            ready += replica.ready
            key = (replica.pool, replica.state.value)
            states[key] = states.get(key, 0) + 1
        for (pool, state), count in states.items():
            self.metrics.replicas.labels(self.model, pool, state).set(count)
        demand = len(self.queue) + self.num_in_flight()
        self.metrics.queue_depth_per_replica.labels(self.model).set(demand / max(1, ready))
