"""``tidegate k8s render``: every manifest valid against the Kubernetes schemas (strict), the
semantics no schema checks, and an HPA that scales exactly as tidegate's own autoscaler.

No API server runs here: validity is kubernetes-validate's bundled OpenAPI schemas plus the
checks below; KEDA's CRD is not among those schemas, so ScaledObjects get our own checks
(and their ``behavior`` the HPA schema).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import re
import zoneinfo
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import httpx
import kubernetes_validate
import pytest
import yaml
from typer.main import get_command
from typer.testing import CliRunner

from tests.procs import DEADLINE_S, wait_for, worker_process
from tidegate.cli import app
from tidegate.config import TidegateConfig, load_config, parse_config
from tidegate.control import k8s_scaling
from tidegate.control.k8s import (
    MONITORING_KINDS,
    Manifests,
    drain_worker,
    grace_period_s,
    render_manifests,
)
from tidegate.control.k8s_objects import WORKER_PORT, RenderOptions, dns_name
from tidegate.core.autoscale import (
    DEFAULT_SCALE_UP,
    HPA_DEFAULT_SCALE_DOWN,
    AutoscaleConfig,
    DemandSample,
    ScaleInputs,
    ScaleState,
    ScalingPolicy,
    ScalingRules,
    Schedule,
    decide_scale,
    replay_scale,
)
from tidegate.errors import ConfigError, NotReady
from tidegate.gateway.forward import outcome_of as _outcome_of
from tidegate.gateway.observe import ARRIVALS
from tidegate.metrics import GatewayMetrics

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
NAMESPACE = "inference"
CASES = [(path, keda) for path in EXAMPLES for keda in (False, True)]


def case_id(case: tuple[Path, bool]) -> str:
    return f"{case[0].stem}-{'keda' if case[1] else 'hpa'}"


def render(config: TidegateConfig, *, keda: bool = False) -> Manifests:
    return render_manifests(config, RenderOptions(namespace=NAMESPACE, keda=keda))


def kind(manifests: Manifests, name: str) -> list[dict[str, Any]]:
    return [doc for doc in manifests.documents if doc["kind"] == name]


def workers(manifests: Manifests) -> list[dict[str, Any]]:
    return [d for d in kind(manifests, "Deployment") if d["metadata"]["name"] != "tidegate-gateway"]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


@pytest.fixture(params=CASES, ids=case_id)
def rendered(request: pytest.FixtureRequest) -> tuple[TidegateConfig, Manifests]:
    path, keda = request.param
    config = load_config(path)
    return config, render(config, keda=keda)


def test_examples_include_autoscaling() -> None:
    assert "autoscaling.yaml" in {path.name for path in EXAMPLES}


# ----------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_strictly(
    rendered: tuple[TidegateConfig, Manifests], version: str
) -> None:
    _, manifests = rendered
    for doc in manifests.documents:
        if doc["kind"] == "ScaledObject":
            check_scaled_object(doc, manifests, version)
        elif doc["kind"] in MONITORING_KINDS:
            continue  # the Prometheus Operator's CRDs: tests/ops/test_observability_k8s.py
        else:
            kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_catches_an_unknown_field() -> None:
    # The check above can fail: an extra field is refused in strict mode.
    manifests = render(load_config(REPO / "examples" / "pools.yaml"))
    deployment = workers(manifests)[0]
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


SCALED_OBJECT_SPEC = {
    "scaleTargetRef",
    "pollingInterval",
    "cooldownPeriod",
    "idleReplicaCount",
    "minReplicaCount",
    "maxReplicaCount",
    "advanced",
    "triggers",
    "fallback",
}
TRIGGER_KEYS = {"type", "name", "metadata", "metricType", "authenticationRef", "useCachedMetrics"}
CRON_RE = re.compile(r"^([0-5]?\d) ([01]?\d|2[0-3]) \* \* (\*|[0-6](,[0-6])*)$")


def check_scaled_object(doc: dict[str, Any], manifests: Manifests, version: str) -> None:
    """KEDA v2's ScaledObject, as its CRD and admission webhook would see it."""
    assert doc["apiVersion"] == "keda.sh/v1alpha1"
    assert set(doc["metadata"]) == {"name", "namespace", "labels"}
    spec = doc["spec"]
    assert set(spec) <= SCALED_OBJECT_SPEC
    target = spec["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
    deployment = next(d for d in workers(manifests) if d["metadata"]["name"] == target["name"])
    assert "replicas" not in deployment["spec"]  # KEDA owns the count
    assert isinstance(spec["pollingInterval"], int)
    assert spec["pollingInterval"] >= 1
    low, high = spec["minReplicaCount"], spec["maxReplicaCount"]
    assert 0 <= low <= high
    if "idleReplicaCount" in spec:
        assert 0 <= spec["idleReplicaCount"] < low
    if "cooldownPeriod" in spec:
        assert isinstance(spec["cooldownPeriod"], int)
        assert spec["cooldownPeriod"] >= 0
    hpa_config = spec["advanced"]["horizontalPodAutoscalerConfig"]
    assert set(spec["advanced"]) == {"horizontalPodAutoscalerConfig"}
    assert set(hpa_config) == {"name", "behavior"}
    # The behavior is the HPA's own type: the HPA schema checks it.
    hpa = k8s_scaling.render_hpa(AutoscaleConfig(), _target(target["name"]))
    hpa["spec"]["behavior"] = hpa_config["behavior"]
    kubernetes_validate.validate(hpa, version, strict=True)
    check_behavior(hpa_config["behavior"])
    for trigger in spec["triggers"]:
        assert set(trigger) <= TRIGGER_KEYS
        metadata = trigger["metadata"]
        assert all(isinstance(v, str) for v in metadata.values()), metadata  # map[string]string
        if trigger["type"] == "prometheus":
            assert trigger["metricType"] == "AverageValue"
            assert set(metadata) == {
                "serverAddress",
                "query",
                "threshold",
                "activationThreshold",
                "ignoreNullValues",
            }
            assert float(metadata["threshold"]) > 0
            assert float(metadata["activationThreshold"]) >= 0
            assert metadata["ignoreNullValues"] in ("true", "false")
            assert f'namespace="{NAMESPACE}"' in metadata["query"]
        else:
            assert trigger["type"] == "cron"
            assert set(metadata) == {"timezone", "start", "end", "desiredReplicas"}
            zoneinfo.ZoneInfo(metadata["timezone"])
            assert CRON_RE.match(metadata["start"])
            assert CRON_RE.match(metadata["end"])
            assert metadata["start"] != metadata["end"]  # KEDA refuses equal ones
            assert 0 <= int(metadata["desiredReplicas"]) <= high


def _target(deployment: str) -> k8s_scaling.ScaleTarget:
    return k8s_scaling.ScaleTarget("m", deployment, NAMESPACE, {}, "models[0].autoscaling", "t")


# ----------------------------------------------------------------------------- semantics


def check_behavior(behavior: dict[str, Any]) -> None:
    """What the schema leaves to the API server's validation: enum values and bounds."""
    assert set(behavior) == {"scaleUp", "scaleDown"}
    for rules in behavior.values():
        assert rules["selectPolicy"] in ("Max", "Min", "Disabled")
        assert 0 <= rules["stabilizationWindowSeconds"] <= 3600
        assert rules["policies"]
        for policy in rules["policies"]:
            assert policy["type"] in ("Pods", "Percent")
            assert policy["value"] > 0
            assert 0 < policy["periodSeconds"] <= 1800


def test_requests_equal_limits(rendered: tuple[TidegateConfig, Manifests]) -> None:
    _, manifests = rendered
    for deployment in kind(manifests, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            resources = container["resources"]
            assert resources["requests"] == resources["limits"]
            assert {"cpu", "memory"} <= set(resources["requests"])


def test_workers_probe_warm_up_and_drain_within_their_grace(
    rendered: tuple[TidegateConfig, Manifests],
) -> None:
    config, manifests = rendered
    for deployment in workers(manifests):
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        model = config.model(deployment["metadata"]["labels"]["tidegate.io/model"])
        assert container["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
        assert container["ports"] == [{"name": "http", "containerPort": WORKER_PORT}]
        drain = container["lifecycle"]["preStop"]["exec"]["command"]
        assert drain[:3] == ["tidegate", "k8s", "drain"]
        timeout_s = float(drain[drain.index("--timeout-s") + 1])
        assert timeout_s == model.drain_timeout_s
        assert pod["terminationGracePeriodSeconds"] >= timeout_s + 10  # + the worker's exit
        assert pod["terminationGracePeriodSeconds"] == grace_period_s(model.drain_timeout_s)
        volume = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert volume["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_selectors_match_their_pods_and_only_theirs(
    rendered: tuple[TidegateConfig, Manifests],
) -> None:
    _, manifests = rendered
    deployments = kind(manifests, "Deployment")
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in deployments}
    for deployment in deployments:
        selector = deployment["spec"]["selector"]["matchLabels"]
        name = deployment["metadata"]["name"]
        assert [n for n, labels in pods.items() if matches(selector, labels)] == [name]
    for pdb in kind(manifests, "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert [n for n, labels in pods.items() if matches(selector, labels)] == [
            pdb["metadata"]["name"]
        ]
        assert pdb["spec"]["maxUnavailable"] == 1
    for service in kind(manifests, "Service"):
        selected = [n for n, labels in pods.items() if matches(service["spec"]["selector"], labels)]
        assert selected, service["metadata"]["name"]
        models = {pods[n].get("tidegate.io/model", "gateway") for n in selected}
        assert len(models) == 1  # a Service reaches one model's pods


def test_autoscalers_target_rendered_deployments(
    rendered: tuple[TidegateConfig, Manifests],
) -> None:
    config, manifests = rendered
    by_name = {d["metadata"]["name"]: d for d in workers(manifests)}
    scalers = kind(manifests, "HorizontalPodAutoscaler") + kind(manifests, "ScaledObject")
    autoscaled = {name for name, m in config.models.items() if m.autoscaling is not None}
    assert {s["metadata"]["labels"]["tidegate.io/model"] for s in scalers} == autoscaled
    for scaler in scalers:
        deployment = by_name[scaler["spec"]["scaleTargetRef"]["name"]]
        assert "replicas" not in deployment["spec"]  # re-applying must not fight the scaler
    for hpa in kind(manifests, "HorizontalPodAutoscaler"):
        spec = hpa["spec"]
        check_behavior(spec["behavior"])
        assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
        (metric,) = spec["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["target"]["type"] == "AverageValue"
        assert metric["external"]["metric"]["name"] in adapter_metric_names(manifests)
    for deployment in by_name.values():
        model = config.model(deployment["metadata"]["labels"]["tidegate.io/model"])
        if model.autoscaling is None:
            pool = deployment["metadata"]["labels"]["tidegate.io/pool"]
            assert deployment["spec"]["replicas"] == model.replicas[pool]


def adapter_metric_names(manifests: Manifests) -> set[str]:
    return {rule["name"]["as"] for rule in adapter_rules(manifests)}


def adapter_rules(manifests: Manifests) -> list[dict[str, Any]]:
    maps = [c for c in kind(manifests, "ConfigMap") if "adapter" in c["metadata"]["name"]]
    rules: list[dict[str, Any]] = yaml.safe_load(maps[0]["data"]["config.yaml"])["externalRules"]
    return rules


def test_adapter_rules_read_the_gateways_real_gauge() -> None:
    manifests = render(load_config(REPO / "examples" / "autoscaling.yaml"))
    exported = {metric.name for metric in GatewayMetrics().registry.collect()}
    read = set()
    for rule in adapter_rules(manifests):
        metric = rule["name"]["matches"].strip("^$")
        assert rule["seriesQuery"].startswith(f"{metric}{{")
        assert rule["metricsQuery"].startswith("sum(")
        read.add(metric)
    # The example sizes chat on the queue's gauge and embed on the arrival counter.
    assert read == {k8s_scaling.METRIC, k8s_scaling.RATE_METRIC}
    assert k8s_scaling.METRIC in exported
    assert f"{ARRIVALS}_total" == k8s_scaling.RATE_METRIC  # gateway/observe.py's collector
    # The wake-from-zero trigger counts what a request to a model with no replica gets.
    assert "tidegate_requests" in exported
    assert _outcome_of(NotReady("no replica", code="no_ready_replica")) == (
        k8s_scaling.REJECTED_OUTCOME
    )


def test_gateway_config_points_every_model_at_its_service(
    rendered: tuple[TidegateConfig, Manifests],
) -> None:
    config, manifests = rendered
    config_map = next(
        c
        for c in kind(manifests, "ConfigMap")
        if c["metadata"]["name"] == "tidegate-gateway-config"
    )
    cluster = parse_config(yaml.safe_load(config_map["data"]["config.yaml"]), "<configmap>")
    services = {s["metadata"]["name"]: s for s in kind(manifests, "Service")}
    assert cluster.gateway.host == "0.0.0.0"
    assert cluster.devices == ()
    for name, model in cluster.models.items():
        original = config.model(name)
        assert model.engine == "openai"
        assert model.autoscaling is None
        if not original.local:
            assert model.upstreams == original.upstreams
            assert model.upstream_workers == original.upstream_workers
            continue
        assert model.upstream_workers  # behind the Service: tidegate workers, sent the tenant
        (url,) = model.upstreams
        host, port = url.removeprefix("http://").split(":")
        service, namespace = host.split(".")[:2]
        assert namespace == NAMESPACE
        assert services[service]["spec"]["ports"][0]["port"] == int(port)
        assert services[service]["spec"]["selector"]["tidegate.io/model"] == dns_name(name)
        assert model.slots is not None
        assert model.slots >= 1
    gateway = next(
        d for d in kind(manifests, "Deployment") if d["metadata"]["name"] == "tidegate-gateway"
    )
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    assert container["ports"][0]["containerPort"] == cluster.gateway.port
    assert services["tidegate-gateway"]["spec"]["ports"][0]["port"] == cluster.gateway.port


def test_names_are_dns_labels(rendered: tuple[TidegateConfig, Manifests]) -> None:
    _, manifests = rendered
    for doc in manifests.documents:
        name = doc["metadata"]["name"]
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)
        assert len(name) <= 63
        assert doc["metadata"]["namespace"] == NAMESPACE


def test_dns_name_keeps_distinct_names_distinct() -> None:
    assert dns_name("tidegate", "minilm", "shared") == "tidegate-minilm-shared"
    assert dns_name("tidegate", "a.b") != dns_name("tidegate", "a_b")
    long = dns_name("tidegate", "m" * 80)
    assert len(long) <= 63
    assert long != dns_name("tidegate", "m" * 81)


# ----------------------------------------------------------------------------- commands


def test_command_lines_parse_with_the_real_cli(rendered: tuple[TidegateConfig, Manifests]) -> None:
    _, manifests = rendered
    cli = get_command(app)
    for deployment in kind(manifests, "Deployment"):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        lines = [container["command"] + container["args"]]
        if "exec" in container["lifecycle"]["preStop"]:
            hook = container["lifecycle"]["preStop"]["exec"]["command"]
            lines += [hook] if hook[0] == "tidegate" else []
        for line in lines:
            assert line[0] == "tidegate"
            parse_command_line(cli, line[1:])


def parse_command_line(cli: click.Command, args: list[str]) -> None:
    """Parse ``args`` as the real CLI would (an unknown option fails), without running it."""
    command, name, context = cli, "tidegate", None
    while isinstance(command, click.Group):
        context = click.Context(command, info_name=name, parent=context)
        found, sub, args = command.resolve_command(context, args)
        assert found is not None, args
        assert sub is not None, args
        command, name = sub, found
    command.make_context(name, list(args), parent=context)


def test_worker_command_carries_the_model_and_listens_on_every_address() -> None:
    config = load_config(REPO / "examples" / "autoscaling.yaml")
    manifests = render(config)
    chat = next(d for d in workers(manifests) if d["metadata"]["name"] == "tidegate-chat-dedicated")
    args = chat["spec"]["template"]["spec"]["containers"][0]["args"]
    option = {args[i]: args[i + 1] for i in range(1, len(args) - 1) if args[i].startswith("--")}
    assert args[0] == "worker"
    assert (option["--model"], option["--engine"], option["--task"]) == (
        "chat",
        "simulated",
        "generate",
    )
    assert (option["--host"], option["--port"], option["--device"]) == ("0.0.0.0", "8080", "cuda:0")
    assert option["--max-num-seqs"] == "16"


@pytest.mark.parametrize(
    ("example", "deployment", "expected"),
    [
        ("autoscaling", "tidegate-chat-dedicated", {"nvidia.com/gpu": "1"}),
        (
            "autoscaling",
            "tidegate-embed-shared",
            {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "2048"},
        ),
        ("pools", "tidegate-minilm-shared", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "550"}),
        ("embedded", "tidegate-minilm-shared", {}),
    ],
)
def test_gpu_asks(example: str, deployment: str, expected: dict[str, str]) -> None:
    manifests = render(load_config(REPO / "examples" / f"{example}.yaml"))
    found = next(d for d in workers(manifests) if d["metadata"]["name"] == deployment)
    limits = found["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert {k: v for k, v in limits.items() if k.startswith("nvidia.com/")} == expected


# ----------------------------------------------------------------------------- fidelity


def parse_quantity(text: str) -> float:
    scales = {"m": 1e3, "u": 1e6, "n": 1e9}
    return int(text[:-1]) / scales[text[-1]] if text[-1] in scales else float(text)


@pytest.mark.parametrize(
    ("value", "text"),
    [(12, "12"), (0.5, "500m"), (273.55, "273550m"), (0.0005, "500u"), (0.1234567, "123456700n")],
)
def test_quantities_keep_the_value_whole(value: float, text: str) -> None:
    assert k8s_scaling.quantity(value) == text
    assert parse_quantity(text) == pytest.approx(value)


def rules_from_behavior(rules: dict[str, Any]) -> ScalingRules:
    """An HPA direction read back into the core's type, independently of the renderer."""
    kinds = {"Pods": "pods", "Percent": "percent"}
    tolerance = rules.get("tolerance")
    return ScalingRules(
        stabilization_window_s=float(rules["stabilizationWindowSeconds"]),
        policies=tuple(
            ScalingPolicy(kinds[p["type"]], p["value"], float(p["periodSeconds"]))
            for p in rules["policies"]
        ),
        select_policy=rules["selectPolicy"].lower(),
        tolerance=None if tolerance is None else parse_quantity(tolerance),
    )


def config_from_hpa(hpa: dict[str, Any], rules: list[dict[str, Any]]) -> AutoscaleConfig:
    """What the HPA will do, as an AutoscaleConfig: bounds, target, averaging, behavior."""
    spec = hpa["spec"]
    external = spec["metrics"][0]["external"]
    rule = next((r for r in rules if r["name"]["as"] == external["metric"]["name"]), None)
    window = None if rule is None else re.search(r"\[(\d+)s\]", rule["metricsQuery"])
    return AutoscaleConfig(
        min_replicas=spec["minReplicas"],
        max_replicas=spec["maxReplicas"],
        target_per_replica=parse_quantity(external["target"]["averageValue"]),
        tolerance=k8s_scaling.HPA_DEFAULT_TOLERANCE,
        stable_window_s=float(window.group(1)) if window else 0.0,
        scale_up=rules_from_behavior(spec["behavior"]["scaleUp"]),
        scale_down=rules_from_behavior(spec["behavior"]["scaleDown"]),
    )


def config_from_scaled_object(scaled: dict[str, Any]) -> AutoscaleConfig:
    spec = scaled["spec"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    demand = next(t for t in spec["triggers"] if t.get("name") == "demand")["metadata"]
    window = re.search(r"\[(\d+)s\]", demand["query"])
    return AutoscaleConfig(
        min_replicas=max(1, spec["minReplicaCount"]),  # the HPA KEDA makes keeps 1 when active
        max_replicas=spec["maxReplicaCount"],
        target_per_replica=float(demand["threshold"]),
        tolerance=k8s_scaling.HPA_DEFAULT_TOLERANCE,
        stable_window_s=float(window.group(1)) if window else 0.0,
        scale_up=rules_from_behavior(behavior["scaleUp"]),
        scale_down=rules_from_behavior(behavior["scaleDown"]),
    )


def hpa_part(config: AutoscaleConfig) -> AutoscaleConfig:
    """The features an HPA has: no panic window, no schedules, never below 1."""
    return dataclasses.replace(
        config,
        panic_threshold=None,
        schedules=(),
        scale_to_zero=False,
        min_replicas=max(1, config.min_replicas),
    )


def demand_series(seconds: int = 6 * 3600, step_s: int = 15) -> list[tuple[float, float | None]]:
    """A tidal load: a 4x swell, a flash crowd, flapping around the target, a quiet spell
    and a metrics outage (None), sampled every HPA sync period."""
    points: list[tuple[float, float | None]] = []
    for t in range(0, seconds, step_s):
        base = 40 + 30 * math.sin(2 * math.pi * t / (3 * 3600))
        if 3600 <= t < 3900:
            base *= 5  # flash crowd
        if 7200 <= t < 9000:
            base = 24 + (8 if (t // 60) % 2 else -8)  # flapping every minute
        if 12000 <= t < 13800:
            base = 0.0
        points.append((float(t), None if 15000 <= t < 15300 else round(base, 1)))
    return points


SCALED_CONFIGS = {
    "hpa_defaults": {"max_replicas": 20, "target_per_replica": 8, "stable_window_s": 0},
    "tidegate_defaults": {"max_replicas": 20, "target_per_replica": 8},
    "select_min_both_ways": {
        "min_replicas": 2,
        "max_replicas": 12,
        "target_per_replica": 5,
        "stable_window_s": 30,
        "scale_up": {
            "stabilization_window_s": 60,
            "select_policy": "min",
            "policies": [
                {"type": "pods", "value": 2, "period_s": 30},
                {"type": "percent", "value": 50, "period_s": 60},
            ],
        },
        "scale_down": {
            "stabilization_window_s": 300,
            "select_policy": "min",
            "policies": [
                {"type": "pods", "value": 3, "period_s": 60},
                {"type": "percent", "value": 20, "period_s": 120},
            ],
        },
    },
    "scale_down_disabled": {
        "max_replicas": 30,
        "target_per_replica": 3,
        "tolerance": 0.05,
        "scale_down": {"select_policy": "disabled"},
    },
}


def scaled_model(autoscaling: dict[str, Any]) -> TidegateConfig:
    model = {"name": "sim", "task": "embeddings", "engine": "simulated"}
    return parse_config({"models": [{**model, "autoscaling": autoscaling}]}, "<fidelity>")


def fidelity_cases() -> Iterator[Any]:
    for name, autoscaling in SCALED_CONFIGS.items():
        yield pytest.param(scaled_model(autoscaling), id=name)
    yield pytest.param(load_config(REPO / "examples" / "autoscaling.yaml"), id="example")


@pytest.mark.parametrize("config", list(fidelity_cases()))
def test_rendered_hpa_scales_as_the_builtin_autoscaler(config: TidegateConfig) -> None:
    manifests = render(config)
    points = demand_series()
    for hpa in kind(manifests, "HorizontalPodAutoscaler"):
        model = config.model(hpa["metadata"]["labels"]["tidegate.io/model"])
        assert model.autoscaling is not None
        ours = hpa_part(model.autoscaling)
        theirs = config_from_hpa(hpa, adapter_rules(manifests))
        assert theirs.tolerances() == ours.tolerances()
        if ours.target_rate_per_replica is not None:
            assert_rate_replays_alike(ours, theirs)
            continue
        for attribute in ("min_replicas", "max_replicas", "target_per_replica", "stable_window_s"):
            assert getattr(theirs, attribute) == getattr(ours, attribute)
        series = replay_scale(points, ours, initial_replicas=ours.min_replicas)
        assert replay_scale(points, theirs, initial_replicas=ours.min_replicas) == series
        assert len(set(series)) > 2, "the load must move the count for the check to mean much"


@pytest.mark.parametrize("config", list(fidelity_cases()))
def test_keda_scales_as_the_builtin_autoscaler(config: TidegateConfig) -> None:
    manifests = render(config, keda=True)
    points = demand_series()
    for scaled in kind(manifests, "ScaledObject"):
        model = config.model(scaled["metadata"]["labels"]["tidegate.io/model"])
        assert model.autoscaling is not None
        ours = hpa_part(model.autoscaling)
        theirs = config_from_scaled_object(scaled)
        if ours.target_rate_per_replica is not None:
            assert_rate_replays_alike(ours, theirs)
            continue
        series = replay_scale(points, ours, initial_replicas=ours.min_replicas)
        assert replay_scale(points, theirs, initial_replicas=ours.min_replicas) == series
        if model.autoscaling.scale_to_zero:
            # Idle for the scale-down window: zero, in both.
            window = model.autoscaling.scale_down.stabilization_window_s
            assert scaled["spec"]["cooldownPeriod"] == window


def test_behavior_with_a_tolerance_renders_it_per_direction() -> None:
    config = scaled_model(SCALED_CONFIGS["scale_down_disabled"])
    (hpa,) = kind(render(config), "HorizontalPodAutoscaler")
    behavior = hpa["spec"]["behavior"]
    assert behavior["scaleUp"]["tolerance"] == behavior["scaleDown"]["tolerance"] == "50m"
    assert behavior["scaleDown"]["selectPolicy"] == "Disabled"
    kubernetes_validate.validate(hpa, VERSIONS[-1], strict=True)  # a field since 1.33


def _rules_description(field: str) -> str:
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    folder = schemas / f"v{kubernetes_validate.latest_version()}-local-strict"
    definitions = json.loads((folder / "_definitions.json").read_text())["$defs"]
    description: str = definitions["io.k8s.api.autoscaling.v2.HPAScalingRules"]["properties"][
        field
    ]["description"]
    return description


def test_defaults_are_the_documented_hpa_defaults() -> None:
    # The HPA's API documents its defaults; the core's constants must say the same.
    policies = _rules_description("policies")
    scale_up = "For scale up: allow doubling the number of pods, or an absolute change of 4 pods"
    assert f"{scale_up} in a 15s window" in policies
    assert "For scale down: allow all pods to be removed in a 15s window" in policies
    windows = _rules_description("stabilizationWindowSeconds")
    assert "For scale up: 0" in windows
    assert "For scale down: 300" in windows
    assert "If not set, the default value Max is used" in _rules_description("selectPolicy")
    assert (
        ScalingRules(
            0.0, (ScalingPolicy("percent", 100, 15.0), ScalingPolicy("pods", 4, 15.0)), "max"
        )
        == DEFAULT_SCALE_UP
    )
    assert (
        ScalingRules(300.0, (ScalingPolicy("percent", 100, 15.0),), "max") == HPA_DEFAULT_SCALE_DOWN
    )
    # Rendered, they are exactly what the API server would default an omitted field to.
    config = scaled_model(
        {
            "max_replicas": 10,
            "target_per_replica": 4,
            "scale_down": {
                "stabilization_window_s": 300,
                "policies": [{"type": "percent", "value": 100, "period_s": 15}],
            },
        }
    )
    (hpa,) = kind(render(config), "HorizontalPodAutoscaler")
    assert hpa["spec"]["behavior"] == {
        "scaleUp": {
            "stabilizationWindowSeconds": 0,
            "selectPolicy": "Max",
            "policies": [
                {"type": "Percent", "value": 100, "periodSeconds": 15},
                {"type": "Pods", "value": 4, "periodSeconds": 15},
            ],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": 300,
            "selectPolicy": "Max",
            "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}],
        },
    }


def test_hpa_docs_scale_down_example_through_the_rendered_behavior() -> None:
    # kubernetes.io, HPA "Scaling Policies": Pods 4 and Percent 10 per 60 s, Max: 10% while
    # that is more than 4 pods (80 -> 72 -> 64 ...), then 4 pods a minute.
    config = scaled_model(
        {
            "max_replicas": 100,
            "target_per_replica": 1,
            "stable_window_s": 0,
            "scale_down": {
                "stabilization_window_s": 0,
                "policies": [
                    {"type": "pods", "value": 4, "period_s": 60},
                    {"type": "percent", "value": 10, "period_s": 60},
                ],
            },
        }
    )
    (hpa,) = kind(render(config), "HorizontalPodAutoscaler")
    hpa_config = config_from_hpa(hpa, adapter_rules(render(config)))
    series = replay_scale([(15.0 * i, 0.0) for i in range(80)], hpa_config, initial_replicas=80)
    steps = [count for i, count in enumerate(series) if i == 0 or count != series[i - 1]]
    assert steps == [72, 64, 57, 51, 45, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 1]
    assert all(series[i] == series[i - i % 4] for i in range(len(series)))  # one step a minute


# ----------------------------------------------------------------------------- cron floors


def cron_fires(line: str) -> set[int]:
    """Minutes of the week (0 = Monday 00:00) at which ``M H * * DOW`` fires."""
    minute, hour, _, _, dow = line.split()
    days = range(7) if dow == "*" else [(int(d) - 1) % 7 for d in dow.split(",")]
    return {day * 1440 + int(hour) * 60 + int(minute) for day in days}


def cron_active(starts: set[int], ends: set[int], at: int) -> bool:
    """KEDA's cron scaler: active from a start until the next end."""
    since_start = min((at - s) % 10080 for s in starts)
    since_end = min((at - e) % 10080 for e in ends)
    return since_start < since_end


SCHEDULES = [
    Schedule((0, 1, 2, 3, 4), 8 * 60 + 30, 19 * 60, 3),
    Schedule((5, 6), 22 * 60, 2 * 60, 2),  # across midnight, into Monday 02:00
    Schedule((0,), 0, 6 * 60, 4),  # a lead moves its start to Sunday
    Schedule((2,), 0, 1440, 1),  # all of Wednesday
    Schedule((0, 1, 2, 3, 4, 5, 6), 23 * 60 + 59, 1, 5),
]


@pytest.mark.parametrize(
    "schedule", SCHEDULES, ids=lambda s: f"{s.days}-{s.from_minute}-{s.to_minute}"
)
@pytest.mark.parametrize("lead", [0, 2, 90])
def test_cron_floor_is_active_exactly_when_the_schedule_is(schedule: Schedule, lead: int) -> None:
    start, end = k8s_scaling.cron_window(schedule, lead)
    starts, ends = cron_fires(start), cron_fires(end)
    for at in range(10080):  # every minute of the week
        expected = schedule.is_active(at // 1440, at % 1440, lead)
        assert cron_active(starts, ends, at) == expected, (start, end, at)


def test_cron_window_lines() -> None:
    assert k8s_scaling.cron_window(SCHEDULES[0], 2) == ("28 8 * * 1,2,3,4,5", "0 19 * * 1,2,3,4,5")
    assert k8s_scaling.cron_window(SCHEDULES[1], 0) == ("0 22 * * 0,6", "0 2 * * 0,1")
    assert k8s_scaling.cron_window(SCHEDULES[2], 2) == ("58 23 * * 0", "0 6 * * 1")
    assert k8s_scaling.cron_window(SCHEDULES[3], 0) == ("0 0 * * 3", "0 0 * * 4")


# ----------------------------------------------------------------------------- errors, CLI


def test_autoscaled_model_in_two_pools_is_refused() -> None:
    config = parse_config(
        {
            "pools": {"a": None, "b": None},
            "models": [
                {
                    "name": "sim",
                    "task": "embeddings",
                    "engine": "simulated",
                    "replicas": {"a": 1, "b": 1},
                    "autoscaling": {"max_replicas": 4, "target_per_replica": 8},
                }
            ],
        },
        "two.yaml",
    )
    with pytest.raises(ConfigError) as info:
        render(config)
    assert info.value.key == "models[0].replicas"
    assert "one HPA scales one Deployment" in info.value.message
    assert "split it into one model per pool" in info.value.message


def test_names_that_meet_are_refused() -> None:
    # The model "gateway" would get the gateway's own Service name.
    config = parse_config(
        {"models": [{"name": "gateway", "task": "embeddings", "engine": "simulated"}]}, "g.yaml"
    )
    with pytest.raises(ConfigError, match="two Services would be named tidegate-gateway"):
        render(config)


def test_fractional_seconds_are_refused_for_an_hpa() -> None:
    config = scaled_model(
        {"max_replicas": 4, "target_per_replica": 8, "scale_up": {"stabilization_window_s": 2.5}}
    )
    with pytest.raises(ConfigError) as info:
        render(config)
    assert info.value.key == "models[0].autoscaling.scale_up.stabilization_window_s"
    assert "whole number of seconds" in info.value.message


def test_notes_say_what_an_hpa_cannot_do() -> None:
    notes = render(load_config(REPO / "examples" / "autoscaling.yaml")).notes
    assert any("chat: panic mode is not rendered" in n for n in notes)
    assert any("embed: schedules are not rendered" in n for n in notes)
    assert any("embed: an HPA keeps at least 1 replica" in n for n in notes)
    keda_notes = render(load_config(REPO / "examples" / "autoscaling.yaml"), keda=True).notes
    assert not any("schedules" in n or "at least 1" in n for n in keda_notes)


def test_cli_writes_one_file_per_kind(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "k8s",
            "render",
            "--config",
            str(REPO / "examples" / "autoscaling.yaml"),
            "--out",
            str(tmp_path),
            "--namespace",
            NAMESPACE,
            "--image",
            "registry.example/tidegate:1",
        ],
    )
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "01-configmap.yaml",
        "02-service.yaml",
        "03-deployment.yaml",
        "04-poddisruptionbudget.yaml",
        "05-horizontalpodautoscaler.yaml",
        "06-prometheus-adapter-rules.yaml",
        "07-monitoring.yaml",
    ]
    deployments = list(yaml.safe_load_all((tmp_path / "03-deployment.yaml").read_text()))
    assert {d["kind"] for d in deployments} == {"Deployment"}
    images = {d["spec"]["template"]["spec"]["containers"][0]["image"] for d in deployments}
    assert images == {"registry.example/tidegate:1"}


def test_cli_prints_to_stdout_and_reports_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["k8s", "render", "--keda"])
    assert result.exit_code == 0, result.output
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert {d["kind"] for d in docs} == {
        "ConfigMap",
        "Service",
        "Deployment",
        "PodDisruptionBudget",
        *MONITORING_KINDS,
    }
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [{name: sim, task: embeddings, engine: simulated, gpu: half}]\n")
    result = runner.invoke(app, ["k8s", "render", "--config", str(bad)])
    assert result.exit_code == 2
    assert "models[0].gpu" in result.output


# ----------------------------------------------------------------------------- drain hook


def test_drain_gives_up_after_its_timeout() -> None:
    def busy(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/admin/drain":
            return httpx.Response(200, json={"status": "draining", "returned": 2})
        return httpx.Response(200, json={"in_flight": 3})

    said = drain_worker("http://w", 0.0, transport=httpx.MockTransport(busy))
    assert said == "drain: 3 still in flight after 0 s; stopping"


def test_drain_of_an_unreachable_worker_does_not_fail() -> None:
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    said = drain_worker("http://w", 5.0, transport=httpx.MockTransport(down))
    assert said.startswith("drain: http://w did not answer")


@pytest.mark.e2e
def test_drain_hook_lets_a_running_batch_finish(tmp_path: Path) -> None:
    profile = tmp_path / "slow.json"
    profile.write_text(
        '{"version": 1, "task": "embeddings", "embeddings": {"points": '
        '[{"batch_size": 1, "latency_ms": 3000}, {"batch_size": 8, "latency_ms": 3000}]}}'
    )
    # 3 s batches: a poll of /stats on a loaded machine must still see the batch running.
    with worker_process(
        "--model",
        "sim",
        "--engine",
        "simulated",
        "--profile",
        str(profile),
        "--max-batch-size",
        "8",
    ) as worker:
        with (
            httpx.Client(timeout=DEADLINE_S) as client,
            concurrent.futures.ThreadPoolExecutor(1) as pool,
        ):
            answer = pool.submit(
                client.post, f"{worker.url}/v1/embeddings", json={"model": "sim", "input": "a"}
            )
            # Running, not merely queued: a queued request would be handed back (503).
            wait_for(lambda: int(worker.stats()["running"]) > 0)  # type: ignore[call-overload]
            said = drain_worker(worker.url, 30.0, poll_s=0.05)
            assert answer.result().status_code == 200
        assert said == "drained: 0 handed back to the gateway, nothing in flight"
        readyz = httpx.get(f"{worker.url}/readyz", timeout=DEADLINE_S)
        assert (readyz.status_code, readyz.json()["status"]) == (503, "draining")


RATE_SCALED = {
    "min_replicas": 1,
    "max_replicas": 12,
    "target_per_replica": 8,
    "target_rate_per_replica": 50,
    "stable_window_s": 30,
}


def test_a_rate_target_renders_the_gateways_arrival_counter() -> None:
    config = scaled_model(RATE_SCALED)
    manifests = render(config)
    (hpa,) = kind(manifests, "HorizontalPodAutoscaler")
    external = hpa["spec"]["metrics"][0]["external"]
    assert external["metric"]["name"] == "tidegate_arrivals_per_s_30s"
    assert external["target"] == {"type": "AverageValue", "averageValue": "50"}
    (rule,) = adapter_rules(manifests)
    assert rule["name"]["matches"] == "^tidegate_arrivals_total$"
    assert rule["name"]["as"] == external["metric"]["name"]
    assert rule["seriesQuery"].startswith("tidegate_arrivals_total{")
    assert rule["metricsQuery"] == "sum(rate(<<.Series>>{<<.LabelMatchers>>}[30s]))"
    # The counter the gateway exports (gateway/observe.py; tests/gateway/test_serve.py).
    assert f"{ARRIVALS}_total" == k8s_scaling.RATE_METRIC
    assert not any("arrival rate" in note for note in manifests.notes)
    for version in VERSIONS:
        kubernetes_validate.validate(hpa, version, strict=True)
    keda = render(config, keda=True)
    (scaled,) = kind(keda, "ScaledObject")
    demand = next(t for t in scaled["spec"]["triggers"] if t["name"] == "demand")["metadata"]
    assert demand["query"] == (
        f'sum(rate(tidegate_arrivals_total{{namespace="{NAMESPACE}",model="sim"}}[30s]))'
    )
    assert demand["threshold"] == "50"
    check_scaled_object(scaled, keda, VERSIONS[-1])


def test_a_rate_over_a_shorter_window_than_two_scrapes_is_widened_and_said() -> None:
    config = scaled_model({**RATE_SCALED, "stable_window_s": 0})
    manifests = render(config)
    (hpa,) = kind(manifests, "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"].endswith("_30s")
    assert any("sim: the arrival rate is taken over 30 s" in note for note in manifests.notes)


def test_rendered_rate_target_scales_as_the_builtin_rate_path() -> None:
    """Given the same arrival rate, the HPA's arithmetic on the rendered metric (ceil(rate /
    averageValue), the tolerance, the behavior) is the core's rate path, decision by
    decision. The rate itself differs by its window's edges (PromQL extrapolates; the core
    counts from the last decision at or before the window's start): module docstring."""
    config = scaled_model(RATE_SCALED)
    model = config.model("sim")
    assert model.autoscaling is not None
    (hpa,) = kind(render(config), "HorizontalPodAutoscaler")
    assert_rate_replays_alike(hpa_part(model.autoscaling), config_from_hpa(hpa, []))


def assert_rate_replays_alike(ours: AutoscaleConfig, theirs: AutoscaleConfig) -> None:
    """``ours`` (a rate target) on the gateway's counter of a tidal series, and ``theirs``
    (an HPA or KEDA read back from its manifest: the rate is its metric, the target its
    ``averageValue``) on the rates ``ours`` computed: the same replica series."""
    assert ours.target_rate_per_replica is not None
    # Ours on the counter: arrivals per 15 s from the tidal demand series, a unit of the
    # series being 1/25 of a replica's rate (the series' outage: no sample, held by both).
    per_unit = ours.target_rate_per_replica / 25
    replicas, state, arrived = ours.min_replicas, ScaleState(), 0.0
    decisions = []
    for at, level in demand_series():
        sample = None
        if level is not None:
            arrived += level * 15 * per_unit
            sample = DemandSample(at, queued=0.0, in_flight=0.0, arrived=arrived)
        inputs = ScaleInputs(replicas=replicas, ready_replicas=replicas, demand=sample)
        decision, state = decide_scale(inputs, state, ours, at)
        replicas = decision.desired_replicas
        decisions.append(decision)
    series = tuple(d.desired_replicas for d in decisions)
    rates = [(d.decided_at, d.rate) for d in decisions]
    assert sum(rate is not None for _, rate in rates) > len(rates) * 0.9
    assert theirs.target_per_replica == ours.target_rate_per_replica
    # The averaging is the query's rate window: the cluster reads the rate as it comes.
    theirs = dataclasses.replace(theirs, stable_window_s=0.0)
    assert replay_scale(rates, theirs, initial_replicas=ours.min_replicas) == series
    assert len(set(series)) > 2, "the load must move the count for the check to mean much"
