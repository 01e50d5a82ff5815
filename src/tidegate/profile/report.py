"""report.md: the measured tables, the choice in two sentences, and what to read with care.

One table per sweep (batch | batch latency | throughput | p95 | memory | worker CPU ...),
columns declared once in ``TABLES``, and a last column that marks the knee (the point the
choice names, and the plot stars) and the points that chose a batching setting; notes for
unstable points, failed requests and the CPU other processes took while the points were
measured (the noise of a shared machine).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tidegate.engines.profile import MeasuredPoint
from tidegate.profile.measure import config_label
from tidegate.profile.openloop import (
    chosen,
    closed_loop_curve,
    closed_loop_itl,
    curve_capacity,
    point_line,
)
from tidegate.profile.recommend import Recommendation, slo_text
from tidegate.profile.record import RunRecord, host_facts


def report_markdown(
    record: RunRecord, points: Sequence[MeasuredPoint], rec: Recommendation, png: bool
) -> str:
    o = record.options
    host = host_facts()
    status = "complete" if record.stopped is None else f"INCOMPLETE ({record.stopped})"
    lines = [
        f"# Capacity profile: {o.model} ({record.engine}, {o.device})",
        "",
        f"Measured {record.started_at} in {record.duration_s:.0f} s on {host['cpus']} CPUs "
        f"({host['cpu_model']}), {host['platform']}; status: {status}.",
        "",
        f"Command: `{o.command}`",
        "",
        f"SLO: {slo_text(o.slo)}. Workload: {_workload_text(record.workload)}.",
        "",
        "## Choice",
        "",
        rec.summary,
        "",
    ]
    for title, sweep, rows in _tables(points, record.task, choice_marks(rec)):
        if rows:
            lines += [f"## {title}", "", *rows, ""]
            if sweep in record.climb_stops:
                lines += [f"Stopped climbing: {record.climb_stops[sweep]}.", ""]
    lines += _open_loop(record, points)
    lines += _notes(points, record)
    if png:
        lines += ["![latency, throughput and memory curves](report.png)", ""]
    return "\n".join(lines)


def _workload_text(workload: dict[str, Any]) -> str:
    inputs = workload.get("input_tokens", {})
    text = f"{workload.get('source')}, mean input {inputs.get('mean')} tokens"
    text += f" (p99 {inputs.get('p99')})"
    outputs = workload.get("output_tokens", {})
    if outputs.get("mean"):
        text += f", mean output {outputs.get('mean')} tokens"
    clipping = workload.get("clipping", {})
    if clipping.get("num_clipped"):
        text += (
            f"; {clipping['num_clipped']} of {workload.get('num_samples')} requests clipped "
            f"to what the model takes (inputs to {clipping.get('max_input_tokens')} tokens"
        )
        if clipping.get("max_output_tokens"):
            text += f", outputs to {clipping['max_output_tokens']}"
        text += f", both within a context of {clipping.get('context_tokens')})"
    return text


Column = tuple[str, Callable[[MeasuredPoint], str]]


def _fixed(digits: int, get: Callable[[MeasuredPoint], float | None]) -> Callable[..., str]:
    def show(point: MeasuredPoint) -> str:
        value = get(point)
        return "-" if value is None else f"{value:,.{digits}f}"

    return show


THROUGHPUT: Column = ("throughput req/s", _fixed(1, lambda p: p.throughput_rps))
P50: Column = ("p50 ms", _fixed(1, lambda p: p.latency_p50_ms))
P95: Column = ("p95 ms", _fixed(1, lambda p: p.latency_p95_ms))
MEMORY: Column = ("memory MB", _fixed(0, lambda p: p.peak_memory_mb))
CPU: Column = ("worker CPU (cores)", _fixed(2, lambda p: p.worker_cpu_cores))
MEAN_BATCH: Column = ("mean batch", _fixed(1, lambda p: p.mean_batch_size))
IN_FLIGHT: Column = ("in flight", lambda p: str(p.concurrency))

TABLES: dict[str, dict[str, tuple[str, list[Column]]]] = {
    "embeddings": {
        "batch": (
            "Batch sweep",
            [
                ("batch", lambda p: str(p.batch_size)),
                ("batch latency ms", _fixed(1, lambda p: p.batch_latency_ms)),
                THROUGHPUT,
                P95,
                MEMORY,
                CPU,
                MEAN_BATCH,
                IN_FLIGHT,
            ],
        ),
        "window": (
            "Batch window",
            [
                ("window ms", lambda p: f"{p.batch_window_ms:g}"),
                MEAN_BATCH,
                THROUGHPUT,
                P50,
                P95,
                CPU,
            ],
        ),
        "concurrency": (
            "Concurrency sweep",
            [
                IN_FLIGHT,
                THROUGHPUT,
                P50,
                P95,
                ("p99 ms", _fixed(1, lambda p: p.latency_p99_ms)),
                MEAN_BATCH,
                MEMORY,
                CPU,
            ],
        ),
    },
    "generate": {
        "concurrency": (
            "Concurrency sweep",
            [
                IN_FLIGHT,
                THROUGHPUT,
                ("output tokens/s", _fixed(0, lambda p: p.tokens_per_s)),
                ("TTFT p50 ms", _fixed(1, lambda p: p.ttft_p50_ms)),
                ("TTFT p95 ms", _fixed(1, lambda p: p.ttft_p95_ms)),
                ("ITL p50 ms", _fixed(2, lambda p: p.itl_p50_ms)),
                ("ITL p95 ms", _fixed(2, lambda p: p.itl_p95_ms)),
                MEMORY,
                CPU,
            ],
        ),
    },
}


# What the knee of a sweep other than the operating point's chose (recommend._batching).
SETS = {"batch": "sets max_batch_size", "window": "sets batch_window_ms"}


def choice_marks(rec: Recommendation) -> list[tuple[MeasuredPoint, str]]:
    """The points the choice rests on, with what each one is: the knee first."""
    marks = [] if rec.final is None else [(rec.final.point, "**knee**")]
    for knee in rec.knees:
        if knee is not rec.final and knee.sweep in SETS:
            marks.append((knee.point, SETS[knee.sweep]))
    return marks


def _tables(
    points: Sequence[MeasuredPoint], task: str, marks: list[tuple[MeasuredPoint, str]]
) -> list[tuple[str, str, list[str]]]:
    def mark(point: MeasuredPoint) -> str:
        # By identity: two points of a sweep may hold equal figures.
        return next((text for marked, text in marks if marked is point), "")

    tables = []
    for sweep, (title, columns) in TABLES[task].items():
        rows = [
            "| " + " | ".join([*(show(p) for _, show in columns), mark(p)]) + " |"
            for p in points
            if p.sweep == sweep
        ]
        header = "| " + " | ".join([*(name for name, _ in columns), "choice"]) + " |"
        rule = "|" + "---:|" * len(columns) + ":---|"
        tables.append((title, sweep, [header, rule, *rows] if rows else []))
    return tables


def _open_loop(record: RunRecord, points: Sequence[MeasuredPoint]) -> list[str]:
    """The open-loop tries of ``--through-gateway`` and what they did to the curves."""
    if not record.open_loop:
        return []
    generate = record.task == "generate"
    joins = (
        "each joining prompt pays its own prefill"
        if generate
        else "each batch takes what is queued, up to max batch"
    )
    lines = [
        "## Open-loop point",
        "",
        "Poisson arrivals at a fraction of the capacity predicted from the closed loop: what "
        f"the simulator answers with its curves when arrivals keep coming, where {joins} "
        "(docs/profile.md).",
        "",
    ]
    best = _closed_loop_best(points, record.options.max_batch, generate)
    if best:
        lines += [f"The closed loop's best throughput was {best:,.2f} requests/s.", ""]
    for number, attempt in enumerate(record.open_loop, 1):
        target = (
            ""
            if attempt.capacity_rps is None
            else f" at {attempt.fraction:.0%} of {attempt.capacity_rps:,.2f} req/s"
        )
        lines.append(f"- Try {number}{target}: {point_line(attempt)}.")
    used = chosen(record.open_loop)
    factor = None if used is None else used.factor
    if used is not None and factor is not None and used.at_batch is not None:
        what = "sequences decoding" if generate else "batch"
        lines += [
            "",
            f"The curves in profile.json are the closed loop's times {factor:.2f} from mean "
            f"{what} {used.at_batch:.1f} up (1 at 1, linear in between).",
        ]
    return [*lines, ""]


def _closed_loop_best(points: Sequence[MeasuredPoint], max_batch: int, generate: bool) -> float:
    if generate:
        closed = closed_loop_itl(points, max_batch)
        return 0.0 if closed is None else closed[1]
    curve = closed_loop_curve(points)
    return 0.0 if curve is None else curve_capacity(curve, max_batch)


def _notes(points: Sequence[MeasuredPoint], record: RunRecord) -> list[str]:
    notes = []
    if record.drift is not None:
        notes.append(f"- Drift check: {record.drift.sentence()}")
    unstable = [p for p in points if not p.stable]
    if unstable:
        labels = "; ".join(
            f"{p.sweep} sweep: {config_label(p.batch_size, p.batch_window_ms, p.concurrency)}"
            for p in unstable
        )
        notes.append(f"- Not stable within the time allowed (kept, read with care): {labels}.")
    failed = [p for p in points if p.num_errors]
    if failed:
        total = sum(p.num_errors for p in failed)
        notes.append(f"- {total} requests failed across {len(failed)} points.")
    others = [p.other_cpu_cores for p in points if p.other_cpu_cores is not None]
    if others:
        notes.append(
            f"- Other processes used up to {max(others):.2f} CPU cores during the windows "
            "(noise on a shared machine); the load generator's own CPU is in profile.json."
        )
    return ["## Notes", "", *notes, ""] if notes else []
