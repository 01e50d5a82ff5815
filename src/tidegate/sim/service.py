"""Service-time models: how long a replica's engine takes, from measured points.

Two shapes, one per scheduling level of the worker:

- request level (embeddings, dynamic batching): ``batch_s(num_requests, num_tokens)``, the
  time to run one batch; from a profile's ``batch_latency_ms`` curve (batch size -> latency,
  linear between measured points, as ``tidegate.engines.profile.Curve`` interpolates);
- iteration level (generation, continuous batching): ``step_s(num_decode, num_prefill,
  prefill_tokens)``, the time of one engine step in which ``num_decode`` running sequences
  each make a token and ``num_prefill`` joining ones process their prompts.

Sources: a ``tidegate profile`` JSON (``load_profile``; the simulated engine reads the same
file) and the measured A100/H100 table of splitwise-sim (``perf_model.csv``: prefill time by
prompt size x batch, decode step time by batch). ``load_service`` picks by the file.

A profile's two prices (``CurveBatch``, ``ConcurrencySteps``) live in
``tidegate.engines.cost``, where the simulated engine charges the same ones in wall time;
that module says how a profile measured by concurrency becomes a step model, and what the
step model was measured against.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from tidegate.engines.cost import ConcurrencySteps, CurveBatch
from tidegate.engines.profile import Curve, EngineProfile, default_profile, load_profile
from tidegate.errors import ConfigError

PERF_MODEL_DEFAULT = ("llama2-70b", "a100-80gb", 8)  # model, hardware, tensor parallel


class BatchService(Protocol):
    def batch_s(self, num_requests: int, num_tokens: int) -> float:
        """Seconds to run one batch of ``num_requests`` holding ``num_tokens`` in all."""


class StepService(Protocol):
    def step_s(self, num_decode: int, num_prefill: int, prefill_tokens: int) -> float:
        """Seconds of one engine iteration (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """What a replica's engine costs. Exactly one of ``batch`` / ``step`` is set."""

    name: str  # what it was built from, for the report
    task: str  # "embeddings" (request level) or "generate" (iteration level)
    batch: BatchService | None = None
    step: StepService | None = None
    source: str = ""  # file name (no folder: reports must not depend on where it lies)
    gpus_per_replica: int = 1  # perf_model: the tensor-parallel degree

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "task": self.task,
            "source": self.source,
            "gpus_per_replica": self.gpus_per_replica,
        }


class TokenSteps:
    """``step_s`` = decode step by batch + prefill time by the step's prompt tokens."""

    __slots__ = ("_decode", "_decode_cache", "_prefill")

    def __init__(self, prefill_ms: Curve, decode_ms: Curve) -> None:
        self._prefill = prefill_ms  # total prompt tokens in the step -> ms
        self._decode = decode_ms  # sequences decoding -> ms per step
        self._decode_cache: dict[int, float] = {}

    def step_s(self, num_decode: int, num_prefill: int, prefill_tokens: int) -> float:
        seconds = 0.0
        if num_decode:
            decode_s = self._decode_cache.get(num_decode)
            if decode_s is None:
                decode_s = self._decode_cache[num_decode] = self._decode(num_decode) / 1e3
            seconds = decode_s
        if num_prefill:
            seconds += self._prefill(max(1, prefill_tokens)) / 1e3
        return seconds


def from_profile(profile: EngineProfile, source: str) -> ServiceModel:
    if profile.task == "embeddings":
        assert profile.batch_latency_ms is not None
        return ServiceModel(
            f"{profile.model} on {profile.device}",
            "embeddings",
            batch=CurveBatch(profile.batch_latency_ms),
            source=source,
        )
    assert profile.ttft_ms is not None
    assert profile.itl_ms is not None
    return ServiceModel(
        f"{profile.model} on {profile.device}",
        "generate",
        step=ConcurrencySteps(profile.ttft_ms, profile.itl_ms, profile.join_ms),
        source=source,
    )


class _ScaledBatch:
    __slots__ = ("_factor", "_inner")

    def __init__(self, inner: BatchService, factor: float) -> None:
        self._inner = inner
        self._factor = factor

    def batch_s(self, num_requests: int, num_tokens: int) -> float:
        return self._inner.batch_s(num_requests, num_tokens) * self._factor


