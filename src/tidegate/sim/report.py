"""The report of one or more runs on the same workload: JSON, Markdown and a terminal table.

``build_report`` turns ``RunResult``s into a plain dict (``report.json``): no wall-clock
time, no absolute path, numbers rounded, keys in a fixed order, so the same seed gives a
byte-identical file. Per priority class (the workload's names, also under fifo):
completed, shed, rejected by reason, expired, failed; p50/p95/p99 of the gateway queue
wait, time to first token and end-to-end latency; SLO attainment (completed within the
class's TTFT SLO, over *all* its requests: a refused request is a miss) and goodput
(requests/s that met it); the longest queue wait; what never ran (``unservable``,
``stranded``: still queued when the run ended, see ``sim.run``). Overall: throughput,
output tokens/s, the batch-size distribution (generation: running sequences per engine
step), replica-hours and GPU-hours (replica-hours x GPUs per replica), the queue depth
over time, and ``stopped``: why requests were left queued, or null. With a simulated prefix
cache (``Scenario.prefix_cache``), ``overall.prefix_cache``: prompt blocks prefilled, of them
cached, the hit rate, and the replicas' shares of the span busy (engine running any step)
and prefilling (steps in which sequences joined): the mean and the max over replicas. Where
fair sharing's preemption paused sequences, ``overall.preemption``: how many were paused, and
the tokens the resumed ones prefilled again (their prompts and the tokens they had made).

``warnings`` (in the report, report.md and the terminal table) say where a comparison
shows less than it seems: every request at one priority level (priority and fifo then
schedule alike), or requests that never ran.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidegate.sim.recorder import ClassStats, Histogram
from tidegate.sim.run import RunResult, worker_slots

SCHEMA = "tidegate.simulate/1"
PERCENTILES = (50, 95, 99)
_REJECTED = ("rejected_full", "rejected_deadline", "rejected_holdback", "unavailable")


def _r(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def _percentiles(histogram: Histogram) -> dict[str, float | None]:
    return {f"p{q}": _r(histogram.percentile(q)) for q in PERCENTILES}


def _class_summary(stats: ClassStats, span_s: float) -> dict[str, Any]:
    outcomes = stats.outcomes
    total = sum(outcomes.values())
    return {
        "requests": total,
        "completed": outcomes["completed"],
        "shed": outcomes["shed"],
        "rejected": {reason.removeprefix("rejected_"): outcomes[reason] for reason in _REJECTED},
        "expired": outcomes["expired"],
        "failed": outcomes["failed"],
        "unservable": outcomes["unservable"],
        "stranded": outcomes["stranded"],
        "queue_wait_s": _percentiles(stats.wait),
        "ttft_s": _percentiles(stats.ttft),
        "e2e_s": _percentiles(stats.e2e),
        "slo_ttft_s": stats.slo_ttft_s,
        "slo_attainment": _r(stats.slo_met / total if total else None, 4),
        "goodput_per_s": _r(stats.slo_met / span_s if span_s > 0 else None, 4),
        "max_queue_wait_s": _r(stats.max_wait_s),
    }


def run_summary(result: RunResult) -> dict[str, Any]:
    recorder = result.recorder
    span_s = max(0.0, result.end_at - result.first_arrival_at)
    completed = sum(stats.outcomes["completed"] for stats in recorder.classes)
    tokens = sum(stats.output_tokens for stats in recorder.classes)
    batches = sum(recorder.batch_sizes.values())
    weighted = sum(size * count for size, count in recorder.batch_sizes.items())
    scenario = result.scenario
    overall: dict[str, Any] = {
        "requests": result.num_requests,
        "completed": completed,
        "span_s": _r(span_s),
        "throughput_per_s": _r(completed / span_s if span_s > 0 else None, 4),
        "output_tokens_per_s": _r(tokens / span_s if span_s > 0 else None, 2),
        "batches": batches,
        "mean_batch_size": _r(weighted / batches if batches else None, 3),
        "batch_sizes": {
            str(size): recorder.batch_sizes[size] for size in sorted(recorder.batch_sizes)
        },
        "replica_hours": _r(result.replica_seconds / 3600.0, 4),
        "gpu_hours": _r(result.replica_seconds / 3600.0 * scenario.service.gpus_per_replica, 4),
        "max_queued": max((sample[1] for sample in recorder.samples), default=0),
    }
    if scenario.prefix_cache is not None:
        overall["prefix_cache"] = prefix_cache_summary(result, span_s)
    if recorder.preempted:
        overall["preemption"] = {
            "preempted": sum(recorder.preempted.values()),
            "recomputed_tokens": sum(recorder.recomputed_tokens.values()),
        }
    return {
        "policy": result.label,
        "gateway_policy": scenario.config.policy,
        "controller": scenario.controller,
        "stopped": result.stopped,
        "classes": {stats.name: _class_summary(stats, span_s) for stats in recorder.classes},
        "overall": overall,
        "queue_depth": {
            "columns": ["at_s", "queued", "in_flight", "ready_replicas"],
            "interval_s": recorder.sample_interval_s,
            "rows": [
                [_r(at, 3), queued, flying, ready] for at, queued, flying, ready in recorder.samples
            ],
        },
    }


def prefix_cache_summary(result: RunResult, span_s: float) -> dict[str, Any]:
    """Blocks prefilled and cached, and the replicas' busy shares (module docstring)."""
    recorder = result.recorder
    blocks = recorder.cache_blocks
    num = sum(result.scenario.replicas.values())
    summary: dict[str, Any] = {
        "blocks": blocks,
        "hit_blocks": recorder.cache_hit_blocks,
        "hit_rate": _r(recorder.cache_hit_blocks / blocks if blocks else None, 4),
    }
    for name, seconds in (("busy", recorder.busy_s), ("prefill", recorder.prefill_s)):
        shares = [value / span_s for value in seconds.values()] if span_s > 0 else []
        count = max(num, len(shares))
        summary[f"{name}_mean"] = _r(sum(shares) / count if count else None, 4)
        summary[f"{name}_max"] = _r(max(shares, default=0.0), 4)
    return summary


