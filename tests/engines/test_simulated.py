"""The simulated generation engine steps its sequences as the simulator does.

The engine's steps are passed by hand (``simulated._sleep`` replaced): each test sees the
duration every step asked for and lets it end when it chooses, so nothing waits on wall time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from tidegate.engines import simulated
from tidegate.engines.base import SamplingParams, TokenEvent
from tidegate.engines.cost import ConcurrencySteps
from tidegate.engines.profile import Curve, EngineProfile
from tidegate.engines.simulated import SimulatedGenerator

TTFT = Curve((1.0, 2.0), (200.0, 300.0))
ITL = Curve((1.0, 2.0), (40.0, 50.0))
JOIN_MS = 100.0
pytestmark = pytest.mark.asyncio

PROFILE = EngineProfile("sim", "generate", ttft_ms=TTFT, itl_ms=ITL, join_ms=JOIN_MS)


class HandClock:
    """Each step's duration as the engine asked for it; a step ends on ``tick``."""

    def __init__(self) -> None:
        self.asked: list[float] = []
        self._ticks: asyncio.Queue[None] = asyncio.Queue()

    async def sleep(self, seconds: float) -> None:
        self.asked.append(seconds)
        await self._ticks.get()

    async def tick(self, until: Callable[[], bool]) -> None:
        """End the step in progress; return once ``until()`` holds."""
        self._ticks.put_nowait(None)
        await settle(until)


async def settle(until: Callable[[], bool]) -> None:
    for _ in range(1000):  # rounds of the event loop, not time
        if until():
            return
        await asyncio.sleep(0)
    raise AssertionError("the engine never reached the expected state")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> HandClock:
    hand = HandClock()
    monkeypatch.setattr(simulated, "_sleep", hand.sleep)
    return hand


def collect(stream: AsyncIterator[TokenEvent], into: list[TokenEvent]) -> asyncio.Task[None]:
    async def run() -> None:
        async for event in stream:
            into.append(event)

    return asyncio.get_running_loop().create_task(run())


def start(engine: SimulatedGenerator, seq_id: str, max_tokens: int) -> list[TokenEvent]:
    got: list[TokenEvent] = []
    collect(engine.generate(seq_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens)), got)
    return got


async def test_a_prompt_joining_a_decoding_batch_pays_the_profiles_join_price(
    clock: HandClock,
) -> None:
    engine = SimulatedGenerator("sim", PROFILE)
    steps = ConcurrencySteps(TTFT, ITL, JOIN_MS)
    first = start(engine, "a", 3)
    await settle(lambda: len(clock.asked) == 1)
    assert clock.asked[0] == pytest.approx(TTFT(1) / 1e3)  # alone, into an idle engine
    second = start(engine, "b", 2)
    await settle(lambda: engine.num_running == 2)

    await clock.tick(lambda: len(first) == 1 and len(clock.asked) == 2)
    assert second == []  # it joins in the next step, not in the one it arrived during
    # a decoding sequence and a joiner: a decode step of two, plus the join
    assert clock.asked[1] == pytest.approx(steps.step_s(1, 1, 0))
    assert clock.asked[1] == pytest.approx((ITL(2) + JOIN_MS) / 1e3)

    await clock.tick(lambda: len(second) == 1 and len(clock.asked) == 3)
    assert len(first) == 2
    assert clock.asked[2] == pytest.approx(ITL(2) / 1e3)  # both decoding

    await clock.tick(lambda: len(first) == 3 and len(second) == 2)
    assert engine.num_running == 0
    assert [e.num_tokens for e in first] == [1, 2, 3]
    assert [e.num_tokens for e in second] == [1, 2]
    assert first[-1].finish_reason == "length"
    assert engine.steps_run == 3
    assert len(clock.asked) == 3  # no step with nobody running
    # each step counted by kind and sequences running, as the transformers engine's are (the
    # worker exports the table; the profiler prices a join from it)
    table = engine.steps.table()
    assert {key: (cell.num_steps, cell.num_joins) for key, cell in table.items()} == {
        ("start", 1): (1, 1),
        ("join", 2): (1, 1),
        ("decode", 2): (1, 0),
    }
    assert all(cell.seconds >= 0 for cell in table.values())


async def test_prompts_joining_an_idle_engine_together_take_the_ttft_of_their_number(
    clock: HandClock,
) -> None:
    engine = SimulatedGenerator("sim", PROFILE)
    a, b = start(engine, "a", 1), start(engine, "b", 1)
    await settle(lambda: len(clock.asked) == 1)
    assert clock.asked[0] == pytest.approx(TTFT(2) / 1e3)
    await clock.tick(lambda: len(a) == len(b) == 1)
    assert engine.num_running == 0


async def test_a_sequence_whose_client_left_is_out_of_the_next_step(clock: HandClock) -> None:
    engine = SimulatedGenerator("sim", PROFILE)
    stays = start(engine, "a", 4)
    leaving: list[TokenEvent] = []
    task = collect(engine.generate("b", [1], SamplingParams(max_tokens=4)), leaving)
    await settle(lambda: len(clock.asked) == 1)
    await clock.tick(lambda: len(leaving) == 1 and len(clock.asked) == 2)
    assert clock.asked[1] == pytest.approx(ITL(2) / 1e3)
    task.cancel()  # its client disconnects mid-stream
    await settle(lambda: engine.num_running == 1)
    await clock.tick(lambda: len(clock.asked) == 3)
    assert clock.asked[2] == pytest.approx(ITL(1) / 1e3)
    await clock.tick(lambda: len(stays) == 3)
    await clock.tick(lambda: len(stays) == 4)
    assert [e.num_tokens for e in stays] == [1, 2, 3, 4]
    assert engine.num_running == 0
