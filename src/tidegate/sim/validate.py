"""``tidegate simulate --validate RUN``: a recorded real run replayed through the simulator.

A *run file* (docs/simulator.md, "Validating against a real run") holds what one real run of
``tidegate serve`` saw: the serve config it ran with, the arrival schedule (when each request
was sent, its priority and token counts) and each request's outcome (HTTP status) and
latencies, measured by the client from the request's scheduled send time, plus the round
trip of a lone request on the idle server. ``benchmarks/bench_sim_fidelity.py`` writes
them; anything that can write the JSON below can too.

The replay uses the same config (parsed by the server's own loader), the given service model
(a profile) and the identical arrivals. The round trip the simulator does not model (HTTP,
JSON, the proxy) is the run's idle round trip minus what the simulator predicts for one lone
request on an idle replica, added to every request as ``network_s``: a measurement of the
run, not a fitted parameter. When the run file also has the engine time the worker reported
for those lone requests (``idle_engine_ms``), that replaces the profile's (see
``network_s_for``).

Compared per priority: p50/p95/p99 of completed requests (end to end; generation also time
to first token), throughput (completed per second over the side's own span, first arrival
to last completion) and the outcome counts (completed, 429, 504, and any other status),
each with its error ``(simulated - measured) / measured``. A count whose measured value is
under 1% of the class's requests is compared as a share of the class instead (0 against 3
of 3,000 is 0.1%, not infinite). The verdict: p50 and p95 within 15%, throughput within 5%
and counts within 10% (``Tolerances``). ``--sensitivity S`` adds each figure replayed with
the engine S faster and S slower, and a diagnostic count beside the verdict (``validate``).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tidegate.config.loading import parse_config
from tidegate.engines.profile import EngineProfile
from tidegate.engines.steps import (
    BATCH,
    StepTable,
    profile_at_steps,
    step_rows,
    table_of_rows,
)
from tidegate.errors import ConfigError
from tidegate.sim.run import RunResult, Scenario, Simulation
from tidegate.sim.service import ServiceModel, from_profile, scaled
from tidegate.sim.workload import Arrival, Listed

RUN_FORMAT = "tidegate-run"
RUN_VERSION = 1
# The HTTP status the server answers for each terminal outcome of the simulator.
STATUS_OF_OUTCOME = {
    "completed": 200,
    "shed": 429,
    "rejected_full": 429,
    "rejected_deadline": 429,
    "rejected_holdback": 429,
    "unavailable": 503,
    "expired": 504,
    "failed": 502,
    "unservable": 0,  # still queued at the end: no answer
    "stranded": 0,
}
SMALL_COUNT_SHARE = 0.01


@dataclass(frozen=True, slots=True)
class RunRequest:
    """One request of a recorded run."""

    at_s: float  # scheduled send time, seconds from the run's start
    priority: str | None
    prompt_tokens: int
    output_tokens: int  # 0 for embeddings
    status: int  # HTTP status; 0: no answer (connection error, cut off at the end)
    latency_s: float | None  # end to end, from at_s
    ttft_s: float | None = None  # generation: to the first token, from at_s


@dataclass(frozen=True)
class RecordedRun:
    model: str
    task: str  # embeddings or generate
    config: Mapping[str, Any]  # the serve config, as its YAML/JSON parses
    requests: tuple[RunRequest, ...]
    idle_round_trip_s: float | None = None  # a lone request on the idle server (median)
    source: str = "<run>"
    meta: Mapping[str, Any] = field(default_factory=dict)  # who recorded it, when, where
    idle_engine_s: float | None = None  # embeddings: the worker's engine time per lone batch
    # What the worker's /metrics said of the run's engine (``own_engine_service``):
    # generation, its step table over the run (tidegate.engines.steps); embeddings, its
    # batches: how many, their mean size and mean engine time in ms.
    engine_steps: StepTable | None = None
    engine_batches: EngineBatches | None = None


@dataclass(frozen=True, slots=True)
class EngineBatches:
    """The worker's batches over a run, from its /metrics."""

    count: float
    mean_size: float
    mean_ms: float


@dataclass(frozen=True)
class Tolerances:
    percentile: float = 0.15  # p50 and p95 (p99 is reported, not judged)
    throughput: float = 0.05
    count: float = 0.10


