"""Simulated engines: the latency and memory of a profile, no model.

Used by tests that need many replicas, by load tests of the gateway and to develop the
fidelity benchmark against a stack whose engine is known. Outputs are deterministic: the same
seed and input give the same vectors and tokens. A batch of embeddings lasts
``batch_latency_ms(batch size)``: its vectors are made first and the rest is slept.

Generation runs the simulator's step model in wall time (``tidegate.engines.cost``'s
``ConcurrencySteps``, the one ``tidegate simulate`` charges): one loop steps every running
sequence at once; a step where nobody joins lasts ``itl(running)``, prompts joining an idle
engine together ``ttft`` of their number, and each prompt joining a batch that is decoding
adds the profile's ``generate.join_ms``. A joiner's first token comes at the end of its
step, each next one a step later. Each step is timed as it ran (the sleep, and however late
the event loop woke it) into the same ``StepTally`` the transformers engine keeps, so the
worker exports ``tidegate_engine_step*`` and the profiler reads a join price from it as it
does on a real model. (Until 2026-12-04 each sequence slept ``ttft(running)``
then ``itl(running)`` per token on its own, so a prompt joining a busy engine cost the others
nothing and the profile's join price was not charged: a stack on this engine served what the
simulator would not.)
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence

import numpy as np

from tidegate.engines.base import (
    MemoryReport,
    ModelCard,
    Resume,
    SamplingParams,
    TokenEvent,
    Vectors,
)
from tidegate.engines.cost import ConcurrencySteps
from tidegate.engines.profile import EngineProfile
from tidegate.engines.steps import StepTally
from tidegate.engines.text import CatchUp, StopScanner

_WORDS = (
    "tide gate harbour vessel current anchor lantern signal river delta channel beacon "
    "pier quay buoy ledger cargo dock crane hull mast keel rudder sail"
).split()
_MB = 1024 * 1024
_sleep = asyncio.sleep  # how a step passes (tests step the engine by hand)


def _approx_tokens(text: str) -> int:
    """About four characters per token, as for English BPE vocabularies."""
    return max(1, math.ceil(len(text) / 4))


def _memory(profile: EngineProfile) -> MemoryReport:
    return MemoryReport(
        device=profile.device,
        weights_bytes=int(profile.weights_mb * _MB),
        peak_bytes=int(profile.memory_mb * _MB),
    )


class SimulatedEmbeddings:
    def __init__(self, name: str, profile: EngineProfile, *, seed: int = 0, dimensions: int = 384):
        assert profile.batch_latency_ms is not None
        self.profile = profile
        self.seed = seed
        self.card = ModelCard(
            name=name,
            task="embeddings",
            engine="simulated",
            max_context_tokens=512,
            dimensions=dimensions,
            synthetic=True,
            description=f"simulated from profile of {profile.model}",
        )
        self._latency = profile.batch_latency_ms

    def load(self) -> None:
        """Nothing to load."""

    def close(self) -> None:
        """Nothing to release."""

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """No loop of its own: it never dies on its own."""

    def memory(self) -> MemoryReport:
        return _memory(self.profile)

    def load_counter(self) -> None:
        """Counting needs nothing loaded."""

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [_approx_tokens(text) for text in texts]

    def batch_latency_s(self, batch_size: int) -> float:
        return self._latency(batch_size) / 1e3

    async def embed(self, texts: Sequence[str]) -> Vectors:
        started = time.perf_counter()
        vectors = self._vectors(texts)  # (made first: the batch lasts its profiled latency)
        await asyncio.sleep(self._left_s(len(texts), started))
        return vectors

    def embed_sync(self, texts: list[str]) -> Vectors:
        """One batch on the calling thread (in an engine process of its own)."""
        started = time.perf_counter()
        vectors = self._vectors(texts)
        time.sleep(self._left_s(len(texts), started))
        return vectors

    def _left_s(self, batch_size: int, started: float) -> float:
        return max(0.0, self.batch_latency_s(batch_size) - (time.perf_counter() - started))

    def _vectors(self, texts: Sequence[str]) -> Vectors:
        """Unit vectors, one per text, from a seeded hash of the text: numpy, not a Python
        loop per value (32 texts of 384 values took 9 ms that way, in the worker's event
        loop, on top of the profile's latency)."""
        vectors = np.empty((len(texts), self.card.dimensions), dtype=np.float32)
        for row, text in enumerate(texts):
            digest = hashlib.blake2b(f"{self.seed}:{text}".encode(), digest_size=8).digest()
            values = np.random.default_rng(int.from_bytes(digest, "big")).standard_normal(
                self.card.dimensions
            )
            vectors[row] = values / (np.linalg.norm(values) or 1.0)
        return vectors


class SimulatedGenerator:
    def __init__(self, name: str, profile: EngineProfile, *, seed: int = 0) -> None:
        assert profile.ttft_ms is not None
        assert profile.itl_ms is not None
        self.profile = profile
        self.seed = seed
        self.card = ModelCard(
            name=name,
            task="generate",
            engine="simulated",
            max_context_tokens=4096,
            max_output_tokens=2048,
            synthetic=True,
            description=f"simulated from profile of {profile.model}",
        )
        self._steps = ConcurrencySteps(profile.ttft_ms, profile.itl_ms, profile.join_ms)
        self._joining: list[_Sequence] = []  # to prefill in the next step
        self._prefilling: list[_Sequence] = []  # joining in the step in progress
        self._decoding: list[_Sequence] = []
        self._loop: asyncio.Task[None] | None = None
        self.steps_run = 0  # engine steps so far (tests)
        # every step timed as it ran, as the transformers engine's own (the worker exports
        # the table as tidegate_engine_step*, and the profiler prices a join from it)
        self.steps = StepTally()

    @property
    def num_running(self) -> int:
        return len(self._joining) + len(self._prefilling) + len(self._decoding)

    def load(self) -> None:
        """Nothing to load."""

    def close(self) -> None:
        """Nothing to release."""

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Its step loop only sleeps and hands out tokens: it never dies on its own."""

    def memory(self) -> MemoryReport:
        return _memory(self.profile)

    def encode(self, prompt: str) -> list[int]:
        return list(range(_approx_tokens(prompt)))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        text = "".join(f"{m['role']}\n{m['content']}\n" for m in messages) + "assistant\n"
        return self.encode(text)

    def step_s(self, num_decode: int, num_join: int) -> float:
        """One step of ``num_decode`` decoding sequences and ``num_join`` joining ones."""
        return self._steps.step_s(num_decode, num_join, 0)

    async def _run(self) -> None:
        """The engine loop: a step of every running sequence at a time, while any runs."""
        while self._joining or self._decoding:
            self._prefilling, self._joining = self._joining, []
            decoding, joining = len(self._decoding), len(self._prefilling)
            began = time.perf_counter()
            await _sleep(self.step_s(decoding, joining))
            self.steps.add(decoding, joining, time.perf_counter() - began)
            self.steps_run += 1
            stepped = self._decoding + self._prefilling  # (one that left is out of them)
            self._decoding, self._prefilling = [], []
            for seq in stepped:
                seq.left -= 1
                seq.tokens.put_nowait(None)
                if seq.left:
                    self._decoding.append(seq)
        self._loop = None

    def _join(self, seq: _Sequence) -> None:
        self._joining.append(seq)
        if self._loop is None or self._loop.done():  # (done: its event loop was closed)
            self._loop = asyncio.get_running_loop().create_task(self._run())

    def _leave(self, seq: _Sequence) -> None:
        """``seq`` ended before its last token (a stop string, or its client left)."""
        seq.left = 0
        for running in (self._joining, self._prefilling, self._decoding):
            if seq in running:
                running.remove(seq)

    async def generate(
        self,
        seq_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        resume: Resume | None = None,
    ) -> AsyncIterator[TokenEvent]:
        seed = params.seed if params.seed is not None else f"{self.seed}:{seq_id}"
        rng = random.Random(f"{seed}:{len(prompt_ids)}")
        scanner = StopScanner(params.stop)
        before = 0 if resume is None else len(resume.token_ids)
        if before >= params.max_tokens:
            raise ValueError(f"a resumed sequence has made its {params.max_tokens} tokens")
        catch_up = None
        if resume is not None:  # the same words again, as the client got them
            replayed = "".join(scanner.feed(_word(rng, made))[0] for made in range(1, before + 1))
            catch_up = CatchUp(replayed, resume.text_chars)
        seq = _Sequence(params.max_tokens - before)
        self._join(seq)
        try:
            for made in range(before + 1, params.max_tokens + 1):
                await seq.tokens.get()
                text, stopped = scanner.feed(_word(rng, made))
                last = made == params.max_tokens
                if last and not stopped:
                    text += scanner.flush()
                if catch_up is not None:
                    text = catch_up(text)
                ids = range(made)  # (its tokens have no ids of their own: their positions)
                if stopped:
                    yield TokenEvent(text, made, "stop", ids)
                    return
                yield TokenEvent(text, made, "length" if last else None, ids)
        finally:
            self._leave(seq)


class _Sequence:
    """A running sequence as the simulated engine steps it."""

    __slots__ = ("left", "tokens")

    def __init__(self, left: int) -> None:
        self.left = left  # tokens still to make; 0: it has left the engine
        self.tokens: asyncio.Queue[None] = asyncio.Queue()  # one item per token made


def _word(rng: random.Random, made: int) -> str:
    """The ``made``-th token's text: a word, after a space but for the first."""
    return ("" if made == 1 else " ") + rng.choice(_WORDS)
