"""From measured points to the operating point and the settings of ``recommended.yaml``.

Each sweep has its own knee (core ``find_knee``; the configuration's size is what the sweep
varies): the batch sweep chooses ``max_batch_size``, the window sweep ``batch_window_ms``
and the concurrency sweep the requests in flight per replica, which become ``slots`` and
the autoscaling target. Generation and ``--url`` profiles have only the concurrency sweep.
Throughput is requests/s for embeddings and output tokens/s for generation.

The operating point (``Recommendation.final``, "the knee" of the report, the table and the
plot) is the knee of the most refined sweep measured: concurrency, else window, else batch.
A run cut short may have stopped that sweep below what an earlier one measured; then the
operating point is the best of the sweeps' knees (``pick_final``), so that the text never
calls a point the best while the tables show a better one. Every reason names its sweep.

The queue is sized in seconds of work at what one replica serves: a full queue
(``queue.max_size``) drains in ``QUEUE_DRAIN_S`` at one replica, and the graded holdback
keeps the default fractions (low above 70%, medium above 90%), stated in seconds too. That
rate is the knee's throughput, or, with ``--through-gateway``'s open-loop point, what a
replica sustains when arrivals keep coming (``openloop.sustained_rps``) where that is lower:
the closed loop overstates it for generation, where its sequences join an idle engine
together and share one prefill (1.25-1.4x on the 2-CPU machine of docs/benchmarks.md).
``memory_mb`` is the peak of the chosen worker configuration; ``autoscaling.max_replicas``
is not measured and is written as 1, to be raised. Every setting carries the sentence that
says which measurement chose it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tidegate.core.capacity import CapacityPoint, Knee, NoKnee, Slo, find_knee
from tidegate.engines.profile import KneeRecord, MeasuredPoint
from tidegate.profile.measure import config_label

QUEUE_DRAIN_S = 10.0  # a full gateway queue holds this much work for one replica
TIE_TOLERANCE = 0.05  # core find_knee's: a more refined sweep's knee this close wins
REFINEMENT = ("concurrency", "window", "batch")  # the most refined sweep first
HOLDBACK = {"medium": 0.9, "low": 0.7}  # the gateway's defaults, restated in seconds
CPU_BOUND_SHARE = 0.85  # a worker using this share of the machine's cores is CPU-bound


@dataclass(frozen=True)
class Setting:
    key: str  # dotted path in a model entry of the config, e.g. batching.max_batch_size
    value: int | float | dict[str, float]
    why: str


@dataclass(frozen=True)
class SweepKnee:
    """The knee of one sweep, with the measured point it chose."""

    sweep: str
    point: MeasuredPoint
    outcome: Knee | NoKnee

    @property
    def meets_slo(self) -> bool:
        return isinstance(self.outcome, Knee)

    @property
    def reason(self) -> str:
        """Why this point, within its own sweep (another sweep's table may show more)."""
        if isinstance(self.outcome, Knee):
            return f"{self.outcome.reason}, in the {self.sweep} sweep"
        return f"no point of the {self.sweep} sweep meets the SLO; the closest was kept"


@dataclass(frozen=True)
class Recommendation:
    knee: KneeRecord | None
    settings: tuple[Setting, ...]
    memory_mb: float
    summary: str  # the choice in two sentences
    knees: tuple[SweepKnee, ...]
    final: SweepKnee | None = None  # the operating point: ``knee``, as measured


def throughput_of(point: MeasuredPoint, task: str) -> float:
    return point.tokens_per_s if task == "generate" else point.throughput_rps


def capacity_point(point: MeasuredPoint, size: float, task: str) -> CapacityPoint:
    return CapacityPoint(
        size=size,
        throughput_per_s=throughput_of(point, task),
        p95_ms=point.latency_p95_ms if point.num_requests else math.inf,
        ttft_p95_ms=point.ttft_p95_ms,
        itl_p95_ms=point.itl_p95_ms,
        error_rate=point.error_rate,
    )


SIZE_OF: dict[str, Callable[[MeasuredPoint], float]] = {
    "batch": lambda p: float(p.batch_size or 0),
    "window": lambda p: float(p.batch_window_ms or 0.0),
    "concurrency": lambda p: float(p.concurrency),
}


def sweep_knee(
    points: Sequence[MeasuredPoint], sweep: str, slo: Slo, task: str
) -> SweepKnee | None:
    mine = [p for p in points if p.sweep == sweep]
    if not mine:
        return None
    size = SIZE_OF[sweep]
    outcome = find_knee([capacity_point(p, size(p), task) for p in mine], slo)
    chosen = outcome.point if isinstance(outcome, Knee) else outcome.closest
    assert chosen is not None  # points were given
    point = next(p for p in mine if size(p) == chosen.size)
    return SweepKnee(sweep, point, outcome)


def pick_final(knees: Sequence[SweepKnee], task: str, cut_short: bool) -> SweepKnee | None:
    """The operating point among the sweeps' knees (see the module docstring)."""
    by_sweep = {k.sweep: k for k in knees}
    ordered = [by_sweep[sweep] for sweep in REFINEMENT if sweep in by_sweep]
    meeting = [k for k in ordered if k.meets_slo]
    if not cut_short or not meeting:
        # Complete: each sweep was measured at the knee of the one before, so the last is
        # the most specific configuration, whatever the noise between sweeps.
        return ordered[0] if ordered else None
    best = max(throughput_of(k.point, task) for k in meeting)
    return next(k for k in meeting if throughput_of(k.point, task) >= best * (1.0 - TIE_TOLERANCE))


def recommend(
    points: Sequence[MeasuredPoint],
    slo: Slo,
    task: str,
    local: bool,
    stopped: str | None = None,
    sustained_rps: float | None = None,
) -> Recommendation:
    """``stopped``: why the run ended early (None: complete); ``sustained_rps``: what one
    replica sustains under open-loop arrivals, where measured (module docstring)."""
    knees = tuple(k for k in (sweep_knee(points, s, slo, task) for s in SIZE_OF) if k is not None)
    by_sweep = {k.sweep: k for k in knees}
    final = pick_final(knees, task, cut_short=stopped is not None)
    if final is None:
        return Recommendation(None, (), 0.0, "Nothing was measured.", knees)
    op = final.point
    record = KneeRecord(
        concurrency=op.concurrency,
        throughput_rps=op.throughput_rps,
        latency_p95_ms=op.latency_p95_ms,
        meets_slo=all(k.meets_slo for k in knees),
        reason=final.reason,
        batch_size=op.batch_size,
        batch_window_ms=op.batch_window_ms,
        tokens_per_s=op.tokens_per_s,
    )
    memory = _memory_mb(points, op.batch_size)
    settings = _batching(by_sweep, task, local) + _flow(final, task, sustained_rps)
    if local:  # an openai model's servers are started and scaled outside tidegate
        settings += _replica(final, task, memory, sustained_rps)
    summary = _summary(final, points, by_sweep, slo, task, stopped)
    return Recommendation(record, tuple(settings), memory, summary, knees, final)


def _batching(by_sweep: dict[str, SweepKnee], task: str, local: bool) -> list[Setting]:
    if not local:
        return []  # --url: the server's batching is its own
    settings: list[Setting] = []
    if task == "generate" and "concurrency" in by_sweep:
        k = by_sweep["concurrency"]
        settings.append(
            Setting(
                "batching.max_num_seqs",
                k.point.concurrency,
                f"{_measured(k.point, task)}: {k.reason}",
            )
        )
    if "batch" in by_sweep:
        k = by_sweep["batch"]
        settings.append(
            Setting(
                "batching.max_batch_size",
                k.point.batch_size or 1,
                f"{_measured(k.point, task)}: {k.reason}",
            )
        )
    if "window" in by_sweep:
        k = by_sweep["window"]
        window = k.point.batch_window_ms or 0.0
        settings.append(
            Setting("batching.batch_window_ms", window, f"{_measured(k.point, task)}: {k.reason}")
        )
    elif "batch" in by_sweep and by_sweep["batch"].point.batch_size == 1:
        why = "max batch 1: a batch of one never waits for companions (no window sweep)"
        settings.append(Setting("batching.batch_window_ms", 0.0, why))
    return settings


def _served(final: SweepKnee, sustained_rps: float | None) -> tuple[float, str]:
    """Requests/s one replica serves, and the words that say which measurement gave it: the
    knee's throughput, or the open-loop point's where that is lower (module docstring)."""
    op = final.point
    rps, basis = op.throughput_rps, f"the knee's {op.throughput_rps:.4g} req/s per replica"
    if sustained_rps is not None and 0 < sustained_rps < rps:
        rps = sustained_rps
        basis = (
            f"{rps:.4g} req/s per replica, what one replica sustains when arrivals keep coming "
            f"(the open-loop point; the knee's closed loop gave {op.throughput_rps:.4g})"
        )
    return max(rps, 1e-9), basis


def _flow(final: SweepKnee, task: str, sustained_rps: float | None) -> list[Setting]:
    op = final.point
    rps, basis = _served(final, sustained_rps)
    max_size = max(1, math.ceil(rps * QUEUE_DRAIN_S))
    seconds = {level: fraction * max_size / rps for level, fraction in HOLDBACK.items()}
    return [
        Setting("slots", op.concurrency, f"requests in flight at the knee: {_measured(op, task)}"),
        Setting("queue.max_size", max_size, f"{QUEUE_DRAIN_S:g} s of work at {basis}"),
        Setting(
            "queue.holdback",
            dict(HOLDBACK),
            "; ".join(f"{lvl} refused above {s:.3g} s of queued work" for lvl, s in seconds.items())
            + f" at {rps:.4g} req/s",
        ),
    ]


def _replica(
    final: SweepKnee, task: str, memory_mb: float, sustained_rps: float | None
) -> list[Setting]:
    """What placement and the autoscaler need of one replica."""
    op = final.point
    settings = []
    if memory_mb > 0:
        kind = "max batch" if op.batch_window_ms is not None else "max_num_seqs"
        why = f"peak memory of a worker with {kind} {op.batch_size}: the highest of its points"
        settings.append(Setting("memory_mb", math.ceil(memory_mb), why))
    settings.append(
        Setting(
            "autoscaling.target_per_replica",
            op.concurrency,
            f"demand (queued + in flight) one replica serves within the SLO: {_measured(op, task)}",
        )
    )
    if task != "generate":
        # Sized on arrivals/s (bench_autoscale: nearer the oracle's GPU-hours than the queue).
        # Not for generation: a request's cost there is its lengths, which the rate ignores.
        rps, basis = _served(final, sustained_rps)
        why = f"arrivals/s one replica serves within the SLO: {basis}"
        settings.append(Setting("autoscaling.target_rate_per_replica", float(f"{rps:.4g}"), why))
    return [
        *settings,
        Setting(
            "autoscaling.max_replicas",
            1,
            "not measured: raise it to the replicas your devices hold"
            + (f" at {math.ceil(memory_mb)} MB each" if memory_mb > 0 else ""),
        ),
    ]


def _measured(point: MeasuredPoint, task: str) -> str:
    """The configuration of a point and its figures, in a few words."""
    config = config_label(point.batch_size, point.batch_window_ms, point.concurrency)
    return f"{config} gave {_figures(point, task)}"


def _figures(point: MeasuredPoint, task: str) -> str:
    what = [f"{point.throughput_rps:.4g} req/s"]
    if task == "generate":
        what.append(f"{point.tokens_per_s:.4g} tok/s")
        what.append(f"TTFT p95 {point.ttft_p95_ms or 0:.4g} ms")
        what.append(f"ITL p95 {point.itl_p95_ms or 0:.3g} ms")
    else:
        what.append(f"p95 {point.latency_p95_ms:.4g} ms")
    return ", ".join(what)


def _memory_mb(points: Sequence[MeasuredPoint], batch_size: int | None) -> float:
    """Peak memory of the chosen worker configuration (of every point with --url)."""
    same = [p for p in points if batch_size is None or p.batch_size == batch_size]
    values = [p.peak_memory_mb for p in same or points if p.peak_memory_mb is not None]
    return max(values, default=0.0)


def _summary(
    final: SweepKnee,
    points: Sequence[MeasuredPoint],
    by_sweep: dict[str, SweepKnee],
    slo: Slo,
    task: str,
    stopped: str | None,
) -> str:
    op = final.point
    config = config_label(op.batch_size, op.batch_window_ms, op.concurrency)
    first = (
        f"The knee is {config}, which gave {_figures(op, task)}: {final.reason} ({slo_text(slo)})."
    )
    missed = [k.sweep for k in by_sweep.values() if not k.meets_slo]
    if missed:
        first += f" No configuration of the {' and '.join(missed)} sweep met the SLO."
    if stopped is not None:
        first += f" {_cut_short_sentence(final, points, by_sweep, task, stopped)}"
    return f"{first} {cpu_sentence(op)}"


def _cut_short_sentence(
    final: SweepKnee,
    points: Sequence[MeasuredPoint],
    by_sweep: dict[str, SweepKnee],
    task: str,
    stopped: str,
) -> str:
    """What an incomplete run leaves open: the sweep it cut, and what it reached."""
    last = next(sweep for sweep in REFINEMENT if sweep in by_sweep)
    if last == final.sweep:
        return f"The run stopped early ({stopped}): a longer run may find a better knee."
    unit = "tok/s" if task == "generate" else "req/s"
    reached = max(throughput_of(p, task) for p in points if p.sweep == last)
    return (
        f"The run stopped early ({stopped}) in the {last} sweep, which reached "
        f"{reached:.4g} {unit} at most: the {final.sweep} sweep's knee is kept instead."
    )


def slo_text(slo: Slo) -> str:
    parts = []
    if slo.p95_ms is not None:
        parts.append(f"p95 <= {slo.p95_ms:g} ms")
    if slo.ttft_p95_ms is not None:
        parts.append(f"TTFT p95 <= {slo.ttft_p95_ms:g} ms")
    if slo.itl_p95_ms is not None:
        parts.append(f"ITL p95 <= {slo.itl_p95_ms:g} ms")
    return ", ".join(parts) or "no SLO given"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_sentence(point: MeasuredPoint) -> str:
    """Whether the worker was CPU-bound at the point: the limit to name in the report."""
    cores = available_cores()
    used = point.worker_cpu_cores
    if used is None:
        return "The worker's CPU was not measured (no local process to watch)."
    if used >= CPU_BOUND_SHARE * cores:
        return (
            f"The worker used {used:.2f} of the {cores} CPU cores there: it is CPU-bound on this "
            "machine, so more throughput needs more cores or replicas, not other batch settings."
        )
    return (
        f"The worker used {used:.2f} of the {cores} CPU cores there: it is not CPU-bound, so "
        "latency, not compute, set the limit."
    )
