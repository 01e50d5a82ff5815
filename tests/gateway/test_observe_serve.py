"""Service discovery on a real ``tidegate serve``: the targets are exactly its live workers.

One model has a fixed replica, another scales from zero and back. The listing follows a
cold start, a scale-in to zero and a killed worker's restart, and every target it lists is a
worker answering /metrics for its model. Waits are for conditions, bounded by generous
deadlines.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.gateway.harness import flat_profile
from tests.procs import DEADLINE_S, Proc, gateway_process, wait_for
from tests.worker.test_metrics_worker import samples, value
from tidegate.gateway.observe import TARGETS_PATH

pytestmark = pytest.mark.e2e

DOWN_WINDOW_S = 2.0  # idle this long, the scaled model goes back to zero


def _config(tmp_path: Path) -> Path:
    profile = str(flat_profile(tmp_path / "flat.json", 1.0))
    sim = {"task": "embeddings", "engine": "simulated", "profile": profile, "pools": ["shared"]}
    config = {
        "pools": {"shared": {"priorities": ["high", "medium", "low"], "devices": ["cpu"]}},
        "models": [
            {"name": "fixed", **sim, "replicas": 1},
            {
                "name": "scaled",
                **sim,
                "replicas": 0,
                "autoscaling": {
                    "min_replicas": 0,
                    "max_replicas": 1,
                    "target_per_replica": 4,
                    "scale_to_zero": True,
                    "interval_s": 0.5,
                    "stable_window_s": 0,
                    "scale_down": {
                        "stabilization_window_s": DOWN_WINDOW_S,
                        "policies": [{"type": "pods", "value": 1, "period_s": 0.5}],
                    },
                },
            },
        ],
    }
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _get(url: str) -> Any:
    answer = httpx.get(url, timeout=DEADLINE_S)
    answer.raise_for_status()
    return answer.json() if "json" in answer.headers["content-type"] else answer.text


def _targets(gateway: Proc) -> dict[str, tuple[str, dict[str, str]]]:
    """replica id -> (scrape URL, labels) of every target the gateway lists."""
    listed: dict[str, tuple[str, dict[str, str]]] = {}
    for group in _get(f"{gateway.url}{TARGETS_PATH}"):
        labels = group["labels"]
        (address,) = group["targets"]
        url = f"{labels['__scheme__']}://{address}{labels['__metrics_path__']}"
        listed[labels["replica"]] = (url, labels)
    return listed


def _live_workers(gateway: Proc) -> dict[str, str]:
    """replica id -> its /metrics URL, for every replica /admin/replicas shows with an
    address and a process behind it."""
    live = {}
    for model in _get(f"{gateway.url}/admin/replicas").values():
        for replica in model["replicas"]:
            if replica["url"] and replica["state"] not in ("stopped", "failed"):
                live[replica["id"]] = f"{replica['url']}/metrics"
    return live


def _assert_targets_are_the_live_workers(gateway: Proc) -> dict[str, str]:
    """The listing and /admin/replicas agree (two reads: wait for a pair taken between two
    changes), and each target is a ready worker of its model."""
    snapshot: list[Any] = []

    def agree() -> bool:
        snapshot[:] = [_targets(gateway), _live_workers(gateway)]
        return {rid: url for rid, (url, _) in snapshot[0].items()} == snapshot[1]

    wait_for(agree)
    targets, live = snapshot
    for rid, (url, labels) in targets.items():
        assert labels["pool"] == "shared"
        metrics = _get(url)
        assert value(metrics, "tidegate_worker_ready", model=labels["model"]) == 1.0, rid
    return live


def _replica_info(gateway: Proc) -> dict[str, dict[str, str]]:
    """replica id -> the labels of its tidegate_replica_info."""
    found = samples(_get(f"{gateway.url}/metrics"))
    return {ls["replica"]: ls for name, ls, _ in found if name == "tidegate_replica_info"}


def _replica(gateway: Proc, model: str) -> dict[str, Any]:
    (replica,) = _get(f"{gateway.url}/admin/replicas")[model]["replicas"]
    return replica  # type: ignore[no-any-return]


class _Trickle:
    """One request after another to a model, in a thread, until the block ends: demand
    that keeps its replica through the scale-down window."""

    def __init__(self, gateway: Proc, model: str) -> None:
        self.url = f"{gateway.url}/v1/embeddings"
        self.model = model
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> _Trickle:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=DEADLINE_S)

    def _run(self) -> None:
        with httpx.Client(timeout=DEADLINE_S) as client:
            while not self._stop.is_set():
                body = {"model": self.model, "input": "keep busy"}
                self.statuses.append(client.post(self.url, json=body).status_code)


def test_targets_follow_a_cold_start_a_scale_to_zero_and_a_restart(tmp_path: Path) -> None:
    with gateway_process("--config", str(_config(tmp_path))) as gateway:
        # At first: the one fixed worker; the scaled model has none.
        (fixed,) = _assert_targets_are_the_live_workers(gateway)
        assert fixed.startswith("fixed-")
        info = _replica_info(gateway)
        assert set(info) == {fixed}
        assert info[fixed]["device"] == "cpu"
        assert f"{info[fixed]['url']}/metrics" == _live_workers(gateway)[fixed]

        # A request for the scaled model starts its worker: it is listed once it answers.
        answer = httpx.post(
            f"{gateway.url}/v1/embeddings",
            json={"model": "scaled", "input": "wake up"},
            timeout=3 * DEADLINE_S,
        )
        assert answer.status_code == 200, answer.text
        with _Trickle(gateway, "scaled") as trickle:  # demand: it is started again if it goes
            # Three reads (targets, /admin/replicas, /metrics): wait for a set taken between
            # two changes. On a loaded machine the trickle can leave a scale-down window idle,
            # and the scaled replica is then replaced between two reads.
            seen: dict[str, Any] = {}

            def listed_alike() -> bool:
                live = seen["live"] = _assert_targets_are_the_live_workers(gateway)
                models = {rid: labels["model"] for rid, (_, labels) in _targets(gateway).items()}
                listed = set(_replica_info(gateway)) == set(live) == set(models)
                return listed and sorted(models.values()) == ["fixed", "scaled"]

            wait_for(listed_alike, timeout_s=2 * DEADLINE_S)
            (scaled,) = set(seen["live"]) - {fixed}
            assert scaled.startswith("scaled-")
        assert set(trickle.statuses) <= {200}

        # Idle past the scale-down window: back to zero, and out of the listing.
        wait_for(lambda: set(_targets(gateway)) == {fixed}, timeout_s=2 * DEADLINE_S)
        _assert_targets_are_the_live_workers(gateway)
        wait_for(lambda: set(_replica_info(gateway)) == {fixed})

        # The fixed worker is killed and restarted: listed again, at its new process.
        before_url = _targets(gateway)[fixed][0]
        started = value(_get(before_url), "process_start_time_seconds")
        os.killpg(_replica(gateway, "fixed")["pid"], signal.SIGKILL)
        wait_for(lambda: _replica(gateway, "fixed")["restarts"] == 1)
        wait_for(lambda: _replica(gateway, "fixed")["state"] == "ready", timeout_s=2 * DEADLINE_S)
        _assert_targets_are_the_live_workers(gateway)
        after_url = _targets(gateway)[fixed][0]
        assert value(_get(after_url), "process_start_time_seconds") > started  # a new process
        assert f"{_replica_info(gateway)[fixed]['url']}/metrics" == after_url
