"""The sequence scheduler's prefill budget and its fair queue, on a fake engine.

The fake engine makes each sequence's first token, and its end, wait for the test to open
a gate, so a test says exactly when a prefill is over. Waits are for the event loop to run
out of ready work (``quiesce``), never for wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.procs import DEADLINE_S
from tidegate.control.explain import format_batching
from tidegate.core.fairness import FairnessConfig
from tidegate.core.queue import QueueConfig
from tidegate.engines.base import ModelCard, SamplingParams, TokenEvent
from tidegate.metrics import WorkerMetrics
from tidegate.worker.app import create_app
from tidegate.worker.runtime import Worker, WorkerSettings
from tidegate.worker.scheduling import SequenceScheduler

MEDIUM = 1
PARAMS = SamplingParams(max_tokens=8, temperature=0.0)


class EngineFailed(RuntimeError):
    pass


@dataclass
class GatedEngine:
    """A generation engine whose sequences wait for the test: for their first token
    (``first``), then for their end (``finish``); one in ``failing`` raises at its gate."""

    card: ModelCard = field(
        default_factory=lambda: ModelCard("fake", "generate", "fake", 4096, 512)
    )
    started: list[str] = field(default_factory=list)
    before_first: dict[str, int] = field(default_factory=dict)  # started, no token yet
    first: dict[str, asyncio.Event] = field(default_factory=dict)
    finish: dict[str, asyncio.Event] = field(default_factory=dict)
    failing: set[str] = field(default_factory=set)

    def gate(self, gates: dict[str, asyncio.Event], seq_id: str) -> asyncio.Event:
        return gates.setdefault(seq_id, asyncio.Event())

    def release(self, *seq_ids: str) -> None:
        """Let these sequences make their first token and end."""
        for seq_id in seq_ids:
            self.gate(self.first, seq_id).set()
            self.gate(self.finish, seq_id).set()

    async def generate(
        self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        self.started.append(seq_id)
        self.before_first[seq_id] = len(prompt_ids)
        try:
            await self.gate(self.first, seq_id).wait()
            if seq_id in self.failing:
                raise EngineFailed(seq_id)
        finally:
            self.before_first.pop(seq_id, None)
        yield TokenEvent("a", 1)
        await self.gate(self.finish, seq_id).wait()
        if seq_id in self.failing:
            raise EngineFailed(seq_id)
        yield TokenEvent("b", 2, "length")


async def quiesce() -> None:
    """Let every task that can run, run (no I/O here: a bounded number of loop turns)."""
    for _ in range(50):
        await asyncio.sleep(0)


def scheduler(
    engine: GatedEngine,
    budget: int = 0,
    max_num_seqs: int = 8,
    queue: QueueConfig | None = None,
) -> SequenceScheduler:
    return SequenceScheduler(
        engine,  # type: ignore[arg-type]  # generate and card are all the scheduler uses
        max_num_seqs,
        queue or QueueConfig(),
        WorkerMetrics(),
        max_prefill_tokens=budget,
    )


@dataclass
class Client:
    """Runs sequences on a scheduler; records how each ended."""

    scheduler: SequenceScheduler
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    ended: dict[str, str] = field(default_factory=dict)

    def send(self, seq_id: str, prompt_tokens: int, tenant: str = "") -> None:
        self.tasks[seq_id] = asyncio.create_task(self._run(seq_id, prompt_tokens, tenant))

    async def _run(self, seq_id: str, prompt_tokens: int, tenant: str) -> None:
        stream = self.scheduler.stream(
            seq_id, list(range(prompt_tokens)), PARAMS, MEDIUM, tenant=tenant
        )
        try:
            async with contextlib.aclosing(stream):
                async for _ in stream:
                    pass
        except EngineFailed:
            self.ended[seq_id] = "failed"
        except asyncio.CancelledError:
            self.ended[seq_id] = "cancelled"
            raise
        else:
            self.ended[seq_id] = "completed"

    async def join(self) -> None:
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


@pytest.mark.asyncio
async def test_the_budget_holds_the_next_until_the_first_token_and_nothing_overtakes_it() -> None:
    engine = GatedEngine()
    seqs = scheduler(engine, budget=100)
    client = Client(seqs)
    client.send("a", 80)
    client.send("b", 40)  # 120 > 100: waits for a's prefill
    client.send("c", 10)  # 90 would fit, but b is ahead
    await quiesce()
    assert engine.started == ["a"]
    assert (seqs.prefilling_tokens, seqs.num_running, len(seqs.queue)) == (80, 1, 2)
    engine.first["a"].set()
    await quiesce()
    assert engine.started == ["a", "b", "c"]  # 40 + 10 within the budget: both join
    assert seqs.prefilling_tokens == 50
    engine.release("a", "b", "c")
    await client.join()
    assert client.ended == dict.fromkeys("abc", "completed")
    assert (seqs.prefilling_tokens, seqs.num_running) == (0, 0)


@pytest.mark.asyncio
async def test_a_cancel_before_the_first_token_releases_its_prefill_once() -> None:
    engine = GatedEngine()
    seqs = scheduler(engine, budget=100)
    client = Client(seqs)
    client.send("a", 80)
    client.send("b", 40)
    client.send("c", 70)
    await quiesce()
    assert engine.started == ["a"]
    client.tasks["a"].cancel()
    await quiesce()
    assert client.ended["a"] == "cancelled"
    assert engine.started == ["a", "b"]  # 40 + 70 > 100: c still waits for b
    assert (seqs.prefilling_tokens, seqs.num_running) == (40, 1)
    engine.first["b"].set()
    await quiesce()
    assert engine.started == ["a", "b", "c"]
    assert seqs.prefilling_tokens == 70
    engine.release("b", "c")
    await client.join()
    assert (seqs.prefilling_tokens, seqs.num_running, seqs.cached_tokens) == (0, 0, 0)


@pytest.mark.asyncio
async def test_an_engine_error_before_the_first_token_releases_its_prefill_once() -> None:
    engine = GatedEngine(failing={"a"})
    seqs = scheduler(engine, budget=100)
    client = Client(seqs)
    client.send("a", 80)
    client.send("b", 40)
    await quiesce()
    engine.first["a"].set()  # a's gate: it raises instead of its first token
    await quiesce()
    assert client.ended["a"] == "failed"
    assert engine.started == ["a", "b"]
    assert (seqs.prefilling_tokens, seqs.num_running) == (40, 1)
    engine.release("b")
    await client.join()
    assert client.ended["b"] == "completed"
    assert (seqs.prefilling_tokens, seqs.num_running) == (0, 0)


@dataclass(frozen=True)
class JoinCase:
    budget: int
    max_num_seqs: int
    prompts: tuple[int, ...]  # sent in this order as s0, s1, ...
    joined: int  # how many join at once, before any first token


@pytest.mark.parametrize(
    "case",
    [
        JoinCase(budget=100, max_num_seqs=8, prompts=(300, 10), joined=1),
        JoinCase(budget=0, max_num_seqs=3, prompts=(1000,) * 4, joined=3),
        JoinCase(budget=100, max_num_seqs=8, prompts=(30, 30, 40, 1), joined=3),
    ],
    ids=["a_prompt_over_the_budget_joins_alone", "no_budget_only_slots", "up_to_the_budget"],
)
@pytest.mark.asyncio
async def test_who_joins_before_any_first_token(case: JoinCase) -> None:
    engine = GatedEngine()
    seqs = scheduler(engine, budget=case.budget, max_num_seqs=case.max_num_seqs)
    client = Client(seqs)
    names = [f"s{index}" for index in range(len(case.prompts))]
    for name, prompt in zip(names, case.prompts, strict=True):
        client.send(name, prompt)
    await quiesce()
    assert engine.started == names[: case.joined]
    assert seqs.prefilling_tokens == sum(case.prompts[: case.joined])
    engine.release(*names)
    await client.join()
    assert (seqs.prefilling_tokens, seqs.num_running) == (0, 0)


@pytest.mark.asyncio
async def test_a_waiter_cancelled_as_its_slot_frees_is_skipped_for_the_next() -> None:
    engine = GatedEngine()
    seqs = scheduler(engine, max_num_seqs=1)
    client = Client(seqs)
    client.send("a", 10)
    await quiesce()
    client.send("b", 10)
    client.send("c", 10)
    await quiesce()
    # a ends before b's task runs to leave the queue: the freed slot must skip b.
    engine.release("a")
    client.tasks["b"].cancel()
    await quiesce()
    assert engine.started == ["a", "c"]
    assert client.ended == {"a": "completed", "b": "cancelled"}
    engine.release("c")
    await client.join()
    assert (seqs.num_running, len(seqs.queue), seqs.prefilling_tokens) == (0, 0, 0)


def fair_queue_config(fairness: FairnessConfig | None) -> QueueConfig:
    return Worker(WorkerSettings(model="fake", fairness=fairness)).sequence_queue_config()


@pytest.mark.parametrize(
    ("fairness", "next_up"),
    [
        (FairnessConfig(reserve_fraction=0.0), "light"),
        (None, "heavy1"),
    ],
    ids=["fair_light_goes_first", "fifo_heavy_goes_first"],
)
@pytest.mark.asyncio
async def test_a_light_tenant_queued_after_a_heavy_one_takes_the_next_free_slot(
    fairness: FairnessConfig | None, next_up: str
) -> None:
    engine = GatedEngine()
    seqs = scheduler(engine, max_num_seqs=1, queue=fair_queue_config(fairness))
    client = Client(seqs)
    client.send("heavy0", 50, tenant="heavy")
    await quiesce()
    for index in range(1, 11):
        client.send(f"heavy{index}", 50, tenant="heavy")
    client.send("light", 50, tenant="light")
    await quiesce()
    assert engine.started == ["heavy0"]
    engine.release("heavy0")
    await quiesce()
    assert engine.started == ["heavy0", next_up]
    engine.release(*client.tasks)
    await client.join()
    assert set(client.ended.values()) == {"completed"}
    if fairness is not None:  # every slot given back; the counters hold what was served
        tenants = seqs.queue.tenants()
        assert {state["in_flight"] for state in tenants.values()} == {0}


def test_the_worker_sequence_queue_carries_fairness_and_the_embedding_queue_does_not() -> None:
    fairness = FairnessConfig(reserve_fraction=0.0)
    worker = Worker(WorkerSettings(model="fake", fairness=fairness))
    assert worker.sequence_queue_config().fairness == fairness
    assert worker.queue_config().fairness is None
    assert worker.sequence_queue_config().levels == worker.queue_config().levels


def test_the_tenant_header_reaches_the_fair_queue_and_stats_show_the_budget() -> None:
    fairness = FairnessConfig(lag_tokens=0.0, reserve_fraction=0.0)
    settings = WorkerSettings(
        model="gen", engine="simulated", task="generate", max_prefill_tokens=64, fairness=fairness
    )
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + DEADLINE_S
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "simulated worker never became ready"
            time.sleep(0.05)
        chat = {"model": "gen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        answer = client.post(
            "/v1/chat/completions", json=chat, headers={"X-Tidegate-Tenant": "team-a"}
        )
        assert answer.status_code == 200, answer.text
        stats = client.get("/stats").json()
    assert (stats["max_prefill_tokens"], stats["prefilling_tokens"]) == (64, 0)
    assert stats["fair_sharing"] is True
    assert stats["tenants"]["team-a"]["in_flight"] == 0
    # settled with what it was served: its prompt in at weight 1, 2 tokens out at weight 2
    served = answer.json()["usage"]["prompt_tokens"] + 2 * 2
    assert stats["tenants"]["team-a"]["counter"] == served


# ----------------------------------------------------------------------------- property
STEPS = st.lists(
    st.tuples(st.sampled_from(["first", "finish", "cancel", "fail"]), st.integers(0, 5)),
    max_size=30,
)


@settings(max_examples=80, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 80), min_size=1, max_size=6),
    budget=st.integers(0, 120),
    max_num_seqs=st.integers(1, 4),
    steps=STEPS,
)
def test_pending_prefill_returns_to_zero_whatever_ends_the_sequences(
    prompts: list[int], budget: int, max_num_seqs: int, steps: list[tuple[str, int]]
) -> None:
    asyncio.run(_interleave(prompts, budget, max_num_seqs, steps))


async def _interleave(
    prompts: list[int], budget: int, max_num_seqs: int, steps: list[tuple[str, int]]
) -> None:
    engine = GatedEngine()
    seqs = scheduler(engine, budget=budget, max_num_seqs=max_num_seqs)
    client = Client(seqs)
    names = [f"s{index}" for index in range(len(prompts))]
    for name, prompt in zip(names, prompts, strict=True):
        client.send(name, prompt)
    await quiesce()
    for action, index in steps:
        name = names[index % len(names)]
        if action == "first":
            engine.gate(engine.first, name).set()
        elif action == "finish":
            engine.release(name)
        elif action == "cancel":
            client.tasks[name].cancel()
        else:
            engine.failing.add(name)
            engine.gate(engine.first, name).set()
        await quiesce()
        # The budget counts exactly the prompts started and not yet at their first token,
        # and holds unless one alone is pending.
        assert seqs.prefilling_tokens == sum(engine.before_first.values())
        assert budget == 0 or len(engine.before_first) <= 1 or seqs.prefilling_tokens <= budget
        assert seqs.num_running <= max_num_seqs
    engine.release(*names)
    await client.join()
    assert len(client.ended) == len(names)
    assert (seqs.prefilling_tokens, seqs.num_running, seqs.cached_tokens) == (0, 0, 0)
    assert len(seqs.queue) == 0


@pytest.mark.asyncio
async def test_stats_and_explain_say_what_held_the_sequences() -> None:
    """b waits for a's prefill (the budget), then d for a slot: /stats' batching counts each
    sequence once per reason however often the scheduler looks, and explain prints it."""
    engine = GatedEngine()
    seqs = scheduler(engine, budget=100, max_num_seqs=2)
    client = Client(seqs)
    client.send("a", 80)
    client.send("b", 40)
    await quiesce()
    client.send("c", 1)  # looks again: b is still the head held by the budget
    await quiesce()
    assert seqs.describe()["held_by"] == {"prefill_budget": 1}
    engine.first["a"].set()  # b joins: 2 of 2 running, c waits for a slot
    await quiesce()
    client.send("d", 1)
    await quiesce()
    described = seqs.describe()
    assert described["held_by"] == {"prefill_budget": 1, "slots": 1}
    assert described["last_held_by"] == "slots"
    assert (described["running"], described["prefilling_tokens"]) == (2, 40)
    text = format_batching("chat", [("chat-0", described)])
    assert "chat-0: 2 of 2 sequences running, prefill budget 100 tokens (40 admitted" in text
    assert "by what held them: prefill_budget 1, slots 1; last: slots" in text
    engine.release("a", "b", "c", "d")
    await client.join()
    assert client.ended == dict.fromkeys("abcd", "completed")
