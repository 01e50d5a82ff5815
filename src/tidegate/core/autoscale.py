"""decide_scale: how many replicas a model should have now, and the rule that said so.

Design note. The autoscaler is a policy in the Ray Serve sense: a plain function of what the
controller observed and of the state it returned last time, giving ``(decision, new_state)``.
The controller (or the simulator, or ``replay_scale``) reads the clock, the queue and the
wall time, calls it every ``interval_s``, and applies ``desired_replicas``. One decision:

1. *Signal.* Demand = queued + in-flight, averaged over ``stable_window_s``; per ready
   replica (those that passed warm-up). No sample, or one older than ``max_signal_age_s``:
   hold the current count (a broken metrics path must never read as "no traffic").
2. *Recommendation* (HPA): ``ceil(demand / target_per_replica)``, i.e. ``ceil(ready x
   signal / target)``; nothing while ``signal / target`` is within the tolerance band around
   1.0. With ``target_rate_per_replica`` set, on the arrival rate instead: ``ceil(rate /
   target_rate_per_replica)``, the rate from the samples' arrival counters over the stable
   window (the queue of a batching server swings by a batch between two instants and grows
   without bound past capacity; arrivals per second scale with the load). Panic mode and
   scale to zero stay on the queue. A sample without a counter, or a window of one sample:
   the queue signal for that decision. While replicas are still warming up, an overloaded
   ready set never recommends fewer than the replicas already coming (the HPA's "no change
   of direction" guard).
3. *Panic* (Knative, optional): when demand over the short ``panic_window_s`` exceeds
   ``panic_threshold`` x target per ready replica, recommend on that demand instead, and
   never below the current count or the panic's highest, until the signal has stayed calm
   for ``stable_window_s``.
4. *Floors and ceiling*, the HPA's top-level branches: above ``max_replicas`` go to it; below
   the floor go to it at once. The floor is the largest of ``min_replicas``, the active
   time-of-day schedules (started ``cold_start_s`` early, so the capacity is warm at the
   peak), the seasonal forecast (a floor only: it never scales anything down), and 1 when a
   model at zero sees demand (scale from zero: requests wait in the queue meanwhile).
   Unlike the HPA, the recommendation is recorded on the way up to a floor too, so the
   scale-down window remembers a scale from zero like any other scale-up.
5. *Behavior* (HPA ``behavior``, ``scaling_rules``): stabilization windows, then rate
   policies, clamped to [floor, max].
6. *Scale to zero* (KEDA, per model): the last replicas go at once once no demand has been
   seen for the scale-down window and no schedule or forecast holds a floor.

Invariants: pure (time is ``now``, monotonic seconds; the wall time arrives as a value);
``desired`` is in ``[min_replicas, max_replicas]`` once ``replicas`` is, or 0 with
``scale_to_zero``; a missing or stale signal never changes the count; after a scale-up the
count does not go down before the scale-down window has passed (floors aside); every
decision names its rule, its inputs, the window bounds and the clamps it went through.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from tidegate.core.scaling_rules import DEFAULT_SCALE_DOWN as DEFAULT_SCALE_DOWN
from tidegate.core.scaling_rules import DEFAULT_SCALE_UP as DEFAULT_SCALE_UP
from tidegate.core.scaling_rules import HPA_DEFAULT_SCALE_DOWN as HPA_DEFAULT_SCALE_DOWN
from tidegate.core.scaling_rules import (
    Recommendation,
    ScaleEvent,
    record_event,
    record_recommendation,
    scale_limit,
    stabilize,
)
from tidegate.core.scaling_rules import ScalingPolicy as ScalingPolicy
from tidegate.core.scaling_rules import ScalingRules as ScalingRules
from tidegate.core.schedules import Schedule as Schedule
from tidegate.core.schedules import lead_minutes, schedule_floor


class Direction(enum.StrEnum):
    UP = "up"
    DOWN = "down"
    NONE = "none"


class ScaleReason(enum.StrEnum):
    """The rule that chose a decision's count (a label of ``tidegate_scale_events_total``)."""

    TARGET = "target"  # the recommendation itself
    TOLERANCE = "tolerance"  # signal within the dead band: current count kept
    WARMING = "warming"  # overloaded, but replicas still warming up already cover it
    STABILIZED = "stabilized"  # held back by a stabilization window
    RATE_LIMITED = "rate_limited"  # held back by the scale-up or scale-down policies
    MIN = "min"
    MAX = "max"
    SCHEDULE = "schedule"  # a time-of-day floor
    FORECAST = "forecast"  # the seasonal forecast floor
    PANIC = "panic"  # the short-window signal (or holding during a panic)
    HOLD_STALE_SIGNAL = "hold_stale_signal"  # no fresh demand sample: nothing changes
    SCALE_TO_ZERO = "scale_to_zero"  # idle for the scale-down window: zero replicas
    COLD_START_FROM_ZERO = "cold_start_from_zero"  # demand at zero replicas


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    min_replicas: int = 1
    max_replicas: int = 4
    target_per_replica: float = 8.0  # demand (queued + in-flight) per ready replica
    tolerance: float = 0.1  # dead band around ratio 1.0 (per direction: ScalingRules.tolerance)
    interval_s: float = 15.0  # how often the shell decides (the HPA's sync period)
    scale_up: ScalingRules = DEFAULT_SCALE_UP
    scale_down: ScalingRules = DEFAULT_SCALE_DOWN
    panic_threshold: float | None = None  # e.g. 2.0: short-window signal > 2x target: panic
    panic_window_s: float = 15.0  # the short window (Knative: 10% of the stable window)
    stable_window_s: float = 60.0  # demand is averaged over this (0: the latest sample)
    schedules: tuple[Schedule, ...] = ()
    timezone: str = "UTC"  # of the schedules; the shell converts, the core reads no clock
    cold_start_s: float = 0.0  # schedules take effect this much earlier
    scale_to_zero: bool = False
    forecast: bool = False  # the shell passes the seasonal floor (core.forecast) when set
    max_signal_age_s: float = 60.0  # an older demand sample is stale: hold
    # Arrivals per second one ready replica should take (e.g. 0.95 x its profiled capacity);
    # None: size on the queue (target_per_replica). Panic stays on the queue either way.
    target_rate_per_replica: float | None = None

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < max(1, self.min_replicas):
            raise ValueError(
                f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, "
                f"got {self.min_replicas}..{self.max_replicas}"
            )
        if self.target_per_replica <= 0:
            raise ValueError(f"target_per_replica must be > 0, got {self.target_per_replica}")
        rate = self.target_rate_per_replica
        if rate is not None and not (0 < rate < math.inf):
            raise ValueError(f"target_rate_per_replica must be a number > 0, got {rate}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")
        if self.panic_threshold is not None and self.panic_threshold <= 1:
            raise ValueError(f"panic_threshold must be > 1, got {self.panic_threshold}")
        durations = {
            "interval_s": self.interval_s,
            "max_signal_age_s": self.max_signal_age_s,
            "panic_window_s": self.panic_window_s,
        }
        for name, value in durations.items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.stable_window_s < 0 or self.cold_start_s < 0:
            raise ValueError("stable_window_s and cold_start_s must be >= 0")

    def tolerances(self) -> tuple[float, float]:
        """(down, up) dead band half-widths."""
        down, up = self.scale_down.tolerance, self.scale_up.tolerance
        return (
            self.tolerance if down is None else down,
            self.tolerance if up is None else up,
        )


