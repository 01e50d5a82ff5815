"""The Grafana dashboard for a config: the panels of the gateway's live ``/dashboard``.

Per model and priority the request rate, queue depth, TTFT and end-to-end P50 / P95 / P99 and
outcomes; replicas by pool and state with the desired count, scale events as annotations;
the batch-size distribution; start-up, model-load and cold-start times; CPU / GPU
utilisation and memory per replica; doctor's findings. A Prometheus data-source variable
and a model variable; queries use ``$__rate_interval``. The series: ``ops.series``.
"""

from __future__ import annotations

from typing import Any

from tidegate.config import TidegateConfig
from tidegate.ops.series import GW, QUANTILES, WK

__all__ = ["SCALE_EVENTS_ANNOTATION", "panel_queries", "render_dashboard"]

DASHBOARD_UID = "tidegate"
SCHEMA_VERSION = 39  # Grafana 10.4 / 11
SCALE_EVENTS_ANNOTATION = (
    f"sum by (model, direction, reason) (increase(tidegate_scale_events_total"
    f'{{{GW},model=~"$model"}}[1m])) > 0'
)


def _target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "expr": expr,
        "legendFormat": legend,
        "refId": ref,
    }


def _panel(
    title: str, queries: list[tuple[str, str]], unit: str, *, kind: str = "timeseries"
) -> dict[str, Any]:
    targets = [_target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(queries)]
    panel: dict[str, Any] = {
        "type": kind,
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "right"}},
    }
    if kind == "heatmap":
        for target in targets:
            target["format"] = "heatmap"
        panel["options"] = {"calculate": False, "yAxis": {"unit": unit}}
    return panel


def _quantiles(phase: str) -> list[tuple[str, str]]:
    rate = (
        f'rate(tidegate_request_duration_seconds_bucket{{{GW},model=~"$model",'
        f'phase="{phase}"}}[$__rate_interval])'
    )
    return [
        (
            f"histogram_quantile({q}, sum by (model, priority, le) ({rate}))",
            f"{{{{model}}}} {{{{priority}}}} {name}",
        )
        for name, q in QUANTILES
    ]


def _panels() -> list[dict[str, Any]]:
    sel = f'{GW},model=~"$model"'
    wsel = f'{WK},model=~"$model"'
    per_replica = "{{model}} {{replica}}"
    return [
        _panel(
            "Requests per second by model and priority",
            [
                (
                    f"sum by (model, priority) (rate(tidegate_requests_total{{{sel}}}"
                    "[$__rate_interval]))",
                    "{{model}} {{priority}}",
                )
            ],
            "reqps",
        ),
        _panel(
            "Queue depth",
            [
                (
                    f"sum by (model, priority) (tidegate_queue_depth{{{sel}}})",
                    "{{model}} {{priority}}",
                )
            ],
            "short",
        ),
        _panel("Time to first token P50 / P95 / P99", _quantiles("ttft"), "s"),
        _panel("End-to-end latency P50 / P95 / P99", _quantiles("e2e"), "s"),
        _panel(
            "Outcomes (429 shed / rejected, 502 failed, 503 unavailable, 504 expired)",
            [
                (
                    f"sum by (model, outcome) (rate(tidegate_requests_total{{{sel}}}"
                    "[$__rate_interval]))",
                    "{{model}} {{outcome}}",
                )
            ],
            "reqps",
        ),
        _panel(
            "Replicas by pool and state (scale events as annotations)",
            [
                (
                    f"sum by (model, pool, state) (tidegate_replicas{{{sel}}})",
                    "{{model}} {{pool}} {{state}}",
                ),
                (f"max by (model) (tidegate_desired_replicas{{{sel}}})", "{{model}} desired"),
            ],
            "short",
        ),
        _panel(
            "Batch size distribution",
            [
                (
                    f"sum by (le) (rate(tidegate_batch_size_bucket{{{wsel}}}[$__rate_interval]))",
                    "{{le}}",
                )
            ],
            "short",
            kind="heatmap",
        ),
        _panel(
            "Start-up, model load and cold start",
            [
                (
                    f"max by (model, replica, phase) (tidegate_worker_startup_seconds{{{wsel}}})",
                    "{{model}} {{replica}} {{phase}}",
                ),
                (
                    f"sum by (model) (rate(tidegate_cold_start_seconds_sum{{{sel}}}[1h])) / "
                    f"sum by (model) (rate(tidegate_cold_start_seconds_count{{{sel}}}[1h]))",
                    "{{model}} mean cold start",
                ),
                (
                    f"sum by (model) (increase(tidegate_cold_start_seconds_count{{{sel}}}[1h]))",
                    "{{model}} cold starts (1 h)",
                ),
            ],
            "s",
        ),
        _panel(
            "CPU and GPU utilisation per replica",
            [
                (
                    f"sum by (model, replica) (rate(process_cpu_seconds_total{{{wsel}}}"
                    "[$__rate_interval])) * 100",
                    f"{per_replica} CPU",
                ),
                (
                    f"max by (model, replica, gpu) (DCGM_FI_DEV_GPU_UTIL{{{wsel}}})",
                    f"{per_replica} GPU",
                ),
            ],
            "percent",
        ),
        _panel(
            "Memory per replica",
            [
                (
                    f"max by (model, replica) (process_resident_memory_bytes{{{wsel}}})",
                    f"{per_replica} RSS",
                ),
                (
                    f"max by (model, replica, gpu) (DCGM_FI_DEV_FB_USED{{{wsel}}}) * 1048576",
                    f"{per_replica} GPU used",
                ),
                (
                    f"max by (model, replica, gpu) (DCGM_FI_DEV_FB_FREE{{{wsel}}}) * 1048576",
                    f"{per_replica} GPU free",
                ),
            ],
            "bytes",
        ),
        _panel(
            "Doctor's findings",
            [
                (
                    f"max by (rule, severity) (tidegate_doctor_findings{{{GW}}})",
                    "{{rule}} {{severity}}",
                )
            ],
            "short",
            kind="table",
        ),
    ]


def _layout(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two columns, 8 rows high; ids in order."""
    for index, panel in enumerate(panels):
        panel["id"] = index + 1
        panel["gridPos"] = {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)}
    return panels


def render_dashboard(config: TidegateConfig) -> dict[str, Any]:
    """The Grafana dashboard: the panels of the gateway's ``/dashboard``."""
    models = sorted(config.models)
    return {
        "uid": DASHBOARD_UID,
        "title": "tidegate",
        "tags": ["tidegate"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                },
                {
                    "name": "model",
                    "label": "Model",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {
                        "query": f"label_values(tidegate_requests_total{{{GW}}}, model)",
                        "refId": "models",
                    },
                    "definition": f"label_values(tidegate_requests_total{{{GW}}}, model)",
                    "refresh": 2,
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "options": [],
                    "sort": 1,
                    "regex": "",
                    # the configured models, for a dashboard opened before any traffic
                    "description": "configured: " + ", ".join(models),
                },
            ]
        },
        "annotations": {
            "list": [
                {
                    "name": "Scale events",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "enable": True,
                    "iconColor": "orange",
                    "expr": SCALE_EVENTS_ANNOTATION,
                    "step": "60s",
                    "titleFormat": "scale {{direction}}",
                    "textFormat": "{{model}}: {{reason}}",
                    "tagKeys": "model,direction",
                }
            ]
        },
        "panels": _layout(_panels()),
    }


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
