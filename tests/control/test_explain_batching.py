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