# ----------------------------------------------------------------------------- run files
def run_data(run: RecordedRun) -> dict[str, Any]:
    """The JSON object of a run file."""
    return {
        "format": RUN_FORMAT,
        "version": RUN_VERSION,
        "model": run.model,
        "task": run.task,
        "config": dict(run.config),
        "idle_round_trip_ms": None
        if run.idle_round_trip_s is None
        else round(run.idle_round_trip_s * 1e3, 3),
        "idle_engine_ms": None if run.idle_engine_s is None else round(run.idle_engine_s * 1e3, 3),
        "meta": dict(run.meta),
        "engine_steps": None if run.engine_steps is None else step_rows(run.engine_steps),
        "engine_batches": None if run.engine_batches is None else asdict(run.engine_batches),
        "requests": [
            {
                "at_s": round(r.at_s, 6),
                "priority": r.priority,
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
                "status": r.status,
                "latency_ms": None if r.latency_s is None else round(r.latency_s * 1e3, 3),
                "ttft_ms": None if r.ttft_s is None else round(r.ttft_s * 1e3, 3),
            }
            for r in run.requests
        ],
    }


def write_run(path: str | Path, run: RecordedRun) -> None:
    Path(path).write_text(json.dumps(run_data(run), separators=(",", ":")))


def load_run(path: str | Path) -> RecordedRun:
    source = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(
            source, "(file)", f"cannot read it ({exc.strerror})", "check the path"
        ) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(source, "(file)", f"not JSON ({exc.msg})", "pass a run file") from None
    return parse_run(data, source)


