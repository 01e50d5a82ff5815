"""decide_outlier and routable_views, one scenario per row."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tidegate.core.outliers import (
    OutlierAction,
    OutlierConfig,
    OutlierState,
    decide_outlier,
    ejection_s,
    routable_views,
)
from tidegate.core.routing import PoolSpec, ReplicaView, pick_replica

CONFIG = OutlierConfig(
    consecutive_failures=3, base_ejection_s=10.0, max_ejection_s=25.0, max_ejection_percent=50.0
)
FAIL, OK = True, False


@dataclass(frozen=True)
class Answers:
    name: str
    answers: list[tuple[float, bool]]  # (at, failed), in order
    expected: OutlierState
    last_action: OutlierAction
    num_ejected: int = 0  # the model's other replicas ejected now
    num_replicas: int = 2
    start: OutlierState = field(default_factory=OutlierState)


SCENARIOS = [
    Answers(
        "failures_below_the_threshold_only_count",
        [(1, FAIL), (2, FAIL)],
        OutlierState(consecutive_failures=2),
        OutlierAction.NONE,
    ),
    Answers(
        "a_success_resets_the_count",
        [(1, FAIL), (2, FAIL), (3, OK), (4, FAIL)],
        OutlierState(consecutive_failures=1),
        OutlierAction.NONE,
    ),
    Answers(
        "threshold_in_a_row_ejects_for_the_base_time",
        [(1, FAIL), (2, FAIL), (3, FAIL)],
        OutlierState(num_ejections=1, ejected_until=13.0),
        OutlierAction.EJECT,
    ),
    Answers(
        "answers_while_ejected_change_nothing",
        [(1, FAIL), (2, FAIL), (3, FAIL), (4, FAIL), (5, OK)],
        OutlierState(num_ejections=1, ejected_until=13.0),
        OutlierAction.NONE,
    ),
    Answers(
        "half_open_success_returns_it_and_keeps_the_multiplier",
        [(1, FAIL), (2, FAIL), (3, FAIL), (13, OK)],
        OutlierState(num_ejections=1, returned_at=13.0),
        OutlierAction.RETURN,
    ),
    Answers(
        "half_open_failure_ejects_again_for_twice_as_long",
        [(1, FAIL), (2, FAIL), (3, FAIL), (14, FAIL)],
        OutlierState(num_ejections=2, ejected_until=34.0),
        OutlierAction.EJECT,
    ),
    Answers(
        "ejection_length_is_capped",
        [(100, FAIL)],
        OutlierState(num_ejections=3, ejected_until=125.0),
        OutlierAction.EJECT,
        start=OutlierState(num_ejections=2, ejected_until=90.0),
    ),
    Answers(
        "good_for_max_ejection_s_after_return_forgets_the_past",
        [(40, OK)],
        OutlierState(),
        OutlierAction.NONE,
        start=OutlierState(num_ejections=2, returned_at=15.0),
    ),
    Answers(
        "good_but_not_long_enough_keeps_the_multiplier",
        [(30, OK)],
        OutlierState(num_ejections=2, returned_at=15.0),
        OutlierAction.NONE,
        start=OutlierState(num_ejections=2, returned_at=15.0),
    ),
    Answers(
        "the_only_replica_is_never_ejected_at_50_percent",
        [(1, FAIL), (2, FAIL), (3, FAIL), (4, FAIL)],
        OutlierState(consecutive_failures=4),
        OutlierAction.REFUSED,
        num_replicas=1,
    ),
    Answers(
        "no_ejection_past_max_ejection_percent",
        [(1, FAIL), (2, FAIL), (3, FAIL)],
        OutlierState(consecutive_failures=3),
        OutlierAction.REFUSED,
        num_ejected=1,
        num_replicas=3,
    ),
    Answers(
        "a_second_of_four_may_go_at_50_percent",
        [(1, FAIL), (2, FAIL), (3, FAIL)],
        OutlierState(num_ejections=1, ejected_until=13.0),
        OutlierAction.EJECT,
        num_ejected=1,
        num_replicas=4,
    ),
    Answers(
        "refused_half_open_failure_stays_in_rotation",
        [(20, FAIL)],
        OutlierState(consecutive_failures=3, num_ejections=1),
        OutlierAction.REFUSED,
        num_ejected=1,
        start=OutlierState(num_ejections=1, ejected_until=13.0),
    ),
]


@pytest.mark.parametrize("case", SCENARIOS, ids=lambda case: case.name)
def test_decide_outlier(case: Answers) -> None:
    state, action = case.start, OutlierAction.NONE
    for at, failed in case.answers:
        state, action = decide_outlier(
            state,
            failed=failed,
            now=at,
            num_ejected=case.num_ejected,
            num_replicas=case.num_replicas,
            config=CONFIG,
        )
    assert state == case.expected
    assert action is case.last_action


def test_ejection_grows_linearly_up_to_the_cap() -> None:
    assert [ejection_s(n, CONFIG) for n in (1, 2, 3, 4)] == [10.0, 20.0, 25.0, 25.0]


def test_state_says_ejected_then_half_open() -> None:
    state = OutlierState(num_ejections=1, ejected_until=13.0)
    assert state.ejected(12.9)
    assert not state.half_open(12.9)
    assert not state.ejected(13.0)
    assert state.half_open(13.0)
    assert state.describe(10.0)["ejected_for_s"] == 3.0


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"consecutive_failures": 0}, "consecutive_failures"),
        ({"base_ejection_s": 0}, "base_ejection_s"),
        ({"base_ejection_s": 10, "max_ejection_s": 5}, "max_ejection_s"),
        ({"max_ejection_percent": 101}, "max_ejection_percent"),
    ],
)
def test_config_refuses_nonsense(config: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OutlierConfig(**config)


# ----------------------------------------------------------------------------- routing
POOLS = {
    "dedicated": PoolSpec("dedicated", frozenset({0})),
    "shared": PoolSpec("shared", frozenset({0, 1, 2})),
}


def rep(rid: str, pool: str = "shared", *, ready: bool = True, busy: int = 0) -> ReplicaView:
    return ReplicaView(id=rid, pool=pool, ready=ready, in_flight=busy, slots=4)


@dataclass(frozen=True)
class Route:
    name: str
    replicas: list[ReplicaView]
    ejected: frozenset[str]
    routable: set[str]  # ids still ready after the ejections


ROUTES = [
    Route("nothing_ejected_changes_nothing", [rep("a"), rep("b")], frozenset(), {"a", "b"}),
    Route("ejected_is_out_while_a_healthy_one_serves", [rep("a"), rep("b")], frozenset("a"), {"b"}),
    Route(
        "ejected_stays_while_the_healthy_one_is_busy",
        [rep("a"), rep("b", busy=4)],
        frozenset("a"),
        {"b"},
    ),
    Route("all_ejected_all_routable", [rep("a"), rep("b")], frozenset("ab"), {"a", "b"}),
    Route(
        "ejected_is_the_last_hope_when_the_other_is_not_ready",
        [rep("a"), rep("b", ready=False)],
        frozenset("a"),
        {"a"},
    ),
    Route(
        "ejected_shared_stays_for_the_levels_only_it_serves",
        [rep("a"), rep("d", "dedicated")],
        frozenset("a"),
        {"a", "d"},
    ),
    Route(
        "ejected_dedicated_goes_when_shared_covers_its_level",
        [rep("a"), rep("d", "dedicated")],
        frozenset("d"),
        {"a"},
    ),
]


@pytest.mark.parametrize("case", ROUTES, ids=lambda case: case.name)
def test_routable_views(case: Route) -> None:
    views = routable_views(case.replicas, case.ejected, POOLS)
    assert [v.id for v in views] == [v.id for v in case.replicas]  # order and all kept
    assert {v.id for v in views if v.ready} == case.routable


def test_router_sends_nothing_to_an_ejected_replica_while_another_serves() -> None:
    views = routable_views([rep("a"), rep("b", busy=3)], frozenset("a"), POOLS)
    assert pick_replica(views, 1, POOLS) == rep("b", busy=3)
    full = routable_views([rep("a"), rep("b", busy=4)], frozenset("a"), POOLS)
    assert pick_replica(full, 1, POOLS) is None  # wait for b rather than use a
