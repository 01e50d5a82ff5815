"""What the observability tests share: a config with every kind of alert, and promtool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tidegate.config import TidegateConfig, load_config
from tidegate.ops.observability import RULES_FILE

HIGH_TIMEOUT_S = 2.0
COLD_START_S = 30.0
MAX_REPLICAS = 3
PROMTOOL_FIX = (
    "promtool (Debian's prometheus package) is not installed. Fix: make system-packages "
    "(or: sudo apt-get install -y --no-install-recommends prometheus)"
)


def write_profile(path: Path, latency_ms: float = 20.0) -> Path:
    path.write_text(
        json.dumps(
            {
                "version": 1,
                "model": "sim",
                "task": "embeddings",
                "memory_mb": 100,
                "embeddings": {"points": [{"batch_size": 1, "latency_ms": latency_ms}]},
            }
        )
    )
    return path


def config_dict(profile: Path) -> dict[str, object]:
    """An autoscaled model ``chat`` (high level's timeout set) and a static ``embed``."""
    common = {
        "task": "embeddings",
        "engine": "simulated",
        "profile": str(profile),
        "pools": ["shared"],
        "replicas": 1,
    }
    return {
        "pools": {"shared": {"priorities": ["high", "medium", "low"], "devices": ["cpu"]}},
        "models": [
            {
                "name": "chat",
                **common,
                "queue": {"timeout_s": {"high": HIGH_TIMEOUT_S}},
                "autoscaling": {
                    "min_replicas": 1,
                    "max_replicas": MAX_REPLICAS,
                    "target_per_replica": 4,
                    "cold_start_s": COLD_START_S,
                },
            },
            {"name": "embed", **common},
        ],
    }


def load(tmp_path: Path, data: dict[str, object] | None = None) -> TidegateConfig:
    profile = write_profile(tmp_path / "profile.json")
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump(data or config_dict(profile)))
    return load_config(path)


def grafana_to_promql(expr: str) -> str:
    """A dashboard query as Prometheus runs it: all models, a 1 m rate window."""
    return expr.replace("$__rate_interval", "1m").replace('"$model"', '".*"')


def promtool() -> str:
    found = shutil.which("promtool")
    assert found is not None, PROMTOOL_FIX
    return found


def run_promtool(*args: str, cwd: Path) -> str:
    """promtool ARGS; its output, or an assertion error that shows it."""
    done = subprocess.run(
        [promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


@dataclass(frozen=True)
class AlertCase:
    """One alert against one series set: the alerts expected at ``eval_time``."""

    name: str
    alert: str
    series: dict[str, str]
    eval_time: str
    fires: list[dict[str, str]] = field(default_factory=list)  # labels of each firing alert
    values: list[str] = field(default_factory=list)  # its $value as its annotations print it


_TEMPLATE = re.compile(r"\{\{\s*(\$labels\.(\w+)|\$value[^}]*)\s*\}\}")


def expand(text: str, labels: dict[str, str], value: str) -> str:
    """The alert's annotation as Prometheus prints it: its labels and its value."""
    return _TEMPLATE.sub(lambda m: labels[m.group(2)] if m.group(2) else value, text)


def annotations_of(rules: dict[str, Any], alert: str, labels: dict[str, str]) -> dict[str, str]:
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") != alert:
                continue
            if all(labels.get(k) == v for k, v in rule["labels"].items()):
                return dict(rule["annotations"])
    raise AssertionError(f"no {alert} rule with labels {labels}")


def run_alert_case(case: AlertCase, rules: dict[str, Any], folder: Path) -> None:
    """``promtool test rules``: ``case``'s alert fires exactly as it says over ``rules``."""
    (folder / RULES_FILE).write_text(yaml.safe_dump(rules, sort_keys=False))
    expected = []
    for labels, value in zip(case.fires, case.values or [""] * len(case.fires), strict=True):
        notes = annotations_of(rules, case.alert, labels)
        expected.append(
            {
                "exp_labels": labels,
                "exp_annotations": {k: expand(v, labels, value) for k, v in notes.items()},
            }
        )
    test = {
        "rule_files": [RULES_FILE],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [{"series": s, "values": v} for s, v in case.series.items()],
                "alert_rule_test": [
                    {"eval_time": case.eval_time, "alertname": case.alert, "exp_alerts": expected}
                ],
            }
        ],
    }
    (folder / "test.yaml").write_text(yaml.safe_dump(test, sort_keys=False))
    run_promtool("test", "rules", "test.yaml", cwd=folder)