@dataclass(frozen=True, slots=True)
class DemandSample:
    measured_at: float  # monotonic seconds
    queued: float  # requests waiting in the gateway's queue (a count, or a mean of counts)
    in_flight: float  # requests dispatched to replicas and not finished
    arrived: float | None = None  # requests that arrived for the model so far (a counter)

    @property
    def demand(self) -> float:
        return self.queued + self.in_flight


@dataclass(frozen=True, slots=True)
class ScaleInputs:
    replicas: int  # the count being maintained: starting, warming and ready, not draining
    ready_replicas: int  # those that passed warm-up
    demand: DemandSample | None  # the latest sample; None: missing
    local_time: tuple[int, int] | None = None  # (weekday 0=Mon, minute of the local day)
    forecast_replicas: int | None = None  # seasonal forecast: a floor, never a ceiling
    cold_start_s: float | None = None  # measured cold start; None: the config's


@dataclass(frozen=True, slots=True)
class ScaleState:
    """What one decision hands to the next. Start from ``ScaleState()``."""

    recommendations: tuple[Recommendation, ...] = ()  # the stabilization windows' memory
    scale_up_events: tuple[ScaleEvent, ...] = ()  # the rate policies' memory
    scale_down_events: tuple[ScaleEvent, ...] = ()
    samples: tuple[DemandSample, ...] = ()  # within the stable and panic windows
    seeded: bool = False  # the first decision remembers the count it found
    last_demand_at: float | None = None  # when demand was last seen (scale to zero)
    panic_at: float | None = None  # when the panic signal last crossed; None: calm
    max_panic_replicas: int = 0  # highest recommendation of the current panic

    @property
    def panicking(self) -> bool:
        return self.panic_at is not None


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """One decision with everything that explains it (``/admin/autoscaler``, ``explain``)."""

    decided_at: float
    current_replicas: int
    desired_replicas: int
    reason: ScaleReason
    inputs: ScaleInputs
    demand: float | None = None  # mean over the stable window; None: no fresh signal
    rate: float | None = None  # arrivals/s over the stable window (target_rate_per_replica)
    panic_demand: float | None = None  # mean over the panic window
    ratio: float | None = None  # demand per ready replica / target
    recommendation: int | None = None  # after tolerance and panic, before the behavior
    window_lowest: int | None = None  # lowest recommendation of the scale-up window
    window_highest: int | None = None  # highest recommendation of the scale-down window
    stabilized: int | None = None  # the count the windows allowed
    scale_up_limit: int | None = None  # what the scale-up policies allowed, when scaling up
    scale_down_limit: int | None = None  # what the scale-down policies allowed
    floor: int = 0  # the lower clamp: min, schedules, forecast, cold start
    ceiling: int = 0  # max_replicas
    clamps: tuple[ScaleReason, ...] = ()  # every rule that moved the count, in order
    panicking: bool = False

    @property
    def direction(self) -> Direction:
        if self.desired_replicas > self.current_replicas:
            return Direction.UP
        if self.desired_replicas < self.current_replicas:
            return Direction.DOWN
        return Direction.NONE

    def describe(self) -> str:
        """One line for humans: ``1 -> 5 up (rate_limited); demand 80 on 1 ready = ...``."""
        parts = [
            f"{self.current_replicas} -> {self.desired_replicas} {self.direction} ({self.reason})"
        ]
        if self.rate is not None and self.ratio is not None:
            parts.append(
                f"{self.rate:.4g} arrivals/s on {self.inputs.ready_replicas} ready = "
                f"{self.ratio:.2f}x target"
            )
        elif self.demand is not None and self.ratio is not None:
            parts.append(
                f"demand {self.demand:g} on {self.inputs.ready_replicas} ready = "
                f"{self.ratio:.2f}x target"
            )
        if self.recommendation is not None:
            parts.append(f"recommended {self.recommendation}")
        if self.window_lowest is not None:
            parts.append(f"window [{self.window_lowest}, {self.window_highest}]")
        for name, limit in (("up", self.scale_up_limit), ("down", self.scale_down_limit)):
            if limit is not None:
                parts.append(f"{name} limit {limit}")
        parts.append(f"bounds [{self.floor}, {self.ceiling}]")
        if self.clamps:
            parts.append("clamps " + ",".join(self.clamps))
        if self.panicking:
            parts.append("panicking")
        return "; ".join(parts)


