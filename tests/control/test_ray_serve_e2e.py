"""``tidegate serve`` on a Ray cluster, end to end: autoscaling over nodes, and a node lost.

The test process starts a three-node Ray cluster on loopback (``raycluster``), each node
declaring one GPU of ``NODE_MEMORY_MB`` (``gpu_mem_mb``), the pool ``shared`` and two CPUs;
then a real ``tidegate serve`` whose configuration (``controller: {orchestrator: ray}``)
points at that cluster. The gateway process is the Ray driver: its controller autoscales a
simulated embedding model whose replicas are Ray actors. Real OpenAI clients (the ``openai``
package, no retries) send the load to 127.0.0.1.

The story: one replica; a burst makes it four, spread over the nodes; a node that holds
replicas is removed under load and its replicas come back on the surviving nodes; the load
stops and the count goes back to one; SIGTERM stops the gateway cleanly. Every request sent
got an answer (none raised, none hung), each is counted once in the gateway's
``tidegate_requests_total``, and an answer that is not a 200 is a 429 or a 503 with
``Retry-After``.

Every wait is for a condition read from the gateway (``/admin/*``, ``/metrics``), with a
generous deadline and the state printed when it is not met.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.control.raycluster import loopback_cluster
from tests.gateway.harness import flat_profile
from tests.loadthreads import ClosedLoop, openai_embeddings
from tests.procs import DEADLINE_S, Proc, gateway_process

pytestmark = pytest.mark.e2e

MODEL = "sim"
NODE_MEMORY_MB = 1000.0
NODE = {
    "num_cpus": 2,  # a replica reserves one (cpus_per_replica): four fit on two nodes
    "num_gpus": 1,
    "resources": {"gpu_mem_mb": NODE_MEMORY_MB, "pool:shared": 1},
    "node_ip_address": "127.0.0.1",
    "object_store_memory": 80 * 1024 * 1024,
}
MAX_REPLICAS = 4
CLIENTS = 16  # in flight: four times the target of one replica
MAX_REQUESTS = 20_000  # the load's bound in count; its phases bound it in time
OK_REFUSALS = (429, 503)  # with Retry-After; anything else is a failure of the test


def _config(tmp_path: Path, address: str) -> Path:
    profile = flat_profile(tmp_path / "profile.json", latency_ms=100)
    config = {
        "controller": {"orchestrator": "ray", "ray_address": address},
        "pools": {"shared": {"devices": ["cpu"]}},
        "models": [
            {
                "name": MODEL,
                "task": "embeddings",
                "engine": "simulated",
                "profile": str(profile),
                "memory_mb": 200,  # a fifth of a node's GPU
                "replicas": 1,
                "slots": 4,
                "batching": {"max_batch_size": 4, "batch_window_ms": 0},
                "drain_timeout_s": 10,
                "autoscaling": {
                    "min_replicas": 1,
                    "max_replicas": MAX_REPLICAS,
                    "target_per_replica": 4,
                    "interval_s": 0.5,
                    "stable_window_s": 0,
                    "scale_down": {
                        "stabilization_window_s": 2,
                        "policies": [{"type": "percent", "value": 100, "period_s": 0.5}],
                    },
                },
            }
        ],
    }
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# ----------------------------------------------------------------------------- the gateway
def _get(proc: Proc, path: str) -> Any:
    response = httpx.get(f"{proc.url}{path}", timeout=DEADLINE_S)
    response.raise_for_status()
    return response.json() if path.startswith("/admin") else response.text


def _replicas(proc: Proc) -> list[dict[str, Any]]:
    return list(_get(proc, "/admin/replicas")[MODEL]["replicas"])


def _metrics(proc: Proc) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples by name: (labels, value)."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(_get(proc, "/metrics")):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def _nodes(proc: Proc) -> dict[str, str]:
    """Replica id -> the Ray node it runs on, from ``tidegate_replica_info``'s device."""
    return {
        labels["replica"]: labels["device"].removeprefix("ray:")
        for labels, _ in _metrics(proc)["tidegate_replica_info"]
        if labels["model"] == MODEL
    }


