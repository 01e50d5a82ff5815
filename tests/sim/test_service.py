"""Service models from a profile and from splitwise-sim's perf_model.csv."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidegate.engines.profile import default_profile
from tidegate.errors import ConfigError
from tidegate.sim.service import default_service, from_profile, load_service

from .conftest import FIXTURES, flat_step_service

PERF = FIXTURES / "perf_model_slice.csv"


def test_perf_model_steps_match_the_measured_table() -> None:
    service = load_service(str(PERF))  # default: llama2-70b on a100-80gb, TP8
    assert service.task == "generate"
    assert service.name == "llama2-70b on a100-80gb TP8"
    assert service.source == "perf_model_slice.csv"
    step = service.step
    assert step is not None
    # Decode: token_time by batch, averaged over the rows (README: about 45 ms at batch 1,
    # 50 at 16 and 71 at 64 for 512-token prompts).
    assert step.step_s(1, 0, 0) == pytest.approx(0.045, abs=0.002)
    assert step.step_s(16, 0, 0) == pytest.approx(0.050, abs=0.002)
    assert step.step_s(64, 0, 0) == pytest.approx(0.0716, abs=0.002)
    # Prefill by the step's prompt tokens: 2048 tokens were measured as one 2048-token
    # prompt (274 ms) and as 4 x 512 (291 ms): their mean. Sequences already running add
    # their decode step.
    assert step.step_s(0, 1, 2048) == pytest.approx((0.2738 + 0.2908) / 2, abs=0.002)
    prefill_s = step.step_s(0, 1, 2048)
    assert step.step_s(8, 1, 2048) == pytest.approx(prefill_s + step.step_s(8, 0, 0))
    # Longer prompts and bigger batches never get cheaper.
    assert step.step_s(0, 1, 8192) > step.step_s(0, 1, 1024) > step.step_s(0, 1, 128)


def test_perf_model_selection_by_hardware() -> None:
    h100 = load_service(f"{PERF}#llama2-70b/h100-80gb/8")
    a100 = load_service(str(PERF))
    assert h100.step is not None
    assert a100.step is not None
    assert h100.step.step_s(1, 0, 0) < a100.step.step_s(1, 0, 0)  # README: 30 vs 45 ms


def test_an_unknown_selection_lists_what_the_file_has() -> None:
    with pytest.raises(ConfigError, match="llama2-70b/a100-80gb/8"):
        load_service(f"{PERF}#bloom-176b/a100-80gb/8")
    with pytest.raises(ConfigError, match="MODEL/HARDWARE/TP"):
        load_service(f"{PERF}#llama2-70b")


def test_a_profile_json_loads_as_a_batch_or_step_model(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(
        json.dumps(
            {
                "version": 1,
                "model": "minilm",
                "task": "embeddings",
                "embeddings": {
                    "points": [
                        {"batch_size": 1, "latency_ms": 10.0},
                        {"batch_size": 32, "latency_ms": 72.0},
                    ]
                },
            }
        )
    )
    service = load_service(str(path))
    assert service.task == "embeddings"
    assert service.source == "profile.json"
    assert service.batch is not None
    assert service.batch.batch_s(1, 14) == pytest.approx(0.010)
    assert service.batch.batch_s(16, 200) == pytest.approx(0.010 + 15 * 0.062 / 31)


def test_a_concurrency_profile_makes_joining_steps_cost_the_ttft() -> None:
    generate = default_service("generate")  # ttft/itl: 20/10 ms at 1, 30/14 at 8, 60/25 at 32
    step = generate.step
    assert step is not None
    assert step.step_s(1, 0, 0) == pytest.approx(0.010)
    assert step.step_s(0, 1, 100) == pytest.approx(0.020)  # alone: its TTFT
    assert step.step_s(0, 32, 3200) == pytest.approx(0.060)  # all join at once: TTFT(32)
    assert step.step_s(7, 1, 100) == pytest.approx(0.014 + 0.010)  # decode of 8, one prefill
    # A lone joiner among 32 costs the prefill of one prompt, not a 32nd of 32 prompts'.
    assert step.step_s(31, 1, 100) == pytest.approx(0.025 + (0.020 - 0.010))
    # Joiners into a decoding batch each pay a lone prompt's prefill: 8 cost 8 of them,
    # where 8 joining an idle engine together cost TTFT(8) - ITL(8).
    assert step.step_s(24, 8, 800) == pytest.approx(0.025 + 8 * (0.020 - 0.010))
    assert step.step_s(0, 8, 800) == pytest.approx(0.030)
    assert flat_step_service(7.0).step is not None


def test_a_measured_join_price_replaces_the_lone_prefill() -> None:
    profile = default_profile("generate")  # ttft/itl: 20/10 ms at 1, 30/14 at 8
    step = from_profile(replace(profile, join_ms=45.0), "measured").step
    assert step is not None
    assert step.step_s(7, 1, 100) == pytest.approx(0.014 + 0.045)  # decode of 8, one join
    assert step.step_s(5, 3, 300) == pytest.approx(0.014 + 3 * 0.045)
    assert step.step_s(0, 8, 800) == pytest.approx(0.030)  # an idle engine: as measured
    assert step.step_s(8, 0, 0) == pytest.approx(0.014)


@given(
    num_decode=st.integers(0, 40),
    num_prefill=st.integers(0, 40),
    more=st.integers(1, 8),
)
def test_a_joining_step_costs_more_with_more_joiners_and_more_running(
    num_decode: int, num_prefill: int, more: int
) -> None:
    step = default_service("generate").step  # both curves rise with the sequences
    assert step is not None
    base = step.step_s(num_decode, num_prefill, 0)
    assert step.step_s(num_decode + more, num_prefill, 0) >= base
    if num_decode + num_prefill:
        assert step.step_s(num_decode, num_prefill + more, 0) >= base


def test_a_missing_profile_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_service(str(tmp_path / "nope.json"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_service(str(tmp_path / "nope.csv"))


@pytest.mark.parametrize("task", ["embeddings", "generate"])
def test_scaled_multiplies_every_batch_or_step(task: str) -> None:
    from tidegate.sim.service import scaled

    base = default_service(task)
    slower = scaled(base, 1.25)
    assert slower.task == task
    assert "x1.25" in slower.name
    if task == "embeddings":
        assert base.batch is not None
        assert slower.batch is not None
        for size in (1, 7, 32):
            assert slower.batch.batch_s(size, 0) == pytest.approx(
                1.25 * base.batch.batch_s(size, 0)
            )
    else:
        assert base.step is not None
        assert slower.step is not None
        for args in ((4, 0, 0), (3, 1, 200), (0, 2, 900)):
            assert slower.step.step_s(*args) == pytest.approx(1.25 * base.step.step_s(*args))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="factor"):
            scaled(base, bad)
