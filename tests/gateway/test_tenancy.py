"""Tenants through the real HTTP path: the key's name, or a header only when the operator
trusts one; a bad header value is a 400; the answer's usage settles the tenant's counter;
the dispatcher bounds each tenant's share of the slots."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tests.gateway.harness import flat_profile, gateway_client, sim_config, sim_worker
from tidegate.core.fairness import FairnessConfig
from tidegate.core.queue import QueueConfig
from tidegate.core.request import Request
from tidegate.core.routing import PoolSpec
from tidegate.gateway.dispatcher import ModelDispatcher, Ticket, _usage
from tidegate.gateway.replicas import Replica, ReplicaState
from tidegate.gateway.state import Gateway
from tidegate.metrics import GatewayMetrics

LIGHT, HEAVY = "sk-light", "sk-heavy"
KEYS = [
    {"name": name, "sha256": hashlib.sha256(secret.encode()).hexdigest()}
    for name, secret in (("light", LIGHT), ("heavy", HEAVY))
]


@contextlib.asynccontextmanager
async def _served(
    tmp_path: Path, tenancy: dict[str, Any], keys: bool = True
) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    profile = flat_profile(tmp_path / "flat.json", 1.0)
    with sim_worker(profile) as worker:
        sections: dict[str, Any] = {"tenancy": tenancy}
        if keys:
            sections["keys"] = KEYS
        data = sim_config(worker.url, **sections)
        async with gateway_client(data, [worker.url], 4) as served:
            yield served


async def _embed(
    client: httpx.AsyncClient, secret: str | None, headers: dict[str, str | bytes] | None = None
) -> httpx.Response:
    # bytes: httpx sends a str header value as ASCII only
    sent = {
        name.encode(): v if isinstance(v, bytes) else v.encode()
        for name, v in (headers or {}).items()
    }
    if secret is not None:
        sent[b"Authorization"] = f"Bearer {secret}".encode()
    return await client.post(
        "/v1/embeddings", json={"model": "sim", "input": "hello there"}, headers=sent
    )


@pytest.mark.asyncio
async def test_the_key_names_the_tenant_and_usage_settles_its_counter(tmp_path: Path) -> None:
    async with _served(tmp_path, {"fair_sharing": True, "lag_tokens": 0}) as (client, gateway):
        queue = gateway.dispatchers["sim"].queue
        first = await _embed(client, LIGHT, {"X-Tenant": "spoofed"})  # the header: not trusted
        assert first.status_code == 200, first.text
        # The pick charged the estimate; the answer's usage replaced it: input tokens x 1.
        assert queue.tenants()["light"]["counter"] == first.json()["usage"]["prompt_tokens"]
        for _ in range(2):
            assert (await _embed(client, HEAVY, {"X-Tenant": "spoofed"})).status_code == 200
        tenants = queue.tenants()
    assert set(tenants) == {"light", "heavy"}
    assert tenants["heavy"]["counter"] > tenants["light"]["counter"]


@pytest.mark.asyncio
async def test_a_trusted_header_names_the_tenant(tmp_path: Path) -> None:
    tenancy = {"header": "X-Tenant", "fair_sharing": True}
    async with _served(tmp_path, tenancy, keys=False) as (client, gateway):
        assert (await _embed(client, None, {"X-Tenant": "team-a"})).status_code == 200
        assert (await _embed(client, None)).status_code == 200  # none: the anonymous tenant
        for bad in ("x" * 65, "a b", "é".encode()):
            response = await _embed(client, None, {"X-Tenant": bad})
            assert response.status_code == 400, bad
            error = response.json()["error"]
            assert error["code"] == "invalid_tenant"
            assert error["param"] == "x-tenant"
        view = (await client.get("/admin/replicas")).json()["sim"]["tenants"]
    assert view["fair_sharing"] is True
    assert set(view["tenants"]) == {"team-a", ""}
    assert all(tenant["queued"] == 0 for tenant in view["tenants"].values())
    assert gateway.dispatchers["sim"].queue.outcome_counts()  # the 400s never queued
    assert sum(gateway.dispatchers["sim"].queue.outcome_counts().values()) == 4  # 2 x (Q, D)


@pytest.mark.asyncio
async def test_without_fair_sharing_the_queue_keeps_no_counters(tmp_path: Path) -> None:
    async with _served(tmp_path, {}) as (client, gateway):
        assert (await _embed(client, LIGHT)).status_code == 200
        assert gateway.dispatchers["sim"].queue.tenants() == {}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"data": [], "usage": {"prompt_tokens": 7, "total_tokens": 7}}', (7, 0)),
        (b'{"usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}', (3, 5)),
        (b'{"choices": [{"text": "\\"usage\\""}], "usage" : {"prompt_tokens": 1}}', (1, 0)),
        (b'{"data": []}', None),
        (b'{"usage": null}', None),
        (b'{"usage": {"prompt_tokens": true}}', None),
        (b'{"usage": {"prompt_tokens": -1}}', None),
        (b'{"usage": {"prompt_tokens": 1', None),
    ],
)
def test_answer_usage_parsed(body: bytes, expected: tuple[int, int] | None) -> None:
    assert _usage(body) == expected


@pytest.mark.parametrize(("named", "taker"), [(True, "heavy"), (False, "light")])
@pytest.mark.asyncio
async def test_a_freed_slot_goes_by_slot_share_then_counter(named: bool, taker: str) -> None:
    """4 slots, shares of 2: light holds 1, heavy 3 and has the lower counter. Named, heavy0
    ends: heavy at its share (2) still competes by its counter and takes the slot. Unnamed,
    the release frees the oldest dispatched to the replica, light's: heavy is over its share
    while light, under, waits, so light's request takes it."""
    metrics = GatewayMetrics(CollectorRegistry())
    replica = Replica("r0", "sim", "shared", "upstream", "http://unused", ReplicaState.READY, 4)
    queue = QueueConfig(fairness=FairnessConfig(lag_tokens=0.0))
    pools = {"shared": PoolSpec("shared", frozenset({0, 1, 2}))}
    dispatcher = ModelDispatcher("sim", queue, pools, [replica], metrics)

    def submit(rid: str, tenant: str) -> Ticket:
        return dispatcher.submit(Request(rid, "sim", 0, time.monotonic(), tenant=tenant))

    light_old = submit("light-old", "light")
    heavy = [submit(f"heavy{i}", "heavy") for i in range(6)]
    assert [t.assigned.done() for t in heavy] == [True] * 3 + [False] * 3
    # light was served 500 tokens: its counter is far above heavy's
    dispatcher.settle(light_old.request, b'{"usage": {"prompt_tokens": 500}}')
    light = submit("light0", "light")
    assert dispatcher.describe_tenants()["slots"] == 4
    dispatcher.release(replica, request=heavy[0].request if named else None)
    assert (light.assigned.done(), heavy[3].assigned.done()) == (
        taker == "light",
        taker == "heavy",
    )
    tenants = dispatcher.queue.tenants()
    assert (tenants["light"]["in_flight"], tenants["heavy"]["in_flight"]) == (1, 3)


