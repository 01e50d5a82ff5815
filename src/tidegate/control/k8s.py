"""``tidegate k8s render``: Kubernetes manifests for a tidegate configuration.

Kubernetes is not an orchestrator of tidegate's controller here: the cluster's own
controllers act on what is rendered (see docs/kubernetes.md). Per local model:

- a worker ``Deployment`` per pool it has replicas in, running the same ``tidegate worker``
  command line as a local replica (``control.local.worker_command``) on port 8080:
  requests = limits (Guaranteed QoS), ``nvidia.com/gpu: 1`` for ``gpu: exclusive``, HAMi's
  ``nvidia.com/gpumem`` (MiB) + ``nvidia.com/gpu: 1`` for a shared model on a GPU pool, a
  memory-backed ``/dev/shm``, startup and readiness probes on ``/readyz`` (gated on
  warm-up), liveness on ``/livez``, a preStop hook that drains (``tidegate k8s drain``) and
  a termination grace period that covers it;
- a ``PodDisruptionBudget`` per Deployment (one replica evicted at a time);
- one ``Service`` per model over its pods: the gateway's upstream for the model;
- when autoscaled, an HPA or a KEDA ScaledObject (``control.k8s_scaling``).

And the gateway: its configuration in a ``ConfigMap`` (every local model switched to
``engine: openai`` with its Service as the one upstream), a ``Deployment``, a ``Service``
and a ``PodDisruptionBudget``; plus the Prometheus Adapter rules (without ``--keda``).
Monitoring (``control.k8s_observability``): a PodMonitor and a ServiceMonitor, the alerting
and recording rules as a PrometheusRule and the Grafana dashboard as a ConfigMap, all in
their own file (they need the Prometheus Operator's CRDs).

Invariants: requests == limits in every container; every selector matches its pods'
labels and nothing else; every HPA targets a rendered Deployment; a worker's grace period
exceeds its drain timeout; what cannot be rendered faithfully is an error or a note.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from tidegate import __version__
from tidegate.config import ModelSpec, TidegateConfig
from tidegate.control import k8s_scaling
from tidegate.control.k8s_gateway import ModelService, render_gateway
from tidegate.control.k8s_objects import (
    GRACE_MARGIN_S,
    PROBE_PERIOD_S,
    TIDEGATE,
    WORKER_PORT,
    RenderOptions,
    common_labels,
    dns_name,
    metadata,
    pdb,
    probe,
)
from tidegate.control.k8s_observability import (
    MODEL_ANNOTATION,
    POOL_ANNOTATION,
    render_monitoring,
)
from tidegate.control.k8s_scaling import ScaleTarget
from tidegate.control.local import tidegate_command, worker_command
from tidegate.errors import ConfigError

__all__ = [
    "MONITORING_FILE",
    "MONITORING_KINDS",
    "Manifests",
    "RenderOptions",
    "container_args",
    "dns_name",
    "drain_worker",
    "grace_period_s",
    "render_manifests",
    "worker_resources",
    "write_manifests",
]

WORKER_SHUTDOWN_S = 10  # the worker's graceful shutdown after SIGTERM (worker/server.py)
SHM_MB = 1024
RUNTIME_MB = 1024  # host memory of Python and the engine runtime beyond the model itself
GPU_HOST_MB = 8192  # host memory of a GPU worker: CUDA context, loading the weights
WORKER_CPU = "2"
STARTUP_BUDGET_S = 600  # how long loading + warm-up may take before the pod restarts
FILES = {  # kind -> file under --out; numbered in the order `kubectl apply -f DIR` wants
    "ConfigMap": "01-configmap.yaml",
    "Service": "02-service.yaml",
    "Deployment": "03-deployment.yaml",
    "PodDisruptionBudget": "04-poddisruptionbudget.yaml",
    "HorizontalPodAutoscaler": "05-horizontalpodautoscaler.yaml",
    "ScaledObject": "05-scaledobject.yaml",
}
ADAPTER_FILE = "06-prometheus-adapter-rules.yaml"
MONITORING_FILE = "07-monitoring.yaml"
MONITORING_KINDS = ("PodMonitor", "ServiceMonitor", "PrometheusRule")
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@dataclass(frozen=True, slots=True)
class Manifests:
    documents: tuple[dict[str, Any], ...]
    notes: tuple[str, ...]
    source: str

    def by_file(self) -> dict[str, list[dict[str, Any]]]:
        files: dict[str, list[dict[str, Any]]] = {}
        for doc in self.documents:
            name = doc["metadata"]["name"]
            if name.endswith("prometheus-adapter-rules"):
                file = ADAPTER_FILE
            elif doc["kind"] in MONITORING_KINDS or name.endswith("grafana-dashboard"):
                file = MONITORING_FILE
            else:
                file = FILES[doc["kind"]]
            files.setdefault(file, []).append(doc)
        return dict(sorted(files.items()))

    def to_yaml(self, documents: list[dict[str, Any]] | None = None) -> str:
        header = [f"# Rendered by tidegate {__version__} k8s render from {self.source}."]
        header += [f"# note: {note}" for note in self.notes]
        docs = list(self.documents) if documents is None else documents
        body = yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, width=100)
        return "\n".join(header) + "\n" + body


class _Dumper(yaml.SafeDumper):
    """No anchors and aliases: a selector and its pod labels are written out both times."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class _Unit:
    """One worker Deployment: a model's replicas in one pool."""

    model: ModelSpec
    key: str  # models[i], for errors
    pool: str
    name: str
    replicas: int
    gpu: bool