def build_report(results: Sequence[RunResult], workload: dict[str, Any]) -> dict[str, Any]:
    first = results[0].scenario
    spec = first.config.model(first.model)
    return {
        "schema": SCHEMA,
        "workload": workload,
        "model": {
            "name": spec.name,
            "task": spec.task,
            "service": first.service.describe(),
            "replicas": dict(first.replicas),
            "slots_per_replica": worker_slots(first.config, first.model),
            "network_s": first.network_s,
        },
        "config": Path(first.config.source).name,
        "slo_ttft_s": first.slos(),
        "runs": [run_summary(result) for result in results],
        "warnings": warnings(results),
    }


def warnings(results: Sequence[RunResult]) -> list[str]:
    """What makes the comparison show less than it seems (module docstring)."""
    out = []
    first = results[0]
    levels = first.scenario.config.levels
    used = [stats.name for stats in first.recorder.classes if sum(stats.outcomes.values())]
    if len(levels) > 1 and len(used) == 1:
        out.append(
            f"every request is at priority {used[0]}: priority and fifo schedule them alike, "
            "so the comparison shows no difference between them; give the workload a mix, "
            "e.g. --priority-mix high=0.2,medium=0.5,low=0.3 (or --priority-rules)"
        )
    for result in results:
        if result.stopped:
            out.append(f"{result.label}: requests never ran: {result.stopped}")
    return out


def dumps(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, allow_nan=False) + "\n"


