"""The engine's step table (``tidegate.engines.steps``) as Prometheus counters.

Read from a ``StepTally`` at each scrape (the generation engine's, kept by its thread; the
embeddings batcher's, one entry per batch), so the hot path pays a dict update per step and
nothing else. Three counters, labels ``model``, ``kind`` (decode, join, start; batch for an
embeddings worker) and ``running`` (sequences in the step, joiners included; a batch's
inputs):

- ``tidegate_engine_steps_total``: engine steps;
- ``tidegate_engine_step_seconds_total``: their time;
- ``tidegate_engine_step_joins_total``: prompts that joined in them.

``rate(tidegate_engine_step_seconds_total[1m]) / rate(tidegate_engine_steps_total[1m])`` is
the mean step by kind and batch (for embeddings: the mean engine time of a batch of that
size); docs/observability.md shows what a joiner costs from them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from tidegate.engines.steps import StepTally

LABELS = ("model", "kind", "running")


class StepCollector(Collector):
    def __init__(self, model: str, tally: StepTally) -> None:
        self.model = model
        self.tally = tally

    def collect(self) -> Iterator[Metric]:
        steps = CounterMetricFamily(
            "tidegate_engine_steps",
            "Engine steps (an embeddings batch is one), by kind and sequences or inputs running.",
            labels=LABELS,
        )
        seconds = CounterMetricFamily(
            "tidegate_engine_step_seconds",
            "Time of the engine's steps, by kind and sequences or inputs running.",
            labels=LABELS,
        )
        joins = CounterMetricFamily(
            "tidegate_engine_step_joins",
            "Prompts that joined in the generation engine's steps (their prefill).",
            labels=LABELS,
        )
        for (kind, running), cell in sorted(self.tally.table().items()):
            labels = [self.model, kind, str(running)]
            steps.add_metric(labels, cell.num_steps)
            seconds.add_metric(labels, cell.seconds)
            joins.add_metric(labels, cell.num_joins)
        yield steps
        yield seconds
        yield joins
