"""Autoscaling end to end: ``tidegate serve`` with simulated workers under a burst.

A real gateway process starts real worker processes; a burst of concurrent requests makes
the controller scale up within a few control periods; once the burst ends, the replicas go
back down only after the scale-down window, and every request of the whole run — including
those in flight on the replicas being drained — gets a 200.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.procs import TIDEGATE, gateway_process, wait_for

pytestmark = pytest.mark.e2e

DOWN_WINDOW_S = 4.0
INTERVAL_S = 0.5


def _config(tmp_path: Path) -> Path:
    profile = tmp_path / "profile.json"
    profile.write_text(
        json.dumps(
            {
                "version": 1,
                "model": "sim",
                "task": "embeddings",
                "memory_mb": 100,
                # 150 ms a batch of up to 4: one replica serves about 27 inputs/s.
                "embeddings": {"points": [{"batch_size": 1, "latency_ms": 150}]},
            }
        )
    )
    config = {
        "pools": {"shared": {"priorities": ["high", "medium", "low"], "devices": ["cpu"]}},
        "models": [
            {
                "name": "sim",
                "task": "embeddings",
                "engine": "simulated",
                "profile": str(profile),
                "pools": ["shared"],
                "replicas": 1,
                "slots": 4,
                "batching": {"max_batch_size": 4, "batch_window_ms": 0},
                "drain_timeout_s": 10,
                "autoscaling": {
                    "min_replicas": 1,
                    "max_replicas": 3,
                    "target_per_replica": 4,
                    "interval_s": INTERVAL_S,
                    "stable_window_s": 0,
                    "scale_down": {
                        "stabilization_window_s": DOWN_WINDOW_S,
                        "select_policy": "max",
                        "policies": [{"type": "pods", "value": 1, "period_s": INTERVAL_S}],
                    },
                },
            }
        ],
    }
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class _Load:
    """``clients`` threads each sending one request after another until stopped."""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.statuses: Counter[int] = Counter()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run) for _ in range(clients)]

    def __enter__(self) -> _Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                response = client.post(
                    f"{self.url}/v1/embeddings", json={"model": "sim", "input": "tide"}
                )
                with self._lock:
                    self.statuses[response.status_code] += 1
                    if response.status_code != 200:
                        self.errors.append(response.text[:200])


def _autoscaler(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/admin/autoscaler", timeout=5).json()["models"]["sim"]


def _ready(url: str) -> int:
    return int(_autoscaler(url)["ready_replicas"])


def test_burst_scales_up_then_down_after_the_window_and_loses_nothing(tmp_path: Path) -> None:
    with gateway_process("--config", str(_config(tmp_path))) as gateway:
        assert _autoscaler(gateway.url)["replicas"] == 1
        with _Load(gateway.url, clients=16) as burst:
            # 16 in flight on one replica: 4x the target. Up within a few periods.
            wait_for(lambda: _autoscaler(gateway.url)["replicas"] == 3, timeout_s=5)
            wait_for(lambda: _ready(gateway.url) == 3, timeout_s=30)
            time.sleep(2)  # served by three replicas for a while
        calm_at = time.monotonic()
        with _Load(gateway.url, clients=2) as trickle:  # in flight during the scale-in
            wait_for(lambda: _autoscaler(gateway.url)["replicas"] == 1, timeout_s=30)
            went_down_after_s = time.monotonic() - calm_at
            time.sleep(1)
        state = _autoscaler(gateway.url)
        metrics = httpx.get(f"{gateway.url}/metrics").text
        explained = subprocess.run(
            [TIDEGATE, "explain", "sim", "--url", gateway.url],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    assert "sim: 1 replicas (1 ready), desired 1, pool shared" in explained
    assert "1 -> 3 up (" in explained
    assert "down (" in explained
    assert went_down_after_s >= DOWN_WINDOW_S - INTERVAL_S
    assert burst.errors == []
    assert trickle.errors == []
    assert set(burst.statuses) == {200}
    assert set(trickle.statuses) == {200}
    assert burst.statuses[200] > 100
    assert trickle.statuses[200] > 10
    directions = [d["direction"] for d in state["decisions"] if d["direction"] != "none"]
    # Up first, then down one at a time; never back up inside the window.
    assert directions[0] == "up"
    assert directions[directions.index("down") :] == ["down", "down"]
    assert 'tidegate_scale_events_total{direction="up",model="sim",reason=' in metrics
    assert 'tidegate_desired_replicas{model="sim"} 1.0' in metrics
    # The configured replica and the two the burst added.
    assert 'tidegate_cold_start_seconds_count{model="sim"} 3.0' in metrics
    assert 'tidegate_drain_seconds_count{model="sim"} 2.0' in metrics
