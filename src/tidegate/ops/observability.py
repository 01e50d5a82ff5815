"""Prometheus rules and a Prometheus scrape configuration for a config; the files.

``tidegate observability render --out DIR`` writes them with the Grafana dashboard
(``ops.grafana``) for a plain Prometheus; ``tidegate k8s render`` wraps the same rules and
dashboard in cluster objects (``control.k8s_observability``). Everything rendered is a
function of the configuration alone: the same config gives the same files, byte for byte.
Every rule names its scrape job (``ops.series``).

The alerts, each named after the doctor rule that explains it (``tidegate doctor``):

- ``TidegateLatencyOverSlo`` per model and level: time-to-first-token P99 above the level's
  SLO. A level's SLO is its ``queue.timeout_s`` (past it a queued request gets 504), or,
  where none is set, the aging bound ``aging.threshold_s + level / aging.rate_per_s``;
- ``TidegateBacklogWithoutScaleUp`` and ``TidegateAutoscalingSignalMissing`` per autoscaled
  model; ``TidegateColdStartOverBudget`` per autoscaled model (budget: ``cold_start_s``);
- ``TidegateReplicasFlapping``, ``TidegateServerErrors``, ``TidegateHighPriorityShed`` and
  ``TidegateWorkerRestarts`` for every model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tidegate.config import ModelSpec, TidegateConfig
from tidegate.ops.grafana import render_dashboard
from tidegate.ops.series import GATEWAY_JOB, GW, QUANTILES, WINDOW, WK, WORKERS_JOB

__all__ = [
    "ScaleSource",
    "alert_names",
    "level_slo_s",
    "render_rules",
    "render_scrape_config",
    "write_observability",
]

RULES_FILE = "tidegate-rules.yaml"
DASHBOARD_FILE = "tidegate-dashboard.json"
SCRAPE_FILE = "prometheus.yml"
ADMIN_KEY_FILE = "tidegate-admin-key"  # beside prometheus.yml, when the config has keys
DEFAULT_COLD_START_BUDGET_S = 60.0  # when autoscaling.cold_start_s is 0 (not stated)
SERVER_ERROR_RATIO = 0.05  # share of a model's requests answered 5xx that pages
SERVER_ERROR_OUTCOMES = "failed|expired|rejected_unavailable"  # 502/500, 504, 503
REFUSED_OUTCOMES = "shed|rejected_full|rejected_deadline|rejected_holdback|expired"


@dataclass(frozen=True, slots=True)
class ScaleSource:
    """Where the replica count an autoscaler wants is read from.

    ``tidegate serve`` runs its own autoscaler and exports ``tidegate_desired_replicas`` and
    ``tidegate_scale_events_total``; in a cluster the HPA decides, and kube-state-metrics
    exports its ``status.desiredReplicas`` (``hpa_names``: model -> HPA name).
    """

    namespace: str | None = None  # None: tidegate's own autoscaler
    hpa_names: tuple[tuple[str, str], ...] = ()


# ----------------------------------------------------------------------------- SLOs


def level_slo_s(config: TidegateConfig, model: ModelSpec, level: str) -> float | None:
    """A level's TTFT P99 objective: its queue timeout, else the aging bound (None: none)."""
    timeout_s = model.queue.timeout_s.get(level)
    if timeout_s is not None:
        return timeout_s
    index = config.levels.index(level)
    if index == 0:
        # past it, aged requests of the lower levels compete with it: the level is saturated
        return config.aging.threshold_s
    if config.aging.rate_per_s <= 0:
        return None  # without aging a level may wait as long as more urgent work arrives
    return config.aging.threshold_s + index / config.aging.rate_per_s


def _cold_start_budget_s(model: ModelSpec) -> float:
    assert model.autoscaling is not None
    return model.autoscaling.cold_start_s or DEFAULT_COLD_START_BUDGET_S


# ----------------------------------------------------------------------------- rules


def _record(name: str, expr: str, **labels: str) -> dict[str, Any]:
    return {"record": name, "expr": expr, **({"labels": labels} if labels else {})}


