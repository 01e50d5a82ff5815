"""Doctor's rules: a window of metrics in, ranked findings with config fixes out.

Design note. A rule is a plain function ``(model window, snapshot, thresholds) -> Finding |
None``; it reads only what the snapshot says and is silent when a number it needs was not
measured (``None``), so a missing metric never turns into an invented one. The shell
(``tidegate.ops``) builds the snapshot from a running gateway (two scrapes a window apart),
from Prometheus (two instants hours apart) or from a simulator report; the gateway itself
evaluates the same rules on its own metrics every few seconds.

Invariants:
- ``diagnose`` is total: any snapshot gives a ranked list (no exception for odd numbers);
- the ranking is by severity (critical first), then by impact (requests affected per
  second, larger first), then by rule name: the same snapshot gives the same order;
- a window without traffic, backlog or memory figures gives no finding;
- every config change names a key of the running config, its current value and a new one
  that differs; ``Finding.config_diff`` renders them as a YAML diff against that config.

The rules follow the troubleshooting table of the second seed, one per row, plus the
priority cases of issue 13 (low starving, high shed, 429 storms, Retry-After ignored).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

SEVERITIES = ("critical", "warning", "info")  # most severe first
REFUSED = ("shed", "rejected_full", "rejected_deadline", "rejected_holdback")  # 429s
TIMED_OUT = ("expired", "rejected_deadline")  # 504 and "would wait past its deadline"
DEFAULT_LEVELS = ("high", "medium", "low")


# ----------------------------------------------------------------------------- the input


@dataclass(frozen=True, slots=True)
class ClassWindow:
    """One model x priority level over the window."""

    priority: str
    outcomes: Mapping[str, float] = field(default_factory=dict)  # outcome -> count in window
    queue_p99_s: float | None = None  # gateway queue wait
    e2e_p99_s: float | None = None
    # Means over the window (histogram sum / count), where the source has them: the share of
    # time spent queueing, read without the p99s' bucket coarseness.
    queue_mean_s: float | None = None
    e2e_mean_s: float | None = None
    queued: float = 0.0  # waiting at the window's end
    queued_before: float = 0.0  # waiting at its start

    @property
    def num_requests(self) -> float:
        return sum(self.outcomes.values())

    def count(self, *outcomes: str) -> float:
        return sum(self.outcomes.get(o, 0.0) for o in outcomes)


@dataclass(frozen=True, slots=True)
class ReplicaWindow:
    """One replica (worker process) over the window; None: not measured."""

    replica: str
    pool: str = ""
    url: str = ""
    inflight: float | None = None  # gateway's in-flight count at the end
    num_batches: float | None = None
    batch_mean_s: float | None = None  # engine seconds per batch
    gpu_util_pct: float | None = None  # DCGM_FI_DEV_GPU_UTIL
    device_free_mb: float | None = None  # DCGM_FI_DEV_FB_FREE
    memory_peak_mb: float | None = None  # tidegate_engine_memory_bytes{kind=peak}
    memory_device: str = ""  # its device label: cuda:N, or cpu (the peak is then the RSS)
    tokenize_s: float | None = None  # tidegate_tokenize_seconds_sum, in the window
    cpu_s: float | None = None  # process_cpu_seconds_total, in the window


@dataclass(frozen=True, slots=True)
class ModelWindow:
    """One model over the window: its classes, its replicas, its autoscaler's record."""

    model: str
    classes: tuple[ClassWindow, ...] = ()
    replicas: tuple[ReplicaWindow, ...] = ()
    mean_batch_size: float | None = None  # tidegate_batch_size, in the window
    ready_replicas: float | None = None
    signal: float | None = None  # inference_queue_depth at the end; None: absent
    scale_ups: float = 0.0
    scale_downs: float = 0.0
    cold_starts: float = 0.0
    cold_start_mean_s: float | None = None

    def level(self, name: str) -> ClassWindow | None:
        return next((c for c in self.classes if c.priority == name), None)

    @property
    def num_requests(self) -> float:
        return sum(c.num_requests for c in self.classes)

    @property
    def queued(self) -> float:
        return sum(c.queued for c in self.classes)

    @property
    def queued_before(self) -> float:
        return sum(c.queued_before for c in self.classes)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What doctor knows: a window of metrics and the running config (``{}``: unknown).

    ``config`` has the shape ``tidegate config check`` prints (models as a list of
    mappings with ``name``)."""

    window_s: float
    models: tuple[ModelWindow, ...]
    config: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""

    def model_config(self, name: str) -> Mapping[str, Any]:
        for model in self.config.get("models") or ():
            if isinstance(model, Mapping) and model.get("name") == name:
                return model
        return {}

    def levels(self) -> tuple[str, ...]:
        levels = (self.config.get("priorities") or {}).get("levels")
        return tuple(levels) if levels else DEFAULT_LEVELS


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When a number counts as a symptom. Defaults suit interactive serving."""

    p99_slo_s: float = 1.0  # end-to-end p99 above this is "high latency"
    queue_share: float = 0.5  # queue wait p99 at least this share of e2e p99: "queueing"
    small_batch_share: float = 0.5  # mean batch at most this share of the max: "small"
    memory_near: float = 0.9  # engine peak over its memory_mb ask: near the limit
    memory_jump: float = 1.2  # ... and beyond it: the model changed
    device_not_full: float = 0.25  # free share of the device that counts as "not full"
    slow_replica: float = 2.0  # a replica's batch time over the others' median
    refused_share: float = 0.2  # 429s over all requests: a storm
    min_refused_per_s: float = 1.0
    retry_storm_ratio: float = 3.0  # 429s per completed request: clients retry at once
    starving_share: float = 0.1  # least urgent level timed out at least this share
    timeout_share: float = 0.01  # timed-out share after a scale-in
    tokenize_loop_share: float = 0.5  # of the window spent tokenizing (one event loop)
    tokenize_share: float = 0.3  # of the worker's CPU time, when it is CPU-bound
    cpu_busy: float = 0.8  # CPU seconds per second: the worker is CPU-bound
    accelerator_idle_pct: float = 50.0


