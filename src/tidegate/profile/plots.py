"""report.png: latency, throughput and memory curves, with the knee and the SLO line marked.

Four panels over the sweep that chose the batch (embeddings with workers) or the concurrency
(generation, ``--url``): latency percentiles with the SLO, throughput, peak memory, and the
concurrency sweep as latency against throughput. matplotlib with the Agg backend: no display.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidegate.core.capacity import Slo
from tidegate.engines.profile import MeasuredPoint
from tidegate.profile.recommend import Recommendation, throughput_of

KNEE_STYLE = {"marker": "*", "markersize": 14, "color": "tab:red", "zorder": 5}


def write_report_png(
    path: Path, points: Sequence[MeasuredPoint], rec: Recommendation, task: str, slo: Slo
) -> bool:
    """Draw the figure; False (and no file) when there is nothing to draw."""
    name = "batch" if any(p.sweep == "batch" for p in points) else "concurrency"
    main = [p for p in points if p.sweep == name]
    if not main:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    knees = {k.sweep: k.point for k in rec.knees}
    sweep = _Sweep(name, main, knees.get(name), task)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), dpi=90)
    _latency(axes[0][0], sweep, slo)
    _throughput(axes[0][1], sweep)
    _memory(axes[1][0], sweep)
    _tradeoff(axes[1][1], [p for p in points if p.sweep == "concurrency"], task, slo, knees)
    fig.suptitle(rec.summary.partition(": ")[0], fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


@dataclass(frozen=True)
class _Sweep:
    """The sweep drawn against its configuration size, with its knee."""

    name: str  # "batch" or "concurrency"
    points: Sequence[MeasuredPoint]
    knee: MeasuredPoint | None
    task: str

    def x(self, point: MeasuredPoint) -> float:
        return float(point.batch_size or 1) if self.name == "batch" else float(point.concurrency)

    @property
    def xs(self) -> list[float]:
        return [self.x(p) for p in self.points]

    def plot(self, ax: Any, ys: Sequence[float | None], style: str, label: str) -> None:
        ax.plot(self.xs, [y or 0 for y in ys], style, label=label)

    def mark_knee(self, ax: Any, y: Callable[[MeasuredPoint], float | None]) -> None:
        value = None if self.knee is None else y(self.knee)
        if self.knee is not None and value is not None:
            ax.plot([self.x(self.knee)], [value], label="knee", linestyle="none", **KNEE_STYLE)

    def finish(self, ax: Any, y_label: str, title: str) -> None:
        ax.set_ylim(bottom=0)
        x_label = "max batch size" if self.name == "batch" else "requests in flight"
        _axes(ax, x_label, y_label, title, log2_x=True)


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


def _memory(ax: Any, sweep: _Sweep) -> None:
    if any(p.peak_memory_mb is not None for p in sweep.points):
        sweep.plot(ax, [p.peak_memory_mb for p in sweep.points], "o-", "peak memory")
        sweep.mark_knee(ax, lambda p: p.peak_memory_mb)
    sweep.finish(ax, "MB", "peak memory")


def _unit(task: str) -> str:
    return "output tokens/s" if task == "generate" else "requests/s"


def _tradeoff(
    ax: Any,
    points: Sequence[MeasuredPoint],
    task: str,
    slo: Slo,
    knees: dict[str, MeasuredPoint],
) -> None:
    if points:
        tput = [throughput_of(p, task) for p in points]
        ax.plot(tput, [p.latency_p95_ms for p in points], "o-", label="p95 (end to end)")
        for point, x in zip(points, tput, strict=True):
            ax.annotate(str(point.concurrency), (x, point.latency_p95_ms), fontsize=7)
        _slo_line(ax, slo.p95_ms, "SLO p95")
        knee = knees.get("concurrency")
        if knee is not None:
            ax.plot(
                [throughput_of(knee, task)],
                [knee.latency_p95_ms],
                label="knee",
                linestyle="none",
                **KNEE_STYLE,
            )
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
