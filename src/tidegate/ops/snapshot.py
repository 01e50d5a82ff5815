"""Doctor's input: metric samples at a window's two ends, turned into a core ``Snapshot``.

Three sources give the same ``Samples`` (series -> value at one instant): the Prometheus
text of a running gateway and of its workers (``parse_exposition``; a worker's series get
the ``replica``, ``pool`` and ``model`` labels of the replica that served them), a
Prometheus server's instant queries (``prometheus_samples``), and the gateway's own
registry (``registry_samples``). ``build_snapshot`` takes the deltas of counters and
histograms between the two ends (a counter that went down was reset: its new value is the
delta, as Prometheus's ``increase`` counts it) and the gauges at the end. A simulator
report becomes a snapshot directly (``report_snapshot``).

Request metrics (queue depth, durations, outcomes) are the gateway's: a series of them with
a ``replica`` label is a worker's own count of the same requests and is left out.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tidegate.core.diagnose import ClassWindow, ModelWindow, ReplicaWindow, Snapshot

Labels = frozenset[tuple[str, str]]
Samples = dict[tuple[str, Labels], float]
MB = 1024.0 * 1024.0

# What a worker contributes; the rest of its /metrics repeats what the gateway counts.
WORKER_PREFIXES = (
    "tidegate_batch_size",
    "tidegate_batch_duration_seconds",
    "tidegate_engine_memory_bytes",
    "tidegate_tokenize_seconds",
    "tidegate_worker_",
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "DCGM_FI_DEV_",
)
QUERY = (
    '{__name__=~"tidegate_.+|inference_queue_depth|DCGM_FI_DEV_.+|process_cpu_seconds_total'
    '|process_resident_memory_bytes|process_start_time_seconds"}'
)


def _add(out: Samples, name: str, labels: Mapping[str, str], value: float) -> None:
    if math.isnan(value):
        return
    out[(name, frozenset(labels.items()))] = value


def parse_exposition(text: str, extra: Mapping[str, str] | None = None) -> Samples:
    """Prometheus text format to samples; ``extra`` labels are set on every worker series
    (and only worker series are kept when it is given)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if extra is not None and not sample.name.startswith(WORKER_PREFIXES):
                continue
            _add(out, sample.name, {**sample.labels, **(extra or {})}, float(sample.value))
    return out


def registry_samples(registry: CollectorRegistry) -> Samples:
    out: Samples = {}
    for family in registry.collect():
        for sample in family.samples:
            _add(out, sample.name, sample.labels, float(sample.value))
    return out


def prometheus_samples(result: Iterable[Mapping[str, Any]]) -> Samples:
    """An instant query's ``data.result`` (vector) to samples."""
    out: Samples = {}
    for series in result:
        labels = {k: v for k, v in series["metric"].items() if k != "__name__"}
        _add(out, series["metric"]["__name__"], labels, float(series["value"][1]))
    return out


class _Window:
    """The two ends of the window and the queries the builder asks of them."""

    def __init__(self, before: Samples, after: Samples) -> None:
        self.before = before
        self.after = after

    def series(self, name: str, **match: str) -> list[tuple[dict[str, str], float, float]]:
        """(labels, value before, value after) of every series of ``name`` matching."""
        out = []
        for (n, labels), value in self.after.items():
            if n != name:
                continue
            d = dict(labels)
            if all(d.get(k) == v for k, v in match.items()):
                out.append((d, self.before.get((n, labels), 0.0), value))
        return out

    def delta(self, name: str, **match: str) -> float:
        return sum(_increase(b, a) for _, b, a in self.series(name, **match))

    def gauge(self, name: str, **match: str) -> float | None:
        found = self.series(name, **match)
        return sum(a for _, _, a in found) if found else None

    def gauge_before(self, name: str, **match: str) -> float:
        return sum(b for _, b, _ in self.series(name, **match))

    def quantile(self, q: float, name: str, **match: str) -> float | None:
        """histogram_quantile over the window's bucket increases (linear in a bucket)."""
        buckets: dict[float, float] = defaultdict(float)
        for labels, b, a in self.series(f"{name}_bucket", **match):
            buckets[float(labels["le"])] += _increase(b, a)
        if not buckets or buckets.get(math.inf, 0.0) <= 0:
            return None
        bounds = sorted(buckets)
        rank = q * buckets[math.inf]
        lower, below = 0.0, 0.0
        for bound in bounds:
            count = buckets[bound]
            if count >= rank:
                if math.isinf(bound):
                    return lower  # beyond the last finite bucket: its bound, as Prometheus
                width = count - below
                return lower + (bound - lower) * ((rank - below) / width if width > 0 else 1.0)
            lower, below = bound, count
        return lower

    def mean(self, name: str, **match: str) -> tuple[float | None, float]:
        """(sum/count over the window or None, count)."""
        count = self.delta(f"{name}_count", **match)
        if count <= 0:
            return None, count
        return self.delta(f"{name}_sum", **match) / count, count

    def label_values(self, name: str, label: str, **match: str) -> list[str]:
        values = {labels.get(label, "") for labels, _, _ in self.series(name, **match)}
        return sorted(v for v in values if v)