# ----------------------------------------------------------------------------- the output


@dataclass(frozen=True, slots=True)
class ConfigChange:
    """Set ``path`` (under ``models[name=model]``, or the top level when model is None)."""

    model: str | None
    path: tuple[str, ...]
    old: Any
    new: Any


@dataclass(frozen=True, slots=True)
class Finding:
    rule: str
    severity: str  # one of SEVERITIES
    model: str
    symptom: str
    numbers: Mapping[str, float]
    cause: str
    fix: str
    changes: tuple[ConfigChange, ...] = ()
    impact: float = 0.0  # requests affected per second (ranking)

    @property
    def config_diff(self) -> str:
        return render_diff(self.changes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "severity": self.severity,
            "model": self.model,
            "symptom": self.symptom,
            "numbers": dict(self.numbers),
            "cause": self.cause,
            "fix": self.fix,
            "config_diff": self.config_diff,
            "impact": round(self.impact, 4),
        }


@dataclass(frozen=True, slots=True)
class Diagnosis:
    findings: tuple[Finding, ...]
    not_measured: tuple[str, ...]  # "rule: what it needs" for rules that could not look

    @property
    def exit_status(self) -> int:
        """2 when a finding is critical (for cron and CI), else 0."""
        return 2 if any(f.severity == "critical" for f in self.findings) else 0


# ----------------------------------------------------------------------------- helpers


def _rate(count: float, snapshot: Snapshot) -> float:
    return count / snapshot.window_s if snapshot.window_s > 0 else count


def _get(config: Mapping[str, Any], *path: str) -> Any:
    node: Any = config
    for key in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    return node


def _num(value: Any, default: float) -> float:
    return (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default
    )


def _worst_p99(model: ModelWindow) -> tuple[ClassWindow | None, float]:
    """The level with the highest end-to-end p99 among those that had requests."""
    known = [
        (c, c.e2e_p99_s) for c in model.classes if c.e2e_p99_s is not None and c.num_requests > 0
    ]
    if not known:
        return None, 0.0
    c, p99 = max(known, key=lambda pair: pair[1] or 0.0)
    return c, p99 or 0.0


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _at_max(m: ModelWindow, cfg: Mapping[str, Any]) -> bool:
    """An autoscaled model whose ready replicas are at its ``max_replicas``."""
    maximum = _get(cfg, "autoscaling", "max_replicas")
    return isinstance(maximum, int) and (m.ready_replicas or 0.0) >= maximum


def _change(
    model: str | None, config: Mapping[str, Any], path: tuple[str, ...], new: Any
) -> ConfigChange:
    old = _get(config, *path)
    return ConfigChange(model, path, old, new)


# ----------------------------------------------------------------------------- the rules

