"""The autoscaling half of ``tidegate k8s render``: one ``AutoscaleConfig``, three renderings.

- an HPA ``autoscaling/v2`` on the External metric ``inference_queue_depth`` (served by the
  Prometheus Adapter from the gateways' gauge), its ``behavior`` field for field from
  ``scale_up`` / ``scale_down``;
- or a KEDA ``ScaledObject``: the same query as a ``prometheus`` trigger, the schedules as
  ``cron`` triggers (floors), scale to zero, and the same ``behavior``;
- the Prometheus Adapter ``externalRules`` that turn the gauge into that External metric.

With ``target_rate_per_replica`` the metric is the arrival rate instead: the gateways'
``tidegate_arrivals_total{model}`` as ``sum(rate(...[W]))`` over the core's stable window
(at least ``RATE_MIN_WINDOW_S``: a rate needs two scrapes), with that rate as the
``AverageValue`` target: ``ceil(rate / target_rate_per_replica)``, the core's rate path.
PromQL's ``rate`` extrapolates to the window's edges where the core counts from the last
decision at or before the window's start; over a steady load the two agree.

Why an External metric with an ``AverageValue`` target: the gateways export
``inference_queue_depth{model}`` = (queued + in flight) / ready upstreams, and in a cluster
each model is one upstream (its Service), so the gauge is the model's whole demand on that
gateway; the adapter sums the gateways. The HPA then computes ``ceil(demand / target)``
with the tolerance band on ``demand / (target x replicas)``: the core's
``ceil(replicas x signal / target)`` with the same band. It is not a ``Pods`` metric
because the workers do not export it: the backlog lives in the gateways.

Invariants: the ``behavior`` rendered parses back to the ``ScalingRules`` it came from
(tests/control/test_k8s.py replays both through ``core.autoscale``); what the HPA cannot
express (panic mode, schedules without KEDA, per-HPA sync period, scale to zero without
KEDA) is said in a note, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from tidegate.core.autoscale import AutoscaleConfig, ScalingRules, Schedule
from tidegate.core.schedules import MINUTES_PER_DAY, lead_minutes
from tidegate.errors import ConfigError

METRIC = "inference_queue_depth"  # tidegate.metrics.GatewayMetrics.queue_depth_per_replica
METRIC_LABEL = "model"
REJECTED_METRIC = "tidegate_requests_total"
RATE_METRIC = "tidegate_arrivals_total"  # tidegate.gateway.observe.ScrapeCollector
RATE_MIN_WINDOW_S = 30  # two scrapes at Prometheus' common 15 s interval
REJECTED_OUTCOME = "rejected_unavailable"  # what a request to a model at zero replicas gets
HPA_DEFAULT_TOLERANCE = 0.1  # kube-controller-manager --horizontal-pod-autoscaler-tolerance
HPA_SYNC_PERIOD_S = 15.0  # --horizontal-pod-autoscaler-sync-period
WAKE_THRESHOLD = "1000000"  # the wake trigger only activates; it never asks for more than 1
_SELECT = {"max": "Max", "min": "Min", "disabled": "Disabled"}
_POLICY = {"pods": "Pods", "percent": "Percent"}


@dataclass(frozen=True, slots=True)
class ScaleTarget:
    """What the autoscaler of one worker Deployment needs to know about it."""

    model: str  # the model's name: the metric's label value
    deployment: str
    namespace: str
    labels: dict[str, str]
    key: str  # the config key of the model's autoscaling, for errors
    source: str


# ----------------------------------------------------------------------------- metric names


def metric_name(config: AutoscaleConfig) -> str:
    """The External metric an autoscaled model reads: the gauge averaged over the core's
    ``stable_window_s`` (the raw gauge when 0); with a rate target, the arrival rate."""
    if config.target_rate_per_replica is not None:
        return _rate_name(rate_window_s(config))
    window_s = _whole_seconds(config.stable_window_s)
    return METRIC if window_s == 0 else f"{METRIC}_avg_{window_s}s"


def rate_window_s(config: AutoscaleConfig) -> int:
    """The window of the arrival rate: the core's stable window, at least two scrapes."""
    return max(RATE_MIN_WINDOW_S, _whole_seconds(config.stable_window_s))