def _recording_rules(source: ScaleSource) -> list[dict[str, Any]]:
    duration = f"tidegate_request_duration_seconds_bucket{{{GW}}}"
    rules = [
        _record(
            f"tidegate:requests:rate{WINDOW}",
            f"sum by (model, priority) (rate(tidegate_requests_total{{{GW}}}[{WINDOW}]))",
        ),
        _record(
            f"tidegate:requests_by_outcome:rate{WINDOW}",
            f"sum by (model, priority, outcome) (rate(tidegate_requests_total{{{GW}}}[{WINDOW}]))",
        ),
        *(
            _record(
                f"tidegate:request_duration_seconds:{name}",
                f"histogram_quantile({q}, sum by (model, priority, phase, le) "
                f"(rate({duration}[{WINDOW}])))",
            )
            for name, q in QUANTILES
        ),
        _record(
            f"tidegate:server_errors:ratio_rate{WINDOW}",
            f'sum by (model) (rate(tidegate_requests_total{{{GW},outcome=~"'
            f'{SERVER_ERROR_OUTCOMES}"}}[{WINDOW}])) / sum by (model) '
            f"(rate(tidegate_requests_total{{{GW}}}[{WINDOW}]))",
        ),
        _record(
            f"tidegate:batch_size:mean{WINDOW}",
            f"sum by (model) (rate(tidegate_batch_size_sum{{{WK}}}[{WINDOW}])) / sum by (model) "
            f"(rate(tidegate_batch_size_count{{{WK}}}[{WINDOW}]))",
        ),
        _record("tidegate:queue_depth:sum", f"sum by (model) (tidegate_queue_depth{{{GW}}})"),
        _record(
            "tidegate:worker_start_time_seconds",
            f"max by (model, replica) (process_start_time_seconds{{{WK}}})",
        ),
    ]
    return rules + _scale_records(source)


def _scale_records(source: ScaleSource) -> list[dict[str, Any]]:
    """The autoscaler's wish and its moves, by model, from whichever autoscaler runs."""
    if source.namespace is None:
        events = f"tidegate_scale_events_total{{{GW}"
        return [
            _record(
                "tidegate:desired_replicas", f"max by (model) (tidegate_desired_replicas{{{GW}}})"
            ),
            *(
                _record(
                    f"tidegate:scale_{d}s:increase15m",
                    f'sum by (model) (increase({events},direction="{d}"}}[15m]))',
                )
                for d in ("up", "down")
            ),
        ]
    rules = []
    for model, hpa in source.hpa_names:
        desired = (
            f'kube_horizontalpodautoscaler_status_desired_replicas{{namespace="'
            f'{source.namespace}",horizontalpodautoscaler="{hpa}"}}'
        )
        rules.append(_record("tidegate:desired_replicas", f"max({desired})", model=model))
    for direction, op in (("up", ">"), ("down", "<")):
        rules.append(
            _record(
                f"tidegate:scale_{direction}s:increase15m",
                f"count_over_time((tidegate:desired_replicas {op} tidegate:desired_replicas "
                f"offset 30s)[15m:30s])",
            )
        )
    return rules


@dataclass(frozen=True, slots=True)
class _Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    doctor: str  # the doctor rules that explain it
    model: str | None = None  # per-model rules carry it: two of them must differ in labels
    labels: tuple[tuple[str, str], ...] = ()

    def rule(self) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {
                "severity": self.severity,
                **({"model": self.model} if self.model else {}),
                **dict(self.labels),
            },
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "doctor": self.doctor,
            },
        }


def _model_alerts(config: TidegateConfig) -> Iterator[_Alert]:
    for model in config.models.values():
        for index, level in enumerate(config.levels):
            slo_s = level_slo_s(config, model, level)
            if slo_s is None:
                continue
            yield _Alert(
                "TidegateLatencyOverSlo",
                f'tidegate:request_duration_seconds:p99{{model="{model.name}",'
                f'priority="{level}",phase="ttft"}} > {slo_s:g}',
                "2m",
                "critical" if index == 0 else "warning",
                f"{model.name} {level}: time to first token P99 is "
                f'{{{{ $value | printf "%.2f" }}}} s, over its {slo_s:g} s SLO',
                "Requests of this level wait or run longer than its queue timeout (or aging "
                "bound) allows. tidegate doctor (rules batches_too_small, scale_out_latency, "
                "noisy_neighbour) says why: queueing "
                "with small batches (raise batching.batch_window_ms or max_batch_size), too "
                "few replicas (autoscaling.target_per_replica lower, max_replicas higher), "
                "or a slow shared device (move the model to its own pool).",
                "batches_too_small,scale_out_latency,noisy_neighbour",
                model=model.name,
                labels=(("priority", level), ("slo_s", f"{slo_s:g}")),
            )
        if model.autoscaling is not None:
            yield from _autoscaling_alerts(model)


