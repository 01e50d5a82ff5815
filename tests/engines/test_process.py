"""An embedding engine in a child process: the same vectors, and a death that is never hidden.

Real child processes, real minilm where the vectors matter; the failure tests use the
simulated engine in the child (it starts in a second). Every wait is for an event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pytest

from tests.engines.test_embeddings import TEXTS
from tests.procs import gone
from tidegate.engines.embeddings import TransformersEmbeddings
from tidegate.engines.process import ProcessEmbeddingEngine, wants_engine_process
from tidegate.engines.registry import build_engine
from tidegate.errors import ConfigError, ReplicaFailed


def started(build: functools.partial[Any]) -> ProcessEmbeddingEngine:
    engine = ProcessEmbeddingEngine(build, build())
    engine.load()
    return engine


def simulated() -> ProcessEmbeddingEngine:
    return started(functools.partial(build_engine, "emb", "simulated", task="embeddings"))


@pytest.fixture(scope="module")
def minilm() -> Iterator[ProcessEmbeddingEngine]:
    engine = started(functools.partial(build_engine, "minilm"))
    yield engine
    engine.close()


def test_vectors_match_the_in_process_engine(
    minilm: ProcessEmbeddingEngine, in_process: TransformersEmbeddings
) -> None:
    ours = asyncio.run(minilm.embed(TEXTS))
    reference = in_process.embed_sync(TEXTS)
    assert ours.dtype == np.float32
    assert ours.shape == (len(TEXTS), 384)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-6)


def test_card_memory_and_counts_come_from_the_model(
    minilm: ProcessEmbeddingEngine, in_process: TransformersEmbeddings
) -> None:
    assert minilm.card == in_process.card  # the child's card, after its load
    memory = minilm.memory()
    assert 80e6 < memory.weights_bytes < 100e6  # 22.7M float32 parameters
    assert memory.peak_bytes > memory.weights_bytes
    assert minilm.count_tokens(TEXTS) == in_process.count_tokens(TEXTS)
    assert minilm.count_tokens(["hello world"]) == [4]  # [CLS] hello world [SEP]


def test_token_counts_agree_with_transformers_tokenizer(
    in_process: TransformersEmbeddings,
) -> None:
    from transformers import AutoTokenizer

    from tidegate.engines.embeddings import minilm_path

    tokenizer = AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    expected = [len(ids) for ids in tokenizer(TEXTS, truncation=False)["input_ids"]]
    assert in_process.count_tokens(TEXTS) == expected


def test_a_batch_that_raises_in_the_child_fails_only_that_batch(
    minilm: ProcessEmbeddingEngine,
) -> None:
    failures: list[str] = []
    minilm.on_failure(failures.append)

    async def run() -> None:
        with pytest.raises(RuntimeError, match="ValueError") as caught:
            await minilm.embed(cast(list[str], [None]))  # the tokenizer refuses a non-text
        assert not isinstance(caught.value, ReplicaFailed)
        assert (await minilm.embed(TEXTS[:2])).shape == (2, 384)

    asyncio.run(run())
    assert failures == []


def test_killing_the_child_fails_the_pending_batch_and_calls_on_failure_once() -> None:
    engine = simulated()
    pid = engine.pid
    assert pid is not None
    died = threading.Event()
    reasons: list[str] = []

    def on_failure(reason: str) -> None:
        reasons.append(reason)
        died.set()

    engine.on_failure(on_failure)

    async def run() -> None:
        os.kill(pid, signal.SIGSTOP)  # it cannot answer: the batch below stays pending
        pending = asyncio.ensure_future(engine.embed(["tide", "gate"]))
        await asyncio.sleep(0)  # sent
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ReplicaFailed, match="killed by SIGKILL"):
            await pending
        with pytest.raises(ReplicaFailed, match="killed by SIGKILL"):
            await engine.embed(["later"])

    try:
        asyncio.run(run())
        assert died.wait(60)
        late: list[str] = []
        engine.on_failure(late.append)  # after the death: told at once
        engine.close()  # not a second failure
    finally:
        with_kill(pid)
    assert len(reasons) == 1
    assert "killed by SIGKILL" in reasons[0]
    assert late == reasons


def test_the_next_batch_after_the_child_died_fails() -> None:
    engine = simulated()
    pid = engine.pid
    assert pid is not None
    died = threading.Event()
    engine.on_failure(lambda reason: died.set())
    os.kill(pid, signal.SIGKILL)
    assert died.wait(60)
    with pytest.raises(ReplicaFailed):
        asyncio.run(engine.embed(["after"]))
    engine.close()


def test_close_stops_the_child_and_is_not_a_failure() -> None:
    engine = simulated()
    pid = engine.pid
    assert pid is not None
    failures: list[str] = []
    engine.on_failure(failures.append)
    assert asyncio.run(engine.embed(["tide"])).shape == (1, 384)
    engine.close()
    assert gone(pid)
    assert failures == []
    with pytest.raises(ReplicaFailed, match="not running"):
        asyncio.run(engine.embed(["after"]))


def test_a_child_that_fails_to_load_fails_the_load_with_its_reason() -> None:
    build = functools.partial(build_engine, "mine", model_path="/nonexistent", task="embeddings")
    engine = ProcessEmbeddingEngine(build, cast(Any, _NoCounter(build())))
    with pytest.raises(RuntimeError, match="failed to load"):
        engine.load()
    assert engine.pid is not None
    assert gone(engine.pid)


class _NoCounter:
    """The engine's card, no tokenizer to load (the folder does not exist)."""

    def __init__(self, engine: Any) -> None:
        self.card = engine.card

    def load_counter(self) -> None:
        pass

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [1 for _ in texts]


@pytest.mark.parametrize(
    ("requested", "engine", "task", "expected"),
    [
        (None, "transformers", "embeddings", False),  # until it measures faster
        (True, "transformers", "embeddings", True),
        (None, "simulated", "embeddings", False),
        (True, "simulated", "embeddings", True),
        (False, "transformers", "embeddings", False),
        (None, "transformers", "generate", False),
        (False, "transformers", "generate", False),
    ],
)
def test_where_an_engine_runs_by_default_and_when_asked(
    requested: bool | None, engine: str, task: str, expected: bool
) -> None:
    card = dataclasses.replace(build_engine("m", "simulated", task=task).card, engine=engine)
    assert wants_engine_process(requested, card) is expected


def test_an_engine_process_for_a_generation_model_is_a_config_error() -> None:
    card = build_engine("tiny-llama", "simulated").card
    with pytest.raises(ConfigError) as caught:
        wants_engine_process(True, card)
    assert caught.value.key == "engine_process"
    assert "--engine-process" in str(caught.value).split("Fix: ")[1]


def with_kill(pid: int) -> None:
    """Leave no child behind, whatever the test did."""
    if not gone(pid):
        os.kill(pid, signal.SIGKILL)
