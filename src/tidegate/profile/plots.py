"""report.png: latency, throughput and memory curves, with the knee and the SLO line marked.

Four panels over the sweep that chose the batch (embeddings with workers) or the concurrency
(generation, ``--url``): latency percentiles with the SLO, throughput, peak memory, and the
concurrency sweep as latency against throughput. matplotlib with the Agg backend: no display.

Invariants: the star labelled "knee" is the operating point the report's text names
(``Recommendation.final``), drawn only in the panels that hold that very point; the point
another sweep's knee chose there is a ring labelled with the setting it chose. A panel with
nothing measured says "not measured" and why, instead of staying empty.
"""

from __future__ import annotations

import functools
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidegate.core.capacity import Slo
from tidegate.engines.profile import MeasuredPoint
from tidegate.profile.recommend import Recommendation, throughput_of
from tidegate.profile.record import RunRecord

KNEE_STYLE = {"marker": "*", "markersize": 14, "color": "tab:red", "zorder": 5}
CHOSEN_STYLE = {
    "marker": "o",
    "markersize": 11,
    "markerfacecolor": "none",
    "markeredgecolor": "tab:red",
    "zorder": 5,
}
CHOSEN_LABEL = {"batch": "chose max_batch_size"}


def write_report_png(
    path: Path, record: RunRecord, points: Sequence[MeasuredPoint], rec: Recommendation
) -> bool:
    """Draw the figure; False (and no file) when there is nothing to draw."""
    fig = report_figure(record, points, rec)
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    fig.savefig(path)
    plt.close(fig)
    return True


def report_figure(
    record: RunRecord, points: Sequence[MeasuredPoint], rec: Recommendation
) -> Any | None:
    """The figure (a matplotlib Figure; close it), or None when nothing was measured."""
    name = "batch" if any(p.sweep == "batch" for p in points) else "concurrency"
    main = [p for p in points if p.sweep == name]
    if not main:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    knees = {k.sweep: k.point for k in rec.knees}
    final = None if rec.final is None else rec.final.point
    sweep = _Sweep(name, main, final, knees.get(name), record.task)
    slo = record.options.slo
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), dpi=90)
    _latency(axes[0][0], sweep, slo)
    _throughput(axes[0][1], sweep)
    _memory(axes[1][0], sweep, record)
    concurrency = [p for p in points if p.sweep == "concurrency"]
    _tradeoff(axes[1][1], concurrency, record, final)
    fig.suptitle(rec.summary.partition(": ")[0], fontsize=9)
    fig.tight_layout()
    return fig


@dataclass(frozen=True)
class _Sweep:
    """The sweep drawn against its configuration size, with the points the choice rests on."""

    name: str  # "batch" or "concurrency"
    points: Sequence[MeasuredPoint]
    final: MeasuredPoint | None  # the operating point, wherever it was measured
    chosen: MeasuredPoint | None  # this sweep's own knee
    task: str

    def x(self, point: MeasuredPoint) -> float:
        return float(point.batch_size or 1) if self.name == "batch" else float(point.concurrency)

    @property
    def xs(self) -> list[float]:
        return [self.x(p) for p in self.points]

    def plot(self, ax: Any, ys: Sequence[float | None], style: str, label: str) -> None:
        ax.plot(self.xs, [y or 0 for y in ys], style, label=label)

    def mark_knee(self, ax: Any, y: Callable[[MeasuredPoint], float | None]) -> None:
        """The star on the operating point when this sweep holds it (by identity), else a
        ring on the point this sweep chose."""
        if any(p is self.final for p in self.points):
            _mark(ax, self.final, self.x, y, "knee", KNEE_STYLE)
        elif self.chosen is not None:
            label = CHOSEN_LABEL.get(self.name, "this sweep's knee")
            _mark(ax, self.chosen, self.x, y, label, CHOSEN_STYLE)

    def finish(self, ax: Any, y_label: str, title: str) -> None:
        ax.set_ylim(bottom=0)
        x_label = "max batch size" if self.name == "batch" else "requests in flight"
        _axes(ax, x_label, y_label, title, log2_x=True)


