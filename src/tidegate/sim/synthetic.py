"""Rate-defined workloads: arrivals drawn from a rate curve, seeded.

A ``Segment`` is a span of time with a mean rate and an inter-arrival law (exponential for
Poisson, gamma of a given CV for bursty traffic, or the gamma / Weibull that ServeGen fitted
per 10-minute window). Arrivals follow a renewal process in *operational time*: each gap is
a draw of mean 1 spent at the local rate, so a gap that crosses into a busier segment is
shortened accordingly, and a rate of 0 simply passes. For Poisson this is exact.

Generators here: ``poisson``, ``gamma`` (constant rate), ``diurnal`` (a day shaped by a
cosine with a given peak:trough ratio, plus rectangular flash crowds), and the ServeGen
readers in ``traces`` build their curves from the same pieces. Token lengths come from a
``Lengths`` (lognormal by default, fitted to the Azure conversation trace: prompt median
1020 tokens, p90 2735; output median 129, p90 424).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from tidegate.sim.workload import NO_SCALE, Arrival, Scale

DIURNAL_STEP_S = 60.0  # the cosine day is piecewise constant at this resolution
SECONDS_PER_DAY = 86_400.0


@dataclass(frozen=True, slots=True)
class Gaps:
    """An inter-arrival law with mean 1: ``exponential``, ``gamma`` or ``weibull``."""

    law: str = "exponential"
    shape: float = 1.0  # gamma: k (CV = 1/sqrt(k)); weibull: c

    def draw(self, rng: random.Random) -> float:
        if self.law == "gamma":
            return rng.gammavariate(self.shape, 1.0 / self.shape)
        if self.law == "weibull":
            return rng.weibullvariate(1.0 / math.gamma(1.0 + 1.0 / self.shape), self.shape)
        return rng.expovariate(1.0)

    @staticmethod
    def with_cv(cv: float) -> Gaps:
        if cv <= 0:
            raise ValueError(f"cv must be > 0, got {cv}")
        return Gaps() if cv == 1.0 else Gaps("gamma", 1.0 / (cv * cv))


@dataclass(frozen=True, slots=True)
class Segment:
    start_s: float
    end_s: float
    arrivals_per_s: float
    gaps: Gaps = Gaps()


class Lengths(Protocol):
    def draw(self, rng: random.Random) -> tuple[int, int]:
        """(prompt tokens, output tokens)."""


@dataclass(frozen=True, slots=True)
class LognormalLengths:
    prompt_median: float = 1020.0
    prompt_sigma: float = 0.77
    output_median: float = 129.0
    output_sigma: float = 0.93
    max_tokens: int = 16_384

    def draw(self, rng: random.Random) -> tuple[int, int]:
        prompt = rng.lognormvariate(math.log(self.prompt_median), self.prompt_sigma)
        output = (
            rng.lognormvariate(math.log(self.output_median), self.output_sigma)
            if self.output_median > 0
            else 0.0
        )
        return (
            max(1, min(self.max_tokens, round(prompt))),
            min(self.max_tokens, round(output)) if self.output_median > 0 else 0,
        )


@dataclass(frozen=True, slots=True)
class SampledLengths:
    """Lengths drawn from the (prompt, output) pairs of a real trace."""

    pairs: tuple[tuple[int, int], ...]

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return self.pairs[rng.randrange(len(self.pairs))]


def arrivals_on(
    segments: Sequence[Segment], lengths: Lengths, rng: random.Random, tenant: str = ""
) -> Iterator[Arrival]:
    """Arrivals of one renewal process over ``segments`` (sorted, not overlapping)."""
    now = segments[0].start_s if segments else 0.0
    index = 0
    while index < len(segments):
        segment = segments[index]
        if now < segment.start_s:
            now = segment.start_s
        left = segment.gaps.draw(rng)  # operational time to the next arrival
        while index < len(segments):
            segment = segments[index]
            now = max(now, segment.start_s)
            rate = segment.arrivals_per_s
            if rate > 0 and now + left / rate < segment.end_s:
                now += left / rate
                break
            if rate > 0:
                left -= rate * (segment.end_s - now)
            now = segment.end_s
            index += 1
        else:
            return
        prompt, output = lengths.draw(rng)
        yield Arrival(now, prompt, output, None, tenant)


def scaled(segments: Sequence[Segment], scale: Scale) -> list[Segment]:
    """Rate times ``rate_scale``; time divided by ``speedup`` (see ``workload``)."""
    k = scale.speedup
    return [
        Segment(s.start_s / k, s.end_s / k, s.arrivals_per_s * scale.rate_scale, s.gaps)
        for s in segments
    ]


class RateWorkload:
    """Arrivals of one or more tenants, each a renewal process over its own segments."""

    def __init__(
        self,
        name: str,
        tenants: Sequence[tuple[str, Sequence[Segment]]],
        lengths: Lengths,
        scale: Scale = NO_SCALE,
        seed: int = 0,
    ) -> None:
        self.name = name
        self.tenants = [(tenant, scaled(segments, scale)) for tenant, segments in tenants]
        self.lengths = lengths
        self.seed = seed

    def __iter__(self) -> Iterator[Arrival]:
        streams = [
            arrivals_on(segments, self.lengths, random.Random(f"{self.seed}:{tenant}"), tenant)
            for tenant, segments in self.tenants
            if segments
        ]
        if len(streams) == 1:
            return streams[0]
        return heapq.merge(*streams, key=lambda a: a.arrival_s)


def constant(arrivals_per_s: float, duration_s: float, gaps: Gaps = Gaps()) -> list[Segment]:
    return [Segment(0.0, duration_s, arrivals_per_s, gaps)]


@dataclass(frozen=True, slots=True)
class Flash:
    at_s: float
    multiplier: float
    duration_s: float


def diurnal(
    mean_arrivals_per_s: float,
    peak_to_trough: float,
    duration_s: float = SECONDS_PER_DAY,
    peak_hour: float = 14.0,
    gaps: Gaps = Gaps(),
    flashes: Sequence[Flash] = (),
) -> list[Segment]:
    """A cosine day with ``peak_to_trough`` between its highest and lowest rate (mean kept),
    flash crowds multiplying the rate in their window."""
    if peak_to_trough < 1:
        raise ValueError(f"peak:trough must be >= 1, got {peak_to_trough}")
    amplitude = (peak_to_trough - 1.0) / (peak_to_trough + 1.0)
    steps = math.ceil(duration_s / DIURNAL_STEP_S)
    cuts = {min(duration_s, i * DIURNAL_STEP_S) for i in range(steps + 1)}
    for flash in flashes:
        cuts |= {t for t in (flash.at_s, flash.at_s + flash.duration_s) if 0 < t < duration_s}
    points = sorted(cuts)
    segments = []
    for start, end in itertools.pairwise(points):
        middle_h = (start + end) / 2 / 3600.0
        cosine = math.cos(2 * math.pi * (middle_h - peak_hour) / 24)
        rate = mean_arrivals_per_s * (1 + amplitude * cosine)
        for flash in flashes:
            if flash.at_s <= start < flash.at_s + flash.duration_s:
                rate *= flash.multiplier
        segments.append(Segment(start, end, rate, gaps))
    return segments
