"""The drift check of ``--through-gateway``: the top level before the sweep against its own."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.profile.test_outputs import EMBEDDINGS_POINTS, SLO, point, record
from tidegate.profile.drift import DRIFT_LIMIT, Drift, drift_between, engine_figure
from tidegate.profile.options import ProfileOptions
from tidegate.profile.outputs import write_outputs
from tidegate.profile.recommend import recommend

SWEEP = [
    point("concurrency", 32, 5.0, level, batch_latency_ms=ms)
    for level, ms in ((1, 17.0), (16, 62.0), (64, 250.0))
]


def test_the_reference_is_set_against_the_sweeps_point_at_its_level() -> None:
    before = point("concurrency", 32, 5.0, 64, batch_latency_ms=200.0)
    drift = drift_between(before, SWEEP)
    assert drift == Drift(64, "engine time per batch", 200.0, 250.0)
    assert drift is not None
    assert drift.ratio == pytest.approx(1.25)
    assert drift.moved
    assert "+25%" in drift.sentence()
    assert "measure again when the machine is quieter" in drift.sentence()
    steady = drift_between(dataclasses.replace(before, batch_latency_ms=240.0), SWEEP)
    assert steady is not None
    assert not steady.moved
    assert "held within 10%" in steady.sentence()


def test_no_check_without_both_measurements_of_one_engine_figure() -> None:
    before = point("concurrency", 32, 5.0, 64, batch_latency_ms=200.0)
    assert drift_between(None, SWEEP) is None
    assert drift_between(before, SWEEP[:2]) is None  # the sweep stopped below the level
    assert drift_between(dataclasses.replace(before, batch_latency_ms=None), SWEEP) is None
    tokens = dataclasses.replace(before, batch_latency_ms=None, itl_mean_ms=40.0)
    assert engine_figure(tokens) == ("mean time between tokens", 40.0)
    assert drift_between(tokens, SWEEP) is None  # different figures are not compared


@given(st.floats(1.0, 1e4), st.floats(0.5, 2.0))
def test_moved_is_the_ratio_beyond_the_limit(first: float, ratio: float) -> None:
    drift = Drift(8, "engine time per batch", first, first * ratio)
    assert drift.ratio == pytest.approx(ratio)
    if abs(ratio - 1.0) > DRIFT_LIMIT * 1.001:
        assert drift.moved
    elif abs(ratio - 1.0) < DRIFT_LIMIT * 0.999:
        assert not drift.moved
    assert drift.describe()["moved"] is drift.moved


def test_the_profile_and_the_report_carry_the_check(tmp_path: Path) -> None:
    options = ProfileOptions(model="minilm", out=tmp_path, slo=SLO, through_gateway=True)
    drift = Drift(64, "engine time per batch", 208.0, 309.0)
    run = dataclasses.replace(record(tmp_path), options=options, drift=drift)
    rec = recommend(EMBEDDINGS_POINTS, SLO, "embeddings", local=True)
    write_outputs(tmp_path, run, EMBEDDINGS_POINTS, rec)
    measured = json.loads((tmp_path / "profile.json").read_text())["measured"]
    assert measured["drift"] == {
        "concurrency": 64,
        "figure": "engine time per batch",
        "first_ms": 208.0,
        "last_ms": 309.0,
        "ratio": 1.486,
        "moved": True,
        "limit": DRIFT_LIMIT,
    }
    report = (tmp_path / "report.md").read_text()
    assert "- Drift check: 64 in flight, measured before the sweep" in report
    assert "208.0 then 309.0 ms (+49%)" in report
    without = tmp_path / "without"
    write_outputs(without, record(without), EMBEDDINGS_POINTS, rec)
    assert json.loads((without / "profile.json").read_text())["measured"]["drift"] is None
    assert "Drift check" not in (without / "report.md").read_text()
