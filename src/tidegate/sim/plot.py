"""``report.png``: latency CDF by priority, queue depth over time, batch sizes.

The latency is end to end for embeddings, and the time to first token for generation (the
part the queue decides; the rest is the length of the answer).

Every policy of a ``--compare`` is drawn in the same three panels: one colour per priority
class in the CDF (one line style per policy), one colour per policy elsewhere. matplotlib
with the Agg backend, imported here only, so the rest of the simulator runs without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tidegate.sim.run import RunResult

_STYLES = ("-", "--", ":", "-.")


def write_png(results: Sequence[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (cdf, depth, sizes) = plt.subplots(1, 3, figsize=(17, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    generate = results[0].scenario.service.task == "generate"
    for p, result in enumerate(results):
        style = _STYLES[p % len(_STYLES)]
        for c, stats in enumerate(result.recorder.classes):
            points = (stats.ttft if generate else stats.e2e).cdf()
            if not points:
                continue
            xs = [max(x, 1e-4) for x, _ in points]
            cdf.step(
                xs,
                [y for _, y in points],
                where="post",
                linestyle=style,
                color=colours[c % len(colours)],
                label=f"{stats.name} ({result.label})",
            )
        samples = result.recorder.samples
        depth.plot(
            [s[0] for s in samples],
            [s[1] for s in samples],
            color=colours[p % len(colours)],
            label=result.label,
        )
        batch = result.recorder.batch_sizes
        total = sum(batch.values()) or 1
        ordered = sorted(batch)
        sizes.step(
            ordered,
            [batch[size] / total for size in ordered],
            where="mid",
            color=colours[p % len(colours)],
            label=result.label,
        )
    what = "time to first token" if generate else "end-to-end latency"
    cdf.set(xscale="log", xlabel=f"{what} (s)", ylabel="fraction of completed")
    cdf.set_title("latency CDF by priority")
    depth.set(xlabel="time (s)", ylabel="requests queued at the gateway")
    depth.set_title("queue depth")
    sizes.set(xlabel="batch size (generation: running sequences)", ylabel="share of batches")
    sizes.set_title("batch sizes")
    for axes in (cdf, depth, sizes):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
