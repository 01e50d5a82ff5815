"""The control-plane seam of the simulator: a controller sees the fleet, returns changes.

Every ``interval_s`` of virtual time the simulation builds a ``FleetView`` (queued and
in-flight requests, every live replica with its lifecycle state) and asks the controller
to ``decide``; it applies the returned ``StartReplica`` (a cold start: starting, warming,
then ready) and ``DrainReplica`` (no new requests, what had not started goes back to the
gateway's queue, the rest finishes within the drain timeout, then stopped) actions.

Demand is what the autoscaler of ARCHITECTURE.md scales on: (queued + in-flight) per ready
replica, the seed metric ``inference_queue_depth``; None when no replica is ready (a missing
signal means hold, never zero).

``StaticController`` keeps a fixed count per pool. Autoscalers plug in by registering a
factory in ``CONTROLLERS``; the kernel does not change. A controller that knows the future
(``sim.oracle``) reads the run's workload and service model from its ``ControllerContext``,
and only it starts replicas ``warm`` (ready at once, no cold start).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tidegate.config import TidegateConfig
from tidegate.core.placement import Placement, VictimCandidate, pick_victims
from tidegate.gateway.replicas import ReplicaState

if TYPE_CHECKING:
    from tidegate.sim.service import ServiceModel
    from tidegate.sim.workload import Workload

DEFAULT_INTERVAL_S = 15.0
# The states a controller maintains a count of (draining replicas are on their way out).
COUNTED = (ReplicaState.STARTING, ReplicaState.WARMING, ReplicaState.READY)


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    id: str
    pool: str
    state: ReplicaState
    in_flight: int
    slots: int
    started_at: float


@dataclass(frozen=True, slots=True)
class FleetView:
    now: float
    queued: int
    queued_by_level: tuple[int, ...]
    in_flight: int
    replicas: tuple[ReplicaStatus, ...]  # live ones: starting, warming, ready, draining
    arrived: int = 0  # requests that arrived so far (a counter: the autoscaler's rate)

    @property
    def num_ready(self) -> int:
        return sum(1 for replica in self.replicas if replica.state is ReplicaState.READY)

    @property
    def demand_per_ready(self) -> float | None:
        ready = self.num_ready
        return (self.queued + self.in_flight) / ready if ready else None

    def count(self, pool: str, *states: ReplicaState) -> int:
        return sum(1 for r in self.replicas if r.pool == pool and r.state in states)


@dataclass(frozen=True, slots=True)
class StartReplica:
    pool: str
    warm: bool = False  # ready at once, no cold start: an oracle's replica, never a real one


@dataclass(frozen=True, slots=True)
class DrainReplica:
    replica_id: str


FleetAction = StartReplica | DrainReplica


class Controller(Protocol):
    interval_s: float

    def decide(self, view: FleetView) -> Sequence[FleetAction]: ...


@dataclass(frozen=True)
class ControllerContext:
    """What a controller is built from: the run's config, model and starting fleet."""

    config: TidegateConfig
    model: str
    replicas: Mapping[str, int]  # pool -> replicas ready at time 0
    start_wall_s: float = 0.0  # wall-clock epoch seconds of virtual time 0 (schedules)
    speedup: float = 1.0  # a virtual second stands for this many seconds of the real day
    workload: Workload | None = None  # the run's arrivals: the future, for an oracle only
    service: ServiceModel | None = None  # the replicas' engine cost model


class StaticController:
    """A fixed count per pool: starts replacements for replicas that went away, nothing else."""

    def __init__(self, replicas: Mapping[str, int], interval_s: float = DEFAULT_INTERVAL_S):
        self.replicas = dict(replicas)
        self.interval_s = interval_s

    def decide(self, view: FleetView) -> Sequence[FleetAction]:
        actions: list[FleetAction] = []
        for pool, wanted in self.replicas.items():
            actions += [StartReplica(pool)] * max(0, wanted - view.count(pool, *COUNTED))
        return actions


def drain_least_busy(view: FleetView, pool: str, count: int) -> list[FleetAction]:
    """Drain ``count`` of the pool's counted replicas, least busy first (``pick_victims``)."""
    candidates = [
        VictimCandidate(r.id, r.in_flight, r.started_at)
        for r in view.replicas
        if r.pool == pool and r.state in COUNTED
    ]
    return [DrainReplica(rid) for rid in pick_victims(candidates, count, Placement())]


ControllerFactory = Callable[[ControllerContext], Controller]

CONTROLLERS: dict[str, ControllerFactory] = {
    "static": lambda context: StaticController(context.replicas),
}
