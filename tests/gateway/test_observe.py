"""Prometheus service discovery and ``tidegate_replica_info`` over the gateway's replica set.

The gateway app runs in this process over hand-made replicas in every state and kind (its
own state, no process behind them): which are scrape targets, with which labels, and who may
ask. The end-to-end tests (test_observe_serve, test_observe_prometheus) run the real thing.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from tidegate.config import parse_config
from tidegate.gateway.app import Gateway, create_gateway_app
from tidegate.gateway.observe import TARGETS_PATH
from tidegate.gateway.replicas import Replica, ReplicaState

ADMIN_KEY = "sk-test-ops"
USER_KEY = "sk-test-user"
READY, WARMING, STARTING = ReplicaState.READY, ReplicaState.WARMING, ReplicaState.STARTING
DRAINING, FAILED, STOPPED = ReplicaState.DRAINING, ReplicaState.FAILED, ReplicaState.STOPPED


class Placed:
    """An orchestrator as far as the gateway asks: where each of its replicas runs."""

    def __init__(self, devices: dict[str, str]) -> None:
        self.devices = devices

    def device_of(self, replica_id: str) -> str:
        return self.devices[replica_id]  # KeyError: not one of mine


def _config(keys: bool) -> dict[str, Any]:
    data: dict[str, Any] = {
        "pools": {
            "dedicated": {"priorities": ["high"], "devices": ["cpu"]},
            "shared": {"priorities": ["high", "medium", "low"], "devices": ["cpu"]},
        },
        "models": [
            {"name": "embed", "task": "embeddings", "engine": "simulated"},
            {"name": "chat", "task": "generate", "engine": "simulated"},
            {"name": "remote", "task": "embeddings", "engine": "openai", "upstreams": ["http://u"]},
        ],
    }
    if keys:
        data["keys"] = [
            {"name": "ops", "sha256": _sha(ADMIN_KEY), "role": "admin"},
            {"name": "user", "sha256": _sha(USER_KEY)},
        ]
    return data


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _replicas() -> dict[str, list[Replica]]:
    def local(rid: str, model: str, pool: str, url: str | None, state: ReplicaState) -> Replica:
        return Replica(rid, model, pool, "local", url, state)

    return {
        "embed": [
            local("embed-shared-1", "embed", "shared", "http://127.0.0.1:41002", READY),
            local("embed-shared-0", "embed", "shared", "http://127.0.0.1:41001", WARMING),
            local("embed-shared-2", "embed", "shared", None, STARTING),  # not bound yet
            local("embed-shared-3", "embed", "shared", None, FAILED),  # exited, restarting
            local("embed-shared-4", "embed", "shared", None, STOPPED),  # scaled in
        ],
        "chat": [
            local("chat-dedicated-0", "chat", "dedicated", "http://127.0.0.1:41010", DRAINING),
            Replica("chat-ray-0", "chat", "shared", "ray", "http://10.0.0.7:9000/w/0", READY),
        ],
        "remote": [Replica("remote-0", "remote", "shared", "upstream", "http://u", READY)],
    }


def _gateway(keys: bool = False) -> Gateway:
    gateway = Gateway(parse_config(_config(keys), "<test>"), replicas=_replicas())
    gateway.orchestrators = [
        Placed({"embed-shared-0": "cuda:1", "embed-shared-1": "cuda:0"}),
        Placed({"chat-dedicated-0": "cpu"}),
    ]
    return gateway


@pytest_asyncio.fixture
async def client() -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    gateway = _gateway()
    # No lifespan: neither route needs a dispatcher running.
    transport = httpx.ASGITransport(app=create_gateway_app(gateway))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as c:
        yield c, gateway


def _target(address: str, model: str, replica: str, pool: str, path: str = "") -> dict[str, Any]:
    labels = {"model": model, "replica": replica, "pool": pool}
    meta = {"__scheme__": "http", "__metrics_path__": f"{path}/metrics"}
    return {"targets": [address], "labels": labels | meta}


@pytest.mark.asyncio
async def test_targets_list_every_live_worker_and_no_upstream(
    client: tuple[httpx.AsyncClient, Gateway],
) -> None:
    c, _ = client
    answer = await c.get(TARGETS_PATH)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    assert answer.json() == [
        _target("127.0.0.1:41010", "chat", "chat-dedicated-0", "dedicated"),
        _target("10.0.0.7:9000", "chat", "chat-ray-0", "shared", "/w/0"),
        _target("127.0.0.1:41001", "embed", "embed-shared-0", "shared"),
        _target("127.0.0.1:41002", "embed", "embed-shared-1", "shared"),
    ]


@pytest.mark.asyncio
async def test_targets_follow_the_replica_set(client: tuple[httpx.AsyncClient, Gateway]) -> None:
    c, gateway = client
    embed = gateway.replicas["embed"]
    embed[0].url = None  # embed-shared-1 exited: its supervisor clears the address first
    embed[0].set_state(FAILED, "exit 137")
    embed[2].url = "http://127.0.0.1:41003"  # embed-shared-2 has bound
    gateway.remove_replica(gateway.replicas["chat"][0])  # chat-dedicated-0 scaled in
    listed = [(g["labels"]["replica"], g["targets"]) for g in (await c.get(TARGETS_PATH)).json()]
    assert listed == [
        ("chat-ray-0", ["10.0.0.7:9000"]),
        ("embed-shared-0", ["127.0.0.1:41001"]),
        ("embed-shared-2", ["127.0.0.1:41003"]),
    ]


@pytest.mark.asyncio
async def test_replica_info_is_one_per_known_replica_with_its_device_and_url(
    client: tuple[httpx.AsyncClient, Gateway],
) -> None:
    c, gateway = client
    text = (await c.get("/metrics")).text
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "tidegate_replica_info"
    ]
    assert family.type == "gauge"
    info = {s.labels["replica"]: (s.labels, s.value) for s in family.samples}
    assert set(info) == {r.id for rs in gateway.replicas.values() for r in rs}
    assert {v for _, v in info.values()} == {1.0}
    assert info["embed-shared-1"][0] == {
        "model": "embed",
        "replica": "embed-shared-1",
        "pool": "shared",
        "device": "cuda:0",
        "url": "http://127.0.0.1:41002",
    }
    assert info["chat-dedicated-0"][0]["device"] == "cpu"
    assert info["embed-shared-2"][0]["url"] == ""  # not bound yet
    assert info["remote-0"][0]["device"] == ""  # an upstream: nobody placed it
    gateway.remove_replica(gateway.replicas["embed"][4])
    after = [
        sample.labels["replica"]
        for family in text_string_to_metric_families((await c.get("/metrics")).text)
        if family.name == "tidegate_replica_info"
        for sample in family.samples
    ]
    assert "embed-shared-4" in info
    assert "embed-shared-4" not in after  # gone with the replica: no stale series
    assert len(after) == len(info) - 1


@pytest.mark.asyncio
async def test_the_gateway_exports_its_own_process_metrics(
    client: tuple[httpx.AsyncClient, Gateway],
) -> None:
    c, _ = client
    names = {
        sample.name
        for family in text_string_to_metric_families((await c.get("/metrics")).text)
        for sample in family.samples
    }
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= names


@pytest.mark.parametrize(
    ("key", "status"),
    [(None, 401), ("sk-test-wrong", 401), (USER_KEY, 403), (ADMIN_KEY, 200)],
)
@pytest.mark.asyncio
async def test_targets_need_an_admin_key_when_keys_are_set(key: str | None, status: int) -> None:
    transport = httpx.ASGITransport(app=create_gateway_app(_gateway(keys=True)))
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as c:
        answer = await c.get(TARGETS_PATH, headers=headers)
    assert answer.status_code == status, answer.text
    if status == 401:
        assert answer.headers["www-authenticate"].startswith("Bearer")
    if status == 200:
        assert len(answer.json()) == 4


@pytest.mark.asyncio
async def test_a_removed_replica_leaves_no_per_replica_series(
    client: tuple[httpx.AsyncClient, Gateway],
) -> None:
    """In-flight and ejection gauges per replica go with the replica, as replica_info does."""
    c, gateway = client

    def replicas_in(text: str, name: str) -> set[str]:
        return {
            sample.labels["replica"]
            for family in text_string_to_metric_families(text)
            if family.name == name
            for sample in family.samples
        }

    before = (await c.get("/metrics")).text
    gone = gateway.replicas["embed"][4]
    for name in ("tidegate_inflight", "tidegate_replica_ejected"):
        assert gone.id in replicas_in(before, name)
    gateway.remove_replica(gone)
    after = (await c.get("/metrics")).text
    for name in ("tidegate_inflight", "tidegate_replica_ejected"):
        assert replicas_in(after, name) == replicas_in(before, name) - {gone.id}
