"""pick_replica rules, one scenario per row."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tidegate.core.routing import PoolSpec, ReplicaView, pick_replica

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
    RouteScenario("unknown_pool_is_skipped", [rep("x", "gone")], 0, None),
    RouteScenario("zero_slots_is_never_picked", [rep("a", slots=0)], 0, None),
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_pick_replica(scenario: RouteScenario) -> None:
    picked = pick_replica(scenario.replicas, scenario.priority, POOLS)
    assert (picked.id if picked else None) == scenario.expected


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
