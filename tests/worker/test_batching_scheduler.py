"""The worker's embedding batcher with adaptive batching: batches it forms, and /stats' why.

A gated fake engine holds the first batch while more inputs queue, so what the next plan
sees is fixed; a manual clock that never moves keeps the windows out of it (no wall time).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from tidegate.core.batch_adapt import CapConfig
from tidegate.core.batching import BatchConfig
from tidegate.core.queue import LevelSpec, QueueConfig
from tidegate.engines.base import ModelCard, Vectors
from tidegate.metrics import WorkerMetrics
from tidegate.worker.scheduling import EmbeddingBatcher


class FixedClock:
    def now(self) -> float:
        return 100.0


class StepClock:
    """Every reading is a second after the one before: latencies are whole seconds."""

    def __init__(self) -> None:
        self.at = 0.0

    def now(self) -> float:
        self.at += 1.0
        return self.at


class GatedEngine:
    """Records each batch; the first one waits for ``gate``."""

    def __init__(self) -> None:
        self.card = ModelCard(name="m", task="embeddings", engine="fake", max_context_tokens=512)
        self.batches: list[list[str]] = []
        self.gate = asyncio.Event()
        self.started = asyncio.Event()

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(t) for t in texts]

    async def embed(self, texts: Sequence[str]) -> Vectors:
        self.batches.append(list(texts))
        self.started.set()
        if len(self.batches) == 1:
            await self.gate.wait()
        return np.zeros((len(texts), 4), dtype=np.float32)


QUEUE = QueueConfig(levels=(LevelSpec("high"), LevelSpec("medium"), LevelSpec("low")))


LATER = (("short-a", 10), ("long", 200), ("short-b", 12))  # (text, tokens), arrival order


async def _run(
    config: BatchConfig,
    cap: CapConfig | None = None,
    clock: FixedClock | StepClock | None = None,
    later_inputs: Sequence[tuple[str, int]] = LATER,
) -> tuple[GatedEngine, dict[str, Any]]:
    engine = GatedEngine()
    batcher = EmbeddingBatcher(
        engine,  # type: ignore[arg-type]
        config,
        QUEUE,
        WorkerMetrics(),
        clock=clock or FixedClock(),
        cap=cap,
    )
    loop = asyncio.create_task(batcher.run())
    try:
        first = asyncio.create_task(batcher.embed(["block"], [5], priority=0))
        await engine.started.wait()
        # Queued while the engine is busy, in this arrival order, one level.
        later = [
            asyncio.create_task(batcher.embed([text], [tokens], priority=1))
            for text, tokens in later_inputs
        ]
        await asyncio.sleep(0)  # one turn of the loop: each task queues its input
        assert len(batcher.queue) == len(later_inputs)
        engine.gate.set()
        await asyncio.gather(first, *later)
        return engine, batcher.planner.describe(100.0)
    finally:
        loop.cancel()


@pytest.mark.asyncio
async def test_length_aware_batcher_groups_similar_lengths_past_a_long_one() -> None:
    config = BatchConfig(max_batch_size=2, batch_window_ms=0.0, length_candidates=8)
    engine, stats = await _run(config)
    assert engine.batches == [["block"], ["short-a", "short-b"], ["long"]]
    assert stats["releases_by_reason"] == {"window": 2, "full_size": 1}
    assert stats["last_release_reason"] == "window"
    assert stats["length_candidates"] == 8


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("overhead_tokens", "expected"),
    [
        # The ratio rule: 2 x 30 padded tokens over 40 real is past 1.25, so each goes alone.
        (None, [["block"], ["short"], ["mid"], ["long"]]),
        # On cost: 20 padding tokens are under a batch's 30 tokens of overhead: one batch.
        (30.0, [["block"], ["short", "mid"], ["long"]]),
    ],
    ids=["ratio", "cost"],
)
async def test_length_aware_batcher_pairs_short_inputs_on_cost(
    overhead_tokens: float | None, expected: list[list[str]]
) -> None:
    config = BatchConfig(
        max_batch_size=2,
        batch_window_ms=0.0,
        length_candidates=8,
        batch_overhead_tokens=overhead_tokens,
    )
    later = (("short", 10), ("mid", 30), ("long", 200))
    engine, stats = await _run(config, later_inputs=later)
    assert engine.batches == expected
    assert stats["length_rule"].startswith("ratio" if overhead_tokens is None else "cost")


@pytest.mark.asyncio
async def test_fixed_rule_batcher_keeps_arrival_order() -> None:
    config = BatchConfig(max_batch_size=2, batch_window_ms=0.0)
    engine, stats = await _run(config)
    assert engine.batches == [["block"], ["short-a", "long"], ["short-b"]]
    assert stats["releases_by_reason"] == {"window": 2, "full_size": 1}


@pytest.mark.asyncio
async def test_late_high_batch_of_one_holds_the_cap_and_stats_say_so() -> None:
    config = BatchConfig(max_batch_size=2, batch_window_ms=0.0)
    cap = CapConfig(target_p99_s=0.5, max_batch_size=2, num_samples=1)
    engine, stats = await _run(config, cap, StepClock())
    # The high input's latency is whole seconds, over the 0.5 s target, from its own run
    # mostly; but its batch was of 1, which a cap of 1 would not have cut: the cap holds.
    assert engine.batches == [["block"], ["short-a", "long"], ["short-b"]]
    assert stats["max_batch_size"] == 2
    assert stats["configured_max_batch_size"] == 2
    assert stats["adaptive_cap"]["last_decision"] == "hold_short"
    assert stats["adaptive_cap"]["decisions"] == {"hold_short": 1}
    assert stats["adaptive_cap"]["bounds"] == [1, 2]
    assert stats["releases_by_reason"] == {"window": 2, "full_size": 1}


@pytest.mark.asyncio
async def test_stats_name_a_level_window_release() -> None:
    config = BatchConfig(max_batch_size=3, batch_window_ms=1e6, level_windows_ms=(0.0,))
    engine, stats = await _run(config)
    # The high "block" goes at once (its level's window is 0, the others' is 1000 s); the
    # three medium inputs then fill a batch.
    assert engine.batches == [["block"], ["short-a", "long", "short-b"]]
    assert stats["window_ms_by_level"] == [0.0, 1e6, 1e6]
    assert stats["releases_by_reason"] == {"level_window": 1, "full_size": 1}
