"""Engine profiles: measured latency and memory curves of one model on one device.

``tidegate profile`` (the capacity planner) writes them; the simulated engine, the
simulator, placement and the autoscaler read them. Schema version 1, JSON (docs/profile.md
describes every key)::

    {"version": 1, "model": "minilm", "task": "embeddings", "engine": "transformers",
     "device": "cpu", "memory_mb": 350, "weights_mb": 87,
     "embeddings": {"points": [{"batch_size": 1, "latency_ms": 6.0}, ...]},
     "generate": {"points": [{"concurrency": 1, "ttft_ms": 15.0, "itl_ms": 8.0}, ...],
                  "join_ms": 40.0},
     "slo": {"p95_ms": 200},
     "workload": {"source": "synthetic", ...},
     "points": [{"sweep": "batch", "batch_size": 8, "concurrency": 16, ...}, ...],
     "knee": {"batch_size": 8, "concurrency": 16, "throughput_rps": 230, ...}}

Only ``version``, ``task`` and the curve of that task are required: the curves are what the
simulated engine replays (``latency_ms`` is the mean engine time of one batch of that size;
``ttft_ms`` / ``itl_ms`` are mean times with that many sequences running; the optional
``generate.join_ms`` is what one prompt joining a decoding batch adds to that step). ``points``
(every configuration the planner measured, with percentiles, memory and CPU), ``knee``,
``slo`` and ``workload`` are the planner's record; files written before them still load.
Latency between measured points is interpolated linearly, and extrapolated from the last
two points beyond them. Unknown keys are kept in ``raw``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from tidegate.core.capacity import Slo
from tidegate.errors import ConfigError

PROFILE_VERSION = 1
_Record = TypeVar("_Record")


@dataclass(frozen=True, slots=True)
class Curve:
    """y as a piecewise-linear function of x, from measured points sorted by x."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    @classmethod
    def of(cls, points: Mapping[float, float]) -> Curve:
        """The curve through ``points`` (x -> y, at least one), sorted by x."""
        xs = tuple(sorted(points))
        return cls(xs, tuple(points[x] for x in xs))

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0]
        index = min(max(bisect_left(xs, x), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[index - 1], xs[index], ys[index - 1], ys[index]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True, slots=True)
class MeasuredPoint:
    """One configuration the planner measured until stable (docs/profile.md, "Points")."""

    sweep: str  # "batch", "window" or "concurrency": the sweep that measured it
    concurrency: int  # requests the load generator kept in flight
    throughput_rps: float  # completed requests per second
    latency_p95_ms: float  # end to end, per request
    batch_size: int | None = None  # worker max_batch_size / max_num_seqs; None: not set (--url)
    batch_window_ms: float | None = None  # worker batch_window_ms; None: not set
    tokens_per_s: float = 0.0  # input tokens/s (embeddings), output tokens/s (generate)
    latency_p50_ms: float = 0.0
    latency_p99_ms: float = 0.0
    ttft_p50_ms: float | None = None  # generation only
    ttft_p95_ms: float | None = None
    ttft_p99_ms: float | None = None
    ttft_mean_ms: float | None = None
    itl_p50_ms: float | None = None  # gaps between streamed tokens, all requests pooled
    itl_p95_ms: float | None = None
    itl_p99_ms: float | None = None
    itl_mean_ms: float | None = None
    batch_latency_ms: float | None = None  # mean engine time per batch (worker /metrics)
    mean_batch_size: float | None = None  # mean batch the worker formed (worker /metrics)
    # generation, from the engine's own step table (worker /metrics, tidegate.engines.steps):
    # its mean step with ``concurrency`` sequences all decoding, and all joining an idle engine
    decode_step_ms: float | None = None
    start_step_ms: float | None = None
    mean_input_tokens: float = 0.0  # from the server's usage counts
    mean_output_tokens: float = 0.0
    peak_memory_mb: float | None = None  # GPU memory on a GPU, else the worker's peak RSS
    worker_cpu_cores: float | None = None  # CPU the worker process used; 1.0 = one core
    loadgen_cpu_cores: float | None = None  # CPU of the planner's own load generator
    other_cpu_cores: float | None = None  # the rest of the machine: noise
    num_requests: int = 0  # completed in the windows that count
    num_errors: int = 0
    duration_s: float = 0.0  # of the windows that count (the last three)
    num_windows: int = 0  # windows measured in all
    stable: bool = True  # False: it ran out of time before its windows agreed

    @property
    def error_rate(self) -> float:
        total = self.num_requests + self.num_errors
        return self.num_errors / total if total else 0.0


@dataclass(frozen=True, slots=True)
class KneeRecord:
    """The operating point the planner chose (docs/profile.md, "The knee")."""

    concurrency: int
    throughput_rps: float
    latency_p95_ms: float
    meets_slo: bool
    reason: str
    batch_size: int | None = None
    batch_window_ms: float | None = None
    tokens_per_s: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineProfile:
    model: str
    task: str
    device: str = "cpu"
    memory_mb: float = 0.0
    weights_mb: float = 0.0
    batch_latency_ms: Curve | None = None  # embeddings: batch size -> batch latency
    ttft_ms: Curve | None = None  # generate: running sequences -> time to first token
    itl_ms: Curve | None = None  # generate: running sequences -> inter-token latency
    # generate: what one prompt joining a decoding batch adds to that step, measured in the
    # serving stack (None: not measured; the simulator then prices it from the curves)
    join_ms: float | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False)
    engine: str = ""  # what ran the model when it was measured; "" in older files
    points: tuple[MeasuredPoint, ...] = ()
    knee: KneeRecord | None = None
    slo: Slo | None = None
    workload: Mapping[str, Any] = field(default_factory=dict)