def _increase(before: float, after: float) -> float:
    return after - before if after >= before else after


def _gateway_only(w: _Window, name: str, model: str) -> list[tuple[dict[str, str], float, float]]:
    return [s for s in w.series(name, model=model) if "replica" not in s[0]]


def _class_window(w: _Window, model: str, priority: str) -> ClassWindow:
    outcomes: dict[str, float] = defaultdict(float)
    for labels, b, a in _gateway_only(w, "tidegate_requests_total", model):
        if labels.get("priority") == priority:
            outcomes[labels["outcome"]] += _increase(b, a)
    depth = [
        s
        for s in _gateway_only(w, "tidegate_queue_depth", model)
        if s[0].get("priority") == priority
    ]
    gateway = {"model": model, "priority": priority}
    return ClassWindow(
        priority=priority,
        outcomes={k: v for k, v in outcomes.items() if v > 0},
        queue_p99_s=_gateway_quantile(w, gateway, "queue"),
        e2e_p99_s=_gateway_quantile(w, gateway, "e2e"),
        queue_mean_s=_gateway_mean(w, gateway, "queue"),
        e2e_mean_s=_gateway_mean(w, gateway, "e2e"),
        queued=sum(a for _, _, a in depth),
        queued_before=sum(b for _, b, _ in depth),
    )


def _gateway_quantile(w: _Window, match: dict[str, str], phase: str) -> float | None:
    name = "tidegate_request_duration_seconds_bucket"
    kept = _Window(
        {k: v for k, v in w.before.items() if k[0] == name and "replica" not in dict(k[1])},
        {k: v for k, v in w.after.items() if k[0] == name and "replica" not in dict(k[1])},
    )
    return kept.quantile(0.99, "tidegate_request_duration_seconds", phase=phase, **match)


def _gateway_mean(w: _Window, match: dict[str, str], phase: str) -> float | None:
    name = "tidegate_request_duration_seconds"
    kept = _Window(
        {
            k: v
            for k, v in w.before.items()
            if k[0].startswith(name) and "replica" not in dict(k[1])
        },
        {k: v for k, v in w.after.items() if k[0].startswith(name) and "replica" not in dict(k[1])},
    )
    return kept.mean(name, phase=phase, **match)[0]


def _replica_window(w: _Window, model: str, replica: str, info: Mapping[str, str]) -> ReplicaWindow:
    m = {"model": model, "replica": replica}
    batch_mean_s, num_batches = w.mean("tidegate_batch_duration_seconds", **m)
    peak = w.gauge("tidegate_engine_memory_bytes", kind="peak", **m)
    devices = w.label_values("tidegate_engine_memory_bytes", "device", kind="peak", **m)
    tokenize = w.series("tidegate_tokenize_seconds_sum", **m)
    cpu = w.series("process_cpu_seconds_total", replica=replica)
    return ReplicaWindow(
        replica=replica,
        pool=info.get("pool", ""),
        url=info.get("url", ""),
        inflight=w.gauge("tidegate_inflight", **m),
        num_batches=num_batches if batch_mean_s is not None else None,
        batch_mean_s=batch_mean_s,
        gpu_util_pct=w.gauge("DCGM_FI_DEV_GPU_UTIL", replica=replica),
        device_free_mb=w.gauge("DCGM_FI_DEV_FB_FREE", replica=replica),
        memory_peak_mb=None if peak is None else peak / MB,
        memory_device=devices[0] if devices else "",
        tokenize_s=w.delta("tidegate_tokenize_seconds_sum", **m) if tokenize else None,
        cpu_s=w.delta("process_cpu_seconds_total", replica=replica) if cpu else None,
    )


