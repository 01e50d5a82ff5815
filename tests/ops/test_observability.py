"""The rendered Prometheus rules, scrape config and Grafana dashboard, checked by promtool.

``promtool check rules`` / ``check config`` validate what ``tidegate observability render``
writes; ``promtool test rules`` runs one unit test per alert: it fires on a series that shows
its symptom and stays silent on a healthy one. Every dashboard query is checked to parse by
promtool too (as a recording rule); that they return data is the end-to-end test's job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.ops.observability_fixtures import (
    COLD_START_S,
    HIGH_TIMEOUT_S,
    MAX_REPLICAS,
    AlertCase,
    config_dict,
    grafana_to_promql,
    load,
    run_alert_case,
    run_promtool,
    write_profile,
)
from tidegate.cli import app
from tidegate.config import TidegateConfig
from tidegate.ops.grafana import SCALE_EVENTS_ANNOTATION, panel_queries, render_dashboard
from tidegate.ops.observability import (
    ADMIN_KEY_FILE,
    DASHBOARD_FILE,
    RULES_FILE,
    SCRAPE_FILE,
    alert_names,
    level_slo_s,
    render_rules,
    render_scrape_config,
    write_observability,
)

GW = 'job="tidegate-gateway"'
WK = 'job="tidegate-workers"'
ALERTS = {
    "TidegateLatencyOverSlo",
    "TidegateBacklogWithoutScaleUp",
    "TidegateAutoscalingSignalMissing",
    "TidegateReplicasFlapping",
    "TidegateColdStartOverBudget",
    "TidegateServerErrors",
    "TidegateHighPriorityShed",
    "TidegateWorkerRestarts",
}


@pytest.fixture
def config(tmp_path: Path) -> TidegateConfig:
    return load(tmp_path)


# ----------------------------------------------------------------------------- files


def test_cli_writes_rules_dashboard_and_scrape_config_that_promtool_accepts(
    tmp_path: Path,
) -> None:
    load(tmp_path)  # writes tidegate.yaml and its profile
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        ["observability", "render", "--config", str(tmp_path / "tidegate.yaml"), "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [RULES_FILE, DASHBOARD_FILE, SCRAPE_FILE]
    )
    checked = run_promtool("check", "rules", "--lint-fatal", RULES_FILE, cwd=out)
    assert "SUCCESS" in checked
    run_promtool("check", "config", SCRAPE_FILE, cwd=out)  # reads the rule file it names
    dashboard = json.loads((out / DASHBOARD_FILE).read_text())
    assert dashboard["uid"] == "tidegate"


def test_cli_reports_a_bad_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("gateway: {prot: 1}\n")
    result = CliRunner().invoke(
        app, ["observability", "render", "--config", str(bad), "--out", str(tmp_path)]
    )
    assert result.exit_code == 2
    assert "gateway.prot" in result.output


def test_embedded_default_renders_and_checks(tmp_path: Path) -> None:
    from tidegate.config import load_config

    write_observability(load_config(None), tmp_path)
    run_promtool("check", "rules", "--lint-fatal", RULES_FILE, cwd=tmp_path)
    run_promtool("check", "config", SCRAPE_FILE, cwd=tmp_path)


def test_rendering_depends_on_the_config_alone(config: TidegateConfig, tmp_path: Path) -> None:
    first = [p.read_bytes() for p in write_observability(config, tmp_path / "a")]
    second = [p.read_bytes() for p in write_observability(config, tmp_path / "b")]
    assert first == second


def test_every_alert_is_rendered_with_its_doctor_rule_and_fix(config: TidegateConfig) -> None:
    rules = render_rules(config)
    assert alert_names(rules) == ALERTS
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            notes = rule["annotations"]
            assert notes["summary"], rule["alert"]
            assert notes["description"], rule["alert"]
            assert "tidegate doctor (rule" in notes["description"], rule["alert"]
            assert notes["doctor"], rule["alert"]
            assert rule["labels"]["severity"] in ("critical", "warning")


def test_every_doctor_annotation_names_doctor_rules(config: TidegateConfig) -> None:
    from tidegate.core.diagnose import RULE_NAMES

    for group in render_rules(config)["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                named = rule["annotations"]["doctor"].split(",")
                assert set(named) <= set(RULE_NAMES), (rule["alert"], named)
                for name in named:
                    assert name in rule["annotations"]["description"], rule["alert"]


def test_slo_per_level_comes_from_the_config(config: TidegateConfig) -> None:
    chat, embed = config.models["chat"], config.models["embed"]
    assert level_slo_s(config, chat, "high") == HIGH_TIMEOUT_S  # its queue timeout
    # no timeout: the aging bound threshold + level / rate (30 s, 0.5 levels/s by default)
    assert level_slo_s(config, embed, "high") == 30.0
    assert level_slo_s(config, embed, "low") == 34.0
    slo_rules = [
        r
        for g in render_rules(config)["groups"]
        for r in g["rules"]
        if r.get("alert") == "TidegateLatencyOverSlo"
    ]
    assert len(slo_rules) == len(config.models) * len(config.levels)
    assert (
        f'model="chat",priority="high",phase="ttft"}} > {HIGH_TIMEOUT_S:g}' in slo_rules[0]["expr"]
    )


def test_scrape_config_reaches_workers_through_the_gateway(config: TidegateConfig) -> None:
    scrape = render_scrape_config(config)
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert jobs["tidegate-gateway"]["static_configs"] == [{"targets": ["127.0.0.1:8000"]}]
    sd = jobs["tidegate-workers"]["http_sd_configs"][0]
    assert sd["url"] == "http://127.0.0.1:8000/admin/prometheus/targets"
    assert jobs["tidegate-workers"]["honor_labels"] is True
    assert "authorization" not in jobs["tidegate-gateway"]  # no keys: an open service


def test_scrape_config_with_keys_sends_the_admin_key_as_bearer(tmp_path: Path) -> None:
    data = config_dict(write_profile(tmp_path / "profile.json"))
    data["keys"] = [{"name": "ops", "sha256": "0" * 64, "role": "admin"}]
    scrape = render_scrape_config(load(tmp_path, data))
    expected = {"type": "Bearer", "credentials_file": ADMIN_KEY_FILE}
    gateway, workers = scrape["scrape_configs"]
    assert gateway["authorization"] == expected
    assert workers["http_sd_configs"][0]["authorization"] == expected


# ----------------------------------------------------------------------------- dashboard


def test_dashboard_has_the_live_pages_panels_and_a_datasource_variable(
    config: TidegateConfig,
) -> None:
    dashboard = render_dashboard(config)
    assert dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    titles = " | ".join(p["title"] for p in dashboard["panels"]).lower()
    for words in (
        "requests per second",
        "queue depth",
        "time to first token p50 / p95 / p99",
        "end-to-end latency p50 / p95 / p99",
        "outcomes",
        "replicas by pool and state",
        "batch size distribution",
        "start-up, model load and cold start",
        "cpu and gpu utilisation per replica",
        "memory per replica",
    ):
        assert words in titles
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
    annotation = dashboard["annotations"]["list"][0]
    assert "tidegate_scale_events_total" in annotation["expr"]


def test_every_dashboard_query_parses(config: TidegateConfig, tmp_path: Path) -> None:
    queries = [e for _, e in panel_queries(render_dashboard(config))] + [SCALE_EVENTS_ANNOTATION]
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query{i}", "expr": grafana_to_promql(e)}
                    for i, e in enumerate(queries)
                ],
            }
        ]
    }
    (tmp_path / "queries.yaml").write_text(yaml.safe_dump(rules))
    run_promtool("check", "rules", "--lint-fatal", "queries.yaml", cwd=tmp_path)


# ----------------------------------------------------------------------------- alert unit tests


def bucket(le: str, values: str, model: str = "chat", priority: str = "high") -> tuple[str, str]:
    labels = f'{GW},model="{model}",priority="{priority}",phase="ttft",le="{le}"'
    return f"tidegate_request_duration_seconds_bucket{{{labels}}}", values


def slow_ttft(fast: str, slow: str) -> dict[str, str]:
    # ``fast`` requests per 15 s under 1 s, ``slow`` ones between 1 s and 3 s
    return dict(
        [
            bucket("1", f"0+{fast}x40"),
            bucket("3", f"0+{int(fast) + int(slow)}x40"),
            bucket("+Inf", f"0+{int(fast) + int(slow)}x40"),
        ]
    )


def requests(outcome: str, values: str, priority: str = "high") -> tuple[str, str]:
    labels = f'{GW},model="chat",priority="{priority}",outcome="{outcome}"'
    return f"tidegate_requests_total{{{labels}}}", values


def queue(values: str) -> tuple[str, str]:
    return f'tidegate_queue_depth{{{GW},model="chat",priority="low"}}', values


def desired(values: str) -> tuple[str, str]:
    return f'tidegate_desired_replicas{{{GW},model="chat"}}', values


def scale_events(direction: str, values: str) -> tuple[str, str]:
    labels = f'{GW},model="chat",direction="{direction}",reason="demand"'
    return f"tidegate_scale_events_total{{{labels}}}", values


def worker(metric: str, instance: str, values: str, extra: str = "") -> tuple[str, str]:
    labels = f'{WK},model="chat",replica="chat-0",instance="{instance}"{extra}'
    return f"{metric}{{{labels}}}", values


CHAT = {"model": "chat"}
CASES = [
    AlertCase(
        "p99 over the high level's SLO",
        "TidegateLatencyOverSlo",
        slow_ttft("0", "100"),  # every request between 1 and 3 s: P99 = 1 + 2 x 0.99
        "5m",
        [{**CHAT, "priority": "high", "phase": "ttft", "severity": "critical", "slo_s": "2"}],
        ["2.98"],
    ),
    AlertCase("p99 under the SLO", "TidegateLatencyOverSlo", slow_ttft("100", "0"), "5m"),
    AlertCase(
        "backlog grows, desired stays",
        "TidegateBacklogWithoutScaleUp",
        dict([queue("0+1x60"), desired("1x60")]),
        "10m",
        [{**CHAT, "severity": "critical"}],
        ["40"],
    ),
    AlertCase(
        "backlog grows, the autoscaler scaled up",
        "TidegateBacklogWithoutScaleUp",
        dict([queue("0+1x60"), desired("1x32 2x28")]),
        "10m",
    ),
    AlertCase(
        "backlog grows at max replicas",
        "TidegateBacklogWithoutScaleUp",
        dict([queue("0+1x60"), desired(f"{MAX_REPLICAS}x60")]),
        "10m",
    ),
    AlertCase(
        "signal absent",
        "TidegateAutoscalingSignalMissing",
        dict([queue("5x40")]),
        "6m",
        [{**CHAT, "job": "tidegate-gateway", "severity": "critical"}],
        ["1"],
    ),
    AlertCase(
        "signal stuck at 0 while requests queue",
        "TidegateAutoscalingSignalMissing",
        dict([queue("5x60"), (f'inference_queue_depth{{{GW},model="chat"}}', "0x60")]),
        "11m",
        [{**CHAT, "severity": "critical"}],
        ["0"],
    ),
    AlertCase(
        "signal present",
        "TidegateAutoscalingSignalMissing",
        dict([queue("5x60"), (f'inference_queue_depth{{{GW},model="chat"}}', "2x60")]),
        "11m",
    ),
    AlertCase(
        "up and down twice each",
        "TidegateReplicasFlapping",
        dict([scale_events("up", "0x4 1x4 2x40"), scale_events("down", "0x8 1x4 2x40")]),
        "5m",
        [{**CHAT, "severity": "warning"}],
    ),
    AlertCase(
        "two scale-ups, no scale-down",
        "TidegateReplicasFlapping",
        dict([scale_events("up", "0x4 1x4 2x40"), scale_events("down", "0x40")]),
        "5m",
    ),
    AlertCase(
        "slow cold start",
        "TidegateColdStartOverBudget",
        dict(
            [
                worker("tidegate_worker_startup_seconds", "w0", "45x20", ',phase="ready"'),
                worker("process_start_time_seconds", "w0", "0x20"),
            ]
        ),
        "2m",
        [{**CHAT, "severity": "warning", "budget_s": f"{COLD_START_S:g}"}],
        ["45.0"],
    ),
    AlertCase(
        "cold start within budget",
        "TidegateColdStartOverBudget",
        dict(
            [
                worker("tidegate_worker_startup_seconds", "w0", "12x20", ',phase="ready"'),
                worker("process_start_time_seconds", "w0", "0x20"),
            ]
        ),
        "2m",
    ),
    AlertCase(
        "slow start long ago",
        "TidegateColdStartOverBudget",
        dict(
            [
                worker("tidegate_worker_startup_seconds", "w0", "45x100", ',phase="ready"'),
                worker("process_start_time_seconds", "w0", "0x100"),
            ]
        ),
        "20m",
    ),
    AlertCase(
        "one request in ten fails",
        "TidegateServerErrors",
        dict([requests("completed", "0+90x40"), requests("failed", "0+10x40")]),
        "5m",
        [{**CHAT, "severity": "critical"}],
        ["10%"],
    ),
    AlertCase(
        "no failures",
        "TidegateServerErrors",
        dict([requests("completed", "0+90x40"), requests("failed", "0x40")]),
        "5m",
    ),
    AlertCase(
        "high requests refused",
        "TidegateHighPriorityShed",
        dict([requests("completed", "0+90x20"), requests("rejected_full", "0+6x20")]),
        "2m",
        [{**CHAT, "severity": "critical"}],
        ["0.40"],
    ),
    AlertCase(
        "only low requests shed",
        "TidegateHighPriorityShed",
        dict([requests("completed", "0+90x20"), requests("shed", "0+6x20", "low")]),
        "2m",
    ),
    AlertCase(
        "a worker restarted at a new address",
        "TidegateWorkerRestarts",
        dict(
            [
                worker("process_start_time_seconds", "127.0.0.1:9001", "100x10"),
                worker("process_start_time_seconds", "127.0.0.1:9002", "_x11 300x30"),
            ]
        ),
        "5m",
        [{**CHAT, "replica": "chat-0", "severity": "warning"}],
        ["1"],
    ),
    AlertCase(
        "a worker ran on",
        "TidegateWorkerRestarts",
        dict([worker("process_start_time_seconds", "127.0.0.1:9001", "100x40")]),
        "5m",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_alert_unit(case: AlertCase, config: TidegateConfig, tmp_path: Path) -> None:
    run_alert_case(case, render_rules(config), tmp_path)


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    firing = {c.alert for c in CASES if c.fires}
    silent = {c.alert for c in CASES if not c.fires}
    assert firing == silent == ALERTS
