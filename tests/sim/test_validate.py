"""``tidegate simulate --validate RUN``: run files, the replay and the comparison.

The reference run is the simulator's own output written as a run file: replayed with the
same profile every figure agrees exactly; with a profile 1.6x slower the latencies are off
and the verdict says MISS. A hand-made run checks the outcome mapping and the counts rule.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tidegate.cli import app
from tidegate.engines.profile import Curve, EngineProfile
from tidegate.engines.steps import StepTotals
from tidegate.errors import ConfigError
from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.service import from_profile
from tidegate.sim.validate import (
    STATUS_OF_OUTCOME,
    EngineBatches,
    Figure,
    RecordedRun,
    RunRequest,
    Side,
    compare,
    load_run,
    own_engine_service,
    validate,
    write_run,
)
from tidegate.sim.workload import Arrival, Listed

from .conftest import config_of, flat_batch_service, flat_step_service

CONFIG: dict[str, Any] = {
    "gateway": {"policy": "priority"},
    "models": [
        {
            "name": "m",
            "task": "embeddings",
            "engine": "simulated",
            "replicas": 1,
            "batching": {"max_batch_size": 4, "batch_window_ms": 5},
            "queue": {"max_size": 40},
        }
    ],
}
PROFILE: dict[str, Any] = {
    "version": 1,
    "model": "m",
    "task": "embeddings",
    "embeddings": {
        "points": [{"batch_size": 1, "latency_ms": 10}, {"batch_size": 4, "latency_ms": 25}]
    },
}


def arrivals(rate: float, count: int, seed: int = 1) -> list[Arrival]:
    draw = random.Random(seed)
    at, out = 0.0, []
    for _ in range(count):
        at += draw.expovariate(rate)
        out.append(Arrival(at, 14, 0, draw.choice(("high", "medium", "low"))))
    return out


def recorded_from_simulation(latency_ms: float, schedule: list[Arrival]) -> RecordedRun:
    """What the simulator saw, as a run file would hold it."""
    scenario = Scenario(
        config_of(CONFIG),
        "m",
        flat_batch_service(latency_ms),
        Listed("t", schedule),
        {"shared": 1},
        keep_requests=True,
    )
    result = Simulation(scenario).run()
    assert result.recorder.requests is not None
    requests = []
    for record in sorted(result.recorder.requests, key=lambda r: int(r.id)):
        a = schedule[int(record.id)]
        status = STATUS_OF_OUTCOME[record.outcome]
        latency = record.e2e_s if status == 200 else 0.001
        requests.append(RunRequest(a.arrival_s, a.priority, 14, 0, status, latency))
    return RecordedRun("m", "embeddings", CONFIG, tuple(requests), None, "run.json")


def profile_file(tmp_path: Path, latency_ms: float) -> str:
    path = tmp_path / f"profile-{latency_ms:g}.json"
    points = [{"batch_size": 1, "latency_ms": latency_ms}]
    path.write_text(json.dumps({**PROFILE, "embeddings": {"points": points}}))
    return str(path)


def test_a_run_of_the_simulator_itself_validates_exactly(tmp_path: Path) -> None:
    from tidegate.sim.service import load_service

    schedule = arrivals(300.0, 1500)  # overload: 429s as well as completions
    run = recorded_from_simulation(20.0, schedule)
    write_run(tmp_path / "run.json", run)
    again = load_run(tmp_path / "run.json")
    validation, measured, _simulated = validate(again, load_service(profile_file(tmp_path, 20)))
    assert sum(measured.statuses["low"].values()) > 0
    assert measured.statuses["low"][429] > 0  # the check covers refusals too
    for figure in validation.figures:
        assert figure.measured == pytest.approx(figure.simulated, rel=1e-3, abs=1e-3), figure
    assert validation.passed
    assert validation.verdict().startswith("PASS")


def test_a_slower_real_stack_is_a_miss_with_the_errors_signed(tmp_path: Path) -> None:
    from tidegate.sim.service import load_service

    schedule = arrivals(60.0, 600)
    run = recorded_from_simulation(32.0, schedule)  # the "real" stack: 1.6x slower batches
    validation, _, _ = validate(run, load_service(profile_file(tmp_path, 20)))
    p50 = [f for f in validation.figures if f.name == "e2e p50 ms"]
    assert p50
    assert all(f.error < -0.15 for f in p50)
    assert not validation.passed
    assert validation.verdict().startswith("MISS")


def test_counts_under_one_percent_are_compared_as_a_share_of_the_class() -> None:
    measured, simulated = Side(), Side()
    for side, rejected in ((measured, 0), (simulated, 3)):
        side.statuses["low"] = Counter({200: 3000 - rejected})
        side.statuses["low"][429] = rejected
        side.e2e_s["low"] = [0.1] * (3000 - rejected)
        side.span_s = 10.0
    figures = {f.name: f for f in compare(measured, simulated, "embeddings")}
    assert figures["429"].error == pytest.approx(3 / 3000)
    assert figures["429"].ok
    assert figures["throughput /s"].error == pytest.approx(-3 / 3000)
    assert math.isnan(figures["e2e p50 ms"].error) is False


def test_the_command_prints_the_table_and_exits_by_the_verdict(tmp_path: Path) -> None:
    run = recorded_from_simulation(20.0, arrivals(100.0, 300))
    write_run(tmp_path / "run.json", run)
    runner = CliRunner()
    good = runner.invoke(
        app,
        [
            "simulate",
            "--validate",
            str(tmp_path / "run.json"),
            "--profile",
            profile_file(tmp_path, 20),
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert good.exit_code == 0, good.output
    assert "e2e p95 ms" in good.output
    assert "PASS" in good.output
    assert json.loads((tmp_path / "out" / "validation.json").read_text())["passed"] is True
    bad = runner.invoke(
        app,
        [
            "simulate",
            "--validate",
            str(tmp_path / "run.json"),
            "--profile",
            profile_file(tmp_path, 40),
        ],
    )
    assert bad.exit_code == 1, bad.output
    assert "MISS" in bad.output


def test_a_file_that_is_not_a_run_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"format": "tidegate-run", "version": 1, "model": "m"}))
    with pytest.raises(ConfigError, match="task"):
        load_run(path)


GENERATE_CONFIG: dict[str, Any] = {
    "models": [
        {
            "name": "g",
            "task": "generate",
            "engine": "simulated",
            "replicas": 1,
            "batching": {"max_num_seqs": 4},
        }
    ],
}


def generation_run(step_ms: float) -> RecordedRun:
    """A generation run of the simulator whose every engine step took ``step_ms``."""
    draw = random.Random(3)
    at, schedule = 0.0, []
    for _ in range(200):
        at += draw.expovariate(8.0)
        schedule.append(Arrival(at, 30, 6, draw.choice(("high", "low"))))
    scenario = Scenario(
        config_of(GENERATE_CONFIG),
        "g",
        flat_step_service(step_ms),
        Listed("t", schedule),
        {"shared": 1},
        keep_requests=True,
    )
    result = Simulation(scenario).run()
    assert result.recorder.requests is not None
    requests = []
    for record in sorted(result.recorder.requests, key=lambda r: int(r.id)):
        a = schedule[int(record.id)]
        status = STATUS_OF_OUTCOME[record.outcome]
        requests.append(
            RunRequest(a.arrival_s, a.priority, 30, 6, status, record.e2e_s, record.ttft_s)
        )
    return RecordedRun("g", "generate", GENERATE_CONFIG, tuple(requests), None, "g.json")


def test_a_generation_run_compares_time_to_first_token_and_end_to_end() -> None:
    run = generation_run(20.0)
    validation, _, _ = validate(run, flat_step_service(20.0))
    names = {f.name for f in validation.figures}
    assert {"ttft p50 ms", "ttft p95 ms", "e2e p50 ms", "e2e p95 ms"} <= names
    for figure in validation.figures:
        assert figure.measured == pytest.approx(figure.simulated, rel=1e-3, abs=1e-3), figure
    slower, _, _ = validate(run, flat_step_service(40.0))
    ttft = [f for f in slower.figures if f.name == "ttft p50 ms"]
    assert all(f.error > 0.5 for f in ttft)  # the slower model is pessimistic, and says so
    with pytest.raises(ValueError, match="embeddings"):
        validate(run, flat_batch_service(10.0))


def test_the_engine_time_of_the_probe_replaces_the_profiles_in_the_round_trip(
    tmp_path: Path,
) -> None:
    from dataclasses import replace

    from tidegate.sim.validate import lone_request_s, network_s_for

    run = recorded_from_simulation(20.0, arrivals(50.0, 50))
    service = flat_batch_service(20.0)
    lone = lone_request_s(run, service)
    outside = lone - 0.020  # the batch window the simulator waits for a lone request
    assert outside >= 0
    probed = replace(run, idle_round_trip_s=0.050)
    assert network_s_for(probed, service) == pytest.approx(0.050 - lone)
    # The worker said its engine took 30 ms then (the profile says 20): the 10 ms more were
    # the engine's, not the network's.
    measured = replace(probed, idle_engine_s=0.030)
    assert network_s_for(measured, service) == pytest.approx(0.050 - 0.030 - outside)
    write_run(tmp_path / "run.json", measured)
    assert load_run(tmp_path / "run.json").idle_engine_s == pytest.approx(0.030)


def test_sensitivity_replays_the_run_with_the_engine_faster_and_slower(tmp_path: Path) -> None:
    from tidegate.sim.service import load_service

    # The "real" stack ran 10% slower than the profile: p50 within 15%, but a 10% spread
    # covers it exactly, and the figures move the way the engine does.
    run = recorded_from_simulation(22.0, arrivals(60.0, 600))
    service = load_service(profile_file(tmp_path, 20))
    plain, _, _ = validate(run, service)
    assert all(math.isnan(f.faster) and math.isnan(f.slower) for f in plain.figures)
    assert plain.sensitivity_line() == ""
    spread, _, _ = validate(run, service, sensitivity=0.1)
    assert [(f.cls, f.name, f.simulated) for f in spread.figures] == [
        (f.cls, f.name, f.simulated) for f in plain.figures
    ]  # the nominal replay and the verdict are the same
    assert spread.passed == plain.passed
    for f in spread.figures:
        if f.name == "e2e p50 ms":
            assert f.faster < f.simulated < f.slower, f
            assert f.slower == pytest.approx(f.measured, rel=0.02), f  # x1.1 = the real 22 ms
            assert f.reachable(0.0)
    line = spread.sensitivity_line()
    assert "x0.9 to x1.1" in line
    assert "not the verdict" in line
    with pytest.raises(ValueError, match="sensitivity"):
        validate(run, service, sensitivity=0.5)


def test_reachable_takes_the_simulated_range_as_continuous() -> None:
    def fig(measured: float, sim: float, faster: float, slower: float) -> Figure:
        return Figure(
            "high",
            "e2e p95 ms",
            measured,
            sim,
            (sim - measured) / measured,
            True,
            False,
            faster,
            slower,
        )

    assert fig(200, 310, 212, 384).reachable(0.15)  # 212 is within 15% of 200
    assert not fig(100, 310, 212, 384).reachable(0.15)  # the whole range is above 115
    assert fig(150, 100, 90, 300).reachable(0.0)  # 150 lies between 90 and 300
    assert not fig(150, math.nan, math.nan, math.nan).reachable(0.15)


def test_the_command_prints_the_spread_columns_and_needs_validate(tmp_path: Path) -> None:
    run = recorded_from_simulation(20.0, arrivals(100.0, 300))
    write_run(tmp_path / "run.json", run)
    runner = CliRunner()
    args = ["simulate", "--profile", profile_file(tmp_path, 20), "--sensitivity", "0.05"]
    done = runner.invoke(
        app, [*args, "--validate", str(tmp_path / "run.json"), "--out", str(tmp_path / "out")]
    )
    assert done.exit_code == 0, done.output
    assert "sim -5%" in done.output
    assert "sim +5%" in done.output
    assert "x0.95 to x1.05" in done.output
    data = json.loads((tmp_path / "out" / "validation.json").read_text())
    assert data["sensitivity"] == 0.05
    assert all("simulated_faster" in f for f in data["figures"])
    alone = runner.invoke(app, args)
    assert alone.exit_code == 2
    assert "--sensitivity needs --validate" in alone.output
    too_far = runner.invoke(app, [*args[:-1], "0.6", "--validate", str(tmp_path / "run.json")])
    assert too_far.exit_code == 2


def flat_profile(task: str, ms: float) -> EngineProfile:
    """The profile of ``flat_batch_service`` / ``flat_step_service``."""
    curve = Curve((1.0,), (ms,))
    if task == "generate":
        return EngineProfile("flat", task, ttft_ms=curve, itl_ms=curve)
    return EngineProfile("flat", task, batch_latency_ms=curve)


def test_own_engine_time_takes_the_generation_steps_from_the_run(tmp_path: Path) -> None:
    # The run's worker saw every step take 20 ms (decode, start, and joins that cost their
    # step nothing more, as flat_step_service charges); the profile says 40.
    table = {("decode", n): StepTotals(10, 0.2, 0) for n in (1, 2, 3, 4)}
    table.update({("start", n): StepTotals(5, 0.1, 5 * n) for n in (1, 2)})
    table.update({("join", n): StepTotals(5, 0.1, 5) for n in (2, 3, 4)})
    run = replace(generation_run(20.0), engine_steps=table)
    write_run(tmp_path / "g.json", run)
    again = load_run(tmp_path / "g.json")
    assert again.engine_steps == table
    plain, _, _ = validate(again, from_profile(flat_profile("generate", 40.0), "p"))
    assert not plain.passed  # the profile's speed is not the run's
    own = own_engine_service(again, flat_profile("generate", 40.0), "p")
    validation, _, _ = validate(again, own)
    for figure in validation.figures:
        assert figure.measured == pytest.approx(figure.simulated, rel=1e-3, abs=1e-3), figure
    assert validation.passed
    with pytest.raises(ConfigError, match="engine_steps"):
        own_engine_service(generation_run(20.0), flat_profile("generate", 40.0), "p")
    with pytest.raises(ConfigError, match="task"):
        own_engine_service(again, flat_profile("embeddings", 40.0), "p")


def test_own_engine_time_scales_embeddings_batches_by_the_runs_own(tmp_path: Path) -> None:
    run = recorded_from_simulation(32.0, arrivals(60.0, 600))  # batches of 32 ms
    write_run(tmp_path / "run.json", replace(run, engine_batches=EngineBatches(200, 2.5, 32.0)))
    assert load_run(tmp_path / "run.json").engine_batches == EngineBatches(200, 2.5, 32.0)
    runner = CliRunner()
    args = ["simulate", "--validate", str(tmp_path / "run.json")]
    args += ["--profile", profile_file(tmp_path, 20)]  # the profile says 20 ms
    assert runner.invoke(app, args).exit_code == 1  # MISS at the profile's speed
    own = runner.invoke(app, [*args, "--own-engine-time"])
    assert own.exit_code == 0, own.output  # PASS at the run's own
    assert "the run's own speed" in own.output
    write_run(tmp_path / "bare.json", run)
    bare = runner.invoke(app, [*args[:1], "--validate", str(tmp_path / "bare.json"), *args[3:]])
    assert bare.exit_code == 1  # (no figures recorded: a plain replay still works)
    missing = runner.invoke(
        app, [*args[:1], "--validate", str(tmp_path / "bare.json"), *args[3:], "--own-engine-time"]
    )
    assert missing.exit_code == 2
    assert "engine_batches" in missing.output
    data = json.loads((tmp_path / "run.json").read_text())
    data["engine_batches"]["mean_ms"] = float("nan")
    (tmp_path / "nan.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="engine_batches"):
        load_run(tmp_path / "nan.json")
    alone = runner.invoke(app, ["simulate", "--own-engine-time"])
    assert alone.exit_code == 2
    assert "--own-engine-time needs --validate" in alone.output


def test_own_engine_time_prices_embeddings_batches_by_size_from_the_run(tmp_path: Path) -> None:
    # The run's engine took 32 ms a batch whatever its size; the profile says 10 ms for one
    # input and 40 ms for eight. Its batch table (kind "batch") gives the price of every size;
    # one factor at the run's mean batch would keep the profile's slope.
    run = recorded_from_simulation(32.0, arrivals(60.0, 600))
    table = {("batch", n): StepTotals(10, 0.32, 0) for n in range(1, 9)}
    write_run(tmp_path / "run.json", replace(run, engine_steps=table))
    again = load_run(tmp_path / "run.json")
    assert again.engine_steps == table
    sloped = EngineProfile("e", "embeddings", batch_latency_ms=Curve((1.0, 8.0), (10.0, 40.0)))
    own = own_engine_service(again, sloped, "p")
    assert own.batch is not None
    assert [own.batch.batch_s(n, 0) for n in (1, 4, 8)] == pytest.approx([0.032] * 3)
    validation, _, _ = validate(again, own)
    for figure in validation.figures:
        assert figure.measured == pytest.approx(figure.simulated, rel=1e-3, abs=1e-3), figure
    assert validation.passed
    # The command prints the run's batches beside the simulator's.
    args = ["simulate", "--validate", str(tmp_path / "run.json")]
    done = CliRunner().invoke(app, [*args, "--profile", profile_file(tmp_path, 20)])
    assert done.exit_code == 1  # MISS at the profile's 20 ms
    assert "batches: the run's worker 80 (mean 4.5 inputs, 32.0 ms), simulated " in done.output
    # Without the table the one factor at the mean batch is what a run file can give.
    one = replace(again, engine_steps=None, engine_batches=EngineBatches(80, 4.5, 32.0))
    scaled_one = own_engine_service(one, sloped, "p")
    assert scaled_one.batch is not None
    assert scaled_one.batch.batch_s(1, 0) < 0.032 < scaled_one.batch.batch_s(8, 0)
