"""A request whose replica could not be reached is retried on another one, not the same."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests.gateway.harness import flat_profile, gateway_client, sim_config, sim_worker
from tests.gateway.test_proxy_client import replica
from tidegate.core.queue import QueueConfig
from tidegate.core.request import Request
from tidegate.core.routing import PoolSpec
from tidegate.gateway.dispatcher import ModelDispatcher
from tidegate.gateway.replicas import Replica, ReplicaState
from tidegate.metrics import GatewayMetrics

POOLS = {"shared": PoolSpec("shared", frozenset({0, 1, 2}))}


def _replica(rid: str, slots: int = 4) -> Replica:
    return Replica(rid, "m", "shared", "upstream", "http://unused", ReplicaState.READY, slots)


def _dispatcher(replicas: list[Replica]) -> ModelDispatcher:
    return ModelDispatcher("m", QueueConfig(), POOLS, replicas, GatewayMetrics(CollectorRegistry()))


@pytest.mark.asyncio
async def test_retry_goes_to_another_replica_even_when_the_failed_one_is_least_loaded() -> None:
    dead, healthy = _replica("dead"), _replica("healthy")
    dispatcher = _dispatcher([dead, healthy])
    healthy.in_flight = 2  # least loaded is the dead one: the old rule sent the retry back there
    for attempt in range(20):
        ticket = dispatcher.submit(Request(f"r{attempt}", "m", 1, 0.0))
        first = ticket.assigned.result()
        if first is not dead:
            dispatcher.release(first, completed=True)
            continue
        again = dispatcher.retry(ticket, dead)
        assert again.assigned.result() is healthy
        dispatcher.release(healthy, completed=True)


@pytest.mark.asyncio
async def test_retry_takes_the_failed_replica_when_it_is_the_only_one() -> None:
    only = _replica("only")
    dispatcher = _dispatcher([only])
    ticket = dispatcher.submit(Request("r", "m", 1, 0.0))
    assert ticket.assigned.result() is only
    assert dispatcher.retry(ticket, only).assigned.result() is only


@pytest.mark.asyncio
async def test_a_replica_gone_before_the_send_is_retried_elsewhere_and_not_held_against_it(
    tmp_path: Path,
) -> None:
    # A worker that died between its slot being given and the request being sent: its
    # orchestrator has cleared the URL. The old path sent to "None/v1/embeddings", and
    # counted the failure toward ejecting a replica that was only restarting.
    profile = flat_profile(tmp_path / "flat.json", 1.0)
    with sim_worker(profile) as worker:
        data = sim_config(worker.url)
        async with gateway_client(data, [worker.url, worker.url], 1) as (client, gateway):
            gone, alive = gateway.replicas["sim"]
            gone.url = None  # READY a moment longer: as seen by a handler that just woke
            alive.in_flight = 0
            for _ in range(4):
                response = await client.post("/v1/embeddings", json={"model": "sim", "input": "x"})
                assert response.status_code == 200, response.text
            assert gone.outlier.consecutive_failures == 0
            assert gone.in_flight == 0


@pytest.mark.asyncio
async def test_a_second_retry_avoids_every_replica_that_failed_the_request() -> None:
    """A lost node takes two replicas at once: the first retry may land on the other one of
    them; the second then goes to the healthy replica, not back to either."""
    dead_a, dead_b, healthy = _replica("dead-a"), _replica("dead-b"), _replica("healthy")
    dispatcher = _dispatcher([dead_a, dead_b, healthy])
    healthy.in_flight = 3  # the dead ones are the least loaded
    ticket = dispatcher.submit(Request("r", "m", 1, 0.0))
    first = ticket.assigned.result()
    assert first in (dead_a, dead_b)
    again = dispatcher.retry(ticket, first)
    second = again.assigned.result()
    assert second in (dead_a, dead_b)
    assert second is not first
    third = dispatcher.retry(again, second).assigned.result()
    assert third is healthy


@pytest.mark.asyncio
async def test_an_answer_cut_off_mid_body_is_answered_by_another_replica(tmp_path: Path) -> None:
    """A replica whose node went while it wrote an embeddings answer (the head out, the
    body cut): the client gets the other replica's answer, not a 502 (the node-loss e2e on
    Ray under load once saw one such 502), and the cut counts against the first replica."""

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"object": "li')
        await writer.drain()
        writer.close()

    profile = flat_profile(tmp_path / "flat.json", 1.0)
    async with replica(cut) as dying:
        with sim_worker(profile) as worker:
            data = sim_config(worker.url)
            async with gateway_client(data, [dying.url, worker.url], 1) as (client, gateway):
                cutting, alive = gateway.replicas["sim"]
                response = await client.post("/v1/embeddings", json={"model": "sim", "input": "x"})
                assert response.status_code == 200, response.text
                assert len(dying.requests) == 1  # r0 (least loaded, first id) took it first
                assert cutting.outlier.consecutive_failures == 1
                assert cutting.in_flight == alive.in_flight == 0