@dataclass(frozen=True, slots=True)
class _Floor:
    replicas: int
    reason: ScaleReason
    schedule_replicas: int
    forecast_replicas: int


@dataclass(frozen=True, slots=True)
class _Signal:
    latest: float  # the newest sample's demand
    demand: float  # mean over the stable window
    panic_demand: float  # mean over the panic window
    ratio: float  # demand (or rate) per ready replica / target (inf: any and nothing ready)
    rate: float | None = None  # arrivals/s, when the recommendation sizes on it


@dataclass(frozen=True, slots=True)
class _Tick:
    """Everything one decision reads, once the signal is known to be fresh."""

    inputs: ScaleInputs
    config: AutoscaleConfig
    now: float
    signal: _Signal
    floor: _Floor

    @property
    def current(self) -> int:
        return self.inputs.replicas

    def decision(self, desired: int, reason: ScaleReason) -> ScaleDecision:
        return ScaleDecision(
            self.now,
            self.current,
            desired,
            reason,
            self.inputs,
            demand=self.signal.demand,
            rate=self.signal.rate,
            panic_demand=self.signal.panic_demand,
            ratio=self.signal.ratio,
            floor=self.floor.replicas,
            ceiling=self.config.max_replicas,
        )


@dataclass(frozen=True, slots=True)
class _Limited:
    replicas: int
    up_limit: int | None = None
    down_limit: int | None = None
    clamp: ScaleReason | None = None  # the bound that held it back, if any


