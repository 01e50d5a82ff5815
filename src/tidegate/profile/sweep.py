"""The sweeps: which configurations are measured, in what order, and when a sweep stops.

Embeddings, with workers the planner starts (docs/profile.md, "How it measures"):

1. batch sweep: for B = 1, 2, 4 ... ``--max-batch``, a worker with ``--max-batch-size B``
   and 2*B requests in flight: one batch runs while the next waits full, as the gateway
   drives a replica (its default ``slots`` is 2 x max batch). The engine time of a batch
   comes from the worker's own /metrics: that is the batch latency of the curve.
2. window sweep, at the knee batch B*: a worker per ``--batch-windows-ms`` value, B*
   requests in flight, so that the window decides whether a batch leaves full or not.
3. concurrency sweep on a worker with B* and the chosen window: 1, 2, 4 ... 4*B* in flight
   (at most ``--max-concurrency``, which bounds this sweep only).

Generation: one worker with ``--max-num-seqs --max-batch``; concurrency 1, 2, 4 ...
``--max-concurrency`` (the running batch is the concurrency up to max_num_seqs).
``--through-gateway`` adds an open-loop point after the closed-loop levels, for either task
(profile/openloop.py).
``--url``: the server's batching cannot be set, only the concurrency sweep runs.

Each sweep climbs until core ``decide_climb`` stops it (SLO broken, or less than 5% gain
over 4 steps). ``stop`` (Ctrl-C, ``--max-duration-s``) ends everything at once; the points
measured so far stay in ``Planner.points``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from tidegate.core.capacity import StopClimbing, decide_climb
from tidegate.engines.profile import MeasuredPoint, load_profile
from tidegate.errors import ConfigError
from tidegate.profile.drift import Drift, drift_between
from tidegate.profile.gateway import (
    LocalStack,
    base_config,
    configured_window,
    find_worker,
    free_port,
    stack_config,
)
from tidegate.profile.loadgen import RequestStream, calibrate
from tidegate.profile.measure import MeasureSettings, PointRun, PointSpec, measure_point
from tidegate.profile.openloop import (
    TRIES,
    OpenLoopPoint,
    closed_loop_curve,
    embeddings_capacity,
    generation_capacity,
    measure_open_loop,
    point_line,
    spans_s,
)
from tidegate.profile.options import DEFAULT_WINDOW_MS, ProfileOptions
from tidegate.profile.recommend import SIZE_OF, capacity_point, sweep_knee
from tidegate.profile.resources import ResourceMeter
from tidegate.profile.server import LocalWorker, ServerInfo, server_info
from tidegate.profile.workload import (
    TextSizer,
    Workload,
    clip_workload,
    load_workload,
    synthetic_workload,
)
from tidegate.worker.runtime import WorkerSettings

log = logging.getLogger("tidegate.profile")
CONCURRENCY_SWEEP_BATCHES = 4  # the embeddings concurrency sweep goes up to 4 x B*


class Progress(Protocol):
    def planned(self, total: int) -> None: ...

    def begin(self, label: str) -> None: ...

    def window(self, num_windows: int) -> None: ...

    def done(self, point: MeasuredPoint | None) -> None: ...

    def note(self, text: str) -> None: ...


@dataclass
class Prepared:
    """What every point of a run shares, settled on the first server."""

    info: ServerInfo
    task: str
    workload: Workload
    requests: RequestStream
    sizer: TextSizer


@dataclass
class Planner:
    options: ProfileOptions
    progress: Progress
    stop: asyncio.Event
    points: list[MeasuredPoint] = field(default_factory=list)
    climb_stops: dict[str, str] = field(default_factory=dict)  # sweep -> why it stopped
    prepared: Prepared | None = None
    weights_mb: float | None = None
    open_loop: list[OpenLoopPoint] = field(default_factory=list)  # --through-gateway tries
    reference: MeasuredPoint | None = None  # --through-gateway: the top level, before (drift)
    drift: Drift | None = None  # the reference against the sweep's own point (profile/drift)
    _left: dict[str, int] = field(default_factory=dict)  # points still planned per sweep

    async def run(self, session: aiohttp.ClientSession) -> None:
        if self.options.through_gateway:
            await self._through_gateway(session)
            return
        if not self.options.local:
            assert self.options.url is not None
            await self._prepare(session, self.options.url)
            levels = self.options.concurrency_levels(self.options.max_concurrency)
            self._expect("concurrency", len(levels))
            await self._concurrency_sweep(session, self.options.url, None, None, levels)
            return
        task = self.expected_task()
        if task == "generate":
            await self._generate_sweep(session)
        else:
            await self._embeddings_sweeps(session)

    # ----------------------------------------------------------------- embeddings
    async def _embeddings_sweeps(self, session: aiohttp.ClientSession) -> None:
        o = self.options
        batches = o.batch_sizes()
        self._expect("batch", len(batches))
        self._expect("window", len(o.batch_windows_ms))
        self._expect("concurrency", len(batches) + 1)  # until the knee batch is known
        for index, batch in enumerate(batches):
            if self.stop.is_set():
                return
            spec = PointSpec("batch", 2 * batch, batch, DEFAULT_WINDOW_MS)
            async with self._worker(session, batch, DEFAULT_WINDOW_MS) as (url, meter):
                await self._measure(session, url, meter, spec)
            if self._stops_climbing("batch", batches[index + 1 :]):
                break
        best = self._knee_point("batch")
        if best is None or self.stop.is_set():
            return
        batch = best.batch_size or 1
        window = await self._window_sweep(session, batch)
        levels = o.concurrency_levels(CONCURRENCY_SWEEP_BATCHES * batch)
        self._expect("concurrency", len(levels))
        if self.stop.is_set():
            return
        async with self._worker(session, batch, window) as (url, meter):
            await self._concurrency_sweep(session, url, meter, (batch, window), levels)

    async def _window_sweep(self, session: aiohttp.ClientSession, batch: int) -> float:
        """The knee window at ``batch`` in flight; a batch of one has nothing to wait for."""
        if batch == 1:
            self.progress.note("batch 1: no window sweep (a batch of one never waits)")
            self._expect("window", 0)
            return 0.0
        for window in self.options.batch_windows_ms:
            if self.stop.is_set():
                break
            spec = PointSpec("window", batch, batch, window)
            async with self._worker(session, batch, window) as (url, meter):
                await self._measure(session, url, meter, spec)
        best = self._knee_point("window")
        return DEFAULT_WINDOW_MS if best is None else best.batch_window_ms or 0.0

    # ----------------------------------------------------------------- through the gateway
    async def _through_gateway(self, session: aiohttp.ClientSession) -> None:
        """Load through ``tidegate serve``, service times from its worker (profile/gateway.py)."""
        o = self.options
        if o.url is not None:
            stack = await find_worker(session, o.url, o.model)
            levels = o.concurrency_levels(o.max_concurrency)
            self._expect("concurrency", len(levels))
            meter = ResourceMeter(session, stack.worker_url, stack.worker_pid, o.device)
            try:
                await self._concurrency_sweep(session, stack.gateway_url, meter, None, levels)
            finally:
                meter.close()
            return
        task = self.expected_task()
        base = base_config(o.serve_config)
        if task == "generate":
            levels = o.concurrency_levels(o.max_concurrency)
            self._expect("concurrency", len(levels))
            async with self._stack(session, base, task, o.max_batch) as started:
                if started is not None:
                    url, meter = started
                    top = PointSpec("concurrency", levels[-1], o.max_batch, None)
                    await self._measure(session, url, meter, top, reference=True)
                    await self._concurrency_sweep(session, url, meter, (o.max_batch, None), levels)
                    self._check_drift()
                    if o.open_loop_fraction() > 0:
                        await self._open_loop(session, url, meter)
            return
        # One stack as deployed (max batch --max-batch, the config's window and slots); the
        # batches it forms at 1, 2, 4 ... 2 x max batch in flight span 1 to max batch. Every
        # level is measured: the curve needs the large batches an overload forms.
        levels = o.concurrency_levels(2 * o.max_batch)
        self._expect("concurrency", len(levels))
        window = configured_window(base, o.model)
        async with self._stack(session, base, task, o.max_batch) as started:
            if started is None:
                return
            top = PointSpec("concurrency", levels[-1], o.max_batch, window)
            await self._measure(session, started[0], started[1], top, reference=True)
            for level in levels:
                if self.stop.is_set():
                    return
                spec = PointSpec("concurrency", level, o.max_batch, window)
                await self._measure(session, started[0], started[1], spec)
            self._check_drift()
            if o.open_loop_fraction() > 0:
                await self._open_loop(session, started[0], started[1], window)

    async def _open_loop(
        self,
        session: aiohttp.ClientSession,
        url: str,
        meter: ResourceMeter,
        window_ms: float = DEFAULT_WINDOW_MS,
    ) -> None:
        """The open-loop point(s) after the closed-loop levels (profile/openloop.py)."""
        o = self.options
        generate = self.prepared is not None and self.prepared.task == "generate"
        if generate:
            found = generation_capacity(self.points, o.max_batch)
            curve, capacity, best = found if found is not None else (None, 0.0, 0.0)
        else:
            curve = closed_loop_curve(self.points)
            capacity, best = (
                (0.0, 0.0) if curve is None else embeddings_capacity(curve, o.max_batch, window_ms)
            )
        predicted = (
            f"what the simulator answers with the closed-loop curves when arrivals keep "
            f"coming; the closed loop's best was {best:.2f}"
        )
        if curve is None or self.prepared is None:
            self.progress.note("open loop: skipped, the closed loop measured no batch")
            return
        fraction = o.open_loop_fraction()
        for _ in range(TRIES):
            if self.stop.is_set() or capacity <= 0:
                return
            rate = fraction * capacity
            self.progress.note(
                f"open loop: Poisson arrivals at {rate:.2f} requests/s "
                f"({fraction:.0%} of {capacity:.2f}, {predicted})"
            )
            predicted = "the capacity the first try's factor corrects"
            point = await measure_open_loop(
                session,
                url,
                self.prepared.requests,
                meter,
                curve,
                rate,
                fraction,
                spans_s(rate, o.min_seconds_per_point, self.points),
                o.seed,
                self.stop,
                generate,
            )
            if point is None:
                return
            point = replace(point, capacity_rps=round(capacity, 3))
            self.open_loop.append(point)
            self.progress.note(f"open loop: {point_line(point)}")
            if point.kept_up or point.factor is None:
                return
            # Over capacity: once more, below what it managed and what the factor says.
            capacity = min(capacity / max(point.factor, 1.0), point.completed_rps)

    @contextlib.asynccontextmanager
    async def _stack(
        self, session: aiohttp.ClientSession, base: dict[str, Any], task: str, batch: int
    ) -> AsyncIterator[tuple[str, ResourceMeter] | None]:
        o = self.options
        config = stack_config(
            base,
            o.model,
            task,
            batch,
            engine=o.engine,
            sim_profile=o.sim_profile,
            model_path=o.model_path,
            device=o.device,
            port=free_port(),
        )
        self.progress.note(f"starting tidegate serve: batch {batch}")
        async with LocalStack.start(
            session, config, o.model, o.ready_timeout_s, self.stop
        ) as stack:
            if stack is None:
                yield None
                return
            meter = ResourceMeter(session, stack.worker_url, stack.worker_pid, o.device)
            try:
                first = await meter.snapshot()
                if first.counters is not None and first.counters.weights_mb is not None:
                    self.weights_mb = first.counters.weights_mb
                yield stack.gateway_url, meter
            finally:
                meter.close()

    # ----------------------------------------------------------------- generation
    async def _generate_sweep(self, session: aiohttp.ClientSession) -> None:
        levels = self.options.concurrency_levels(self.options.max_concurrency)
        self._expect("concurrency", len(levels))
        config = (self.options.max_batch, None)
        async with self._worker(session, self.options.max_batch, None) as (url, meter):
            await self._concurrency_sweep(session, url, meter, config, levels)

    # ----------------------------------------------------------------- shared steps
    async def _concurrency_sweep(
        self,
        session: aiohttp.ClientSession,
        url: str,
        meter: ResourceMeter | None,
        config: tuple[int, float | None] | None,
        levels: Sequence[int],
    ) -> None:
        batch, window = config if config is not None else (None, None)
        with contextlib.ExitStack() as stack:
            if meter is None:
                meter = ResourceMeter(session, url, None, self.options.device)
                stack.callback(meter.close)
            for index, level in enumerate(levels):
                if self.stop.is_set():
                    return
                spec = PointSpec("concurrency", level, batch, window)
                await self._measure(session, url, meter, spec)
                if self._stops_climbing("concurrency", levels[index + 1 :]):
                    return

    async def _measure(
        self,
        session: aiohttp.ClientSession,
        url: str,
        meter: ResourceMeter,
        spec: PointSpec,
        reference: bool = False,
    ) -> None:
        """One point of the sweep; ``reference``: the drift check's first measurement of the
        top level (profile/drift.py), kept apart from the sweep's points."""
        if self.stop.is_set():
            return
        prepared = self.prepared or await self._prepare(session, url)
        if reference:
            self._expect("drift", 1)
        label = spec.label()
        self.progress.begin(f"{label} (drift check, before the sweep)" if reference else label)
        run = PointRun(
            session,
            url,
            prepared.task,
            prepared.requests,
            meter,
            MeasureSettings(self.options.stability_rule(), self.options.window_s()),
            self.stop,
            self.progress.window,
        )
        point = await measure_point(run, spec)
        if reference:
            self.reference = point
            self._left["drift"] = 0
        else:
            if point is not None:
                self.points.append(point)
            self._left[spec.sweep] = max(0, self._left.get(spec.sweep, 1) - 1)
        self.progress.done(point)
        self._update_plan()

    def _check_drift(self) -> None:
        """The drift check's verdict, once the sweep has measured the top level again."""
        self.drift = drift_between(self.reference, self.points)
        if self.drift is not None:
            self.progress.note(f"drift check: {self.drift.sentence()}")

    def _stops_climbing(self, sweep: str, rest: Sequence[int]) -> bool:
        assert self.prepared is not None
        task = self.prepared.task
        mine = [p for p in self.points if p.sweep == sweep]
        size = SIZE_OF[sweep]
        decision = decide_climb([capacity_point(p, size(p), task) for p in mine], self.options.slo)
        if isinstance(decision, StopClimbing) and rest:
            self.climb_stops[sweep] = decision.detail
            self.progress.note(f"{sweep} sweep stops: {decision.detail}")
            self._expect(sweep, 0)
            return True
        return False

    def _knee_point(self, sweep: str) -> MeasuredPoint | None:
        assert self.prepared is not None
        knee = sweep_knee(self.points, sweep, self.options.slo, self.prepared.task)
        return None if knee is None else knee.point

    def _expect(self, sweep: str, num_points: int) -> None:
        """``num_points`` of ``sweep`` are still to come (for the progress bar's ETA)."""
        self._left[sweep] = num_points
        self._update_plan()

    def _update_plan(self) -> None:
        done = len(self.points) + (self.reference is not None)
        self.progress.planned(done + sum(self._left.values()))

    @contextlib.asynccontextmanager
    async def _worker(
        self, session: aiohttp.ClientSession, batch: int, window: float | None
    ) -> AsyncIterator[tuple[str, ResourceMeter]]:
        o = self.options
        settings = WorkerSettings(
            model=o.model,
            engine=o.engine,
            model_path=o.model_path,
            task=o.task,
            device=o.device,
            max_batch_size=batch,
            batch_window_ms=DEFAULT_WINDOW_MS if window is None else window,
            max_num_seqs=batch,
            profile=o.sim_profile,
            seed=o.seed,
        )
        label = f"batch {batch}" + ("" if window is None else f", window {window:g} ms")
        self.progress.note(f"starting a worker: {label}")
        async with LocalWorker.start(session, settings, o.ready_timeout_s, self.stop) as worker:
            meter = ResourceMeter(session, worker.url, worker.pid, o.device)
            try:
                first = await meter.snapshot()
                if first.counters is not None and first.counters.weights_mb is not None:
                    self.weights_mb = first.counters.weights_mb
                yield worker.url, meter
            finally:
                meter.close()

    def expected_task(self) -> str:
        """The task of the model, before any server answered (known models, --task, profile)."""
        from tidegate.engines.registry import known_models

        o = self.options
        if o.local and o.engine == "simulated" and o.sim_profile is not None:
            return load_profile(o.sim_profile).task
        known = known_models().get(o.model)
        return o.task or (known.task if known else "embeddings")

    async def _prepare(self, session: aiohttp.ClientSession, url: str) -> Prepared:
        """Ask the server what it serves, size the texts to its tokenizer, build the mix."""
        o = self.options
        info = await server_info(session, url, o.model)
        task = info.task or o.task
        if task is None:  # vLLM and others do not say; guessing would measure errors
            raise ConfigError(
                "<command line>",
                "task",
                f"{url} does not say whether {o.model} embeds or generates",
                "give --task embeddings or --task generate",
            )
        raw = (
            load_workload(o.workload, o.seed)
            if o.workload is not None
            else synthetic_workload(task, o.seed)
        )
        workload = clip_workload(raw, **self._limits(info, task))
        sizer = await calibrate(session, url, o.model, task, o.seed)
        requests = RequestStream(o.model, task, workload, sizer)
        self.prepared = Prepared(info, task, workload, requests, sizer)
        clipped = workload.details["clipping"]["num_clipped"]
        self.progress.note(
            f"workload: {workload.source}, {len(requests)} requests, mean input "
            f"{workload.describe()['input_tokens'].get('mean')} tokens ({clipped} clipped)"
        )
        return self.prepared

    def _limits(self, info: ServerInfo, task: str) -> dict[str, int]:
        context = info.max_model_len or 4096
        read = embedding_read_limit(self.options) if task == "embeddings" else None
        return {
            "max_input_tokens": min(context, read or context),
            "max_output_tokens": 0 if task == "embeddings" else self.options.max_output_tokens,
            "context_tokens": context,
        }


def embedding_read_limit(options: ProfileOptions) -> int | None:
    """Tokens a local sentence-transformers model reads (it truncates the rest); else None."""
    if not options.local or options.engine != "transformers":
        return None
    if options.model_path is not None:
        folder = Path(options.model_path)
    elif options.model == "minilm":
        from tidegate.engines.embeddings import minilm_path

        folder = minilm_path()
    else:
        return None
    config = folder / "sentence_bert_config.json"
    with contextlib.suppress(OSError, ValueError, TypeError):
        return int(json.loads(config.read_text())["max_seq_length"])
    return None
