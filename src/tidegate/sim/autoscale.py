"""Autoscaling controllers of the simulator: the server's autoscaler on a virtual clock.

``CoreAutoscaler`` is the simulator's twin of ``control.controller.Controller``: every
``interval_s`` it builds the same ``ScaleInputs`` (replicas that are starting, warming or
ready; the ready ones; demand = queued + in-flight), calls ``core.autoscale.decide_scale``
and turns the decision into fleet actions: starts in the model's scaled pool (its last
pool), drains chosen by ``core.placement.pick_victims``. Schedules see the wall time of
``start_wall_s`` + virtual time; the seasonal forecast is ``core.forecast``. Nothing of the
policy lives here.

Registered controllers (``--compare``):

- ``tidegate``: the model's own ``autoscaling:`` block;
- ``hpa-default``: the same bounds and target under the Kubernetes HPA's defaults
  (stabilization 300 s down, 100% per 15 s down, x2 or +4 per 15 s up) with no schedules,
  panic, forecast or scale to zero: the baseline a team gets from a plain HPA;
- ``static-peak``: ``max_replicas`` all day, the provisioning for the peak.

Compressed time (``--speedup K``): a virtual second stands for K seconds of the trace's
day, so every duration of the autoscaler (period, windows, policy periods, panic and stable
windows, signal age) is divided by K and the wall time of the schedules runs K times faster
(the cold-start lead stays a wall duration); the decisions are then those of the real day,
replayed faster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

from tidegate.core.autoscale import (
    DEFAULT_SCALE_UP,
    HPA_DEFAULT_SCALE_DOWN,
    AutoscaleConfig,
    DemandSample,
    ScaleDecision,
    ScaleInputs,
    ScaleState,
    ScalingRules,
    decide_scale,
)
from tidegate.core.forecast import SeasonalHistory, forecast_floor, record_hour
from tidegate.sim.control import (
    CONTROLLERS,
    COUNTED,
    ControllerContext,
    FleetAction,
    FleetView,
    StartReplica,
    StaticController,
    drain_least_busy,
)


class CoreAutoscaler:
    """``decide_scale`` every ``interval_s`` of virtual time; see the module docstring."""

    def __init__(self, context: ControllerContext, config: AutoscaleConfig) -> None:
        self.speedup = context.speedup
        self.config = config = compress(config, context.speedup)
        self.interval_s = config.interval_s
        self.pool = context.config.model(context.model).pools[-1]
        self.start_wall_s = context.start_wall_s
        self.scales_from_zero = config.scale_to_zero
        self.state = ScaleState()
        self.history = SeasonalHistory()
        self.decisions: list[ScaleDecision] = []  # the changes, for reports and tests
        self._zone = ZoneInfo(config.timezone)

    def decide(self, view: FleetView) -> Sequence[FleetAction]:
        counted = sum(1 for r in view.replicas if r.state in COUNTED)
        delta = self.scale_delta(
            view.now, counted, view.num_ready, view.queued, view.in_flight, view.arrived
        )
        if delta == 0:
            return ()
        if delta > 0:
            return [StartReplica(self.pool)] * delta
        return drain_least_busy(view, self.pool, -delta)

    def scale_delta(
        self,
        now: float,
        replicas: int,
        ready: int,
        queued: float,
        in_flight: float,
        arrived: float | None = None,
    ) -> int:
        """One ``decide_scale`` on counts: replicas to add (> 0) or drain (< 0).

        ``decide`` calls it with what its ``FleetView`` counts; the fleet-level simulator
        (``sim.fluid``), which keeps no per-request state, with its fluid counts.
        """
        wall_s = self.start_wall_s + now * self.speedup
        local = datetime.fromtimestamp(wall_s, UTC).astimezone(self._zone)
        forecast = (
            forecast_floor(self.history, wall_s, self.config.cold_start_s)
            if self.config.forecast
            else None
        )
        inputs = ScaleInputs(
            replicas=replicas,
            ready_replicas=ready,
            demand=DemandSample(now, queued, in_flight, arrived),
            local_time=(local.weekday(), local.hour * 60 + local.minute),
            forecast_replicas=forecast,
        )
        decision, self.state = decide_scale(inputs, self.state, self.config, now)
        if decision.recommendation is not None:
            self.history = record_hour(self.history, wall_s, decision.recommendation)
        delta = decision.desired_replicas - decision.current_replicas
        if delta != 0:
            self.decisions.append(decision)
        return delta


def compress(config: AutoscaleConfig, speedup: float) -> AutoscaleConfig:
    """``config`` with every duration divided by ``speedup`` (schedules are wall times)."""
    if speedup == 1.0:
        return config

    def rules(r: ScalingRules) -> ScalingRules:
        return dataclasses.replace(
            r,
            stabilization_window_s=r.stabilization_window_s / speedup,
            policies=tuple(
                dataclasses.replace(p, period_s=p.period_s / speedup) for p in r.policies
            ),
        )

    return dataclasses.replace(
        config,
        interval_s=config.interval_s / speedup,
        scale_up=rules(config.scale_up),
        scale_down=rules(config.scale_down),
        panic_window_s=config.panic_window_s / speedup,
        stable_window_s=config.stable_window_s / speedup,
        max_signal_age_s=config.max_signal_age_s / speedup,
    )


def _autoscaling(context: ControllerContext) -> AutoscaleConfig:
    config = context.config.model(context.model).autoscaling
    if config is None:
        raise ValueError(
            f"model {context.model} has no autoscaling: block in {context.config.source}; "
            "add one (see docs/config.md) to compare autoscalers"
        )
    return config


def tidegate_autoscaler(context: ControllerContext) -> CoreAutoscaler:
    return CoreAutoscaler(context, _autoscaling(context))


def hpa_default_autoscaler(context: ControllerContext) -> CoreAutoscaler:
    own = _autoscaling(context)
    baseline = AutoscaleConfig(
        min_replicas=max(1, own.min_replicas),
        max_replicas=own.max_replicas,
        target_per_replica=own.target_per_replica,
        interval_s=own.interval_s,
        stable_window_s=own.stable_window_s,
        scale_up=DEFAULT_SCALE_UP,
        scale_down=HPA_DEFAULT_SCALE_DOWN,
        max_signal_age_s=own.max_signal_age_s,
    )
    return CoreAutoscaler(context, baseline)


def static_peak(context: ControllerContext) -> StaticController:
    pool = context.config.model(context.model).pools[-1]
    return StaticController({pool: _autoscaling(context).max_replicas})


CONTROLLERS.update(
    {
        "tidegate": tidegate_autoscaler,
        "hpa-default": hpa_default_autoscaler,
        "static-peak": static_peak,
    }
)