# The documented default: a small embedding model and a small generator on one CPU core,
# in the range measured for minilm and tiny-llama here. Replace with `tidegate profile`.
DEFAULT_PROFILE_DATA: dict[str, dict[str, Any]] = {
    "embeddings": {
        "version": PROFILE_VERSION,
        "model": "simulated-embeddings",
        "task": "embeddings",
        "device": "cpu",
        "memory_mb": 300.0,
        "weights_mb": 87.0,
        "embeddings": {
            "points": [
                {"batch_size": 1, "latency_ms": 5.0},
                {"batch_size": 8, "latency_ms": 12.0},
                {"batch_size": 32, "latency_ms": 36.0},
                {"batch_size": 64, "latency_ms": 70.0},
            ]
        },
    },
    "generate": {
        "version": PROFILE_VERSION,
        "model": "simulated-generate",
        "task": "generate",
        "device": "cpu",
        "memory_mb": 400.0,
        "weights_mb": 2.0,
        "generate": {
            "points": [
                {"concurrency": 1, "ttft_ms": 20.0, "itl_ms": 10.0},
                {"concurrency": 8, "ttft_ms": 30.0, "itl_ms": 14.0},
                {"concurrency": 32, "ttft_ms": 60.0, "itl_ms": 25.0},
            ]
        },
    },
}


def default_profile(task: str) -> EngineProfile:
    return parse_profile(DEFAULT_PROFILE_DATA[task], "<default profile>")


def load_profile(path: str | Path) -> EngineProfile:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(
            str(path),
            "profile",
            f"cannot read it ({exc.strerror})",
            "pass a profile.json written by `tidegate profile`",
        ) from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(
            str(path),
            "profile",
            f"not JSON ({exc.msg} at line {exc.lineno})",
            "pass a profile.json written by `tidegate profile`",
        ) from exc
    return parse_profile(data, str(path))


def parse_profile(data: Any, source: str) -> EngineProfile:
    if not isinstance(data, dict):
        raise ConfigError(source, "<root>", "a profile is a JSON object", "see docs/profile.md")
    if data.get("version") != PROFILE_VERSION:
        raise ConfigError(
            source,
            "version",
            f"unsupported version {data.get('version')!r}",
            f"write it again with this tidegate (version {PROFILE_VERSION})",
        )
    task = data.get("task")
    if task not in ("embeddings", "generate"):
        raise ConfigError(source, "task", f"unknown task {task!r}", "use embeddings or generate")
    points = data.get(task, {}).get("points") if isinstance(data.get(task), dict) else None
    if not isinstance(points, list) or not points:
        raise ConfigError(
            source, f"{task}.points", "missing or empty", "give at least one measured point"
        )
    profile = EngineProfile(
        model=str(data.get("model", "simulated")),
        task=task,
        device=str(data.get("device", "cpu")),
        memory_mb=float(data.get("memory_mb", 0.0)),
        weights_mb=float(data.get("weights_mb", 0.0)),
        raw=data,
        engine=str(data.get("engine", "")),
        points=_records(data, "points", MeasuredPoint, source),
        knee=_record(data, "knee", KneeRecord, source),
        slo=_record(data, "slo", Slo, source),
        workload=dict(_mapping(data, "workload", source)),
    )
    if task == "embeddings":
        curve = _curve(points, "batch_size", "latency_ms", source, task)
        return replace(profile, batch_latency_ms=curve)
    return replace(
        profile,
        ttft_ms=_curve(points, "concurrency", "ttft_ms", source, task),
        itl_ms=_curve(points, "concurrency", "itl_ms", source, task),
        join_ms=_join_ms(data["generate"], source),
    )


