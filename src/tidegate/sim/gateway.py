"""The gateway of one model in virtual time: ``ModelDispatcher``'s decisions, by the core.

Mirrors ``tidegate.gateway.dispatcher`` step by step, with the kernel's clock:

- submit: 503 ``unavailable`` when no replica is ready (unless ``on_demand`` is set: a
  controller that scales from zero, as the dispatcher's hook); else ``WaitQueue.admit`` with the
  saturation ``len(queue) / max_size`` (graded holdback, predicted-wait deadline check,
  capacity and shedding are the core's); shed victims end as ``shed``;
- deadlines and aging: one timer at the earlier of ``WaitQueue.next_deadline_at()`` and
  ``WaitQueue.next_eligible_at(servable levels)`` (a queued request ages into a level a free
  slot serves), re-armed only for an earlier time, firing ``expire`` then a dispatch, as the
  dispatcher's owner task does;
- dispatch (flow control and routing): pop the most urgent request that ``servable_levels``
  can take (its own level or one it has aged to), route it with ``pick_replica`` (its own
  level's pools first, else those of a level it has aged to); a replica holds at most
  ``slots``;
- release: a finished request frees its slot and feeds the queue's ``DrainRate``; a completed
  one's tokens settle its tenant's fair-share counter (``WaitQueue.settle``), as the
  dispatcher's ``release`` does with an answer's usage; with fair sharing each one's tenant
  gives its slot back (``WaitQueue.vacate``), and a dispatch tells the queue the ready slots
  (``set_slots``: fair sharing's slot shares), as the dispatcher does;
- prefix affinity (``affinity`` set, ``core.prefix``): ``pick_replica`` gets the ticket's
  ``prefix_key`` (the leading blocks of its prompt), as the dispatcher passes the key the
  gateway computed from the request;
- preemption (fair sharing's ``preemption`` on, core.fairness): when a dispatch finds no free
  slot, ``WaitQueue.preempt`` gives each request that may pause one of another tenant's (the
  victim); it goes, with ``Ticket.preempt`` = the victim, to the ready replica serving its
  level that holds the most of the victim's requests in flight (ties: the first in the
  views' order), whose in-flight may then exceed its slots; with none holding any, it is
  requeued and preemption stops until the next dispatch. The worker pauses one of the
  victim's sequences for it (``sim.workers``); the paused one stays in flight on that
  replica and is released when it completes there, as any other.

One difference of form, not of decision: where several slots are free, the requests are
popped together (``pop(n)``) when ``n`` successive single pops could not see a different
set of servable levels (each pool with a free slot has at least ``n``), since with the
same ``now`` the queue returns the same requests in the same order either way.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Final

from tidegate.core.prefix import PrefixAffinity
from tidegate.core.queue import QueueConfig, Rejected, WaitQueue
from tidegate.core.request import Request
from tidegate.core.routing import PoolSpec, ReplicaView, pick_replica, servable_levels
from tidegate.sim.kernel import Kernel
from tidegate.sim.recorder import Recorder

if TYPE_CHECKING:  # (it imports this module: a cycle at run time)
    from tidegate.sim.fleet import Fleet

_NO_LEVELS: Final[frozenset[int]] = frozenset()


class Ticket:
    """One request on its way through the simulated stack."""

    __slots__ = (
        "blocks",
        "dispatched_at",
        "first_at",
        "klass",
        "local",
        "made_tokens",
        "output_tokens",
        "preempt",
        "prefix_key",
        "prompt_tokens",
        "replica",
        "request",
    )

    def __init__(
        self,
        request: Request,
        klass: int,
        prompt_tokens: int,
        output_tokens: int,
        blocks: tuple[int, ...] = (),
        prefix_key: int | None = None,
    ):
        self.request = request  # as the gateway's queue knows it
        self.klass = klass  # index of its priority class in the recorder
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.blocks = blocks  # prefix-block ids of the prompt (a worker's prefix cache)
        self.prefix_key = prefix_key  # what prefix-affinity routing hashes; None: none
        self.dispatched_at = 0.0
        self.first_at = -1.0  # generation: when the first token came back
        self.replica: str = ""
        self.preempt = ""  # sent to pause one of this tenant's sequences (""): none
        self.local: Request = request  # as the worker's queue knows it, once it got there
        # generation: output tokens made; a paused sequence prefills its prompt and these again
        self.made_tokens = 0

    @property
    def prefill_tokens(self) -> int:
        """What its (next) prefill computes: the prompt, and the tokens made before a pause."""
        return self.prompt_tokens + self.made_tokens


class SimGateway:
    def __init__(
        self,
        kernel: Kernel,
        queue: QueueConfig,
        pools: Mapping[str, PoolSpec],
        replicas: Fleet,
        recorder: Recorder,
        affinity: PrefixAffinity | None = None,
    ) -> None:
        self.kernel = kernel
        self.affinity = affinity  # prefix-affinity routing; None: least loaded
        self.queue = WaitQueue(queue)
        self.pools = pools
        self.replicas = replicas
        self.recorder = recorder
        self.tickets: dict[str, Ticket] = {}  # queued ones
        self._max_size = queue.max_size
        self._timer_at: float | None = None  # the deadline or aging the owner task sleeps until
        self._timer_version = 0
        # Set for a controller that scales from zero (as the dispatcher's ``on_demand``):
        # with no replica ready, requests wait in the queue and the controller hears of it.
        self.on_demand: Callable[[], None] | None = None
        self._num_choices = 0  # pick_replica's choice_key: 0, 1, 2... (a counter)
        self.num_dispatched = 0  # progress, for the run's guard against a queue that is stuck
        # Fair sharing's slot shares (core.fairness); False: the counters alone, as before
        # them (a benchmark's side-by-side; the gateway always bounds them).
        self.slot_shares = True
        # Preemption: each replica's requests in flight by tenant (replica -> tenant -> count);
        # None: preemption off, nothing counted.
        fairness = queue.fairness
        self._tenants_on: dict[str, Counter[str]] | None = (
            defaultdict(Counter) if fairness is not None and fairness.preemption else None
        )
        self.num_preempts = 0  # requests sent to pause one of another tenant's

    # ------------------------------------------------------------------ requests
    def submit(self, ticket: Ticket) -> None:
        now = self.kernel.time
        request = ticket.request
        if not self.replicas.num_ready and not self._cold_starting():
            self.recorder.ended(ticket.klass, "unavailable", request.id, now, None)
            return
        queue = self.queue
        decision = queue.admit(request, now, len(queue) / self._max_size)
        if isinstance(decision, Rejected):
            self.recorder.ended(ticket.klass, decision.reason.value, request.id, now, None)
            return
        for victim in decision.shed:
            shed = self.tickets.pop(victim.id)
            self.recorder.ended(shed.klass, "shed", victim.id, now, now - victim.arrival_at)
        self.tickets[request.id] = ticket
        self.dispatch(now)
        deadline_at = decision.deadline_at
        if (
            deadline_at is not None
            and request.id in queue
            and (self._timer_at is None or deadline_at < self._timer_at)
        ):
            self._arm(deadline_at)

    def _cold_starting(self) -> bool:
        if self.on_demand is None:
            return False
        self.on_demand()
        return True

    def release(self, replica_id: str, tickets: Sequence[Ticket], completed: bool) -> None:
        """``tickets`` on ``replica_id`` finished now: free their slots, dispatch.

        When ``completed``, their tokens settle their tenants' counters.
        """
        self.replicas.free(replica_id, len(tickets), self._tokens(tickets))
        self._left(replica_id, tickets)
        queue = self.queue
        if completed:
            queue.drain.record(self.kernel.time, len(tickets))
        if queue.fair is not None:
            for ticket in tickets:
                if completed:
                    queue.settle(ticket.request, ticket.prompt_tokens, ticket.output_tokens)
                queue.vacate(ticket.request)
        self.dispatch(self.kernel.time)

    def retry(self, tickets: Sequence[Ticket], replica_id: str) -> None:
        """Dispatched requests that had not started go back in front of their levels."""
        now = self.kernel.time
        self.replicas.free(replica_id, len(tickets), self._tokens(tickets))
        self._left(replica_id, tickets)
        for ticket in tickets:
            request = dataclasses.replace(ticket.request, attempt=ticket.request.attempt + 1)
            ticket.request = request
            ticket.preempt = ""
            self.queue.requeue(request, now)
            self.tickets[request.id] = ticket
        self.dispatch(now)

    def _tokens(self, tickets: Sequence[Ticket]) -> int:
        """What ``tickets`` held of the replica's tokens in flight: counted only for prefix
        affinity's bound (``Fleet.count_tokens``)."""
        if self.affinity is None:
            return 0
        tokens = 0
        for ticket in tickets:
            tokens += ticket.request.cost_tokens
        return tokens

    # ------------------------------------------------------------------ timers
    def _arm(self, at: float) -> None:
        """One live timer: a new one supersedes the one pending (its event is ignored)."""
        self._timer_at = at
        self._timer_version += 1
        self.kernel.at(at, self._on_timer, self._timer_version)

    def _on_timer(self, version: int) -> None:
        if version == self._timer_version:
            self.wake()

    def wake(self) -> None:
        """What the dispatcher's owner task does when woken: expire, dispatch, re-arm."""
        now = self.kernel.time
        for request in self.queue.expire(now):
            ticket = self.tickets.pop(request.id)
            self.recorder.ended(ticket.klass, "expired", request.id, now, now - request.arrival_at)
        levels = self.dispatch(now)
        queue = self.queue
        wake_at = queue.next_deadline_at()
        if levels and len(queue):
            eligible_at = queue.next_eligible_at(levels)
            if eligible_at is not None and (wake_at is None or eligible_at < wake_at):
                wake_at = eligible_at
        if wake_at is None:
            self._timer_at = None
            self._timer_version += 1
        else:
            self._arm(wake_at)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, now: float) -> frozenset[int]:
        """Dispatch what free slots can take; returns the levels still servable then."""
        queue = self.queue
        levels = _NO_LEVELS
        if not len(queue):
            return levels
        views = self.replicas.views.values()  # a live view: it follows occupy's updates
        pools = self.pools
        tickets = self.tickets
        replicas = self.replicas  # the fleet: compiled, occupy is a direct call
        affinity = self.affinity
        if queue.fair is not None and self.slot_shares:
            queue.set_slots(sum(view.slots for view in views if view.ready))
        while len(queue):
            levels = servable_levels(views, pools)
            if not levels:
                if self._tenants_on is not None:
                    self._preempt(now)
                return levels
            batch = self._safe_batch() if len(queue) > 1 else 1
            popped = queue.pop(batch, now, levels=levels)
            if not popped:
                self._arm_for_aging(levels)
                return levels
            self.num_dispatched += len(popped)
            for request in popped:
                # Its aged level matters only where its own has no free slot (core.routing).
                aged = None if request.priority in levels else queue.aged_level(request, now)
                ticket = tickets[request.id]  # (dict.pop: a method looked up by name, compiled)
                del tickets[request.id]
                choice_key = self._num_choices
                self._num_choices = choice_key + 1
                view = pick_replica(
                    views,
                    request.priority,
                    pools,
                    aged_level=aged,
                    choice_key=choice_key,
                    prefix_key=ticket.prefix_key,
                    affinity=affinity,
                    tokens=request.cost_tokens,
                )
                assert view is not None  # a servable level has an eligible replica
                ticket.dispatched_at = now
                ticket.replica = view.id
                if self._tenants_on is not None:
                    self._tenants_on[view.id][request.tenant] += 1
                replicas.occupy(view.id, ticket)
        return levels

    def _preempt(self, now: float) -> None:
        """No slot free: send each request that may pause one of another tenant's to the
        replica holding most of that tenant's requests (module docstring)."""
        queue = self.queue
        tenants_on = self._tenants_on
        assert tenants_on is not None
        while (taken := queue.preempt(now)) is not None:
            request, victim = taken
            ticket = self.tickets.pop(request.id)
            level = request.priority
            best: ReplicaView | None = None
            most = 0
            for view in self.replicas.views.values():
                pool = self.pools.get(view.pool)
                if not view.ready or pool is None or level not in pool.priorities:
                    continue
                held = tenants_on[view.id][victim]
                if held > most:  # ties: the first in the views' order
                    best, most = view, held
            if best is None:  # none of the victim's where it could go: wait for a slot
                queue.requeue(request, now)
                self.tickets[request.id] = ticket
                return
            self.num_dispatched += 1
            self.num_preempts += 1
            ticket.dispatched_at = now
            ticket.replica = best.id
            ticket.preempt = victim
            tenants_on[best.id][request.tenant] += 1
            self.replicas.occupy(best.id, ticket)

    def _left(self, replica_id: str, tickets: Sequence[Ticket]) -> None:
        """``tickets`` are no longer in flight on ``replica_id`` (preemption's count)."""
        tenants_on = self._tenants_on
        if tenants_on is None:
            return
        on = tenants_on[replica_id]
        for ticket in tickets:
            tenant = ticket.request.tenant
            on[tenant] -= 1
            if not on[tenant]:
                del on[tenant]

    def _arm_for_aging(self, levels: frozenset[int]) -> None:
        """An earlier timer when a queued request ages into ``levels`` sooner (dispatcher's
        ``_wake_for_aging``): a slot freed in a pool that serves only some levels."""
        eligible_at = self.queue.next_eligible_at(levels)
        if eligible_at is not None and (self._timer_at is None or eligible_at < self._timer_at):
            self._arm(eligible_at)

    def _safe_batch(self) -> int:
        """How many pops in a row cannot change the servable levels (module docstring)."""
        free: dict[str, int] = {}
        for view in self.replicas.views.values():
            if view.ready and view.in_flight < view.slots:
                free[view.pool] = free.get(view.pool, 0) + view.slots - view.in_flight
        return min(free.values()) if free else 1
