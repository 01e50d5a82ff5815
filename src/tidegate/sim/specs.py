"""Command-line specs of the simulator: ``--workload KIND:key=value,...`` and ``--slo``.

Workload kinds (rates in requests/s, times in seconds; ``prompt`` and ``output`` are the
median token lengths of a lognormal, ``output=0`` for embeddings):

- ``poisson:rate=5,duration_s=600``
- ``gamma:rate=5,cv=3,duration_s=600`` (bursty: inter-arrival CV 3)
- ``diurnal:mean_rate=5,peak_trough=4,duration_s=86400,peak_hour=14,cv=1,
  flash=50400/5/600+72000/3/300`` (a cosine day, mean kept; each flash crowd is
  ``START_S/MULTIPLIER/DURATION_S``, joined by ``+``)

Common keys: ``prompt`` (default 1020), ``output`` (129), ``lengths=PATH`` (draw the
(prompt, output) pairs of a trace file instead).
"""

from __future__ import annotations

from typing import Any

from tidegate.sim.synthetic import (
    Flash,
    Gaps,
    Lengths,
    LognormalLengths,
    RateWorkload,
    SampledLengths,
    constant,
    diurnal,
)
from tidegate.sim.traces import open_trace
from tidegate.sim.workload import Scale, Workload

_KEYS = {
    "poisson": {"rate", "duration_s"},
    "gamma": {"rate", "cv", "duration_s"},
    "diurnal": {"mean_rate", "peak_trough", "duration_s", "peak_hour", "cv", "flash"},
}
_COMMON = {"prompt", "output", "lengths"}
MAX_SAMPLED_PAIRS = 200_000


def parse_pairs(text: str, what: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what}: {item!r} is not KEY=VALUE")
        pairs[key.strip()] = value.strip()
    return pairs


def parse_workload(spec: str, scale: Scale, seed: int) -> Workload:
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in _KEYS:
        raise ValueError(
            f"workload kind {kind!r} is not one of {', '.join(_KEYS)} (see docs/simulator.md)"
        )
    values = parse_pairs(rest, f"workload {kind}")
    unknown = set(values) - _KEYS[kind] - _COMMON
    if unknown:
        allowed = ", ".join(sorted(_KEYS[kind] | _COMMON))
        raise ValueError(
            f"workload {kind}: unknown key(s) {', '.join(sorted(unknown))}; use {allowed}"
        )
    number = _numbers(values, kind)
    lengths = _lengths(values, number)
    if kind == "diurnal":
        segments = diurnal(
            number("mean_rate", None),
            number("peak_trough", 4.0),
            number("duration_s", 86_400.0),
            number("peak_hour", 14.0),
            Gaps.with_cv(number("cv", 1.0)),
            _flashes(values.get("flash", "")),
        )
    else:
        cv = number("cv", 3.0) if kind == "gamma" else 1.0
        segments = constant(number("rate", None), number("duration_s", 600.0), Gaps.with_cv(cv))
    return RateWorkload(spec, [("", segments)], lengths, scale, seed)


def _numbers(values: dict[str, str], kind: str) -> Any:
    def number(key: str, default: float | None) -> float:
        if key not in values:
            if default is None:
                raise ValueError(f"workload {kind}: {key}=... is required")
            return default
        try:
            value = float(values[key])
        except ValueError:
            raise ValueError(f"workload {kind}: {key}={values[key]!r} is not a number") from None
        if value < 0:
            raise ValueError(f"workload {kind}: {key} must be >= 0")
        return value

    return number


def _lengths(values: dict[str, str], number: Any) -> Lengths:
    if "lengths" in values:
        pairs = []
        for arrival in open_trace(values["lengths"]):
            pairs.append((arrival.prompt_tokens, arrival.output_tokens))
            if len(pairs) >= MAX_SAMPLED_PAIRS:
                break
        if not pairs:
            raise ValueError(f"lengths={values['lengths']}: the trace has no requests")
        return SampledLengths(tuple(pairs))
    return LognormalLengths(
        prompt_median=number("prompt", 1020.0), output_median=number("output", 129.0)
    )


def _flashes(text: str) -> tuple[Flash, ...]:
    flashes = []
    for item in filter(None, text.split("+")):
        parts = item.split("/")
        try:
            at_s, multiplier, duration_s = (float(part) for part in parts)
        except ValueError:
            raise ValueError(f"flash {item!r}: write START_S/MULTIPLIER/DURATION_S") from None
        flashes.append(Flash(at_s, multiplier, duration_s))
    return tuple(flashes)


def parse_slo(text: str) -> dict[str, float]:
    """``high=1,medium=5,low=30``: seconds to the first token, per level name."""
    slo = {}
    for name, value in parse_pairs(text, "slo").items():
        try:
            slo[name] = float(value.removesuffix("s"))
        except ValueError:
            raise ValueError(f"slo {name}={value!r}: give seconds, e.g. {name}=2") from None
    return slo