class _ScaledSteps:
    __slots__ = ("_factor", "_inner")

    def __init__(self, inner: StepService, factor: float) -> None:
        self._inner = inner
        self._factor = factor

    def step_s(self, num_decode: int, num_prefill: int, prefill_tokens: int) -> float:
        return self._inner.step_s(num_decode, num_prefill, prefill_tokens) * self._factor


def scaled(service: ServiceModel, factor: float) -> ServiceModel:
    """The same engine with every batch or step ``factor`` times as long (``factor`` > 0):
    how much a replay's figures move with the engine's speed (``--sensitivity``)."""
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"an engine time factor must be a finite number > 0, got {factor}")
    return replace(
        service,
        name=f"{service.name} x{factor:g}",
        batch=None if service.batch is None else _ScaledBatch(service.batch, factor),
        step=None if service.step is None else _ScaledSteps(service.step, factor),
    )


def default_service(task: str) -> ServiceModel:
    """The simulated engine's documented default profile for ``task``."""
    return from_profile(default_profile(task), "<default profile>")


def load_perf_model(
    path: str | Path,
    model: str = PERF_MODEL_DEFAULT[0],
    hardware: str = PERF_MODEL_DEFAULT[1],
    tensor_parallel: int = PERF_MODEL_DEFAULT[2],
) -> ServiceModel:
    """A step model from splitwise-sim's ``perf_model.csv`` rows of one model/hardware/TP.

    Prefill: ``prompt_time`` by total prompt tokens of the batch (prompt_size x batch_size),
    averaged over repeated measurements. Decode: ``token_time`` by batch size, averaged.
    """
    source = str(path)
    prefill: dict[float, list[float]] = defaultdict(list)
    decode: dict[float, list[float]] = defaultdict(list)
    seen: set[tuple[str, str, int]] = set()
    try:
        with open(path, newline="") as file:
            for index, row in enumerate(csv.DictReader(file)):
                try:
                    key = (row["model"], row["hardware"], int(row["tensor_parallel"]))
                    seen.add(key)
                    if key != (model, hardware, tensor_parallel):
                        continue
                    batch = int(row["batch_size"])
                    prefill[float(int(row["prompt_size"]) * batch)].append(
                        float(row["prompt_time"])
                    )
                    decode[float(batch)].append(float(row["token_time"]))
                except (KeyError, TypeError, ValueError) as exc:
                    raise ConfigError(
                        source,
                        f"row {index + 2}",
                        f"not a perf_model row ({exc})",
                        "pass splitwise-sim's perf_model.csv",
                    ) from None
    except OSError as exc:
        raise ConfigError(
            source, "(file)", f"cannot read it ({exc.strerror})", "check the path"
        ) from None
    if not decode:
        options = ", ".join(f"{m}/{h}/{tp}" for m, h, tp in sorted(seen)) or "none"
        raise ConfigError(
            source,
            "(selection)",
            f"no rows for {model}/{hardware}/{tensor_parallel}",
            f"pick one of: {options} (as PATH#MODEL/HARDWARE/TP)",
        )
    name = f"{model} on {hardware} TP{tensor_parallel}"
    steps = TokenSteps(_mean_curve(prefill), _mean_curve(decode))
    return ServiceModel(
        name, "generate", step=steps, source=Path(path).name, gpus_per_replica=tensor_parallel
    )


def load_service(spec: str) -> ServiceModel:
    """``profile.json`` (from ``tidegate profile``) or ``perf_model.csv[#MODEL/HW/TP]``."""
    path, _, selection = spec.partition("#")
    if path.endswith(".csv"):
        if not selection:
            return load_perf_model(path)
        parts = selection.split("/")
        if len(parts) != 3 or not parts[2].isdigit():
            raise ConfigError(
                spec,
                "(selection)",
                f"{selection!r} is not MODEL/HARDWARE/TP",
                "write e.g. perf_model.csv#llama2-70b/h100-80gb/8",
            )
        return load_perf_model(path, parts[0], parts[1], int(parts[2]))
    return from_profile(load_profile(path), Path(path).name)


def _mean_curve(points: dict[float, list[float]]) -> Curve:
    return Curve.of({x: sum(ys) / len(ys) for x, ys in points.items()})
