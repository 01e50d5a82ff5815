"""Doctor against real servers: each symptom produced by a real ``tidegate serve`` whose
config causes it (simulated engines, real worker processes), and healthy runs it must pass.

Load comes from client threads in closed loops that retry a 429 at once (ignoring its
Retry-After, which is one of the symptoms). Each test waits for the event that makes its
symptom visible (a 429 counted, a cold start, batches on both replicas), never for a time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.gateway.harness import flat_profile, sim_worker
from tests.ops.doctor_load import load, metric, one_slot_model, serve, sim_model, tidegate
from tests.procs import DEADLINE_S, wait_for
from tidegate.core.diagnose import Thresholds, diagnose
from tidegate.ops.doctor import gateway_snapshot

OVERLOAD_RULES = {
    "high_priority_shed",
    "low_priority_starving",
    "rejection_storm",
    "retry_after_ignored",
    "batches_too_small",
    "autoscale_stuck",
}


def test_overload_is_diagnosed_and_a_light_load_on_the_same_config_is_healthy(
    tmp_path: Path,
) -> None:
    """One replica, one request at a time, a queue of 4 and an autoscaler whose target is
    never reached: healthy under one client; under twelve, the top level is refused
    (critical), low starves, 429s storm back, batches cannot grow and nothing scales."""
    profile = flat_profile(tmp_path / "profile.json", latency_ms=200)
    model = one_slot_model(profile)
    with serve(tmp_path, [model]) as proc:
        with load(proc.url, "sim", {"high": 1}) as counts:
            wait_for(lambda: counts[("high", 200)] > 0)
            healthy = tidegate("doctor", "--url", proc.url, "--window", "2s")
        assert healthy.returncode == 0, healthy.stdout + healthy.stderr
        assert "healthy: no rule found a symptom" in healthy.stdout

        with load(proc.url, "sim", {"high": 8, "low": 4}) as counts:
            wait_for(lambda: counts[("high", 429)] > 0 and counts[("low", 429)] > 0)
            # A 3 s window holds a dozen completions: on a loaded machine one window's coarse
            # histogram quantiles can miss a symptom, so read windows until all are seen.
            results = []

            def diagnosed() -> bool:
                results.append(
                    tidegate(
                        "doctor", "--url", proc.url, "--window", "3s", "--p99-slo", "0.3", "--json"
                    )
                )
                seen = {
                    f["rule"] for f in json.loads(results[-1].stdout or "{}").get("findings", [])
                }
                return seen >= OVERLOAD_RULES

            try:
                wait_for(diagnosed, interval_s=0.0)
            except AssertionError as exc:
                raise AssertionError(f"{exc}; the last reading: {results[-1].stdout}") from None
            result = results[-1]
            # the gateway's own watch sees it too, and exports it as a gauge
            wait_for(
                lambda: metric(proc.url, "tidegate_doctor_findings", rule="high_priority_shed") > 0
            )
        admin = httpx.get(f"{proc.url}/admin/doctor", timeout=DEADLINE_S).json()

    assert result.returncode == 2, result.stdout + result.stderr
    findings = json.loads(result.stdout)["findings"]
    rules = [f["rule"] for f in findings]
    assert rules[0] == "high_priority_shed"  # the critical one ranks first
    assert set(rules) >= OVERLOAD_RULES, rules
    by_rule = {f["rule"]: f for f in findings}
    assert "+    max_batch_size: 2" in by_rule["batches_too_small"]["config_diff"]
    assert "-    target_per_replica: 1000.0" in by_rule["autoscale_stuck"]["config_diff"]
    assert "-    max_size: 4" in by_rule["high_priority_shed"]["config_diff"]
    assert admin["config"]["models"][0]["queue"]["max_size"] == 4
    assert {"rule", "severity", "symptom", "numbers", "cause", "fix", "config_diff"} <= set(
        admin["findings"][0]
    )


def test_memory_over_the_ask_and_near_it_against_a_model_that_fits(tmp_path: Path) -> None:
    """Profiles that measured 900 and 290 MB, served asking 300 MB each; a third fits."""

    def measured(name: str, memory_mb: float) -> Path:
        path = flat_profile(tmp_path / f"{name}.json", latency_ms=5)
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "memory_mb": memory_mb}))
        return path

    models = [
        {**sim_model(measured(name, mb), memory_mb=300), "name": name}
        for name, mb in (("grown", 900), ("tight", 290), ("fits", 100))
    ]
    with serve(tmp_path, models) as proc:
        snapshot = gateway_snapshot(proc.url, None, 0.0, wait=lambda _: None)
    found = {(f.model, f.rule, f.severity) for f in diagnose(snapshot).findings}
    # on a CPU host with no declared devices nothing is placed by memory: a stale ask is a
    # warning, and a peak near its ask is no limit there (it is one on a GPU: the table tests)
    assert found == {("grown", "memory_jump", "warning")}


def test_one_slow_replica_is_a_noisy_neighbour_and_equal_ones_are_not(tmp_path: Path) -> None:
    fast = flat_profile(tmp_path / "fast.json", latency_ms=10)
    slow = flat_profile(tmp_path / "slow.json", latency_ms=80)

    def diagnose_pair(second: Path) -> set[str]:
        with sim_worker(fast) as a, sim_worker(second) as b:
            model = {"name": "sim", "task": "embeddings", "engine": "openai"}
            with serve(tmp_path, [{**model, "upstreams": [a.url, b.url]}]) as proc:
                wait = _until_batches(a.url, b.url)
                with load(proc.url, "sim", {"high": 4}):
                    snapshot = gateway_snapshot(proc.url, None, 0.0, wait=wait)
        return {f.rule for f in diagnose(snapshot).findings}

    assert "noisy_neighbour" in diagnose_pair(slow)
    assert "noisy_neighbour" not in diagnose_pair(fast)


def _until_batches(*urls: str) -> Callable[[float], None]:
    """A window that lasts until every worker ran ten more batches."""

    def batches(url: str) -> float:
        return metric(url, "tidegate_batch_duration_seconds_count")

    def wait(_: float) -> None:
        start = [batches(u) for u in urls]
        wait_for(lambda: all(batches(u) >= s + 10 for u, s in zip(urls, start, strict=True)))

    return wait


def test_latency_after_a_scale_out_with_cold_starts(tmp_path: Path) -> None:
    """Demand doubles the replicas; the new one starts cold while requests queue."""
    profile = flat_profile(tmp_path / "profile.json", latency_ms=200)
    model = sim_model(
        profile,
        slots=1,
        batching={"max_batch_size": 1, "batch_window_ms": 0},
        autoscaling={
            "min_replicas": 1,
            "max_replicas": 2,
            "target_per_replica": 1,
            "interval_s": 1,
            "stable_window_s": 0,
        },
    )
    with serve(tmp_path, [model]) as proc, contextlib.ExitStack() as stack:

        def window(_: float) -> None:
            cold = metric(proc.url, "tidegate_cold_start_seconds_count")
            counts = stack.enter_context(load(proc.url, "sim", {"high": 4}))
            wait_for(lambda: metric(proc.url, "tidegate_cold_start_seconds_count") > cold)
            done = counts[("high", 200)]
            wait_for(lambda: counts[("high", 200)] >= done + 8)  # served on both replicas

        snapshot = gateway_snapshot(proc.url, None, 0.0, wait=window)
    findings = {f.rule: f for f in diagnose(snapshot, Thresholds(p99_slo_s=0.3)).findings}
    assert "scale_out_latency" in findings, findings
    assert findings["scale_out_latency"].numbers["cold_starts"] >= 1
    assert "min_replicas: 2" in findings["scale_out_latency"].config_diff


def test_a_worker_tokenizing_huge_inputs_is_tokenize_bound_and_short_ones_are_not(
    tmp_path: Path,
) -> None:
    """The real MiniLM worker: its tokenizer counts every token of a 200 KB input (to refuse
    it as over the context) on the worker's event loop, while the model idles."""

    def rules_under(text: str) -> set[str]:
        with load(proc.url, "minilm", {"high": 3}, text=text) as counts:
            wait_for(lambda: sum(counts.values()) > 0)

            def window(_: float) -> None:
                done = sum(counts.values())
                wait_for(lambda: sum(counts.values()) >= done + 8)

            snapshot = gateway_snapshot(proc.url, None, 0.0, wait=window)
        return {f.rule for f in diagnose(snapshot).findings}

    with serve(tmp_path, [{"name": "minilm", "replicas": 1}]) as proc:
        assert "tokenize_bound" not in rules_under("the tide comes in")
        assert "tokenize_bound" in rules_under("tide gate " * 20_000)


