"""place / plan_defrag / pick_victims rules, one scenario per row."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tidegate.core.placement import (
    DefragPlan,
    Device,
    Move,
    Placed,
    Placement,
    Refusal,
    ReplicaAsk,
    VictimCandidate,
    pick_victims,
    place,
    placement_violations,
    plan_defrag,
)


def dev(device_id: str, mb: float = 16000, node: str = "n1", pool: str | None = None) -> Device:
    return Device(device_id, mb, node, pool)


def ask(
    rid: str, model: str = "m", mb: float = 4000, pool: str = "shared", *, exclusive: bool = False
) -> ReplicaAsk:
    return ReplicaAsk(rid, model, pool, mb, exclusive)


def on(device_id: str, *asks: ReplicaAsk) -> tuple[Placed, ...]:
    return tuple(Placed(a, device_id) for a in asks)


def placement(*groups: tuple[Placed, ...]) -> Placement:
    return Placement(tuple(p for group in groups for p in group))


TWO = (dev("A"), dev("B"))
POOLS = (dev("D", pool="dedicated"), dev("S", pool="shared"))


@dataclass(frozen=True)
class PlaceScenario:
    name: str
    devices: tuple[Device, ...]
    asks: tuple[ReplicaAsk, ...]
    expected: dict[str, str]  # new replica -> device
    refused: dict[str, Refusal] = field(default_factory=dict)
    current: Placement = field(default_factory=Placement)
    strategy: str = "binpack"


PLACE_SCENARIOS = [
    PlaceScenario(
        "binpack_takes_the_tightest_fit",
        (dev("A", 24000), dev("B", 16000)),
        (ask("r", mb=10000),),
        {"r": "B"},
    ),
    PlaceScenario(
        "spread_takes_the_emptiest",
        (dev("A", 24000), dev("B", 16000)),
        (ask("r", mb=10000),),
        {"r": "A"},
        strategy="spread",
    ),
    PlaceScenario(
        "binpack_fills_a_used_device_before_an_empty_one",
        TWO,
        (ask("r"),),
        {"r": "A"},
        current=placement(on("A", ask("k", "other", 8000))),
    ),
    PlaceScenario(
        "spread_prefers_the_empty_device",
        TWO,
        (ask("r"),),
        {"r": "B"},
        current=placement(on("A", ask("k", "other", 8000))),
        strategy="spread",
    ),
    PlaceScenario(
        "replicas_of_a_model_spread_over_devices_even_when_binpacking",
        TWO,
        (ask("r2"),),
        {"r2": "B"},
        current=placement(on("A", ask("r1"))),
    ),
    PlaceScenario(
        "replicas_of_a_model_spread_over_nodes",
        (dev("A", node="n1"), dev("B", node="n1"), dev("C", node="n2")),
        (ask("r2"), ask("r3")),
        {"r2": "C", "r3": "B"},
        current=placement(on("A", ask("r1"))),
    ),
    PlaceScenario(
        "replicas_of_a_model_share_a_device_when_nothing_else_has_room",
        TWO,
        (ask("r2"),),
        {"r2": "A"},
        current=placement(on("A", ask("r1")), on("B", ask("k", "other", 14000))),
    ),
    PlaceScenario(
        "largest_first_places_what_arrival_order_would_not",
        (dev("A", 10000), dev("B", 10000)),
        (ask("a", "ma", 4000), ask("b", "mb", 4000), ask("c", "mc", 6000), ask("d", "md", 6000)),
        {"c": "A", "d": "B", "a": "A", "b": "B"},
    ),
    PlaceScenario(
        "an_exact_fit_is_allowed",
        TWO,
        (ask("r", mb=16000),),
        {"r": "A"},
    ),
    PlaceScenario(
        "exclusive_needs_an_empty_device",
        TWO,
        (ask("x", "big", 2000, exclusive=True),),
        {"x": "B"},
        current=placement(on("A", ask("k", "other", 1000))),
    ),
    PlaceScenario(
        "an_exclusive_device_hosts_nothing_else",
        TWO,
        (ask("r", mb=100),),
        {"r": "B"},
        current=placement(on("A", ask("x", "big", 2000, exclusive=True))),
    ),
    PlaceScenario(
        "exclusive_asks_go_before_shared_ones",
        (dev("A"),),
        (ask("s", mb=1000), ask("x", "big", 2000, exclusive=True)),
        {"x": "A"},
        {"s": Refusal.NO_ROOM},
    ),
    PlaceScenario(
        "exclusive_without_an_empty_device_is_refused",
        (dev("A"),),
        (ask("x", "big", 2000, exclusive=True),),
        {},
        {"x": Refusal.NO_ROOM},
        current=placement(on("A", ask("k", "other", 1000))),
    ),
    PlaceScenario(
        "a_pool_uses_only_its_devices",
        POOLS,
        (ask("s", pool="shared"), ask("d", pool="dedicated")),
        {"s": "S", "d": "D"},
    ),
    PlaceScenario(
        "a_full_pool_refuses_rather_than_borrowing",
        POOLS,
        (ask("s", pool="shared"),),
        {},
        {"s": Refusal.NO_ROOM},
        current=placement(on("S", ask("k", "other", 14000))),
    ),
    PlaceScenario(
        "an_unowned_device_serves_any_pool",
        (dev("D", pool="dedicated"), dev("U")),
        (ask("s", pool="shared"),),
        {"s": "U"},
    ),
    PlaceScenario(
        "larger_than_any_device_is_refused",
        TWO,
        (ask("r", mb=16001),),
        {},
        {"r": Refusal.TOO_LARGE},
    ),
    PlaceScenario(
        "a_pool_without_devices_is_refused",
        POOLS,
        (ask("r", pool="batch"),),
        {},
        {"r": Refusal.NO_DEVICE_IN_POOL},
    ),
    PlaceScenario(
        "a_replica_already_placed_is_refused",
        TWO,
        (ask("r1"),),
        {},
        {"r1": Refusal.ALREADY_PLACED},
        current=placement(on("A", ask("r1"))),
    ),
    PlaceScenario(
        "ties_go_to_the_smaller_device_id",
        (dev("B"), dev("A")),
        (ask("r"),),
        {"r": "A"},
    ),
]


@pytest.mark.parametrize("scenario", PLACE_SCENARIOS, ids=lambda s: s.name)
def test_place(scenario: PlaceScenario) -> None:
    result = place(scenario.asks, scenario.devices, scenario.current, scenario.strategy)
    assert {p.ask.replica_id: p.device_id for p in result.new} == scenario.expected
    assert {r.ask.replica_id: r.reason for r in result.refused} == scenario.refused
    assert result.placement.placed[: len(scenario.current.placed)] == scenario.current.placed
    assert placement_violations(result.placement, scenario.devices) == ()


def test_refusals_say_why() -> None:
    result = place(
        [ask("big", mb=20000), ask("x", "e", 100, exclusive=True), ask("p", pool="batch")],
        [dev("A", pool="shared")],
        placement(on("A", ask("k", "other", 1000))),
    )
    messages = {r.ask.replica_id: r.message for r in result.refused}
    assert messages == {
        "big": "big asks 20000 MB; the largest device of pool shared has 16000 MB",
        "x": "no device of pool shared has an empty device for x",
        "p": "pool batch has no device",
    }


def test_an_unknown_strategy_is_refused() -> None:
    with pytest.raises(ValueError, match="binpack"):
        place([ask("r")], TWO, strategy="random")


def test_placement_helpers() -> None:
    current = placement(
        on("A", ask("r1", mb=3000), ask("r2", "k", 5000)), on("B", ask("x", exclusive=True))
    )
    assert current.assignments == {"r1": "A", "r2": "A", "x": "B"}
    assert current.used_devices == {"A", "B"}
    assert current.free_mb(dev("A")) == 8000
    assert current.free_mb(dev("B")) == 0
    assert current.free_mb(dev("C")) == 16000
    assert current.device_of("r2") == "A"
    assert current.device_of("nope") is None
    assert current.without({"r1"}).assignments == {"r2": "A", "x": "B"}
    assert current.with_moves([Move("r1", "A", "C")]).device_of("r1") == "C"


def test_violations_name_each_broken_rule() -> None:
    broken = placement(
        on("A", ask("r1", mb=10000), ask("r2", "k", 10000)),
        on("B", ask("x", exclusive=True), ask("y", "k")),
        on("D", ask("s", pool="shared")),
        on("Z", ask("z")),
        on("A", ask("r1")),
    )
    devices = (dev("A"), dev("B"), dev("D", pool="dedicated"))
    assert set(placement_violations(broken, devices)) == {
        "r1 is placed twice",
        "s (pool shared) is on D",
        "z is on unknown device Z",
        "A is over-committed",
        "B shares an exclusive replica",
    }


# ------------------------------------------------------------------------------- defrag


@dataclass(frozen=True)
class DefragScenario:
    name: str
    devices: tuple[Device, ...]
    current: Placement
    moves: tuple[Move, ...]
    freed: tuple[str, ...]
    pending: tuple[ReplicaAsk, ...] = ()
    max_moves: int | None = None
    fits_pending: bool = True


THREE = (dev("A"), dev("B"), dev("C"))

DEFRAG_SCENARIOS = [
    DefragScenario(
        "cheapest_devices_are_emptied_onto_the_fullest",
        THREE,
        placement(
            on("A", ask("r1", "m1")), on("B", ask("r2", "m2")), on("C", ask("r3", "m3", 8000))
        ),
        (Move("r1", "A", "C"), Move("r2", "B", "C")),
        ("A", "B"),
    ),
    DefragScenario(
        "never_stacks_two_replicas_of_a_model",
        TWO,
        placement(on("A", ask("r1")), on("B", ask("r2"))),
        (),
        (),
    ),
    DefragScenario(
        "never_moves_to_an_empty_device",
        TWO,
        placement(on("A", ask("r1"))),
        (),
        (),
    ),
    DefragScenario(
        "nothing_moves_when_nothing_has_room",
        TWO,
        placement(on("A", ask("r1", "m1", 12000)), on("B", ask("r2", "m2", 12000))),
        (),
        (),
    ),
    DefragScenario(
        "an_exclusive_replica_neither_moves_nor_takes_company",
        TWO,
        placement(on("A", ask("x", "big", exclusive=True)), on("B", ask("r", mb=1000))),
        (),
        (),
    ),
    DefragScenario(
        "moves_stay_inside_the_pool",
        POOLS,
        placement(on("D", ask("d", "m1", pool="dedicated")), on("S", ask("s", "m2"))),
        (),
        (),
    ),
    DefragScenario(
        "a_whole_device_emptied_in_several_moves",
        THREE,
        placement(
            on("A", ask("a1", "m1", 2000), ask("a2", "m2", 2000)),
            on("B", ask("b", "m3", 13000)),
            on("C", ask("c", "m4", 13000)),
        ),
        (Move("a1", "A", "B"), Move("a2", "A", "C")),
        ("A",),
    ),
    DefragScenario(
        "pending_exclusive_frees_one_device_and_stops",
        THREE,
        placement(on("A", ask("r1", "m1")), on("B", ask("r2", "m2")), on("C", ask("r3", "m3"))),
        (Move("r1", "A", "B"),),
        ("A",),
        pending=(ask("x", "big", exclusive=True),),
    ),
    DefragScenario(
        "pending_that_already_fits_moves_nothing",
        THREE,
        placement(on("A", ask("r1", "m1")), on("B", ask("r2", "m2"))),
        (),
        (),
        pending=(ask("x", "big", exclusive=True),),
    ),
    DefragScenario(
        "pending_that_cannot_fit_is_reported",
        TWO,
        placement(on("A", ask("r1", "m1")), on("B", ask("r2", "m2"))),
        (Move("r1", "A", "B"),),
        ("A",),
        pending=(ask("huge", mb=20000),),
        fits_pending=False,
    ),
    DefragScenario(
        "one_move_beats_two",
        THREE,
        placement(
            on("A", ask("a1", "m1", 2000), ask("a2", "m2", 2000)),
            on("B", ask("b", "m3", 12000)),
            on("C", ask("c", "m4", 12000)),
        ),
        (Move("b", "B", "A"),),
        ("B",),
    ),
    DefragScenario(
        "max_moves_skips_a_device_that_costs_more",
        THREE,
        placement(
            on("A", ask("a1", "m1", 2000), ask("a2", "m2", 2000)),
            on("B", ask("b", "m3")),
            on("C", ask("c", "m4", 8000)),
        ),
        (Move("b", "B", "C"),),
        ("B",),
        max_moves=1,
    ),
]


@pytest.mark.parametrize("scenario", DEFRAG_SCENARIOS, ids=lambda s: s.name)
def test_plan_defrag(scenario: DefragScenario) -> None:
    plan = plan_defrag(
        scenario.current, scenario.devices, scenario.pending, max_moves=scenario.max_moves
    )
    assert plan.moves == scenario.moves
    assert plan.freed_devices == scenario.freed
    assert plan.fits_pending is scenario.fits_pending
    assert plan.placement == scenario.current.with_moves(scenario.moves)
    assert placement_violations(plan.placement, scenario.devices) == ()


def test_defrag_plan_prints_for_a_dry_run() -> None:
    plan = plan_defrag(DEFRAG_SCENARIOS[0].current, THREE)
    assert plan.describe() == ["move r1: A -> C", "move r2: B -> C", "frees 2: A, B"]
    assert DefragPlan((), (), Placement()).describe() == ["nothing to move"]


# ------------------------------------------------------------------------------ victims


@dataclass(frozen=True)
class VictimScenario:
    name: str
    current: Placement
    candidates: tuple[VictimCandidate, ...]
    count: int
    expected: tuple[str, ...]


def cand(rid: str, in_flight: int = 0, started_at: float = 0.0) -> VictimCandidate:
    return VictimCandidate(rid, in_flight, started_at)


VICTIM_SCENARIOS = [
    VictimScenario(
        "fewest_in_flight_first",
        placement(on("A", ask("r1")), on("B", ask("r2"))),
        (cand("r1", 3), cand("r2", 1)),
        1,
        ("r2",),
    ),
    VictimScenario(
        "then_the_one_that_frees_a_whole_device",
        placement(on("A", ask("r1")), on("B", ask("r2"), ask("k", "other", 1000))),
        (cand("r2", started_at=9.0), cand("r1")),
        1,
        ("r1",),
    ),
    VictimScenario(
        "then_the_one_leaving_its_device_emptiest",
        placement(
            on("A", ask("r1"), ask("k1", "other", 8000)),
            on("B", ask("r2"), ask("k2", "other", 2000)),
        ),
        (cand("r1", started_at=9.0), cand("r2")),
        1,
        ("r2",),
    ),
    VictimScenario(
        "then_the_newest",
        placement(on("A", ask("r1")), on("B", ask("r2"))),
        (cand("r1", started_at=1.0), cand("r2", started_at=2.0)),
        1,
        ("r2",),
    ),
    VictimScenario(
        "two_on_one_device_go_together",
        placement(on("A", ask("r1"), ask("r2")), on("B", ask("r3"), ask("k", "other", 8000))),
        (cand("r1", started_at=1.0), cand("r2", started_at=2.0), cand("r3", started_at=3.0)),
        2,
        ("r2", "r1"),
    ),
    VictimScenario(
        "never_more_than_the_candidates",
        placement(on("A", ask("r1"))),
        (cand("r1"), cand("local")),
        5,
        ("r1", "local"),
    ),
]


@pytest.mark.parametrize("scenario", VICTIM_SCENARIOS, ids=lambda s: s.name)
def test_pick_victims(scenario: VictimScenario) -> None:
    picked = pick_victims(scenario.candidates, scenario.count, scenario.current)
    assert picked == scenario.expected