# ----------------------------------------------------------------------------- entry points


def render_manifests(config: TidegateConfig, options: RenderOptions) -> Manifests:
    """Every manifest for ``config``; ConfigError when something cannot be rendered."""
    notes: list[str] = []
    units = _units(config, notes)
    docs: list[dict[str, Any]] = []
    services: dict[str, ModelService] = {}
    for model in {unit.model.name: unit.model for unit in units}.values():
        service = _service(model, options.namespace)
        url = (
            f"http://{service['metadata']['name']}.{options.namespace}.svc.cluster.local:"
            f"{WORKER_PORT}"
        )
        used = {unit.pool for unit in units if unit.model is model}
        pools = tuple(pool for pool in model.pools if pool in used)
        services[model.name] = ModelService(url, pools)
        docs.append(service)
    for unit in units:
        docs += [_deployment(config, unit, options), pdb(unit.name, _selector(unit), options)]
        docs += _autoscaler(config, unit, options, notes)
    docs += render_gateway(config, services, options, notes)
    scaled = [u.model.autoscaling for u in units if u.model.autoscaling is not None]
    if scaled and not options.keda:
        labels = {**common_labels(), "app.kubernetes.io/component": "metrics"}
        docs.append(k8s_scaling.render_adapter_config_map(scaled, options.namespace, labels))
    hpas = {u.model.name: u.name for u in units if u.model.autoscaling is not None}
    gateway_labels = {**common_labels(), "app.kubernetes.io/component": "gateway"}
    docs += render_monitoring(config, options, hpas, gateway_labels)
    _check_unique(docs, config.source)
    return Manifests(tuple(docs), tuple(notes), config.source)


def _check_unique(docs: list[dict[str, Any]], source: str) -> None:
    """Two objects of one kind with one name would overwrite each other when applied."""
    seen: set[tuple[str, str]] = set()
    for doc in docs:
        key = (doc["kind"], doc["metadata"]["name"])
        if key in seen:
            raise ConfigError(
                source,
                "models",
                f"two {key[0]}s would be named {key[1]} (model and pool names meet there)",
                "rename one of the models (or pools) involved",
            )
        seen.add(key)


