"""A sequence starts only when the engine's KV cache has room for it, in priority order.

The simulated engine stands in for the model; its card is given a small paged cache as a
transformers engine reports one (``max_cached_tokens``, ``cache_page_tokens``).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tidegate.core.queue import QueueConfig
from tidegate.engines.base import SamplingParams
from tidegate.engines.profile import default_profile
from tidegate.engines.simulated import SimulatedGenerator
from tidegate.metrics import WorkerMetrics
from tidegate.worker.scheduling import SequenceScheduler

HIGH, MEDIUM, LOW = 0, 1, 2


def scheduler_with_cache(capacity_tokens: int, page_tokens: int) -> SequenceScheduler:
    engine = SimulatedGenerator("sim", default_profile("generate"))
    engine.card = dataclasses.replace(
        engine.card, max_cached_tokens=capacity_tokens, cache_page_tokens=page_tokens
    )
    return SequenceScheduler(engine, 8, QueueConfig(), WorkerMetrics())


@pytest.mark.asyncio
async def test_a_sequence_waits_for_cache_room_and_a_smaller_one_does_not_overtake_it() -> None:
    scheduler = scheduler_with_cache(capacity_tokens=128, page_tokens=32)
    started: list[str] = []
    first_token = asyncio.Event()

    async def run(name: str, prompt_tokens: int, max_tokens: int, priority: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        stream = scheduler.stream(name, list(range(prompt_tokens)), params, priority)
        async for event in stream:
            if event.num_tokens == 1:
                started.append(name)
                first_token.set()

    # 60 + 30 tokens hold 3 pages (96 tokens) of 128: 32 left.
    big = asyncio.create_task(run("big", 60, 30, LOW))
    await first_token.wait()
    assert scheduler.cached_tokens == 96
    # Needs 2 pages: waits. The less urgent one would fit in the last page, but waits behind it.
    medium = asyncio.create_task(run("medium", 40, 10, MEDIUM))
    low = asyncio.create_task(run("low", 10, 5, LOW))
    await asyncio.sleep(0.05)
    assert (scheduler.num_running, len(scheduler.queue)) == (1, 2)
    await asyncio.gather(big, medium, low)
    assert started == ["big", "medium", "low"]
    assert (scheduler.num_running, scheduler.cached_tokens) == (0, 0)


@pytest.mark.asyncio
async def test_a_cancelled_head_lets_the_next_sequence_in() -> None:
    scheduler = scheduler_with_cache(capacity_tokens=128, page_tokens=32)
    first_token = asyncio.Event()
    running_at_start: dict[str, int] = {}

    async def run(name: str, prompt_tokens: int, max_tokens: int, priority: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        async for event in scheduler.stream(name, list(range(prompt_tokens)), params, priority):
            if event.num_tokens == 1:
                running_at_start[name] = scheduler.num_running
                first_token.set()

    big = asyncio.create_task(run("big", 60, 30, LOW))  # 96 of 128 tokens
    await first_token.wait()
    head = asyncio.create_task(run("head", 40, 10, HIGH))  # 64: waits
    small = asyncio.create_task(run("small", 10, 5, LOW))  # 32: would fit, waits behind
    await asyncio.sleep(0.05)
    assert len(scheduler.queue) == 2
    head.cancel()
    await asyncio.gather(big, small)
    await asyncio.gather(head, return_exceptions=True)
    assert running_at_start["small"] == 2  # it started beside big, as soon as the head left
    assert "head" not in running_at_start
    assert (scheduler.num_running, scheduler.cached_tokens) == (0, 0)
