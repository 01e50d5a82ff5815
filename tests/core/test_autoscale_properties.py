"""decide_scale invariants under random demand, readiness and signal loss (Hypothesis).

The count always follows the decisions, as the controller applies them; floors are held
constant (no schedule or forecast), since a floor that moves is meant to move the count.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.core.autoscale import (
    AutoscaleConfig,
    DemandSample,
    Direction,
    ScaleDecision,
    ScaleInputs,
    ScaleReason,
    ScaleState,
    ScalingPolicy,
    ScalingRules,
    decide_scale,
)


@dataclass(frozen=True)
class Step:
    dt_s: float  # since the previous decision
    demand: float | None  # None: no sample
    sample_age_s: float
    ready_fraction: float


policies = st.builds(
    ScalingPolicy,
    kind=st.sampled_from(["pods", "percent"]),
    value=st.integers(1, 200),
    period_s=st.sampled_from([15.0, 30.0, 60.0, 120.0]),
)


def scaling_rules(windows_s: list[float]) -> st.SearchStrategy[ScalingRules]:
    return st.builds(
        ScalingRules,
        stabilization_window_s=st.sampled_from(windows_s),
        policies=st.lists(policies, min_size=1, max_size=3).map(tuple),
        select_policy=st.sampled_from(["max", "min", "disabled"]),
    )


@st.composite
def configs(draw: st.DrawFn) -> AutoscaleConfig:
    min_replicas = draw(st.integers(0, 3))
    return AutoscaleConfig(
        min_replicas=min_replicas,
        max_replicas=draw(st.integers(max(1, min_replicas), min_replicas + 8)),
        target_per_replica=draw(st.sampled_from([1.0, 4.0, 8.0])),
        scale_up=draw(scaling_rules([0.0, 30.0])),
        scale_down=draw(scaling_rules([0.0, 60.0, 300.0, 600.0])),
        panic_threshold=draw(st.sampled_from([None, 2.0])),
        stable_window_s=draw(st.sampled_from([0.0, 60.0])),
        scale_to_zero=draw(st.booleans()),
    )


steps = st.lists(
    st.builds(
        Step,
        dt_s=st.sampled_from([1.0, 15.0, 15.0, 15.0, 60.0, 300.0]),
        demand=st.one_of(st.none(), st.just(0.0), st.floats(0.0, 200.0)),
        sample_age_s=st.sampled_from([0.0, 0.0, 5.0, 61.0]),
        ready_fraction=st.sampled_from([1.0, 1.0, 0.5, 0.0]),
    ),
    min_size=1,
    max_size=40,
)


def simulate(config: AutoscaleConfig, start: int, script: list[Step]) -> list[ScaleDecision]:
    replicas, state, now = start, ScaleState(), 0.0
    decisions = []
    for step in script:
        now += step.dt_s
        sample = None
        if step.demand is not None:
            sample = DemandSample(now - step.sample_age_s, step.demand, 0.0)
        ready = int(replicas * step.ready_fraction)
        decision, state = decide_scale(ScaleInputs(replicas, ready, sample), state, config, now)
        decisions.append(decision)
        replicas = decision.desired_replicas
    return decisions


Run = tuple[AutoscaleConfig, list[ScaleDecision]]


@st.composite
def runs(draw: st.DrawFn) -> Run:
    config = draw(configs())
    start = draw(st.integers(config.min_replicas, config.max_replicas))
    return config, simulate(config, start, draw(steps))


# The three invariants below hold for any run: one test draws the runs (most of its time)
# and checks all three on each, the 300 examples each had when they were three tests.
@settings(max_examples=300, deadline=None)
@given(runs())
def test_any_run_keeps_the_bounds_the_down_window_and_holds_on_stale_signals(run: Run):
    count_stays_within_min_and_max_or_zero(run)
    no_scale_down_inside_the_down_window_after_a_scale_up(run)
    a_missing_or_stale_signal_never_changes_the_count(run)


def count_stays_within_min_and_max_or_zero(run: Run) -> None:
    config, decisions = run
    for decision in decisions:
        desired = decision.desired_replicas
        within = config.min_replicas <= desired <= config.max_replicas
        assert within or (desired == 0 and config.scale_to_zero), decision.describe()


def no_scale_down_inside_the_down_window_after_a_scale_up(run: Run) -> None:
    config, decisions = run
    window_s = config.scale_down.stabilization_window_s
    last_up_at: float | None = None
    for decision in decisions:
        if decision.direction is Direction.UP:
            last_up_at = decision.decided_at
        elif decision.direction is Direction.DOWN and last_up_at is not None:
            assert decision.decided_at - last_up_at >= window_s, decision.describe()


def a_missing_or_stale_signal_never_changes_the_count(run: Run) -> None:
    config, decisions = run
    for decision in decisions:
        sample = decision.inputs.demand
        if sample is None or decision.decided_at - sample.measured_at > config.max_signal_age_s:
            assert decision.desired_replicas == decision.current_replicas
            assert decision.reason is ScaleReason.HOLD_STALE_SIGNAL


@settings(max_examples=200, deadline=None)
@given(
    up=st.integers(1, 6),
    up_period_s=st.sampled_from([15.0, 60.0]),
    down=st.integers(1, 6),
    down_period_s=st.sampled_from([15.0, 60.0, 120.0]),
    start=st.integers(1, 20),
    script=steps,
)
def test_pods_policies_bound_the_move_from_the_count_at_the_period_start(
    up: int, up_period_s: float, down: int, down_period_s: float, start: int, script: list[Step]
):
    """HPA: a Pods policy allows ``value`` replicas more (or fewer) than the count in effect
    one period ago; what was added in the period counts against it, what was removed for it."""
    config = AutoscaleConfig(
        min_replicas=1,
        max_replicas=20,
        target_per_replica=1.0,
        stable_window_s=0.0,
        scale_up=ScalingRules(0.0, (ScalingPolicy("pods", up, up_period_s),)),
        scale_down=ScalingRules(0.0, (ScalingPolicy("pods", down, down_period_s),)),
    )
    decisions = simulate(config, start, script)

    def count_at(at: float) -> int:
        before = [d.desired_replicas for d in decisions if d.decided_at <= at]
        return before[-1] if before else start

    for decision in decisions:
        now, desired = decision.decided_at, decision.desired_replicas
        if decision.direction is Direction.UP:
            assert desired <= count_at(now - up_period_s) + up, decision.describe()
        elif decision.direction is Direction.DOWN:
            assert desired >= count_at(now - down_period_s) - down, decision.describe()


@settings(max_examples=100, deadline=None)
@given(runs())
def test_same_inputs_same_decisions(run: Run):
    config, decisions = run
    replayed_state = ScaleState()
    for decision in decisions:
        again, replayed_state = decide_scale(
            decision.inputs, replayed_state, config, decision.decided_at
        )
        assert again == decision
