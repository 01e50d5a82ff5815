"""One run of the planner: sweep with a progress bar, then write the files, whatever happened.

Ctrl-C (SIGINT) or SIGTERM, and ``--max-duration-s``, set one stop event: the point being
measured is cut at once and summarised from its finished windows, no further point starts,
the workers are stopped, and the four files are written from what was measured (marked
incomplete). A second Ctrl-C aborts without writing. Exit status: 0 complete, 130 stopped by
a signal, 1 failed (a worker that would not start, a server that does not answer), 2 bad
options; in every case but 2 the files are written.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import signal
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from tidegate.engines.profile import MeasuredPoint
from tidegate.errors import ConfigError, ReplicaFailed
from tidegate.profile.loadgen import client_session
from tidegate.profile.openloop import sustained_rps
from tidegate.profile.options import ProfileOptions
from tidegate.profile.outputs import write_outputs
from tidegate.profile.recommend import recommend
from tidegate.profile.record import RunRecord
from tidegate.profile.sweep import Planner

EXIT_STOPPED = 130


class RichProgress:
    """The progress bar (points done of points planned, elapsed, ETA) and one line per point."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.bar = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("points"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            speed_estimate_period=3600,  # points take seconds to minutes: average them all
        )
        self.task = self.bar.add_task("starting", total=None)
        self.label = ""

    def __enter__(self) -> RichProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def planned(self, total: int) -> None:
        self.bar.update(self.task, total=total)

    def begin(self, label: str) -> None:
        self.label = label
        self.bar.update(self.task, description=label)

    def window(self, num_windows: int) -> None:
        self.bar.update(self.task, description=f"{self.label}, window {num_windows}")

    def done(self, point: MeasuredPoint | None) -> None:
        self.bar.advance(self.task)
        if point is not None:
            self.console.print(f"measured {self.label}: {point_line(point)}", highlight=False)

    def note(self, text: str) -> None:
        self.console.print(text, style="dim", highlight=False)


def point_line(p: MeasuredPoint) -> str:
    parts = [f"{p.throughput_rps:.1f} req/s", f"p95 {p.latency_p95_ms:.1f} ms"]
    if p.ttft_p95_ms is not None:
        parts += [f"{p.tokens_per_s:.0f} tok/s", f"TTFT p95 {p.ttft_p95_ms:.1f} ms"]
    if p.itl_p95_ms is not None:
        parts.append(f"ITL p95 {p.itl_p95_ms:.2f} ms")
    if p.batch_latency_ms is not None:
        parts.append(f"batch {p.batch_latency_ms:.1f} ms (mean {p.mean_batch_size or 0:.1f})")
    if p.worker_cpu_cores is not None:
        parts.append(f"worker CPU {p.worker_cpu_cores:.2f}")
    if p.peak_memory_mb is not None:
        parts.append(f"memory {p.peak_memory_mb:.0f} MB")
    if p.num_errors:
        parts.append(f"{p.num_errors} errors")
    parts.append(f"{'stable' if p.stable else 'NOT stable'} after {p.num_windows} windows")
    return ", ".join(parts)


def run_profile(options: ProfileOptions) -> int:
    """Run the planner; the exit status of ``tidegate profile``."""
    console = Console(stderr=True)
    return asyncio.run(_run(options, console))


async def _run(options: ProfileOptions, console: Console) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    reasons: list[str] = []

    def request_stop(reason: str) -> None:
        if not stop.is_set():
            reasons.append(reason)
            stop.set()
            console.print(f"stopping: {reason}; writing what was measured", highlight=False)
        # A second Ctrl-C is Python's own again: it aborts.
        loop.remove_signal_handler(signal.SIGINT)

    loop.add_signal_handler(signal.SIGINT, request_stop, "interrupted (Ctrl-C)")
    loop.add_signal_handler(signal.SIGTERM, request_stop, "terminated (SIGTERM)")
    timer = None
    if options.max_duration_s is not None:
        timer = loop.call_later(options.max_duration_s, request_stop, "--max-duration-s reached")
    started_at = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    started = time.monotonic()
    failed = False
    with RichProgress(console) as progress:
        planner = Planner(options, progress, stop)
        try:
            async with client_session() as session:
                await planner.run(session)
        except (ReplicaFailed, ConfigError) as exc:
            failed = True
            reasons.append(f"failed: {exc.message.splitlines()[0]}")
            console.print(f"error: {exc.message}", highlight=False)
        finally:
            if timer is not None:
                timer.cancel()
            loop.remove_signal_handler(signal.SIGTERM)
            loop.remove_signal_handler(signal.SIGINT)
    _write(options, planner, reasons, started_at, time.monotonic() - started, console)
    if failed:
        return 1
    return EXIT_STOPPED if reasons and "max-duration" not in reasons[0] else 0


def _write(
    options: ProfileOptions,
    planner: Planner,
    reasons: list[str],
    started_at: str,
    duration_s: float,
    console: Console,
) -> None:
    prepared = planner.prepared
    task = prepared.task if prepared is not None else planner.expected_task()
    record = RunRecord(
        options=options,
        task=task,
        engine=(
            prepared.info.engine
            if prepared is not None and not (options.through_gateway and options.local)
            else options.engine
        ),
        started_at=started_at,
        duration_s=duration_s,
        workload=prepared.workload.describe() if prepared is not None else {},
        stopped=reasons[0] if reasons else None,
        climb_stops=dict(planner.climb_stops),
        weights_mb=planner.weights_mb,
        open_loop=tuple(planner.open_loop),
        drift=planner.drift,
        calibration=(
            {
                "overhead_tokens": round(prepared.sizer.overhead_tokens, 2),
                "tokens_per_word": round(prepared.sizer.tokens_per_word, 3),
            }
            if prepared is not None
            else {}
        ),
    )
    rec = recommend(
        planner.points,
        options.slo,
        task,
        options.local,
        record.stopped,
        sustained_rps(record.open_loop),
    )
    paths = write_outputs(options.out, record, planner.points, rec)
    console.print(rec.summary, highlight=False)
    console.print("wrote " + ", ".join(str(p) for p in paths), highlight=False)