def _autoscaling_alerts(model: ModelSpec) -> Iterator[_Alert]:
    assert model.autoscaling is not None
    m = f'model="{model.name}"'
    desired = f"tidegate:desired_replicas{{{m}}}"
    queued = f"tidegate:queue_depth:sum{{{m}}}"
    yield _Alert(
        "TidegateBacklogWithoutScaleUp",
        f"({queued} > 0) and on (model) (deriv({queued}[5m]) > 0)"
        f" unless on (model) ({desired} > min_over_time({desired}[10m]))"
        f" unless on (model) ({desired} >= {model.autoscaling.max_replicas})",
        "5m",
        "critical",
        f'{model.name}: {{{{ $value | printf "%.0f" }}}} requests queued and growing, no '
        "scale-up for 10 minutes",
        "The backlog grows while the autoscaler asks for no more replicas (and is below "
        "max_replicas). tidegate doctor (rule autoscale_stuck): check that "
        "inference_queue_depth reaches the autoscaler, lower autoscaling.target_per_replica "
        "or shorten scale_up.stabilization_window_s.",
        "autoscale_stuck",
        model=model.name,
    )
    yield _Alert(
        "TidegateAutoscalingSignalMissing",
        f"absent(inference_queue_depth{{{GW},{m}}}) or ((max by (model) (max_over_time("
        f"inference_queue_depth{{{GW},{m}}}[10m])) == 0) and on (model) "
        f"(tidegate:queue_depth:sum{{{m}}} > 0))",
        "5m",
        "critical",
        f"{model.name}: the autoscaling signal inference_queue_depth is absent or stuck at 0",
        "The autoscaler scales on inference_queue_depth; without it (or at 0 while requests "
        "queue) it never scales up. tidegate doctor (rule autoscale_stuck): check "
        "the gateway's /metrics, the scrape job tidegate-gateway and the Prometheus Adapter "
        "rules (tidegate k8s render).",
        "autoscale_stuck",
        model=model.name,
    )
    budget_s = _cold_start_budget_s(model)
    yield _Alert(
        "TidegateColdStartOverBudget",
        f'max by (model) (tidegate_worker_startup_seconds{{{WK},{m},phase="ready"}} and on '
        f"(instance) (time() - process_start_time_seconds{{{WK}}} < 900)) > {budget_s:g}",
        "0m",
        "warning",
        f'{model.name}: a replica took {{{{ $value | printf "%.1f" }}}} s to become ready, '
        f"over the {budget_s:g} s cold-start budget",
        "New replicas take longer to load and warm up than autoscaling.cold_start_s plans for, "
        "so scale-ups and schedules come late. tidegate doctor (rule scale_out_latency): "
        "keep weights on local disk, shorten warm-up, raise autoscaling.cold_start_s or "
        "min_replicas before known peaks (schedules).",
        "scale_out_latency",
        model=model.name,
        labels=(("budget_s", f"{budget_s:g}"),),
    )


