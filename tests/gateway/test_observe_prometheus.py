"""A real Prometheus (Debian's ``prometheus``) finds and scrapes tidegate's workers through
the gateway's http_sd endpoint, with the admin key, and joins them to their replicas.

The Prometheus configuration, its data and its port are the test's own (a temporary folder,
a free loopback port); the server is always stopped. Waits are for Prometheus' own answers.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
import yaml

from tests.gateway.harness import flat_profile
from tests.procs import DEADLINE_S, Proc, gateway_process, wait_for
from tests.promserver import PROMETHEUS_READY_S, api, prometheus, query
from tidegate.gateway.observe import TARGETS_PATH

pytestmark = pytest.mark.e2e

ADMIN_KEY = "sk-test-prometheus"
WORKERS_JOB = "tidegate-workers"
GATEWAY_JOB = "tidegate-gateway"


def _config(tmp_path: Path) -> Path:
    profile = str(flat_profile(tmp_path / "flat.json", 1.0))
    sim = {"task": "embeddings", "engine": "simulated", "profile": profile}
    config = {
        "gateway": {"metrics_auth": "admin"},
        "pools": {
            "dedicated": {"priorities": ["high"], "devices": ["cpu"]},
            "shared": {"priorities": ["high", "medium", "low"], "devices": ["cpu"]},
        },
        "models": [
            {
                "name": "embed",
                **sim,
                "pools": ["dedicated", "shared"],
                "replicas": {"dedicated": 1, "shared": 1},
            },
            {"name": "other", **sim, "pools": ["shared"], "replicas": 1},
        ],
        "keys": [
            {
                "name": "ops",
                "sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest(),
                "role": "admin",
            }
        ],
    }
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _prometheus_config(tmp_path: Path, gateway: Proc) -> Path:
    address = gateway.url.removeprefix("http://")
    key_file = tmp_path / "admin-key"
    key_file.write_text(ADMIN_KEY)
    # type Bearer spelled out: Prometheus 2.42 (Debian 12) sends an http_sd's credentials
    # with no type at all ("Authorization: sk-..."), which the gateway refuses (401).
    auth = {"authorization": {"type": "Bearer", "credentials_file": str(key_file)}}
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {"job_name": GATEWAY_JOB, **auth, "static_configs": [{"targets": [address]}]},
            {
                "job_name": WORKERS_JOB,
                "honor_labels": True,  # the workers' own model label is the target's
                "http_sd_configs": [
                    {"url": f"{gateway.url}{TARGETS_PATH}", "refresh_interval": "1s", **auth}
                ],
            },
        ],
    }
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def _up_targets(url: str, job: str) -> dict[str, dict[str, str]]:
    """replica (or instance) -> labels of the job's active targets that are up."""
    targets = api(url, "targets", state="active")["activeTargets"]
    return {
        t["labels"].get("replica", t["labels"]["instance"]): t["labels"]
        for t in targets
        if t["labels"]["job"] == job and t["health"] == "up"
    }


def test_prometheus_scrapes_every_worker_found_through_the_gateway(tmp_path: Path) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with gateway_process("--config", str(_config(tmp_path))) as gateway:
        expected: dict[str, dict[str, str]] = {}

        def all_listed() -> bool:  # /readyz waits for one replica of each model, not all
            listed = httpx.get(f"{gateway.url}{TARGETS_PATH}", headers=admin, timeout=DEADLINE_S)
            expected.update({g["labels"]["replica"]: g["labels"] for g in listed.json()})
            return len(expected) == 3  # embed in two pools, other in one

        wait_for(all_listed)
        data = tmp_path / "prometheus-data"
        with prometheus(_prometheus_config(tmp_path, gateway), data) as prom:
            wait_for(
                lambda: set(_up_targets(prom, WORKERS_JOB)) == set(expected), PROMETHEUS_READY_S
            )
            wait_for(lambda: len(_up_targets(prom, GATEWAY_JOB)) == 1, PROMETHEUS_READY_S)
            for replica, labels in _up_targets(prom, WORKERS_JOB).items():
                for name in ("model", "replica", "pool"):
                    assert labels[name] == expected[replica][name]

            # Every worker's series carry its replica and pool, its own model label kept.
            def all_workers(expr: str) -> bool:
                return {s["metric"].get("replica") for s in query(prom, expr)} == set(expected)

            wait_for(lambda: all_workers("tidegate_worker_ready == 1"))
            wait_for(lambda: all_workers("process_resident_memory_bytes{job='tidegate-workers'}"))
            for series in query(prom, "tidegate_worker_ready"):
                metric = series["metric"]
                assert metric["model"] == expected[metric["replica"]]["model"]
                assert metric["pool"] == expected[metric["replica"]]["pool"]

            # tidegate_replica_info joins a worker's series to where the replica runs.
            joined = (
                "tidegate_worker_ready * on (replica) group_left (device, url) "
                "tidegate_replica_info{job='tidegate-gateway'}"
            )
            wait_for(lambda: all_workers(joined))
            for series in query(prom, joined):
                metric = series["metric"]
                assert metric["device"] == "cpu"
                assert metric["url"].startswith("http://127.0.0.1:")
