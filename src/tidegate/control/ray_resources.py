"""What one Ray replica asks of the cluster, and whether the cluster can give it: pure.

A replica is one placement-group bundle (``plan_resources``); the actor asks for the same:

- a GPU share: ``exclusive`` takes ``num_gpus`` 1 and the device's whole ``gpu_mem_mb``;
  ``memory_mb`` > 0 takes ``num_gpus`` = memory_mb / device memory (rounded up to Ray's
  1/10000, so never less than the share) and ``gpu_mem_mb`` = memory_mb. Ray's fractional
  GPUs keep a share on one device; ``gpu_mem_mb`` (declared per node: the sum of its devices'
  memory) is the cluster-wide account. A replica with neither takes no GPU. ``spec.device``
  is not used: it names a device of the controller's host, and on Ray the cluster places.
- its pool, ``pool:<name>``: ``POOL_UNITS`` of it, so a node that declares ``pool:<name>: 1``
  serves the pool (up to 1000 replicas) and a node that does not never gets them. Pools are
  opt-in: on a cluster where no node declares any ``pool:`` resource, every node serves
  every pool and replicas ask for none.
- ``cpus_per_replica`` CPUs (``MIN_CPUS`` when it would ask for nothing at all).

``check_fits`` refuses at once what no alive node could ever hold and what the cluster's free
resources cannot cover; what passes may still find no single node with room, which the
placement group's ready timeout decides (``control.ray``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from tidegate.control.orchestrator import ReplicaSpec

GPU_MEMORY = "gpu_mem_mb"  # custom resource: MB of GPU memory a node offers
POOL_PREFIX = "pool:"  # custom resource per pool, e.g. pool:shared
POOL_UNITS = 0.001  # of a pool resource per replica
RAY_PRECISION = 10_000  # Ray counts fractional resources in 1/10000
MIN_CPUS = 0.01  # what a replica that asks for nothing else takes


class PlacementRefused(RuntimeError):
    """The cluster cannot hold a replica now: no node of its pool, or memory exhausted."""


def plan_resources(
    spec: ReplicaSpec,
    device_memory_mb: float | None,
    cpus_per_replica: float,
    pools_declared: bool = True,
) -> dict[str, float]:
    """The bundle of one replica: Ray resource name -> amount (see the module docstring)."""
    bundle: dict[str, float] = {f"{POOL_PREFIX}{spec.pool}": POOL_UNITS} if pools_declared else {}
    if cpus_per_replica > 0:
        bundle["CPU"] = cpus_per_replica
    elif not bundle:
        bundle["CPU"] = MIN_CPUS  # a bundle must hold something
    if not spec.exclusive and spec.memory_mb <= 0:
        return bundle
    if device_memory_mb is None or device_memory_mb <= 0:
        raise PlacementRefused(
            f"{spec.replica_id}: wants a GPU share but no alive node declares {GPU_MEMORY} "
            f"with its GPUs (start nodes with --resources '{{\"{GPU_MEMORY}\": MB}}')"
        )
    if spec.exclusive:
        bundle["GPU"] = 1.0
        bundle[GPU_MEMORY] = device_memory_mb
        return bundle
    if spec.memory_mb > device_memory_mb:
        raise PlacementRefused(
            f"{spec.replica_id}: needs {spec.memory_mb:g} MB, more than one device "
            f"({device_memory_mb:g} MB)"
        )
    bundle["GPU"] = math.ceil(spec.memory_mb / device_memory_mb * RAY_PRECISION) / RAY_PRECISION
    bundle[GPU_MEMORY] = spec.memory_mb
    return bundle


def declares_pools(nodes: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any node declares a ``pool:`` resource (else pools are not asked for)."""
    return any(name.startswith(POOL_PREFIX) for node in nodes for name in node["Resources"])


def device_memory_mb(nodes: Sequence[Mapping[str, Any]]) -> float | None:
    """The smallest device any GPU node declares (its gpu_mem_mb / GPU), so a share computed
    from it never over-commits a larger device; None when no node declares both."""
    sizes = [
        node["Resources"][GPU_MEMORY] / node["Resources"]["GPU"]
        for node in nodes
        if node["Resources"].get("GPU", 0) > 0 and node["Resources"].get(GPU_MEMORY, 0) > 0
    ]
    return min(sizes) if sizes else None


def check_fits(
    replica_id: str,
    bundle: Mapping[str, float],
    nodes: Sequence[Mapping[str, Any]],
    available: Mapping[str, float],
) -> None:
    """Raise PlacementRefused when no alive node (``ray.nodes()`` entries) could ever hold
    ``bundle``, or when the cluster's free resources (``ray.available_resources()``) are short."""
    if not any(
        all(node["Resources"].get(name, 0) >= amount for name, amount in bundle.items())
        for node in nodes
    ):
        largest = {
            name: max((node["Resources"].get(name, 0) for node in nodes), default=0)
            for name in bundle
        }
        raise PlacementRefused(
            f"{replica_id}: no alive node could ever hold {describe(bundle)} "
            f"(the most any node has: {describe(largest)})"
        )
    short = {name: amount for name, amount in bundle.items() if available.get(name, 0) < amount}
    if short:
        free = {name: available.get(name, 0) for name in short}
        raise PlacementRefused(
            f"{replica_id}: the cluster is full: needs {describe(short)}, free {describe(free)}"
        )


def describe(resources: Mapping[str, float]) -> str:
    """``GPU 0.3, gpu_mem_mb 300, pool:shared 0.001``: for details and refusals."""
    return ", ".join(f"{name} {amount:g}" for name, amount in sorted(resources.items()))