def write_manifests(manifests: Manifests, out: Path) -> list[Path]:
    """One file per kind under ``out`` (created); the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file, docs in manifests.by_file().items():
        path = out / file
        path.write_text(manifests.to_yaml(docs), encoding="utf-8")
        written.append(path)
    return written


def drain_worker(
    url: str, timeout_s: float, *, poll_s: float = 0.5, transport: httpx.BaseTransport | None = None
) -> str:
    """The worker's preStop hook: ``POST /admin/drain`` (no new requests; what waits goes
    back to the gateway), then wait until nothing runs, at most ``timeout_s``.

    Polls ``/stats``: the worker is another process, and its HTTP API is all there is.
    Never fails: the pod stops after the hook either way. Returns what happened.
    """
    deadline = time.monotonic() + timeout_s
    # Each call may take the whole budget: on a busy node a local answer can take seconds,
    # and "did not answer" would stop the pod with its batch still running.
    per_call_s = max(1.0, timeout_s)
    with httpx.Client(base_url=url, timeout=per_call_s, transport=transport) as client:
        try:
            answer = client.post("/admin/drain")
            returned = answer.json().get("returned", 0) if answer.status_code == 200 else 0
            while (in_flight := int(client.get("/stats").json().get("in_flight", 0))) > 0:
                if time.monotonic() >= deadline:
                    return f"drain: {in_flight} still in flight after {timeout_s:g} s; stopping"
                time.sleep(poll_s)
        except (httpx.HTTPError, ValueError) as exc:
            return f"drain: {url} did not answer ({exc}); stopping"
    return f"drained: {returned} handed back to the gateway, nothing in flight"


# ----------------------------------------------------------------------------- names


def _selector(unit: _Unit) -> dict[str, str]:
    return {**_model_selector(unit.model), "tidegate.io/pool": dns_name(unit.pool)}


def _model_selector(model: ModelSpec) -> dict[str, str]:
    return {
        **common_labels(),
        "app.kubernetes.io/component": "worker",
        "tidegate.io/model": dns_name(model.name),
    }


# ----------------------------------------------------------------------------- workers


def _units(config: TidegateConfig, notes: list[str]) -> list[_Unit]:
    units: list[_Unit] = []
    for index, model in enumerate(config.models.values()):
        key = f"models[{index}]"
        if not model.local:
            continue
        if not _LABEL_VALUE_RE.match(model.name) or len(model.name) > 63:
            raise ConfigError(
                config.source,
                f"{key}.name",
                f"{model.name!r} cannot be a Kubernetes label value (the HPA's metric selector)",
                "rename it: at most 63 characters, starting and ending with a letter or digit",
            )
        placed = [(pool, count) for pool, count in model.replicas.items() if count > 0]
        if model.autoscaling is not None:
            if len(placed) > 1:
                raise ConfigError(
                    config.source,
                    f"{key}.replicas",
                    f"autoscaled with replicas in {len(placed)} pools: on Kubernetes one HPA "
                    "scales one Deployment, and the pools would each scale to the whole demand",
                    "start it in one pool (replicas: {pool: N}), or split it into one model "
                    "per pool",
                )
            placed = placed or [(next(iter(model.replicas), model.pools[0]), 0)]
        elif not placed:
            notes.append(f"{model.name}: no replica in any pool: nothing rendered for it")
        for path in (model.model_path, model.profile):
            if path is not None:
                notes.append(f"{model.name}: {path} must exist at that path in the image")
        for pool, count in placed:
            name = dns_name("tidegate", model.name, pool)
            gpu = _gpu_pool(config, pool)
            units.append(_Unit(model, key, pool, name, count, gpu))
    return units


def _gpu_pool(config: TidegateConfig, pool: str) -> bool:
    """On Kubernetes a pool runs on GPUs when a device inventory is declared (its devices
    are GPUs) or when it lists cuda:N; auto and cpu pools run on CPU otherwise (a pod sees
    no GPU it did not request, so auto would find none)."""
    devices = config.pools[pool].devices
    return bool(config.devices) or any(d.startswith("cuda:") for d in devices)


def _deployment(config: TidegateConfig, unit: _Unit, options: RenderOptions) -> dict[str, Any]:
    model = unit.model
    labels = _selector(unit)
    spec: dict[str, Any] = {
        "selector": {"matchLabels": labels},
        # Make before break: a new replica warms up before an old one drains.
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        },
        "template": {
            "metadata": {
                "labels": labels,
                "annotations": {
                    "prometheus.io/scrape": "true",
                    "prometheus.io/port": str(WORKER_PORT),
                    "prometheus.io/path": "/metrics",
                    # exact names for the PodMonitor's model and pool labels
                    MODEL_ANNOTATION: model.name,
                    POOL_ANNOTATION: unit.pool,
                },
            },
            "spec": {
                "terminationGracePeriodSeconds": grace_period_s(model.drain_timeout_s),
                "containers": [_worker_container(config, unit, options)],
                "volumes": [
                    {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{SHM_MB}Mi"}}
                ],
            },
        },
    }
    if model.autoscaling is None:
        spec = {"replicas": unit.replicas, **spec}
    # Autoscaled: no replicas field, so that re-applying does not fight the HPA.
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(unit.name, options.namespace, labels),
        "spec": spec,
    }


def grace_period_s(drain_timeout_s: float) -> int:
    """preStop drain, then the worker's own graceful shutdown, then a margin."""
    return math.ceil(drain_timeout_s) + WORKER_SHUTDOWN_S + GRACE_MARGIN_S


