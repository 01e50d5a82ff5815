"""Small builders shared by the manifests of ``tidegate k8s render``: options, names,
labels, metadata, probes and disruption budgets.

Invariants: every name is a DNS-1035 label of at most 63 characters (Services need it), and
distinct inputs give distinct names; every object carries the common labels.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from tidegate import __version__

WORKER_PORT = 8080
GATEWAY_PORT = 8000  # when the config says port 0
GRACE_MARGIN_S = 5
PROBE_PERIOD_S = 5
TIDEGATE = ("tidegate",)  # the console script inside the image


@dataclass(frozen=True, slots=True)
class RenderOptions:
    image: str = f"tidegate:{__version__}"
    namespace: str = "default"
    keda: bool = False
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"
    gateway_replicas: int = 2


def common_labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": "tidegate", "app.kubernetes.io/part-of": "tidegate"}


def dns_name(*parts: str) -> str:
    """A DNS-1035 label (Service names are the strictest): a short hash keeps it unique
    when the parts had to be changed to fit."""
    raw = "-".join(parts)
    name = re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]+", "-", raw.lower())).strip("-")
    if name != raw or len(name) > 63:
        digest = hashlib.sha256(raw.encode()).hexdigest()[:6]
        name = f"{name[: 63 - 7].rstrip('-')}-{digest}"
    return name


def _common() -> dict[str, str]:
    return {"app.kubernetes.io/name": "tidegate", "app.kubernetes.io/part-of": "tidegate"}


def metadata(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": {**labels, "app.kubernetes.io/managed-by": "tidegate"},
    }


def probe(path: str, period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period_s,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def pdb(name: str, selector: dict[str, str], options: RenderOptions) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(name, options.namespace, selector),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
    }