def _rate_name(window_s: int) -> str:
    return f"tidegate_arrivals_per_s_{window_s}s"


def target_value(config: AutoscaleConfig) -> float:
    """What one replica should carry of the metric: the rate target, else the demand."""
    rate = config.target_rate_per_replica
    return config.target_per_replica if rate is None else rate


def adapter_rules(configs: list[AutoscaleConfig]) -> dict[str, Any]:
    """Prometheus Adapter ``externalRules``: one per averaging window in use, and one per
    arrival-rate window."""
    rules: list[dict[str, Any]] = []
    by_rate = [c for c in configs if c.target_rate_per_replica is not None]
    on_queue = [c for c in configs if c.target_rate_per_replica is None]
    for window_s in sorted({_whole_seconds(c.stable_window_s) for c in on_queue}):
        series = "<<.Series>>{<<.LabelMatchers>>}"
        inner = series if window_s == 0 else f"avg_over_time({series}[{window_s}s])"
        name = METRIC if window_s == 0 else f"{METRIC}_avg_{window_s}s"
        rules.append(
            {
                "seriesQuery": f'{METRIC}{{namespace!="",{METRIC_LABEL}!=""}}',
                "resources": {"overrides": {"namespace": {"resource": "namespace"}}},
                "name": {"matches": f"^{METRIC}$", "as": name},
                # Summed over the gateway copies: each holds its own share of the backlog.
                "metricsQuery": f"sum({inner})",
            }
        )
    for window_s in sorted({rate_window_s(c) for c in by_rate}):
        rules.append(
            {
                "seriesQuery": f'{RATE_METRIC}{{namespace!="",{METRIC_LABEL}!=""}}',
                "resources": {"overrides": {"namespace": {"resource": "namespace"}}},
                "name": {"matches": f"^{RATE_METRIC}$", "as": _rate_name(window_s)},
                # Summed over the gateway copies: each counts the requests it was sent.
                "metricsQuery": f"sum(rate(<<.Series>>{{<<.LabelMatchers>>}}[{window_s}s]))",
            }
        )
    return {"externalRules": rules}


def prometheus_query(config: AutoscaleConfig, model: str, namespace: str) -> str:
    """The PromQL KEDA asks: the same sum as the adapter's rule, for one model."""
    if config.target_rate_per_replica is not None:
        series = f'{RATE_METRIC}{{namespace="{namespace}",{METRIC_LABEL}="{model}"}}'
        return f"sum(rate({series}[{rate_window_s(config)}s]))"
    series = f'{METRIC}{{namespace="{namespace}",{METRIC_LABEL}="{model}"}}'
    window_s = _whole_seconds(config.stable_window_s)
    return f"sum({series})" if window_s == 0 else f"sum(avg_over_time({series}[{window_s}s]))"


# ----------------------------------------------------------------------------- behavior


def behavior(config: AutoscaleConfig, target: ScaleTarget) -> dict[str, Any]:
    """HPA ``behavior``: both directions, every field explicit (no cluster default applies)."""
    down_tolerance, up_tolerance = config.tolerances()
    return {
        "scaleUp": _rules(config.scale_up, up_tolerance, f"{target.key}.scale_up", target),
        "scaleDown": _rules(config.scale_down, down_tolerance, f"{target.key}.scale_down", target),
    }


def _rules(rules: ScalingRules, tolerance: float, key: str, target: ScaleTarget) -> dict[str, Any]:
    out: dict[str, Any] = {
        "stabilizationWindowSeconds": _seconds(
            rules.stabilization_window_s, f"{key}.stabilization_window_s", target
        ),
        "selectPolicy": _SELECT[rules.select_policy],
        "policies": [
            {
                "type": _POLICY[p.kind],
                "value": p.value,
                "periodSeconds": _seconds(p.period_s, f"{key}.policies[{i}].period_s", target),
            }
            for i, p in enumerate(rules.policies)
        ],
    }
    if tolerance != HPA_DEFAULT_TOLERANCE:
        out["tolerance"] = quantity(tolerance)
    return out