def _ready(proc: Proc) -> dict[str, str]:
    """Ready replica id -> its node."""
    nodes = _nodes(proc)
    return {r["id"]: nodes[r["id"]] for r in _replicas(proc) if r["state"] == "ready"}


def _wait(proc: Proc, what: str, condition: Callable[[], bool], timeout_s: float) -> None:
    """Until ``condition`` holds; else fail with the gateway's replicas and decisions."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            state = {
                "replicas": _replicas(proc),
                "nodes": _nodes(proc),
                "autoscaler": _get(proc, "/admin/autoscaler")["models"][MODEL],
            }
            pytest.fail(f"not within {timeout_s}s: {what}\n{json.dumps(state, indent=1)[-6000:]}")
        time.sleep(0.1)


def _counted(proc: Proc) -> dict[str, float]:
    """``tidegate_requests_total`` of the model by outcome, summed over priorities."""
    outcomes: dict[str, float] = {}
    for labels, value in _metrics(proc)["tidegate_requests_total"]:
        if labels["model"] == MODEL:
            outcomes[labels["outcome"]] = outcomes.get(labels["outcome"], 0.0) + value
    return outcomes


def _served_more(proc: Proc, load: ClosedLoop, when: str) -> None:
    served = load.served()
    _wait(proc, f"100 more answers {when}", lambda: load.served() >= served + 100, 60)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[Proc, Any]]:
    with loopback_cluster(NODE) as cluster:
        config = _config(tmp_path, cluster.address)
        with gateway_process("--config", str(config)) as proc:
            yield proc, cluster


# ----------------------------------------------------------------------------- the story
def test_serve_on_ray_scales_over_nodes_survives_a_node_loss_and_counts_every_request(
    gateway: tuple[Proc, Any],
) -> None:
    proc, cluster = gateway
    assert len(_ready(proc)) == 1
    without_retry_after: list[str] = []  # 429 and 503 answers without it fail the test
    send = openai_embeddings(proc.url, MODEL, without_retry_after)
    load = ClosedLoop([("", send)] * CLIENTS, max_requests=MAX_REQUESTS)
    with load:
        _wait(proc, f"{MAX_REPLICAS} ready", lambda: len(_ready(proc)) == MAX_REPLICAS, 120)
        spread = _ready(proc)
        assert len(set(spread.values())) > 1, spread  # SPREAD: more than one node
        _served_more(proc, load, "on 4 replicas")

        # A node other than the head (which the gateway's driver is attached to) that
        # holds replicas: lost with them, under load. (After the answers above, the
        # gateway's connections to them are kept-alive ones: a request in flight on one
        # is retried elsewhere. One opened for it is not, see docs/ray.md.)
        doomed = next(n for n in cluster.worker_nodes if n.node_id in spread.values())
        lost = sorted(rid for rid, node in spread.items() if node == doomed.node_id)
        cluster.remove_node(doomed)

        def replaced() -> bool:
            ready = _ready(proc)
            return len(ready) == MAX_REPLICAS and doomed.node_id not in ready.values()

        _wait(proc, f"{lost} back on surviving nodes", replaced, 120)
        restarted = {r["id"]: r["restarts"] for r in _replicas(proc)}
        assert all(restarted[rid] >= 1 for rid in lost), restarted
        _served_more(proc, load, "after the loss")
    _wait(proc, "back to 1 replica", lambda: len(_replicas(proc)) == 1, 120)
    sent = load.statuses.total()
    counted = _counted(proc)
    # SIGTERM: the gateway's own shutdown (not Ray's exit at once), then its exit status 0.
    proc.process.send_signal(signal.SIGTERM)
    assert proc.process.wait(timeout=DEADLINE_S) == 0

    assert load.statuses[0] == 0, load.errors[:5]  # no request raised or hung
    assert set(load.statuses) <= {200, *OK_REFUSALS}, load.statuses
    assert without_retry_after == [], without_retry_after[:5]
    assert sum(counted.values()) == sent, (counted, load.statuses)  # each counted once
    assert counted.get("completed", 0) == load.statuses[200], (counted, load.statuses)
    assert counted.get("failed", 0) == 0, counted
    assert sent < MAX_REQUESTS  # the phases ended the load, not the budget