Rule = Callable[[ModelWindow, Snapshot, Thresholds], "Finding | None"]


def rule_batches_too_small(m: ModelWindow, s: Snapshot, t: Thresholds) -> Finding | None:
    """Low utilisation but high p99: requests queue while batches stay small."""
    worst, p99 = _worst_p99(m)
    if worst is None or p99 <= t.p99_slo_s or m.mean_batch_size is None:
        return None
    queue_p99 = worst.queue_p99_s or 0.0
    if worst.queue_mean_s is not None and worst.e2e_mean_s:
        queueing = worst.queue_mean_s >= t.queue_share * worst.e2e_mean_s
    else:
        queueing = queue_p99 >= t.queue_share * p99
    if not queueing:
        return None  # the time goes elsewhere than the queue
    gpu = [r.gpu_util_pct for r in m.replicas if r.gpu_util_pct is not None]
    if gpu and max(gpu) >= t.accelerator_idle_pct:
        return None  # the accelerator is busy: a capacity problem, not a batching one
    cfg = s.model_config(m.model)
    generate = cfg.get("task") == "generate"
    key = "max_num_seqs" if generate else "max_batch_size"
    max_batch = _num(_get(cfg, "batching", key), 32.0)
    window_ms = _num(_get(cfg, "batching", "batch_window_ms"), 5.0)
    if (
        m.mean_batch_size > max(1.0, t.small_batch_share * max_batch)
        and m.mean_batch_size < 0.8 * max_batch
    ):
        return None  # batches are neither small nor capped
    changes: list[ConfigChange] = []
    if m.mean_batch_size >= 0.8 * max_batch:
        cause = f"batches are full at {key} {max_batch:g}: the replica cannot take more at once"
        changes.append(_change(m.model, cfg, ("batching", key), int(max_batch * 2)))
    else:
        cause = "batches leave before they fill: the batch window is short for this arrival rate"
        changes.append(
            _change(m.model, cfg, ("batching", "batch_window_ms"), max(10.0, window_ms * 2))
        )
        slots = _get(cfg, "slots")
        if isinstance(slots, int) and slots < 2 * max_batch:
            cause += f", and slots {slots} lets the replica hold fewer requests than a batch"
            changes.append(_change(m.model, cfg, ("slots",), int(2 * max_batch)))
    inflight = [r.inflight for r in m.replicas if r.inflight is not None]
    numbers = {
        "e2e_p99_s": p99,
        "queue_p99_s": queue_p99,
        "mean_batch_size": m.mean_batch_size,
        key: max_batch,
    }
    fix = "raise the batch window or the largest batch"
    if len(inflight) > 1:
        numbers["inflight_max"], numbers["inflight_min"] = max(inflight), min(inflight)
        if max(inflight) > 2 * max(1.0, min(inflight)):
            fix += "; routing is uneven across replicas: check their health and slots"
    return Finding(
        "batches_too_small",
        "warning",
        m.model,
        f"{m.model}: p99 {p99:.2f}s ({worst.priority}) of which {queue_p99:.2f}s queueing, "
        f"while batches average {m.mean_batch_size:.1f} of {max_batch:g}",
        numbers,
        cause,
        fix,
        tuple(changes),
        _rate(m.num_requests, s),
    )


