"""Prometheus metrics. Every process owns one registry; names start with ``tidegate_``.

Request metrics are labelled by ``model`` and ``priority`` (the level name). Every registry
also carries prometheus_client's standard ``process_*`` metrics (CPU seconds, resident
memory) of its own process. docs/observability.md lists every metric and who exports it.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

# Seconds: from a millisecond batch to a minute-long queue wait.
LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Seconds: tokenizing one request, from a short prompt (tens of microseconds) to a long
# batch of inputs (tens of milliseconds); above a second the worker is badly CPU-bound.
TOKENIZE_BUCKETS_S = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)


class _RequestMetrics:
    """The request metrics every process exports, with the same names and labels."""

    def __init__(self, registry: CollectorRegistry | None, where: str) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # process_cpu_seconds_total, process_resident_memory_bytes, ...: read at scrape time.
        ProcessCollector(registry=r)
        self.queue_depth = Gauge(
            "tidegate_queue_depth",
            f"Requests waiting in the {where}'s queue.",
            ["model", "priority"],
            registry=r,
        )
        self.request_duration = Histogram(
            "tidegate_request_duration_seconds",
            "Request duration by phase: queue (waiting for a slot), ttft (to the first byte "
            "of the reply), e2e (whole request).",
            ["model", "priority", "phase"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.requests = Counter(
            "tidegate_requests_total",
            "Requests by terminal outcome.",
            ["model", "priority", "outcome"],
            registry=r,
        )
        # Labelled children, looked up once: ``labels()`` takes a lock and checks every
        # value, a fair share of the bookkeeping of a request. The label sets are bounded
        # (configured models and levels, a fixed set of outcomes and phases).
        self._counters: dict[tuple[str, str, str], Any] = {}
        self._timers: dict[tuple[str, str, str], Any] = {}

    def count(self, model: str, priority: str, outcome: str) -> None:
        """``tidegate_requests_total{model, priority, outcome}`` + 1."""
        key = (model, priority, outcome)
        child = self._counters.get(key)
        if child is None:
            child = self._counters[key] = self.requests.labels(*key)
        child.inc()

    def observe(self, model: str, priority: str, phase: str, seconds: float) -> None:
        """One ``tidegate_request_duration_seconds{model, priority, phase}`` observation."""
        key = (model, priority, phase)
        child = self._timers.get(key)
        if child is None:
            child = self._timers[key] = self.request_duration.labels(*key)
        child.observe(seconds)


class WorkerMetrics(_RequestMetrics):
    """What one engine worker exports on /metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry, "worker")
        r = self.registry
        self.inflight = Gauge(
            "tidegate_worker_inflight",
            "Requests (embedding inputs or sequences) running.",
            ["model"],
            registry=r,
        )
        self.batch_size = Histogram(
            "tidegate_batch_size",
            "Inputs per engine batch (embeddings) or running sequences "
            "when one starts (generation).",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.batch_duration = Histogram(
            "tidegate_batch_duration_seconds",
            "Engine time per embedding batch.",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tokenize = Histogram(
            "tidegate_tokenize_seconds",
            "Time the worker spends tokenizing one request (its prompt, chat template or "
            "inputs), on the event loop before the request is queued.",
            ["model"],
            buckets=TOKENIZE_BUCKETS_S,
            registry=r,
        )
        self.tokens = Counter(
            "tidegate_tokens_total",
            "Tokens processed.",
            ["model", "kind"],
            registry=r,
        )
        self.startup = Gauge(
            "tidegate_worker_startup_seconds",
            "Start-up phases: load, warmup, ready (time from process start to ready).",
            ["model", "phase"],
            registry=r,
        )
        self.ready = Gauge(
            "tidegate_worker_ready", "1 once warm-up succeeded.", ["model"], registry=r
        )
        self.memory = Gauge(
            "tidegate_engine_memory_bytes",
            "Engine memory: weights and peak.",
            ["model", "device", "kind"],
            registry=r,
        )


class GatewayMetrics(_RequestMetrics):
    """What the gateway exports on /metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry, "gateway")
        r = self.registry
        self.inflight = Gauge(
            "tidegate_inflight",
            "Requests sent to a replica and not yet finished.",
            ["model", "replica"],
            registry=r,
        )
        self.replicas = Gauge(
            "tidegate_replicas",
            "Replicas by pool and lifecycle state.",
            ["model", "pool", "state"],
            registry=r,
        )
        self.quota_rejections = Counter(
            "tidegate_quota_rejections_total",
            "Requests refused by their API key's rate limit before taking a place in the "
            "queue, by key and the limit that refused them (requests or tokens).",
            ["key", "limit"],
            registry=r,
        )
        self.retries = Counter(
            "tidegate_retries_total",
            "Requests retried on another replica after a connect failure.",
            ["model"],
            registry=r,
        )
        self.ejections = Counter(
            "tidegate_replica_ejections_total",
            "Replicas taken out of routing for a while after consecutive failed answers "
            "(outlier detection).",
            ["model", "replica"],
            registry=r,
        )
        self.ejected = Gauge(
            "tidegate_replica_ejected",
            "1 while a replica is ejected from routing by outlier detection.",
            ["model", "replica"],
            registry=r,
        )
        self.queue_depth_per_replica = Gauge(
            "inference_queue_depth",
            "Demand per ready replica: (queued + in-flight) / ready "
            "replicas. The autoscaling signal.",
            ["model"],
            registry=r,
        )
        self.scale_events = Counter(
            "tidegate_scale_events_total",
            "Replica count changes the autoscaler made, by direction and the rule that chose it.",
            ["model", "direction", "reason"],
            registry=r,
        )
        self.desired_replicas = Gauge(
            "tidegate_desired_replicas",
            "Replicas the autoscaler wants for a model (its last decision).",
            ["model"],
            registry=r,
        )
        self.cold_start = Histogram(
            "tidegate_cold_start_seconds",
            "From a replica's launch to ready (warm-up passed).",
            ["model"],
            buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
            registry=r,
        )
        self.doctor_findings = Gauge(
            "tidegate_doctor_findings",
            "Doctor's active findings over the gateway's own metrics, by rule and severity "
            "(0 once cleared).",
            ["rule", "severity"],
            registry=r,
        )
        self.drain = Histogram(
            "tidegate_drain_seconds",
            "From draining (no new requests) to stopped, for a replica scaled in.",
            ["model"],
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120),
            registry=r,
        )
