"""Prefix-affinity routing: table scenarios through pick_replica, and Hypothesis properties
of the bounded-load consistent-hash rule (core.prefix)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.core.prefix import (
    PrefixAffinity,
    block_key,
    build_ring,
    pick_by_prefix,
    text_key,
    within_bound,
)
from tidegate.core.routing import PoolSpec, ReplicaView, pick_replica

POOLS = {
    "dedicated": PoolSpec("dedicated", frozenset({0})),
    "shared": PoolSpec("shared", frozenset({0, 1, 2})),
}
AFFINITY = PrefixAffinity(load_factor=1.25, slack=1.0, num_vnodes=64)


def rep(
    rid: str,
    pool: str = "shared",
    *,
    ready: bool = True,
    busy: int = 0,
    slots: int = 8,
    tokens: int = 0,
) -> ReplicaView:
    return ReplicaView(id=rid, pool=pool, ready=ready, in_flight=busy, slots=slots, tokens=tokens)


def key_owned_by(owner: str, ids: list[str], *, avoid_second: str | None = None) -> int:
    """A block key whose ring walk over ``ids`` starts at ``owner`` (and whose second
    replica is not ``avoid_second``, when given)."""
    ring = build_ring(ids)
    for n in range(10_000):
        key = block_key([0, n])
        assert key is not None
        walk = list(ring.walk(key))
        if walk[0] == owner and (avoid_second is None or walk[1] != avoid_second):
            return key
    raise AssertionError("no key found")


def second_on_ring(key: int, ids: list[str]) -> str:
    return list(build_ring(ids).walk(key))[1]


IDS = ["a", "b", "c", "d"]
KEY_A = key_owned_by("a", IDS)
KEY_D_DEDICATED = key_owned_by("d", IDS)


@dataclass(frozen=True)
class PrefixScenario:
    name: str
    replicas: list[ReplicaView]
    priority: int
    key: int | None
    expected: str | None


SCENARIOS = [
    PrefixScenario(
        "idle_fleet_takes_the_keys_replica",
        [rep(i) for i in IDS],
        1,
        KEY_A,
        "a",
    ),
    PrefixScenario(
        "preferred_within_bound_wins_over_less_loaded",
        # 4 in flight in all: a may hold 1.25 * 5 / 4 + 1 = 2.56 -> takes a 2nd request
        [rep("a", busy=1), rep("b", busy=1), rep("c", busy=1), rep("d", busy=1)],
        1,
        KEY_A,
        "a",
    ),
    PrefixScenario(
        "preferred_over_bound_walks_the_ring",
        # a holds 6 of 6: allowed 1.25 * 7 / 4 + 1 = 3.19 < 7 -> next replica clockwise
        [rep("a", busy=6), rep("b"), rep("c"), rep("d")],
        1,
        KEY_A,
        second_on_ring(KEY_A, IDS),
    ),
    PrefixScenario(
        "full_preferred_walks_the_ring",
        [rep("a", busy=8), rep("b", busy=1), rep("c", busy=1), rep("d", busy=1)],
        1,
        KEY_A,
        second_on_ring(KEY_A, IDS),
    ),
    PrefixScenario(
        "no_key_is_least_loaded",
        [rep("a", busy=2), rep("b", busy=1), rep("c", busy=3), rep("d", busy=2)],
        1,
        None,
        "b",
    ),
    PrefixScenario(
        "low_priority_never_lands_on_dedicated_even_when_its_key_is_there",
        [rep("a"), rep("b"), rep("c"), rep("d", "dedicated")],
        2,
        KEY_D_DEDICATED,
        second_on_ring(KEY_D_DEDICATED, IDS),
    ),
    PrefixScenario(
        "not_ready_preferred_walks_the_ring",
        [rep("a", ready=False), rep("b"), rep("c"), rep("d")],
        1,
        KEY_A,
        second_on_ring(KEY_A, IDS),
    ),
    PrefixScenario("nothing_eligible_no_pick", [rep("a", busy=8)], 1, KEY_A, None),
]


@pytest.mark.parametrize("case", SCENARIOS, ids=lambda c: c.name)
def test_prefix_route(case: PrefixScenario) -> None:
    picked = pick_replica(
        case.replicas, case.priority, POOLS, prefix_key=case.key, affinity=AFFINITY
    )
    assert (picked.id if picked else None) == case.expected


# One request each, but a holds a 60k-token prompt: its share of the tokens with a 2k-token
# request is 1.25 * (63,000 + 2,000) / 4 = 20,312, far under 60,000.
HEAVY_A = [rep("a", busy=1, tokens=60_000), *(rep(i, busy=1, tokens=1_000) for i in "bcd")]


@pytest.mark.parametrize(
    ("views", "token_bound", "expected"),
    [
        pytest.param(HEAVY_A, True, second_on_ring(KEY_A, IDS), id="heavy_in_tokens_walks_on"),
        pytest.param(HEAVY_A, False, "a", id="requests_bound_alone_sees_one_request"),
        pytest.param(
            # 1.25 * (4 * 5,000 + 2,000) / 4 = 6,875 >= 5,000: even tokens, the key's own
            [rep(i, busy=1, tokens=5_000) for i in IDS],
            True,
            "a",
            id="even_tokens_keep_the_key",
        ),
        pytest.param(
            # an idle fleet groups a key whatever the request's size
            [rep(i) for i in IDS],
            True,
            "a",
            id="idle_fleet_groups_a_large_request",
        ),
    ],
)
def test_the_bound_in_tokens(views: list[ReplicaView], token_bound: bool, expected: str) -> None:
    affinity = PrefixAffinity(load_factor=1.25, slack=1.0, token_bound=token_bound)
    tokens = 50_000 if views[0].tokens == 0 else 2_000
    picked = pick_replica(views, 1, POOLS, prefix_key=KEY_A, affinity=affinity, tokens=tokens)
    assert picked is not None
    assert picked.id == expected


def test_own_level_pool_first_is_kept_under_affinity() -> None:
    # A medium request aged to high: the shared pool (its own level) has room, so the key's
    # replica in the dedicated pool is not taken even though it is idle.
    replicas = [rep("d", "dedicated"), rep("a", busy=7), rep("b", busy=7), rep("c", busy=7)]
    key = key_owned_by("d", ["a", "b", "c", "d"])
    picked = pick_replica(replicas, 1, POOLS, aged_level=0, prefix_key=key, affinity=AFFINITY)
    assert picked is not None
    assert picked.pool == "shared"


def test_a_hot_key_spills_to_the_same_next_replicas() -> None:
    """Many requests of one key: the preferred replica fills to its bound, then the next on
    the ring, never a replica further away while a nearer one is within the bound."""
    views = {i: rep(i, slots=32) for i in IDS}
    walk = list(build_ring(IDS).walk(KEY_A))
    order = []
    for _ in range(12):
        picked = pick_replica(list(views.values()), 1, POOLS, prefix_key=KEY_A, affinity=AFFINITY)
        assert picked is not None
        order.append(picked.id)
        views[picked.id] = rep(picked.id, busy=picked.in_flight + 1, slots=32)
    assert order[0] == walk[0]
    assert set(order) == set(walk[: len(set(order))])  # a prefix of the ring walk
    assert len(set(order)) > 1  # and it did spill


def test_text_key_counts_whole_blocks_only() -> None:
    assert text_key("x" * 100, num_blocks=2, block_chars=64) == text_key("x" * 127, 2, 64)
    assert text_key("x" * 63, num_blocks=2, block_chars=64) is None
    shared = "s" * 128
    assert text_key(shared + "tail one", 2, 64) == text_key(shared + "tail two", 2, 64)
    assert text_key("a" * 64 + "b" * 64, 2, 64) != text_key("a" * 64 + "c" * 64, 2, 64)


def test_block_key_uses_only_the_leading_blocks() -> None:
    assert block_key([0, 7, 8], 2) == block_key([0, 7, 99], 2)
    assert block_key([0, 7], 2) != block_key([0, 8], 2)
    assert block_key([], 2) is None


def test_bad_affinity_is_refused() -> None:
    with pytest.raises(ValueError, match="load_factor"):
        PrefixAffinity(load_factor=0.9)


# ----------------------------------------------------------------------------- properties

replica_ids = st.lists(
    st.text("abcdefgh", min_size=1, max_size=3), min_size=1, max_size=8, unique=True
)
keys = st.integers(0, 2**64 - 1)
affinities = st.builds(
    PrefixAffinity,
    load_factor=st.floats(1.0, 3.0),
    slack=st.floats(0.0, 4.0),
    num_vnodes=st.integers(1, 32),
    token_bound=st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(replica_ids, keys, st.integers(0, 6), affinities)
def test_equal_loads_same_key_same_replica(
    ids: list[str], key: int, busy: int, affinity: PrefixAffinity
) -> None:
    """Balanced loads: the key's replica is its ring owner, whatever the common load."""
    views = [rep(i, busy=busy, slots=8) for i in ids]
    picked = pick_replica(views, 1, POOLS, prefix_key=key, affinity=affinity)
    assert picked is not None
    if affinity.slack >= 1.0:  # the owner always fits: busy + 1 <= lf * (n busy + 1) / n + 1
        assert picked.id == build_ring(ids, affinity.num_vnodes).owner(key)
    again = pick_replica(list(reversed(views)), 1, POOLS, prefix_key=key, affinity=affinity)
    assert again is not None
    assert again.id == picked.id


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 7), st.sampled_from([4, 8, 16]), st.integers(0, 100_000)),
        min_size=1,
        max_size=8,
    ),
    keys,
    affinities,
    st.integers(1, 100_000),
)
def test_pick_exceeds_the_bound_only_when_every_candidate_would(
    loads: list[tuple[int, int, int]], key: int, affinity: PrefixAffinity, tokens: int
) -> None:
    views = [
        rep(f"r{i}", busy=min(busy, slots - 1), slots=slots, tokens=held)
        for i, (busy, slots, held) in enumerate(loads)
    ]
    picked = pick_replica(views, 1, POOLS, prefix_key=key, affinity=affinity, tokens=tokens)
    assert picked is not None  # every view has a free slot
    total_in = sum(v.in_flight for v in views)
    total_slots = sum(v.slots for v in views)
    total_tokens = sum(v.tokens for v in views)

    def fits(view: ReplicaView) -> bool:
        return within_bound(view, total_in, total_slots, affinity, total_tokens, tokens)

    if not fits(picked):
        assert not any(fits(v) for v in views)
        assert picked.load == min(v.load for v in views)


@settings(max_examples=200, deadline=None)
@given(replica_ids.filter(lambda ids: len(ids) >= 2), st.lists(keys, min_size=1, max_size=50))
def test_removing_a_replica_moves_only_its_keys(ids: list[str], sample: list[int]) -> None:
    removed = ids[0]
    before = build_ring(ids)
    after = build_ring(ids[1:])
    for key in sample:
        owner = before.owner(key)
        if owner != removed:
            assert after.owner(key) == owner
        else:
            assert after.owner(key) == next(r for r in before.walk(key) if r != removed)


@settings(max_examples=100, deadline=None)
@given(replica_ids, keys)
def test_walk_visits_every_replica_once(ids: list[str], key: int) -> None:
    walk = list(build_ring(ids, 8).walk(key))
    assert sorted(walk) == sorted(ids)


def test_pick_by_prefix_with_no_candidates_is_none() -> None:
    assert pick_by_prefix([], 1, build_ring(["a"]), AFFINITY) is None