# ----------------------------------------------------------------------------- tables


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    ms = value * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def comparison_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row per (class, policy): the table of the terminal summary and report.md."""
    rows = []
    classes = list(report["runs"][0]["classes"])
    for name in classes:
        for run in report["runs"]:
            c = run["classes"][name]
            if not c["requests"]:
                continue
            rejected = sum(c["rejected"].values())
            rows.append(
                [
                    name,
                    run["policy"],
                    f"{c['requests']:,}",
                    f"{c['completed']:,}",
                    f"{rejected + c['shed']:,}",
                    f"{c['expired']:,}",
                    _ms(c["queue_wait_s"]["p95"]),
                    _ms(c["ttft_s"]["p50"]),
                    _ms(c["ttft_s"]["p95"]),
                    _ms(c["e2e_s"]["p50"]),
                    _ms(c["e2e_s"]["p95"]),
                    _ms(c["e2e_s"]["p99"]),
                    _pct(c["slo_attainment"]),
                    f"{c['goodput_per_s']:.2f}" if c["goodput_per_s"] is not None else "-",
                    _ms(c["max_queue_wait_s"]),
                ]
            )
    return rows


COMPARISON_HEADER = [
    "priority",
    "policy",
    "requests",
    "completed",
    "refused+shed",
    "expired",
    "wait p95 ms",
    "TTFT p50 ms",
    "TTFT p95 ms",
    "e2e p50 ms",
    "e2e p95 ms",
    "e2e p99 ms",
    "SLO met",
    "goodput/s",
    "max wait ms",
]


def overall_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for run in report["runs"]:
        o = run["overall"]
        rows.append(
            [
                run["policy"],
                f"{o['requests']:,}",
                f"{o['completed']:,}",
                f"{o['throughput_per_s'] or 0:.2f}",
                f"{o['output_tokens_per_s'] or 0:,.0f}",
                f"{o['mean_batch_size'] or 0:.2f}",
                f"{o['max_queued']:,}",
                f"{o['replica_hours']:.2f}",
                f"{o['gpu_hours']:.2f}",
            ]
        )
    return rows


OVERALL_HEADER = [
    "policy",
    "requests",
    "completed",
    "req/s",
    "output tok/s",
    "mean batch",
    "max queued",
    "replica-hours",
    "GPU-hours",
]


def markdown_table(header: list[str], rows: list[list[str]], text_columns: int) -> str:
    align = ["---" if i < text_columns else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    w = report["workload"]
    m = report["model"]
    slo = ", ".join(f"{name} {value:g} s" for name, value in report["slo_ttft_s"].items())
    replicas = ", ".join(f"{count} in {pool}" for pool, count in m["replicas"].items())
    return "\n".join(
        [
            "# tidegate simulate",
            "",
            f"Workload: {w['name']}, {w['requests']:,} requests, rate x{w['rate_scale']:g}, "
            f"speedup x{w['speedup']:g}, seed {w['seed']}, priorities: {w['priorities']}.",
            f"Model: {m['name']} ({m['task']}), service {m['service']['name']} "
            f"({m['service']['source']}); replicas: {replicas or 'none'}; "
            f"{m['slots_per_replica']} slots each; config {report['config']}.",
            f"SLO (time to first token): {slo}.",
            "",
            markdown_table(COMPARISON_HEADER, comparison_rows(report), 2),
            "",
            markdown_table(OVERALL_HEADER, overall_rows(report), 1),
            "",
            *(line for text in report.get("warnings", ()) for line in (f"Warning: {text}", "")),
        ]
    )


def terminal(report: dict[str, Any]) -> str:
    """Fixed-width columns for the terminal."""
    out = []
    for header, rows in (
        (COMPARISON_HEADER, comparison_rows(report)),
        (OVERALL_HEADER, overall_rows(report)),
    ):
        widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
        for row in (header, *rows):
            out.append(
                "  ".join(
                    cell.ljust(width) if i < 2 else cell.rjust(width)
                    for i, (cell, width) in enumerate(zip(row, widths, strict=True))
                )
            )
        out.append("")
    out += [f"warning: {text}" for text in report.get("warnings", ())]
    return "\n".join(out)
