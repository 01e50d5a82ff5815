"""A GPU inventory of whole nodes for the fleet-level simulator, placed by the core.

A replica of ``gpus`` GPUs (its tensor-parallel degree) runs on one node: its shards are
``gpus`` asks of ``memory_mb`` each, placed by ``core.placement.place`` on that node's
devices around what the node already holds (``binpack``; the core spreads the shards of a
model over the node's devices before it stacks them, and refuses what has no room, never
over-committing a device). Which node: the one with the fewest free GPUs that still has
``gpus`` of them (best fit, so whole nodes stay free for the widest replicas), ties to the
lower index; when the core refuses there, the next. One ``Placement`` per node keeps each
call O(GPUs per node) instead of O(fleet): 10,000 GPUs cost no more per placement than 8.

"Free" GPU: one holding no ask. A node whose devices are shared by small asks of several
models is still placed by the core, which checks memory; the free count only orders nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidegate.core.placement import (
    Device,
    Placement,
    ReplicaAsk,
    place,
    placement_violations,
)


@dataclass(frozen=True, slots=True)
class Inventory:
    nodes: int = 1250
    gpus_per_node: int = 8
    gpu_memory_mb: float = 81920.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or self.gpu_memory_mb <= 0:
            raise ValueError(
                f"an inventory needs nodes >= 1, gpus_per_node >= 1 and gpu_memory_mb > 0, "
                f"got {self.nodes}, {self.gpus_per_node}, {self.gpu_memory_mb}"
            )

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


class GpuInventory:
    """Nodes of GPUs; ``put`` and ``release`` replicas (see the module docstring)."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        per = inventory.gpus_per_node
        self.devices: list[tuple[Device, ...]] = [
            tuple(
                Device(f"n{node:05d}/gpu{g}", inventory.gpu_memory_mb, f"n{node:05d}")
                for g in range(per)
            )
            for node in range(inventory.nodes)
        ]
        self.placements: list[Placement] = [Placement() for _ in range(inventory.nodes)]
        self.free: list[int] = [per] * inventory.nodes
        # nodes by free GPUs: buckets[k] holds the nodes with exactly k free GPUs
        self.buckets: list[set[int]] = [set() for _ in range(per + 1)]
        self.buckets[per].update(range(inventory.nodes))
        self.where: dict[str, int] = {}  # replica id -> node
        self.used_gpus = 0  # GPUs holding at least one ask
        self.refusals = 0

    def put(self, replica_id: str, model: str, pool: str, gpus: int, memory_mb: float) -> bool:
        """Place a replica's ``gpus`` shards on one node; False when no node has room."""
        if gpus > self.inventory.gpus_per_node:
            self.refusals += 1
            return False
        asks = [
            ReplicaAsk(f"{replica_id}/{shard}", model, pool, memory_mb) for shard in range(gpus)
        ]
        for free in range(gpus, self.inventory.gpus_per_node + 1):
            for node in sorted(self.buckets[free]):
                result = place(asks, self.devices[node], self.placements[node])
                if result.refused:
                    continue
                self.placements[node] = result.placement
                self.where[replica_id] = node
                self._recount(node)
                return True
        self.refusals += 1
        return False

    def release(self, replica_id: str) -> None:
        node = self.where.pop(replica_id, None)
        if node is None:
            return
        prefix = f"{replica_id}/"
        current = self.placements[node]
        gone = {p.ask.replica_id for p in current.placed if p.ask.replica_id.startswith(prefix)}
        self.placements[node] = current.without(gone)
        self._recount(node)

    def _recount(self, node: int) -> None:
        used = self.placements[node].used_devices
        free = self.inventory.gpus_per_node - len(used)
        old = self.free[node]
        if free != old:
            self.buckets[old].discard(node)
            self.buckets[free].add(node)
            self.used_gpus += old - free
            self.free[node] = free

    def violations(self) -> tuple[str, ...]:
        """``core.placement.placement_violations`` over every node (tests)."""
        problems: list[str] = []
        for devices, placement in zip(self.devices, self.placements, strict=True):
            problems += placement_violations(placement, devices)
        return tuple(problems)