def _worker_container(
    config: TidegateConfig, unit: _Unit, options: RenderOptions
) -> dict[str, Any]:
    model = unit.model
    settings = config.worker_settings(model.name, "cuda:0" if unit.gpu else "cpu")
    startup_s = STARTUP_BUDGET_S
    if model.autoscaling is not None:
        startup_s = max(startup_s, math.ceil(2 * model.autoscaling.cold_start_s))
    drain = [*TIDEGATE, "k8s", "drain", "--url", f"http://127.0.0.1:{WORKER_PORT}"]
    return {
        "name": "worker",
        "image": options.image,
        "command": list(TIDEGATE),
        "args": container_args(worker_command(settings)),
        "ports": [{"name": "http", "containerPort": WORKER_PORT}],
        "env": [
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "TOKENIZERS_PARALLELISM", "value": "false"},
        ],
        "resources": worker_resources(model, unit.gpu),
        "startupProbe": probe("/readyz", PROBE_PERIOD_S, math.ceil(startup_s / PROBE_PERIOD_S)),
        "readinessProbe": probe("/readyz", PROBE_PERIOD_S, 2),
        "livenessProbe": probe("/livez", 10, 6),
        "lifecycle": {
            "preStop": {"exec": {"command": [*drain, "--timeout-s", f"{model.drain_timeout_s:g}"]}}
        },
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }


def container_args(command: list[str]) -> list[str]:
    """``worker_command``'s arguments for a container: without this interpreter's path to
    tidegate, listening on every address at WORKER_PORT."""
    prefix = tidegate_command()
    if command[: len(prefix)] != prefix:
        raise ValueError(f"not a tidegate command line: {command[:3]}")
    args = command[len(prefix) :]
    for flag, value in (("--host", "0.0.0.0"), ("--port", str(WORKER_PORT))):
        args[args.index(flag) + 1] = value
    return args


def worker_resources(model: ModelSpec, gpu: bool) -> dict[str, dict[str, str]]:
    """requests == limits (Guaranteed QoS); GPU asks as the NVIDIA device plugin and HAMi
    take them."""
    host_mb = (GPU_HOST_MB if gpu else model.memory_mb + RUNTIME_MB) + SHM_MB
    resources = {"cpu": WORKER_CPU, "memory": f"{host_mb}Mi"}
    if gpu:
        resources["nvidia.com/gpu"] = "1"
        if not model.exclusive:
            resources["nvidia.com/gpumem"] = str(model.memory_mb)  # HAMi: MiB of the device
    return {"requests": resources, "limits": dict(resources)}


def _service(model: ModelSpec, namespace: str) -> dict[str, Any]:
    selector = _model_selector(model)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(dns_name("tidegate", model.name), namespace, selector),
        "spec": {
            "selector": selector,
            "ports": [{"name": "http", "port": WORKER_PORT, "targetPort": "http"}],
        },
    }


def _autoscaler(
    config: TidegateConfig, unit: _Unit, options: RenderOptions, notes: list[str]
) -> list[dict[str, Any]]:
    autoscaling = unit.model.autoscaling
    if autoscaling is None:
        return []
    target = ScaleTarget(
        model=unit.model.name,
        deployment=unit.name,
        namespace=options.namespace,
        labels=_selector(unit),
        key=f"{unit.key}.autoscaling",
        source=config.source,
    )
    notes += k8s_scaling.hpa_notes(autoscaling, unit.model.name, options.keda)
    if options.keda:
        return [k8s_scaling.render_scaled_object(autoscaling, target, options.prometheus_url)]
    return [k8s_scaling.render_hpa(autoscaling, target)]
