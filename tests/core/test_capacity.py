"""find_knee, decide_climb and decide_point, one scenario per row."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from tidegate.core.capacity import (
    CapacityPoint,
    Climb,
    Knee,
    NoKnee,
    PointVerdict,
    Slo,
    StabilityRule,
    StopClimbing,
    WindowStats,
    decide_climb,
    decide_point,
    find_knee,
    meets_slo,
    windows_agree,
)


def pt(size: float, tput: float, p95: float, **extra: float) -> CapacityPoint:
    return CapacityPoint(size=size, throughput_per_s=tput, p95_ms=p95, **extra)


@dataclass(frozen=True)
class KneeScenario:
    name: str
    points: list[CapacityPoint]
    slo: Slo
    knee_size: float | None  # None: NoKnee expected
    closest_size: float | None = None  # for NoKnee: the point reported as closest


SLO_100 = Slo(p95_ms=100.0)
KNEE_SCENARIOS = [
    KneeScenario(
        "highest_throughput_under_the_slo_wins",
        [pt(1, 50, 20), pt(2, 90, 40), pt(4, 150, 80), pt(8, 200, 160)],
        SLO_100,
        4,
    ),
    KneeScenario(
        "every_point_meets_the_slo_takes_the_fastest",
        [pt(1, 50, 20), pt(2, 90, 40), pt(4, 150, 80)],
        Slo(p95_ms=1000.0),
        4,
    ),
    KneeScenario(
        "no_slo_means_highest_throughput",
        [pt(1, 50, 20), pt(2, 90, 400), pt(4, 150, 8000)],
        Slo(),
        4,
    ),
    KneeScenario(
        "smaller_config_within_five_percent_is_preferred",
        [pt(8, 200, 60), pt(16, 208, 90), pt(32, 209, 99)],
        SLO_100,
        8,
    ),
    KneeScenario(
        "six_percent_apart_is_not_a_tie",
        [pt(8, 196, 60), pt(16, 208.6, 90)],
        SLO_100,
        16,
    ),
    KneeScenario(
        "exactly_five_percent_below_counts_as_a_tie",
        [pt(8, 95, 60), pt(16, 100, 90)],
        SLO_100,
        8,
    ),
    KneeScenario(
        "tie_is_measured_against_the_best_not_chained",
        # 4 is within 5% of 8, 8 within 5% of 16, but 4 is 9% below 16.
        [pt(4, 91, 30), pt(8, 95.5, 50), pt(16, 100, 90)],
        SLO_100,
        8,
    ),
    KneeScenario(
        "a_faster_point_that_breaks_the_slo_is_ignored",
        [pt(1, 50, 20), pt(2, 90, 99.9), pt(4, 300, 100.1)],
        SLO_100,
        2,
    ),
    KneeScenario(
        "slo_met_exactly_at_the_bound_counts",
        [pt(1, 50, 20), pt(2, 90, 100.0)],
        SLO_100,
        2,
    ),
    KneeScenario(
        "no_point_meets_the_slo_reports_the_closest",
        [pt(1, 50, 120), pt(2, 90, 150), pt(4, 150, 300)],
        SLO_100,
        None,
        closest_size=1,
    ),
    KneeScenario(
        "too_many_errors_disqualify_a_point",
        [pt(1, 50, 20), pt(2, 90, 40, error_rate=0.02)],
        SLO_100,
        1,
    ),
    KneeScenario(
        "generation_needs_both_ttft_and_itl",
        [
            pt(1, 100, 900, ttft_p95_ms=50, itl_p95_ms=10),
            pt(4, 350, 1500, ttft_p95_ms=90, itl_p95_ms=18),
            pt(8, 600, 2500, ttft_p95_ms=110, itl_p95_ms=31),
        ],
        Slo(ttft_p95_ms=120, itl_p95_ms=30),
        4,
    ),
    KneeScenario(
        "a_target_on_a_measure_the_point_lacks_is_not_met",
        [pt(1, 100, 50), pt(2, 150, 60)],
        Slo(ttft_p95_ms=120),
        None,
        closest_size=1,
    ),
    KneeScenario(
        "nothing_completed_never_meets_the_slo",
        [pt(1, 50, 20), pt(2, 0, math.inf)],
        SLO_100,
        1,
    ),
    KneeScenario("no_points_no_knee", [], SLO_100, None),
]


@pytest.mark.parametrize("case", KNEE_SCENARIOS, ids=lambda c: c.name)
def test_find_knee(case: KneeScenario) -> None:
    outcome = find_knee(case.points, case.slo)
    if case.knee_size is None:
        assert isinstance(outcome, NoKnee)
        closest = outcome.closest.size if outcome.closest is not None else None
        assert closest == case.closest_size
        return
    assert isinstance(outcome, Knee)
    assert outcome.point.size == case.knee_size
    assert outcome.point in case.points
    assert meets_slo(outcome.point, case.slo)


def test_knee_names_the_best_when_a_smaller_one_wins() -> None:
    outcome = find_knee([pt(8, 200, 60), pt(16, 208, 90)], SLO_100)
    assert isinstance(outcome, Knee)
    assert (outcome.point.size, outcome.best.size) == (8, 16)
    assert "within 5%" in outcome.reason


@dataclass(frozen=True)
class ClimbScenario:
    name: str
    throughputs: list[float]
    p95s: list[float]
    slo: Slo
    stop: str | None  # None: climb on; else the reason


CLIMB_SCENARIOS = [
    ClimbScenario("nothing_measured_climbs", [], [], SLO_100, None),
    ClimbScenario("still_gaining_climbs", [10, 20, 40, 80, 160], [1] * 5, SLO_100, None),
    ClimbScenario("slo_broken_stops_at_once", [10, 20], [50, 101], SLO_100, "slo_broken"),
    ClimbScenario("no_slo_never_stops_for_latency", [10, 20], [50, 10_000], Slo(), None),
    ClimbScenario("four_flat_steps_stop", [100, 101, 102, 103, 104], [1] * 5, SLO_100, "plateau"),
    ClimbScenario(
        "five_percent_over_four_steps_climbs_on",
        [100, 100, 100, 100, 105.1],
        [1] * 5,
        SLO_100,
        None,
    ),
    ClimbScenario("four_points_are_too_few_to_judge", [100, 100, 100, 100], [1] * 4, SLO_100, None),
    ClimbScenario(
        "falling_throughput_stops",
        [100, 200, 150, 140, 130, 120],
        [1] * 6,
        SLO_100,
        "plateau",
    ),
    ClimbScenario(
        "an_early_peak_is_not_forgotten",
        # The best before the last four is 200: the last four never beat it by 5%.
        [50, 200, 120, 150, 180, 205],
        [1] * 6,
        SLO_100,
        "plateau",
    ),
]


@pytest.mark.parametrize("case", CLIMB_SCENARIOS, ids=lambda c: c.name)
def test_decide_climb(case: ClimbScenario) -> None:
    points = [
        pt(2**i, tput, p95)
        for i, (tput, p95) in enumerate(zip(case.throughputs, case.p95s, strict=True))
    ]
    decision = decide_climb(points, case.slo)
    if case.stop is None:
        assert isinstance(decision, Climb)
    else:
        assert isinstance(decision, StopClimbing)
        assert decision.reason == case.stop


def w(tput: float, p95: float) -> WindowStats:
    return WindowStats(throughput_per_s=tput, p95_ms=p95, duration_s=1.0)


RULE = StabilityRule(num_windows=3, tolerance=0.10, min_seconds=5.0, max_seconds=30.0)


@dataclass(frozen=True)
class PointScenario:
    name: str
    windows: list[WindowStats]
    elapsed_s: float
    verdict: PointVerdict


POINT_SCENARIOS = [
    PointScenario(
        "three_agreeing_windows_after_min_time_are_stable",
        [w(100, 50), w(105, 52), w(109, 54)],
        6.0,
        PointVerdict.STABLE,
    ),
    PointScenario(
        "agreeing_windows_before_min_time_measure_more",
        [w(100, 50), w(100, 50), w(100, 50)],
        4.9,
        PointVerdict.MEASURE,
    ),
    PointScenario(
        "two_windows_are_not_enough",
        [w(100, 50), w(100, 50)],
        10.0,
        PointVerdict.MEASURE,
    ),
    PointScenario(
        "throughput_spread_over_ten_percent_measures_more",
        [w(100, 50), w(105, 50), w(111, 50)],
        10.0,
        PointVerdict.MEASURE,
    ),
    PointScenario(
        "p95_spread_over_ten_percent_measures_more",
        [w(100, 50), w(100, 50), w(100, 56)],
        10.0,
        PointVerdict.MEASURE,
    ),
    PointScenario(
        "only_the_last_three_count_so_a_warm_up_window_is_forgotten",
        [w(10, 500), w(100, 50), w(101, 51), w(102, 52)],
        6.0,
        PointVerdict.STABLE,
    ),
    PointScenario(
        "a_window_with_nothing_done_is_never_stable",
        [w(0, math.inf), w(0, math.inf), w(0, math.inf)],
        10.0,
        PointVerdict.MEASURE,
    ),
    PointScenario(
        "out_of_time_is_unstable",
        [w(100, 50), w(150, 50), w(100, 90)],
        30.0,
        PointVerdict.UNSTABLE,
    ),
    PointScenario(
        "stable_wins_over_out_of_time",
        [w(100, 50), w(100, 50), w(100, 50)],
        31.0,
        PointVerdict.STABLE,
    ),
]


@pytest.mark.parametrize("case", POINT_SCENARIOS, ids=lambda c: c.name)
def test_decide_point(case: PointScenario) -> None:
    assert decide_point(case.windows, case.elapsed_s, RULE) is case.verdict


def test_windows_agree_needs_windows() -> None:
    assert not windows_agree([], 0.1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_windows": 0}, "num_windows"),
        ({"min_seconds": 10.0, "max_seconds": 5.0}, "max_seconds"),
    ],
    ids=["no_windows", "max_below_min"],
)
def test_stability_rule_rejects_nonsense(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StabilityRule(**kwargs)  # type: ignore[arg-type]
