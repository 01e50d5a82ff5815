"""engines/steps.py: a profile at the speed of the engine's own steps, and step rows."""

from __future__ import annotations

import pytest

from tidegate.engines.profile import Curve, EngineProfile
from tidegate.engines.steps import StepTotals, profile_at_steps, step_rows, table_of_rows

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
