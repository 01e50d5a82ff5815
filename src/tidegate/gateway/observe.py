"""What Prometheus needs to find the workers and to join their metrics to replicas.

``GET /admin/prometheus/targets`` is a Prometheus HTTP service-discovery endpoint (the
``http_sd_config`` format): one target group per live tidegate worker, its ``host:port``
with the labels ``model``, ``replica`` and ``pool`` (and ``__scheme__`` /
``__metrics_path__`` from its URL). A worker is live while it has an address and is not
stopped or failed: a restarted worker is listed at its new address, a replica scaled in
disappears, one scaled out appears once it has bound. Upstream servers (vLLM, SGLang, any
OpenAI-compatible URL) are not listed: they are not tidegate workers and may not serve
``/metrics``; scrape them with their own job. Admin role whenever keys are configured.

``tidegate_arrivals_total{model}`` counts the requests submitted to each model's queue,
refused ones included (the dispatcher's ``num_arrived``: the offered load the autoscaler's
``target_rate_per_replica`` sizes on, and what ``tidegate k8s render`` gives an HPA for it),
read at each scrape.

``tidegate_replica_info{model,replica,pool,device,url}`` is 1 for every replica the gateway
knows, read from the replica set at each scrape (a collector, so it can never lag behind):
``device`` is where the orchestrator placed it (``cpu``, ``cuda:N`` or a declared device id;
empty when unknown, as for upstreams), ``url`` its base URL (empty while it has none).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tidegate.gateway.auth import authorize_admin
from tidegate.gateway.replicas import Replica, ReplicaState
from tidegate.gateway.state import Gateway

TARGETS_PATH = "/admin/prometheus/targets"
REPLICA_INFO = "tidegate_replica_info"
ARRIVALS = "tidegate_arrivals"  # exposed as tidegate_arrivals_total
REPLICA_INFO_LABELS = ("model", "replica", "pool", "device", "url")
_GONE = (ReplicaState.STOPPED, ReplicaState.FAILED)  # no process behind the address


def add_observe_routes(app: FastAPI, gateway: Gateway) -> None:
    """The service-discovery route, and the gateway's scrape-time series in its registry."""
    gateway.metrics.registry.register(ScrapeCollector(gateway))

    @app.get(TARGETS_PATH)
    async def prometheus_targets(request: Request) -> list[dict[str, Any]]:
        """Prometheus http_sd targets: every live worker's /metrics."""
        authorize_admin(gateway.config, request)
        return scrape_targets(gateway)


def scrape_targets(gateway: Gateway) -> list[dict[str, Any]]:
    """One http_sd target group per live worker, ordered by model and replica id."""
    groups = []
    for model in sorted(gateway.replicas):
        for replica in sorted(gateway.replicas[model], key=lambda r: r.id):
            if replica.kind == "upstream" or replica.url is None or replica.state in _GONE:
                continue
            address = urlsplit(replica.url)
            labels = {
                "model": model,
                "replica": replica.id,
                "pool": replica.pool,
                "__scheme__": address.scheme,
                "__metrics_path__": address.path.rstrip("/") + "/metrics",
            }
            groups.append({"targets": [address.netloc], "labels": labels})
    return groups


class ScrapeCollector(Collector):
    """What is read from the gateway's state when scraped, so it can never lag behind:
    ``tidegate_replica_info`` (the replica set) and ``tidegate_arrivals_total`` (each
    dispatcher's count of submitted requests: no work on the request path beyond the count
    the autoscaler keeps)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def describe(self) -> Iterable[Metric]:
        return [_family(), _arrivals()]

    def collect(self) -> Iterator[Metric]:
        family = _family()
        for model in sorted(self.gateway.replicas):
            for replica in self.gateway.replicas[model]:
                device = device_of(self.gateway, replica)
                labels = (model, replica.id, replica.pool, device, replica.url or "")
                family.add_metric(labels, 1.0)
        yield family
        arrivals = _arrivals()
        for model in sorted(self.gateway.dispatchers):
            arrivals.add_metric((model,), float(self.gateway.dispatchers[model].num_arrived))
        yield arrivals


def _arrivals() -> CounterMetricFamily:
    return CounterMetricFamily(
        ARRIVALS,
        "Requests submitted to a model's queue, refused ones included: the offered load "
        "(autoscaling.target_rate_per_replica sizes on its rate).",
        labels=("model",),
    )


def device_of(gateway: Gateway, replica: Replica) -> str:
    """Where an orchestrator placed ``replica``; empty when none of them says."""
    orchestrators = list(gateway.orchestrators)
    runner = getattr(gateway.controller, "orchestrator", None)
    if runner is not None:
        orchestrators.append(runner)
    for orchestrator in orchestrators:
        where = getattr(orchestrator, "device_of", None)
        if where is None:
            continue
        try:
            return str(where(replica.id))
        except KeyError:  # not one of this orchestrator's replicas
            continue
    return ""


def _family() -> GaugeMetricFamily:
    return GaugeMetricFamily(
        REPLICA_INFO,
        "1 for each replica the gateway knows: where it runs (device) and its URL, to join "
        "the workers' metrics (labelled model, replica, pool by service discovery).",
        labels=REPLICA_INFO_LABELS,
    )