def _seconds(value: float, key: str, target: ScaleTarget) -> int:
    if value != int(value):
        raise ConfigError(
            target.source,
            key,
            f"{value:g} s is not a whole number of seconds, which is all an HPA takes",
            f"use {int(value)} or {int(value) + 1}",
        )
    return int(value)


def _whole_seconds(value: float) -> int:
    return round(value)


def quantity(value: float) -> str:
    """A Kubernetes quantity: ``12``, ``0.5`` as ``500m``, ``0.0005`` as ``500u``; in the
    largest unit that holds the value whole, else in nano units (the finest there is)."""
    for scale, suffix in ((1, ""), (1_000, "m"), (1_000_000, "u")):
        scaled = value * scale
        if abs(scaled - round(scaled)) <= 1e-9 * max(1.0, abs(scaled)):
            return f"{round(scaled)}{suffix}"
    return f"{round(value * 1_000_000_000)}n"


# ----------------------------------------------------------------------------- HPA


def render_hpa(config: AutoscaleConfig, target: ScaleTarget) -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(target),
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": target.deployment,
            },
            # An HPA cannot go below 1 (without the HPAScaleToZero alpha gate).
            "minReplicas": max(1, config.min_replicas),
            "maxReplicas": config.max_replicas,
            "metrics": [_external_metric(config, target)],
            "behavior": behavior(config, target),
        },
    }


def _external_metric(config: AutoscaleConfig, target: ScaleTarget) -> dict[str, Any]:
    return {
        "type": "External",
        "external": {
            "metric": {
                "name": metric_name(config),
                "selector": {"matchLabels": {METRIC_LABEL: target.model}},
            },
            "target": {
                "type": "AverageValue",
                "averageValue": quantity(target_value(config)),
            },
        },
    }


def hpa_notes(config: AutoscaleConfig, model: str, keda: bool) -> list[str]:
    """What the rendering cannot carry over, one line each."""
    notes: list[str] = []
    if config.panic_threshold is not None:
        notes.append(
            f"{model}: panic mode is not rendered (an HPA has no short window); "
            "its scale_up policies bound the reaction to a burst"
        )
    if config.interval_s != HPA_SYNC_PERIOD_S:
        notes.append(
            f"{model}: interval_s {config.interval_s:g} differs from the HPA's sync period "
            f"({HPA_SYNC_PERIOD_S:g} s, a kube-controller-manager flag for the whole cluster)"
        )
    rate = config.target_rate_per_replica
    if rate is not None and rate_window_s(config) != _whole_seconds(config.stable_window_s):
        notes.append(
            f"{model}: the arrival rate is taken over {rate_window_s(config)} s, not the "
            f"stable window's {config.stable_window_s:g} s (a rate needs two scrapes)"
        )
    down, up = config.tolerances()
    if up != HPA_DEFAULT_TOLERANCE or down != HPA_DEFAULT_TOLERANCE:
        notes.append(
            f"{model}: behavior.*.tolerance is rendered; it needs the HPAConfigurableTolerance "
            "feature gate (Kubernetes 1.33+), else the cluster's 10% applies"
        )
    if not keda and config.schedules:
        notes.append(
            f"{model}: schedules are not rendered for an HPA (it has no time of day); "
            "render with --keda for cron floors"
        )
    if not keda and (config.scale_to_zero or config.min_replicas == 0):
        notes.append(
            f"{model}: an HPA keeps at least 1 replica; render with --keda to scale to zero"
        )
    return notes


# ----------------------------------------------------------------------------- KEDA


def render_scaled_object(
    config: AutoscaleConfig, target: ScaleTarget, prometheus_url: str
) -> dict[str, Any]:
    """A KEDA ScaledObject: demand trigger, cron floors, scale to zero, the same behavior."""
    spec: dict[str, Any] = {
        "scaleTargetRef": {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": target.deployment,
        },
        "pollingInterval": max(1, round(config.interval_s)),
        "minReplicaCount": config.min_replicas,
        "maxReplicaCount": config.max_replicas,
        "advanced": {
            "horizontalPodAutoscalerConfig": {
                "name": target.deployment,
                "behavior": behavior(config, target),
            }
        },
        "triggers": [_demand_trigger(config, target, prometheus_url)],
    }
    if config.scale_to_zero:
        # Idle for the scale-down window: zero (the core's rule). Active: at least
        # min_replicas, which KEDA keeps as long as idleReplicaCount is below it.
        spec["cooldownPeriod"] = round(config.scale_down.stabilization_window_s)
        if config.min_replicas > 0:
            spec["idleReplicaCount"] = 0
        spec["triggers"].append(_wake_trigger(target, prometheus_url))
    elif config.min_replicas == 0:
        spec["minReplicaCount"] = 1
    lead = lead_minutes(config.cold_start_s)
    spec["triggers"].extend(_cron_trigger(s, config.timezone, lead) for s in config.schedules)
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _metadata(target),
        "spec": spec,
    }


