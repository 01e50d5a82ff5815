"""Autoscaling end to end: ``tidegate serve`` with simulated workers under a burst.

A real gateway process starts real worker processes; a burst of concurrent requests makes
the controller scale up; once the burst ends, the replicas go back down only after the
scale-down window, and every request of the whole run — including those in flight on the
replicas being drained — gets a 200.

The test waits for what it needs (replica counts, requests served, drains done) with
generous deadlines, and checks the window on the gateway's own decisions: a busy machine
makes everything slower, never a check fail.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.loadthreads import ClosedLoop
from tests.procs import DEADLINE_S, TIDEGATE, gateway_process, wait_for

pytestmark = pytest.mark.e2e

DOWN_WINDOW_S = 4.0
INTERVAL_S = 0.5


def _config(tmp_path: Path, **autoscaling: Any) -> Path:
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
                    **autoscaling,
                },
            }
        ],
    }
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _load(url: str, clients: int) -> ClosedLoop:
    """``clients`` threads each sending one request after another until stopped."""

    def embed(client: httpx.Client) -> httpx.Response:
        return client.post(f"{url}/v1/embeddings", json={"model": "sim", "input": "tide"})

    return ClosedLoop([("", embed)] * clients)


def _autoscaler(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/admin/autoscaler", timeout=DEADLINE_S).json()["models"]["sim"]


def _ready(url: str) -> int:
    return int(_autoscaler(url)["ready_replicas"])


def _metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=DEADLINE_S).text


def _recommended(decision: dict[str, Any]) -> int:
    """The recommendation a decision recorded for the stabilization windows (0: none, as a
    hold on a stale signal records none)."""
    found = re.search(r"recommended (\d+)", decision["explain"])
    return 0 if found is None else int(found.group(1))


def _held_for_the_window(decisions: list[dict[str, Any]]) -> float:
    """Seconds (gateway clock) from the last recommendation of 3 or more to the first
    scale-down: the scale-down window, however slowly the machine ran."""
    first_down = next(i for i, d in enumerate(decisions) if d["direction"] == "down")
    last_high = max(i for i in range(first_down) if _recommended(decisions[i]) >= 3)
    return float(decisions[first_down]["at"] - decisions[last_high]["at"])


def test_burst_scales_up_then_down_after_the_window_and_loses_nothing(tmp_path: Path) -> None:
    with gateway_process("--config", str(_config(tmp_path))) as gateway:
        assert _autoscaler(gateway.url)["replicas"] == 1
        with _load(gateway.url, clients=16) as burst:
            # 16 in flight on one replica: 4x the target.
            wait_for(lambda: _autoscaler(gateway.url)["replicas"] == 3, timeout_s=DEADLINE_S)
            wait_for(lambda: _ready(gateway.url) == 3, timeout_s=2 * DEADLINE_S)
            served = burst.served()  # served by three replicas for a while
            wait_for(lambda: burst.served() >= served + 100, timeout_s=2 * DEADLINE_S)
        with _load(gateway.url, clients=2) as trickle:  # in flight during the scale-in
            wait_for(lambda: _autoscaler(gateway.url)["replicas"] == 1, timeout_s=2 * DEADLINE_S)
            served = trickle.served()  # and after it, on the one replica left
            wait_for(lambda: trickle.served() >= served + 10, timeout_s=DEADLINE_S)
        # A drain ends when the replica's process has stopped: wait for both to be counted.
        drained = 'tidegate_drain_seconds_count{model="sim"} 2.0'
        wait_for(lambda: drained in _metrics(gateway.url), timeout_s=DEADLINE_S)
        state = _autoscaler(gateway.url)
        metrics = _metrics(gateway.url)
        explained = subprocess.run(
            [TIDEGATE, "explain", "sim", "--url", gateway.url],
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
            check=True,
        ).stdout
    assert "sim: 1 replicas (1 ready), desired 1, pool shared" in explained
    # Up to 3 (in one step, or two when a period saw the burst only half arrived).
    assert "-> 3 up (" in explained
    assert "down (" in explained
    assert _held_for_the_window(state["decisions"]) >= DOWN_WINDOW_S - 0.01  # "at" is rounded
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
    assert drained in metrics


def _arrivals(metrics: str) -> float:
    series = 'tidegate_arrivals_total{model="sim"} '
    (line,) = (line for line in metrics.splitlines() if line.startswith(series))
    return float(line.removeprefix(series))


def test_a_rate_target_scales_on_the_arrivals_the_gateway_counts(tmp_path: Path) -> None:
    # 5 arrivals/s per replica: one replica alone serves ~27/s to 16 clients, so the count
    # goes to the maximum; with no traffic the rate is 0 and it comes back to 1.
    config = _config(tmp_path, target_rate_per_replica=5, stable_window_s=1)
    with gateway_process("--config", str(config)) as gateway:
        with _load(gateway.url, clients=16) as burst:
            wait_for(lambda: _autoscaler(gateway.url)["replicas"] == 3, timeout_s=DEADLINE_S)
            served = burst.served()
            wait_for(lambda: burst.served() >= served + 50, timeout_s=2 * DEADLINE_S)
        wait_for(lambda: _autoscaler(gateway.url)["replicas"] == 1, timeout_s=2 * DEADLINE_S)
        state = _autoscaler(gateway.url)
        metrics = _metrics(gateway.url)
    assert burst.errors == []
    assert set(burst.statuses) == {200}
    # Every request counted once as it arrived: the counter an HPA reads (k8s render).
    assert _arrivals(metrics) == sum(burst.statuses.values())
    up = next(d for d in state["decisions"] if d["direction"] == "up")
    assert "arrivals/s" in up["explain"]
    down = next(d for d in state["decisions"] if d["direction"] == "down")
    assert "arrivals/s" in down["explain"]
