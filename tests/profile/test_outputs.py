"""From measured points to the four files, and the profile schema they are read back with."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import matplotlib
import pytest
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tidegate.config import load_config
from tidegate.core.capacity import Slo
from tidegate.engines.profile import (
    Curve,
    EngineProfile,
    KneeRecord,
    MeasuredPoint,
    load_profile,
    parse_profile,
    profile_data,
)
from tidegate.errors import ConfigError
from tidegate.profile.options import ProfileOptions
from tidegate.profile.outputs import recommended_yaml, write_outputs
from tidegate.profile.plots import report_figure
from tidegate.profile.recommend import QUEUE_DRAIN_S, recommend
from tidegate.profile.record import RunRecord


def point(
    sweep: str, batch: int | None, window: float | None, conc: int, **kw: Any
) -> MeasuredPoint:
    base: dict[str, Any] = {
        "sweep": sweep,
        "concurrency": conc,
        "batch_size": batch,
        "batch_window_ms": window,
        "throughput_rps": 100.0,
        "latency_p95_ms": 50.0,
        "latency_p50_ms": 40.0,
        "num_requests": 300,
        "peak_memory_mb": 500.0,
        "worker_cpu_cores": 1.0,
        "mean_input_tokens": 64.0,
    }
    return MeasuredPoint(**(base | kw))


# An embeddings run: batch sweep (2B in flight), window sweep at B*=8, concurrency sweep.
EMBEDDINGS_POINTS = [
    point(
        "batch",
        1,
        5.0,
        2,
        throughput_rps=60,
        latency_p95_ms=40,
        batch_latency_ms=15,
        mean_batch_size=1.0,
        peak_memory_mb=400,
    ),
    point(
        "batch",
        2,
        5.0,
        4,
        throughput_rps=100,
        latency_p95_ms=50,
        batch_latency_ms=19,
        mean_batch_size=2.0,
        peak_memory_mb=410,
    ),
    point(
        "batch",
        4,
        5.0,
        8,
        throughput_rps=160,
        latency_p95_ms=60,
        batch_latency_ms=24,
        mean_batch_size=4.0,
        peak_memory_mb=420,
    ),
    point(
        "batch",
        8,
        5.0,
        16,
        throughput_rps=220,
        latency_p95_ms=90,
        batch_latency_ms=36,
        mean_batch_size=8.0,
        peak_memory_mb=450,
    ),
    point(
        "batch",
        16,
        5.0,
        32,
        throughput_rps=225,
        latency_p95_ms=170,
        batch_latency_ms=70,
        mean_batch_size=16.0,
        peak_memory_mb=520,
    ),
    point("window", 8, 0.0, 8, throughput_rps=150, latency_p95_ms=60, mean_batch_size=4.1),
    point("window", 8, 2.0, 8, throughput_rps=200, latency_p95_ms=55, mean_batch_size=7.5),
    point("window", 8, 5.0, 8, throughput_rps=205, latency_p95_ms=58, mean_batch_size=8.0),
    point("concurrency", 8, 2.0, 4, throughput_rps=120, latency_p95_ms=40, peak_memory_mb=455),
    point("concurrency", 8, 2.0, 8, throughput_rps=200, latency_p95_ms=60, peak_memory_mb=460),
    point("concurrency", 8, 2.0, 16, throughput_rps=215, latency_p95_ms=95, peak_memory_mb=470),
    point("concurrency", 8, 2.0, 32, throughput_rps=216, latency_p95_ms=190, peak_memory_mb=480),
]
SLO = Slo(p95_ms=100.0)


def record(tmp_path: Path, **kw: Any) -> RunRecord:
    options = ProfileOptions(model="minilm", out=tmp_path, slo=SLO, command="tidegate profile")
    base: dict[str, Any] = {
        "options": options,
        "task": "embeddings",
        "engine": "transformers",
        "started_at": "2026-11-29 12:00 UTC",
        "duration_s": 100.0,
        "workload": {"source": "synthetic", "input_tokens": {"mean": 64.0}},
        "weights_mb": 87.0,
    }
    return RunRecord(**(base | kw))


def test_recommendation_follows_the_knee_of_each_sweep() -> None:
    rec = recommend(EMBEDDINGS_POINTS, SLO, "embeddings", local=True)
    settings = {s.key: s.value for s in rec.settings}
    # Batch 16 is only 2% above batch 8 (225 vs 220): the smaller batch is kept.
    assert settings["batching.max_batch_size"] == 8
    # Window 2 ms is within 5% of 5 ms (200 vs 205), and smaller.
    assert settings["batching.batch_window_ms"] == 2.0
    # 16 in flight is 7.5% above 8 in flight, 32 in flight breaks the SLO.
    assert settings["slots"] == 16
    assert settings["autoscaling.target_per_replica"] == 16
    # The rate it serves there, for sizing on arrivals/s.
    assert settings["autoscaling.target_rate_per_replica"] == 215
    assert settings["memory_mb"] == 500
    assert settings["queue.max_size"] == 215 * QUEUE_DRAIN_S
    assert settings["queue.holdback"] == {"medium": 0.9, "low": 0.7}
    assert rec.knee is not None
    assert (rec.knee.batch_size, rec.knee.batch_window_ms, rec.knee.concurrency) == (8, 2.0, 16)
    assert rec.knee.meets_slo
    # The highest peak among the points run with the chosen batch (a window point saw 500).
    assert rec.memory_mb == 500
    assert all(s.why for s in rec.settings)
    assert "The knee is batch 8, window 2 ms, 16 in flight" in rec.summary


def test_no_point_meets_the_slo_keeps_the_closest_and_says_so() -> None:
    rec = recommend(EMBEDDINGS_POINTS, Slo(p95_ms=10.0), "embeddings", local=True)
    assert rec.knee is not None
    assert not rec.knee.meets_slo
    assert "met the SLO" in rec.summary


def test_a_knee_at_batch_one_needs_no_window() -> None:
    batch_only = [p for p in EMBEDDINGS_POINTS if p.sweep == "batch"][:1]
    rec = recommend(batch_only, SLO, "embeddings", local=True)
    settings = {s.key: s for s in rec.settings}
    assert settings["batching.max_batch_size"].value == 1
    assert settings["batching.batch_window_ms"].value == 0.0
    assert "never waits" in settings["batching.batch_window_ms"].why


def test_url_profiles_recommend_no_batching_and_no_autoscaling(tmp_path: Path) -> None:
    points = [
        dataclasses.replace(p, batch_size=None, batch_window_ms=None)
        for p in EMBEDDINGS_POINTS
        if p.sweep == "concurrency"
    ]
    rec = recommend(points, SLO, "embeddings", local=False)
    keys = {s.key for s in rec.settings}
    assert keys == {"slots", "queue.max_size", "queue.holdback"}
    options = ProfileOptions(model="e5", out=tmp_path, url="http://127.0.0.1:9", slo=SLO)
    path = tmp_path / "recommended.yaml"
    path.write_text(recommended_yaml(record(tmp_path, options=options), rec))
    model = load_config(path).model("e5")  # an openai model with the server as upstream
    assert (model.engine, model.slots) == ("openai", 16)
    assert "16 in flight per server" in path.read_text()


def test_four_files_and_the_profile_loads_back(tmp_path: Path) -> None:
    run = record(tmp_path)
    rec = recommend(EMBEDDINGS_POINTS, SLO, "embeddings", local=True)
    written = write_outputs(tmp_path, run, EMBEDDINGS_POINTS, rec)
    assert [p.name for p in written] == [
        "profile.json",
        "recommended.yaml",
        "report.md",
        "report.png",
    ]
    profile = load_profile(tmp_path / "profile.json")
    assert profile.points == tuple(EMBEDDINGS_POINTS)
    assert profile.knee == rec.knee
    assert profile.slo == SLO
    assert (profile.engine, profile.memory_mb, profile.weights_mb) == ("transformers", 500, 87)
    assert profile.batch_latency_ms == Curve((1.0, 2.0, 4.0, 8.0, 16.0), (15, 19, 24, 36, 70))
    raw = json.loads((tmp_path / "profile.json").read_text())
    assert raw["version"] == 1
    assert raw["measured"]["complete"] is True
    assert raw["recommended"]["batching.max_batch_size"] == 8
    assert (tmp_path / "report.png").stat().st_size < 200_000


def test_report_has_the_table_and_the_choice(tmp_path: Path) -> None:
    run = record(tmp_path, stopped="interrupted (Ctrl-C)")
    rec = recommend(EMBEDDINGS_POINTS, SLO, "embeddings", local=True)
    write_outputs(tmp_path, run, EMBEDDINGS_POINTS, rec)
    report = (tmp_path / "report.md").read_text()
    assert "| batch | batch latency ms | throughput req/s | p95 ms | memory MB |" in report
    assert "| 8 | 36.0 | 220.0 | 90.0 | 450 | 1.00 |" in report
    assert "INCOMPLETE (interrupted (Ctrl-C))" in report
    assert rec.summary in report


def test_recommended_yaml_is_a_model_entry_with_a_reason_per_setting(tmp_path: Path) -> None:
    run = record(tmp_path)
    rec = recommend(EMBEDDINGS_POINTS, SLO, "embeddings", local=True)
    text = recommended_yaml(run, rec)
    lines = text.splitlines()
    for setting in rec.settings:
        key = setting.key.rpartition(".")[2]
        index = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{key}:"))
        assert lines[index - 1].strip() == f"# {setting.why}"
    (entry,) = yaml.safe_load(text)["models"]
    assert entry["batching"] == {"max_batch_size": 8, "batch_window_ms": 2.0}
    assert entry["autoscaling"] == {
        "target_per_replica": 16,
        "target_rate_per_replica": 215.0,
        "max_replicas": 1,
    }
    # As written, it is a configuration `tidegate serve` takes.
    path = tmp_path / "recommended.yaml"
    path.write_text(text)
    model = load_config(path).model("minilm")
    assert (model.slots, model.batching.max_batch_size, model.queue.max_size) == (16, 8, 2150)
    assert model.memory_mb == 500
    assert model.autoscaling is not None
    assert model.autoscaling.target_per_replica == 16
    assert model.autoscaling.target_rate_per_replica == 215.0


GENERATE_POINTS = [
    point(
        "concurrency",
        16,
        None,
        c,
        tokens_per_s=t,
        ttft_p95_ms=f,
        ttft_mean_ms=f * 0.8,
        itl_p95_ms=i,
        itl_mean_ms=i * 0.8,
    )
    for c, t, f, i in [
        (1, 300, 20, 8),
        (2, 550, 25, 9),
        (4, 900, 30, 11),
        (16, 2000, 90, 25),
        (32, 2050, 400, 26),
    ]
]


def test_generation_curves_leave_out_queued_concurrency(tmp_path: Path) -> None:
    options = ProfileOptions(
        model="tiny-llama", out=tmp_path, max_batch=16, slo=Slo(ttft_p95_ms=100, itl_p95_ms=30)
    )
    run = record(tmp_path, options=options, task="generate")
    rec = recommend(GENERATE_POINTS, options.slo, "generate", local=True)
    settings = {s.key: s.value for s in rec.settings}
    assert settings["batching.max_num_seqs"] == 16
    # A chat's cost is its lengths: no rate target is recommended for generation.
    assert "autoscaling.target_rate_per_replica" not in settings
    write_outputs(tmp_path, run, GENERATE_POINTS, rec)
    profile = load_profile(tmp_path / "profile.json")
    assert profile.ttft_ms is not None
    assert profile.itl_ms is not None
    assert profile.ttft_ms.xs == (1.0, 2.0, 4.0, 16.0)  # 32 > max_num_seqs: it queued
    assert profile.ttft_ms(16) == pytest.approx(72.0)
    assert "| 16 | 100.0 | 2,000 |" in (tmp_path / "report.md").read_text()


def test_an_interrupted_run_with_nothing_measured_still_writes_its_files(tmp_path: Path) -> None:
    run = record(tmp_path, stopped="interrupted (Ctrl-C)")
    rec = recommend([], SLO, "embeddings", local=True)
    written = write_outputs(tmp_path, run, [], rec)
    assert {p.name for p in written} == {"profile.json", "recommended.yaml", "report.md"}
    with pytest.raises(ConfigError, match=r"embeddings\.points"):
        load_profile(tmp_path / "profile.json")


# ----------------------------------------------------------------------------- the schema
def test_profile_data_round_trips() -> None:
    profile = EngineProfile(
        model="m",
        task="embeddings",
        memory_mb=512.5,
        weights_mb=87,
        batch_latency_ms=Curve((1.0, 8.0), (10.0, 40.5)),
        engine="transformers",
        points=tuple(EMBEDDINGS_POINTS[:2]),
        knee=KneeRecord(
            concurrency=8,
            throughput_rps=200,
            latency_p95_ms=60,
            meets_slo=True,
            reason="r",
            batch_size=8,
            batch_window_ms=2.0,
        ),
        slo=SLO,
        workload={"source": "synthetic"},
    )
    data = json.loads(json.dumps(profile_data(profile)))
    assert parse_profile(data, "x") == profile


def test_version_1_files_of_before_the_planner_still_load() -> None:
    old = {
        "version": 1,
        "model": "minilm",
        "task": "embeddings",
        "device": "cpu",
        "memory_mb": 350,
        "weights_mb": 87,
        "embeddings": {"points": [{"batch_size": 1, "latency_ms": 6.0}]},
    }
    profile = parse_profile(old, "old.json")
    assert (profile.points, profile.knee, profile.slo, profile.engine) == ((), None, None, "")


def test_unknown_keys_of_a_newer_planner_are_ignored() -> None:
    data = json.loads(
        json.dumps(
            profile_data(
                EngineProfile(
                    model="m",
                    task="embeddings",
                    batch_latency_ms=Curve((1.0,), (5.0,)),
                    points=(EMBEDDINGS_POINTS[0],),
                )
            )
        )
    )
    data["points"][0]["energy_joules"] = 3.5
    assert parse_profile(data, "x").points == (EMBEDDINGS_POINTS[0],)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"points": [{"sweep": "batch"}]}, "points[0]"),
        (
            {"points": [{**dataclasses.asdict(EMBEDDINGS_POINTS[0]), "throughput_rps": "fast"}]},
            "points[0]",
        ),
        ({"points": {"not": "a list"}}, "points"),
        (
            {
                "knee": {
                    "concurrency": True,
                    "throughput_rps": 1,
                    "latency_p95_ms": 1,
                    "meets_slo": True,
                    "reason": "",
                }
            },
            "knee",
        ),
        ({"slo": ["p95_ms", 100]}, "slo"),
    ],
    ids=[
        "missing_fields",
        "text_for_a_number",
        "points_not_a_list",
        "bool_for_an_int",
        "slo_not_an_object",
    ],
)
def test_bad_planner_records_name_their_key(change: dict[str, Any], key: str) -> None:
    data = {
        "version": 1,
        "task": "embeddings",
        "embeddings": {"points": [{"batch_size": 1, "latency_ms": 6.0}]},
    } | change
    with pytest.raises(ConfigError) as raised:
        parse_profile(data, "p.json")
    assert raised.value.key == key


# ----------------------------------------------------------------------------- one knee
def knee_marks(fig: Any) -> dict[str, list[tuple[float, float]]]:
    """Per panel title: where the figure draws a marker labelled "knee"."""
    return {
        ax.get_title(): [
            (float(line.get_xdata()[0]), float(line.get_ydata()[0]))
            for line in ax.get_lines()
            if line.get_label() == "knee"
        ]
        for ax in fig.axes
    }


def panel_notes(fig: Any) -> dict[str, str]:
    """Per panel title: its text, on one line."""
    return {
        ax.get_title(): " ".join(" ".join(t.get_text().split()) for t in ax.texts)
        for ax in fig.axes
    }


def knee_rows(report: str) -> list[str]:
    return [line for line in report.splitlines() if line.endswith("| **knee** |")]


def test_a_complete_run_stars_the_knee_its_text_names_and_scopes_its_reason(
    tmp_path: Path,
) -> None:
    rec = recommend(EMBEDDINGS_POINTS, SLO, "embeddings", local=True)
    assert "The knee is batch 8, window 2 ms, 16 in flight, which gave 215 req/s" in rec.summary
    # The batch table shows 220 req/s within the SLO: "highest" holds for its own sweep only.
    assert "the highest throughput that meets the SLO, in the concurrency sweep" in rec.summary
    fig = report_figure(record(tmp_path), EMBEDDINGS_POINTS, rec)
    try:
        marks, notes = knee_marks(fig), panel_notes(fig)
    finally:
        plt.close(fig)
    # Drawn over the batch sweep, which does not hold the knee: no star there (its own
    # choice is a ring), and the star where the knee is, the concurrency sweep.
    assert marks["throughput"] == marks["latency"] == marks["peak memory"] == []
    assert marks["concurrency sweep (labels: in flight)"] == [(215.0, 95.0)]
    assert all("not measured" not in note for note in notes.values())
    write_outputs(tmp_path, record(tmp_path), EMBEDDINGS_POINTS, rec)
    report = (tmp_path / "report.md").read_text()
    assert knee_rows(report) == ["| 16 | 215.0 | 40.0 | 95.0 | 0.0 | - | 470 | 1.00 | **knee** |"]
    assert "| 8 | 36.0 | 220.0 | 90.0 | 450 | 1.00 | 8.0 | 16 | sets max_batch_size |" in report
    assert "| 2 | 7.5 | 200.0 | 40.0 | 55.0 | 1.00 | sets batch_window_ms |" in report


def test_a_run_cut_short_keeps_the_best_knee_and_text_table_and_plot_agree(
    tmp_path: Path,
) -> None:
    # Stopped (Ctrl-C) two points into the concurrency sweep, which had reached 200 req/s:
    # the batch sweep's knee, 220 req/s within the SLO, is the best measured.
    points = [p for p in EMBEDDINGS_POINTS if p.sweep != "concurrency" or p.concurrency <= 8]
    run = record(tmp_path, stopped="interrupted (Ctrl-C)")
    rec = recommend(points, SLO, "embeddings", local=True, stopped=run.stopped)
    assert rec.knee is not None
    assert (rec.knee.batch_size, rec.knee.concurrency, rec.knee.throughput_rps) == (8, 16, 220)
    meeting = [p.throughput_rps for p in points if p.latency_p95_ms <= 100.0]
    assert rec.knee.throughput_rps == max(meeting)  # "the highest", and the tables agree
    assert (
        "which gave 220 req/s, p95 90 ms: the highest throughput that meets the SLO, in the "
        "batch sweep" in rec.summary
    )
    assert (
        "stopped early (interrupted (Ctrl-C)) in the concurrency sweep, which reached 200 "
        "req/s at most" in rec.summary
    )
    settings = {s.key: s.value for s in rec.settings}
    assert (settings["slots"], settings["batching.max_batch_size"]) == (16, 8)
    fig = report_figure(run, points, rec)
    try:
        marks = knee_marks(fig)
    finally:
        plt.close(fig)
    assert marks["throughput"] == [(8.0, 220.0)]  # the star on the point the text names
    assert marks["latency"] == [(8.0, 90.0)]
    assert marks["concurrency sweep (labels: in flight)"] == []
    write_outputs(tmp_path, run, points, rec)
    report = (tmp_path / "report.md").read_text()
    assert knee_rows(report) == ["| 8 | 36.0 | 220.0 | 90.0 | 450 | 1.00 | 8.0 | 16 | **knee** |"]
    assert rec.summary in report


def test_a_panel_with_nothing_measured_says_so_and_why(tmp_path: Path) -> None:
    batch_only = [p for p in EMBEDDINGS_POINTS if p.sweep == "batch"]
    run = record(tmp_path, stopped="--max-duration-s reached")
    rec = recommend(batch_only, SLO, "embeddings", local=True, stopped=run.stopped)
    fig = report_figure(run, batch_only, rec)
    try:
        notes = panel_notes(fig)
    finally:
        plt.close(fig)
    assert notes["concurrency sweep (labels: in flight)"] == (
        "not measured: the run stopped before the concurrency sweep (--max-duration-s reached)"
    )
    assert notes["peak memory"] == ""
    url_points = [
        dataclasses.replace(p, batch_size=None, batch_window_ms=None, peak_memory_mb=None)
        for p in EMBEDDINGS_POINTS
        if p.sweep == "concurrency"
    ]
    options = ProfileOptions(model="e5", out=tmp_path, url="http://127.0.0.1:9", slo=SLO)
    rec = recommend(url_points, SLO, "embeddings", local=False)
    fig = report_figure(record(tmp_path, options=options), url_points, rec)
    try:
        notes = panel_notes(fig)
    finally:
        plt.close(fig)
    assert (
        notes["peak memory"] == "not measured: the server at --url is not a process here to watch"
    )
