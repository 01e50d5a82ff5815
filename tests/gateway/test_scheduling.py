"""Scheduling through the gateway under load, over real simulated workers.

What a policy decides is checked by the dispatcher's own record (the order in which it took
requests from the queue, and its clock then), never by how long a request took: a loaded
machine changes the times, not the decisions. Where a test needs requests to stay queued,
it holds the replica's slots itself, as requests that do not finish until it lets go would,
so that nothing leaves the queue before it looks, however slow the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.harness import flat_profile, gateway_client, sim_config, sim_worker
from tests.procs import DEADLINE_S
from tidegate.core.queue import effective_priority
from tidegate.core.request import Request
from tidegate.gateway.app import Gateway
from tidegate.gateway.dispatcher import ModelDispatcher
from tidegate.gateway.replicas import ReplicaState

BATCH_MS = 60.0
SLOTS = 4


async def _embed(
    client: httpx.AsyncClient, priority: str, request_id: str | None = None
) -> httpx.Response:
    headers = {"X-Priority": priority}
    if request_id is not None:
        headers["X-Request-Id"] = request_id  # the id the dispatcher's queue knows it by
    return await client.post("/v1/embeddings", json={"model": "sim", "input": "x"}, headers=headers)


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait for the gateway's state (in this process) to reach ``condition``.

    The deadline is one a loaded machine stays far below: reaching it means the state never
    came.
    """
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S}s: {what}"
        await asyncio.sleep(0.01)


@contextlib.contextmanager
def _slots_held(gateway: Gateway, count: int = 1) -> Iterator[ModelDispatcher]:
    """``count`` slots of the model's only replica, taken by the test until the block ends.

    As requests that run until then would: the dispatcher sends nothing to those slots, and
    each one given back dispatches what is most urgent, as a finished request's slot does.
    """
    dispatcher = gateway.dispatchers["sim"]
    (replica,) = dispatcher.replicas
    replica.in_flight += count
    try:
        yield dispatcher
    finally:
        for _ in range(count):
            dispatcher.release(replica, completed=False)


def _named(request: Request) -> str:
    """The X-Request-Id a client gave a request (the gateway's key is "<it>~<random>")."""
    return request.id.partition("~")[0]


def _trace_pops(dispatcher: ModelDispatcher) -> list[tuple[float, Request]]:
    """Every request the dispatcher takes from the queue from now on, in order, with the
    dispatcher's clock at that moment."""
    taken: list[tuple[float, Request]] = []
    pop = dispatcher.queue.pop

    def traced(n: int, now: float, *args: Any, **kwargs: Any) -> tuple[Request, ...]:
        requests = pop(n, now, *args, **kwargs)
        taken.extend((now, request) for request in requests)
        return requests

    dispatcher.queue.pop = traced  # type: ignore[method-assign]
    return taken


async def _dispatch_order_of_highs_sent_after_a_low_flood(
    client: httpx.AsyncClient, gateway: Gateway, num_low: int
) -> list[int]:
    """Positions, in the dispatch order, of SLOTS high requests sent while ``num_low`` low
    ones wait in the queue."""
    taken = _trace_pops(gateway.dispatchers["sim"])
    with _slots_held(gateway, SLOTS) as dispatcher:  # the engine is busy: the flood waits
        flood = [asyncio.create_task(_embed(client, "low", f"low-{i}")) for i in range(num_low)]
        await _until(lambda: len(dispatcher.queue) == num_low, "the low flood is queued")
        highs = [asyncio.create_task(_embed(client, "high", f"high-{i}")) for i in range(SLOTS)]
        await _until(lambda: len(dispatcher.queue) == num_low + SLOTS, "the highs are queued")
    results = await asyncio.gather(*flood, *highs)
    assert all(r.status_code == 200 for r in results), [r.status_code for r in results]
    order = [_named(request) for _, request in taken]
    assert sorted(order) == sorted(r.headers["X-Request-Id"] for r in results)  # each once
    return [i for i, request_id in enumerate(order) if request_id.startswith("high-")]


