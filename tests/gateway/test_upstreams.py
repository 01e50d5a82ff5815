"""Static upstreams as tidegate serve meets them: an API key, and one that fails everything.

The upstreams are small aiohttp servers in this process (on a thread of their own), reached
by a real ``tidegate serve`` over loopback: they record what they were sent.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiohttp import web

from tests.procs import DEADLINE_S, Proc, gateway_process, wait_for

UPSTREAM_KEY = "sk-upstream-7f3a9c"  # what the fake vLLM was started with (--api-key)
KEY_ENV = "TIDEGATE_TEST_UPSTREAM_KEY"


class FakeUpstream:
    """An OpenAI-compatible embeddings server: ``/health``, ``/v1/models``, ``/v1/embeddings``.

    ``api_key``: every path needs ``Authorization: Bearer <api_key>`` (401 otherwise), health
    included (stricter than vLLM, so the health checker is shown to send it too).
    ``failing``: ``/v1/embeddings`` answers 500 while ``/health`` still says 200.
    """

    def __init__(self, *, api_key: str | None = None, failing: bool = False) -> None:
        self.api_key = api_key
        self.failing = failing
        self.hits = 0  # /v1/embeddings requests received
        self.authorizations: list[str | None] = []  # their Authorization headers
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _authorized(self, request: web.Request) -> bool:
        return self.api_key is None or (
            request.headers.get("Authorization") == f"Bearer {self.api_key}"
        )

    async def _health(self, request: web.Request) -> web.Response:
        if not await self._authorized(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        return web.json_response({"status": "ok"})

    async def _embeddings(self, request: web.Request) -> web.Response:
        self.hits += 1
        self.authorizations.append(request.headers.get("Authorization"))
        if not await self._authorized(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        if self.failing:
            return web.json_response({"error": {"message": "engine is broken"}}, status=500)
        body = await request.json()
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [
            {"object": "embedding", "index": i, "embedding": [0.5, 0.5]} for i in range(len(inputs))
        ]
        return web.json_response(
            {"object": "list", "data": data, "model": body["model"], "usage": {}}
        )

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._health)
        app.router.add_post("/v1/embeddings", self._embeddings)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    def __enter__(self) -> FakeUpstream:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(DEADLINE_S)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            cleanup = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
            cleanup.result(DEADLINE_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(DEADLINE_S)
        self._loop.close()


def write_config(tmp_path: Path, upstreams: list[Any], **extra: Any) -> str:
    model = {"name": "emb", "task": "embeddings", "engine": "openai", "upstreams": upstreams}
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump({"models": [model], **extra}))
    return str(path)


def embed(gateway: Proc, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/v1/embeddings",
        json={"model": "emb", "input": "tide"},
        headers=headers,
        timeout=DEADLINE_S,
    )


def replicas(gateway: Proc, **headers: str) -> dict[str, dict[str, Any]]:
    answer = httpx.get(f"{gateway.url}/admin/replicas", headers=headers, timeout=DEADLINE_S)
    answer.raise_for_status()
    return {r["id"]: r for r in answer.json()["emb"]["replicas"]}


# ----------------------------------------------------------------------------- API key
def test_upstream_started_with_an_api_key_gets_it_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)  # the gateway process inherits it
    with FakeUpstream(api_key=UPSTREAM_KEY) as vllm:
        config = write_config(tmp_path, [{"url": f"{vllm.url}/v1", "api_key_env": KEY_ENV}])
        # Ready at all means the health checker sent the key: /health needs it here.
        with gateway_process("--config", config) as gateway:
            answer = embed(gateway)
            admin = httpx.get(f"{gateway.url}/admin/replicas", timeout=DEADLINE_S).text
            metrics = httpx.get(f"{gateway.url}/metrics", timeout=DEADLINE_S).text
    assert answer.status_code == 200, answer.text
    assert answer.json()["data"][0]["embedding"] == [0.5, 0.5]
    assert vllm.authorizations == [f"Bearer {UPSTREAM_KEY}"]
    assert UPSTREAM_KEY not in admin
    assert UPSTREAM_KEY not in metrics


# ----------------------------------------------------------------------------- outliers
def ejections(gateway: Proc, replica: str) -> float:
    text = httpx.get(f"{gateway.url}/metrics", timeout=DEADLINE_S).text
    prefix = f'tidegate_replica_ejections_total{{model="emb",replica="{replica}"}} '
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(lines[0].removeprefix(prefix)) if lines else 0.0


EJECTION_S = 12.0  # long enough for a handful of requests on a busy machine (6 s was not at load 7)


def test_upstream_failing_everything_is_ejected_then_returns_after_the_back_off(
    tmp_path: Path,
) -> None:
    outliers = {
        "consecutive_failures": 3,
        "base_ejection_s": EJECTION_S,
        "max_ejection_s": EJECTION_S,
    }
    with FakeUpstream(failing=True) as broken, FakeUpstream() as healthy:
        config = write_config(
            tmp_path,
            [broken.url, healthy.url],
            gateway={"outlier_detection": outliers},
        )
        with gateway_process("--config", config) as gateway:
            wait_for(lambda: {r["state"] for r in replicas(gateway).values()} == {"ready"})
            # One at a time, both idle: ties go to emb-0, the broken one, whose /health is
            # fine; only its answers give it away.
            first = [embed(gateway).status_code for _ in range(3)]
            ejected = replicas(gateway)["emb-0"]
            ejected_at = time.monotonic()
            during = [embed(gateway).status_code for _ in range(5)]
            took_s = time.monotonic() - ejected_at
            hits_during = broken.hits
            assert ejections(gateway, "emb-0") == 1.0
            assert ejections(gateway, "emb-1") == 0.0

            broken.failing = False  # it recovers; the gateway learns it only by trying
            wait_for(lambda: not replicas(gateway)["emb-0"]["outlier"]["ejected"])
            after = [embed(gateway).status_code for _ in range(2)]
            returned = replicas(gateway)["emb-0"]
    assert first == [500, 500, 500]
    assert ejected["state"] == "ready"  # health alone would have kept it in rotation
    assert ejected["outlier"]["ejected"] is True
    assert ejected["outlier"]["ejections"] == 1
    assert 0 < ejected["outlier"]["ejected_for_s"] <= EJECTION_S
    assert took_s < EJECTION_S, "the machine was too slow for the check of the ejection"
    assert during == [200] * 5
    assert hits_during == 3  # nothing reached the broken upstream while it was ejected
    assert healthy.hits >= 5
    assert after == [200, 200]
    assert broken.hits > 3  # half-open: it got traffic again after the back-off ...
    assert returned["outlier"]["half_open"] is False  # ... answered well, and stays
    assert returned["outlier"]["consecutive_failures"] == 0
