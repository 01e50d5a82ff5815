"""One worker's life: load the engine, warm it up, then serve; phases gate /readyz."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tidegate.core.batching import BatchConfig
from tidegate.core.queue import AgingConfig, LevelSpec, QueueConfig
from tidegate.engines.base import EmbeddingEngine, Engine, GenerationEngine, SamplingParams
from tidegate.errors import NotReady
from tidegate.metrics import WorkerMetrics
from tidegate.worker.scheduling import EmbeddingBatcher, SequenceScheduler

log = logging.getLogger("tidegate.worker")

# The worker holds only what it can batch soon: the gateway keeps the backlog. Its local
# queue orders by priority (no holdback: the gateway already decided admission).
WORKER_LEVELS = (LevelSpec("high"), LevelSpec("medium"), LevelSpec("low"))


PROBE_ATTEMPTS = 5  # slow probes before the worker gives up starting
PROBE_RETRY_S = 0.5


@dataclass(frozen=True)
class WorkerSettings:
    model: str
    engine: str = "transformers"
    model_path: str | None = None
    task: str | None = None
    device: str = "cpu"
    max_batch_size: int = 32
    batch_window_ms: float = 5.0
    max_batch_tokens: int | None = None
    max_num_seqs: int = 16
    queue_max_size: int = 4096
    profile: str | None = None
    seed: int = 0
    warmup_tokens: int = 4
    memory_fraction: float | None = None  # CUDA: this process's cap on its device's memory
    probe_max_ms: float | None = None  # ready only once a probe request is this fast


@dataclass
class Worker:
    settings: WorkerSettings
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    engine: Engine | None = None
    batcher: EmbeddingBatcher | None = None
    sequences: SequenceScheduler | None = None
    phase: str = "starting"  # starting, loading, warming, ready, draining, failed, stopping
    error: str | None = None
    created_at: float = field(default_factory=time.monotonic)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    def queue_config(self) -> QueueConfig:
        return QueueConfig(
            levels=WORKER_LEVELS,
            max_size=self.settings.queue_max_size,
            aging=AgingConfig(),
        )

    async def start(self, build: Callable[[WorkerSettings], Engine]) -> None:
        """Load and warm up; on failure the phase says why and the caller decides."""
        s = self.settings
        try:
            self.phase = "loading"
            load_started = time.monotonic()
            engine = build(s)
            await asyncio.to_thread(engine.load)
            self.engine = engine
            load_s = time.monotonic() - load_started
            self._attach(engine)
            self.phase = "warming"
            warm_started = time.monotonic()
            await self._warm_up(engine)
            warm_s = time.monotonic() - warm_started
            self.phase = "probing"
            probe_s = await self._probe(engine)
        except Exception as exc:
            self.phase = "failed"
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("worker %s failed to start", s.model)
            raise
        ready_s = time.monotonic() - self.created_at
        labels = self.metrics.startup
        labels.labels(s.model, "load").set(load_s)
        labels.labels(s.model, "warmup").set(warm_s)
        labels.labels(s.model, "probe").set(probe_s)
        labels.labels(s.model, "ready").set(ready_s)
        memory = engine.memory()
        self.metrics.memory.labels(s.model, memory.device, "weights").set(memory.weights_bytes)
        self.metrics.memory.labels(s.model, memory.device, "peak").set(memory.peak_bytes)
        self.metrics.ready.labels(s.model).set(1)
        self.phase = "ready"
        log.info(
            "worker %s ready: load %.2fs, warm-up %.2fs, %.2fs since start",
            s.model,
            load_s,
            warm_s,
            ready_s,
        )

    def _attach(self, engine: Engine) -> None:
        s = self.settings
        if engine.card.task == "embeddings":
            assert isinstance(engine, EmbeddingEngine)
            batch = BatchConfig(s.max_batch_size, s.max_batch_tokens, s.batch_window_ms)
            self.batcher = EmbeddingBatcher(engine, batch, self.queue_config(), self.metrics)
            self._tasks.append(asyncio.create_task(self.batcher.run(), name="batcher"))
        else:
            assert isinstance(engine, GenerationEngine)
            self.sequences = SequenceScheduler(
                engine, s.max_num_seqs, self.queue_config(), self.metrics
            )

    async def _probe(self, engine: Engine) -> float:
        """Time one request as a client would send it; ready only when it is fast enough.

        With ``probe_max_ms`` set, a replica whose probe is slower (a GPU shared with a
        noisy neighbour, a CPU starved by others) tries again a few times, then fails to
        start: the orchestrator restarts it after a back-off instead of routing to it.
        """
        limit_ms = self.settings.probe_max_ms
        took_s = 0.0
        for attempt in range(PROBE_ATTEMPTS):
            started = time.monotonic()
            if isinstance(engine, EmbeddingEngine):
                await engine.embed(["readiness probe"])
            else:
                assert isinstance(engine, GenerationEngine)
                params = SamplingParams(max_tokens=1, temperature=0.0)
                async for _ in engine.generate(f"probe-{attempt}", engine.encode("probe"), params):
                    pass
            took_s = time.monotonic() - started
            if limit_ms is None or took_s * 1000 <= limit_ms:
                return took_s
            log.warning(
                "worker %s: probe %d took %.0f ms > %.0f ms",
                self.settings.model,
                attempt + 1,
                took_s * 1000,
                limit_ms,
            )
            await asyncio.sleep(PROBE_RETRY_S)
        raise RuntimeError(
            f"readiness probe took {took_s * 1000:.0f} ms, over probe_max_ms={limit_ms:g} "
            f"{PROBE_ATTEMPTS} times"
        )

    async def _warm_up(self, engine: Engine) -> None:
        """Every batch size up to the max (embeddings), or a short generation."""
        if isinstance(engine, EmbeddingEngine):
            size = 1
            while True:
                await engine.embed(["warm-up sentence for the batch path"] * size)
                if size >= self.settings.max_batch_size:
                    break
                size = min(size * 2, self.settings.max_batch_size)
            return
        assert isinstance(engine, GenerationEngine)
        params = SamplingParams(max_tokens=self.settings.warmup_tokens, temperature=0.0)
        prompt = engine.encode("warm-up")

        # Several sequences at once, so the engine's batched path is warm too.
        async def one(index: int) -> None:
            async for _ in engine.generate(f"warmup-{index}", prompt, params):
                pass

        await asyncio.gather(*(one(i) for i in range(min(4, self.settings.max_num_seqs))))

    def drain(self) -> int:
        """Stop taking requests (``/readyz`` 503 ``draining``); return the waiting ones."""
        if self.phase in ("ready", "draining"):
            self.phase = "draining"
        error = NotReady(
            f"{self.settings.model}: this replica is draining", code="draining", retry_after_s=1.0
        )
        returned = 0
        for scheduler in (self.batcher, self.sequences):
            if scheduler is not None:
                returned += scheduler.drain(error)
        return returned

    async def stop(self) -> None:
        self.phase = "stopping"
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)
