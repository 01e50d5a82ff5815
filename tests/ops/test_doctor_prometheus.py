"""Doctor reading a real Prometheus (Debian's) that scrapes an overloaded tidegate: the
gateway directly, its workers through the gateway's http_sd endpoint."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from tests.gateway.harness import flat_profile
from tests.ops.doctor_load import load, one_slot_model, tidegate, write_config
from tests.procs import DEADLINE_S, gateway_process, wait_for
from tests.promserver import prometheus, query_sum
from tidegate.gateway.observe import TARGETS_PATH


def _scrape_config(tmp_path: Path, gateway_url: str) -> Path:
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {
                "job_name": "tidegate-gateway",
                "static_configs": [{"targets": [gateway_url.removeprefix("http://")]}],
            },
            {
                "job_name": "tidegate-workers",
                "honor_labels": True,
                "http_sd_configs": [
                    {"url": f"{gateway_url}{TARGETS_PATH}", "refresh_interval": "1s"}
                ],
            },
        ],
    }
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


OVERLOAD_RULES = {"high_priority_shed", "rejection_storm", "batches_too_small", "autoscale_stuck"}


def _diagnosed(readings: list[subprocess.CompletedProcess[str]], prom: str, config: Path) -> bool:
    """Doctor once more over the last hour; True when it found every overload symptom."""
    result = tidegate(
        "doctor", "--prometheus", prom, "--range", "1h", "--config", str(config),
        "--p99-slo", "0.3", "--json",
    )  # fmt: skip
    readings.append(result)
    if result.returncode != 2:
        return False
    return {f["rule"] for f in json.loads(result.stdout)["findings"]} >= OVERLOAD_RULES


def test_overload_read_back_from_prometheus(tmp_path: Path) -> None:
    profile = flat_profile(tmp_path / "profile.json", latency_ms=200)
    config = write_config(tmp_path, [one_slot_model(profile)])
    with gateway_process("--config", str(config)) as gateway:
        scrape = _scrape_config(tmp_path, gateway.url)
        with (
            prometheus(scrape, tmp_path / "prometheus-data") as prom,
            load(gateway.url, "sim", {"high": 8, "low": 4}),
        ):
            shed = 'sum(tidegate_requests_total{priority="high",outcome="rejected_full"})'
            wait_for(lambda: query_sum(prom, shed) > 0)
            wait_for(lambda: query_sum(prom, "sum(tidegate_batch_size_count)") > 0)
            seen = query_sum(prom, 'sum(tidegate_requests_total{outcome="completed"})')
            wait_for(
                lambda: query_sum(prom, 'sum(tidegate_requests_total{outcome="completed"})') > seen
            )
            # Read until every symptom is seen: on a loaded machine one reading can fall on
            # a scrape that saw the queue empty for a moment (autoscale_stuck needs a backlog).
            readings: list[subprocess.CompletedProcess[str]] = []
            wait_for(lambda: _diagnosed(readings, prom, config), timeout_s=3 * DEADLINE_S)
    result = readings[-1]
    assert result.returncode == 2, result.stdout + result.stderr
    report = json.loads(result.stdout)
    rules = [f["rule"] for f in report["findings"]]
    assert rules[0] == "high_priority_shed"
    assert set(rules) >= OVERLOAD_RULES, rules
    by_rule = {f["rule"]: f for f in report["findings"]}
    assert "-    max_size: 4" in by_rule["high_priority_shed"]["config_diff"]
    assert "+    max_batch_size: 2" in by_rule["batches_too_small"]["config_diff"]
