"""The open-loop point of ``--through-gateway``: its factor, and the curve it calibrates."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.profile.test_outputs import EMBEDDINGS_POINTS, GENERATE_POINTS, SLO, point, record
from tidegate.core.capacity import Slo
from tidegate.engines.profile import Curve, EngineProfile, load_profile
from tidegate.engines.steps import StepTotals
from tidegate.errors import ConfigError
from tidegate.profile.loadgen import Completion
from tidegate.profile.openloop import (
    OpenLoopPoint,
    calibrated_curve,
    chosen,
    closed_loop_curve,
    closed_loop_itl,
    curve_capacity,
    decode_steps,
    decoding_gaps,
    embeddings_capacity,
    generation_capacity,
    generation_curves,
    measured_join,
    spans_s,
    sustained_rps,
)
from tidegate.profile.options import ProfileOptions
from tidegate.profile.outputs import write_outputs
from tidegate.profile.recommend import QUEUE_DRAIN_S, recommend
from tidegate.sim.service import from_profile

CURVE = Curve((1.0, 2.0, 4.0, 8.0, 16.0), (15.0, 19.0, 24.0, 36.0, 70.0))


def open_point(**kw: object) -> OpenLoopPoint:
    base: dict[str, object] = {
        "fraction": 0.85,
        "offered_rps": 100.0,
        "completed_rps": 99.0,
        "num_refused": 0,
        "latency_p50_ms": 50.0,
        "latency_p95_ms": 90.0,
        "mean_batch_size": 4.0,
        "batch_latency_ms": 30.0,
        "curve_ms": 24.0,
        "duration_s": 10.0,
    }
    return OpenLoopPoint(**(base | kw))  # type: ignore[arg-type]


def test_the_factor_is_the_open_loop_engine_time_over_the_curve_at_its_batch() -> None:
    assert open_point().factor == pytest.approx(1.25)
    assert open_point(batch_latency_ms=None).factor is None
    assert open_point(curve_ms=None).factor is None


@pytest.mark.parametrize(
    ("completed", "refused", "kept_up"),
    [(99.0, 0, True), (95.0, 0, True), (94.0, 0, False), (100.0, 3, False)],
)
def test_kept_up_means_it_answered_what_was_offered(
    completed: float, refused: int, kept_up: bool
) -> None:
    assert open_point(completed_rps=completed, num_refused=refused).kept_up is kept_up


def test_the_calibrated_curve_rises_from_one_at_batch_one_to_the_factor() -> None:
    scaled = calibrated_curve(CURVE, mean_batch=4.0, factor=1.3)
    assert scaled.xs == CURVE.xs
    assert scaled.ys[0] == 15.0  # batch 1: the closed loop's own regime
    assert scaled.ys[1] == pytest.approx(19.0 * 1.1)  # a third of the way to batch 4
    assert scaled.ys[2:] == pytest.approx((24.0 * 1.3, 36.0 * 1.3, 70.0 * 1.3))


@given(
    mean_batch=st.floats(0.5, 40.0),
    factor=st.floats(0.5, 3.0),
)
def test_the_calibration_scales_every_point_between_one_and_the_factor(
    mean_batch: float, factor: float
) -> None:
    scaled = calibrated_curve(CURVE, mean_batch, factor)
    low, high = sorted((1.0, factor))
    for x, before, after in zip(CURVE.xs, CURVE.ys, scaled.ys, strict=True):
        assert low * before - 1e-3 <= after <= high * before + 1e-3
        if x >= mean_batch:
            assert after == pytest.approx(before * factor, abs=1e-3)


def test_the_closed_loop_curve_and_its_capacity() -> None:
    curve = closed_loop_curve(EMBEDDINGS_POINTS)
    assert curve == CURVE  # the points with a mean batch and an engine time
    assert curve_capacity(CURVE, 16) == pytest.approx(16 / 0.070)
    assert curve_capacity(CURVE, 8) == pytest.approx(8 / 0.036)
    assert closed_loop_curve([]) is None


def test_the_spans_hold_a_few_request_lifetimes_and_enough_arrivals() -> None:
    fast = [dataclasses.replace(p, latency_p50_ms=40.0) for p in EMBEDDINGS_POINTS]
    assert spans_s(200.0, 5.0, fast) == (3.0, 10.0)  # the floors
    assert spans_s(200.0, 12.0, fast) == (3.0, 12.0)  # --min-seconds-per-point
    chats = [dataclasses.replace(p, latency_p50_ms=3200.0) for p in EMBEDDINGS_POINTS]
    assert spans_s(2.0, 5.0, chats) == (6.4, 20.0)  # two lifetimes; 40 arrivals at 2/s
    assert spans_s(2.0, 5.0, []) == (3.0, 20.0)


def test_the_last_try_with_a_factor_is_the_one_used() -> None:
    first, second = open_point(completed_rps=50.0), open_point(batch_latency_ms=26.0)
    assert chosen([first, second]) is second
    assert chosen([first, open_point(batch_latency_ms=None)]) is first
    assert chosen([]) is None


def test_the_profile_writes_the_calibrated_curve_and_every_try(tmp_path: Path) -> None:
    options = ProfileOptions(
        model="minilm", out=tmp_path, slo=SLO, through_gateway=True, command="tidegate profile"
    )
    tries = (
        open_point(completed_rps=60.0, capacity_rps=117.6),
        open_point(batch_latency_ms=36.0),
    )
    run = dataclasses.replace(record(tmp_path), options=options, open_loop=tries)
    write_outputs(
        tmp_path,
        run,
        EMBEDDINGS_POINTS,
        recommend(EMBEDDINGS_POINTS, SLO, "embeddings", local=True),
    )
    profile = load_profile(tmp_path / "profile.json")
    assert profile.batch_latency_ms == calibrated_curve(CURVE, 4.0, 1.5)
    assert profile.points == tuple(EMBEDDINGS_POINTS)  # the measured points stay as measured
    measured = json.loads((tmp_path / "profile.json").read_text())["measured"]
    assert measured["open_loop"]["factor"] == pytest.approx(1.5)
    assert measured["open_loop"]["at_mean_batch"] == 4.0
    assert [t["kept_up"] for t in measured["open_loop"]["tries"]] == [False, True]
    assert "open-loop factor 1.50" in measured["curve_source"]
    assert measured["open_loop"]["tries"][0]["capacity_rps"] == 117.6
    report = (tmp_path / "report.md").read_text()
    assert "## Open-loop point" in report
    assert "each batch takes what is queued, up to max batch" in report
    closed = closed_loop_curve(EMBEDDINGS_POINTS)
    assert closed is not None
    best = curve_capacity(closed, options.max_batch)
    assert f"The closed loop's best throughput was {best:,.2f} requests/s." in report
    assert "- Try 1 at 85% of 117.60 req/s: 100.00 offered, 60.00 answered" in report
    assert "did NOT keep up" in report
    assert "closed loop's times 1.50 from mean batch 4.0 up" in report


def test_without_an_open_loop_the_curve_is_the_closed_loop_one(tmp_path: Path) -> None:
    write_outputs(
        tmp_path,
        record(tmp_path),
        EMBEDDINGS_POINTS,
        recommend(EMBEDDINGS_POINTS, SLO, "embeddings", local=True),
    )
    assert load_profile(tmp_path / "profile.json").batch_latency_ms == CURVE
    assert json.loads((tmp_path / "profile.json").read_text())["measured"]["open_loop"] is None


def test_the_fraction_defaults_only_where_the_planner_starts_the_stack(tmp_path: Path) -> None:
    assert ProfileOptions(model="m", out=tmp_path).open_loop_fraction() == 0.0
    gateway = ProfileOptions(model="m", out=tmp_path, through_gateway=True)
    assert gateway.open_loop_fraction() == 0.85
    off = ProfileOptions(model="m", out=tmp_path, through_gateway=True, open_loop=0.0)
    assert off.open_loop_fraction() == 0.0
    running = ProfileOptions(
        model="m", out=tmp_path, through_gateway=True, url="http://127.0.0.1:1"
    )
    assert running.open_loop_fraction() == 0.0  # a shared gateway: not the planner's to load
    with pytest.raises(ConfigError, match="--through-gateway"):
        ProfileOptions(model="m", out=tmp_path, open_loop=0.85)
    with pytest.raises(ConfigError, match="fraction"):
        ProfileOptions(model="m", out=tmp_path, through_gateway=True, open_loop=-1.0)


# ----------------------------------------------------------------------------- generation
def stream(sent_at: float, ttft_s: float, gaps_s: list[float], ok: bool = True) -> Completion:
    """A streamed answer sent at ``sent_at``: its tokens at the first one plus the gaps."""
    latency = ttft_s + sum(gaps_s)
    return Completion(sent_at + latency, latency, ok, 46, len(gaps_s) + 1, ttft_s, gaps_s)


ITL = Curve((1.0, 2.0), (10.0, 20.0))


def test_each_gap_is_set_against_the_curve_at_the_sequences_decoding_then() -> None:
    a = stream(0.0, 1.0, [1.0, 1.0, 1.0])  # tokens at 1, 2, 3, 4
    b = stream(1.5, 0.5, [1.0])  # tokens at 2, 3: it joined in the step of a's token 2
    failed = stream(0.0, 0.5, [5.0], ok=False)  # an error answer decodes nothing
    # a's 1-2 prefilled b: left out. a's 2-3 and b's 2-3 with both decoding, a's 3-4 alone
    # (b's last token at 3 is before the middle 3.5).
    running, measured_ms, curve_ms = decoding_gaps([a, b, failed], ITL, 0.0, 10.0) or (0, 0, 0)
    assert running == pytest.approx(5 / 3)
    assert measured_ms == pytest.approx(1000.0)
    assert curve_ms == pytest.approx((20.0 + 20.0 + 10.0) / 3)
    # only the gaps whose middle is in the span count; the others' streams still do
    assert decoding_gaps([a, b], ITL, 3.0, 10.0) == pytest.approx((1.0, 1000.0, 10.0))
    assert decoding_gaps([a, b], ITL, 5.0, 6.0) is None
    assert decoding_gaps([], ITL, 0.0, 1.0) is None


@given(
    sends=st.lists(
        st.tuples(
            st.floats(0.0, 10.0),
            st.floats(0.01, 2.0),
            st.lists(st.floats(0.01, 1.0), min_size=1, max_size=6),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_the_count_of_sequences_decoding_is_between_one_and_all_of_them(
    sends: list[tuple[float, float, list[float]]],
) -> None:
    completions = [stream(at, ttft, gaps) for at, ttft, gaps in sends]
    result = decoding_gaps(completions, ITL, 0.0, 100.0)
    if len(sends) == 1:
        assert result is not None  # nobody joins a lone stream: every gap counts
    if result is None:
        return  # every gap was a join's step
    running, measured_ms, curve_ms = result
    assert 1.0 <= running <= len(sends) + 1e-9
    assert ITL(1) - 1e-9 <= curve_ms <= ITL(len(sends)) + 1e-9  # the curve at 1 to all
    gaps = [g for _, _, gs in sends for g in gs]
    assert 1e3 * min(gaps) - 1e-6 <= measured_ms <= 1e3 * max(gaps) + 1e-6


def test_the_closed_loop_itl_curve_and_capacity_have_every_sequence_running() -> None:
    result = closed_loop_itl(GENERATE_POINTS, 16)
    assert result is not None
    curve, capacity = result
    assert curve.xs == (1.0, 2.0, 4.0, 16.0)  # 32 in flight: 16 ran, the rest queued
    assert curve.ys == pytest.approx((6.4, 7.2, 8.8, 20.0))  # the mean gaps
    assert capacity == 100.0  # the best throughput measured among them
    assert closed_loop_itl([], 16) is None


def test_the_open_loop_factor_reads_the_engines_decode_steps_where_it_reports_them() -> None:
    window = {
        ("decode", 1): StepTotals(10, 0.11, 0),  # 11 ms each, the curve says 10
        ("decode", 2): StepTotals(30, 0.66, 0),  # 22 ms each, the curve says 20
        ("join", 2): StepTotals(5, 0.5, 5),  # steps with a prefill are left out
        ("start", 1): StepTotals(3, 0.3, 3),
    }
    running, measured_ms, curve_ms = decode_steps(window, ITL) or (0, 0, 0)
    assert running == pytest.approx((10 * 1 + 30 * 2) / 40)
    assert measured_ms == pytest.approx(1e3 * 0.77 / 40)
    assert curve_ms == pytest.approx((10 * 10.0 + 30 * 20.0) / 40)
    assert measured_ms / curve_ms == pytest.approx(1.1)  # the factor
    assert decode_steps(window, ITL, least=41) is None  # too few to tell
    assert decode_steps({}, ITL) is None  # another server: the client's gaps instead


def test_generation_curves_are_the_engines_own_steps_where_every_point_has_them() -> None:
    client_only = generation_curves(GENERATE_POINTS[:4])
    assert client_only[1].ys == pytest.approx((6.4, 7.2, 8.8, 20.0))  # the client's mean gaps
    assert client_only[2] == "mean TTFT and inter-token latency per concurrency"
    steps = [
        dataclasses.replace(p, decode_step_ms=5.0 + p.concurrency, start_step_ms=start)
        for p, start in zip(GENERATE_POINTS[:4], (40.0, None, None, None), strict=True)
    ]
    ttft, itl, source = generation_curves(steps)
    assert itl.ys == (6.0, 7.0, 9.0, 21.0)  # the decode steps, not the gaps
    # the start step where the point ran enough of them, the client's mean elsewhere
    assert ttft.ys == (40.0, *(p.ttft_mean_ms for p in GENERATE_POINTS[1:4]))
    assert "its step table" in source
    assert "idle engine at 1," in source
    # one point without the table (an older worker mid-run): the client's, all of them
    mixed = [*steps[:3], dataclasses.replace(steps[3], decode_step_ms=None)]
    assert generation_curves(mixed) == client_only


def write_generation_profile(tmp_path: Path, *tries: OpenLoopPoint) -> EngineProfile:
    """A through-gateway generation run with ``tries`` as its open loop, written and read."""
    options = ProfileOptions(
        model="tiny-llama",
        out=tmp_path,
        max_batch=16,
        slo=Slo(ttft_p95_ms=100, itl_p95_ms=30),
        through_gateway=True,
    )
    run = dataclasses.replace(record(tmp_path), options=options, task="generate", open_loop=tries)
    rec = recommend(GENERATE_POINTS, options.slo, "generate", local=True)
    write_outputs(tmp_path, run, GENERATE_POINTS, rec)
    return load_profile(tmp_path / "profile.json")


def test_a_generation_profile_scales_both_curves_by_the_token_factor(tmp_path: Path) -> None:
    tokens = open_point(
        mean_batch_size=None,
        batch_latency_ms=None,
        curve_ms=8.0,
        mean_running=4.0,
        itl_mean_ms=10.0,
    )
    assert tokens.factor == pytest.approx(1.25)
    assert tokens.at_batch == 4.0
    profile = write_generation_profile(tmp_path, tokens)
    ttft = Curve((1.0, 2.0, 4.0, 16.0), (16.0, 20.0, 24.0, 72.0))  # the closed loop's means
    itl = Curve((1.0, 2.0, 4.0, 16.0), (6.4, 7.2, 8.8, 20.0))
    assert profile.ttft_ms == calibrated_curve(ttft, 4.0, 1.25)
    assert profile.itl_ms == calibrated_curve(itl, 4.0, 1.25)
    assert profile.ttft_ms(1) == 16.0  # a lone sequence: the closed loop's own regime
    measured = json.loads((tmp_path / "profile.json").read_text())["measured"]
    assert measured["open_loop"]["at_mean_batch"] == 4.0
    assert "mean sequences decoding 4.0" in measured["curve_source"]
    report = (tmp_path / "report.md").read_text()
    assert "each joining prompt pays its own prefill" in report
    assert "The closed loop's best throughput was 100.00 requests/s." in report
    assert "from mean sequences decoding 4.0 up" in report


def test_the_profile_keeps_the_join_price_of_the_last_try_with_enough_joins(
    tmp_path: Path,
) -> None:
    tokens = {"mean_batch_size": None, "batch_latency_ms": None, "curve_ms": 8.0}
    first = open_point(**tokens, mean_running=4.0, itl_mean_ms=10.0, join_ms=41.0, num_joins=60)
    few = open_point(**tokens, mean_running=5.0, itl_mean_ms=11.0, join_ms=90.0, num_joins=5)
    assert measured_join([first, few]) is first  # 5 joins are too few to price one
    assert measured_join([few]) is None
    profile = write_generation_profile(tmp_path, first, few)
    assert profile.join_ms == 41.0
    measured = json.loads((tmp_path / "profile.json").read_text())["measured"]
    assert "a prompt joining a decoding batch costs 41.0 ms" in measured["curve_source"]
    assert measured["open_loop"]["tries"][0]["num_joins"] == 60
    step = from_profile(profile, "profile.json").step
    assert step is not None
    assert profile.itl_ms is not None
    assert step.step_s(3, 1, 50) == pytest.approx(profile.itl_ms(4) / 1e3 + 0.041)
    assert write_generation_profile(tmp_path, few).join_ms is None


def test_generation_capacity_is_the_simulators_open_loop_rate_not_the_lockstep() -> None:
    # A closed loop of chats of 16 tokens: c sequences join an idle engine together (one
    # shared prefill, ttft(c)) and end together, c / (ttft(c) + 15 itl(c)) requests/s.
    steps = {1: (250.0, 100.0), 4: (400.0, 130.0), 8: (550.0, 200.0)}  # c: (ttft, itl) ms
    points = [
        point(
            "concurrency",
            8,
            None,
            c,
            throughput_rps=c / ((ttft + 15 * itl) / 1e3),
            ttft_mean_ms=ttft,
            itl_mean_ms=itl,
            mean_output_tokens=16.0,
        )
        for c, (ttft, itl) in steps.items()
    ]
    found = generation_capacity(points, 8)
    assert found is not None
    curve, capacity, best = found
    assert curve == closed_loop_itl(points, 8)[0]  # type: ignore[index]
    assert best == pytest.approx(8 / 3.55)  # the closed loop's best: 2.25 requests/s
    # Under arrivals that do not wait, the 8 running sequences end and join a few at a time
    # and each joiner pays a lone prompt's prefill (150 ms): about 0.5 joiners a step of
    # 200 + 0.5 x 150 ms, 1.82 requests/s (sim/saturation.py).
    assert capacity == pytest.approx(0.5 / 0.275, rel=0.05)
    assert generation_capacity([], 8) is None


def test_past_capacity_an_embeddings_replica_runs_batches_of_max_batch() -> None:
    # The cheapest size per input is 16 (160 requests/s); past capacity the replica takes
    # batches of 32, at 250 ms each: 128 requests/s.
    curve = Curve((1.0, 16.0, 32.0), (20.0, 100.0, 250.0))
    capacity, best = embeddings_capacity(curve, 32, 5.0)
    assert best == pytest.approx(160.0)
    assert capacity == pytest.approx(32 / 0.25, rel=0.03)
    linear = Curve((1.0, 32.0), (10.0, 100.0))  # cheapest at 32: the two agree
    capacity, best = embeddings_capacity(linear, 32, 5.0)
    assert capacity == pytest.approx(best, rel=0.03)


def test_a_replica_sustains_the_closed_loop_capacity_over_the_calibrating_factor() -> None:
    # The first try's capacity is the simulator's on the closed-loop curves; a second try
    # was aimed lower, and its factor (26 / 24) is the one that calibrates the curve.
    first = open_point(completed_rps=50.0, capacity_rps=120.0)
    second = open_point(batch_latency_ms=26.0, capacity_rps=60.0)
    assert sustained_rps([first, second]) == pytest.approx(120.0 * 24.0 / 26.0)
    assert sustained_rps([first]) == pytest.approx(120.0 / 1.25)
    assert sustained_rps([open_point()]) is None  # no capacity recorded
    assert sustained_rps([open_point(batch_latency_ms=None, capacity_rps=120.0)]) is None
    assert sustained_rps([]) is None


def test_the_queue_is_sized_at_what_a_replica_sustains_where_that_is_lower() -> None:
    # The knee's closed loop gave 215 requests/s (test_outputs); an open loop that sustained
    # 150 sizes the queue and the holdback at 150, and says so.
    rec = recommend(EMBEDDINGS_POINTS, SLO, "embeddings", local=True, sustained_rps=150.0)
    settings = {s.key: s for s in rec.settings}
    assert settings["queue.max_size"].value == 150 * QUEUE_DRAIN_S
    assert "what one replica sustains when arrivals keep coming" in settings["queue.max_size"].why
    assert "the knee's closed loop gave 215" in settings["queue.max_size"].why
    assert settings["queue.holdback"].why.endswith("at 150 req/s")
    # A replica that sustains more than the knee measured: the knee's rate, as before.
    higher = recommend(EMBEDDINGS_POINTS, SLO, "embeddings", local=True, sustained_rps=400.0)
    assert {s.key: s.value for s in higher.settings}["queue.max_size"] == 215 * QUEUE_DRAIN_S
