"""The open-loop point of ``--through-gateway``: the engine's time when arrivals do not wait.

The through-gateway sweep is a closed loop: 1 to 2 x max batch requests in flight, each
client sending its next request only when its last one was answered, so the stack is never
offered more than it finishes and its queue stays short. Real traffic is an open loop:
requests keep arriving whatever the stack is doing. On a small machine that costs the engine
CPU the closed loop never saw (the gateway holds a queue of connections, the clients send
while a batch runs): on the 2-CPU machine of docs/benchmarks.md ("Fidelity") the engine
ran each batch 1.17-1.43x slower in an open loop near capacity than the closed-loop curve
said, so a load meant as 80% of capacity was past it on the real stack and the simulator,
fed the closed-loop curve, saw no queue where the stack had seconds of it.

So after the closed-loop levels, in the same ``tidegate serve``, the planner offers Poisson
arrivals at ``--open-loop`` (default 0.85) of the capacity the closed-loop curve predicts
(``spans_s``: a warm-up, then at least 10 s and 40 arrivals measured),
reads the worker's engine time per batch and mean batch over the measured span (its own
/metrics, as for every point), and divides by the closed-loop curve at that batch: the
*factor*. When the stack did not keep up (it completed under 95% of what was offered, or
refused some), the factor is an overloaded stack's: the point is measured once more at the
same fraction of the capacity the factor corrects.

The curve written to profile.json (what the simulator and the simulated engine replay) is the
closed-loop curve times a factor that grows linearly from 1 at batch 1 (a lone request: the
closed loop's own regime) to the measured factor at the open-loop point's mean batch, and
stays at it above: the slowdown comes with load, and load is what forms larger batches. The
closed-loop points, the knee and the recommended settings are unchanged; ``measured.open_loop``
in profile.json holds every open-loop try and the factor used.

Generation's factor is measured as its closed-loop curve was (``generation_curves``). Where
the worker reports its engine's own steps (``tidegate.engines.steps``), from them: the
span's decode steps (nobody joining) against the closed-loop curve, the engine's decode step
by sequences running, at each step's count. Without the table (another server), from the
client's side (``decoding_gaps``): every streamed token is one engine step of the sequences
decoding then, so each gap between two tokens of a request is set against the closed-loop
inter-token curve at the number of sequences decoding at the gap's middle (those between
their first and last token), leaving out the gaps of steps that also prefilled a joining
sequence. The factor is the sum of the measured steps or gaps over the sum of the curve's,
and the "batch" it is measured at is the mean of those counts; both curves the simulator
replays (time to first token and inter-token latency, by running sequences) are scaled by
it the same way. (The client's gaps and counts are the weaker measure: profiling the
simulated engine of a known profile, whose open loop decodes exactly as its closed loop,
they put the factor at 0.84, the engine's steps at about 1.)

What the client cannot see is the step that prefilled a joiner: its first token comes a step
later. So the point also reads the engine's own step table from the worker's /metrics
(``tidegate.engines.steps``): each step where prompts joined a decoding batch, less a decode
step of as many sequences in the same span, over its joiners, is ``join_ms``. The profile
writes the last try's with at least ``MIN_JOINS`` joiners as ``generate.join_ms``, the price
the simulator charges each joiner (engines/cost.py); a worker without the table (another
server, an engine that does not time its steps) leaves it out and the simulator prices a
join from the curves. The simulated engine keeps the table too: profiled through the
gateway, it gives back about the ``join_ms`` it was given (tests/profile).

The capacity the rate is a fraction of is what one replica answers when arrivals keep coming
(``tidegate.sim.saturation``: the simulator, fed the closed-loop curves, offered twice the
closed loop's best rate; ``embeddings_capacity``, ``generation_capacity``). For embeddings
it is at most the curve's best rate: past capacity a replica takes batches of max batch, not
the size cheapest per input (on the 2-CPU machine a batch of 32 cost 2.1-2.5x a batch of 16:
78-95% of the best rate). For generation it is below the closed loop's best throughput where
the closed loop's sequences joined an idle engine together and shared one prefill; arrivals
that do not wait join a decoding batch a few at a time and each pays its own
(engines/cost.py). On the 2-CPU machine, with curves from the clients' gaps, the closed loop's
best was about 1.4x what the real stack answered in an open loop, so a point aimed at 85% of
it was past capacity and had to be measured twice; with the engine's own steps the capacity
came out 0.91-0.94x the closed loop's best for smollm2 (1.78 and 1.96 requests/s), and about
the best for the simulated engine's 6-token chats, whose closed-loop clients drift out of
step and join decoding batches too.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from tidegate.engines.cost import ConcurrencySteps, CurveBatch
from tidegate.engines.profile import Curve, MeasuredPoint
from tidegate.engines.steps import StepTable
from tidegate.profile.loadgen import Completion, RequestSpec, RequestStream, send
from tidegate.profile.measure import percentile_ms
from tidegate.profile.resources import ResourceMeter, usage_between
from tidegate.sim.saturation import saturated_per_s
from tidegate.sim.service import ServiceModel

DEFAULT_FRACTION = 0.85  # of the open-loop capacity (module docstring)
KEPT_UP = 0.95  # completed / offered at or above this: the stack kept up
WARMUP_S = 3.0  # arrivals before the measured span, at least: the queue settles
WARMUP_LIFETIMES = 2.0  # ... and this many of the closed loop's longest p50 latency
MIN_DURATION_S = 10.0  # the measured span, at least
MIN_ARRIVALS = 40  # ... and long enough for this many arrivals (a slow generation stack)
DRAIN_S = 10.0  # what is in flight at the end may take this long, then is cut off
TRIES = 2  # the second only when the first did not keep up
MIN_JOINS = 20  # joiners a try's step table must hold for its join price to be written
CLIENT_CURVES = "mean TTFT and inter-token latency per concurrency"  # curve_source, no table
MIN_DECODE_STEPS = 20  # decode steps a try's table must hold for the factor to come from it


@dataclass(frozen=True, slots=True)
class OpenLoopPoint:
    """One open-loop run: what was offered, what the stack did, and the factor it implies."""

    fraction: float  # of the capacity the curve predicted when it started
    offered_rps: float  # arrivals per second in the measured span
    completed_rps: float  # answers (200) per second in the measured span
    num_refused: int  # non-200 answers and failed sends in the measured span
    latency_p50_ms: float  # from the arrival, answered requests of the measured span
    latency_p95_ms: float
    mean_batch_size: float | None  # the worker's, over the measured span
    batch_latency_ms: float | None  # the worker's mean engine time per batch, same span
    curve_ms: float | None  # the closed-loop curve at that mean batch (generation: mean gap)
    duration_s: float
    # Generation (module docstring): the mean number of sequences decoding at each of the
    # engine's decode steps (else each client token gap), and the mean step (gap) measured;
    # curve_ms is then the closed-loop curve's mean over the same steps (gaps).
    mean_running: float | None = None
    itl_mean_ms: float | None = None
    capacity_rps: float | None = None  # the capacity the rate was ``fraction`` of
    # Generation: what one prompt joining a decoding batch added to its step, from the
    # engine's own step table (tidegate.engines.steps), and over how many joiners.
    join_ms: float | None = None
    num_joins: int | None = None

    @property
    def kept_up(self) -> bool:
        return self.num_refused == 0 and self.completed_rps >= KEPT_UP * self.offered_rps

    @property
    def engine_ms(self) -> float | None:
        """The engine's time measured: per batch, or (generation) per token step."""
        return self.batch_latency_ms if self.batch_latency_ms is not None else self.itl_mean_ms

    @property
    def at_batch(self) -> float | None:
        """Where the factor was measured: the mean batch, or the mean sequences decoding."""
        return self.mean_batch_size if self.mean_batch_size is not None else self.mean_running

    @property
    def factor(self) -> float | None:
        """Engine time in the open loop over the closed loop's at the same batch."""
        engine_ms = self.engine_ms
        if engine_ms is None or not self.curve_ms:
            return None
        return engine_ms / self.curve_ms

    def describe(self) -> dict[str, Any]:
        data = {k: _rounded(v) for k, v in asdict(self).items()}
        factor = self.factor
        return data | {
            "kept_up": self.kept_up,
            "factor": None if factor is None else round(factor, 3),
        }