def decide_scale(
    inputs: ScaleInputs, state: ScaleState, config: AutoscaleConfig, now: float
) -> tuple[ScaleDecision, ScaleState]:
    """The count to maintain now, and the state for the next call. See the module docstring."""
    current = inputs.replicas
    if not state.seeded:
        # As the HPA on (re)start: the count found counts as a recommendation, so nothing
        # scales down before a whole window of evidence, and nothing idles to zero sooner.
        seed = (Recommendation(now, current),)
        state = replace(state, seeded=True, recommendations=seed, last_demand_at=now)
    sample = inputs.demand
    if sample is None or now - sample.measured_at > config.max_signal_age_s:
        hold = ScaleDecision(now, current, current, ScaleReason.HOLD_STALE_SIGNAL, inputs)
        return replace(hold, ceiling=config.max_replicas), state

    state = _observe(state, sample, config, now)
    signal = _measure(state, inputs, config, now)
    tick = _Tick(inputs, config, now, signal, _floor(inputs, config, signal))
    if _goes_to_zero(tick, state):
        decision = tick.decision(0, ScaleReason.SCALE_TO_ZERO)
    elif current > config.max_replicas:
        decision = tick.decision(config.max_replicas, ScaleReason.MAX)
    elif current < tick.floor.replicas:
        decision, state = _raise_to_floor(tick, state)
    else:
        decision, state = _normalize(tick, state)
    return decision, _remember_change(state, decision, config)


def _observe(
    state: ScaleState, sample: DemandSample, config: AutoscaleConfig, now: float
) -> ScaleState:
    """Add a new sample; keep what the windows can see, and always the newest."""
    samples = state.samples
    if not samples or sample.measured_at > samples[-1].measured_at:
        samples = (*samples, sample)
    horizon = now - max(config.stable_window_s, config.panic_window_s)
    kept = tuple(s for s in samples[:-1] if s.measured_at > horizon) + samples[-1:]
    if config.target_rate_per_replica is not None:
        # The arrival rate counts from the last counter at or before the window's start.
        before = [s for s in samples[:-1] if s.measured_at <= horizon]
        kept = (*before[-1:], *kept)
    last_demand_at = now if sample.demand > 0 else state.last_demand_at
    return replace(state, samples=kept, last_demand_at=last_demand_at)


def _measure(
    state: ScaleState, inputs: ScaleInputs, config: AutoscaleConfig, now: float
) -> _Signal:
    demand = _mean_demand(state.samples, config.stable_window_s, now)
    panic_demand = _mean_demand(state.samples, config.panic_window_s, now)
    rate = None
    if config.target_rate_per_replica is not None:
        rate = _arrival_rate(state.samples, config.stable_window_s, now)
    sized, per_replica = demand, config.target_per_replica
    if rate is not None and config.target_rate_per_replica is not None:
        sized, per_replica = rate, config.target_rate_per_replica
    if inputs.ready_replicas > 0:
        ratio = sized / (inputs.ready_replicas * per_replica)
    else:
        # Nothing ready to measure per replica: any demand is more than zero replicas serve.
        ratio = math.inf if sized > 0 else 0.0
    return _Signal(state.samples[-1].demand, demand, panic_demand, ratio, rate)


def _arrival_rate(samples: Sequence[DemandSample], window_s: float, now: float) -> float | None:
    """Arrivals per second from the last counter at or before the window's start (``_observe``
    keeps one; a window of 0: the previous counter) to the newest; the oldest counter when
    none is that old yet. None without two counters apart in time."""
    counted = [s for s in samples if s.arrived is not None]
    if len(counted) < 2 or counted[-1] is not samples[-1]:
        return None
    before = [s for s in counted[:-1] if s.measured_at <= now - window_s]
    first, last = (before[-1] if before else counted[0]), counted[-1]
    span = last.measured_at - first.measured_at
    if span <= 0 or first.arrived is None or last.arrived is None:
        return None
    return max(0.0, last.arrived - first.arrived) / span


def _mean_demand(samples: Sequence[DemandSample], window_s: float, now: float) -> float:
    recent = [s.demand for s in samples if s.measured_at > now - window_s]
    if not recent:
        recent = [samples[-1].demand]  # a window shorter than the sampling: the newest
    return sum(recent) / len(recent)