def _fleet_alerts(config: TidegateConfig) -> Iterator[_Alert]:
    top = config.levels[0]
    yield _Alert(
        "TidegateReplicasFlapping",
        "(tidegate:scale_ups:increase15m >= 2) and on (model) "
        "(tidegate:scale_downs:increase15m >= 2)",
        "0m",
        "warning",
        "{{ $labels.model }}: replicas scaled up and down at least twice each in 15 minutes",
        "The replica count oscillates: each scale-up pays a cold start, each scale-down may "
        "cut in-flight work. tidegate doctor (rule scale_in_timeouts): lengthen "
        "autoscaling.scale_down.stabilization_window_s, widen autoscaling.tolerance.",
        "scale_in_timeouts",
    )
    yield _Alert(
        "TidegateServerErrors",
        f"tidegate:server_errors:ratio_rate{WINDOW} > {SERVER_ERROR_RATIO:g}",
        "2m",
        "critical",
        "{{ $labels.model }}: {{ $value | humanizePercentage }} of requests answered 5xx",
        "Requests end in 502 (a replica failed: outcome failed), 504 (expired in the queue) "
        "or 503 (no replica). tidegate doctor (rules scale_in_timeouts, rejection_storm): "
        "read the workers' logs and /readyz, check replica ejections "
        "(tidegate_replica_ejections_total), and "
        "capacity against the queue timeouts.",
        "scale_in_timeouts,rejection_storm",
    )
    yield _Alert(
        "TidegateHighPriorityShed",
        f'sum by (model) (rate(tidegate_requests_total{{{GW},priority="{top}",outcome=~"'
        f'{REFUSED_OUTCOMES}"}}[{WINDOW}])) > 0',
        "0m",
        "critical",
        f"{{{{ $labels.model }}}}: {top} requests refused or expired "
        f'({{{{ $value | printf "%.2f" }}}}/s)',
        f"The most urgent level ({top}) is being refused (queue full, deadline infeasible) or "
        "expires in the queue. tidegate doctor (rule high_priority_shed): more replicas or a "
        "dedicated pool for it, a larger queue.max_size_per_level for it, and holdback for "
        "the lower levels.",
        "high_priority_shed",
    )
    yield _Alert(
        "TidegateWorkerRestarts",
        "changes(tidegate:worker_start_time_seconds[15m]) > 0",
        "0m",
        "warning",
        "{{ $labels.model }} replica {{ $labels.replica }} restarted "
        '{{ $value | printf "%.0f" }} times in 15 minutes',
        "A worker process died and was started again: its engine crashed, ran out of memory "
        "or failed its liveness probe. tidegate doctor (rules memory_near_limit, "
        "memory_jump): read the worker's log (and its memory against memory_mb), and "
        "/readyz's reason.",
        "memory_near_limit,memory_jump",
    )


def render_rules(config: TidegateConfig, source: ScaleSource | None = None) -> dict[str, Any]:
    """The Prometheus rule file: recording rules, then alerts (``promtool check rules``)."""
    source = source or ScaleSource()
    alerts = [*_model_alerts(config), *_fleet_alerts(config)]
    return {
        # One group: its rules run in order at each evaluation, so an alert reads the
        # recorded series of the same evaluation (across groups it may read the last one).
        "groups": [
            {
                "name": "tidegate",
                "rules": _recording_rules(source) + [alert.rule() for alert in alerts],
            }
        ]
    }


def alert_names(rules: dict[str, Any]) -> set[str]:
    return {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}


# ----------------------------------------------------------------------------- scrape config


def render_scrape_config(config: TidegateConfig) -> dict[str, Any]:
    """A Prometheus configuration that scrapes the gateway and, through it, every worker."""
    host = config.gateway.host
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    gateway = f"{host}:{config.gateway.port}"

    def auth() -> dict[str, Any]:  # /admin/* (and maybe /metrics) need an admin key
        if not config.keys:
            return {}
        # type spelled out: Prometheus 2.42 sends an http_sd's credentials without one
        return {"authorization": {"type": "Bearer", "credentials_file": ADMIN_KEY_FILE}}

    return {
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
        "rule_files": [RULES_FILE],
        "scrape_configs": [
            {"job_name": GATEWAY_JOB, **auth(), "static_configs": [{"targets": [gateway]}]},
            {
                "job_name": WORKERS_JOB,
                # The workers' own model label and the target's are the same name; keep it
                # "model" instead of Prometheus' exported_model.
                "honor_labels": True,
                "http_sd_configs": [
                    {
                        "url": f"http://{gateway}/admin/prometheus/targets",
                        "refresh_interval": "15s",
                        **auth(),
                    }
                ],
            },
        ],
    }


# ----------------------------------------------------------------------------- files


def write_observability(config: TidegateConfig, out: Path) -> list[Path]:
    """Rules, the dashboard and a scrape configuration under ``out`` (created)."""
    out.mkdir(parents=True, exist_ok=True)
    header = f"# Rendered by tidegate observability render from {config.source}.\n"
    files = {
        RULES_FILE: header + yaml.safe_dump(render_rules(config), sort_keys=False, width=100),
        DASHBOARD_FILE: json.dumps(render_dashboard(config), indent=2) + "\n",
        SCRAPE_FILE: header
        + yaml.safe_dump(render_scrape_config(config), sort_keys=False, width=100),
    }
    written = []
    for name, text in files.items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
