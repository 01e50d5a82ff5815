"""Doctor on ``tidegate simulate`` reports: a scale-down that is too fast for bursty load
times requests out after each scale-in; the same load on a fleet that keeps its replicas
is healthy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.gateway.harness import flat_profile
from tests.ops.doctor_load import tidegate

WORKLOAD = "gamma:rate=20,cv=4,duration_s=600,output=0,prompt=16"


def _doctor_on_simulation(tmp_path: Path, autoscaling: dict[str, Any]) -> tuple[int, Any]:
    profile = flat_profile(tmp_path / "profile.json", latency_ms=100)
    config = tmp_path / "tidegate.yaml"
    model = {
        "name": "sim",
        "task": "embeddings",
        "engine": "simulated",
        "profile": str(profile),
        "replicas": 1,
        "batching": {"max_batch_size": 1, "batch_window_ms": 0},
        "queue": {"timeout_s": {"high": 1.0, "medium": 1.0, "low": 1.0}},
        "autoscaling": autoscaling,
    }
    config.write_text(yaml.safe_dump({"models": [model]}))
    out = tmp_path / "sim-out"
    simulated = tidegate(
        "simulate",
        "--workload",
        WORKLOAD,
        "--config",
        str(config),
        "--profile",
        str(profile),
        "--compare",
        "tidegate",
        "--out",
        str(out),
    )
    assert simulated.returncode == 0, simulated.stderr
    doctor = tidegate(
        "doctor", "--report", str(out / "report.json"), "--config", str(config), "--json"
    )
    assert doctor.returncode in (0, 2), doctor.stderr
    return doctor.returncode, json.loads(doctor.stdout)


def test_timeouts_after_a_fast_scale_in(tmp_path: Path) -> None:
    _, report = _doctor_on_simulation(
        tmp_path,
        {
            "min_replicas": 1,
            "max_replicas": 8,
            "target_per_replica": 2,
            "interval_s": 5,
            "stable_window_s": 0,
            "scale_down": {
                "stabilization_window_s": 0,
                "policies": [{"type": "percent", "value": 100, "period_s": 5}],
            },
        },
    )
    by_rule = {f["rule"]: f for f in report["findings"]}
    assert "scale_in_timeouts" in by_rule, report
    diff = by_rule["scale_in_timeouts"]["config_diff"]
    assert "-      stabilization_window_s: 0.0" in diff
    assert "+      stabilization_window_s: 600.0" in diff


def test_the_same_load_on_replicas_kept_is_healthy(tmp_path: Path) -> None:
    status, report = _doctor_on_simulation(
        tmp_path, {"min_replicas": 8, "max_replicas": 8, "target_per_replica": 2}
    )
    assert report["findings"] == []
    assert status == 0
