"""The live dashboard's server side: access, assets, and snapshots that say what /metrics says.

A real ``tidegate serve`` (simulated workers, keys configured) for access and the snapshot's
agreement with ``/metrics``; an in-process gateway over a real worker process and a dead
address for the per-replica series. The page itself is tested in a real Chromium in
test_dashboard_browser.py.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.harness import flat_profile, gateway_client, sim_config, sim_worker
from tests.procs import DEADLINE_S, Proc, gateway_process
from tidegate.gateway.dashboard import doctor_findings

pytestmark = pytest.mark.e2e

ADMIN_KEY = "sk-test-dash-admin"
USER_KEY = "sk-test-dash-user"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
USER = {"Authorization": f"Bearer {USER_KEY}"}
PAGES = ("/dashboard", "/dashboard/data", "/dashboard/assets/dashboard.js")


def basic(key: str, user: str = "ops") -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{key}".encode()).decode()}


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def write_config(
    tmp_path: Path, *, autoscaling: dict[str, Any] | None = None, chat: bool = False
) -> Path:
    """Simulated embeddings (20 ms a batch of up to 4), an admin key and a user key; with
    ``chat``, a simulated generation model too (20 ms to the first token, 5 ms a token)."""
    profile = flat_profile(tmp_path / "profile.json", 20.0)
    model: dict[str, Any] = {
        "name": "sim",
        "task": "embeddings",
        "engine": "simulated",
        "profile": str(profile),
        "replicas": 1,
        "slots": 4,
        "batching": {"max_batch_size": 4, "batch_window_ms": 2},
    }
    if autoscaling is not None:
        model["autoscaling"] = autoscaling
    models = [model]
    if chat:
        models.append(
            {
                "name": "chat",
                "task": "generate",
                "engine": "simulated",
                "profile": str(flat_profile(tmp_path / "chat.json", 5.0, task="generate")),
                "replicas": 1,
            }
        )
    config = {
        "models": models,
        "keys": [
            {"name": "ops", "sha256": _sha(ADMIN_KEY), "role": "admin"},
            {
                "name": "app",
                "sha256": _sha(USER_KEY),
                "default_priority": "high",
                "max_priority": "high",
            },
        ],
    }
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    with gateway_process("--config", str(write_config(tmp_path_factory.mktemp("dash")))) as gw:
        yield gw


def get(gateway: Proc, path: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.get(f"{gateway.url}{path}", headers=headers, timeout=DEADLINE_S)


def test_dashboard_without_the_admin_key_is_401_or_403(served: Proc) -> None:
    for path in PAGES:
        for headers in ({}, basic("sk-wrong"), {"Authorization": "Bearer sk-wrong"}):
            answer = get(served, path, headers)
            assert answer.status_code == 401, (path, headers, answer.text)
            # Basic first: a browser asks for the key itself; Bearer for scripts.
            challenges = answer.headers.get_list("WWW-Authenticate")
            assert challenges[0].startswith("Basic realm="), challenges
            assert challenges[1].startswith("Bearer"), challenges
            assert answer.json()["error"]["type"] == "authentication_error"
        for headers in (USER, basic(USER_KEY)):
            answer = get(served, path, headers)
            assert answer.status_code == 403, (path, answer.text)
            assert answer.json()["error"]["code"] == "admin_required"


def test_dashboard_with_the_admin_key_as_bearer_or_basic(served: Proc) -> None:
    for headers in (ADMIN, basic(ADMIN_KEY), basic(ADMIN_KEY, user="")):
        page = get(served, "/dashboard", headers)
        assert page.status_code == 200, page.text
        assert page.headers["content-type"].startswith("text/html")
        for asset in ("dashboard.js", "dashboard.css"):
            assert f"dashboard/assets/{asset}" in page.text
            served_asset = get(served, f"/dashboard/assets/{asset}", headers)
            assert served_asset.status_code == 200
        assert get(served, "/dashboard/data", headers).json()["models"]["sim"]["task"] == (
            "embeddings"
        )


def test_page_loads_nothing_from_another_origin(served: Proc) -> None:
    page = get(served, "/dashboard", ADMIN).text
    script = get(served, "/dashboard/assets/dashboard.js", ADMIN).text
    style = get(served, "/dashboard/assets/dashboard.css", ADMIN).text
    for text in (page, script, style):
        for remote in ("https://", "//cdn", "@import", "url(http"):
            assert remote not in text.replace("http://www.w3.org/2000/svg", ""), remote


@pytest.mark.parametrize(
    "path",
    [
        "/dashboard/assets/missing.js",
        "/dashboard/assets/..%2F__init__.py",
        "/dashboard/assets/%2E%2E%2Fdashboard.py",
        "/dashboard/assets/index",
    ],
)
def test_only_the_shipped_assets_are_served(served: Proc, path: str) -> None:
    assert get(served, path, ADMIN).status_code == 404


SampleKey = tuple[str, tuple[tuple[str, str], ...]]
# Series that move between two reads of an idle gateway: the process's own CPU and
# memory, and doctor's findings (its rules run on their own timer).
MOVING = ("process_", "python_gc_", "tidegate_doctor_findings")


def metric_samples(text: str) -> dict[SampleKey, float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created") and not sample.name.startswith(MOVING)
    }


def snapshot_samples(data: dict[str, Any]) -> dict[SampleKey, float]:
    return {
        (name, tuple(sorted(labels.items()))): value
        for name, labels, value in data["samples"]
        if not name.startswith(MOVING)
    }


def test_snapshot_holds_what_metrics_holds(served: Proc) -> None:
    with httpx.Client(headers=USER, timeout=DEADLINE_S) as client:
        for text in ("a", "b", "c"):
            answer = client.post(
                f"{served.url}/v1/embeddings", json={"model": "sim", "input": text}
            )
            assert answer.status_code == 200
    # Nothing runs now: the two agree sample for sample, gauges included.
    metrics = metric_samples(get(served, "/metrics", {}).text)
    data = get(served, "/dashboard/data", ADMIN).json()
    assert snapshot_samples(data) == metrics
    completed = metrics[
        (
            "tidegate_requests_total",
            (("model", "sim"), ("outcome", "completed"), ("priority", "high")),
        )
    ]
    assert completed >= 3


def test_snapshot_describes_each_replica_from_its_own_metrics(served: Proc) -> None:
    data = get(served, "/dashboard/data", ADMIN).json()
    (replica,) = data["replicas"]
    assert replica["model"] == "sim"
    assert replica["state"] == "ready"
    assert replica["kind"] == "local"
    assert replica["metrics_error"] is None
    names = {name for name, _, _ in replica["samples"]}
    assert "tidegate_worker_startup_seconds" in names
    assert "tidegate_batch_size_bucket" in names
    # Its own process metrics when it exports them, else psutil on its pid: a local worker
    # always has its CPU seconds and resident memory.
    assert replica["process"]["source"] in ("metrics", "psutil")
    assert replica["process"]["cpu_seconds"] > 0
    assert replica["process"]["rss_bytes"] > 0
    # Doctor's findings as GET /admin/doctor gives them, less the running config.
    doctor = get(served, "/admin/doctor", ADMIN).json()
    assert data["doctor"]["available"] is True
    assert set(data["doctor"]) == {"available", "findings", "window_s", "at", "not_measured"}
    assert isinstance(data["doctor"]["findings"], list)
    assert "config" in doctor


def _closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.asyncio
async def test_a_replica_without_metrics_costs_only_its_own_cells(tmp_path: Path) -> None:
    profile = flat_profile(tmp_path / "profile.json", 5.0)
    with sim_worker(profile) as worker:
        dead = _closed_port()
        async with gateway_client(sim_config(worker.url), [worker.url, dead], slots=2) as (
            client,
            _,
        ):
            answer = await client.get("/dashboard/data")
            assert answer.status_code == 200  # an open service: no key needed
            live, gone = answer.json()["replicas"]
    assert live["url"] == worker.url
    assert live["metrics_error"] is None
    names = {name for name, _, _ in live["samples"]}
    assert "tidegate_worker_startup_seconds" in names
    assert "tidegate_worker_ready" not in names  # only the series the page shows travel
    assert gone["url"] == dead
    assert gone["samples"] is None
    assert gone["metrics_error"] == "/metrics unreachable"
    assert gone["process"] is None  # an upstream: no pid to measure


@pytest.mark.asyncio
async def test_doctor_panel_says_why_when_there_are_no_findings_to_show() -> None:
    """``doctor_findings`` against apps without a doctor (404) and with a broken one (500)."""
    without = FastAPI()
    broken = FastAPI()

    @broken.get("/admin/doctor")
    async def failing() -> dict[str, Any]:
        raise RuntimeError("a bug in a rule")

    assert await doctor_findings(without, None) == {
        "available": False,
        "reason": "doctor not available",
    }
    assert await doctor_findings(broken, "sk-any") == {
        "available": False,
        "reason": "doctor answered 500",
    }


def test_snapshot_is_json_that_the_page_can_read(served: Proc) -> None:
    data = get(served, "/dashboard/data", ADMIN)
    assert data.headers["content-type"] == "application/json"
    parsed = json.loads(data.text)
    assert set(parsed) >= {"at", "poll_interval_s", "window_s", "levels", "models", "samples"}
    assert parsed["levels"] == ["high", "medium", "low"]
