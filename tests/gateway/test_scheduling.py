"""Scheduling through the gateway under load, over real simulated workers."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import flat_profile, gateway_client, sim_config, sim_worker
from tidegate.gateway.replicas import ReplicaState

BATCH_MS = 60.0
SLOTS = 4


async def _embed(client: httpx.AsyncClient, priority: str) -> httpx.Response:
    return await client.post(
        "/v1/embeddings", json={"model": "sim", "input": "x"}, headers={"X-Priority": priority}
    )


async def _high_latency_under_low_flood(client: httpx.AsyncClient, num_low: int) -> float:
    """Median latency of high requests sent while ``num_low`` low ones are queued."""
    flood = [asyncio.create_task(_embed(client, "low")) for _ in range(num_low)]
    await asyncio.sleep(0.3)  # the low flood is queued
    latencies = await asyncio.gather(*(_timed(client) for _ in range(SLOTS)))
    results = await asyncio.gather(*flood)
    assert all(r.status_code == 200 for r in results)
    return statistics.median(latencies)


@pytest.mark.asyncio
async def test_high_priority_keeps_its_latency_under_low_flood_and_fifo_does_not(
    tmp_path: Path,
) -> None:
    profile = flat_profile(tmp_path / "flat.json", BATCH_MS)
    with sim_worker(profile, "--max-batch-size", str(SLOTS)) as worker:
        data = sim_config(worker.url)
        async with gateway_client(data, [worker.url], SLOTS) as (client, _):
            unloaded = statistics.median([await _timed(client) for _ in range(5)])
            priority = await _high_latency_under_low_flood(client, 100)
        fifo_data = sim_config(worker.url, gateway={"policy": "fifo"})
        async with gateway_client(fifo_data, [worker.url], SLOTS) as (client, _):
            fifo = await _high_latency_under_low_flood(client, 100)
    # 100 low requests are 25 batches (1.5 s) of work ahead. Priority: a high request waits
    # about one batch (the one on the engine) before its own. FIFO: it waits behind the
    # whole flood. Margins are wide: this machine is shared and noisy.
    assert priority < 5 * unloaded, (priority, unloaded)
    assert fifo > 8 * unloaded, (fifo, unloaded)
    assert fifo > 3 * priority, (fifo, priority)


async def _timed(client: httpx.AsyncClient) -> float:
    started = time.perf_counter()
    response = await _embed(client, "high")
    assert response.status_code == 200
    return time.perf_counter() - started


@pytest.mark.asyncio
async def test_aged_low_request_finishes_within_the_bound_under_constant_high_load(
    tmp_path: Path,
) -> None:
    profile = flat_profile(tmp_path / "flat.json", 40.0)
    with sim_worker(profile, "--max-batch-size", "1") as worker:
        data = sim_config(worker.url, priorities={"aging": {"threshold_s": 0.5, "rate_per_s": 4.0}})
        async with gateway_client(data, [worker.url], 1) as (client, _):
            stop = asyncio.Event()

            async def high_load() -> None:
                while not stop.is_set():
                    await asyncio.gather(*(_embed(client, "high") for _ in range(4)))

            loaders = [asyncio.create_task(high_load()) for _ in range(3)]
            await asyncio.sleep(0.3)  # the queue is never empty of high work now
            started = time.perf_counter()
            low = await _embed(client, "low")
            waited = time.perf_counter() - started
            stop.set()
            await asyncio.gather(*loaders)
    assert low.status_code == 200
    # Bound: threshold + level / rate = 0.5 + 2 / 4 = 1 s, plus the work ahead of it at
    # the top level when it got there (at most the 12 high requests in flight, 40 ms each).
    assert waited < 1.0 + 12 * 0.040 + 0.5, waited
    assert float(low.headers["X-Tidegate-Queue-Ms"]) >= 500  # it did wait for aging


@pytest.mark.asyncio
async def test_full_queue_sheds_low_for_high_and_refuses_with_retry_after(
    tmp_path: Path,
) -> None:
    profile = flat_profile(tmp_path / "flat.json", 300.0)
    with sim_worker(profile, "--max-batch-size", "1") as worker:
        data = sim_config(worker.url, model={"queue": {"max_size": 3, "holdback": {}}})
        async with gateway_client(data, [worker.url], 1) as (client, _):
            running = asyncio.create_task(_embed(client, "low"))  # takes the only slot
            await asyncio.sleep(0.1)
            lows = [asyncio.create_task(_embed(client, "low")) for _ in range(3)]
            await asyncio.sleep(0.1)
            refused = await _embed(client, "low")  # queue full, nothing less urgent
            high = asyncio.create_task(_embed(client, "high"))  # sheds the newest low
            results = await asyncio.gather(running, *lows, high)
            metrics = (await client.get("/metrics")).text
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "rejected_full"
    statuses = [r.status_code for r in results]
    assert statuses[-1] == 200  # the high request
    assert statuses[1:4].count(429) == 1
    shed = next(r for r in results if r.status_code == 429)
    assert shed.json()["error"]["code"] == "shed"
    assert "Retry-After" in shed.headers
    assert 'outcome="shed"' in metrics
    assert 'outcome="rejected_full"' in metrics


@pytest.mark.asyncio
async def test_holdback_refuses_low_first_as_the_queue_fills(tmp_path: Path) -> None:
    profile = flat_profile(tmp_path / "flat.json", 500.0)
    with sim_worker(profile, "--max-batch-size", "1") as worker:
        data = sim_config(worker.url, model={"queue": {"max_size": 10, "holdback": {"low": 0.2}}})
        async with gateway_client(data, [worker.url], 1) as (client, _):
            busy = [asyncio.create_task(_embed(client, "medium")) for _ in range(4)]
            await asyncio.sleep(0.1)  # 1 running, 3 queued: saturation 0.3
            low = await _embed(client, "low")
            for task in busy:
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
    assert low.status_code == 429
    assert low.json()["error"]["code"] == "rejected_holdback"
    assert int(low.headers["Retry-After"]) >= 1


@pytest.mark.asyncio
async def test_infeasible_deadline_is_refused_at_once_and_timeouts_give_504(
    tmp_path: Path,
) -> None:
    profile = flat_profile(tmp_path / "flat.json", 200.0)
    with sim_worker(profile, "--max-batch-size", "1") as worker:
        data = sim_config(worker.url, model={"queue": {"timeout_s": {"low": 0.5}, "holdback": {}}})
        async with gateway_client(data, [worker.url], 1) as (client, gateway):
            # Teach the drain rate: 6 completions at 5/s.
            for _ in range(6):
                assert (await _embed(client, "high")).status_code == 200
            blockers = [asyncio.create_task(_embed(client, "high")) for _ in range(5)]
            await asyncio.sleep(0.05)
            started = time.perf_counter()
            refused = await _embed(client, "low")  # ~1 s of work ahead, deadline 0.5 s
            assert time.perf_counter() - started < 0.1  # refused at once, not after waiting
            await asyncio.gather(*blockers)
            # Without an estimate of the drain rate the request waits and times out.
            gateway.dispatchers["sim"].queue.drain = type(gateway.dispatchers["sim"].queue.drain)(
                30.0, 10_000
            )
            blockers = [asyncio.create_task(_embed(client, "high")) for _ in range(5)]
            await asyncio.sleep(0.05)
            timed_out = await _embed(client, "low")
            await asyncio.gather(*blockers)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rejected_deadline"
    assert int(refused.headers["Retry-After"]) >= 1
    assert timed_out.status_code == 504
    assert timed_out.json()["error"]["code"] == "queue_timeout"


@pytest.mark.asyncio
async def test_no_ready_replica_is_503_with_retry_after(tmp_path: Path) -> None:
    profile = flat_profile(tmp_path / "flat.json", 10.0)
    with sim_worker(profile) as worker:
        async with gateway_client(sim_config(worker.url), [worker.url], 2) as (client, gw):
            (replica,) = gw.replicas["sim"]
            replica.set_state(ReplicaState.FAILED, "test: health check failed")
            refused = await _embed(client, "high")
            replica.set_state(ReplicaState.READY)
            served = await _embed(client, "high")
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "no_ready_replica"
    assert refused.headers["Retry-After"] == "2"
    assert served.status_code == 200


@pytest.mark.asyncio
async def test_client_gone_while_queued_leaves_the_queue_and_frees_nothing_twice(
    tmp_path: Path,
) -> None:
    profile = flat_profile(tmp_path / "flat.json", 300.0)
    with sim_worker(profile, "--max-batch-size", "1") as worker:
        async with gateway_client(sim_config(worker.url), [worker.url], 1) as (client, gw):
            dispatcher = gw.dispatchers["sim"]
            running = asyncio.create_task(_embed(client, "high"))
            await asyncio.sleep(0.05)
            waiting = asyncio.create_task(_embed(client, "low"))
            await asyncio.sleep(0.05)
            assert len(dispatcher.queue) == 1
            waiting.cancel()  # the client goes away while queued
            await asyncio.gather(waiting, return_exceptions=True)
            await asyncio.sleep(0.05)
            assert len(dispatcher.queue) == 0
            assert (await running).status_code == 200
            assert dispatcher.num_in_flight() == 0
            metrics = (await client.get("/metrics")).text
    assert 'tidegate_requests_total{model="sim",outcome="cancelled",priority="low"} 1.0' in metrics
