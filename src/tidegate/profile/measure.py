"""One point: a fixed configuration under a closed loop, measured in windows until stable.

The load generator starts, then windows of ``window_s`` follow one another; a window that
has seen fewer than ``min_completions`` answers is stretched until it has (slow points, e.g.
long generations at concurrency 1, would otherwise have windows too thin for a p95). After
each window core ``decide_point`` says whether the last three agree within 10% on
throughput and p95 and ``min_seconds`` have passed (stable), whether ``max_seconds`` have
passed (unstable: kept and flagged), or whether to measure another. The first windows are
the warm-up of the point: they only count if they already agree with the later ones.

The point's figures come from the last three windows together (the ones that agreed):
percentiles over all their requests, CPU and batch counters over their span, throughput by
Little's law (``closed_loop_rate``). Peak memory is
the highest seen during the whole point. For generation the stability test uses output
tokens/s and the time-to-first-token p95 instead of requests/s and the end-to-end p95: both
end-to-end latency and requests/s swing with the output lengths that happen to finish in a
window, and the tail of the gaps between tokens is mostly scheduling noise.

Stop (Ctrl-C or ``--max-duration-s``) cuts the point at once: what its finished windows
saw is summarised and flagged unstable, so that nothing measured is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from tidegate.core.capacity import PointVerdict, StabilityRule, WindowStats, decide_point
from tidegate.engines.profile import MeasuredPoint
from tidegate.engines.steps import mean_step_ms
from tidegate.profile.loadgen import Completion, LoadGenerator, Recorder, RequestStream
from tidegate.profile.resources import ResourceMeter, Snapshot, usage_between

DRAIN_S = 10.0  # the longest the requests in flight at the end of a point may take


@dataclass(frozen=True, slots=True)
class PointSpec:
    sweep: str  # "batch", "window" or "concurrency"
    concurrency: int
    batch_size: int | None = None  # of the worker; None: not set by the planner (--url)
    batch_window_ms: float | None = None

    def label(self) -> str:
        return config_label(self.batch_size, self.batch_window_ms, self.concurrency)


def config_label(batch_size: int | None, batch_window_ms: float | None, concurrency: int) -> str:
    """ "batch 8, window 5 ms, 16 in flight"; a generation worker has max_num_seqs, no window."""
    parts = []
    if batch_size is not None:
        kind = "batch" if batch_window_ms is not None else "max_num_seqs"
        parts.append(f"{kind} {batch_size}")
    if batch_window_ms is not None:
        parts.append(f"window {batch_window_ms:g} ms")
    parts.append(f"{concurrency} in flight")
    return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class MeasureSettings:
    rule: StabilityRule
    window_s: float
    min_completions: int = 10  # per window


@dataclass(slots=True)
class Window:
    start: Snapshot
    end: Snapshot
    completions: list[Completion] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return max(1e-9, self.end.at - self.start.at)

    def stats(self, task: str, concurrency: int) -> WindowStats:
        ok = [c for c in self.completions if c.ok]
        rate = closed_loop_rate(self.completions, concurrency)
        if task == "generate":
            tokens = rate * sum(c.output_tokens for c in ok)
            ttfts = [c.ttft_s for c in ok if c.ttft_s is not None]
            return WindowStats(tokens, _p95_ms(ttfts), self.duration_s)
        return WindowStats(rate * len(ok), _p95_ms([c.latency_s for c in ok]), self.duration_s)


def closed_loop_rate(completions: Sequence[Completion], concurrency: int) -> float:
    """Per second, what one completion stands for: ``rate * count`` is a throughput.

    Little's law for a closed loop: ``concurrency`` clients each take a mean cycle to complete
    one request, so together they complete ``concurrency / mean cycle`` per second. Counting
    the completions inside a window instead would be off by a whole batch whenever a batch's
    answers fall just before or after the window's edge (a 1.5 s window holding 9 or 10
    batches of 8 reads 47 or 53 req/s).
    """
    total_s = sum(c.cycle_s for c in completions)
    return concurrency / total_s if total_s > 0 else 0.0


def percentile_ms(seconds: Sequence[float], q: float, empty: float = math.nan) -> float:
    """Percentile ``q`` of durations in seconds, in milliseconds; ``empty`` when none."""
    return float(np.percentile(seconds, q)) * 1e3 if seconds else empty


def _p95_ms(seconds: Sequence[float]) -> float:
    return percentile_ms(seconds, 95, math.inf)


@dataclass
class PointRun:
    """Everything one point needs to run."""

    session: aiohttp.ClientSession
    url: str
    task: str
    requests: RequestStream
    meter: ResourceMeter
    settings: MeasureSettings
    stop: asyncio.Event  # set: cut the point short (Ctrl-C, out of time)
    on_window: Callable[[int], None] = lambda num_windows: None


async def measure_point(run: PointRun, spec: PointSpec) -> MeasuredPoint | None:
    """Measure until stable or out of time; None when not even one window finished."""
    recorder = Recorder()
    generator = LoadGenerator(run.session, run.url, run.requests, spec.concurrency, recorder)
    rule = run.settings.rule
    windows: list[Window] = []
    stable = False
    started = time.monotonic()
    generator.start()
    try:
        start = await run.meter.snapshot()
        recorder.cut()
        while True:
            cut_short = await _fill_window(run, recorder, started + rule.max_seconds)
            completions = recorder.cut()
            end = await run.meter.snapshot()
            windows.append(Window(start, end, completions))
            start = end
            run.on_window(len(windows))
            if cut_short:
                break
            stats = [w.stats(run.task, spec.concurrency) for w in windows]
            verdict = decide_point(stats, end.at - started, rule)
            if verdict is not PointVerdict.MEASURE:
                stable = verdict is PointVerdict.STABLE
                break
    finally:
        # Interrupted: cut off at once. Otherwise let what is in flight finish.
        await generator.stop(0.0 if run.stop.is_set() else DRAIN_S)
    if not windows:
        return None
    return summarize(spec, windows, stable, run.task, rule.num_windows)


async def _fill_window(run: PointRun, recorder: Recorder, deadline: float) -> bool:
    """Wait out one window; True when the point must stop now."""
    if await _stopped_within(run.stop, asyncio.sleep(run.settings.window_s), None):
        return True
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return False
    wanted = recorder.wait_for(run.settings.min_completions)
    return await _stopped_within(run.stop, wanted, remaining)


async def _stopped_within(
    stop: asyncio.Event, awaitable: Awaitable[object], timeout_s: float | None
) -> bool:
    """Await ``awaitable`` (at most ``timeout_s``) unless ``stop`` is set first."""
    stopper = asyncio.ensure_future(stop.wait())
    other = asyncio.ensure_future(awaitable)
    _, pending = await asyncio.wait(
        {stopper, other}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
    )
    for task in pending:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*pending)
    return stop.is_set()


def summarize(
    spec: PointSpec, windows: Sequence[Window], stable: bool, task: str, num_counted: int = 3
) -> MeasuredPoint:
    """The point's figures from its last ``num_counted`` windows (see the module docstring)."""
    counted = windows[-num_counted:]
    done = [c for w in counted for c in w.completions]
    ok = [c for c in done if c.ok]
    duration = max(1e-9, counted[-1].end.at - counted[0].start.at)
    rate = closed_loop_rate(done, spec.concurrency)
    usage = usage_between(counted[0].start, counted[-1].end)
    latency = _percentiles_ms([c.latency_s for c in ok])
    output_tokens = sum(c.output_tokens for c in ok)
    input_tokens = sum(c.input_tokens for c in ok)
    ttft = _percentiles_ms([c.ttft_s for c in ok if c.ttft_s is not None])
    itl = _percentiles_ms([gap for c in ok for gap in c.gaps_s])
    memory = [w.end.memory_mb for w in windows if w.end.memory_mb is not None]
    generate = task == "generate"
    return MeasuredPoint(
        sweep=spec.sweep,
        concurrency=spec.concurrency,
        batch_size=spec.batch_size,
        batch_window_ms=spec.batch_window_ms,
        throughput_rps=_round(rate * len(ok)),
        tokens_per_s=_round(rate * (output_tokens if generate else input_tokens)),
        latency_p50_ms=latency[0],
        latency_p95_ms=latency[1],
        latency_p99_ms=latency[2],
        ttft_p50_ms=ttft[0] if generate else None,
        ttft_p95_ms=ttft[1] if generate else None,
        ttft_p99_ms=ttft[2] if generate else None,
        ttft_mean_ms=ttft[3] if generate else None,
        itl_p50_ms=itl[0] if generate else None,
        itl_p95_ms=itl[1] if generate else None,
        itl_p99_ms=itl[2] if generate else None,
        itl_mean_ms=itl[3] if generate else None,
        batch_latency_ms=_maybe_round(usage.batch_latency_ms),
        mean_batch_size=_maybe_round(usage.mean_batch_size),
        decode_step_ms=_maybe_round(mean_step_ms(usage.steps, "decode", spec.concurrency, 3)),
        start_step_ms=_maybe_round(mean_step_ms(usage.steps, "start", spec.concurrency, 3)),
        mean_input_tokens=_round(input_tokens / len(ok)) if ok else 0.0,
        mean_output_tokens=_round(output_tokens / len(ok)) if ok else 0.0,
        peak_memory_mb=_round(max(memory)) if memory else None,
        worker_cpu_cores=_maybe_round(usage.worker_cpu_cores),
        loadgen_cpu_cores=_maybe_round(usage.loadgen_cpu_cores),
        other_cpu_cores=_maybe_round(usage.other_cpu_cores),
        num_requests=len(ok),
        num_errors=len(done) - len(ok),
        duration_s=_round(duration),
        num_windows=len(windows),
        stable=stable,
    )


def _percentiles_ms(seconds: Sequence[float]) -> tuple[float, float, float, float]:
    """p50, p95, p99 and the mean, in ms; zeros when there is nothing."""
    if not seconds:
        return 0.0, 0.0, 0.0, 0.0
    array = np.asarray(seconds) * 1e3
    p50, p95, p99 = np.percentile(array, [50, 95, 99])
    return _round(p50), _round(p95), _round(p99), _round(array.mean())


def _round(value: float) -> float:
    return round(float(value), 3)


def _maybe_round(value: float | None) -> float | None:
    return None if value is None else _round(value)
