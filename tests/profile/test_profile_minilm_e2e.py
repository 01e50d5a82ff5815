"""A short real profile of minilm runs end to end and writes four valid files.

How fast the model is on this machine is a benchmark's question (benchmarks/), never a
test's: tests share the machine with other work. The sweep is as small as still has a
choice in each sweep: batches 1 and 2, one window, 1 and 2 in flight; each point is the
three shortest windows (0.5 s), stable or not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.profile.profiling import FILES, run_profile
from tidegate.config import load_config
from tidegate.engines.profile import load_profile

pytestmark = pytest.mark.e2e


def test_real_minilm_profile_runs_end_to_end_and_writes_valid_files(tmp_path: Path) -> None:
    # Short sentences of one length, as in docs/benchmarks.md. Nothing here depends on how
    # fast the machine is: a busy one gives slower points, and they are still points.
    trace = tmp_path / "sentences.csv"
    rows = "".join(f"{i / 10},16,0,,\n" for i in range(64))
    trace.write_text("arrival_s,prompt_tokens,output_tokens,priority,tenant\n" + rows)
    out = tmp_path / "minilm"
    result = run_profile(
        "--model", "minilm", "--workload", str(trace), "--max-batch", "2",
        "--max-concurrency", "2", "--batch-windows-ms", "5",
        # A stable point stops at 1.5 s; 6 s leave a loaded machine time for completions
        # (at 1.5 s a point once finished with none, under three other test workers).
        "--min-seconds-per-point", "1.5", "--max-seconds-per-point", "6",
        out=out,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert {p.name for p in out.iterdir()} == FILES
    measured = json.loads((out / "profile.json").read_text())["measured"]
    assert measured["complete"] is True
    profile = load_profile(out / "profile.json")
    assert profile.task == "embeddings"
    assert {p.sweep for p in profile.points} >= {"batch", "concurrency"}
    assert [p.batch_size for p in profile.points if p.sweep == "batch"] == [1, 2]
    assert all(p.num_requests > 0 and p.throughput_rps > 0 for p in profile.points)
    # The knee is one of the points measured, as measured (its speed is not checked).
    knee = profile.knee
    assert knee is not None
    assert any(
        (p.concurrency, p.batch_size, p.batch_window_ms, p.throughput_rps)
        == (knee.concurrency, knee.batch_size, knee.batch_window_ms, knee.throughput_rps)
        for p in profile.points
    ), knee
    assert 1 <= (knee.batch_size or 0) <= 2  # within --max-batch
    assert 1 <= knee.concurrency <= 2  # within --max-concurrency
    assert profile.memory_mb > profile.weights_mb > 0
    assert all(p.worker_cpu_cores is not None for p in profile.points)
    assert all(14 <= p.mean_input_tokens <= 18 for p in profile.points)  # 16, as the trace says
    # recommended.yaml is a valid configuration, set at the knee (each sweep was measured at
    # the knee of the one before: the final one's batch is the batch sweep's choice).
    model = load_config(out / "recommended.yaml").model("minilm")
    assert model.slots == knee.concurrency
    assert model.batching.max_batch_size == knee.batch_size
    assert model.memory_mb > 0
    assert "| batch | batch latency ms |" in (out / "report.md").read_text()
    assert (out / "report.png").read_bytes().startswith(b"\x89PNG")
