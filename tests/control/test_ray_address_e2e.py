"""``tidegate serve`` joining an existing Ray cluster, as docs/ray.md says to point it at one.

The cluster is started the way a platform team starts one, with the ``ray`` CLI
(``rayhead.cli_head``: ``ray start --head`` on loopback, one node declaring a GPU of
``NODE_MEMORY_MB``, ``pool:shared`` and CPUs), once for the module. Then, for each way of
pointing at it, a real ``tidegate serve`` whose configuration says
``controller: {orchestrator: ray, ray_address: ...}``:

- ``auto``: the gateway runs on a node of the cluster (here: the same host, with the
  ``RAY_TMPDIR`` the head was started with, and no ``RAY_ADDRESS``) and finds it through
  the address file ``ray start`` wrote;
- ``ray://127.0.0.1:PORT``: Ray Client, through the head's client server.

Each time: the configured two replicas are Ray actors on the cluster (read from the
cluster's GCS, not from the gateway), on the node the gateway reports; real ``openai``
clients get an answer to every request through the gateway, each counted once; SIGTERM
stops the gateway (exit 0) and leaves no actor of it alive on the cluster.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.control.rayhead import Head, cli_head
from tests.gateway.harness import flat_profile
from tests.loadthreads import ClosedLoop, openai_embeddings
from tests.procs import DEADLINE_S, Proc, gateway_process

pytestmark = pytest.mark.e2e

MODEL = "sim"
NODE_MEMORY_MB = 1000.0
REPLICAS = 2
CLIENTS = 4
REQUESTS = 40
ACTOR_CLASS = "WorkerActor"  # tidegate.control.ray_actor


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    # Two replicas reserve a CPU each (cpus_per_replica); the gateway's own driver none.
    with cli_head(
        num_cpus=REPLICAS + 1,
        num_gpus=1,
        resources={"gpu_mem_mb": NODE_MEMORY_MB, "pool:shared": 1},
    ) as started:
        yield started


@pytest.fixture
def head_env(head: Head, monkeypatch: pytest.MonkeyPatch) -> Head:
    """The gateway (a child process) inherits the environment of a process on the head's host."""
    for name, value in head.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # ``auto`` must find the cluster itself
    return head


def _config(tmp_path: Path, address: str) -> Path:
    config = {
        "controller": {"orchestrator": "ray", "ray_address": address},
        "pools": {"shared": {"devices": ["cpu"]}},
        "models": [
            {
                "name": MODEL,
                "task": "embeddings",
                "engine": "simulated",
                "profile": str(flat_profile(tmp_path / "profile.json", latency_ms=20)),
                "memory_mb": 200,  # a fifth of the node's GPU: both fit
                "replicas": REPLICAS,
                "slots": 4,
                "batching": {"max_batch_size": 4, "batch_window_ms": 0},
                "drain_timeout_s": 10,
                # As examples/ray.yaml: the controller owns the count (and, without it, the
                # gateway does not report the replicas' nodes: see docs/ray.md).
                "autoscaling": {
                    "min_replicas": REPLICAS,
                    "max_replicas": REPLICAS,
                    "target_per_replica": 4,
                },
            }
        ],
    }
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _get(proc: Proc, path: str) -> Any:
    response = httpx.get(f"{proc.url}{path}", timeout=DEADLINE_S)
    response.raise_for_status()
    return response.json() if path.startswith("/admin") else response.text


def _metrics(proc: Proc, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(_get(proc, "/metrics"))
        for sample in family.samples
        if sample.name == name and sample.labels.get("model") == MODEL
    ]


def _replicas(proc: Proc) -> list[dict[str, Any]]:
    return list(_get(proc, "/admin/replicas")[MODEL]["replicas"])


def _until(
    what: str, condition: Callable[[], bool], timeout_s: float, state: Callable[[], Any]
) -> None:
    """Until ``condition`` holds; else fail, saying what was seen."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s}s: {what}\n{state()}")
        time.sleep(0.1)


@pytest.mark.parametrize("how", ["auto", "ray-client"])
def test_serve_joins_an_existing_cluster_serves_and_leaves_no_actor(
    head_env: Head, how: str, tmp_path: Path
) -> None:
    head = head_env
    address = "auto" if how == "auto" else head.client_address

    def alive() -> list[dict[str, Any]]:
        return [a for a in head.actors(ACTOR_CLASS) if a["State"] != "DEAD"]

    assert alive() == []  # nothing left by an earlier case

    with gateway_process("--config", str(_config(tmp_path, address))) as proc:
        _until(
            f"{REPLICAS} replicas ready",
            lambda: [r["state"] for r in _replicas(proc)] == ["ready"] * REPLICAS,
            120,
            lambda: _replicas(proc),
        )
        # The replicas are actors of the cluster, where the gateway says they are.
        actors = alive()
        assert [a["State"] for a in actors] == ["ALIVE"] * REPLICAS, actors
        assert len({a["JobID"] for a in actors}) == 1, actors  # the gateway's job
        devices = {labels["device"] for labels, _ in _metrics(proc, "tidegate_replica_info")}
        assert devices == {f"ray:{a['Address']['NodeID']}" for a in actors}, (devices, actors)
        for replica in _replicas(proc):  # their workers answer where the gateway sends
            assert replica["url"].startswith("http://127.0.0.1:"), replica
            assert httpx.get(f"{replica['url']}/readyz", timeout=DEADLINE_S).status_code == 200

        with ClosedLoop(
            [("", openai_embeddings(proc.url, MODEL))] * CLIENTS, max_requests=REQUESTS
        ) as load:
            _until(
                "every request answered",
                lambda: load.served() == REQUESTS,
                60,
                lambda: load.statuses,
            )
        assert load.statuses == {200: REQUESTS}, (load.statuses, load.errors[:5])
        counted: dict[str, float] = {}  # by outcome, over priorities
        for labels, value in _metrics(proc, "tidegate_requests_total"):
            counted[labels["outcome"]] = counted.get(labels["outcome"], 0.0) + value
        assert sum(counted.values()) == REQUESTS, counted  # each request counted once
        assert counted.get("completed") == REQUESTS, counted

        proc.process.send_signal(signal.SIGTERM)
        assert proc.process.wait(timeout=DEADLINE_S) == 0
    # Stopped replicas' actors were killed (ray.kill is asynchronous: the GCS marks them DEAD).
    _until("no actor of the gateway alive", lambda: alive() == [], 30, alive)
