"""``tidegate explain``'s batching lines, from what a worker's /stats says (a real planner)."""

from __future__ import annotations

from tidegate.control.explain import format_batching
from tidegate.core.batch_adapt import BatchPlanner
from tidegate.core.batching import BatchConfig, Release, plan_batch
from tidegate.core.request import Request


def test_explain_says_why_batches_left_and_the_cap_now() -> None:
    config = BatchConfig(
        max_batch_size=8,
        batch_window_ms=5.0,
        level_windows_ms=(0.0,),
        load_aware=True,
        target_p99_ms=100.0,
    )
    planner = BatchPlanner(config)
    high = Request("a", "m", 0, 1.0)
    planner.arrived(1.0)
    plan = plan_batch(planner.view([high], 1, 1.0), config, 1.0)
    assert isinstance(plan, Release)
    planner.released(plan)
    text = format_batching("emb", [("emb-0", planner.describe(1.0)), ("emb-1", {"error": "x"})])
    assert "emb-0: cap 8 of 8, windows 0/5/5 ms by level, load-aware (rate 1.0/s)" in text
    assert "last batch left by level_window; releases: level_window 1" in text
    assert "AIMD cap: last start at high P99 None ms against 100.0 ms, bounds [1, 8]" in text
    assert "emb-1: x" in text


def test_explain_counts_the_caps_decisions() -> None:
    config = BatchConfig(max_batch_size=8, batch_window_ms=0.0, target_p99_ms=100.0)
    planner = BatchPlanner(config)
    assert planner.cap is not None
    planner.cap.cap = 2
    queue = [Request(f"r{i}", "m", 0, 0.0) for i in range(200)]
    for _ in range(25):  # 50 high latencies, each batch leaving a backlog behind it
        plan = plan_batch(planner.view(queue[:9], len(queue), 1.0), config, 1.0)
        assert isinstance(plan, Release)
        planner.released(plan)
        queue = queue[len(plan.batch) :]
        planner.finished(plan.batch, 1.0, 0.9)
    text = format_batching("emb", [("emb-0", planner.describe(1.0))])
    assert "AIMD cap: last grow_backlog at high P99 1000.0 ms against 100.0 ms" in text
    assert "decisions: grow_backlog 1" in text
    assert "emb-0: cap 4 of 8" in text


def test_explain_names_the_length_rule() -> None:
    ratio = BatchConfig(max_batch_size=8, length_candidates=16)
    cost = BatchConfig(max_batch_size=8, length_candidates=16, batch_overhead_tokens=35.0)
    for config, rule in ((ratio, "ratio: padded tokens within 1.25 x real"), (cost, "35 tokens")):
        text = format_batching("emb", [("emb-0", BatchPlanner(config).describe(0.0))])
        assert "length-aware among 16 (" in text
        assert rule in text
