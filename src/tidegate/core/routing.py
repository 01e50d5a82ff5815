"""pick_replica: which replica runs the next request of a given priority.

Design note. Only replicas that are ready, belong to a pool serving the priority and have a
free slot are eligible: a replica holds only what it can batch soon, the backlog stays in
the gateway's queue where priority and aging apply. Among the eligible, the least loaded
(in-flight / slots) wins, ties broken by replica id so the choice is reproducible. Above
``power_of_two_above`` replicas the router samples two eligible replicas and takes the less
loaded: O(1) instead of O(n), and several gateways do not all pile onto the same one. The
sample is drawn from ``choice_key`` so the same inputs give the same pick.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    priorities: frozenset[int]  # levels this pool serves


@dataclass(frozen=True, slots=True)
class ReplicaView:
    id: str
    pool: str
    ready: bool
    in_flight: int
    slots: int  # requests it accepts at once: its engine's batching capacity

    @property
    def load(self) -> float:
        return self.in_flight / self.slots if self.slots > 0 else float("inf")

    @property
    def has_free_slot(self) -> bool:
        return self.ready and self.in_flight < self.slots


DEFAULT_POWER_OF_TWO_ABOVE = 16


def eligible_replicas(
    replicas: Iterable[ReplicaView], priority: int, pools: Mapping[str, PoolSpec]
) -> list[ReplicaView]:
    """Ready replicas with a free slot in pools that serve ``priority``."""
    return [
        replica
        for replica in replicas
        if replica.has_free_slot
        and replica.pool in pools
        and priority in pools[replica.pool].priorities
    ]


def pick_replica(
    replicas: Iterable[ReplicaView],
    priority: int,
    pools: Mapping[str, PoolSpec],
    *,
    power_of_two_above: int = DEFAULT_POWER_OF_TWO_ABOVE,
    choice_key: int = 0,
) -> ReplicaView | None:
    """The replica to send a request of ``priority`` to, or None when none can take it."""
    candidates = eligible_replicas(replicas, priority, pools)
    if not candidates:
        return None
    if len(candidates) > power_of_two_above:
        # Why sample: a full scan per request costs O(replicas) and sends every gateway copy
        # to the same least-loaded replica at once; two random choices avoid both.
        candidates = random.Random(choice_key).sample(candidates, 2)
    return min(candidates, key=_load_then_id)


def servable_levels(
    replicas: Iterable[ReplicaView], pools: Mapping[str, PoolSpec]
) -> frozenset[int]:
    """Levels that some ready replica with a free slot could take right now.

    The dispatcher pops the most urgent request among these levels, then routes it with
    ``pick_replica``: so a free dedicated slot takes the most urgent high-priority request
    even while low-priority work waits for the shared pool, and low work never lands there.
    """
    levels: set[int] = set()
    for replica in replicas:
        if replica.has_free_slot and replica.pool in pools:
            levels |= pools[replica.pool].priorities
    return frozenset(levels)


def _load_then_id(replica: ReplicaView) -> tuple[float, str]:
    return (replica.load, replica.id)
