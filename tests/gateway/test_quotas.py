"""Per-key quotas through the real HTTP path: 429 with an honest Retry-After, before the queue.

The gateway's quota clock is a manual one: time moves only when the test says so, and the
tests prove a Retry-After by moving the clock by it, never by sleeping.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.harness import flat_profile, gateway_client, sim_config, sim_worker
from tidegate.core.request import RequestState
from tidegate.gateway.state import Gateway

LIMITED, OTHER, TOKENS = "sk-limited", "sk-other", "sk-tokens"


class ManualClock:
    def __init__(self) -> None:
        self.at = 1000.0

    def now(self) -> float:
        return self.at


def _key(name: str, secret: str, rate_limit: dict[str, Any] | None) -> dict[str, Any]:
    key: dict[str, Any] = {"name": name, "sha256": hashlib.sha256(secret.encode()).hexdigest()}
    if rate_limit is not None:
        key["rate_limit"] = rate_limit
    return key


KEYS = [
    _key("limited", LIMITED, {"requests_per_s": 0.5, "burst_requests": 2}),
    _key("other", OTHER, None),
    _key("tokens", TOKENS, {"tokens_per_min": 600, "burst_tokens": 100}),  # 10 tokens/s
]


async def _embed(client: httpx.AsyncClient, secret: str, text: str = "hi") -> httpx.Response:
    return await client.post(
        "/v1/embeddings",
        json={"model": "sim", "input": text},
        headers={"Authorization": f"Bearer {secret}"},
    )


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def _num_queued(gateway: Gateway) -> int:
    """Requests that took a place in the model's queue, since the gateway started."""
    counts = gateway.dispatchers["sim"].queue.outcome_counts()
    return sum(n for (_, state), n in counts.items() if state is RequestState.QUEUED)


def _refused(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code
    assert error["type"] == ("rate_limit_error" if status == 429 else "invalid_request_error")
    return error


@dataclass
class Served:
    client: httpx.AsyncClient  # to the gateway, in this process
    gateway: Gateway
    clock: ManualClock  # the gateway's quota clock
    worker_url: str  # the real worker process behind it


@contextlib.asynccontextmanager
async def _served(tmp_path: Path) -> AsyncIterator[Served]:
    profile = flat_profile(tmp_path / "flat.json", 1.0)
    with sim_worker(profile) as worker:
        data = sim_config(worker.url, keys=KEYS)
        async with gateway_client(data, [worker.url], 4) as (client, gateway):
            clock = ManualClock()
            gateway.quotas.clock = clock
            yield Served(client, gateway, clock, worker.url)


@pytest.mark.asyncio
async def test_a_key_over_its_request_rate_gets_429_before_the_queue_and_others_pass(
    tmp_path: Path,
) -> None:
    async with _served(tmp_path) as served:
        client, gateway, clock = served.client, served.gateway, served.clock
        for _ in range(2):  # the burst
            assert (await _embed(client, LIMITED)).status_code == 200
        over = await _embed(client, LIMITED)
        error = _refused(over, 429, "request_rate_exceeded")
        assert over.headers["Retry-After"] == "2"  # one request at 0.5/s
        assert "key limited" in error["message"]
        assert "0.5 requests/s (bursts of 2)" in error["message"]
        assert "retry in 2.000 s" in error["message"]
        for _ in range(3):  # another key: no quota, not slowed by this one's
            assert (await _embed(client, OTHER)).status_code == 200

        clock.at += 1.5  # the refusal took nothing: the wait counts from the last take
        early = await _embed(client, LIMITED)
        _refused(early, 429, "request_rate_exceeded")
        assert early.headers["Retry-After"] == "1"
        assert "retry in 0.500 s" in early.json()["error"]["message"]
        clock.at += 0.5  # exactly the wait: admitted
        assert (await _embed(client, LIMITED)).status_code == 200

        assert _num_queued(gateway) == 6  # 3 + 3 passed; the 2 refused never queued
        metrics = (await client.get("/metrics")).text
        async with httpx.AsyncClient() as direct:
            worker_metrics = (await direct.get(f"{served.worker_url}/metrics")).text

    rejections = _samples(metrics, "tidegate_quota_rejections_total")
    assert rejections[(("key", "limited"), ("limit", "requests"))] == 2
    assert rejections[(("key", "tokens"), ("limit", "tokens"))] == 0  # its series, at 0
    assert not any(dict(labels)["key"] == "other" for labels in rejections)
    outcomes = _samples(metrics, "tidegate_requests_total")
    by_outcome = {dict(labels)["outcome"]: n for labels, n in outcomes.items()}
    assert by_outcome == {"completed": 6, "rejected_quota": 2}
    received = _samples(worker_metrics, "tidegate_requests_total")
    assert sum(received.values()) == 6  # the worker saw the admitted ones only


@pytest.mark.asyncio
async def test_a_key_over_its_token_rate_waits_for_the_missing_tokens_only(
    tmp_path: Path,
) -> None:
    async with _served(tmp_path) as served:
        client, gateway, clock = served.client, served.gateway, served.clock
        text = "x" * 240  # estimated 240 // 4 + 1 = 61 tokens
        assert (await _embed(client, TOKENS, text)).status_code == 200  # 39 left of 100
        over = await _embed(client, TOKENS, text)
        error = _refused(over, 429, "token_rate_exceeded")
        assert "600 tokens/min (bursts of 100)" in error["message"]
        assert "this request counts 61 tokens (estimated" in error["message"]
        assert "retry in 2.200 s" in error["message"]  # 22 tokens missing at 10/s
        assert over.headers["Retry-After"] == "3"  # rounded up: then it fits
        too_big = await _embed(client, TOKENS, "x" * 400)  # 101 tokens, burst 100
        error = _refused(too_big, 413, "token_burst_exceeded")
        assert "Retry-After" not in too_big.headers  # no wait would admit it
        assert "101 tokens" in error["message"]
        assert "more than the 100" in error["message"]
        clock.at += 3
        assert (await _embed(client, TOKENS, text)).status_code == 200
        assert _num_queued(gateway) == 2
        metrics = (await client.get("/metrics")).text

    rejections = _samples(metrics, "tidegate_quota_rejections_total")
    assert rejections[(("key", "tokens"), ("limit", "tokens"))] == 2
    assert rejections[(("key", "limited"), ("limit", "requests"))] == 0
