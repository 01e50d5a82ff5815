"""Simulated engines: the latency and memory of a profile, no model.

Used by tests that need many replicas, by load tests of the gateway and by the simulator.
Outputs are deterministic: the same seed and input give the same vectors and tokens. A
batch of embeddings takes ``batch_latency_ms(batch size)``; a sequence waits
``ttft_ms(running)`` for its first token and ``itl_ms(running)`` for each next one, where
``running`` is the number of sequences generating at that moment.
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
from tidegate.engines.profile import EngineProfile
from tidegate.engines.text import CatchUp, StopScanner

_WORDS = (
    "tide gate harbour vessel current anchor lantern signal river delta channel beacon "
    "pier quay buoy ledger cargo dock crane hull mast keel rudder sail"
).split()
_MB = 1024 * 1024


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
        await asyncio.sleep(self.batch_latency_s(len(texts)))
        return self._vectors(texts)

    def embed_sync(self, texts: list[str]) -> Vectors:
        """One batch on the calling thread (in an engine process of its own)."""
        time.sleep(self.batch_latency_s(len(texts)))
        return self._vectors(texts)

    def _vectors(self, texts: Sequence[str]) -> Vectors:
        vectors = np.empty((len(texts), self.card.dimensions), dtype=np.float32)
        for row, text in enumerate(texts):
            digest = hashlib.blake2b(f"{self.seed}:{text}".encode(), digest_size=8).digest()
            rng = random.Random(int.from_bytes(digest, "big"))
            values = [rng.gauss(0.0, 1.0) for _ in range(self.card.dimensions)]
            norm = math.sqrt(sum(v * v for v in values)) or 1.0
            vectors[row] = [v / norm for v in values]
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
        self._ttft = profile.ttft_ms
        self._itl = profile.itl_ms
        self.num_running = 0

    def load(self) -> None:
        """Nothing to load."""

    def close(self) -> None:
        """Nothing to release."""

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """No loop of its own: it never dies on its own."""

    def memory(self) -> MemoryReport:
        return _memory(self.profile)

    def encode(self, prompt: str) -> list[int]:
        return list(range(_approx_tokens(prompt)))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        text = "".join(f"{m['role']}\n{m['content']}\n" for m in messages) + "assistant\n"
        return self.encode(text)

    def ttft_s(self, running: int) -> float:
        return self._ttft(running) / 1e3

    def itl_s(self, running: int) -> float:
        return self._itl(running) / 1e3

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
        self.num_running += 1
        try:
            await asyncio.sleep(self.ttft_s(self.num_running))
            for made in range(before + 1, params.max_tokens + 1):
                if made > before + 1:
                    await asyncio.sleep(self.itl_s(self.num_running))
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
            self.num_running -= 1


def _word(rng: random.Random, made: int) -> str:
    """The ``made``-th token's text: a word, after a space but for the first."""
    return ("" if made == 1 else " ") + rng.choice(_WORDS)
