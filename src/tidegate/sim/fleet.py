"""Replicas of the simulated model and their lifecycle, in virtual time.

starting -> warming -> ready -> draining -> stopped, as in ARCHITECTURE.md: a replica added
by a controller spends ``cold_start_s`` starting and ``warmup_s`` warming before it takes
traffic; the initial fleet is ready at time 0. Draining stops routing to it at once, hands
back to the gateway what it had not started, lets the rest finish, and stops when nothing
is left or ``drain_timeout_s`` has passed (what still runs then fails).

The fleet is what the gateway routes over (``views``: one ``ReplicaView`` per live replica,
in the order they were added, updated whenever its readiness or in-flight count changes)
and it delivers dispatched requests to the replicas' workers, after ``network_s / 2``.
Replica-seconds count from the start of a replica to its stop (cold start included: the
GPU is held).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from tidegate.core.routing import ReplicaView
from tidegate.gateway.replicas import ReplicaState
from tidegate.sim.control import ReplicaStatus
from tidegate.sim.gateway import Ticket
from tidegate.sim.kernel import Kernel
from tidegate.sim.workers import Worker

# Final: a compiled build holds them, instead of looking the enum members up per use
_READY: Final = ReplicaState.READY
_DRAINING: Final = ReplicaState.DRAINING


@dataclass(frozen=True, slots=True)
class Lifecycle:
    cold_start_s: float = 60.0  # process start and weights load
    warmup_s: float = 10.0  # warm-up requests until /readyz
    drain_timeout_s: float = 30.0


class FleetEvents(Protocol):
    def replica_ready(self, replica_id: str) -> None: ...

    def hand_back(self, replica_id: str, tickets: list[Ticket]) -> None: ...

    def abandoned(self, replica_id: str, tickets: list[Ticket]) -> None: ...


class SimReplica:
    __slots__ = (
        "id",
        "in_flight",
        "pool",
        "slots",
        "started_at",
        "state",
        "stopped_at",
        "tokens",
        "worker",
    )

    def __init__(self, replica_id: str, pool: str, slots: int, worker: Worker, at: float):
        self.id = replica_id
        self.pool = pool
        self.slots = slots
        self.worker = worker
        self.state = ReplicaState.STARTING
        self.in_flight = 0
        self.tokens = 0  # cost_tokens in flight, when the fleet counts them
        self.started_at = at
        self.stopped_at: float | None = None

    def view(self) -> ReplicaView:
        return ReplicaView(
            self.id, self.pool, self.state is _READY, self.in_flight, self.slots, self.tokens
        )

    def status(self) -> ReplicaStatus:
        return ReplicaStatus(
            self.id, self.pool, self.state, self.in_flight, self.slots, self.started_at
        )


class Fleet:
    def __init__(
        self,
        kernel: Kernel,
        model: str,
        slots: int,
        make_worker: Callable[[str], Worker],
        events: FleetEvents,
        lifecycle: Lifecycle = Lifecycle(),
        network_s: float = 0.0,
    ) -> None:
        self.kernel = kernel
        self.model = model
        self.slots = slots
        self.make_worker = make_worker
        self.events = events
        self.lifecycle = lifecycle
        self.half_hop_s = network_s / 2
        self.live: dict[str, SimReplica] = {}
        self.views: dict[str, ReplicaView] = {}
        self.stopped: list[SimReplica] = []
        self.num_ready = 0
        self._ids = itertools.count()
        # The tokens in flight per replica (``ReplicaView.tokens``), for prefix affinity's
        # bound in tokens (the gateway's ``free`` then gives them back); off, nothing counted.
        self.count_tokens = False

    # ------------------------------------------------------------------ routing side
    def occupy(self, replica_id: str, ticket: Ticket) -> None:
        replica = self.live[replica_id]
        replica.in_flight += 1
        if self.count_tokens:
            replica.tokens += ticket.request.cost_tokens
        self.views[replica_id] = replica.view()
        if self.half_hop_s:
            self.kernel.at(self.kernel.time + self.half_hop_s, self._deliver, ticket)
        else:
            replica.worker.submit(ticket)

    def _deliver(self, ticket: Ticket) -> None:
        replica = self.live.get(ticket.replica)
        if replica is None or replica.state is not ReplicaState.READY:
            self.events.hand_back(ticket.replica, [ticket])  # it went away meanwhile
            return
        replica.worker.submit(ticket)

    def free(self, replica_id: str, count: int, tokens: int = 0) -> None:
        """``count`` requests of ``tokens`` in all (when counted) left ``replica_id``."""
        replica = self.live[replica_id]
        replica.in_flight -= count
        replica.tokens -= tokens
        self.views[replica_id] = replica.view()
        if replica.state is _DRAINING and replica.in_flight == 0:
            self._stop(replica)

    # ------------------------------------------------------------------ lifecycle
    def add(self, pool: str, *, warm: bool = False) -> SimReplica:
        """A new replica in ``pool``: ready now when ``warm``, else after a cold start."""
        replica_id = f"{self.model}-{next(self._ids)}"
        now = self.kernel.time
        replica = SimReplica(replica_id, pool, self.slots, self.make_worker(replica_id), now)
        self.live[replica_id] = replica
        if warm:
            self._set(replica, ReplicaState.READY)
        else:
            self.views[replica_id] = replica.view()
            self.kernel.at(now + self.lifecycle.cold_start_s, self._warming, replica)
        return replica

    def _warming(self, replica: SimReplica) -> None:
        if replica.state is ReplicaState.STARTING:
            self._set(replica, ReplicaState.WARMING)
            self.kernel.at(self.kernel.time + self.lifecycle.warmup_s, self._ready, replica)

    def _ready(self, replica: SimReplica) -> None:
        if replica.state is ReplicaState.WARMING:
            self._set(replica, ReplicaState.READY)

    def drain(self, replica_id: str) -> None:
        replica = self.live.get(replica_id)
        if replica is None or replica.state is ReplicaState.DRAINING:
            return
        if replica.state is not ReplicaState.READY:
            self._stop(replica)  # not started yet: nothing to drain
            return
        self._set(replica, ReplicaState.DRAINING)
        waiting = replica.worker.take_waiting()
        if waiting:
            self.events.hand_back(replica_id, waiting)
        if replica.in_flight == 0 and replica.id in self.live:
            self._stop(replica)
            return
        self.kernel.at(self.kernel.time + self.lifecycle.drain_timeout_s, self._give_up, replica)

    def _give_up(self, replica: SimReplica) -> None:
        if replica.state is ReplicaState.DRAINING:
            running = replica.worker.take_running()
            if running:
                self.events.abandoned(replica.id, running)  # frees the slots: it stops
            if replica.state is ReplicaState.DRAINING:
                self._stop(replica)

    def _stop(self, replica: SimReplica) -> None:
        self._set(replica, ReplicaState.STOPPED)
        replica.stopped_at = self.kernel.time
        del self.live[replica.id]
        del self.views[replica.id]
        self.stopped.append(replica)

    def _set(self, replica: SimReplica, state: ReplicaState) -> None:
        was_ready = replica.state is ReplicaState.READY
        replica.state = state
        now_ready = state is ReplicaState.READY
        self.num_ready += now_ready - was_ready
        self.views[replica.id] = replica.view()
        if now_ready and not was_ready:
            self.events.replica_ready(replica.id)

    # ------------------------------------------------------------------ views
    @property
    def in_flight(self) -> int:
        return sum(replica.in_flight for replica in self.live.values())

    def transitioning(self) -> bool:
        """A replica is starting, warming or draining: its end is still to come."""
        return any(r.state is not ReplicaState.READY for r in self.live.values())

    def statuses(self) -> tuple[ReplicaStatus, ...]:
        return tuple(replica.status() for replica in self.live.values())

    def replica_seconds(self, until: float) -> float:
        held = sum((max(0.0, until - r.started_at) for r in self.live.values()), 0.0)
        return held + sum(((r.stopped_at or until) - r.started_at for r in self.stopped), 0.0)