def _rounded(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


def closed_loop_curve(points: Sequence[MeasuredPoint]) -> Curve | None:
    """Engine time per batch against the mean batch formed, from the closed-loop points."""
    pairs = {
        round(p.mean_batch_size, 2): p.batch_latency_ms
        for p in points
        if p.mean_batch_size is not None and p.batch_latency_ms is not None and p.num_requests
    }
    return Curve.of(pairs) if pairs else None


def generation_curves(running: Sequence[MeasuredPoint]) -> tuple[Curve, Curve, str]:
    """The closed loop's time to first token and inter-token curves by sequences running, of
    ``running`` (closed-loop points with none queued, at least one), and where they came from.

    Where the worker reports its engine's own steps (``tidegate.engines.steps``), the curves
    are what the simulator charges a step, not what a client saw around it. The client's mean
    gap between tokens at ``c`` in flight is not a decode step of ``c``: the closed loop's
    clients drift out of step, so a prompt mostly joins a batch that is decoding, and the gaps
    of those steps carry its prefill (profiling the simulated engine of a known profile, the
    client's gaps came out 1.22x and 1.24x its decode steps at 2 and 4 in flight). The
    simulator charges joins apart (``generate.join_ms``), so ``itl(c)`` is then the engine's
    mean decode step of ``c``, and ``ttft(c)`` its mean step of ``c`` prompts joining an idle
    engine at once where the point ran such steps (at 1 in flight every step starts one),
    else the client's mean time to first token. Without the table (another server), both are
    the client's means."""
    if not all(p.decode_step_ms is not None for p in running):
        ttft = Curve.of({float(p.concurrency): p.ttft_mean_ms or 0.0 for p in running})
        itl = Curve.of({float(p.concurrency): p.itl_mean_ms or 0.0 for p in running})
        return ttft, itl, CLIENT_CURVES
    ttft = Curve.of(
        {
            float(p.concurrency): p.start_step_ms
            if p.start_step_ms is not None
            else p.ttft_mean_ms or 0.0
            for p in running
        }
    )
    itl = Curve.of({float(p.concurrency): p.decode_step_ms or 0.0 for p in running})
    started = sorted(p.concurrency for p in running if p.start_step_ms is not None)
    source = (
        "the engine's own mean decode step per sequences running (its step table); time to "
        "first token: its mean step of that many prompts joining an idle engine at "
        f"{', '.join(map(str, started)) or 'no point'}, the client's mean elsewhere"
    )
    return ttft, itl, source


def closed_loop_itl(points: Sequence[MeasuredPoint], max_seqs: int) -> tuple[Curve, float] | None:
    """Generation: the closed-loop inter-token curve by running sequences, and the best
    throughput (requests/s) measured with at most ``max_seqs`` in flight (all of them running)."""
    running = _running(points, max_seqs)
    if not running:
        return None
    return generation_curves(running)[1], max(p.throughput_rps for p in running)


def generation_capacity(
    points: Sequence[MeasuredPoint], max_seqs: int
) -> tuple[Curve, float, float] | None:
    """Generation: the closed-loop inter-token curve, the capacity under open-loop arrivals
    (requests/s, module docstring) and the closed loop's best throughput."""
    closed = closed_loop_itl(points, max_seqs)
    if closed is None:
        return None
    itl, best = closed
    running = [p for p in _running(points, max_seqs) if p.ttft_mean_ms is not None]
    if not running or best <= 0:
        return itl, best, best
    ttft, itl, _ = generation_curves(running)
    output = max(1, round(sum(p.mean_output_tokens for p in running) / len(running)))
    service = ServiceModel("closed loop", "generate", step=ConcurrencySteps(ttft, itl))
    capacity = saturated_per_s(service, max_seqs, 2 * best, output)
    return itl, (capacity or best), best


def embeddings_capacity(curve: Curve, max_batch: int, window_ms: float) -> tuple[float, float]:
    """Embeddings: the capacity under open-loop arrivals (requests/s: the simulator's replica
    past capacity runs batches of ``max_batch``, whatever size is cheapest per input) and the
    curve's best rate (``curve_capacity``)."""
    best = curve_capacity(curve, max_batch)
    if best <= 0:
        return best, best
    service = ServiceModel("closed loop", "embeddings", batch=CurveBatch(curve))
    capacity = saturated_per_s(service, max_batch, 2 * best, batch_window_ms=window_ms)
    return (capacity or best), best


def _running(points: Sequence[MeasuredPoint], max_seqs: int) -> list[MeasuredPoint]:
    """Closed-loop generation points with every sequence running (none queued)."""
    return [
        p
        for p in points
        if p.itl_mean_ms is not None and p.num_requests > 0 and p.concurrency <= max_seqs
    ]


def decoding_gaps(
    completions: Sequence[Completion], curve: Curve, since: float, until: float
) -> tuple[float, float, float] | None:
    """Over the decode-only token gaps whose middle falls in [since, until]: the mean number
    of sequences decoding then, the mean gap (ms) and the closed-loop ``curve``'s mean at
    those counts.

    A sequence decodes from its first token to its last, as the client stamped them; every
    answered stream counts, whenever it was sent, so the counts at the span's edges are whole.
    A gap whose step also prefilled a joining sequence (another stream's first token within
    half a gap of its end) is left out: the closed loop's sequences joined all at once and
    then only decoded, so its curve is decode steps, and the simulator costs the joins apart
    (engines/cost.py). The factor is then the decode steps' slowdown alone.
    """
    streams: list[list[float]] = []
    for c in completions:
        if c.ok and c.ttft_s is not None:
            first = c.done_at - c.latency_s + c.ttft_s
            streams.append(list(itertools.accumulate(c.gaps_s, initial=first)))
    starts = sorted(s[0] for s in streams)
    ends = sorted(s[-1] for s in streams)
    counts = measured = expected = 0.0
    num_gaps = 0
    for stamps in streams:
        for earlier, later in itertools.pairwise(stamps):
            middle = (earlier + later) / 2
            if not since <= middle <= until:
                continue
            half = (later - earlier) / 2
            if bisect.bisect_right(starts, later + half) > bisect.bisect_right(starts, middle):
                continue  # a join's step: someone's first token came with this one
            # started by the middle, less those that ended before it (never the stream itself)
            running = bisect.bisect_right(starts, middle) - bisect.bisect_left(ends, middle)
            counts += running
            measured += later - earlier
            expected += curve(running)
            num_gaps += 1
    if not num_gaps or expected <= 0:
        return None
    return counts / num_gaps, 1e3 * measured / num_gaps, expected / num_gaps


def decode_steps(
    window: StepTable, curve: Curve, least: int = MIN_DECODE_STEPS
) -> tuple[float, float, float] | None:
    """Over the engine's decode steps of ``window``: the mean number of sequences running,
    the mean step (ms) and the closed-loop ``curve``'s mean at those counts; None with fewer
    than ``least`` of them."""
    steps = counts = measured_s = expected_ms = 0.0
    for (kind, running), cell in window.items():
        if kind == "decode":
            steps += cell.num_steps
            counts += running * cell.num_steps
            measured_s += cell.seconds
            expected_ms += curve(running) * cell.num_steps
    if steps < least or expected_ms <= 0:
        return None
    return counts / steps, 1e3 * measured_s / steps, expected_ms / steps


def spans_s(
    rate_per_s: float, min_seconds: float, points: Sequence[MeasuredPoint]
) -> tuple[float, float]:
    """The warm-up and the measured span of an open-loop point at ``rate_per_s``.

    The warm-up lasts a few of the requests' own lifetimes (chats take seconds), so that the
    stack holds what the rate keeps in it; the span holds at least ``MIN_ARRIVALS`` arrivals,
    so that a slow stack's offered rate is not a handful of Poisson draws.
    """
    lifetime_s = max((p.latency_p50_ms / 1e3 for p in points if p.num_requests), default=0.0)
    warmup_s = max(WARMUP_S, WARMUP_LIFETIMES * lifetime_s)
    return warmup_s, max(MIN_DURATION_S, min_seconds, MIN_ARRIVALS / max(rate_per_s, 1e-9))


def curve_capacity(curve: Curve, max_batch: int) -> float:
    """Requests per second at best, batches of 1 to ``max_batch`` back to back."""
    rates = [n / (curve(n) / 1e3) for n in range(1, max_batch + 1) if curve(n) > 0]
    return max(rates, default=0.0)


def calibrated_curve(curve: Curve, mean_batch: float, factor: float) -> Curve:
    """``curve`` times a factor rising linearly from 1 at batch 1 to ``factor`` at
    ``mean_batch``, and ``factor`` above it (see the module docstring)."""

    def scale(x: float) -> float:
        if mean_batch <= 1.0 or x >= mean_batch:
            return factor
        return 1.0 + (factor - 1.0) * max(0.0, x - 1.0) / (mean_batch - 1.0)

    ys = tuple(round(y * scale(x), 3) for x, y in zip(curve.xs, curve.ys, strict=True))
    return Curve(curve.xs, ys)


async def measure_open_loop(
    session: aiohttp.ClientSession,
    url: str,
    requests: RequestStream,
    meter: ResourceMeter,
    curve: Curve,
    rate_per_s: float,
    fraction: float,
    spans: tuple[float, float],
    seed: int,
    stop: asyncio.Event,
    generate: bool = False,
) -> OpenLoopPoint | None:
    """Poisson arrivals at ``rate_per_s`` for ``spans`` (a warm-up and the measured span,
    seconds: ``spans_s``); None if stopped.

    ``curve``: the closed-loop engine time per batch by mean batch, or with ``generate`` the
    inter-token latency by sequences running (module docstring)."""
    draw = random.Random(f"{seed}:open-loop:{rate_per_s:.6f}")
    url = url.rstrip("/")
    answered: list[tuple[float, Completion]] = []  # (arrival, completion)
    in_flight: set[asyncio.Task[None]] = set()

    async def one(spec: RequestSpec, arrival: float) -> None:
        answered.append((arrival, await send(session, url, spec)))

    started = time.monotonic()
    warmup_s, duration_s = spans
    span_from, span_to = started + warmup_s, started + warmup_s + duration_s

    async def arrivals() -> int:
        at, sent = started, 0
        while at < span_to and not stop.is_set():
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(requests.next(), at))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            if at >= span_from:
                sent += 1
            at += draw.expovariate(rate_per_s)
        return sent

    sender = asyncio.create_task(arrivals())
    try:
        await asyncio.sleep(max(0.0, span_from - time.monotonic()))
        first = await meter.snapshot()
        await asyncio.sleep(max(0.0, span_to - time.monotonic()))
        last = await meter.snapshot()
        sent = await sender
    finally:
        sender.cancel()
        if in_flight and not stop.is_set():
            await asyncio.wait(set(in_flight), timeout=DRAIN_S)
        for task in list(in_flight):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*in_flight, return_exceptions=True)
    if stop.is_set():
        return None
    span = max(1e-9, last.at - first.at)
    usage = usage_between(first, last)
    inside = [(a, c) for a, c in answered if first.at <= c.done_at <= last.at]
    ok_latencies = [c.done_at - a for a, c in inside if c.ok]
    refused = sum(not c.ok for a, c in answered if a >= span_from)
    mean_batch, batch_ms = usage.mean_batch_size, usage.batch_latency_ms
    curve_ms = None if mean_batch is None else curve(mean_batch)
    running = itl_ms = join_ms = num_joins = None
    if generate:  # the client's token stamps, not the worker's batches (module docstring)
        gaps = decode_steps(usage.steps, curve) or decoding_gaps(
            [c for _, c in answered], curve, first.at, last.at
        )
        mean_batch = batch_ms = None
        running, itl_ms, curve_ms = gaps if gaps is not None else (None, None, None)
        if usage.join is not None:
            join_ms, num_joins = usage.join.join_ms, usage.join.num_joins
    return OpenLoopPoint(
        fraction=fraction,
        offered_rps=sent / duration_s,
        completed_rps=len(ok_latencies) / span,
        num_refused=refused,
        latency_p50_ms=percentile_ms(ok_latencies, 50),
        latency_p95_ms=percentile_ms(ok_latencies, 95),
        mean_batch_size=mean_batch,
        batch_latency_ms=batch_ms,
        curve_ms=curve_ms,
        duration_s=span,
        mean_running=running,
        itl_mean_ms=itl_ms,
        join_ms=join_ms,
        num_joins=num_joins,
    )


