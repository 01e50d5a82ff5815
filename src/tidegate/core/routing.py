"""pick_replica: which replica runs the next request of a given priority.

Design note. Only replicas that are ready, belong to a pool serving the priority and have a
free slot are eligible: a replica holds only what it can batch soon, the backlog stays in
the gateway's queue where priority and aging apply. A pool serves a request when it serves
its level or a level it has aged to (``aged_level``, from the queue): a medium request aged
to high may run in a high-only pool, so no level waits forever behind a pool boundary. A
pool of its own level comes first, though: aging lets a request reach a pool, it does not
move it off its own while that has room (a dedicated slot stays free for the work it is
for). Among the eligible, the least loaded (in-flight / slots) wins, ties broken by replica id so
the choice is reproducible. Above ``power_of_two_above`` replicas the router samples two
eligible replicas and takes the less loaded: O(1) instead of O(n), and several gateways do
not all pile onto the same one. The sample is drawn from ``choice_key`` so the same inputs
give the same pick.

Prefix affinity (``core.prefix``, a model's ``routing: prefix``): when the request carries a
prefix key, the choice among the same eligible replicas is the key's replica on a
consistent-hash ring under a bounded load instead of the least loaded. It plugs in after
eligibility so that affinity never overrides pools, readiness, aging or flow control: it only
chooses among what ``pick_replica`` would accept anyway. No power-of-two sampling then: the
ring walk and the bound are what keep several gateways from piling onto one replica.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from tidegate.core.prefix import PrefixAffinity, build_ring, pick_by_prefix


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    priorities: frozenset[int]  # levels this pool serves


@dataclass(frozen=True, slots=True, init=False)
class ReplicaView:
    id: str
    pool: str
    ready: bool
    in_flight: int
    slots: int  # requests it accepts at once: its engine's batching capacity
    tokens: int  # cost_tokens (prompt + output) of its requests in flight; 0: not counted

    # written out for a compiled build, as Request's __init__ (core/request.py)
    def __init__(
        self, id: str, pool: str, ready: bool, in_flight: int, slots: int, tokens: int = 0
    ) -> None:
        object.__setattr__(self, "id", id)
        object.__setattr__(self, "pool", pool)
        object.__setattr__(self, "ready", ready)
        object.__setattr__(self, "in_flight", in_flight)
        object.__setattr__(self, "slots", slots)
        object.__setattr__(self, "tokens", tokens)

    @property
    def load(self) -> float:
        return self.in_flight / self.slots if self.slots > 0 else float("inf")

    @property
    def has_free_slot(self) -> bool:
        return self.ready and self.in_flight < self.slots


DEFAULT_POWER_OF_TWO_ABOVE: Final = 16
# what callers pass, tested before the Collection ABC, whose check is slow per dispatch: a
# list or a tuple (compiled, a type check each), or a dict's values (its exact type)
_DICT_VALUES: Final[type] = type({}.values())


def eligible_replicas(
    replicas: Iterable[ReplicaView],
    priority: int,
    pools: Mapping[str, PoolSpec],
    aged_level: int | None = None,
) -> list[ReplicaView]:
    """Ready replicas with a free slot in pools that serve ``priority`` (aged: see serves)."""
    names = _serving(pools, priority, aged_level)
    if len(names) == 1:  # one pool (the common case): a string comparison, not a set lookup
        only = names[0]
        return [r for r in replicas if r.pool == only and r.has_free_slot]
    serving = set(names)
    return [replica for replica in replicas if replica.pool in serving and replica.has_free_slot]


def _serving(pools: Mapping[str, PoolSpec], priority: int, aged_level: int | None) -> list[str]:
    """The names of the pools that serve ``priority`` (aged to ``aged_level``), each once."""
    serving: list[str] = []
    if isinstance(pools, dict):  # what callers pass: compiled, a dict's own iteration
        for name, pool in pools.items():
            if serves(pool, priority, aged_level):
                serving.append(name)
    else:
        for name, pool in pools.items():
            if serves(pool, priority, aged_level):
                serving.append(name)
    return serving


def serves(pool: PoolSpec, priority: int, aged_level: int | None = None) -> bool:
    """Whether ``pool`` takes a request of ``priority`` that has aged to ``aged_level``.

    It does when it serves the request's own level or any level between that and the one
    it has reached by aging (``WaitQueue.aged_level``; None: not aged).
    """
    served = pool.priorities
    if priority in served:
        return True
    if aged_level is None or aged_level >= priority:
        return False
    return any(aged_level <= level < priority for level in served)


def pick_replica(
    replicas: Iterable[ReplicaView],
    priority: int,
    pools: Mapping[str, PoolSpec],
    *,
    aged_level: int | None = None,
    power_of_two_above: int = DEFAULT_POWER_OF_TWO_ABOVE,
    choice_key: int = 0,
    prefix_key: int | None = None,
    affinity: PrefixAffinity | None = None,
    tokens: int = 0,
) -> ReplicaView | None:
    """The replica to send a request of ``priority`` (aged to ``aged_level``) to, or None.

    Replicas of pools serving ``priority`` first; only when none has a free slot, those of
    pools serving a level it has aged to (module docstring). With ``affinity`` and a
    ``prefix_key``, the key's replica among those (bounded load, the request's ``tokens``
    counted: core.prefix) instead of the least loaded; the ring spans every replica in
    ``replicas``, so a full one keeps its keys for later.
    """
    if (
        not isinstance(replicas, (list, tuple))
        and type(replicas) is not _DICT_VALUES
        and not isinstance(replicas, Collection)
    ):
        replicas = list(replicas)  # it may be scanned twice
    candidates = eligible_replicas(replicas, priority, pools)
    if not candidates and aged_level is not None and aged_level < priority:
        candidates = eligible_replicas(replicas, priority, pools, aged_level)
    if not candidates:
        return None
    if affinity is not None and prefix_key is not None:
        ring = build_ring((replica.id for replica in replicas), affinity.num_vnodes)
        return pick_by_prefix(candidates, prefix_key, ring, affinity, tokens)
    if len(candidates) > power_of_two_above:
        # Why sample: a full scan per request costs O(replicas) and sends every gateway copy
        # to the same least-loaded replica at once; two random choices avoid both.
        candidates = random.Random(choice_key).sample(candidates, 2)
    return least_loaded(candidates)


def servable_levels(
    replicas: Iterable[ReplicaView], pools: Mapping[str, PoolSpec]
) -> frozenset[int]:
    """Levels that some ready replica with a free slot could take right now.

    The dispatcher pops the most urgent request these levels can take (its own level or
    one it has aged to), then routes it with ``pick_replica``: so a free dedicated slot
    takes the most urgent high-priority request even while low-priority work waits for the
    shared pool, and low work lands there only once it has aged to high.
    """
    if isinstance(pools, dict):  # what callers pass: compiled, a dict's own lookups
        return _servable_levels(replicas, pools)
    return _servable_levels(replicas, dict(pools))


def _servable_levels(replicas: Iterable[ReplicaView], pools: dict[str, PoolSpec]) -> frozenset[int]:
    # The first pool's levels are returned as they are (a frozenset already) unless a second
    # pool adds to them: no set built per dispatch in the one-pool case.
    if len(pools) == 1:  # the scan ends at the first replica of the pool with a free slot
        for replica in replicas:
            spec = pools.get(replica.pool)
            if spec is not None and replica.has_free_slot:
                return spec.priorities
        return frozenset()
    first: frozenset[int] | None = None
    levels: set[int] | None = None
    seen: set[str] = set()  # pools whose levels are in: the scan ends once every pool is
    num_pools = len(pools)
    for replica in replicas:
        pool = replica.pool
        if pool in seen or pool not in pools or not replica.has_free_slot:
            continue
        priorities = pools[pool].priorities
        if first is None:
            first = priorities
        else:
            if levels is None:
                levels = set(first)
            levels |= priorities
        seen.add(pool)
        if len(seen) == num_pools:
            break
    if levels is not None:
        return frozenset(levels)
    return frozenset() if first is None else first


def least_loaded(candidates: Sequence[ReplicaView]) -> ReplicaView:
    """The least loaded of ``candidates`` (at least one), ties to the smallest id: what
    ``min`` by ``(load, id)`` gives, without a key tuple per replica on every dispatch."""
    return _least_loaded(candidates if isinstance(candidates, list) else list(candidates))


def _least_loaded(candidates: list[ReplicaView]) -> ReplicaView:
    # compiled: a list indexed natively; the first is not compared with itself (its id
    # comparison, on the tie, is a generic call)
    best = candidates[0]
    best_load = best.load
    for index in range(1, len(candidates)):
        replica = candidates[index]
        load = replica.load
        if load < best_load or (load == best_load and replica.id < best.id):
            best, best_load = replica, load
    return best
