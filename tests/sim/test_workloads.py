"""Workload readers on slices of the real trace files, synthetic generators, priorities."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest

from tidegate.errors import ConfigError
from tidegate.sim.specs import parse_slo, parse_workload
from tidegate.sim.synthetic import Flash, Gaps, diurnal
from tidegate.sim.traces import open_trace, read_azure, read_mooncake, read_own
from tidegate.sim.workload import Arrival, Listed, Prioritized, Scale, parse_mix, parse_rules

from .conftest import FIXTURES

AZURE = FIXTURES / "azure_conv_head.csv"
MOONCAKE = FIXTURES / "mooncake_conv_head.jsonl"
SERVEGEN = FIXTURES / "servegen"
AGGREGATE = FIXTURES / "aggregate_rate_head.csv"


def test_azure_rows_become_arrivals_relative_to_the_first() -> None:
    arrivals = list(read_azure(AZURE))
    assert len(arrivals) == 300
    # First rows: 18:15:46.6805900 (374, 44) then 18:15:50.9951690 (396, 109).
    assert arrivals[0] == Arrival(0.0, 374, 44)
    assert arrivals[1].arrival_s == pytest.approx(4.314579)
    assert (arrivals[1].prompt_tokens, arrivals[1].output_tokens) == (396, 109)
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(arrivals))


def test_mooncake_buckets_are_spread_up_to_the_next_timestamp() -> None:
    arrivals = list(read_mooncake(MOONCAKE, seed=1))
    assert len(arrivals) == 80
    # The slice's first bucket: 10 requests at 0 ms, the next distinct timestamp is 3000 ms.
    first = arrivals[:10]
    assert all(0.0 <= a.arrival_s < 3.0 for a in first)
    assert len({a.arrival_s for a in first}) == 10  # spread, not a batch arrival
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(arrivals))
    records = [json.loads(line) for line in MOONCAKE.read_text().splitlines()[:10]]
    assert [(a.prompt_tokens, a.output_tokens) for a in first] == [
        (r["input_length"], r["output_length"]) for r in records
    ]
    assert list(read_mooncake(MOONCAKE, seed=1)) == arrivals
    assert list(read_mooncake(MOONCAKE, seed=2)) != arrivals


def test_our_csv_keeps_priority_and_tenant(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(
        "arrival_s,prompt_tokens,output_tokens,priority,tenant\n"
        "0.5,100,20,high,acme\n"
        "1.0,50,0,,batch\n"
    )
    assert list(read_own(path)) == [
        Arrival(0.5, 100, 20, "high", "acme"),
        Arrival(1.0, 50, 0, None, "batch"),
    ]


def test_our_csv_refuses_going_back_in_time(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n2,1,1\n1,1,1\n")
    with pytest.raises(ConfigError, match="backwards"):
        list(read_own(path))


def test_servegen_tenants_follow_their_window_rates() -> None:
    workload = open_trace(str(SERVEGEN), seed=3)
    arrivals = list(workload)
    tenants = {a.tenant for a in arrivals}
    assert tenants == {"chunk-0", "chunk-3"}
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(arrivals))
    # chunk-0's first window: 1.3317 requests/s for 600 s (Weibull gaps, CV 8.6): about
    # 800 expected; a CV that high makes the count vary a lot, so the bound is loose.
    first_window = [a for a in arrivals if a.tenant == "chunk-0" and a.arrival_s < 600]
    assert 200 < len(first_window) < 2500
    # Its second window has rate 0: nothing in 600..1200.
    assert not [a for a in arrivals if a.tenant == "chunk-0" and 600 <= a.arrival_s < 1200]
    assert list(open_trace(str(SERVEGEN), seed=3)) == arrivals


def test_servegen_aggregate_needs_a_model_and_replays_its_rate() -> None:
    with pytest.raises(ConfigError, match="which model"):
        open_trace(str(AGGREGATE))
    workload = open_trace(f"{AGGREGATE}#reason/deepseek-r1", Scale(speedup=10.0), seed=1)
    arrivals = list(workload)
    # Three 600 s windows at about 16 requests/s, replayed 10x faster: 180 s, same rate.
    assert arrivals[-1].arrival_s < 180.0
    assert 0.8 < len(arrivals) / (180.0 * 16.5) < 1.2


def test_rate_scale_and_speedup_on_a_request_trace() -> None:
    base = list(open_trace(str(AZURE)))
    faster = list(open_trace(str(AZURE), Scale(rate_scale=2.0)))
    assert len(faster) == len(base)
    assert faster[-1].arrival_s == pytest.approx(base[-1].arrival_s / 2)
    # Speedup 3: the trace's time axis 3x shorter, one request in 3 kept: the same rate.
    shorter = list(open_trace(str(AZURE), Scale(speedup=3.0), seed=5))
    assert shorter[-1].arrival_s <= base[-1].arrival_s / 3
    assert 60 < len(shorter) < 140


def test_poisson_and_gamma_have_their_rate_and_burstiness() -> None:
    poisson = list(parse_workload("poisson:rate=20,duration_s=500,output=0", Scale(), 1))
    gamma = list(parse_workload("gamma:rate=20,cv=3,duration_s=500", Scale(), 1))
    for arrivals in (poisson, gamma):
        assert 0.85 < len(arrivals) / 10_000 < 1.15
    assert all(a.output_tokens == 0 for a in poisson)
    assert 0.9 < _cv(poisson) < 1.1
    assert 2.4 < _cv(gamma) < 3.6
    doubled = list(parse_workload("poisson:rate=20,duration_s=500", Scale(rate_scale=2.0), 1))
    assert 0.9 < len(doubled) / (2 * len(poisson)) < 1.1


def _cv(arrivals: list[Arrival]) -> float:
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(arrivals)]
    mean = sum(gaps) / len(gaps)
    return math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean


def test_a_diurnal_day_has_its_peak_to_trough_and_flash_crowds() -> None:
    segments = diurnal(10.0, 4.0, peak_hour=14.0, flashes=[Flash(3 * 3600 + 30, 5.0, 600.0)])
    rates = {(s.start_s, s.end_s): s.arrivals_per_s for s in segments}
    flash_s = (3 * 3600 + 30, 3 * 3600 + 630)
    plain = [s.arrivals_per_s for s in segments if not flash_s[0] <= s.start_s < flash_s[1]]
    assert max(plain) / min(plain) == pytest.approx(4.0, rel=0.01)
    calm = diurnal(10.0, 4.0, peak_hour=14.0)
    mean = sum(s.arrivals_per_s * (s.end_s - s.start_s) for s in calm) / 86_400
    assert mean == pytest.approx(10.0, rel=0.001)
    peak = max(segments, key=lambda s: s.arrivals_per_s if s.start_s > 5 * 3600 else 0)
    assert 13.5 <= peak.start_s / 3600 <= 14.5
    # The flash crowd starts exactly at its time (segments are cut there), 5x the rate.
    cut = next(s for s in segments if s.start_s == 3 * 3600 + 30)
    before = rates[(3 * 3600, 3 * 3600 + 30)]
    assert cut.arrivals_per_s == pytest.approx(5 * before, rel=0.01)


def test_weibull_and_gamma_gaps_have_mean_one() -> None:
    rng = random.Random(4)
    for gaps in (Gaps("weibull", 0.5), Gaps("gamma", 0.25), Gaps()):
        draws = [gaps.draw(rng) for _ in range(40_000)]
        assert sum(draws) / len(draws) == pytest.approx(1.0, rel=0.1)


def test_priority_mix_is_seeded_and_close_to_its_shares() -> None:
    arrivals = [Arrival(i * 0.01, 10, 0) for i in range(10_000)]
    mix = parse_mix("high=2,medium=3,low=5")
    workload = Prioritized(Listed("x", arrivals), "medium", mix, seed=9)
    names = [a.priority for a in workload]
    assert names == [a.priority for a in workload]  # every iteration draws the same
    for name, share in (("high", 0.2), ("medium", 0.3), ("low", 0.5)):
        assert names.count(name) / len(names) == pytest.approx(share, abs=0.02)


def test_priority_rules_come_first_and_the_file_wins_over_both() -> None:
    arrivals = [
        Arrival(0, 100, 0, None, "acme"),
        Arrival(1, 9000, 0, None, "other"),
        Arrival(2, 100, 0, None, "other"),
        Arrival(3, 100, 0, "medium", "acme"),
    ]
    rules = parse_rules("tenant:acme=high,prompt>=4096=low")
    got = [a.priority for a in Prioritized(Listed("x", arrivals), "medium", (), rules)]
    assert got == ["high", "low", "medium", "medium"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tenant=high", "condition is one of"),
        ("prompt<abc=high", "condition is one of"),
        ("high", "CONDITION=LEVEL"),
    ],
)
def test_bad_priority_rules_say_how_to_write_them(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_rules(text)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("zipf:rate=1", "not one of"),
        ("poisson:duration_s=10", "rate=... is required"),
        ("poisson:rate=1,burst=2", "unknown key"),
        ("gamma:rate=x", "not a number"),
        ("diurnal:mean_rate=1,flash=5", "START_S/MULTIPLIER/DURATION_S"),
    ],
)
def test_bad_workload_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_workload(spec, Scale(), 0)


def test_lengths_can_come_from_a_trace() -> None:
    workload = parse_workload(f"poisson:rate=5,duration_s=20,lengths={AZURE}", Scale(), 0)
    pairs = {(a.prompt_tokens, a.output_tokens) for a in read_azure(AZURE)}
    assert {(a.prompt_tokens, a.output_tokens) for a in workload} <= pairs


def test_slo_spec() -> None:
    assert parse_slo("high=0.5,low=20s") == {"high": 0.5, "low": 20.0}
    with pytest.raises(ValueError, match="give seconds"):
        parse_slo("high=fast")


def test_an_unknown_file_format_is_named(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("a;b\n")
    with pytest.raises(ConfigError, match="not a trace format"):
        open_trace(str(path))