def parse_run(data: Any, source: str) -> RecordedRun:
    fix = "see docs/simulator.md, 'Validating against a real run'"
    if not isinstance(data, dict) or data.get("format") != RUN_FORMAT:
        raise ConfigError(source, "format", f"not a {RUN_FORMAT!r} file", fix)
    if data.get("version") != RUN_VERSION:
        raise ConfigError(source, "version", f"unsupported {data.get('version')!r}", fix)
    for key in ("model", "task", "config", "requests"):
        if key not in data:
            raise ConfigError(source, key, "missing", fix)
    if data["task"] not in ("embeddings", "generate"):
        raise ConfigError(source, "task", f"unknown task {data['task']!r}", fix)
    if not isinstance(data["config"], dict):
        raise ConfigError(source, "config", "must be the serve config as an object", fix)
    requests = []
    for index, row in enumerate(data["requests"]):
        try:
            requests.append(
                RunRequest(
                    float(row["at_s"]),
                    None if row.get("priority") is None else str(row["priority"]),
                    int(row.get("prompt_tokens", 0)),
                    int(row.get("output_tokens", 0)),
                    int(row["status"]),
                    _seconds(row.get("latency_ms")),
                    _seconds(row.get("ttft_ms")),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(source, f"requests[{index}]", f"bad request ({exc})", fix) from None
    if not requests:
        raise ConfigError(source, "requests", "empty", fix)
    idle = data.get("idle_round_trip_ms")
    engine = data.get("idle_engine_ms")
    steps = batches = None
    try:
        if data.get("engine_steps") is not None:
            steps = table_of_rows(data["engine_steps"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(source, "engine_steps", f"bad step row ({exc})", fix) from None
    try:
        if data.get("engine_batches") is not None:
            raw = data["engine_batches"]
            batches = EngineBatches(
                float(raw["count"]), float(raw["mean_size"]), float(raw["mean_ms"])
            )
            if not all(0.0 <= value < math.inf for value in asdict(batches).values()):
                raise ValueError(f"figures must be finite and >= 0, got {raw}")
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(source, "engine_batches", f"bad batches ({exc})", fix) from None
    return RecordedRun(
        str(data["model"]),
        str(data["task"]),
        data["config"],
        tuple(sorted(requests, key=lambda r: r.at_s)),
        None if idle is None else float(idle) / 1e3,
        source,
        dict(data.get("meta") or {}),
        None if engine is None else float(engine) / 1e3,
        steps,
        batches,
    )


def own_engine_service(run: RecordedRun, profile: EngineProfile, source: str) -> ServiceModel:
    """The profile at the engine's own speed in ``run``, as its worker reported it: for
    generation the run's step table for the step prices (``profile_at_steps``); for
    embeddings the run's mean batch by size from the same table where the run file has it
    (kind ``batch``: ``profile_at_steps`` again), else every batch scaled by the run's mean
    engine time over the profile's at the run's mean batch. Not a prediction: a replay that
    takes the engine's speed from the run itself, so that what is left between the two sides
    is the simulator's model of the stack around the engine (docs/simulator.md)."""
    fix = (
        "record the worker's engine figures with the run (benchmarks/bench_sim_fidelity.py "
        "writes them) or drop --own-engine-time"
    )
    if profile.task != run.task:
        raise ConfigError(source, "task", f"a {profile.task} profile for a {run.task} run", fix)
    if run.task == "generate":
        if not run.engine_steps:
            raise ConfigError(run.source, "engine_steps", "missing: no step table", fix)
        return from_profile(profile_at_steps(profile, run.engine_steps), source)
    if run.engine_steps and any(kind == BATCH for kind, _ in run.engine_steps):
        return from_profile(profile_at_steps(profile, run.engine_steps), source)
    batches = run.engine_batches
    service = from_profile(profile, source)
    if batches is None or batches.count <= 0 or service.batch is None:
        raise ConfigError(run.source, "engine_batches", "missing: no batches", fix)
    profiled_ms = service.batch.batch_s(max(1, round(batches.mean_size)), 0) * 1e3
    if profiled_ms <= 0:
        raise ConfigError(source, "embeddings", "the curve is 0 at the run's mean batch", fix)
    return scaled(service, batches.mean_ms / profiled_ms)


def _seconds(ms: Any) -> float | None:
    return None if ms is None else float(ms) / 1e3


# ----------------------------------------------------------------------------- the sides
@dataclass
class Side:
    """What one side (measured or simulated) saw, per class."""

    e2e_s: dict[str, list[float]] = field(default_factory=dict)  # completed requests
    ttft_s: dict[str, list[float]] = field(default_factory=dict)
    statuses: dict[str, Counter[int]] = field(default_factory=dict)
    span_s: float = 0.0  # first arrival to last completion
    batches: Counter[int] = field(default_factory=Counter)  # simulated only: size -> count


def measured_side(run: RecordedRun, default_priority: str) -> Side:
    side = Side()
    first = run.requests[0].at_s
    last = first
    for r in run.requests:
        name = r.priority or default_priority
        side.statuses.setdefault(name, Counter())[r.status] += 1
        side.e2e_s.setdefault(name, [])
        side.ttft_s.setdefault(name, [])
        if r.status == 200 and r.latency_s is not None:
            side.e2e_s[name].append(r.latency_s)
            last = max(last, r.at_s + r.latency_s)
            if r.ttft_s is not None:
                side.ttft_s[name].append(r.ttft_s)
    side.span_s = last - first
    return side


def scenario_for(
    run: RecordedRun, service: ServiceModel, network_s: float, arrivals: Sequence[Arrival]
) -> Scenario:
    config = parse_config(dict(run.config), f"{run.source}#config")
    spec = config.model(run.model)
    replicas = dict(spec.replicas) if spec.local else {spec.upstream_pool: len(spec.upstreams)}
    return Scenario(
        config,
        run.model,
        service,
        Listed(Path(run.source).name, arrivals),
        replicas,
        network_s=network_s,
        keep_requests=True,
    )


def arrivals_of(run: RecordedRun) -> list[Arrival]:
    return [Arrival(r.at_s, r.prompt_tokens, r.output_tokens, r.priority) for r in run.requests]


def lone_request_s(run: RecordedRun, service: ServiceModel) -> float:
    """What the simulator predicts for the run's first request alone on an idle replica
    (time to first token for generation: the round trip delays the first token)."""
    first = run.requests[0]
    lone = Arrival(0.0, first.prompt_tokens, first.output_tokens, first.priority)
    result = Simulation(scenario_for(run, service, 0.0, [lone])).run()
    assert result.recorder.requests is not None
    record = result.recorder.requests[0]
    value = record.ttft_s if run.task == "generate" else record.e2e_s
    return value or 0.0


def network_s_for(run: RecordedRun, service: ServiceModel) -> float:
    """The round trip outside what the simulator models (module docstring).

    With ``idle_engine_s`` (the engine time the worker reported for those lone requests),
    the engine's part of the idle round trip is the measured one, not the profile's: what
    is left is the time outside the engine, less what the simulator itself spends outside
    the engine for a lone request (the batch window). This keeps a slow or fast moment of
    the engine during the probe out of the network term.
    """
    if run.idle_round_trip_s is None:
        return 0.0
    lone_s = lone_request_s(run, service)
    if run.idle_engine_s is not None and service.batch is not None:
        first = run.requests[0]
        outside_s = max(0.0, lone_s - service.batch.batch_s(1, first.prompt_tokens))
        return max(0.0, run.idle_round_trip_s - run.idle_engine_s - outside_s)
    return max(0.0, run.idle_round_trip_s - lone_s)


def simulated_side(
    run: RecordedRun, service: ServiceModel, network_s: float
) -> tuple[Side, RunResult]:
    arrivals = arrivals_of(run)
    result = Simulation(scenario_for(run, service, network_s, arrivals)).run()
    assert result.recorder.requests is not None
    side = Side(batches=Counter(result.recorder.batch_sizes))
    at = {str(index): a.arrival_s for index, a in enumerate(arrivals)}
    first = arrivals[0].arrival_s
    last = first
    for name in [stats.name for stats in result.recorder.classes]:  # the config's order
        side.statuses.setdefault(name, Counter())
        side.e2e_s.setdefault(name, [])
        side.ttft_s.setdefault(name, [])
    for record in result.recorder.requests:
        side.statuses[record.klass][STATUS_OF_OUTCOME.get(record.outcome, 0)] += 1
        if record.outcome == "completed" and record.e2e_s is not None:
            side.e2e_s[record.klass].append(record.e2e_s)
            last = max(last, at[record.id] + record.e2e_s)
            if run.task == "generate" and record.ttft_s is not None:
                side.ttft_s[record.klass].append(record.ttft_s)
    side.span_s = last - first
    return side, result


# ----------------------------------------------------------------------------- comparison
@dataclass(frozen=True, slots=True)
class Figure:
    cls: str
    name: str  # "e2e p50 ms", "throughput /s", "429" ...
    measured: float
    simulated: float
    error: float  # (simulated - measured) / measured; NaN when undefined
    judged: bool  # counts toward the verdict
    ok: bool
    # --sensitivity: the figure simulated with the engine faster / slower by the spread
    faster: float = math.nan
    slower: float = math.nan

    def reachable(self, tolerance: float) -> bool:
        """Within ``tolerance`` of the measured value somewhere in the simulated range
        (the nominal engine time and the two ends of the spread), taken as continuous."""
        values = [v for v in (self.simulated, self.faster, self.slower) if v == v]
        if not values or self.measured != self.measured or self.measured == 0:
            return False
        low, high = min(values), max(values)
        return low <= self.measured * (1 + tolerance) and high >= self.measured * (1 - tolerance)

    @property
    def kind(self) -> str:
        if self.name.startswith("throughput"):
            return "throughput"
        if " p" in self.name:
            return "percentile"
        return "count"


@dataclass(frozen=True)
class Validation:
    figures: tuple[Figure, ...]
    tolerances: Tolerances
    network_s: float
    num_requests: int
    sensitivity: float = 0.0  # the engine-time spread of ``Figure.faster`` / ``slower``; 0: none

    def judged(self, kind: str) -> list[Figure]:
        return [f for f in self.figures if f.judged and f.kind == kind]

    @property
    def passed(self) -> bool:
        return all(f.ok for f in self.figures if f.judged)

    def verdict(self) -> str:
        parts = []
        for kind, label, tolerance in (
            ("percentile", "p50/p95", self.tolerances.percentile),
            ("throughput", "throughput", self.tolerances.throughput),
            ("count", "outcome counts", self.tolerances.count),
        ):
            mine = self.judged(kind)
            ok = sum(f.ok for f in mine)
            worst = max((abs(f.error) for f in mine if f.error == f.error), default=math.nan)
            parts.append(
                f"{label} {ok}/{len(mine)} within {tolerance:.0%} (worst {_pct(worst, False)})"
            )
        return f"{'PASS' if self.passed else 'MISS'}: " + "; ".join(parts)

    def sensitivity_line(self) -> str:
        """How many judged p50/p95 figures the tolerance reaches with the engine's time off
        by at most the spread: a diagnostic beside the verdict, never part of it."""
        if not self.sensitivity:
            return ""
        mine = self.judged("percentile")
        tolerance = self.tolerances.percentile
        reached = sum(f.reachable(tolerance) for f in mine)
        return (
            f"engine time x{1 - self.sensitivity:g} to x{1 + self.sensitivity:g} "
            f"(not the verdict): p50/p95 within {tolerance:.0%} somewhere in the range: "
            f"{reached}/{len(mine)}"
        )


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def relative(simulated: float, measured: float) -> float:
    if measured == 0 or math.isnan(measured) or math.isnan(simulated):
        return math.nan
    return (simulated - measured) / measured


def compare(
    measured: Side, simulated: Side, task: str, tolerances: Tolerances | None = None
) -> list[Figure]:
    t = tolerances or Tolerances()
    figures: list[Figure] = []
    metrics = ("ttft", "e2e") if task == "generate" else ("e2e",)
    for cls in _ordered(simulated.statuses, measured.statuses):
        if not sum(measured.statuses.get(cls, Counter()).values()) and not sum(
            simulated.statuses.get(cls, Counter()).values()
        ):
            continue  # a level of the config nobody sent
        for metric in metrics:
            real = getattr(measured, f"{metric}_s").get(cls, [])
            sim = getattr(simulated, f"{metric}_s").get(cls, [])
            for q in (50, 95, 99):
                a, b = percentile(real, q) * 1e3, percentile(sim, q) * 1e3
                error = relative(b, a)
                judged = q != 99 and bool(real or sim)  # nothing completed on either: n/a
                ok = error == error and abs(error) <= t.percentile
                figures.append(Figure(cls, f"{metric} p{q} ms", a, b, error, judged, ok))
        real_done = len(measured.e2e_s.get(cls, []))
        sim_done = len(simulated.e2e_s.get(cls, []))
        a = real_done / measured.span_s if measured.span_s > 0 else math.nan
        b = sim_done / simulated.span_s if simulated.span_s > 0 else math.nan
        error = relative(b, a)
        ok = error == error and abs(error) <= t.throughput
        figures.append(Figure(cls, "throughput /s", a, b, error, True, ok))
        real_counts = measured.statuses.get(cls, Counter())
        sim_counts = simulated.statuses.get(cls, Counter())
        sent = max(1, sum(real_counts.values()))
        for status in sorted({200, 429, 504} | set(real_counts) | set(sim_counts)):
            a, b = real_counts.get(status, 0), sim_counts.get(status, 0)
            error = relative(b, a) if a >= SMALL_COUNT_SHARE * sent else (b - a) / sent
            ok = abs(error) <= t.count
            name = "completed" if status == 200 else ("no answer" if status == 0 else str(status))
            figures.append(Figure(cls, name, a, b, error, True, ok))
    return figures


def _ordered(*groups: Iterable[str]) -> list[str]:
    seen: list[str] = []
    for group in groups:
        for name in group:
            if name not in seen:
                seen.append(name)
    return seen


def validate(
    run: RecordedRun,
    service: ServiceModel,
    tolerances: Tolerances | None = None,
    sensitivity: float = 0.0,
) -> tuple[Validation, Side, Side]:
    """Replay ``run`` through the simulator and compare; also both sides, for reports.

    With ``sensitivity`` s (0 < s < 0.5), the run is also replayed with the engine's every
    batch or step s faster and s slower (``service.scaled``), and each figure carries those
    two simulated values: near a knee a percentile can move far more than the engine time,
    and this shows which disagreements an engine-time error of at most s explains.
    """
    if service.task != run.task:
        raise ValueError(
            f"the service model is for {service.task} but the run ({run.source}) is "
            f"{run.task}: give the profile of the model the run served"
        )
    if not 0.0 <= sensitivity < 0.5:
        raise ValueError(f"the sensitivity is a fraction in [0, 0.5), got {sensitivity}")
    network_s = network_s_for(run, service)
    simulated, result = simulated_side(run, service, network_s)
    default = result.scenario.config.default_priority
    measured = measured_side(run, default)
    t = tolerances or Tolerances()
    figures = compare(measured, simulated, run.task, t)
    if sensitivity:
        ends = []
        for factor in (1.0 - sensitivity, 1.0 + sensitivity):
            other = scaled(service, factor)
            side, _ = simulated_side(run, other, network_s_for(run, other))
            ends.append({(f.cls, f.name): f.simulated for f in compare(measured, side, run.task)})
        faster, slower = ends
        figures = [
            replace(
                f,
                faster=faster.get((f.cls, f.name), math.nan),
                slower=slower.get((f.cls, f.name), math.nan),
            )
            for f in figures
        ]
    validation = Validation(tuple(figures), t, network_s, len(run.requests), sensitivity)
    return validation, measured, simulated


# ----------------------------------------------------------------------------- output
HEADER = ("class", "figure", "measured", "simulated", "error", "")


def header(validation: Validation) -> tuple[str, ...]:
    if not validation.sensitivity:
        return HEADER
    spread = f"{validation.sensitivity:.0%}"
    return (*HEADER[:4], f"sim -{spread}", f"sim +{spread}", *HEADER[4:])


def rows(validation: Validation) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for f in validation.figures:
        digits = 0 if f.kind == "count" else 1
        mark = ("ok" if f.ok else "MISS") if f.judged else ""
        ends = (_num(f.faster, digits), _num(f.slower, digits)) if validation.sensitivity else ()
        out.append(
            (
                f.cls,
                f.name,
                _num(f.measured, digits),
                _num(f.simulated, digits),
                *ends,
                _pct(f.error),
                mark,
            )
        )
    return out


def render(validation: Validation, title: str = "") -> str:
    body = rows(validation)
    head = header(validation)
    widths = [max(len(cell) for cell in column) for column in zip(head, *body, strict=True)]
    lines = [title] if title else []
    lines.append(
        f"{validation.num_requests:,} requests; round trip added to the simulation "
        f"(idle measured minus predicted): {validation.network_s * 1e3:.1f} ms"
    )
    for row in (head, *body):
        lines.append(
            "  ".join(
                cell.ljust(w) if i < 2 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )
    lines.append(validation.verdict())
    if validation.sensitivity:
        lines.append(validation.sensitivity_line())
    return "\n".join(lines)


def batch_line(run: RecordedRun, simulated: Side, service: ServiceModel) -> str:
    """The batches the run's worker formed (its figures, when the run file has them) beside
    the simulator's: the first thing to look at when an embeddings replay misses. "" for a
    generation run or one without batches on either side."""
    if run.task != "embeddings" or service.batch is None:
        return ""
    sim_count = sum(simulated.batches.values())
    parts = []
    real = _run_batches(run)
    if real is not None:
        parts.append(
            f"the run's worker {real.count:,.0f} (mean {real.mean_size:.1f} inputs, "
            f"{real.mean_ms:.1f} ms)"
        )
    if sim_count:
        inputs = sum(size * n for size, n in simulated.batches.items())
        engine_s = sum(service.batch.batch_s(size, 0) * n for size, n in simulated.batches.items())
        parts.append(
            f"simulated {sim_count:,} (mean {inputs / sim_count:.1f} inputs, "
            f"{engine_s / sim_count * 1e3:.1f} ms)"
        )
    return "batches: " + ", ".join(parts) if parts else ""


def _run_batches(run: RecordedRun) -> EngineBatches | None:
    """The run's batches: from its step table's batch rows, else its ``engine_batches``."""
    cells = [(n, c) for (kind, n), c in (run.engine_steps or {}).items() if kind == BATCH]
    count = sum(c.num_steps for _, c in cells)
    if count > 0:
        inputs = sum(n * c.num_steps for n, c in cells)
        seconds = sum(c.seconds for _, c in cells)
        return EngineBatches(count, inputs / count, seconds / count * 1e3)
    return run.engine_batches if run.engine_batches and run.engine_batches.count > 0 else None


def validation_data(validation: Validation) -> dict[str, Any]:
    return {
        "num_requests": validation.num_requests,
        "network_ms": validation.network_s * 1e3,
        "passed": validation.passed,
        "verdict": validation.verdict(),
        "sensitivity": validation.sensitivity,
        "figures": [
            {
                "class": f.cls,
                "figure": f.name,
                "measured": _finite(f.measured),
                "simulated": _finite(f.simulated),
                "error": _finite(f.error),
                "judged": f.judged,
                "ok": f.ok,
                **(
                    {"simulated_faster": _finite(f.faster), "simulated_slower": _finite(f.slower)}
                    if validation.sensitivity
                    else {}
                ),
            }
            for f in validation.figures
        ],
    }


def _finite(value: float) -> float | None:
    return value if value == value and not math.isinf(value) else None


def _num(value: float, digits: int) -> str:
    return "n/a" if value != value else f"{value:,.{digits}f}"


def _pct(value: float, signed: bool = True) -> str:
    if value != value:
        return "n/a"
    return f"{value:+.1%}" if signed else f"{value:.1%}"