@pytest.mark.spies  # traces the gateway queue's pops by replacing the method
@pytest.mark.asyncio
async def test_high_priority_overtakes_a_low_flood_and_fifo_does_not(tmp_path: Path) -> None:
    profile = flat_profile(tmp_path / "flat.json", BATCH_MS)
    with sim_worker(profile, "--max-batch-size", str(SLOTS)) as worker:
        data = sim_config(worker.url)
        async with gateway_client(data, [worker.url], SLOTS) as (client, gateway):
            priority = await _dispatch_order_of_highs_sent_after_a_low_flood(client, gateway, 100)
        fifo_data = sim_config(worker.url, gateway={"policy": "fifo"})
        async with gateway_client(fifo_data, [worker.url], SLOTS) as (client, gateway):
            fifo = await _dispatch_order_of_highs_sent_after_a_low_flood(client, gateway, 100)
    # 100 low requests are 25 batches of work ahead. Priority: the high requests take the
    # first slots that free up, ahead of the whole flood. FIFO: they wait behind all of it.
    assert priority == [0, 1, 2, 3]
    assert fifo == [100, 101, 102, 103]


@pytest.mark.spies  # traces the gateway queue's pops by replacing the method
@pytest.mark.asyncio
async def test_aged_low_request_finishes_within_the_bound_under_constant_high_load(
    tmp_path: Path,
) -> None:
    profile = flat_profile(tmp_path / "flat.json", 40.0)
    with sim_worker(profile, "--max-batch-size", "1") as worker:
        data = sim_config(worker.url, priorities={"aging": {"threshold_s": 0.5, "rate_per_s": 4.0}})
        async with gateway_client(data, [worker.url], 1) as (client, gateway):
            dispatcher = gateway.dispatchers["sim"]
            aging = dispatcher.queue.config.aging
            taken = _trace_pops(dispatcher)
            stop = asyncio.Event()

            async def high_load() -> None:
                while not stop.is_set():
                    await asyncio.gather(*(_embed(client, "high") for _ in range(4)))

            loaders = [asyncio.create_task(high_load()) for _ in range(3)]
            # 12 high requests in flight, 1 slot: the queue is never empty of high work now.
            await _until(lambda: len(dispatcher.queue) >= 8, "high requests are queued")
            low = await _embed(client, "low", "aged-low")
            stop.set()
            await asyncio.gather(*loaders)
    assert low.status_code == 200
    assert float(low.headers["X-Tidegate-Queue-Ms"]) >= 500  # it did wait for aging
    index, (taken_at, aged) = next(
        (i, t) for i, t in enumerate(taken) if _named(t[1]) == "aged-low"
    )
    # The bound, as the dispatcher keeps it: once aged to the top level (threshold + level /
    # rate = 0.5 + 2 / 4 = 1 s after arrival) it goes next, behind only the high requests
    # that arrived before it.
    for now, other in taken[:index]:
        if other.arrival_at > aged.arrival_at:
            assert effective_priority(aged.priority, aged.arrival_at, now, aging) > 0, (
                f"{other.id}, which arrived after the aged low request, went first at "
                f"{now - aged.arrival_at:.3f}s after its arrival"
            )
    # And aging is what took it: high requests that arrived after it still waited then.
    overtaken = [r for _, r in taken[index + 1 :] if aged.arrival_at < r.arrival_at < taken_at]
    assert overtaken, "no high request waited when the low one was taken: aging untested"


