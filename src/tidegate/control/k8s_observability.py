"""The monitoring half of ``tidegate k8s render``: scrape targets, rules and the dashboard.

Rendered for the Prometheus Operator (kube-prometheus-stack), which the rest of the render
already assumes (KEDA's default server is its ``prometheus-operated`` Service):

- a ``PodMonitor`` for the workers: job ``tidegate-workers``, and the labels ``model``,
  ``pool`` (from the pod's ``tidegate.io/model-name`` / ``pool-name`` annotations: the exact
  names, which pod labels may not hold) and ``replica`` (the pod), as the gateway's http_sd
  endpoint gives them outside a cluster;
- a ``ServiceMonitor`` for the gateways: job ``tidegate-gateway``;
- a ``PrometheusRule`` with ``ops.observability``'s rules, reading the autoscaler's wish from
  kube-state-metrics' HPA series (the HPA decides in a cluster, not the gateway). A
  PrometheusRule rather than a ConfigMap: the Operator validates and loads it into every
  matching Prometheus without a restart or a volume to mount; plain Prometheus users take
  the same rules from ``tidegate observability render``;
- the Grafana dashboard in a ``ConfigMap`` labelled ``grafana_dashboard: "1"``, the label
  the Grafana sidecar of kube-prometheus-stack imports dashboards by.

Invariants: the monitors select exactly the pods and Service the render made; the rules are
the ones ``tidegate observability render`` writes, but for the autoscaler's source.
"""

from __future__ import annotations

import json
from typing import Any

from tidegate.config import TidegateConfig
from tidegate.control.k8s_objects import RenderOptions, common_labels, metadata
from tidegate.ops.grafana import render_dashboard
from tidegate.ops.observability import ScaleSource, render_rules
from tidegate.ops.series import GATEWAY_JOB, WORKERS_JOB

__all__ = ["MODEL_ANNOTATION", "POOL_ANNOTATION", "render_monitoring"]

MODEL_ANNOTATION = "tidegate.io/model-name"
POOL_ANNOTATION = "tidegate.io/pool-name"
SCRAPE_INTERVAL = "15s"


def _meta_annotation(key: str) -> str:
    """The service-discovery label Prometheus gives a pod annotation."""
    return "__meta_kubernetes_pod_annotation_" + "".join(c if c.isalnum() else "_" for c in key)


def _job(name: str) -> dict[str, Any]:
    return {"targetLabel": "job", "replacement": name, "action": "replace"}


def render_monitoring(
    config: TidegateConfig,
    options: RenderOptions,
    hpa_names: dict[str, str],
    gateway_labels: dict[str, str],
) -> list[dict[str, Any]]:
    """PodMonitor, ServiceMonitor, PrometheusRule and the dashboard ConfigMap."""
    labels = {**common_labels(), "app.kubernetes.io/component": "monitoring"}
    workers = {**common_labels(), "app.kubernetes.io/component": "worker"}
    pod_monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": metadata("tidegate-workers", options.namespace, labels),
        "spec": {
            "selector": {"matchLabels": workers},
            "podMetricsEndpoints": [
                {
                    "port": "http",
                    "path": "/metrics",
                    "interval": SCRAPE_INTERVAL,
                    "honorLabels": True,  # the workers' model label is the target's
                    "relabelings": [
                        _job(WORKERS_JOB),
                        {
                            "sourceLabels": [_meta_annotation(MODEL_ANNOTATION)],
                            "targetLabel": "model",
                        },
                        {
                            "sourceLabels": [_meta_annotation(POOL_ANNOTATION)],
                            "targetLabel": "pool",
                        },
                        {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "replica"},
                    ],
                }
            ],
        },
    }
    service_monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata("tidegate-gateway", options.namespace, labels),
        "spec": {
            "selector": {"matchLabels": gateway_labels},
            "endpoints": [
                {
                    "port": "http",
                    "path": "/metrics",
                    "interval": SCRAPE_INTERVAL,
                    "relabelings": [_job(GATEWAY_JOB)],
                }
            ],
        },
    }
    source = ScaleSource(options.namespace, tuple(sorted(hpa_names.items())))
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": metadata("tidegate", options.namespace, labels),
        "spec": render_rules(config, source),
    }
    dashboard = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(
            "tidegate-grafana-dashboard",
            options.namespace,
            {**labels, "grafana_dashboard": "1"},
        ),
        "data": {"tidegate.json": json.dumps(render_dashboard(config), indent=2)},
    }
    return [pod_monitor, service_monitor, rule, dashboard]
