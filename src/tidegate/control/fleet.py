"""The configured replicas of a remote orchestrator, started and stopped with the gateway.

``LocalWorkers`` creates the replicas of the configuration itself. An orchestrator that only
speaks the protocol (``RayWorkers``) gets them from here: on ``start()`` one ``start_replica``
per configured replica (``model-pool-index``, the same ids as local), each handed to the
gateway; on ``stop()`` the orchestrator is closed, which stops them all. A replica the
cluster cannot place is logged and left out; the controller (for an autoscaled model) asks
again at its next period. ``started`` is set once every configured replica was asked for:
the controller decides nothing before (it would see none, and start one more).
"""

from __future__ import annotations

import asyncio
import logging

from tidegate.config import TidegateConfig
from tidegate.control.orchestrator import Orchestrator, ReplicaSpec
from tidegate.gateway.replicas import Replica
from tidegate.gateway.state import Gateway

log = logging.getLogger("tidegate.control")


class ConfiguredFleet:
    def __init__(self, config: TidegateConfig, orchestrator: Orchestrator, gateway: Gateway):
        self.config = config
        self.orchestrator = orchestrator
        self.gateway = gateway
        self.replicas: list[Replica] = []  # the gateway learns of them as they start
        self.started = asyncio.Event()  # every configured replica was asked for

    def specs(self) -> list[ReplicaSpec]:
        return [
            ReplicaSpec(
                replica_id=f"{model.name}-{pool}-{index}",
                model=model.name,
                pool=pool,
                settings=self.config.worker_settings(model.name),
                memory_mb=model.memory_mb,
                exclusive=model.exclusive,
                slots=model.slots,
            )
            for model in self.config.models.values()
            if model.local
            for pool, count in model.replicas.items()
            for index in range(count)
        ]

    async def start(self) -> None:
        try:
            for spec in self.specs():
                try:
                    replica = await self.orchestrator.start_replica(
                        spec, self.gateway.on_replica_change
                    )
                except Exception as exc:  # refused by the cluster: say so, start the others
                    log.error("replica %s not started: %s", spec.replica_id, exc)
                    continue
                self.gateway.add_replica(replica)
        finally:
            self.started.set()

    def device_of(self, replica_id: str) -> str:
        """Where the orchestrator placed ``replica_id`` (a Ray node); KeyError when it does
        not say, or the replica is not one of its own."""
        where = getattr(self.orchestrator, "device_of", None)
        if where is None:
            raise KeyError(replica_id)
        return str(where(replica_id))

    async def stop(self, timeout_s: float = 10) -> None:
        await self.orchestrator.close()
