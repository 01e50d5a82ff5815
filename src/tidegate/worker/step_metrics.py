"""The generation engine's step table (``tidegate.engines.steps``) as Prometheus counters.

Read from the engine's ``StepTally`` at each scrape, so the engine's thread pays a dict
update per step and nothing else. Three counters, labels ``model``, ``kind`` (decode, join,
start) and ``running`` (sequences in the step, joiners included):

- ``tidegate_engine_steps_total``: engine steps;
- ``tidegate_engine_step_seconds_total``: their time;
- ``tidegate_engine_step_joins_total``: prompts that joined in them.

``rate(tidegate_engine_step_seconds_total[1m]) / rate(tidegate_engine_steps_total[1m])`` is
the mean step by kind and batch; docs/observability.md shows what a joiner costs from them.
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
            "Generation engine steps, by kind and sequences running.",
            labels=LABELS,
        )
        seconds = CounterMetricFamily(
            "tidegate_engine_step_seconds",
            "Time of the generation engine's steps, by kind and sequences running.",
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