def test_with_keys_doctor_needs_an_admin_key_and_takes_it_from_the_environment(
    tmp_path: Path,
) -> None:
    admin_key, user_key = "sk-test-doctor-admin", "sk-test-doctor-user"
    keys = [
        {"name": "ops", "sha256": hashlib.sha256(admin_key.encode()).hexdigest(), "role": "admin"},
        {"name": "app", "sha256": hashlib.sha256(user_key.encode()).hexdigest()},
    ]
    profile = flat_profile(tmp_path / "profile.json", latency_ms=5)
    with serve(
        tmp_path, [sim_model(profile)], keys=keys, gateway={"metrics_auth": "admin"}
    ) as proc:
        none = tidegate("doctor", "--url", proc.url, "--window", "1s")
        user = tidegate("doctor", "--url", proc.url, "--window", "1s", "--key", user_key)
        admin = tidegate(
            "doctor", "--url", proc.url, "--window", "1s", "--verbose", TIDEGATE_ADMIN_KEY=admin_key
        )
    assert none.returncode == 1
    assert "needs an admin key" in none.stderr
    assert "TIDEGATE_ADMIN_KEY" in none.stderr
    assert user.returncode == 1
    assert "not an admin key" in user.stderr
    assert admin.returncode == 0, admin.stdout + admin.stderr
    assert "healthy" in admin.stdout
    # one idle replica: no batches to size, no second replica to compare with
    assert "not measured (these rules stayed silent):" in admin.stdout
    assert "sim: noisy_neighbour: tidegate_batch_duration_seconds of two" in admin.stdout
