"""One worker's life: load the engine, warm it up, then serve; phases gate /readyz.

A worker whose engine died (its generation loop, or the embedding batch loop) is ``failed``
for good: ``/readyz`` answers 503 with the reason, what waits is answered 503
``engine_failed`` (what runs is failed by the engine, 502), new requests are refused, and
``on_fatal`` is called so that the process exits and its supervisor replaces it. A dead
engine never looks ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client import Counter

from tidegate.core.batching import BatchConfig
from tidegate.core.fairness import FairnessConfig
from tidegate.core.queue import AgingConfig, LevelSpec, QueueConfig
from tidegate.engines.base import EmbeddingEngine, Engine, GenerationEngine, SamplingParams
from tidegate.engines.steps import StepTally
from tidegate.errors import NotReady, ReplicaFailed
from tidegate.metrics import WorkerMetrics
from tidegate.worker.nvml_metrics import NvmlCollector, import_nvml, nvml_selector
from tidegate.worker.scheduling import EmbeddingBatcher, SequenceScheduler
from tidegate.worker.step_metrics import StepCollector

log = logging.getLogger("tidegate.worker")

# The worker holds only what it can batch soon: the gateway keeps the backlog. Its local
# queue orders by priority (no holdback: the gateway already decided admission); the
# generation queue also by tenant inside a level when fair sharing is on.
WORKER_LEVELS = (LevelSpec("high"), LevelSpec("medium"), LevelSpec("low"))


# A tenant as the gateway forwards it (X-Tidegate-Tenant) or a share names it
# (--tenant-share): printable ASCII without spaces, at most 128 characters.
MAX_TENANT_CHARS = 128
TENANT_RE = re.compile(rf"[!-~]{{1,{MAX_TENANT_CHARS}}}")

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
    # Adaptive batching (core.batching, core.batch_adapt), embeddings; each off by default.
    level_windows_ms: tuple[float | None, ...] = ()  # per worker level: high, medium, low
    load_aware_window: bool = False
    length_candidates: int = 0  # > 1: form batches of similar lengths among this many
    max_padding_ratio: float = 1.25
    # length-aware on cost: padding within (members - 1) x this; None: the ratio above
    batch_overhead_tokens: float | None = None
    target_p99_ms: float | None = None  # AIMD cap on the high level's P99; None: fixed
    min_batch_size: int = 1  # the AIMD cap's floor
    max_num_seqs: int = 16
    # Generation: a sequence joins the engine only while the prompts of those admitted and
    # not yet at their first token stay within this many tokens (one always joins); 0: no bound
    max_prefill_tokens: int = 0
    # Generation: fair sharing between tenants inside a level of the sequence queue (the
    # tenant the gateway forwards); None: first come, first served in a level
    fairness: FairnessConfig | None = None
    queue_max_size: int = 4096
    profile: str | None = None
    seed: int = 0
    warmup_tokens: int = 4
    memory_fraction: float | None = None  # CUDA: this process's cap on its device's memory
    probe_max_ms: float | None = None  # ready only once a probe request is this fast
    # Embeddings: the engine in a process of its own (engines/process.py), off this GIL;
    # None: the engine's default (DEFAULT_ENGINE_PROCESS: off for now).
    engine_process: bool | None = None
    # CPU: the engine's intra-op threads (torch.set_num_threads); None: the engine's default
    # (every core). On a host the gateway and workers share, fewer keep the engine steady.
    engine_threads: int | None = None

    def batch_config(self) -> BatchConfig:
        return BatchConfig(
            max_batch_size=self.max_batch_size,
            max_batch_tokens=self.max_batch_tokens,
            batch_window_ms=self.batch_window_ms,
            level_windows_ms=self.level_windows_ms,
            load_aware=self.load_aware_window,
            length_candidates=self.length_candidates,
            max_padding_ratio=self.max_padding_ratio,
            batch_overhead_tokens=self.batch_overhead_tokens,
            target_p99_ms=self.target_p99_ms,
            min_batch_size=min(self.min_batch_size, self.max_batch_size),
        )


@dataclass
class Worker:
    settings: WorkerSettings
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    engine: Engine | None = None
    batcher: EmbeddingBatcher | None = None
    sequences: SequenceScheduler | None = None
    # starting, loading, warming, probing, ready, draining; terminal: failed, stopping
    phase: str = "starting"
    error: str | None = None
    created_at: float = field(default_factory=time.monotonic)
    on_fatal: Callable[[], None] | None = None  # the engine died: the process should go
    engine_failures: Counter = field(init=False)
    load_nvml: Callable[[], Any] = import_nvml  # the NVML binding, for the GPU metrics
    gpu_metrics: NvmlCollector | None = field(init=False, default=None)  # on CUDA only
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.engine_failures = Counter(
            "tidegate_worker_engine_failures_total",
            "Engines that died under this worker (it then turns unready and exits).",
            ["model"],
            registry=self.metrics.registry,
        )
        # At 0 from the start, so that a rate over it exists before the first request.
        self.metrics.tokenize.labels(self.settings.model)
        self._export_gpu_metrics()

    def _export_gpu_metrics(self) -> None:
        """DCGM-named metrics of this worker's GPU, read from NVML at each scrape."""
        device = self.settings.device
        try:
            selector = nvml_selector(device, os.environ.get("CUDA_VISIBLE_DEVICES"))
        except ValueError as exc:
            log.warning("worker %s exports no GPU metrics: %s", self.settings.model, exc)
            return
        if selector is not None:
            self.gpu_metrics = NvmlCollector(self.settings.model, selector, self.load_nvml)
            self.metrics.registry.register(self.gpu_metrics)

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    def queue_config(self) -> QueueConfig:
        return QueueConfig(
            levels=WORKER_LEVELS,
            max_size=self.settings.queue_max_size,
            aging=AgingConfig(),
        )

    def sequence_queue_config(self) -> QueueConfig:
        """The generation queue's: ``queue_config`` with the settings' fair sharing."""
        return replace(self.queue_config(), fairness=self.settings.fairness)

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
            self._enter("warming")
            warm_started = time.monotonic()
            await self._warm_up(engine)
            warm_s = time.monotonic() - warm_started
            self._enter("probing")
            probe_s = await self._probe(engine)
        except Exception as exc:
            if self.phase != "failed":  # else fail() has told why already
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
        self._enter("ready")
        self.metrics.ready.labels(s.model).set(1)
        log.info(
            "worker %s ready: load %.2fs, warm-up %.2fs, %.2fs since start",
            s.model,
            load_s,
            warm_s,
            ready_s,
        )

    def _enter(self, phase: str) -> None:
        """Move on to the next start-up phase, unless the engine died meanwhile."""
        if self.phase == "failed":
            raise ReplicaFailed(f"{self.settings.model}: {self.error}")
        self.phase = phase

    def _attach(self, engine: Engine) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        engine.on_failure(lambda reason: self._engine_died(loop, reason))
        if engine.card.task == "embeddings":
            assert isinstance(engine, EmbeddingEngine)
            self.batcher = EmbeddingBatcher(
                engine, s.batch_config(), self.queue_config(), self.metrics
            )
            self.metrics.registry.register(StepCollector(s.model, self.batcher.steps))
            batcher = asyncio.create_task(self.batcher.run(), name="batcher")
            batcher.add_done_callback(self._batch_loop_ended)
            self._tasks.append(batcher)
        else:
            assert isinstance(engine, GenerationEngine)
            tally = getattr(engine, "steps", None)
            if isinstance(tally, StepTally):  # an engine that times its own steps
                self.metrics.registry.register(StepCollector(s.model, tally))
            self.sequences = SequenceScheduler(
                engine,
                s.max_num_seqs,
                self.sequence_queue_config(),
                self.metrics,
                max_prefill_tokens=s.max_prefill_tokens,
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

    def _engine_died(self, loop: asyncio.AbstractEventLoop, reason: str) -> None:
        """The engine's failure callback: any thread."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: this worker is gone
            loop.call_soon_threadsafe(self.fail, reason)

    def _batch_loop_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return  # stop() ended it
        exc = task.exception()
        if exc is None:
            self.fail("the embedding batch loop returned")
        else:
            self.fail(f"the embedding batch loop died: {type(exc).__name__}: {exc}", exc)

    def fail(self, reason: str, exc: BaseException | None = None) -> None:
        """The engine can serve nothing more: unready for good, answer what waits, exit.

        Idempotent; nothing once the worker is stopping.
        """
        if self.phase in ("failed", "stopping"):
            return
        model = self.settings.model
        self.phase = "failed"
        self.error = reason
        self.engine_failures.labels(model).inc()
        self.metrics.ready.labels(model).set(0)
        log.error("worker %s: engine failed, serving nothing more: %s", model, reason, exc_info=exc)
        error = NotReady(
            f"{model}: the engine of this replica failed; it is being replaced",
            code="engine_failed",
            retry_after_s=1.0,
        )
        for scheduler in (self.batcher, self.sequences):
            if scheduler is not None:
                scheduler.fail(error)
        if self.on_fatal is not None:
            self.on_fatal()

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
        if self.gpu_metrics is not None:
            self.gpu_metrics.close()