def _floor(inputs: ScaleInputs, config: AutoscaleConfig, signal: _Signal) -> _Floor:
    schedule = 0
    if inputs.local_time is not None:
        cold_start_s = config.cold_start_s if inputs.cold_start_s is None else inputs.cold_start_s
        weekday, minute = inputs.local_time
        lead = lead_minutes(cold_start_s)
        schedule = schedule_floor(config.schedules, weekday, minute, lead)
    forecast = max(0, inputs.forecast_replicas or 0)
    cold_start = 1 if inputs.replicas == 0 and signal.latest > 0 else 0
    # Ties go to the first: the most specific reason names the floor.
    candidates = (
        (cold_start, ScaleReason.COLD_START_FROM_ZERO),
        (schedule, ScaleReason.SCHEDULE),
        (forecast, ScaleReason.FORECAST),
        (config.min_replicas, ScaleReason.MIN),
    )
    replicas, reason = max(candidates, key=lambda candidate: candidate[0])
    return _Floor(min(replicas, config.max_replicas), reason, schedule, forecast)


def _goes_to_zero(tick: _Tick, state: ScaleState) -> bool:
    """Scale to zero (KEDA): idle for the whole scale-down window, and no floor but min."""
    if not tick.config.scale_to_zero or tick.signal.latest > 0:
        return False
    if tick.floor.schedule_replicas > 0 or tick.floor.forecast_replicas > 0:
        return False
    if tick.current == 0:
        return True  # stays at zero until demand arrives
    last_demand_at = tick.now if state.last_demand_at is None else state.last_demand_at
    return tick.now - last_demand_at >= tick.config.scale_down.stabilization_window_s


def _recommend(tick: _Tick) -> tuple[int, ScaleReason]:
    down_tolerance, up_tolerance = tick.config.tolerances()
    if 1.0 - down_tolerance <= tick.signal.ratio <= 1.0 + up_tolerance:
        return tick.current, ScaleReason.TOLERANCE
    signal, config = tick.signal, tick.config
    if signal.rate is not None and config.target_rate_per_replica is not None:
        recommendation = math.ceil(signal.rate / config.target_rate_per_replica)
    else:
        recommendation = math.ceil(signal.demand / config.target_per_replica)
    if signal.demand > 0 or (signal.rate or 0.0) > 0:
        # Any demand needs a replica, also one so small that the division underflows to 0
        # (Hypothesis found 5e-324 / 4): a scale from zero is then remembered as one.
        recommendation = max(1, recommendation)
    if tick.signal.ratio > 1.0 and recommendation < tick.current:
        # The ready replicas are overloaded; the warming ones will take their share. Never
        # read that as a reason to scale down (the HPA's change-of-direction guard).
        return tick.current, ScaleReason.WARMING
    return recommendation, ScaleReason.TARGET


def _panic(recommendation: int, tick: _Tick, state: ScaleState) -> tuple[int, ScaleState]:
    """Knative's panic mode: recommend on the short window, never down, until calm."""
    config, signal = tick.config, tick.signal
    if config.panic_threshold is None:
        return recommendation, state
    capacity = max(1, tick.inputs.ready_replicas) * config.target_per_replica
    panic_at = state.panic_at
    if signal.panic_demand / capacity > config.panic_threshold:
        panic_at = tick.now
    elif panic_at is not None and panic_at + config.stable_window_s < tick.now:
        # Calm for a whole stable window: the surge is in the stable signal by now.
        panic_at = None
    if panic_at is None:
        return recommendation, replace(state, panic_at=None, max_panic_replicas=0)
    panic_recommendation = math.ceil(signal.panic_demand / config.target_per_replica)
    raised = max(recommendation, panic_recommendation, state.max_panic_replicas, tick.current)
    return raised, replace(state, panic_at=panic_at, max_panic_replicas=raised)


def _raise_to_floor(tick: _Tick, state: ScaleState) -> tuple[ScaleDecision, ScaleState]:
    """Below the floor: straight to it, as the HPA does below ``minReplicas``.

    Unlike the HPA, the recommendation is still recorded: a scale from zero is then
    remembered by the scale-down window like any other scale-up.
    """
    recommendation, _ = _recommend(tick)
    decision = replace(
        tick.decision(tick.floor.replicas, tick.floor.reason),
        recommendation=recommendation,
        clamps=(tick.floor.reason,),
    )
    return decision, _remember(state, recommendation, tick)