@pytest.mark.asyncio
async def test_the_slot_reserve_waits_for_a_newcomer() -> None:
    """4 slots, a quarter reserved: heavy alone gets 3; light, arriving, the fourth at once.
    Light's ends: the free slot is the reserve's, so heavy's next waits; one of heavy's
    ends: two free, one outside the reserve, and heavy's next takes it."""
    metrics = GatewayMetrics(CollectorRegistry())
    replica = Replica("r0", "sim", "shared", "upstream", "http://unused", ReplicaState.READY, 4)
    queue = QueueConfig(fairness=FairnessConfig(lag_tokens=0.0, reserve_fraction=0.25))
    pools = {"shared": PoolSpec("shared", frozenset({0, 1, 2}))}
    dispatcher = ModelDispatcher("sim", queue, pools, [replica], metrics)

    def submit(rid: str, tenant: str) -> Ticket:
        return dispatcher.submit(Request(rid, "sim", 0, time.monotonic(), tenant=tenant))

    heavy = [submit(f"heavy{i}", "heavy") for i in range(5)]
    assert [t.assigned.done() for t in heavy] == [True] * 3 + [False] * 2
    described = dispatcher.describe_tenants()
    assert (described["slots"], described["reserve_slots"]) == (4, 1)
    light = submit("light0", "light")
    assert light.assigned.done()
    dispatcher.release(replica, request=light.request)
    assert not heavy[3].assigned.done()
    dispatcher.release(replica, request=heavy[0].request)
    assert [t.assigned.done() for t in heavy[3:]] == [True, False]


@pytest.mark.asyncio
async def test_preemption_sends_past_the_slots_to_the_victims_replica() -> None:
    """Two replicas of 2 slots: heavy holds 2 on r0 and 1 on r1, other the fourth (r1).
    Light comes, no slot free: under its slot share (4 / 3 tenants), heavy over its own,
    so light's request goes past the slots to r0 (most of heavy's), naming heavy; light's
    second too (1 held, still under); the third waits (2, over). The paused ones still
    hold their slots: when one of them ends, nothing new is sent (5 held of 4 slots)."""
    metrics = GatewayMetrics(CollectorRegistry())
    replicas = [
        Replica(f"r{i}", "sim", "shared", "upstream", "http://unused", ReplicaState.READY, 2)
        for i in range(2)
    ]
    config = FairnessConfig(lag_tokens=0.0, reserve_fraction=0.0, preemption=True)
    pools = {"shared": PoolSpec("shared", frozenset({0, 1, 2}))}
    dispatcher = ModelDispatcher("sim", QueueConfig(fairness=config), pools, replicas, metrics)

    def submit(rid: str, tenant: str) -> Ticket:
        return dispatcher.submit(Request(rid, "sim", 0, time.monotonic(), tenant=tenant))

    heavy = [submit(f"heavy{i}", "heavy") for i in range(3)]
    other = submit("other0", "other")
    placed = [t.assigned.result().id for t in [*heavy, other]]
    assert placed == ["r0", "r1", "r0", "r1"]
    heavy.append(submit("heavy3", "heavy"))
    light = [submit(f"light{i}", "light") for i in range(3)]
    assert [t.assigned.done() for t in light] == [True, True, False]
    assert [(t.assigned.result().id, t.preempt) for t in light[:2]] == [("r0", "heavy")] * 2
    assert [r.in_flight for r in replicas] == [4, 2]
    assert dispatcher.describe_tenants()["preemptions"] == 2
    tenants = dispatcher.queue.tenants()
    assert (tenants["light"]["in_flight"], tenants["heavy"]["in_flight"]) == (2, 3)
    dispatcher.release(replicas[0], request=heavy[0].request)
    assert not heavy[3].assigned.done()  # 5 held of 4 slots: none free
    assert not light[2].assigned.done()
