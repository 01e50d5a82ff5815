"""Fair sharing's preemption in the worker's sequence scheduler, on a stepped fake engine.

The gateway decides a preemption (core.fairness) and names the tenant in the request; the
worker pauses one of that tenant's decoding sequences at its next token, gives its slot to
the preempting sequence, and resumes it later from its tokens. The fake engine makes a
token only when the test steps that sequence, so every test says exactly when each token
comes; waits are for the event loop to run out of ready work, never for wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tidegate.control.explain import format_batching
from tidegate.core.fairness import FairnessConfig
from tidegate.core.queue import QueueConfig
from tidegate.engines.base import ModelCard, Resume, SamplingParams, TokenEvent
from tidegate.metrics import WorkerMetrics
from tidegate.worker.scheduling import SequenceScheduler

MEDIUM = 1
MAX_TOKENS = 6
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@dataclass
class SteppedEngine:
    """Each sequence makes a token each time the test steps it; token n's text is
    ``"<seq>:<n> "``. A resumed sequence starts after its tokens (``Resume``) and leaves
    out the text its client already has."""

    card: ModelCard = field(
        default_factory=lambda: ModelCard("fake", "generate", "fake", 4096, 512)
    )
    permits: dict[str, asyncio.Queue[None]] = field(default_factory=dict)
    calls: list[tuple[str, int, int]] = field(default_factory=list)  # seq, prompt, resumed
    running: set[str] = field(default_factory=set)

    def step(self, *seq_ids: str, times: int = 1) -> None:
        for seq_id in seq_ids:
            for _ in range(times):
                self.permits.setdefault(seq_id, asyncio.Queue()).put_nowait(None)

    async def generate(
        self,
        seq_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        resume: Resume | None = None,
    ) -> AsyncIterator[TokenEvent]:
        before = 0 if resume is None else len(resume.token_ids)
        self.calls.append((seq_id, len(prompt_ids), before))
        skip = 0 if resume is None else resume.text_chars - len(_text(seq_id, before))
        self.running.add(seq_id)
        try:
            for made in range(before + 1, params.max_tokens + 1):
                await self.permits.setdefault(seq_id, asyncio.Queue()).get()
                text = f"{seq_id}:{made} "
                if skip > 0:  # (never, here: the client has exactly its tokens' text)
                    text, skip = text[skip:], max(0, skip - len(text))
                last = made == params.max_tokens
                yield TokenEvent(text, made, "length" if last else None, range(made))
        finally:
            self.running.discard(seq_id)


def _text(seq_id: str, tokens: int) -> str:
    return "".join(f"{seq_id}:{made} " for made in range(1, tokens + 1))


async def quiesce() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


@dataclass
class Client:
    scheduler: SequenceScheduler
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    made: dict[str, int] = field(default_factory=dict)
    ended: dict[str, str] = field(default_factory=dict)

    def send(self, seq_id: str, tenant: str, preempt: str = "") -> None:
        self.texts[seq_id] = ""
        self.tasks[seq_id] = asyncio.create_task(self._run(seq_id, tenant, preempt))

    async def _run(self, seq_id: str, tenant: str, preempt: str) -> None:
        stream = self.scheduler.stream(
            seq_id, [1, 2, 3], PARAMS, MEDIUM, tenant=tenant, preempt=preempt
        )
        try:
            async with contextlib.aclosing(stream):
                async for event in stream:
                    self.texts[seq_id] += event.text
                    self.made[seq_id] = event.num_tokens
        except asyncio.CancelledError:
            self.ended[seq_id] = "cancelled"
            raise
        except RuntimeError:
            self.ended[seq_id] = "failed"
            return
        self.ended[seq_id] = "completed"


def make(slots: int = 2, fair: bool = True) -> tuple[SteppedEngine, SequenceScheduler, Client]:
    engine = SteppedEngine()
    fairness = FairnessConfig(lag_tokens=0.0, reserve_fraction=0.0) if fair else None
    scheduler = SequenceScheduler(
        engine,  # type: ignore[arg-type]  # generate and card are all the scheduler uses
        slots,
        QueueConfig(fairness=fairness),
        WorkerMetrics(),
    )
    return engine, scheduler, Client(scheduler)


async def finish_all(engine: SteppedEngine, client: Client) -> None:
    """Step every running sequence until every client has ended (bounded: a sequence that
    never ends fails the test instead of hanging it)."""
    for _ in range(10 * MAX_TOKENS * len(client.tasks) + 1):
        for seq_id, task in client.tasks.items():
            if task.done() and seq_id not in client.ended:
                client.ended[seq_id] = "cancelled"  # before its coroutine ever ran
        if len(client.ended) == len(client.tasks):
            return
        engine.step(*engine.running)
        await quiesce()
    pytest.fail(f"still running: {set(client.tasks) - set(client.ended)}")


async def two_heavy(
    fair: bool = True, first: int = 1, second: int = 1
) -> tuple[SteppedEngine, SequenceScheduler, Client]:
    """Two slots, both heavy's: h1 has made ``first`` tokens, h2 ``second``."""
    engine, scheduler, client = make(fair=fair)
    client.send("h1", "heavy")
    client.send("h2", "heavy")
    await quiesce()
    engine.step("h1", times=first)
    engine.step("h2", times=second)
    await quiesce()
    return engine, scheduler, client