def _normalize(tick: _Tick, state: ScaleState) -> tuple[ScaleDecision, ScaleState]:
    """The HPA's path for a count within bounds: recommend, stabilize, rate-limit, clamp."""
    recommendation, reason = _recommend(tick)
    raised, state = _panic(recommendation, tick, state)
    if raised != recommendation:
        recommendation, reason = raised, ScaleReason.PANIC
    up, down = tick.config.scale_up, tick.config.scale_down
    window = stabilize(recommendation, tick.current, state.recommendations, up, down, tick.now)
    limited = _rate_limit(window.replicas, tick, state)
    clamps: tuple[ScaleReason, ...] = ()
    if window.replicas != recommendation:
        clamps = (ScaleReason.STABILIZED,)
    if limited.clamp is not None:
        clamps = (*clamps, limited.clamp)
    decision = replace(
        tick.decision(limited.replicas, clamps[-1] if clamps else reason),
        recommendation=recommendation,
        window_lowest=window.lowest,
        window_highest=window.highest,
        stabilized=window.replicas,
        scale_up_limit=limited.up_limit,
        scale_down_limit=limited.down_limit,
        clamps=clamps,
        panicking=state.panicking,
    )
    return decision, _remember(state, recommendation, tick)


def _rate_limit(stabilized: int, tick: _Tick, state: ScaleState) -> _Limited:
    """The HPA's rate step: the policies' limit, then [floor, max]; names what bound it."""
    config, current, floor = tick.config, tick.current, tick.floor
    events = (state.scale_up_events, state.scale_down_events)
    if stabilized > current:
        # A spent budget holds the count this period; it never turns into a move down.
        limit = max(scale_limit(current, *events, config.scale_up, tick.now, up=True), current)
        ceiling = min(config.max_replicas, limit)
        if stabilized <= ceiling:
            return _Limited(stabilized, up_limit=limit)
        clamp = ScaleReason.RATE_LIMITED if limit < config.max_replicas else ScaleReason.MAX
        return _Limited(ceiling, up_limit=limit, clamp=clamp)
    if stabilized < current:
        limit = min(scale_limit(current, *events, config.scale_down, tick.now, up=False), current)
        lowest = max(floor.replicas, limit)
        if stabilized >= lowest:
            return _Limited(stabilized, down_limit=limit)
        clamp = ScaleReason.RATE_LIMITED if floor.replicas < limit else floor.reason
        return _Limited(lowest, down_limit=limit, clamp=clamp)
    return _Limited(stabilized)


def _remember(state: ScaleState, recommendation: int, tick: _Tick) -> ScaleState:
    """Record a recommendation for the stabilization windows."""
    up, down = tick.config.scale_up, tick.config.scale_down
    history = record_recommendation(state.recommendations, recommendation, up, down, tick.now)
    return replace(state, recommendations=history)


def _remember_change(
    state: ScaleState, decision: ScaleDecision, config: AutoscaleConfig
) -> ScaleState:
    """Record a change as a scale event: the rate policies count it over their periods."""
    change = decision.desired_replicas - decision.current_replicas
    now = decision.decided_at
    if change > 0:
        events = record_event(state.scale_up_events, change, config.scale_up, now)
        return replace(state, scale_up_events=events)
    if change < 0:
        events = record_event(state.scale_down_events, -change, config.scale_down, now)
        return replace(state, scale_down_events=events)
    return state


def replay_decisions(
    points: Iterable[tuple[float, float | None]],
    config: AutoscaleConfig,
    initial_replicas: int | None = None,
) -> tuple[ScaleDecision, ...]:
    """Decide at each ``(time, demand)`` point (None: missing) as an HPA would.

    Every replica is ready as soon as it is asked for and each decision is applied at
    once: the view the HPA has of a Deployment, so that the same config replayed here and
    by the built-in autoscaler gives the same series (with ``stable_window_s=0``, or a
    metric averaged over the same window).
    """
    replicas = config.min_replicas if initial_replicas is None else initial_replicas
    state = ScaleState()
    decisions: list[ScaleDecision] = []
    for at, demand in points:
        sample = None if demand is None else DemandSample(at, queued=demand, in_flight=0.0)
        inputs = ScaleInputs(replicas=replicas, ready_replicas=replicas, demand=sample)
        decision, state = decide_scale(inputs, state, config, at)
        replicas = decision.desired_replicas
        decisions.append(decision)
    return tuple(decisions)


def replay_scale(
    points: Iterable[tuple[float, float | None]],
    config: AutoscaleConfig,
    initial_replicas: int | None = None,
) -> tuple[int, ...]:
    """The replica count after each point of ``replay_decisions``."""
    return tuple(d.desired_replicas for d in replay_decisions(points, config, initial_replicas))
