"""``tidegate simulate`` end to end: report.json, report.md, report.png and the summary."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tidegate.cli import app

from .conftest import FIXTURES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_simulate_writes_the_three_reports_and_prints_the_comparison(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--trace",
            str(FIXTURES / "azure_conv_head.csv"),
            "--profile",
            str(FIXTURES / "perf_model_slice.csv"),
            "--replicas",
            "3",
            "--compare",
            "fifo,priority",
            "--priority-mix",
            "high=0.2,medium=0.3,low=0.5",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert [run["policy"] for run in report["runs"]] == ["fifo", "priority"]
    assert report["workload"]["requests"] == 300
    assert report["model"]["service"]["name"] == "llama2-70b on a100-80gb TP8"
    assert set(report["runs"][0]["classes"]) == {"high", "medium", "low"}
    markdown = (out / "report.md").read_text()
    assert "| priority | policy |" in markdown
    assert (out / "report.png").read_bytes()[:8] == PNG_MAGIC
    lines = result.output.splitlines()
    assert lines[0].split()[:2] == ["priority", "policy"]
    assert any(line.split()[:2] == ["high", "priority"] for line in lines)


def test_simulate_a_synthetic_embeddings_workload(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--workload",
            "poisson:rate=50,duration_s=20,prompt=14,output=0",
            "--priority-rules",
            "prompt<12=high,*=low",
            "--out",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["model"]["name"] == "minilm"  # the embedded default's embeddings model
    assert report["runs"][0]["policy"] == "priority"
    classes = report["runs"][0]["classes"]
    assert (
        classes["high"]["requests"] + classes["low"]["requests"] == report["workload"]["requests"]
    )
    assert classes["medium"]["requests"] == 0


def test_simulate_refuses_two_sources_and_unknown_policies(tmp_path: Path) -> None:
    runner = CliRunner()
    both = runner.invoke(
        app,
        ["simulate", "--trace", "x.csv", "--workload", "poisson:rate=1", "--out", str(tmp_path)],
    )
    assert both.exit_code == 2
    assert "exactly one of --trace" in both.output
    unknown = runner.invoke(
        app,
        [
            "simulate",
            "--workload",
            "poisson:rate=1,duration_s=1",
            "--compare",
            "fifo,lifo",
            "--out",
            str(tmp_path),
        ],
    )
    assert unknown.exit_code == 2
    assert "unknown policy 'lifo'" in unknown.output
    missing = runner.invoke(app, ["simulate", "--trace", str(tmp_path / "no.csv")])
    assert missing.exit_code == 2
    assert "no such file" in missing.output


def test_simulate_compares_autoscalers_on_a_diurnal_day(tmp_path: Path) -> None:
    config = tmp_path / "scaled.yaml"
    config.write_text(
        """
models:
  - name: embed
    task: embeddings
    engine: simulated
    replicas: 1
    batching: {max_batch_size: 32, batch_window_ms: 5}
    autoscaling:
      min_replicas: 1
      max_replicas: 4
      target_per_replica: 12
      schedules: [{days: daily, from: "09:00", to: "18:00", min_replicas: 2}]
"""
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--workload",
            # a quarter of the load and of the target per replica: the autoscalers still move
            # between 1 and 4 replicas over the day, on 18k requests, not 72k, per policy
            "diurnal:mean_rate=300,peak_trough=4,output=0,prompt=64",
            "--config",
            str(config),
            "--speedup",
            "1440",  # the day in one minute of virtual time, autoscaler timings alike
            "--compare",
            "static-peak,hpa-default,tidegate",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    runs = {run["policy"]: run for run in json.loads((out / "report.json").read_text())["runs"]}
    assert list(runs) == ["static-peak", "hpa-default", "tidegate"]
    hours = {name: run["overall"]["replica_hours"] for name, run in runs.items()}
    assert hours["tidegate"] < hours["static-peak"]
    assert hours["hpa-default"] < hours["static-peak"]
    for run in runs.values():
        classes = run["classes"].values()
        assert sum(c["requests"] for c in classes) == run["overall"]["requests"]
        ended = sum(
            c["completed"]
            + c["shed"]
            + sum(c["rejected"].values())
            + c["expired"]
            + c["failed"]
            + c["unservable"]
            + c["stranded"]
            for c in classes
        )
        assert ended == run["overall"]["requests"]  # every request ended exactly once