def _model_window(
    w: _Window, model: str, levels: Iterable[str], replicas: Mapping[str, Mapping[str, str]]
) -> ModelWindow:
    seen = set(w.label_values("tidegate_requests_total", "priority", model=model))
    seen |= set(w.label_values("tidegate_queue_depth", "priority", model=model))
    ordered = [lv for lv in levels if lv in seen] + sorted(seen - set(levels))
    names = set(replicas) | set(w.label_values("tidegate_inflight", "replica", model=model))
    names |= set(w.label_values("tidegate_batch_size_count", "replica", model=model))
    batch_mean, _ = w.mean("tidegate_batch_size", model=model)
    cold_mean, cold_count = w.mean("tidegate_cold_start_seconds", model=model)
    return ModelWindow(
        model=model,
        classes=tuple(_class_window(w, model, p) for p in ordered),
        replicas=tuple(_replica_window(w, model, r, replicas.get(r, {})) for r in sorted(names)),
        mean_batch_size=batch_mean,
        ready_replicas=w.gauge("tidegate_replicas", model=model, state="ready"),
        signal=w.gauge("inference_queue_depth", model=model),
        scale_ups=w.delta("tidegate_scale_events_total", model=model, direction="up"),
        scale_downs=w.delta("tidegate_scale_events_total", model=model, direction="down"),
        cold_starts=cold_count,
        cold_start_mean_s=cold_mean,
    )


def build_snapshot(
    before: Samples,
    after: Samples,
    window_s: float,
    config: Mapping[str, Any],
    source: str,
    replicas: Mapping[str, Mapping[str, Mapping[str, str]]] | None = None,
) -> Snapshot:
    """A core snapshot of the window between ``before`` and ``after``.

    ``replicas``: model -> replica id -> {pool, url}, where known (/admin/replicas)."""
    w = _Window(before, after)
    replicas = replicas or {}
    models = [m.get("name") for m in config.get("models") or () if isinstance(m, Mapping)]
    found = set(w.label_values("tidegate_requests_total", "model"))
    found |= set(w.label_values("tidegate_queue_depth", "model"))
    names = [m for m in models if isinstance(m, str)] + sorted(found - set(models) - {"-"})
    levels = tuple((config.get("priorities") or {}).get("levels") or ("high", "medium", "low"))
    return Snapshot(
        window_s=window_s,
        models=tuple(_model_window(w, m, levels, replicas.get(m, {})) for m in names),
        config=config,
        source=source,
    )


# ----------------------------------------------------------------------------- simulator


def report_snapshot(
    report: Mapping[str, Any], config: Mapping[str, Any], source: str
) -> list[Snapshot]:
    """One snapshot per run of a ``tidegate simulate`` report (report.json)."""
    model = report["model"]["name"]
    out = []
    for run in report["runs"]:
        overall = run["overall"]
        rows = run["queue_depth"]["rows"]  # [at_s, queued, in_flight, ready_replicas]
        ups = sum(1 for a, b in itertools.pairwise(rows) if b[3] > a[3])
        downs = sum(1 for a, b in itertools.pairwise(rows) if b[3] < a[3])
        last = rows[-1] if rows else [0, 0, 0, 0]
        classes = []
        for name, c in run["classes"].items():
            outcomes = {
                "completed": c["completed"],
                "shed": c["shed"],
                "expired": c["expired"],
                "failed": c["failed"],
                **{f"rejected_{k}": v for k, v in c["rejected"].items()},
            }
            classes.append(
                ClassWindow(
                    priority=name,
                    outcomes={k: float(v) for k, v in outcomes.items() if v},
                    queue_p99_s=c["queue_wait_s"]["p99"],
                    e2e_p99_s=c["e2e_s"]["p99"],
                    queued=float(c["stranded"]),
                )
            )
        window = ModelWindow(
            model=model,
            classes=tuple(classes),
            mean_batch_size=overall["mean_batch_size"],
            ready_replicas=float(last[3]),
            signal=(last[1] + last[2]) / max(1, last[3]),
            scale_ups=float(ups),
            scale_downs=float(downs),
            cold_starts=float(ups),
        )
        out.append(
            Snapshot(
                window_s=float(overall["span_s"] or 0.0),
                models=(window,),
                config=config,
                source=f"{source} ({run['policy']})",
            )
        )
    return out
