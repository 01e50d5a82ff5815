"""The drift check of ``--through-gateway``: did the machine's speed hold while profiling?

The through-gateway profile is a calibration: the simulator replays its curves as the
engine's speed. On a shared machine that speed moves, and a profile whose points were
measured at different speeds gives a curve no moment of the machine had. On the 2-CPU
machine of docs/benchmarks.md ("Fidelity") one profile measured its levels of 32 and 64 in
flight in a slow spell (7.6-7.9 ms of engine time per input, against 6.2 at 16 in flight a
few seconds before), so the simulated capacity came out 103 requests/s where profiles minutes
before and after gave 151-200, and every simulated figure past it was wrong.

So the planner measures the top level (the one the simulated capacity rests on) once more
before the sweep starts, and sets it against the sweep's own measurement of that level at the
end: the engine's time per batch (generation: the mean time between tokens), from the
worker's /metrics or the client's token stamps as for every point. The two are the sweep's
first and last minute. Apart by more than ``DRIFT_LIMIT``, the report says the machine's speed
moved and the profile is best measured again; profile.json keeps both figures under
``measured.drift``. The check only reports: nothing is corrected with it, since the moment
of the change is not known. Being the stack's first load, the reference point also keeps
the sweep's first level off a cold engine (generation's first calls are slow: smollm2's
time to first token at 1 in flight was 246-284 ms as the first point, 131 ms after it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tidegate.engines.profile import MeasuredPoint

DRIFT_LIMIT = 0.10  # the two measurements further apart than this: the speed moved


@dataclass(frozen=True, slots=True)
class Drift:
    """The top level measured before the sweep and again in it."""

    concurrency: int  # requests in flight at the level measured twice
    figure: str  # what was compared
    first_ms: float  # before the sweep
    last_ms: float  # the sweep's own point

    @property
    def ratio(self) -> float:
        return self.last_ms / self.first_ms

    @property
    def moved(self) -> bool:
        return abs(self.ratio - 1.0) > DRIFT_LIMIT

    def describe(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "figure": self.figure,
            "first_ms": round(self.first_ms, 3),
            "last_ms": round(self.last_ms, 3),
            "ratio": round(self.ratio, 3),
            "moved": self.moved,
            "limit": DRIFT_LIMIT,
        }

    def sentence(self) -> str:
        said = (
            f"{self.concurrency} in flight, measured before the sweep and again at its turn: "
            f"{self.figure} {self.first_ms:.1f} then {self.last_ms:.1f} ms "
            f"({self.ratio - 1.0:+.0%})"
        )
        if not self.moved:
            return f"{said}; the machine's speed held within {DRIFT_LIMIT:.0%}."
        return (
            f"{said}. The machine's speed moved by more than {DRIFT_LIMIT:.0%} while profiling, "
            "so the curve mixes speeds: measure again when the machine is quieter."
        )


def engine_figure(point: MeasuredPoint) -> tuple[str, float] | None:
    """The engine's time a point measured: per batch, or (generation) between tokens."""
    if point.batch_latency_ms:
        return "engine time per batch", point.batch_latency_ms
    if point.itl_mean_ms:
        return "mean time between tokens", point.itl_mean_ms
    return None


def drift_between(first: MeasuredPoint | None, points: list[MeasuredPoint]) -> Drift | None:
    """``first`` (the level measured before the sweep) against the sweep's point at the same
    level; None when either is missing or measured no engine time."""
    if first is None:
        return None
    same = [p for p in points if p.sweep == first.sweep and p.concurrency == first.concurrency]
    if not same:
        return None
    before, after = engine_figure(first), engine_figure(same[-1])
    if before is None or after is None or before[0] != after[0]:
        return None
    return Drift(first.concurrency, before[0], before[1], after[1])
