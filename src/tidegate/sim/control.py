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
factory in ``CONTROLLERS``; the kernel does not change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from tidegate.config import TidegateConfig
from tidegate.gateway.replicas import ReplicaState

DEFAULT_INTERVAL_S = 15.0


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


class StaticController:
    """A fixed count per pool: starts replacements for replicas that went away, nothing else."""

    def __init__(self, replicas: Mapping[str, int], interval_s: float = DEFAULT_INTERVAL_S):
        self.replicas = dict(replicas)
        self.interval_s = interval_s

    def decide(self, view: FleetView) -> Sequence[FleetAction]:
        actions: list[FleetAction] = []
        alive = (ReplicaState.STARTING, ReplicaState.WARMING, ReplicaState.READY)
        for pool, wanted in self.replicas.items():
            actions += [StartReplica(pool)] * max(0, wanted - view.count(pool, *alive))
        return actions


ControllerFactory = Callable[[ControllerContext], Controller]

CONTROLLERS: dict[str, ControllerFactory] = {
    "static": lambda context: StaticController(context.replicas),
}