def rule_memory(m: ModelWindow, s: Snapshot, t: Thresholds) -> Finding | None:
    """Memory near the limit while the device is not full; far beyond it: the model changed."""
    cfg = s.model_config(m.model)
    ask_mb = _num(cfg.get("memory_mb"), 0.0)
    peaks = [r for r in m.replicas if r.memory_peak_mb is not None]
    if ask_mb <= 0 or not peaks:
        return None
    top = max(peaks, key=lambda r: r.memory_peak_mb or 0.0)
    peak = top.memory_peak_mb or 0.0
    share = peak / ask_mb
    if share < t.memory_near:
        return None
    numbers = {"memory_peak_mb": peak, "memory_mb": ask_mb, "share": round(share, 3)}
    if top.device_free_mb is not None:
        numbers["device_free_mb"] = top.device_free_mb
    new_ask = math.ceil(peak * 1.25)
    # The ask is a limit only where placement counts it: a GPU or a declared device. On a host
    # whose memory nothing places by (devices: auto on CPU) nothing caps a replica near it.
    placed = top.memory_device.startswith("cuda") or bool(s.config.get("devices"))
    if share >= t.memory_jump:
        # Overcommitted placement is an outage where memory is placed by; elsewhere a warning
        # that the ask is stale.
        return Finding(
            "memory_jump",
            "critical" if placed else "warning",
            m.model,
            f"{m.model}: replica {top.replica} peaks at {peak:.0f} MB, {share:.0%} of the "
            f"{ask_mb:.0f} MB it asks",
            numbers,
            "the model or its cache policy changed since its memory was measured: placement "
            "counts the old size and overcommits the device",
            f"redo the capacity profile (tidegate profile --model {m.model}) and ask what it "
            "measures",
            (_change(m.model, cfg, ("memory_mb",), new_ask),),
            _rate(m.num_requests, s) + 1.0,
        )
    if not placed:
        return None
    generate = cfg.get("task") == "generate"
    key = "max_num_seqs" if generate else "max_batch_size"
    current = int(_num(_get(cfg, "batching", key), 16.0 if generate else 32.0))
    not_full = top.device_free_mb is None or top.device_free_mb >= t.device_not_full * (
        top.device_free_mb + peak
    )
    cause = (
        "the replica's own cap is the limit (KV cache / batch buffers), not the device"
        if not_full
        else "the device itself is nearly full: fragmentation or too many replicas on it"
    )
    return Finding(
        "memory_near_limit",
        "warning",
        m.model,
        f"{m.model}: replica {top.replica} at {share:.0%} of its {ask_mb:.0f} MB",
        numbers,
        cause,
        "cap the KV cache / batch (fewer sequences or inputs at once), give the replica more "
        "memory, or defragment (tidegate defrag --dry-run)",
        (
            _change(m.model, cfg, ("batching", key), max(1, current * 3 // 4)),
            _change(m.model, cfg, ("memory_mb",), new_ask),
        ),
        _rate(m.num_requests, s),
    )


def rule_scale_out_latency(m: ModelWindow, s: Snapshot, t: Thresholds) -> Finding | None:
    """Latency up after a scale-out: cold starts without warm-up, or skewed routing."""
    worst, p99 = _worst_p99(m)
    if m.scale_ups <= 0 or m.cold_starts <= 0 or worst is None or p99 <= t.p99_slo_s:
        return None
    cfg = s.model_config(m.model)
    numbers = {"scale_ups": m.scale_ups, "cold_starts": m.cold_starts, "e2e_p99_s": p99}
    if m.cold_start_mean_s is not None:
        numbers["cold_start_mean_s"] = m.cold_start_mean_s
    minimum = int(_num(_get(cfg, "autoscaling", "min_replicas"), 1.0))
    changes = [
        _change(m.model, cfg, ("autoscaling", "min_replicas"), minimum + math.ceil(m.scale_ups))
    ]
    if _get(cfg, "probe_max_ms") is None:
        changes.append(
            _change(m.model, cfg, ("probe_max_ms",), round(max(1.0, t.p99_slo_s * 1e3 / 2)))
        )
    cold = f" taking {m.cold_start_mean_s:.1f}s each" if m.cold_start_mean_s is not None else ""
    return Finding(
        "scale_out_latency",
        "warning",
        m.model,
        f"{m.model}: p99 {p99:.2f}s ({worst.priority}) in a window with {m.scale_ups:g} "
        f"scale-up(s) and {m.cold_starts:g} cold start(s){cold}",
        numbers,
        "new replicas start cold (model load, no warm-up) while demand waits, or traffic "
        "lands unevenly on them",
        "keep warm capacity before the peak (a higher minimum or a schedule), and let a "
        "replica take traffic only once a probe after warm-up is fast",
        tuple(changes),
        _rate(m.num_requests, s),
    )


def rule_noisy_neighbour(m: ModelWindow, s: Snapshot, t: Thresholds) -> Finding | None:
    """One replica slow while the others of the same model are fine."""
    timed = [r for r in m.replicas if r.batch_mean_s is not None and (r.num_batches or 0.0) >= 5]
    if len(timed) < 2:
        return None
    slow = max(timed, key=lambda r: r.batch_mean_s or 0.0)
    others = _median([r.batch_mean_s or 0.0 for r in timed if r is not slow])
    slow_s = slow.batch_mean_s or 0.0
    if others <= 0 or slow_s < t.slow_replica * others:
        return None
    cfg = s.model_config(m.model)
    changes: tuple[ConfigChange, ...] = ()
    if cfg.get("gpu", "shared") == "shared" and cfg.get("engine") != "openai":
        changes = (_change(m.model, cfg, ("gpu",), "exclusive"),)
    where = slow.url or slow.replica
    return Finding(
        "noisy_neighbour",
        "warning",
        m.model,
        f"{m.model}: replica {slow.replica} takes {slow_s * 1e3:.0f} ms per batch, "
        f"{slow_s / others:.1f}x the other replicas' {others * 1e3:.0f} ms",
        {"slow_batch_s": slow_s, "others_batch_s": others, "ratio": round(slow_s / others, 2)},
        f"the device under {where} is shared and a neighbour takes its compute",
        "move the latency-sensitive model to a whole device (gpu: exclusive) or a dedicated pool",
        changes,
        _rate(m.num_requests, s) / len(timed),
    )


def rule_autoscale_stuck(m: ModelWindow, s: Snapshot, t: Thresholds) -> Finding | None:
    """A backlog that stays (queued at both ends of the window) or builds up under traffic,
    while the autoscaler adds nothing."""
    cfg = s.model_config(m.model)
    scaling = cfg.get("autoscaling")
    if not isinstance(scaling, Mapping) or m.scale_ups > 0:
        return None
    if m.queued <= 0 or (m.queued_before <= 0 and m.num_requests <= 0):
        return None  # no backlog now, or one that only just appeared in an idle window
    target = _num(scaling.get("target_per_replica"), 8.0)
    maximum = int(_num(scaling.get("max_replicas"), 1.0))
    ready = m.ready_replicas
    numbers = {"queued": m.queued, "queued_before": m.queued_before, "target_per_replica": target}
    if ready is not None:
        numbers["ready_replicas"] = ready
    if m.signal is None:
        cause = "inference_queue_depth is absent: the autoscaler (or the HPA) has no signal"
        fix = "export the signal where the autoscaler reads it (Prometheus Adapter for an HPA)"
        changes: tuple[ConfigChange, ...] = ()
    elif m.signal <= 0:
        numbers["inference_queue_depth"] = m.signal
        cause = "inference_queue_depth stays at 0 while the queue grows: the signal is stale"
        fix = "check what exports inference_queue_depth and that the autoscaler reads it fresh"
        changes = ()
    elif ready is not None and ready >= maximum:
        numbers["inference_queue_depth"] = m.signal
        cause = f"the model is at max_replicas {maximum}"
        fix = "allow more replicas (if the devices have room), or shed earlier"
        changes = (_change(m.model, cfg, ("autoscaling", "max_replicas"), maximum * 2),)
    elif scaling.get("target_rate_per_replica") is not None:
        # Sized on the arrival rate: the queue's gauge is not what it compares.
        rate_target = _num(scaling.get("target_rate_per_replica"), 1.0)
        per_replica = _rate(m.num_requests, s) / max(1.0, ready or 1.0)
        if per_replica >= rate_target * (1 + _num(scaling.get("tolerance"), 0.1)):
            return None  # the rate asks for more: a decision is pending, not stuck
        served = sum(c.count("completed") for c in m.classes)
        served_per_replica = _rate(served, s) / max(1.0, ready or 1.0)
        numbers |= {
            "arrivals_per_s_per_replica": round(per_replica, 3),
            "completed_per_s_per_replica": round(served_per_replica, 3),
            "target_rate_per_replica": rate_target,
        }
        cause = (
            f"the threshold is wrong: {per_replica:.3g} arrivals/s per ready replica stay "
            f"under target_rate_per_replica {rate_target:g} while the queue grows"
        )
        fix = "lower target_rate_per_replica to what one replica serves within its SLO"
        # What a replica completed while the queue grew is about what it can serve.
        basis = served_per_replica if served_per_replica > 0 else per_replica / 2
        new_rate = float(f"{0.9 * basis:.3g}")
        key = ("autoscaling", "target_rate_per_replica")
        changes = (_change(m.model, cfg, key, new_rate),)
    elif m.signal < target * (1 + _num(scaling.get("tolerance"), 0.1)):
        numbers["inference_queue_depth"] = m.signal
        cause = (
            f"the threshold is wrong: demand per replica {m.signal:.1f} stays under "
            f"target_per_replica {target:g}"
        )
        fix = "lower target_per_replica to what one replica serves within its SLO"
        new_target = max(1, math.floor(m.signal / 2))  # an int in the diff, compiled or not
        changes = (_change(m.model, cfg, ("autoscaling", "target_per_replica"), new_target),)
    else:
        return None  # the signal asks for more: a decision is pending, not stuck
    return Finding(
        "autoscale_stuck",
        "warning",
        m.model,
        f"{m.model}: {m.queued:g} requests queued (from {m.queued_before:g}) and no scale-up "
        f"in {s.window_s:.0f}s",
        numbers,
        cause,
        fix,
        changes,
        _rate(m.queued, s),
    )


def rule_scale_in_timeouts(m: ModelWindow, s: Snapshot, t: Thresholds) -> Finding | None:
    """Timeouts after a scale-in: the scale-down was too fast."""
    total = m.num_requests
    timed_out = sum(c.count(*TIMED_OUT) for c in m.classes)
    if m.scale_downs <= 0 or total <= 0 or timed_out < max(1.0, t.timeout_share * total):
        return None
    cfg = s.model_config(m.model)
    window = _num(_get(cfg, "autoscaling", "scale_down", "stabilization_window_s"), 600.0)
    return Finding(
        "scale_in_timeouts",
        "warning",
        m.model,
        f"{m.model}: {timed_out:g} of {total:g} requests timed out in a window with "
        f"{m.scale_downs:g} scale-down(s)",
        {"timed_out": timed_out, "requests": total, "scale_downs": m.scale_downs},
        "replicas were removed too fast (many at once, or before demand settled); the rest "
        "take their queue",
        "lengthen the scale-down stabilization window and cap what one period removes",
        (
            _change(
                m.model,
                cfg,
                ("autoscaling", "scale_down", "stabilization_window_s"),
                max(600.0, 2 * window),
            ),
            _change(
                m.model,
                cfg,
                ("autoscaling", "scale_down", "policies"),
                [{"type": "percent", "value": 10, "period_s": 60.0}],
            ),
        ),
        _rate(timed_out, s),
    )


def rule_tokenize_bound(m: ModelWindow, s: Snapshot, t: Thresholds) -> Finding | None:
    """The worker is bound by tokenizing (on its event loop) while its accelerator idles."""
    for r in m.replicas:
        if r.tokenize_s is None or s.window_s <= 0:
            continue
        loop_share = r.tokenize_s / s.window_s  # tokenizing holds the worker's event loop
        busy = None if r.cpu_s is None else r.cpu_s / s.window_s
        cpu_share = r.tokenize_s / r.cpu_s if r.cpu_s else 0.0
        cpu_bound = busy is not None and busy >= t.cpu_busy and cpu_share >= t.tokenize_share
        if loop_share < t.tokenize_loop_share and not cpu_bound:
            continue
        if r.gpu_util_pct is not None and r.gpu_util_pct >= t.accelerator_idle_pct:
            continue
        gpu = "not measured" if r.gpu_util_pct is None else f"{r.gpu_util_pct:.0f}%"
        numbers = {"tokenize_s": r.tokenize_s, "tokenize_share_of_window": round(loop_share, 3)}
        if busy is not None:
            numbers["cpu_per_s"] = round(busy, 3)
        if r.gpu_util_pct is not None:
            numbers["gpu_util_pct"] = r.gpu_util_pct
        return Finding(
            "tokenize_bound",
            "warning",
            m.model,
            f"{m.model}: replica {r.replica} spent {r.tokenize_s:.1f}s of {s.window_s:.0f}s "
            f"tokenizing"
            + ("" if busy is None else f", {busy:.2f} CPU-s per second")
            + f"; accelerator utilisation {gpu}",
            numbers,
            "pre-processing (tokenization) on the CPU is the bottleneck, not the accelerator",
            "tokenize on more cores: more, smaller replicas per device, a fast (Rust) "
            "tokenizer, shorter or pre-tokenized inputs",
            (),
            _rate(m.num_requests, s),
        )
    return None


def rule_low_starving(m: ModelWindow, s: Snapshot, t: Thresholds) -> Finding | None:
    """The least urgent level waits out its deadline while the others are served."""
    present = [c for c in (m.level(lv) for lv in s.levels()) if c is not None]
    if len(present) < 2:
        return None
    low = present[-1]
    served = sum(c.count("completed") for c in present[:-1])
    lost = low.count("expired", "rejected_deadline", "rejected_holdback", "shed")
    if low.num_requests <= 0 or served <= 0 or lost < max(1.0, t.starving_share * low.num_requests):
        return None
    cfg = s.config
    rate = _num(_get(cfg, "priorities", "aging", "rate_per_s"), 0.5)
    threshold = _num(_get(cfg, "priorities", "aging", "threshold_s"), 30.0)
    numbers = {"lost": lost, "requests": low.num_requests, "served_above": served}
    if low.queue_p99_s is not None:
        numbers["queue_p99_s"] = low.queue_p99_s
    return Finding(
        "low_priority_starving",
        "warning",
        m.model,
        f"{m.model}: {lost:g} of {low.num_requests:g} {low.priority} requests timed out or "
        f"were refused while {served:g} more urgent ones completed",
        numbers,
        "the more urgent levels take every free slot; aging does not lift the least urgent "
        "level before its deadline",
        "age faster (or from earlier), give the low level a longer deadline, or add "
        "capacity for it (a shared pool)",
        (
            ConfigChange(None, ("priorities", "aging", "rate_per_s"), rate, max(1.0, rate * 2)),
            ConfigChange(None, ("priorities", "aging", "threshold_s"), threshold, threshold / 2),
        ),
        _rate(lost, s),
    )


def rule_high_shed(m: ModelWindow, s: Snapshot, t: Thresholds) -> Finding | None:
    """The most urgent level is refused, shed or expires: critical."""
    levels = s.levels()
    high = m.level(levels[0])
    if high is None:
        return None
    lost = high.count(*REFUSED, "expired")
    if lost <= 0:
        return None
    cfg = s.model_config(m.model)
    size = int(_num(_get(cfg, "queue", "max_size"), 1000.0))
    changes = [_change(m.model, cfg, ("queue", "max_size"), size * 2)]
    if _at_max(m, cfg):
        maximum = int(_num(_get(cfg, "autoscaling", "max_replicas"), 1.0))
        changes.append(_change(m.model, cfg, ("autoscaling", "max_replicas"), maximum * 2))
    by = {o: high.count(o) for o in (*REFUSED, "expired") if high.count(o)}
    return Finding(
        "high_priority_shed",
        "critical",
        m.model,
        f"{m.model}: {lost:g} of {high.num_requests:g} {high.priority} requests refused or "
        f"expired ({', '.join(f'{o} {n:g}' for o, n in by.items())})",
        {"lost": lost, "requests": high.num_requests, **by},
        "the queue or the replicas are full of the most urgent work itself: capacity is "
        "short of the interactive load",
        "add capacity for the top level (more replicas or a dedicated pool) and a longer "
        "queue for it",
        tuple(changes),
        _rate(lost, s) * 10,
    )


def rule_rejection_storm(m: ModelWindow, s: Snapshot, t: Thresholds) -> Finding | None:
    """Many 429s: admission refuses a large share of what arrives."""
    refused = sum(c.count(*REFUSED) for c in m.classes)
    total = m.num_requests
    if total <= 0 or refused < t.refused_share * total or _rate(refused, s) < t.min_refused_per_s:
        return None
    cfg = s.model_config(m.model)
    changes: tuple[ConfigChange, ...] = ()
    if _at_max(m, cfg):  # below its max, the autoscaler can still add: no config to change
        maximum = int(_num(_get(cfg, "autoscaling", "max_replicas"), 1.0))
        changes = (_change(m.model, cfg, ("autoscaling", "max_replicas"), maximum * 2),)
    return Finding(
        "rejection_storm",
        "warning",
        m.model,
        f"{m.model}: {refused:g} of {total:g} requests answered 429 ({_rate(refused, s):.1f}/s)",
        {"refused": refused, "requests": total, "refused_per_s": round(_rate(refused, s), 3)},
        "arrivals exceed what the replicas drain; the bounded queue refuses the rest",
        "add capacity (replicas, max_replicas) or lower the offered load",
        changes,
        _rate(refused, s),
    )


def rule_retry_after_ignored(m: ModelWindow, s: Snapshot, t: Thresholds) -> Finding | None:
    """429s far outnumber completions: clients come straight back instead of waiting."""
    refused = sum(c.count(*REFUSED) for c in m.classes)
    completed = sum(c.count("completed") for c in m.classes)
    if _rate(refused, s) < t.min_refused_per_s or refused < t.retry_storm_ratio * max(
        1.0, completed
    ):
        return None
    return Finding(
        "retry_after_ignored",
        "warning",
        m.model,
        f"{m.model}: {refused:g} 429s against {completed:g} completions "
        f"({refused / max(1.0, completed):.1f} per completion)",
        {"refused": refused, "completed": completed},
        "clients retry at once instead of waiting the Retry-After the gateway sends",
        "make clients honour Retry-After (the openai SDK does; custom loops must sleep it), "
        "with jitter",
        (),
        _rate(refused, s) / 2,
    )


RULES: tuple[tuple[Rule, tuple[str, ...]], ...] = (
    # (rule, the metrics it cannot look without: reported as "not measured" when absent)
    (rule_high_shed, ()),
    (rule_memory, ("tidegate_engine_memory_bytes",)),
    (rule_batches_too_small, ("tidegate_batch_size",)),
    (rule_scale_out_latency, ()),
    (rule_noisy_neighbour, ("tidegate_batch_duration_seconds of two or more replicas",)),
    (rule_autoscale_stuck, ()),
    (rule_scale_in_timeouts, ()),
    (rule_tokenize_bound, ("tidegate_tokenize_seconds",)),
    (rule_low_starving, ()),
    (rule_rejection_storm, ()),
    (rule_retry_after_ignored, ()),
)
RULE_NAMES = (
    "high_priority_shed",
    "memory_jump",
    "memory_near_limit",
    "batches_too_small",
    "scale_out_latency",
    "noisy_neighbour",
    "autoscale_stuck",
    "scale_in_timeouts",
    "tokenize_bound",
    "low_priority_starving",
    "rejection_storm",
    "retry_after_ignored",
)


def _missing(model: ModelWindow, needs: tuple[str, ...]) -> bool:
    """A rule needing per-replica worker metrics finds none of them in this window."""
    if not needs:
        return False
    if needs[0] == "tidegate_engine_memory_bytes":
        return all(r.memory_peak_mb is None for r in model.replicas)
    if needs[0] == "tidegate_batch_size":
        return model.mean_batch_size is None
    if needs[0].startswith("tidegate_batch_duration"):
        return sum(r.batch_mean_s is not None for r in model.replicas) < 2
    return all(r.tokenize_s is None for r in model.replicas)


def diagnose(snapshot: Snapshot, thresholds: Thresholds | None = None) -> Diagnosis:
    """Every rule over every model, ranked (see the module's invariants)."""
    t = thresholds or Thresholds()
    findings: list[Finding] = []
    not_measured: list[str] = []
    for model in snapshot.models:
        for rule, needs in RULES:
            if _missing(model, needs):
                not_measured.append(f"{model.model}: {rule.__name__[5:]}: {', '.join(needs)}")
                continue
            finding = rule(model, snapshot, t)
            if finding is not None:
                # a change to the value it already has is no fix (e.g. a window already long)
                kept = tuple(c for c in finding.changes if c.old != c.new)
                findings.append(replace(finding, changes=kept))
    findings.sort(key=lambda f: (SEVERITIES.index(f.severity), -f.impact, f.rule, f.model))
    return Diagnosis(tuple(findings), tuple(not_measured))


# ----------------------------------------------------------------------------- YAML diff


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_scalar(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    text = str(value)
    plain = (
        text
        and all(ch.isalnum() or ch in "._-/" for ch in text)
        and text not in ("null", "true", "false")
    )
    return text if plain else '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_diff(changes: Sequence[ConfigChange]) -> str:
    """The changes as a unified-style YAML diff against the running config.

    Context lines (`` ``) locate a key; ``-`` is the running value (``null``: unset, the
    default applies), ``+`` the new one. Changes of one model share its ``- name:`` line.
    """
    lines: list[str] = []
    by_model: dict[str | None, list[ConfigChange]] = {}
    for change in changes:
        by_model.setdefault(change.model, []).append(change)
    for model, group in by_model.items():
        indent = ""
        if model is not None:
            lines += [" models:", f" - name: {model}"]
            indent = "  "
        opened: tuple[str, ...] = ()
        for change in group:
            parents = change.path[:-1]
            common = 0
            while common < min(len(opened), len(parents)) and opened[common] == parents[common]:
                common += 1
            for depth in range(common, len(parents)):
                lines.append(f" {indent}{'  ' * depth}{parents[depth]}:")
            opened = parents
            pad = indent + "  " * len(parents)
            lines.append(f"-{pad}{change.path[-1]}: {_scalar(change.old)}")
            lines.append(f"+{pad}{change.path[-1]}: {_scalar(change.new)}")
    return "\n".join(lines) + ("\n" if lines else "")