def _demand_trigger(
    config: AutoscaleConfig, target: ScaleTarget, prometheus_url: str
) -> dict[str, Any]:
    return {
        "type": "prometheus",
        "name": "demand",
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": prometheus_url,
            "query": prometheus_query(config, target.model, target.namespace),
            "threshold": quantity_decimal(target_value(config)),
            "activationThreshold": "0",
            # No series is a broken metrics path, not zero demand: hold (the core's rule).
            "ignoreNullValues": "false",
        },
    }


def _wake_trigger(target: ScaleTarget, prometheus_url: str) -> dict[str, Any]:
    """At zero replicas the gateway answers 503 instead of queueing, so demand never reaches
    the gauge: the 503s it counts wake the model (one replica; the demand trigger takes over)."""
    series = (
        f'{REJECTED_METRIC}{{namespace="{target.namespace}",{METRIC_LABEL}="{target.model}",'
        f'outcome="{REJECTED_OUTCOME}"}}'
    )
    return {
        "type": "prometheus",
        "name": "wake-from-zero",
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": prometheus_url,
            "query": f"sum(rate({series}[2m]))",
            "threshold": WAKE_THRESHOLD,
            "activationThreshold": "0",
            "ignoreNullValues": "true",
        },
    }


def quantity_decimal(value: float) -> str:
    """A number as KEDA's metadata wants it: a decimal string."""
    return str(int(value)) if value == int(value) else repr(value)


def _cron_trigger(schedule: Schedule, timezone: str, lead: int) -> dict[str, Any]:
    start, end = cron_window(schedule, lead)
    return {
        "type": "cron",
        "metadata": {
            "timezone": timezone,
            "start": start,
            "end": end,
            "desiredReplicas": str(schedule.min_replicas),
        },
    }


def cron_window(schedule: Schedule, lead: int) -> tuple[str, str]:
    """The (start, end) cron lines of a schedule opened ``lead`` minutes early.

    A window belongs to the day it starts (core.schedules): an early start may move to the
    day before, an end at or past midnight to the day after.
    """
    opens = schedule.from_minute - lead
    start_shift = opens // MINUTES_PER_DAY  # 0, or -1 (and so on) days for an early start
    opens %= MINUTES_PER_DAY
    closes = schedule.to_minute
    end_shift = 1 if closes <= schedule.from_minute or closes == MINUTES_PER_DAY else 0
    closes %= MINUTES_PER_DAY
    return (
        _cron(opens, schedule.days, start_shift),
        _cron(closes, schedule.days, end_shift),
    )


def _cron(minute: int, days: tuple[int, ...], shift: int) -> str:
    # cron counts days from Sunday = 0; the core from Monday = 0.
    weekdays = sorted({(day + 1 + shift) % 7 for day in days})
    dow = "*" if len(weekdays) == 7 else ",".join(str(d) for d in weekdays)
    return f"{minute % 60} {minute // 60} * * {dow}"


# ----------------------------------------------------------------------------- adapter


def render_adapter_config_map(
    configs: list[AutoscaleConfig], namespace: str, labels: dict[str, str]
) -> dict[str, Any]:
    """The adapter's rules as a ConfigMap (merge them into the adapter's own config)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "tidegate-prometheus-adapter-rules",
            "namespace": namespace,
            "labels": labels,
        },
        "data": {"config.yaml": yaml.safe_dump(adapter_rules(configs), sort_keys=False)},
    }


def _metadata(target: ScaleTarget) -> dict[str, Any]:
    return {"name": target.deployment, "namespace": target.namespace, "labels": target.labels}
