"""The gateway in a cluster, for ``tidegate k8s render``: its configuration, Deployment,
Service and disruption budget.

What the gateway needs there: every local model served by the model's Service (``engine:
openai``, one upstream, so ``inference_queue_depth`` is the model's whole demand on this
gateway); ``slots`` per upstream sized for every replica the model may have, shared among
the gateway copies; binding every address; no devices and no autoscaling of its own (the
cluster's HPA or KEDA scales the workers). The configuration travels in a ConfigMap whose
digest annotates the pods, so a changed configuration rolls the gateways.

Invariants: the ConfigMap's configuration is itself valid (``parse_config`` loads it); the
grace period covers the preStop pause and ``shutdown_timeout_s``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tidegate.config import ModelSpec, TidegateConfig, render_config
from tidegate.control.k8s_objects import (
    GATEWAY_PORT,
    GRACE_MARGIN_S,
    PROBE_PERIOD_S,
    TIDEGATE,
    RenderOptions,
    common_labels,
    metadata,
    pdb,
    probe,
)

GATEWAY_PRESTOP_S = 5  # endpoints propagate before the gateway stops admitting
GATEWAY_CPU = "2"
GATEWAY_MB = 1024
CONFIG_PATH = "/etc/tidegate/config.yaml"


@dataclass(frozen=True, slots=True)
class ModelService:
    """How the gateway reaches a local model in the cluster."""

    url: str  # the model's Service
    pools: tuple[str, ...]  # the pools its Deployments are in, in the model's order


def gateway_config(
    config: TidegateConfig, services: dict[str, ModelService], options: RenderOptions
) -> TidegateConfig:
    """What the gateway runs with in the cluster: every local model served by its Service
    (engine openai), nothing placed or autoscaled by the gateway itself."""
    models: dict[str, ModelSpec] = {}
    for name, model in config.models.items():
        if not model.local:
            models[name] = model
        elif name in services:
            models[name] = dataclasses.replace(
                model,
                engine="openai",
                model_path=None,
                profile=None,
                replicas=MappingProxyType({}),
                pools=services[name].pools,
                upstreams=(services[name].url,),
                upstream_workers=True,  # behind the Service: tidegate workers (the tenant)
                slots=_gateway_slots(model, options.gateway_replicas),
                autoscaling=None,
                # the workers' own (their Deployment's flags): an openai upstream refuses it
                batching=dataclasses.replace(model.batching, max_prefill_tokens=0),
            )
    pools = {name: dataclasses.replace(p, devices=("auto",)) for name, p in config.pools.items()}
    gateway = dataclasses.replace(
        config.gateway, host="0.0.0.0", port=config.gateway.port or GATEWAY_PORT
    )
    return dataclasses.replace(
        config,
        gateway=gateway,
        pools=MappingProxyType(pools),
        models=MappingProxyType(models),
        devices=(),
        notes=(),
    )


def _gateway_slots(model: ModelSpec, gateways: int) -> int:
    """In flight from one gateway to the model's Service: what every replica at the most
    takes (its /stats ``slots``), shared among the gateway copies."""
    per_replica = model.slots
    if per_replica is None:
        per_replica = 2 * model.batching.max_batch_size
        if model.task == "generate":
            per_replica = model.batching.max_num_seqs
    most = model.autoscaling.max_replicas if model.autoscaling else sum(model.replicas.values())
    return max(1, math.ceil(per_replica * most / gateways))


def render_gateway(
    config: TidegateConfig,
    services: dict[str, ModelService],
    options: RenderOptions,
    notes: list[str],
) -> list[dict[str, Any]]:
    cluster = gateway_config(config, services, options)
    text = render_config(cluster)
    port = cluster.gateway.port
    labels = {**common_labels(), "app.kubernetes.io/component": "gateway"}
    name = "tidegate-gateway"
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(f"{name}-config", options.namespace, labels),
        "data": {"config.yaml": text},
    }
    ready_path = "/readyz"
    if options.keda and any(
        m.autoscaling and m.autoscaling.scale_to_zero for m in config.models.values()
    ):
        # The gateway's /readyz waits for every model; a model at zero replicas would keep
        # every gateway out of its Service, and no demand would ever wake the model.
        ready_path = "/livez"
        notes.append("gateway: readiness on /livez, since a model scales to zero")
    container = {
        "name": "gateway",
        "image": options.image,
        "command": list(TIDEGATE),
        "args": ["serve", "--config", CONFIG_PATH, "--host", "0.0.0.0", "--port", str(port)],
        "ports": [{"name": "http", "containerPort": port}],
        "resources": {
            "requests": {"cpu": GATEWAY_CPU, "memory": f"{GATEWAY_MB}Mi"},
            "limits": {"cpu": GATEWAY_CPU, "memory": f"{GATEWAY_MB}Mi"},
        },
        "startupProbe": probe("/livez", PROBE_PERIOD_S, 12),
        "readinessProbe": probe(ready_path, PROBE_PERIOD_S, 2),
        "livenessProbe": probe("/livez", 10, 6),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(GATEWAY_PRESTOP_S)]}}},
        "volumeMounts": [{"name": "config", "mountPath": str(Path(CONFIG_PATH).parent)}],
    }
    digest = hashlib.sha256(text.encode()).hexdigest()
    grace = GATEWAY_PRESTOP_S + math.ceil(config.gateway.shutdown_timeout_s) + GRACE_MARGIN_S
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(name, options.namespace, labels),
        "spec": {
            "replicas": options.gateway_replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {
                    "labels": labels,
                    # A changed config rolls the gateways.
                    "annotations": {"tidegate.io/config-sha256": digest},
                },
                "spec": {
                    "terminationGracePeriodSeconds": grace,
                    "containers": [container],
                    "volumes": [{"name": "config", "configMap": {"name": f"{name}-config"}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(name, options.namespace, labels),
        "spec": {
            "selector": labels,
            "ports": [{"name": "http", "port": port, "targetPort": "http"}],
        },
    }
    return [config_map, deployment, service, pdb(name, labels, options)]
