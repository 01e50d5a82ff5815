"""What ``tidegate k8s render`` adds for monitoring: monitors, a PrometheusRule, a dashboard.

No API server or Prometheus Operator runs here: the rule groups go through promtool, the
monitors are checked against the pods and Service the same render made (their selectors,
the annotations their relabelings read), the dashboard against its sidecar label.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ops.observability_fixtures import AlertCase, load, run_alert_case, run_promtool
from tidegate.config import load_config
from tidegate.control.k8s import MONITORING_FILE, Manifests, render_manifests, write_manifests
from tidegate.control.k8s_objects import RenderOptions
from tidegate.ops.grafana import render_dashboard
from tidegate.ops.observability import ScaleSource, alert_names, render_rules

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "autoscaling.yaml"
NAMESPACE = "inference"


@pytest.fixture(params=[False, True], ids=["hpa", "keda"])
def manifests(request: pytest.FixtureRequest) -> Manifests:
    return render_manifests(
        load_config(EXAMPLE), RenderOptions(namespace=NAMESPACE, keda=request.param)
    )


def one(manifests: Manifests, kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d
        for d in manifests.documents
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_prometheus_rule_holds_the_rendered_rules_and_promtool_accepts_them(
    manifests: Manifests, tmp_path: Path
) -> None:
    rule = one(manifests, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert alert_names(rule["spec"]) == alert_names(render_rules(load_config(EXAMPLE)))
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    run_promtool("check", "rules", "--lint-fatal", "rules.yaml", cwd=tmp_path)


def test_rules_read_the_hpas_wish_in_a_cluster(manifests: Manifests) -> None:
    """No tidegate autoscaler runs there: the desired count is the HPA's, by its name."""
    hpas = {
        d["metadata"]["name"]
        for d in manifests.documents
        if d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")
    }
    records = [
        r["expr"]
        for g in one(manifests, "PrometheusRule")["spec"]["groups"]
        for r in g["rules"]
        if r.get("record") == "tidegate:desired_replicas"
    ]
    assert records
    assert all("kube_horizontalpodautoscaler_status_desired_replicas" in e for e in records)
    named = {e.split('horizontalpodautoscaler="')[1].split('"')[0] for e in records}
    assert named == hpas


def test_pod_monitor_selects_every_worker_and_reads_annotations_they_carry(
    manifests: Manifests,
) -> None:
    monitor = one(manifests, "PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    deployments = [d for d in manifests.documents if d["kind"] == "Deployment"]
    selected = [
        d for d in deployments if matches(selector, d["spec"]["template"]["metadata"]["labels"])
    ]
    assert {d["metadata"]["name"] for d in selected} == {
        d["metadata"]["name"] for d in deployments if d["metadata"]["name"] != "tidegate-gateway"
    }
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert relabel["job"]["replacement"] == "tidegate-workers"
    assert relabel["replica"]["sourceLabels"] == ["__meta_kubernetes_pod_name"]
    for deployment in selected:
        template = deployment["spec"]["template"]
        port_names = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
        assert endpoint["port"] in port_names
        for label in ("model", "pool"):
            (source,) = relabel[label]["sourceLabels"]
            keys = [
                k
                for k in template["metadata"]["annotations"]
                if source
                == "__meta_kubernetes_pod_annotation_"
                + "".join(c if c.isalnum() else "_" for c in k)
            ]
            assert keys, f"{deployment['metadata']['name']} has no annotation for {label}"
    models = {
        d["spec"]["template"]["metadata"]["annotations"]["tidegate.io/model-name"] for d in selected
    }
    assert models == {m.name for m in load_config(EXAMPLE).models.values() if m.local}


def test_service_monitor_selects_the_gateway_service_only(manifests: Manifests) -> None:
    monitor = one(manifests, "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [d for d in manifests.documents if d["kind"] == "Service"]
    selected = [
        s["metadata"]["name"] for s in services if matches(selector, s["metadata"]["labels"])
    ]
    assert selected == ["tidegate-gateway"]
    endpoint = monitor["spec"]["endpoints"][0]
    gateway = one(manifests, "Service", "tidegate-gateway")
    assert endpoint["port"] in {p["name"] for p in gateway["spec"]["ports"]}
    assert endpoint["relabelings"][0]["replacement"] == "tidegate-gateway"


def test_dashboard_config_map_is_labelled_for_the_grafana_sidecar(manifests: Manifests) -> None:
    config_map = one(manifests, "ConfigMap", "tidegate-grafana-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = config_map["data"].values()
    assert json.loads(text) == render_dashboard(load_config(EXAMPLE))


def test_monitoring_objects_go_to_their_own_file(manifests: Manifests, tmp_path: Path) -> None:
    write_manifests(manifests, tmp_path)
    docs = list(yaml.safe_load_all((tmp_path / MONITORING_FILE).read_text()))
    assert sorted(d["kind"] for d in docs) == [
        "ConfigMap",
        "PodMonitor",
        "PrometheusRule",
        "ServiceMonitor",
    ]


# ----------------------------------------------------------------------------- HPA-read alerts

HPA = "tidegate-chat-shared"


def hpa_desired(values: str) -> dict[str, str]:
    labels = f'namespace="{NAMESPACE}",horizontalpodautoscaler="{HPA}"'
    return {f"kube_horizontalpodautoscaler_status_desired_replicas{{{labels}}}": values}


def queued(values: str) -> dict[str, str]:
    return {'tidegate_queue_depth{job="tidegate-gateway",model="chat",priority="low"}': values}


CHAT = {"model": "chat"}
K8S_CASES = [
    AlertCase(
        "the HPA's count goes up and down twice",
        "TidegateReplicasFlapping",
        hpa_desired("1x4 2x4 1x4 2x4 1x20"),
        "6m",
        [{**CHAT, "severity": "warning"}],
    ),
    AlertCase(
        "the HPA scales up twice",
        "TidegateReplicasFlapping",
        hpa_desired("1x4 2x4 3x30"),
        "6m",
    ),
    AlertCase(
        "backlog grows, the HPA stays",
        "TidegateBacklogWithoutScaleUp",
        {**queued("0+1x60"), **hpa_desired("1x60")},
        "10m",
        [{**CHAT, "severity": "critical"}],
        ["40"],
    ),
    AlertCase(
        "backlog grows, the HPA scaled up",
        "TidegateBacklogWithoutScaleUp",
        {**queued("0+1x60"), **hpa_desired("1x32 2x28")},
        "10m",
    ),
]


@pytest.mark.parametrize("case", K8S_CASES, ids=[c.name for c in K8S_CASES])
def test_alert_unit_on_the_hpas_series(case: AlertCase, tmp_path: Path) -> None:
    rules = render_rules(load(tmp_path), ScaleSource(NAMESPACE, (("chat", HPA),)))
    run_alert_case(case, rules, tmp_path)