def _join_ms(section: Mapping[str, Any], source: str) -> float | None:
    value = section.get("join_ms")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ConfigError(
            source,
            "generate.join_ms",
            f"must be a number of milliseconds, 0 or more, not {value!r}",
            "fix it or remove the key (the simulator then prices a join from the curves)",
        )
    return float(value)


def _curve(points: Sequence[Any], x_key: str, y_key: str, source: str, task: str) -> Curve:
    pairs: dict[float, float] = {}
    for index, point in enumerate(points):
        try:
            pairs[float(point[x_key])] = float(point[y_key])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                source,
                f"{task}.points[{index}]",
                f"needs numeric {x_key} and {y_key}",
                "fix or remove that point",
            ) from exc
    xs = tuple(sorted(pairs))
    return Curve(xs, tuple(pairs[x] for x in xs))


def profile_data(profile: EngineProfile, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON object of a profile: ``parse_profile(profile_data(p), ...)`` equals ``p``.

    ``extra`` adds keys of the planner's own (``measured``, ``recommended``).
    """
    data: dict[str, Any] = {
        "version": PROFILE_VERSION,
        "model": profile.model,
        "task": profile.task,
        "engine": profile.engine,
        "device": profile.device,
        "memory_mb": _number(profile.memory_mb),
        "weights_mb": _number(profile.weights_mb),
    }
    if profile.batch_latency_ms is not None:
        curve = profile.batch_latency_ms
        data["embeddings"] = {
            "points": [
                {"batch_size": _number(x), "latency_ms": _number(y)}
                for x, y in zip(curve.xs, curve.ys, strict=True)
            ]
        }
    if profile.ttft_ms is not None and profile.itl_ms is not None:
        data["generate"] = {
            "points": [
                {
                    "concurrency": _number(x),
                    "ttft_ms": _number(profile.ttft_ms(x)),
                    "itl_ms": _number(profile.itl_ms(x)),
                }
                for x in sorted(set(profile.ttft_ms.xs) | set(profile.itl_ms.xs))
            ]
        }
        if profile.join_ms is not None:
            data["generate"]["join_ms"] = round(profile.join_ms, 3)
    if profile.slo is not None:
        data["slo"] = dataclasses.asdict(profile.slo)
    data["workload"] = dict(profile.workload)
    data["points"] = [_plain(dataclasses.asdict(p)) for p in profile.points]
    data["knee"] = None if profile.knee is None else _plain(dataclasses.asdict(profile.knee))
    return data | dict(extra or {})


def _number(value: float) -> float | int:
    """Whole numbers as ints (a batch size of 8, not 8.0); the rest as they are."""
    return int(value) if math.isfinite(value) and float(value).is_integer() else value


def _plain(record: dict[str, Any]) -> dict[str, Any]:
    return {
        key: _number(value) if isinstance(value, float) else value for key, value in record.items()
    }


def _mapping(data: Mapping[str, Any], key: str, source: str) -> Mapping[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(
            source, key, "must be a JSON object", "rewrite it with `tidegate profile`"
        )
    return value


def _record(data: Mapping[str, Any], key: str, kind: type[_Record], source: str) -> _Record | None:
    value = _mapping(data, key, source)
    return _from_mapping(kind, value, key, source) if value else None


def _records(
    data: Mapping[str, Any], key: str, kind: type[_Record], source: str
) -> tuple[_Record, ...]:
    values = data.get(key) or []
    if not isinstance(values, list):
        raise ConfigError(source, key, "must be a JSON list", "rewrite it with `tidegate profile`")
    return tuple(
        _from_mapping(kind, value, f"{key}[{index}]", source) for index, value in enumerate(values)
    )


def _from_mapping(kind: type[_Record], value: Any, key: str, source: str) -> _Record:
    """A record dataclass from JSON; keys it does not know (newer files) are ignored."""
    fields = {f.name: str(f.type) for f in dataclasses.fields(kind)}  # type: ignore[arg-type]
    try:
        if not isinstance(value, Mapping):
            raise TypeError("not an object")
        known = {k: v for k, v in value.items() if k in fields}
        for name, item in known.items():
            _check_type(name, fields[name], item)
        return kind(**known)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            source, key, f"not a valid record ({exc})", "rewrite it with `tidegate profile`"
        ) from exc


def _check_type(name: str, annotation: str, value: Any) -> None:
    """Numbers where the record wants numbers, strings where it wants text."""
    if value is None and "None" in annotation:
        return
    wanted: tuple[type, ...] = {
        "float": (int, float),
        "int": (int,),
        "str": (str,),
        "bool": (bool,),
    }.get(annotation.split(" ")[0], (object,))
    if isinstance(value, bool) and bool not in wanted:
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not isinstance(value, wanted):
        raise TypeError(f"{name} must be {annotation}, got {value!r}")
