"""The seam between the controller and whatever runs replicas: one small protocol.

The controller decides (core ``decide_scale``, ``place``, ``pick_victims``); an orchestrator
executes: it starts a replica of a model somewhere, reports its lifecycle through
``Replica.set_state`` (STARTING → WARMING → READY, FAILED on a crash, and back through
STARTING when it restarts it), stops one, lists what it runs, and says where to reach it.

Implementations: ``control.local.LocalWorkers`` (child processes on this host, the default)
and ``control.ray.RayWorkers`` (Ray actors on a cluster). Kubernetes is not an orchestrator
here: ``tidegate k8s render`` writes manifests and the cluster's own controllers act on them.

Invariants every implementation keeps:
- ``start_replica`` returns the ``Replica`` at once (STARTING); readiness comes later through
  ``on_change``. A replica is READY only after its worker's ``/readyz`` answered 200, i.e.
  after warm-up passed.
- ``stop_replica`` stops routing nothing by itself: the controller drains first (DRAINING,
  wait for in-flight to finish) and then calls it. It ends in STOPPED, and is idempotent.
- a replica that dies without ``stop_replica`` is restarted with back-off (same id).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tidegate.gateway.replicas import Replica
from tidegate.worker.runtime import WorkerSettings


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """What to run for one replica, and the resources placement gave it."""

    replica_id: str
    model: str
    pool: str
    settings: WorkerSettings  # the `tidegate worker` it runs
    device: str = "cpu"  # placement's device id; local: "cpu" or "cuda:N"
    memory_mb: float = 0.0  # its share of the device (0: not limited)
    exclusive: bool = False  # a whole device
    slots: int | None = None  # in-flight requests it takes; None: ask its /stats


class Orchestrator(Protocol):
    async def start_replica(
        self, spec: ReplicaSpec, on_change: Callable[[Replica], None]
    ) -> Replica: ...

    async def stop_replica(self, replica_id: str, timeout_s: float) -> None: ...

    def list_replicas(self) -> list[Replica]: ...

    def endpoint(self, replica_id: str) -> str | None: ...

    async def close(self) -> None: ...
