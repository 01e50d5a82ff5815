"""What the rendered rules and dashboard read: two scrape jobs, by name.

- ``tidegate-gateway``: the gateways' ``/metrics`` (queues, outcomes, latency by phase,
  replicas, the autoscaler's decisions);
- ``tidegate-workers``: every worker's ``/metrics``, found through the gateway's
  ``/admin/prometheus/targets`` (http_sd) or, in a cluster, a PodMonitor; each target
  carries the labels ``model``, ``replica`` and ``pool``.

Both export ``tidegate_requests_total`` and ``tidegate_request_duration_seconds``, so every
query names its job: a sum over both would count each request twice.
"""

from __future__ import annotations

GATEWAY_JOB = "tidegate-gateway"
WORKERS_JOB = "tidegate-workers"
GW = f'job="{GATEWAY_JOB}"'  # label matchers of each job
WK = f'job="{WORKERS_JOB}"'
WINDOW = "1m"  # rate window of the recording rules: 4 scrapes at Prometheus' default 15 s
QUANTILES = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
