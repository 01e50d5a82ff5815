"""engines/steps.py: a profile at the speed of the engine's own steps, and step rows."""

from __future__ import annotations

import pytest

from tidegate.engines.profile import Curve, EngineProfile
from tidegate.engines.steps import (
    StepTally,
    StepTotals,
    profile_at_steps,
    step_rows,
    table_of_rows,
)

PROFILE = EngineProfile(
    "g",
    "generate",
    ttft_ms=Curve((1.0, 2.0, 4.0), (100.0, 110.0, 200.0)),
    itl_ms=Curve((1.0, 2.0, 4.0), (30.0, 33.0, 45.0)),
    join_ms=70.0,
)
WINDOW = {
    ("decode", 1): StepTotals(10, 0.36, 0),  # 36 ms: the engine ran slower than profiled
    ("decode", 2): StepTotals(20, 0.80, 0),  # 40 ms
    ("decode", 3): StepTotals(2, 0.20, 0),  # too few steps: left out
    ("start", 1): StepTotals(5, 0.60, 5),  # 120 ms
    ("join", 2): StepTotals(4, 0.56, 4),  # 140 ms: a decode step of 2 (40) and a join of 100
}


def test_the_window_s_steps_replace_the_prices_it_measured() -> None:
    at = profile_at_steps(PROFILE, WINDOW)
    assert at.itl_ms == Curve((1.0, 2.0), pytest.approx((36.0, 40.0)))  # decode steps only
    assert at.itl_ms is not None
    assert at.itl_ms(4) == pytest.approx(48.0)  # beyond them: the last two extended
    # a lone start measured; the profile's time to first token elsewhere
    assert at.ttft_ms == Curve((1.0, 2.0, 4.0), pytest.approx((120.0, 110.0, 200.0)))
    assert at.join_ms == pytest.approx(100.0)
    assert (at.model, at.task) == (PROFILE.model, PROFILE.task)


def test_a_window_without_steps_keeps_the_profile() -> None:
    assert profile_at_steps(PROFILE, {}) == PROFILE
    embeddings = EngineProfile("e", "embeddings", batch_latency_ms=Curve((1.0,), (5.0,)))
    assert profile_at_steps(embeddings, WINDOW) is embeddings


def test_step_rows_read_back() -> None:
    rows = step_rows(WINDOW)
    assert rows[0] == {"kind": "decode", "running": 1, "steps": 10, "seconds": 0.36, "joins": 0}
    assert table_of_rows(rows) == WINDOW
    with pytest.raises(ValueError, match="kind"):
        table_of_rows([{**rows[0], "kind": "prefill"}])
    with pytest.raises(KeyError):
        table_of_rows([{"kind": "decode"}])
    for bad in (
        {"steps": -1},
        {"seconds": float("nan")},
        {"seconds": float("inf")},
        {"running": 0},
    ):
        with pytest.raises(ValueError, match="finite"):
            table_of_rows([{**rows[0], **bad}])


EMBEDDINGS = EngineProfile(
    "e", "embeddings", batch_latency_ms=Curve((1.0, 8.0, 32.0), (10.0, 20.0, 60.0))
)


def test_an_embeddings_window_prices_the_batch_sizes_it_measured() -> None:
    tally = StepTally()
    for _ in range(4):
        tally.add_batch(8, 0.030)  # 30 ms: 1.5x the profile's 20
        tally.add_batch(16, 0.045)  # the profile says 33.3 (a third of the way to 60 ms)
    tally.add_batch(2, 0.050)  # one batch: too few for its own price
    window = tally.table()
    assert window[("batch", 8)] == StepTotals(4, pytest.approx(0.12), 0)
    at = profile_at_steps(EMBEDDINGS, window)
    assert at.batch_latency_ms is not None
    # measured sizes at their means; outside them the profile's points at the window's speed
    # against the profile over all its batches (0.35 s for 0.2248 s profiled: x1.557)
    factor = 0.35 / (4 * 0.020 + 4 * (20 + 40 / 3) / 1e3 + (10 + 10 / 7) / 1e3)
    assert at.batch_latency_ms.xs == (1.0, 8.0, 16.0, 32.0)
    assert at.batch_latency_ms.ys == pytest.approx((10 * factor, 30.0, 45.0, 60 * factor))
    assert step_rows(window)[0]["kind"] == "batch"
    assert table_of_rows(step_rows(window)) == pytest.approx(window)
    only_few = {("batch", 4): StepTotals(2, 0.1, 0)}  # no size with enough batches
    scaled = profile_at_steps(EMBEDDINGS, only_few).batch_latency_ms
    assert scaled is not None
    assert scaled.ys == pytest.approx(tuple(y * 50.0 / (10 + 10 * 3 / 7) for y in (10, 20, 60)))
