"""pick_replica rules, one scenario per row."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidegate.core.routing import PoolSpec, ReplicaView, least_loaded, pick_replica, serves

POOLS = {
    "dedicated": PoolSpec("dedicated", frozenset({0})),
    "shared": PoolSpec("shared", frozenset({0, 1, 2})),
}


def rep(rid: str, pool: str = "shared", *, ready: bool = True, busy: int = 0, slots: int = 4):
    return ReplicaView(id=rid, pool=pool, ready=ready, in_flight=busy, slots=slots)


@dataclass(frozen=True)
class RouteScenario:
    name: str
    replicas: list[ReplicaView]
    priority: int
    expected: str | None
    aged_level: int | None = None  # the level the request has reached by aging


SCENARIOS = [
    RouteScenario("no_replicas_no_pick", [], 0, None),
    RouteScenario("least_loaded_wins", [rep("a", busy=3), rep("b", busy=1)], 1, "b"),
    RouteScenario(
        "load_is_relative_to_slots",
        [rep("a", busy=2, slots=8), rep("b", busy=1, slots=2)],
        1,
        "a",
    ),
    RouteScenario("ties_break_by_id", [rep("b", busy=1), rep("a", busy=1)], 1, "a"),
    RouteScenario("not_ready_is_skipped", [rep("a", ready=False), rep("b", busy=3)], 1, "b"),
    RouteScenario("full_replica_is_skipped", [rep("a", busy=4), rep("b", busy=4)], 1, None),
    RouteScenario(
        "low_priority_never_lands_on_dedicated",
        [rep("d", "dedicated"), rep("s", busy=3)],
        2,
        "s",
    ),
    RouteScenario(
        "high_priority_uses_idle_dedicated",
        [rep("d", "dedicated"), rep("s", busy=3)],
        0,
        "d",
    ),
    RouteScenario(
        "medium_not_aged_stays_off_dedicated",
        [rep("d", "dedicated"), rep("s", busy=4)],
        1,
        None,
        aged_level=1,
    ),
    RouteScenario(
        "medium_aged_to_high_uses_idle_dedicated",
        [rep("d", "dedicated"), rep("s", busy=4)],
        1,
        "d",
        aged_level=0,
    ),
    RouteScenario(
        "aged_low_stays_in_its_own_pool_while_that_has_room",
        [rep("d", "dedicated"), rep("s", busy=3)],
        2,
        "s",
        aged_level=0,
    ),
    RouteScenario(
        "aged_low_takes_the_least_loaded_reached_pool_when_its_own_is_full",
        [rep("d1", "dedicated", busy=3), rep("d2", "dedicated", busy=1), rep("s", busy=4)],
        2,
        "d2",
        aged_level=0,
    ),
    RouteScenario("unknown_pool_is_skipped", [rep("x", "gone")], 0, None),
    RouteScenario("zero_slots_is_never_picked", [rep("a", slots=0)], 0, None),
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_pick_replica(scenario: RouteScenario) -> None:
    picked = pick_replica(
        scenario.replicas, scenario.priority, POOLS, aged_level=scenario.aged_level
    )
    assert (picked.id if picked else None) == scenario.expected


@pytest.mark.parametrize(
    ("served", "priority", "aged_level", "expected"),
    [
        ({0}, 0, None, True),
        ({0}, 1, None, False),
        ({0}, 1, 1, False),
        ({0}, 1, 0, True),
        ({0}, 2, 1, False),  # half way: a high-only pool needs it at high
        ({1}, 2, 1, True),
        ({1}, 2, 0, True),  # aged past medium: still on its way through it
        ({2}, 0, 0, False),  # aging never makes a request less urgent
    ],
)
def test_pool_serves_a_request_at_its_level_or_one_it_aged_to(
    served: set[int], priority: int, aged_level: int | None, expected: bool
) -> None:
    assert serves(PoolSpec("p", frozenset(served)), priority, aged_level) is expected


def test_power_of_two_choices_is_deterministic_and_never_picks_the_busiest() -> None:
    # Every other replica is less loaded than "hot", so "hot" loses any pair it is drawn in.
    replicas = [rep(f"r{i:02d}", busy=i % 3, slots=4) for i in range(40)] + [rep("hot", busy=3)]
    picks = {
        pick_replica(replicas, 1, POOLS, power_of_two_above=8, choice_key=k) for k in range(50)
    }
    again = {
        pick_replica(replicas, 1, POOLS, power_of_two_above=8, choice_key=k) for k in range(50)
    }
    assert picks == again
    assert len(picks) > 5  # sampled, not always the global minimum
    assert all(p is not None and p.id != "hot" for p in picks)


@pytest.mark.parametrize(
    ("replicas", "expected"),
    [
        ([], set()),
        ([rep("d", "dedicated")], {0}),
        ([rep("d", "dedicated"), rep("s", busy=4)], {0}),
        ([rep("d", "dedicated", busy=4), rep("s")], {0, 1, 2}),
        ([rep("s", ready=False)], set()),
    ],
    ids=["none", "free_dedicated", "shared_full", "dedicated_full", "not_ready"],
)
def test_servable_levels(replicas: list[ReplicaView], expected: set[int]) -> None:
    from tidegate.core.routing import servable_levels

    assert servable_levels(replicas, POOLS) == expected


VIEWS = st.lists(
    st.builds(
        ReplicaView,
        id=st.sampled_from(["r0", "r1", "r2", "r10", "a"]),
        pool=st.just("p"),
        ready=st.just(True),
        in_flight=st.integers(0, 8),
        slots=st.integers(0, 8),  # 0 slots: load inf
    ),
    min_size=1,
    max_size=12,
)


@given(VIEWS)
def test_least_loaded_is_the_minimum_by_load_then_id(views: list[ReplicaView]) -> None:
    best = least_loaded(views)
    assert (best.load, best.id) == min((view.load, view.id) for view in views)
    assert best is min(views, key=lambda view: (view.load, view.id))


MANY_POOLS = {
    "high": PoolSpec("high", frozenset({0})),
    "shared": PoolSpec("shared", frozenset({0, 1, 2})),
    "low": PoolSpec("low", frozenset({2})),
}
MIXED_VIEWS = st.lists(
    st.builds(
        ReplicaView,
        id=st.sampled_from(["r0", "r1", "r2", "r3"]),
        pool=st.sampled_from([*MANY_POOLS, "gone"]),  # "gone": a pool no longer configured
        ready=st.booleans(),
        in_flight=st.integers(0, 3),
        slots=st.integers(0, 3),
    ),
    max_size=10,
)


@given(MIXED_VIEWS)
def test_servable_levels_is_the_union_over_free_replicas(views: list[ReplicaView]) -> None:
    from tidegate.core.routing import servable_levels

    expected: set[int] = set()
    for view in views:
        if view.has_free_slot and view.pool in MANY_POOLS:
            expected |= MANY_POOLS[view.pool].priorities
    assert servable_levels(views, MANY_POOLS) == expected


@given(MIXED_VIEWS, st.integers(0, 2), st.none() | st.integers(0, 2))
def test_eligible_replicas_are_free_ones_of_pools_serving_the_level(
    views: list[ReplicaView], priority: int, aged: int | None
) -> None:
    from tidegate.core.routing import eligible_replicas

    expected = [
        view
        for view in views
        if view.has_free_slot
        and view.pool in MANY_POOLS
        and serves(MANY_POOLS[view.pool], priority, aged)
    ]
    assert eligible_replicas(views, priority, MANY_POOLS, aged) == expected