@pytest.mark.asyncio
async def test_full_queue_sheds_low_for_high_and_refuses_with_retry_after(
    tmp_path: Path,
) -> None:
    profile = flat_profile(tmp_path / "flat.json", 300.0)
    with sim_worker(profile, "--max-batch-size", "1") as worker:
        data = sim_config(worker.url, model={"queue": {"max_size": 3, "holdback": {}}})
        async with gateway_client(data, [worker.url], 1) as (client, gateway):
            with _slots_held(gateway) as dispatcher:  # the only slot is busy
                lows = []
                for i in range(3):
                    lows.append(asyncio.create_task(_embed(client, "low", f"low-{i}")))
                    await _until(lambda n=i + 1: len(dispatcher.queue) == n, f"{i + 1} queued")
                refused = await _embed(client, "low")  # queue full, nothing less urgent
                high = asyncio.create_task(_embed(client, "high"))  # sheds the newest low
                await _until(lambda: lows[-1].done(), "the newest low request is shed")
                assert len(dispatcher.queue) == 3  # two low requests and the high one
            results = await asyncio.gather(*lows, high)
            metrics = (await client.get("/metrics")).text
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "rejected_full"
    statuses = [r.status_code for r in results]
    assert statuses == [200, 200, 429, 200]  # the newest low request was shed for the high
    shed = results[2]
    assert shed.json()["error"]["code"] == "shed"
    assert "Retry-After" in shed.headers
    assert 'outcome="shed"' in metrics
    assert 'outcome="rejected_full"' in metrics


@pytest.mark.asyncio
async def test_holdback_refuses_low_first_as_the_queue_fills(tmp_path: Path) -> None:
    profile = flat_profile(tmp_path / "flat.json", 500.0)
    with sim_worker(profile, "--max-batch-size", "1") as worker:
        data = sim_config(worker.url, model={"queue": {"max_size": 10, "holdback": {"low": 0.2}}})
        async with gateway_client(data, [worker.url], 1) as (client, gateway):
            with _slots_held(gateway) as dispatcher:  # the only slot is busy
                busy = [asyncio.create_task(_embed(client, "medium")) for _ in range(3)]
                await _until(lambda: len(dispatcher.queue) == 3, "3 queued: saturation 0.3")
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
            # Teach the drain rate: 6 completions, at 5/s at most (a loaded machine is slower,
            # which only makes the wait predicted below longer).
            for _ in range(6):
                assert (await _embed(client, "high")).status_code == 200
            with _slots_held(gateway) as dispatcher:  # no slot frees until the block ends
                blockers = [asyncio.create_task(_embed(client, "high")) for _ in range(5)]
                await _until(lambda: len(dispatcher.queue) == 5, "the blockers are queued")
                # 1 s of work ahead, deadline 0.5 s: refused at once, before any slot freed
                # (had it been admitted, it could only have waited for its timeout: a 504).
                refused = await _embed(client, "low")
                assert len(dispatcher.queue) == 5  # it never entered the queue
            await asyncio.gather(*blockers)
            # Without an estimate of the drain rate the request waits and times out.
            dispatcher.queue.drain = type(dispatcher.queue.drain)(30.0, 10_000)
            with _slots_held(gateway):
                blockers = [asyncio.create_task(_embed(client, "high")) for _ in range(5)]
                await _until(lambda: len(dispatcher.queue) == 5, "the blockers are queued")
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
            with _slots_held(gw) as dispatcher:  # the only slot is busy
                waiting = asyncio.create_task(_embed(client, "low"))
                await _until(lambda: len(dispatcher.queue) == 1, "the request is queued")
                waiting.cancel()  # the client goes away while queued
                await asyncio.gather(waiting, return_exceptions=True)
                await _until(lambda: len(dispatcher.queue) == 0, "it left the queue")
                assert dispatcher.num_in_flight() == 1  # the busy slot was not freed for it
            assert dispatcher.num_in_flight() == 0
            assert (await _embed(client, "high")).status_code == 200  # the slot serves again
            assert dispatcher.num_in_flight() == 0
            metrics = (await client.get("/metrics")).text
    assert 'tidegate_requests_total{model="sim",outcome="cancelled",priority="low"} 1.0' in metrics
