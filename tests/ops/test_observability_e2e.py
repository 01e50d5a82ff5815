"""A real Prometheus scrapes a running ``tidegate serve`` with the rendered rules and config.

Prometheus (Debian's package) runs on a free loopback port with a tmp storage folder and
1 s scrape and evaluation intervals; it finds the workers through the gateway's http_sd
endpoint, as the rendered scrape config says. Under an induced overload (a queue of two,
one slot, bursts of high-priority requests) every dashboard query returns data and the
high-priority-shed alert fires; once the load stops, the alert clears. Prometheus and the
gateway are always killed. Waits are for conditions, with generous deadlines.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.loadthreads import ClosedLoop
from tests.ops.observability_fixtures import config_dict, grafana_to_promql, write_profile
from tests.procs import DEADLINE_S, gateway_process, wait_for
from tests.promserver import api, query
from tests.promserver import prometheus as prometheus_server
from tidegate.config import load_config
from tidegate.ops.grafana import panel_queries, render_dashboard
from tidegate.ops.observability import (
    ADMIN_KEY_FILE,
    RULES_FILE,
    SCRAPE_FILE,
    render_rules,
    render_scrape_config,
)

pytestmark = pytest.mark.e2e

ALERT = "TidegateHighPriorityShed"
# Series only a worker on a CUDA device exports (NVML): these simulated workers run on cpu.
GPU_ONLY = "DCGM_FI_"
ADMIN_KEY = "sk-observability-e2e"
CLEAR_DEADLINE_S = 300.0  # the alert's 1 m rate window, then evaluation, on a busy machine


def overload_config(tmp_path: Path) -> Path:
    """One autoscaled model, slow, one slot per replica and a queue of two; an admin key
    guards /metrics and /admin/*, so Prometheus must use the rendered credentials."""
    data = config_dict(write_profile(tmp_path / "profile.json", latency_ms=200))
    data["gateway"] = {"metrics_auth": "admin"}
    digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    data["keys"] = [{"name": "ops", "sha256": digest, "role": "admin", "max_priority": "high"}]
    chat = data["models"][0]  # type: ignore[index]
    chat.update(
        {
            "slots": 1,
            "batching": {"max_batch_size": 1, "batch_window_ms": 0},
            "queue": {"max_size": 2},
            "drain_timeout_s": 5,
        }
    )
    chat["autoscaling"].update(
        {
            "max_replicas": 2,
            "target_per_replica": 1,
            "interval_s": 1,
            "scale_down": {"stabilization_window_s": 5},
        }
    )
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@contextlib.contextmanager
def prometheus(folder: Path, gateway_url: str) -> Iterator[str]:
    """A Prometheus with the rendered rules and scrape config, aimed at ``gateway_url``."""
    config = load_config(folder / "tidegate.yaml")
    (folder / RULES_FILE).write_text(yaml.safe_dump(render_rules(config), sort_keys=False))
    scrape = render_scrape_config(config)
    address = gateway_url.removeprefix("http://")
    scrape["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    gateway_job, workers_job = scrape["scrape_configs"]
    gateway_job["static_configs"] = [{"targets": [address]}]
    workers_job["http_sd_configs"][0].update(
        {"url": f"{gateway_url}/admin/prometheus/targets", "refresh_interval": "1s"}
    )
    (folder / SCRAPE_FILE).write_text(yaml.safe_dump(scrape, sort_keys=False))
    (folder / ADMIN_KEY_FILE).write_text(ADMIN_KEY)
    with prometheus_server(
        folder / SCRAPE_FILE,
        folder / "data",
        flags=["--log.level=warn"],
        ready_s=DEADLINE_S,
        poll_s=0.1,
    ) as url:
        yield url


def firing(url: str, name: str) -> bool:
    alerts = api(url, "alerts")["alerts"]
    return any(a["labels"]["alertname"] == name and a["state"] == "firing" for a in alerts)


def targets_up(url: str) -> bool:
    active = api(url, "targets", state="active")["activeTargets"]
    up = Counter(t["labels"]["job"] for t in active if t["health"] == "up")
    return up["tidegate-gateway"] == 1 and up["tidegate-workers"] >= 1


def high_priority_burst(url: str, clients: int) -> ClosedLoop:
    """Threads sending high-priority requests back to back until stopped."""

    def high(client: httpx.Client) -> httpx.Response:
        return client.post(
            f"{url}/v1/embeddings",
            json={"model": "chat", "input": "tide"},
            headers={"X-Priority": "high", "Authorization": f"Bearer {ADMIN_KEY}"},
        )

    return ClosedLoop([("high", high)] * clients)


def test_prometheus_scrapes_tidegate_dashboard_has_data_and_shed_alert_fires_then_clears(
    tmp_path: Path,
) -> None:
    config_path = overload_config(tmp_path)
    queries = panel_queries(render_dashboard(load_config(config_path)))
    with (
        gateway_process("--config", str(config_path)) as gateway,
        prometheus(tmp_path, gateway.url) as prom,
    ):
        wait_for(lambda: targets_up(prom), DEADLINE_S, 0.2)
        started_at = time.monotonic()
        with high_priority_burst(gateway.url, clients=8) as burst:
            wait_for(lambda: firing(prom, ALERT), DEADLINE_S * 2, 0.5)
            fired_s = time.monotonic() - started_at
            missing: list[str] = []

            def every_query_has_data() -> bool:
                missing[:] = [
                    f"{title}: {expr}"
                    for title, expr in queries
                    if GPU_ONLY not in expr and not query(prom, grafana_to_promql(expr))
                ]
                return not missing

            with contextlib.suppress(AssertionError):
                wait_for(every_query_has_data, DEADLINE_S * 2, 1.0)
            assert not missing, "dashboard queries without data:\n" + "\n".join(missing)
            data_s = time.monotonic() - started_at
        stopped_at = time.monotonic()
        assert burst.statuses[429] > 0, burst.statuses
        assert burst.statuses[200] > 0, burst.statuses
        wait_for(lambda: not firing(prom, ALERT), CLEAR_DEADLINE_S, 1.0)
        print(
            f"{ALERT} fired {fired_s:.1f} s into the overload; every panel had data at "
            f"{data_s:.1f} s; cleared {time.monotonic() - stopped_at:.1f} s after it stopped"
        )