def _mark(
    ax: Any,
    point: MeasuredPoint | None,
    x: Callable[[MeasuredPoint], float],
    y: Callable[[MeasuredPoint], float | None],
    label: str,
    style: dict[str, Any],
) -> None:
    value = None if point is None else y(point)
    if point is not None and value is not None:
        ax.plot([x(point)], [value], label=label, linestyle="none", **style)


def _not_measured(ax: Any, why: str) -> None:
    """Say so in an empty panel (no axes to read as zeros)."""
    text = "not measured:\n" + textwrap.fill(why, width=44)
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="dimgray")
    ax.set_xticks([])
    ax.set_yticks([])


def _slo_line(ax: Any, target: float | None, label: str) -> None:
    if target is not None:
        ax.axhline(target, linestyle="--", color="tab:red", alpha=0.6, label=label)


def _latency(ax: Any, sweep: _Sweep, slo: Slo) -> None:
    points = sweep.points
    if sweep.task == "generate":
        sweep.plot(ax, [p.ttft_p95_ms for p in points], "o-", "TTFT p95")
        sweep.plot(ax, [p.itl_p95_ms for p in points], "s-", "ITL p95")
        _slo_line(ax, slo.ttft_p95_ms, "TTFT SLO")
        _slo_line(ax, slo.itl_p95_ms, "ITL SLO")
        sweep.mark_knee(ax, lambda p: p.ttft_p95_ms)
    else:
        sweep.plot(ax, [p.latency_p50_ms for p in points], "o-", "request p50")
        sweep.plot(ax, [p.latency_p95_ms for p in points], "s-", "request p95")
        if any(p.batch_latency_ms is not None for p in points):
            sweep.plot(ax, [p.batch_latency_ms for p in points], "^-", "batch latency")
        _slo_line(ax, slo.p95_ms, "SLO p95")
        sweep.mark_knee(ax, lambda p: p.latency_p95_ms)
    sweep.finish(ax, "latency (ms)", "latency")


def _throughput(ax: Any, sweep: _Sweep) -> None:
    sweep.plot(ax, [throughput_of(p, sweep.task) for p in sweep.points], "o-", "throughput")
    sweep.mark_knee(ax, lambda p: throughput_of(p, sweep.task))
    sweep.finish(ax, _unit(sweep.task), "throughput")


def _memory(ax: Any, sweep: _Sweep, record: RunRecord) -> None:
    if any(p.peak_memory_mb is not None for p in sweep.points):
        sweep.plot(ax, [p.peak_memory_mb for p in sweep.points], "o-", "peak memory")
        sweep.mark_knee(ax, lambda p: p.peak_memory_mb)
    elif not record.options.local:
        _not_measured(ax, "the server at --url is not a process here to watch")
    else:
        _not_measured(ax, "no point reported the worker's memory")
    sweep.finish(ax, "MB", "peak memory")


def _unit(task: str) -> str:
    return "output tokens/s" if task == "generate" else "requests/s"


def _tradeoff(
    ax: Any,
    points: Sequence[MeasuredPoint],
    record: RunRecord,
    final: MeasuredPoint | None,
) -> None:
    task = record.task
    if points:
        tput = [throughput_of(p, task) for p in points]
        ax.plot(tput, [p.latency_p95_ms for p in points], "o-", label="p95 (end to end)")
        for point, x in zip(points, tput, strict=True):
            ax.annotate(str(point.concurrency), (x, point.latency_p95_ms), fontsize=7)
        _slo_line(ax, record.options.slo.p95_ms, "SLO p95")
        if any(p is final for p in points):
            on_x = functools.partial(throughput_of, task=task)
            _mark(ax, final, on_x, lambda p: p.latency_p95_ms, "knee", KNEE_STYLE)
    elif record.stopped is not None:
        _not_measured(ax, f"the run stopped before the concurrency sweep ({record.stopped})")
    else:
        _not_measured(ax, "no point of the concurrency sweep completed")
    _axes(ax, _unit(task), "latency p95 (ms)", "concurrency sweep (labels: in flight)")


def _axes(ax: Any, x_label: str, y_label: str, title: str, *, log2_x: bool = False) -> None:
    if log2_x:  # batch sizes and concurrencies are powers of two
        from matplotlib.ticker import FuncFormatter, NullFormatter

        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