def chosen(tries: Sequence[OpenLoopPoint]) -> OpenLoopPoint | None:
    """The try whose factor calibrates the curve: the last one with a factor."""
    return next((t for t in reversed(tries) if t.factor is not None), None)


def measured_join(tries: Sequence[OpenLoopPoint]) -> OpenLoopPoint | None:
    """The try whose join price the profile keeps: the last one with ``MIN_JOINS``."""
    return next(
        (t for t in reversed(tries) if t.join_ms is not None and (t.num_joins or 0) >= MIN_JOINS),
        None,
    )


def sustained_rps(tries: Sequence[OpenLoopPoint]) -> float | None:
    """What one replica sustains when arrivals keep coming, per the calibrated curves: the
    simulator's capacity of the closed-loop curves (the first try's ``capacity_rps``) over the
    chosen try's factor. Past capacity a replica runs batches of max batch (max_num_seqs),
    above the mean batch the factor was measured at, where the calibrated curve is the closed
    loop's times the factor, so its capacity is the closed loop's divided by it. None without
    an open-loop point."""
    point = chosen(tries)
    first = tries[0].capacity_rps if tries else None
    if point is None or point.factor is None or not first or point.factor <= 0:
        return None
    return first / point.factor


def point_line(point: OpenLoopPoint) -> str:
    factor = point.factor
    parts = [
        f"{point.offered_rps:.2f} offered, {point.completed_rps:.2f} answered req/s",
        f"p95 {point.latency_p95_ms:.0f} ms",
    ]
    if point.num_refused:
        parts.append(f"{point.num_refused} refused")
    if point.mean_batch_size is not None and point.batch_latency_ms is not None:
        parts.append(
            f"mean batch {point.mean_batch_size:.1f}, {point.batch_latency_ms:.1f} ms per batch"
            f" (closed loop {point.curve_ms or 0:.1f} ms)"
        )
    if point.mean_running is not None and point.itl_mean_ms is not None:
        parts.append(
            f"{point.mean_running:.1f} sequences decoding, {point.itl_mean_ms:.1f} ms between"
            f" tokens (closed loop {point.curve_ms or 0:.1f} ms)"
        )
    if point.join_ms is not None:
        parts.append(
            f"a prompt joining a decoding batch {point.join_ms:.0f} ms ({point.num_joins} joins)"
        )
    if factor is not None:
        parts.append(f"factor {factor:.2f}")
    parts.append("kept up" if point.kept_up else "did NOT keep up")
    return ", ".join(parts)
