"""Doctor's shell without servers: samples from real registries, durations, the in-gateway
watch over a real gateway registry, and the command's errors."""

from __future__ import annotations

import subprocess

import pytest
from prometheus_client import generate_latest

from tests.procs import DEADLINE_S, TIDEGATE, child_env
from tidegate.config import parse_config
from tidegate.gateway.admin import DoctorWatch
from tidegate.gateway.state import Gateway
from tidegate.metrics import GatewayMetrics, WorkerMetrics
from tidegate.ops.doctor import parse_duration
from tidegate.ops.snapshot import build_snapshot, parse_exposition

CONFIG = {
    "models": [{"name": "sim", "task": "embeddings", "engine": "openai", "upstreams": ["http://x"]}]
}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("60s", 60.0), ("5m", 300.0), ("6h", 21600.0), ("1d", 86400.0), ("90", 90.0)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "-5s", "0"])
def test_bad_durations_say_how_to_write_one(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_snapshot_takes_deltas_quantiles_and_worker_series_of_their_replica() -> None:
    gateway, worker = GatewayMetrics(), WorkerMetrics()
    gateway.requests.labels("sim", "high", "completed").inc(5)
    gateway.requests.labels("sim", "high", "shed").inc(2)
    worker.requests.labels("sim", "high", "completed").inc(5)  # the worker's own count
    worker.batch_size.labels("sim").observe(4)
    worker_labels = {"model": "sim", "replica": "r0", "pool": "shared"}
    before = parse_exposition(generate_latest(gateway.registry).decode())
    before.update(parse_exposition(generate_latest(worker.registry).decode(), worker_labels))
    gateway.requests.labels("sim", "high", "completed").inc(10)
    worker.requests.labels("sim", "high", "completed").inc(10)
    for seconds in (0.1, 0.2, 3.0):
        gateway.request_duration.labels("sim", "high", "e2e").observe(seconds)
    gateway.queue_depth.labels("sim", "high").set(7)
    worker.batch_size.labels("sim").observe(8)
    worker.batch_size.labels("sim").observe(2)
    worker.memory.labels("sim", "cpu", "peak").set(300 * 1024 * 1024)
    after = parse_exposition(generate_latest(gateway.registry).decode())
    after.update(parse_exposition(generate_latest(worker.registry).decode(), worker_labels))

    snapshot = build_snapshot(before, after, 10.0, CONFIG, "test")

    (model,) = snapshot.models
    (high,) = model.classes
    assert high.outcomes == {"completed": 10.0}  # the window's increase, the gateway's only
    assert high.queued == 7
    assert high.e2e_p99_s is not None
    assert 2.5 < high.e2e_p99_s <= 5.0  # in the bucket of the slowest
    assert model.mean_batch_size == 5.0  # (8 + 2) / 2: only this window's batches
    (replica,) = model.replicas
    assert replica.replica == "r0"
    assert replica.memory_peak_mb == 300.0


def test_a_counter_that_went_down_was_reset() -> None:
    metrics = GatewayMetrics()
    metrics.requests.labels("sim", "high", "completed").inc(50)
    before = parse_exposition(generate_latest(metrics.registry).decode())
    fresh = GatewayMetrics()  # the process restarted
    fresh.requests.labels("sim", "high", "completed").inc(3)
    after = parse_exposition(generate_latest(fresh.registry).decode())
    (model,) = build_snapshot(before, after, 10.0, CONFIG, "test").models
    assert model.classes[0].outcomes == {"completed": 3.0}


def test_gateway_watch_sets_the_gauge_and_clears_it_when_the_symptom_stops() -> None:
    gateway = Gateway(parse_config(CONFIG, "<test>"), replicas={})
    watch = DoctorWatch(gateway, window_s=0.0)  # each evaluation: since the one before
    watch.evaluate()
    gateway.metrics.requests.labels("sim", "high", "rejected_full").inc(3)
    gateway.metrics.requests.labels("sim", "high", "completed").inc(1)
    diagnosis = watch.evaluate()
    assert diagnosis.findings[0].rule == "high_priority_shed"
    labels = {"rule": "high_priority_shed", "severity": "critical"}
    registry = gateway.metrics.registry
    assert registry.get_sample_value("tidegate_doctor_findings", labels) == 1
    assert watch.describe()["findings"][0]["config_diff"]
    assert watch.evaluate().findings == ()  # nothing new in the window
    assert registry.get_sample_value("tidegate_doctor_findings", labels) == 0


def _doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TIDEGATE, "doctor", *args],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=child_env(),
        check=False,
    )


def test_no_gateway_is_exit_1_with_the_address() -> None:
    result = _doctor("--url", "http://127.0.0.1:9", "--window", "1s")
    assert result.returncode == 1
    assert "cannot ask http://127.0.0.1:9/admin/doctor" in result.stderr


def test_a_bad_window_is_exit_1() -> None:
    result = _doctor("--window", "soon")
    assert result.returncode == 1
    assert "60s" in result.stderr
