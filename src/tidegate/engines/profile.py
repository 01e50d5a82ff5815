"""Engine profiles: measured latency and memory curves of one model on one device.

``tidegate profile`` (the capacity planner) writes them; the simulated engine, the
simulator, placement and the autoscaler read them. Schema version 1, JSON::

    {"version": 1, "model": "minilm", "task": "embeddings", "device": "cpu",
     "memory_mb": 350, "weights_mb": 87,
     "embeddings": {"points": [{"batch_size": 1, "latency_ms": 6.0}, ...]},
     "generate": {"points": [{"concurrency": 1, "ttft_ms": 15.0, "itl_ms": 8.0}, ...]}}

Latency between measured points is interpolated linearly, and extrapolated from the last
two points beyond them. Extra keys are kept for the planner's own use.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tidegate.errors import ConfigError

PROFILE_VERSION = 1


@dataclass(frozen=True, slots=True)
class Curve:
    """y as a piecewise-linear function of x, from measured points sorted by x."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0]
        index = min(max(bisect_left(xs, x), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[index - 1], xs[index], ys[index - 1], ys[index]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


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
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


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
        raise ConfigError(source, "<root>", "a profile is a JSON object", "see docs/profiles")
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
    )
    if task == "embeddings":
        curve = _curve(points, "batch_size", "latency_ms", source, task)
        return replace(profile, batch_latency_ms=curve)
    return replace(
        profile,
        ttft_ms=_curve(points, "concurrency", "ttft_ms", source, task),
        itl_ms=_curve(points, "concurrency", "itl_ms", source, task),
    )


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