@pytest.mark.asyncio
@pytest.mark.parametrize("fair", [True, False])
async def test_the_fewest_tokens_pause_the_slot_goes_to_the_preempting_one_and_it_resumes(
    fair: bool,
) -> None:
    engine, scheduler, client = await two_heavy(fair, first=3)
    client.send("h3", "heavy")  # waits, before the light one: FIFO would give it the slot
    client.send("l1", "light", preempt="heavy")
    await quiesce()
    assert "l1" not in engine.running  # h2 pauses at its next token, not before
    engine.step("h2")
    await quiesce()
    assert engine.running == {"h1", "l1"}
    assert scheduler.num_running == 2
    assert scheduler.describe()["preempted"] == 1
    assert scheduler.describe()["recomputed_tokens"] == 2
    explained = format_batching("chat", [("chat-0", scheduler.describe())])
    assert "paused for another tenant's (preemption): 1, 2 tokens recomputed" in explained
    engine.step("l1", times=MAX_TOKENS)
    await quiesce()
    assert client.ended["l1"] == "completed"
    assert "h2" in engine.running  # resumed ahead of h3, which came later
    assert ("h2", 3, 2) in engine.calls  # its prompt, then its 2 tokens recomputed
    await finish_all(engine, client)
    assert set(client.ended.values()) == {"completed"}
    for seq_id in ("h1", "h2", "h3", "l1"):
        assert client.texts[seq_id] == _text(seq_id, MAX_TOKENS), seq_id
        assert client.made[seq_id] == MAX_TOKENS
    assert scheduler.num_running == scheduler.cached_tokens == len(scheduler.queue) == 0
    if fair:
        tenants = scheduler.queue.tenants()
        assert all(view["in_flight"] == 0 for view in tenants.values())
        # heavy (first: no lift) settled with what it was served, whatever the pause:
        # 3 sequences of prompt 3 + 6 out at weight 2
        assert tenants["heavy"]["counter"] == 3 * (3 + 2 * 6)


@pytest.mark.asyncio
async def test_no_decoding_sequence_of_the_tenant_it_waits_as_any_other() -> None:
    engine, scheduler, client = make()
    client.send("h1", "heavy")
    client.send("o1", "other")
    await quiesce()  # both prefilling: no token yet, nothing to pause
    client.send("l1", "light", preempt="heavy")
    engine.step("h1", "o1")
    await quiesce()
    engine.step("h1", "o1")
    await quiesce()
    assert engine.running == {"h1", "o1"}
    assert scheduler.describe()["preempted"] == 0
    await finish_all(engine, client)
    assert set(client.ended.values()) == {"completed"}


@pytest.mark.asyncio
async def test_a_preempting_sequence_gone_first_pauses_nobody() -> None:
    engine, scheduler, client = await two_heavy()
    client.send("l1", "light", preempt="heavy")
    await quiesce()
    client.tasks["l1"].cancel()
    await quiesce()
    engine.step("h1", "h2")
    await quiesce()
    assert engine.running == {"h1", "h2"}
    assert scheduler.describe()["preempted"] == 0
    await finish_all(engine, client)
    assert client.ended == {"h1": "completed", "h2": "completed", "l1": "cancelled"}


@pytest.mark.asyncio
async def test_a_victim_that_ends_at_its_next_token_hands_its_slot_over() -> None:
    engine, scheduler, client = await two_heavy(first=MAX_TOKENS - 1, second=MAX_TOKENS - 1)
    client.send("h3", "heavy")
    client.send("l1", "light", preempt="heavy")
    await quiesce()
    engine.step("h2")  # asked to pause (fewest, the later granted), it ends instead
    await quiesce()
    assert client.ended["h2"] == "completed"
    assert scheduler.describe()["preempted"] == 0
    assert engine.running == {"h1", "l1"}  # its slot went to l1, not to h3 ahead of it
    await finish_all(engine, client)
    assert set(client.ended.values()) == {"completed"}


