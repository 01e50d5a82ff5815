"""decide_scale scenarios, one per row: the Kubernetes HPA's worked examples, then tidegate's.

Each scenario starts from ``ScaleState()`` with ``start`` replicas and decides at every tick;
the replicas then become what was decided (and ready, unless the tick says otherwise). The
HPA rows use ``target_per_replica=1`` and ``stable_window_s=0`` (the HPA scales on the metric
it is given), so a tick's demand *is* the metric recommendation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from tidegate.core.autoscale import (
    DEFAULT_SCALE_UP,
    HPA_DEFAULT_SCALE_DOWN,
    AutoscaleConfig,
    DemandSample,
    Direction,
    ScaleDecision,
    ScaleInputs,
    ScaleReason,
    ScaleState,
    ScalingPolicy,
    ScalingRules,
    Schedule,
    decide_scale,
    replay_decisions,
    replay_scale,
)

R = ScaleReason
MON, FRI, SAT, SUN = 0, 4, 5, 6


def hpa(
    up: ScalingRules = DEFAULT_SCALE_UP,
    down: ScalingRules = HPA_DEFAULT_SCALE_DOWN,
    *,
    min_replicas: int = 1,
    max_replicas: int = 1000,
) -> AutoscaleConfig:
    """An HPA with ``behavior`` up/down whose metric is the desired replica count."""
    return AutoscaleConfig(
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        target_per_replica=1.0,
        stable_window_s=0.0,
        scale_up=up,
        scale_down=down,
    )


def rules(*policies: ScalingPolicy, window_s: float = 0.0, select: str = "max") -> ScalingRules:
    return ScalingRules(window_s, policies, select)


def pods(value: int, period_s: float) -> ScalingPolicy:
    return ScalingPolicy("pods", value, period_s)


def percent(value: int, period_s: float) -> ScalingPolicy:
    return ScalingPolicy("percent", value, period_s)


def every(step_s: float, *demands: float) -> tuple[tuple[float, float], ...]:
    return tuple((i * step_s, demand) for i, demand in enumerate(demands))


@dataclass(frozen=True)
class ReplayScenario:
    name: str
    config: AutoscaleConfig
    start: int
    points: tuple[tuple[float, float], ...]
    expected: tuple[int, ...]


HPA_DOC_SCENARIOS = [
    # "Scaling policies": 80 replicas to 10 with Pods 4/60s and Percent 10/60s (Max): the
    # first step removes 8, the next 8 again (10% of 72 is 7.2, "rounded up to 8"), then
    # below 40 replicas the Pods policy removes 4 at a time.
    ReplayScenario(
        "docs_scaling_policies_80_to_10_pods_4_or_10_percent_per_minute",
        hpa(down=rules(pods(4, 60), percent(10, 60))),
        80,
        every(60, *[10] * 14),
        (72, 64, 57, 51, 45, 40, 36, 32, 28, 24, 20, 16, 12, 10),
    ),
    ReplayScenario(
        "docs_scaling_policies_hold_for_their_whole_period",
        hpa(down=rules(pods(4, 60), percent(10, 60))),
        80,
        every(15, *[10] * 9),
        (72, 72, 72, 72, 64, 64, 64, 64, 57),
    ),
    # "Limit scale down rate": at most 10% of the pods per minute.
    ReplayScenario(
        "docs_limit_scale_down_rate_10_percent_per_minute",
        hpa(down=rules(percent(10, 60))),
        20,
        every(60, *[1] * 14),
        (18, 16, 14, 12, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1),
    ),
    # "... no more than 5 Pods are removed per minute": Percent 10 + Pods 5, selectPolicy Min.
    ReplayScenario(
        "docs_select_policy_min_at_most_5_pods_per_minute",
        hpa(down=rules(percent(10, 60), pods(5, 60), select="min")),
        100,
        every(60, *[10] * 14),
        (95, 90, 85, 80, 75, 70, 65, 60, 55, 50, 45, 40, 36, 32),
    ),
    # "Disable scale down": selectPolicy Disabled; scaling up still works.
    ReplayScenario(
        "docs_disable_scale_down",
        hpa(down=ScalingRules(0.0, (), "disabled")),
        10,
        every(60, 1, 1, 1, 1, 20, 1, 1),
        (10, 10, 10, 10, 20, 20, 20),
    ),
    # Default behavior: "4 pods or a 100% ... may at most be added every 15 seconds".
    ReplayScenario(
        "docs_default_scale_up_4_pods_or_double_every_15s",
        hpa(),
        1,
        every(15, *[100] * 7),
        (5, 10, 20, 40, 80, 100, 100),
    ),
    # Default behavior: a 300 s scale-down window, then 100% per 15 s. The last high
    # recommendation is at 60 s, so the count holds until 360 s and then drops at once.
    ReplayScenario(
        "docs_default_scale_down_stabilization_5_minutes",
        hpa(),
        10,
        every(15, *[10] * 5, *[2] * 21),
        (*[10] * 24, 2, 2),
    ),
    # KEP-853 "scale up as fast as possible": Percent 900 per 60 s, 1 -> 10 -> 100 -> 1000.
    ReplayScenario(
        "kep_scale_up_as_fast_as_possible_percent_900_per_minute",
        hpa(up=rules(percent(900, 60))),
        1,
        every(60, *[5000] * 4),
        (10, 100, 1000, 1000),
    ),
    ReplayScenario(
        "kep_percent_900_per_minute_holds_within_the_minute",
        hpa(up=rules(percent(900, 60))),
        1,
        every(15, *[5000] * 6),
        (10, 10, 10, 10, 100, 100),
    ),
    # Pods 4/60s and 100%/15s, Max: the percent policy doubles every 15 s from the count at
    # the start of *its* period, while the pods policy has added its 4 for the minute.
    ReplayScenario(
        "pods_4_per_60s_or_100_percent_per_15s_max",
        hpa(up=rules(pods(4, 60), percent(100, 15))),
        1,
        every(15, *[1000] * 6),
        (5, 10, 20, 40, 80, 160),
    ),
    # Same with Min: each policy counts the replicas added within its own period against it,
    # so the pods policy caps the minute at start + 4 (1 -> 5), then moves its start on.
    ReplayScenario(
        "pods_4_per_60s_or_100_percent_per_15s_min",
        hpa(up=rules(pods(4, 60), percent(100, 15), select="min")),
        1,
        every(15, *[1000] * 6),
        (2, 4, 5, 5, 6, 8),
    ),
    # KEP-853 "avoid false positive signals for scaling up": a scale-up window takes the
    # lowest recommendation of the window, so a one-tick spike never scales up.
    ReplayScenario(
        "kep_scale_up_window_ignores_a_spike",
        hpa(up=rules(pods(4, 15), window_s=60)),
        1,
        every(15, 1, 10, 1, 10, 10, 10, 10, 10),
        (1, 1, 1, 1, 1, 1, 5, 9),
    ),
    # float64 like the HPA: 50 * (1 + 10/100) is 55.00000000000001, which rounds up to 56.
    ReplayScenario(
        "percent_rounding_matches_the_hpa_float64",
        hpa(up=rules(percent(10, 60))),
        50,
        every(60, 100),
        (56,),
    ),
    # On restart the HPA records the count it finds: no scale-down before a full window.
    ReplayScenario(
        "restart_waits_a_full_window_before_scaling_down",
        hpa(),
        6,
        every(60, 1, 1, 1, 1, 1, 1),
        (6, 6, 6, 6, 6, 1),
    ),
]


@pytest.mark.parametrize("scenario", HPA_DOC_SCENARIOS, ids=lambda s: s.name)
def test_hpa_behavior(scenario: ReplayScenario) -> None:
    assert replay_scale(scenario.points, scenario.config, scenario.start) == scenario.expected


# --------------------------------------------------------------------------- tidegate rows


@dataclass(frozen=True)
class Tick:
    at: float
    demand: float | None  # None: no sample
    ready: int | None = None  # None: every replica is ready
    local_time: tuple[int, int] | None = None
    forecast: int | None = None
    sample_age_s: float = 0.0


@dataclass(frozen=True)
class ScaleScenario:
    name: str
    start: int
    ticks: tuple[Tick, ...]
    expected: tuple[int, ...]  # desired replicas after each tick
    reasons: tuple[ScaleReason, ...] | None = None  # checked when given
    config: AutoscaleConfig = field(default_factory=AutoscaleConfig)


def ticks(step_s: float, *demands: float | None) -> tuple[Tick, ...]:
    return tuple(Tick(i * step_s, demand) for i, demand in enumerate(demands))


def run(scenario: ScaleScenario) -> list[ScaleDecision]:
    replicas, state = scenario.start, ScaleState()
    decisions = []
    for tick in scenario.ticks:
        sample = None
        if tick.demand is not None:
            sample = DemandSample(tick.at - tick.sample_age_s, queued=tick.demand, in_flight=0)
        ready = replicas if tick.ready is None else min(tick.ready, replicas)
        inputs = ScaleInputs(replicas, ready, sample, tick.local_time, tick.forecast)
        decision, state = decide_scale(inputs, state, scenario.config, tick.at)
        decisions.append(decision)
        replicas = decision.desired_replicas
    return decisions


QUICK_DOWN = AutoscaleConfig(  # scale-down without a window: the rule under test shows alone
    max_replicas=20,
    stable_window_s=0.0,
    scale_down=rules(percent(100, 15)),
)
PANIC = AutoscaleConfig(
    max_replicas=20,
    panic_threshold=2.0,
    panic_window_s=15.0,
    stable_window_s=60.0,
    scale_down=rules(percent(100, 15)),
)
WORKDAYS = Schedule(days=(0, 1, 2, 3, 4), from_minute=8 * 60, to_minute=18 * 60, min_replicas=4)
SCHEDULED = AutoscaleConfig(max_replicas=10, schedules=(WORKDAYS,), cold_start_s=300.0)
FRIDAY_NIGHT = Schedule(days=(FRI,), from_minute=22 * 60, to_minute=2 * 60, min_replicas=3)
TO_ZERO = AutoscaleConfig(scale_to_zero=True)


def at_time(at: float, weekday: int, hour: int, minute: int, demand: float = 1.0) -> Tick:
    return Tick(at, demand, local_time=(weekday, hour * 60 + minute))


SCENARIOS = [
    ScaleScenario(
        "tolerance_band_holds_at_ratio_1_1",
        1,
        ticks(15, 8.8, 8.9),
        (1, 2),
        (R.TOLERANCE, R.TARGET),
        QUICK_DOWN,
    ),
    ScaleScenario(
        "tolerance_band_holds_at_ratio_0_9",
        4,
        ticks(15, 28.8, 20),
        (4, 3),
        (R.TOLERANCE, R.TARGET),
        QUICK_DOWN,
    ),
    ScaleScenario(
        "flapping_load_scales_up_once_and_never_down_inside_the_window",
        1,
        ticks(15, 40, 4, 40, 4, 40, 4, 40, 4),
        (5, 5, 5, 5, 5, 5, 5, 5),
        (R.TARGET, *[R.STABILIZED, R.TOLERANCE] * 3, R.STABILIZED),
        AutoscaleConfig(max_replicas=10, stable_window_s=0.0),
    ),
    ScaleScenario(
        "noise_around_the_target_never_moves",
        2,
        ticks(15, 15, 17, 14.5, 17.5, 16),
        (2, 2, 2, 2, 2),
        (R.TOLERANCE,) * 5,
        QUICK_DOWN,
    ),
    ScaleScenario(
        "the_stable_window_averages_a_one_tick_spike",
        1,
        ticks(15, 8, 8, 8, 40, 8),
        (1, 1, 1, 2, 2),
        config=AutoscaleConfig(max_replicas=10, stable_window_s=60.0),
    ),
    ScaleScenario(
        "panic_scales_on_the_short_window_and_holds_until_calm",
        1,
        ticks(15, 8, 8, 8, 80, 80, 0, 0, 0, 0),
        (1, 1, 1, 5, 10, 10, 10, 10, 1),
        (*[R.TOLERANCE] * 3, R.RATE_LIMITED, R.PANIC, R.PANIC, R.PANIC, R.PANIC, R.MIN),
        PANIC,
    ),
    ScaleScenario(
        "without_panic_the_same_burst_scales_on_the_stable_window",
        1,
        ticks(15, 8, 8, 8, 80, 80, 0, 0, 0, 0),
        (1, 1, 1, 4, 6, 6, 5, 3, 1),
        config=AutoscaleConfig(
            max_replicas=20, stable_window_s=60.0, scale_down=rules(percent(100, 15))
        ),
    ),
    ScaleScenario(
        "schedule_floor_starts_a_cold_start_early",
        1,
        (at_time(0, MON, 7, 54), at_time(15, MON, 7, 55), at_time(30, MON, 8, 0)),
        (1, 4, 4),
        (R.TARGET, R.SCHEDULE, R.SCHEDULE),
        SCHEDULED,
    ),
    ScaleScenario(
        "schedule_floor_ends_through_the_down_policies",
        4,
        (at_time(0, MON, 17, 59), at_time(15, MON, 18, 0), at_time(75, MON, 18, 1)),
        (4, 2, 1),
        (R.SCHEDULE, R.RATE_LIMITED, R.TARGET),
        AutoscaleConfig(
            max_replicas=10,
            schedules=(WORKDAYS,),
            stable_window_s=0.0,
            scale_down=rules(percent(50, 60)),
        ),
    ),
    ScaleScenario(
        "schedule_floor_is_off_at_the_weekend",
        1,
        (at_time(0, SAT, 9, 0),),
        (1,),
        (R.TARGET,),
        SCHEDULED,
    ),
    ScaleScenario(
        "schedule_wraps_past_midnight_into_saturday",
        1,
        (at_time(0, SAT, 1, 59), at_time(15, SAT, 2, 0)),
        (3, 1),
        (R.SCHEDULE, R.TARGET),
        AutoscaleConfig(
            schedules=(FRIDAY_NIGHT,), stable_window_s=0.0, scale_down=rules(percent(100, 15))
        ),
    ),
    ScaleScenario(
        "forecast_floor_raises_the_count",
        2,
        (Tick(0, 8, forecast=5),),
        (5,),
        (R.FORECAST,),
        AutoscaleConfig(max_replicas=10),
    ),
    ScaleScenario(
        "forecast_floor_never_scales_down",
        6,
        (Tick(0, 48, forecast=2), Tick(15, 60, forecast=0)),
        (6, 8),
        (R.TOLERANCE, R.TARGET),
        AutoscaleConfig(max_replicas=10, stable_window_s=0.0),
    ),
    ScaleScenario(
        "forecast_floor_is_capped_at_max",
        2,
        (Tick(0, 8, forecast=50),),
        (10,),
        (R.FORECAST,),
        AutoscaleConfig(max_replicas=10),
    ),
    ScaleScenario(
        "scale_to_zero_after_the_down_window_without_demand",
        1,
        (Tick(0, 0), Tick(300, 0), Tick(599, 0), Tick(600, 0), Tick(900, 0)),
        (1, 1, 1, 0, 0),
        (R.STABILIZED, R.STABILIZED, R.STABILIZED, R.SCALE_TO_ZERO, R.SCALE_TO_ZERO),
        TO_ZERO,
    ),
    ScaleScenario(
        "demand_restarts_the_idle_clock",
        1,
        (Tick(0, 0), Tick(300, 3), Tick(600, 0), Tick(899, 0), Tick(900, 0)),
        (1, 1, 1, 1, 0),
        config=TO_ZERO,
    ),
    ScaleScenario(
        "zero_replicas_wait_for_demand_then_start_one_at_once",
        0,
        (Tick(0, 0), Tick(15, 0), Tick(30, 100), Tick(45, 100, ready=0)),
        (0, 0, 1, 4),
        (R.SCALE_TO_ZERO, R.SCALE_TO_ZERO, R.COLD_START_FROM_ZERO, R.MAX),
        TO_ZERO,
    ),
    ScaleScenario(
        "scale_from_zero_is_remembered_by_the_down_window",
        0,
        ticks(15, 5, 0, 0),
        (1, 1, 1),
        (R.COLD_START_FROM_ZERO, R.STABILIZED, R.STABILIZED),
        AutoscaleConfig(min_replicas=0, stable_window_s=0.0),
    ),
    ScaleScenario(
        # the smallest float of demand: demand / target underflows to 0, a replica it needs
        "a_vanishing_demand_from_zero_is_remembered_as_one_replica",
        0,
        (Tick(1, 5e-324, ready=0), Tick(2, 0)),
        (1, 1),
        (R.COLD_START_FROM_ZERO, R.STABILIZED),
        AutoscaleConfig(min_replicas=0, max_replicas=1, target_per_replica=4.0),
    ),
    ScaleScenario(
        "a_schedule_floor_keeps_a_model_from_zero",
        0,
        (Tick(0, 0, local_time=(MON, 9 * 60)),),
        (4,),
        (R.SCHEDULE,),
        AutoscaleConfig(scale_to_zero=True, max_replicas=10, schedules=(WORKDAYS,)),
    ),
    ScaleScenario(
        "missing_signal_holds",
        3,
        ticks(15, None, None),
        (3, 3),
        (R.HOLD_STALE_SIGNAL,) * 2,
        QUICK_DOWN,
    ),
    ScaleScenario(
        "missing_signal_never_reads_as_zero",
        1,
        ticks(300, None, None, None, None, None),
        (1,) * 5,
        (R.HOLD_STALE_SIGNAL,) * 5,
        TO_ZERO,
    ),
    ScaleScenario(
        "stale_signal_holds_fresh_one_acts",
        3,
        (Tick(0, 0, sample_age_s=60.5), Tick(15, 0, sample_age_s=60.0)),
        (3, 1),
        (R.HOLD_STALE_SIGNAL, R.MIN),
        QUICK_DOWN,
    ),
    ScaleScenario(
        "above_max_goes_to_max_at_once",
        12,
        ticks(15, 200),
        (10,),
        (R.MAX,),
        AutoscaleConfig(max_replicas=10),
    ),
    ScaleScenario(
        "below_min_goes_to_min_at_once",
        0,
        ticks(15, 0),
        (2,),
        (R.MIN,),
        AutoscaleConfig(min_replicas=2),
    ),
    ScaleScenario(
        "recommendation_above_max_is_clamped",
        8,
        ticks(15, 200),
        (10,),
        (R.MAX,),
        AutoscaleConfig(max_replicas=10),
    ),
    ScaleScenario(
        "warming_replicas_cover_an_overloaded_ready_set",
        4,
        (Tick(0, 24, ready=2),),
        (4,),
        (R.WARMING,),
        QUICK_DOWN,
    ),
    ScaleScenario(
        "nothing_ready_yet_scales_up_on_demand",
        2,
        (Tick(0, 40, ready=0),),
        (5,),
        (R.TARGET,),
        QUICK_DOWN,
    ),
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_decide_scale(scenario: ScaleScenario) -> None:
    decisions = run(scenario)
    assert tuple(d.desired_replicas for d in decisions) == scenario.expected
    if scenario.reasons is not None:
        assert tuple(d.reason for d in decisions) == scenario.reasons


def test_a_decision_records_its_inputs_window_limits_and_clamps() -> None:
    config = AutoscaleConfig(max_replicas=10, stable_window_s=0.0)
    (decision,) = replay_decisions([(0.0, 80.0)], config, initial_replicas=1)
    assert decision.current_replicas == 1
    assert decision.desired_replicas == 5
    assert decision.direction is Direction.UP
    assert decision.reason == "rate_limited"
    assert decision.inputs.demand == DemandSample(0.0, 80.0, 0.0)
    assert decision.demand == 80.0
    assert decision.ratio == 10.0
    assert decision.recommendation == 10
    assert decision.stabilized == 10
    assert (decision.window_lowest, decision.window_highest) == (10, 10)
    assert decision.scale_up_limit == 5
    assert decision.scale_down_limit is None
    assert (decision.floor, decision.ceiling) == (1, 10)
    assert decision.clamps == (R.RATE_LIMITED,)
    assert decision.describe() == (
        "1 -> 5 up (rate_limited); demand 80 on 1 ready = 10.00x target; recommended 10; "
        "window [10, 10]; up limit 5; bounds [1, 10]; clamps rate_limited"
    )


def test_a_held_decision_names_no_signal() -> None:
    (decision,) = replay_decisions([(0.0, None)], AutoscaleConfig(), initial_replicas=2)
    assert decision.direction is Direction.NONE
    assert decision.reason == "hold_stale_signal"
    assert decision.demand is None
    assert decision.recommendation is None
    assert decision.describe().startswith("2 -> 2 none (hold_stale_signal)")


def test_a_measured_cold_start_overrides_the_configured_lead() -> None:
    sample = DemandSample(0.0, 1.0, 0.0)
    early = ScaleInputs(1, 1, sample, local_time=(MON, 7 * 60 + 45), cold_start_s=900.0)
    decision, _ = decide_scale(early, ScaleState(), SCHEDULED, 0.0)
    assert decision.desired_replicas == 4
    assert decision.reason == "schedule"
    late = ScaleInputs(1, 1, sample, local_time=(MON, 7 * 60 + 45), cold_start_s=60.0)
    decision, _ = decide_scale(late, ScaleState(), SCHEDULED, 0.0)
    assert decision.desired_replicas == 1


def test_state_forgets_what_no_window_or_period_can_see() -> None:
    config = AutoscaleConfig(max_replicas=50, stable_window_s=60.0)
    state = ScaleState()
    replicas = 1
    for i in range(400):
        now = i * 15.0
        demand = 400.0 if (i // 40) % 2 == 0 else 0.0
        inputs = ScaleInputs(replicas, replicas, DemandSample(now, demand, 0.0))
        decision, state = decide_scale(inputs, state, config, now)
        replicas = decision.desired_replicas
    assert len(state.recommendations) <= 600 / 15 + 1
    assert len(state.samples) <= 60 / 15 + 1
    assert len(state.scale_up_events) <= 1
    assert len(state.scale_down_events) <= 60 / 15 + 1


@pytest.mark.parametrize(
    ("schedule", "weekday", "minute", "lead", "active"),
    [
        (WORKDAYS, MON, 8 * 60, 0, True),
        (WORKDAYS, MON, 18 * 60, 0, False),
        (WORKDAYS, MON, 7 * 60 + 55, 5, True),
        (WORKDAYS, MON, 7 * 60 + 54, 5, False),
        (WORKDAYS, SAT, 9 * 60, 0, False),
        (FRIDAY_NIGHT, FRI, 23 * 60, 0, True),
        (FRIDAY_NIGHT, SAT, 1 * 60 + 59, 0, True),
        (FRIDAY_NIGHT, SAT, 2 * 60, 0, False),
        (FRIDAY_NIGHT, SAT, 23 * 60, 0, False),
        (FRIDAY_NIGHT, FRI, 21 * 60 + 50, 10, True),
        (Schedule((MON,), 0, 6 * 60, 2), SUN, 23 * 60 + 50, 10, True),
        (Schedule((MON,), 0, 6 * 60, 2), SUN, 23 * 60 + 49, 10, False),
        (Schedule((SUN,), 22 * 60, 1440, 2), SUN, 23 * 60 + 59, 0, True),
        (Schedule((SUN,), 22 * 60, 1440, 2), MON, 0, 0, False),
    ],
)
def test_schedule_windows(
    schedule: Schedule, weekday: int, minute: int, lead: int, active: bool
) -> None:
    assert schedule.is_active(weekday, minute, lead) is active


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: AutoscaleConfig(min_replicas=5, max_replicas=4), "min_replicas <= max_replicas"),
        (lambda: AutoscaleConfig(target_per_replica=0), "target_per_replica"),
        (lambda: AutoscaleConfig(panic_threshold=1.0), "panic_threshold"),
        (lambda: AutoscaleConfig(max_signal_age_s=0), "max_signal_age_s"),
        (lambda: ScalingPolicy("replicas", 1, 15), "policy kind"),
        (lambda: ScalingPolicy("pods", 0, 15), "policy value"),
        (lambda: ScalingPolicy("pods", 1, 1801), "period_s"),
        (lambda: ScalingRules(0.0, (pods(1, 15),), "fastest"), "select_policy"),
        (lambda: ScalingRules(3601.0, (pods(1, 15),)), "stabilization_window_s"),
        (lambda: ScalingRules(0.0, ()), "at least one policy"),
        (lambda: Schedule((7,), 0, 60, 1), "days"),
        (lambda: Schedule((0,), 60, 60, 1), "differ from from_minute"),
        (lambda: Schedule((0,), 0, 1441, 1), "to_minute"),
    ],
)
def test_invalid_settings_are_refused(make: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()
