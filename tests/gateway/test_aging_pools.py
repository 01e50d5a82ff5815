"""The dispatcher with a pool that serves only ``high``: a medium request runs there once
aged to high, woken by a timer at that moment (no other event would), and routed by its
aged level. Fakes only at the edges: replicas as values, a manual clock where time is the
question; waits are on the ticket's future, never on wall time."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from tidegate.core.queue import AgingConfig, QueueConfig
from tidegate.core.request import Request
from tidegate.core.routing import PoolSpec
from tidegate.errors import InvalidRequest
from tidegate.gateway.dispatcher import ModelDispatcher
from tidegate.gateway.replicas import Replica, ReplicaState
from tidegate.metrics import GatewayMetrics

POOLS = {
    "dedicated": PoolSpec("dedicated", frozenset({0})),
    "shared": PoolSpec("shared", frozenset({0, 1, 2})),
}
HIGH, MEDIUM, LOW = 0, 1, 2


class ManualClock:
    def __init__(self) -> None:
        self.at = 1000.0

    def now(self) -> float:
        return self.at


def _replica(rid: str, pool: str, slots: int = 1) -> Replica:
    return Replica(rid, "m", pool, "upstream", "http://unused", ReplicaState.READY, slots)


def _dispatcher(
    replicas: list[Replica], aging: AgingConfig, clock: ManualClock | None = None
) -> ModelDispatcher:
    metrics = GatewayMetrics(CollectorRegistry())
    queue = QueueConfig(aging=aging)
    if clock is None:
        return ModelDispatcher("m", queue, POOLS, replicas, metrics)
    return ModelDispatcher("m", queue, POOLS, replicas, metrics, clock=clock)


@pytest.mark.asyncio
async def test_medium_request_runs_on_a_high_only_pool_once_aged_woken_by_a_timer() -> None:
    # Aging: 0.05 s threshold, 20 levels/s: a medium request reaches high 0.1 s after arrival.
    dedicated = _replica("d0", "dedicated")
    dispatcher = _dispatcher([dedicated], AgingConfig(threshold_s=0.05, rate_per_s=20.0))
    owner = asyncio.create_task(dispatcher.run())
    try:
        arrival_at = time.monotonic()
        ticket = dispatcher.submit(Request("med", "m", MEDIUM, arrival_at))
        assert not ticket.assigned.done()  # not yet aged: the high-only pool may not take it
        # Nothing else happens from here on: only the dispatcher's aging timer can wake it.
        replica = await asyncio.wait_for(ticket.assigned, timeout=60.0)
    finally:
        owner.cancel()
        await asyncio.gather(owner, return_exceptions=True)
    assert replica is dedicated
    assert ticket.assigned_at is not None
    assert ticket.assigned_at - arrival_at >= 0.1  # it waited for aging, no longer than needed
    assert dedicated.in_flight == 1


@pytest.mark.asyncio
async def test_freed_high_only_slot_takes_the_aged_medium_request_and_not_before() -> None:
    clock = ManualClock()
    dedicated = _replica("d0", "dedicated")
    dispatcher = _dispatcher([dedicated], AgingConfig(threshold_s=30.0, rate_per_s=0.5), clock)
    busy = dispatcher.submit(Request("high", "m", HIGH, clock.now()))
    assert busy.assigned.result() is dedicated
    waiting = dispatcher.submit(Request("med", "m", MEDIUM, clock.now()))

    clock.at += 31.9  # medium is at 0.05 above high: not yet there
    dispatcher.release(dedicated)
    assert not waiting.assigned.done()
    assert dedicated.in_flight == 0

    dispatcher.submit(Request("high2", "m", HIGH, clock.now())).assigned.result()
    clock.at += 0.1  # 32 s: threshold 30 s + 1 level at 0.5/s
    dispatcher.release(dedicated)
    assert waiting.assigned.result() is dedicated


@pytest.mark.asyncio
async def test_aged_low_request_goes_to_the_free_dedicated_slot_when_shared_is_full() -> None:
    clock = ManualClock()
    dedicated = _replica("d0", "dedicated")
    shared = _replica("s0", "shared")
    dispatcher = _dispatcher(
        [dedicated, shared], AgingConfig(threshold_s=30.0, rate_per_s=0.5), clock
    )
    assert dispatcher.submit(Request("a", "m", LOW, clock.now())).assigned.result() is shared
    dispatcher.submit(Request("high", "m", HIGH, clock.now())).assigned.result()  # dedicated
    low = dispatcher.submit(Request("b", "m", LOW, clock.now()))
    clock.at += 34.0  # low reaches high
    dispatcher.release(dedicated)
    assert low.assigned.result() is dedicated
    assert shared.in_flight == 1


@pytest.mark.parametrize(
    ("aging", "refused"),
    [
        (AgingConfig(threshold_s=30.0, rate_per_s=0.0), True),  # medium can never reach high
        (AgingConfig(threshold_s=30.0, rate_per_s=0.5), False),  # aged, it runs on dedicated
    ],
)
@pytest.mark.asyncio
async def test_a_level_no_pool_can_ever_take_is_refused_at_once(
    aging: AgingConfig, refused: bool
) -> None:
    dedicated = _replica("d0", "dedicated")
    clock = ManualClock()
    dispatcher = _dispatcher([dedicated], aging, clock)
    dispatcher.refuse_unservable(frozenset({HIGH}))
    if not refused:  # admitted: it waits to age into high
        assert not dispatcher.submit(Request("med", "m", MEDIUM, clock.now())).assigned.done()
        return
    with pytest.raises(InvalidRequest) as error:
        dispatcher.submit(Request("med", "m", MEDIUM, clock.now()))
    assert error.value.code == "priority_not_served"
    assert "serves: high" in str(error.value)
    assert len(dispatcher.queue) == 0