@pytest.mark.asyncio
async def test_a_paused_sequence_whose_client_goes_away_leaves_nothing_behind() -> None:
    engine, scheduler, client = await two_heavy()
    client.send("l1", "light", preempt="heavy")
    await quiesce()
    engine.step("h2")
    await quiesce()
    assert engine.running == {"h1", "l1"}
    client.tasks["h2"].cancel()  # paused, waiting for a slot
    await quiesce()
    assert client.ended["h2"] == "cancelled"
    assert len(scheduler.queue) == 0
    await finish_all(engine, client)
    assert scheduler.num_running == scheduler.cached_tokens == 0
    tenants = scheduler.queue.tenants()
    assert all(view["in_flight"] == 0 for view in tenants.values())
    # Heavy paused with nothing queued: back in the queue it is lifted to light's counter
    # (18: the two estimates of 9 it had when light came); then h2 is charged what it was
    # served (3 + 2 x 2, no estimate left) and h1 settled (3 + 2 x 6 for its estimate 9).
    assert tenants["heavy"]["counter"] == 18 + (3 + 2 * 2) + (3 + 2 * 6 - 9)


@pytest.mark.asyncio
async def test_a_drain_hands_back_what_waits_but_a_paused_sequence_resumes() -> None:
    """A draining worker answers its unstarted waiting sequences (the gateway puts them
    back); a paused one has started streaming: it stays, resumes and completes."""
    engine, scheduler, client = await two_heavy()
    client.send("h3", "heavy")
    client.send("l1", "light", preempt="heavy")
    await quiesce()
    engine.step("h2")
    await quiesce()
    assert scheduler.drain(RuntimeError("draining")) == 1  # h3
    await quiesce()
    assert client.ended == {"h3": "failed"}
    await finish_all(engine, client)
    assert client.ended["h2"] == "completed"
    assert client.texts["h2"] == _text("h2", MAX_TOKENS)
    assert scheduler.num_running == len(scheduler.queue) == 0


@pytest.mark.asyncio
async def test_an_engine_that_died_fails_a_paused_sequence_too() -> None:
    engine, scheduler, client = await two_heavy()
    client.send("l1", "light", preempt="heavy")
    await quiesce()
    engine.step("h2")
    await quiesce()
    scheduler.fail(RuntimeError("engine died"))
    await quiesce()
    assert client.ended == {"h2": "failed"}


OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["send", "preempt", "preempt", "step", "step", "step_all", "cancel", "drain"]
        ),
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 7),
    ),
    min_size=8,
    max_size=50,
)


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(1, 3), st.booleans())
def test_every_sequence_ends_once_with_its_text_whatever_pauses(
    ops: list[tuple[str, str, int]], slots: int, fair: bool
) -> None:
    """Sends (some asking to preempt a tenant), steps, cancels and drains in any order:
    every sequence ends exactly once; a completed one's client got each of its tokens'
    text once and all of them; the running never exceed the slots; at the end nothing is
    held, queued or counted in flight."""

    async def scenario() -> None:
        engine, scheduler, client = make(slots=slots, fair=fair)
        sent = 0
        for op, tenant, number in ops:
            if op in ("send", "preempt"):
                victim = ""
                if op == "preempt":  # mostly a tenant running now, as the gateway names one
                    running = sorted(engine.running) or ["abc"[number % 3]]
                    victim = running[number % len(running)][0]
                client.send(f"{tenant}{sent}", tenant, preempt=victim)
                sent += 1
            elif op == "step" and engine.running:
                engine.step(sorted(engine.running)[number % len(engine.running)])
            elif op == "step_all":
                engine.step(*engine.running)
            elif op == "cancel" and client.tasks:
                task = list(client.tasks.values())[number % len(client.tasks)]
                task.cancel()
            elif op == "drain":
                scheduler.drain(RuntimeError("draining"))
            await quiesce()
            assert scheduler.num_running <= slots
            assert len(engine.running) <= slots
        await finish_all(engine, client)
        event(f"sequences paused: {min(scheduler.num_preempted, 3)}")
        assert set(client.ended) == set(client.tasks)
        for seq_id, how in client.ended.items():
            if how == "completed":
                assert client.texts[seq_id] == _text(seq_id, MAX_TOKENS), seq_id
        assert scheduler.num_running == scheduler.cached_tokens == len(scheduler.queue) == 0
        assert scheduler.prefilling_tokens == 0
        if fair:
            tenants = scheduler.queue.tenants().values()
            assert all(view["in_flight"] == 0 and view["queued"] == 0 for view in tenants)

    asyncio.run(scenario())
