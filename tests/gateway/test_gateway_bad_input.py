"""Bad input to the gateway: a 4xx with an OpenAI-shaped body, never a 500 or a hang."""

from __future__ import annotations

import hashlib
import json
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.harness import flat_profile, gateway_client, sim_config, sim_worker

APP_KEY = "sk-app-123"
BATCH_KEY = "sk-batch-456"


def _keys() -> list[dict[str, str]]:
    def digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    return [
        {
            "name": "app",
            "sha256": digest(APP_KEY),
            "default_priority": "high",
            "max_priority": "high",
        },
        {
            "name": "batch",
            "sha256": digest(BATCH_KEY),
            "default_priority": "low",
            "max_priority": "medium",
        },
    ]


@dataclass(frozen=True)
class Bad:
    name: str
    body: Any
    status: int
    code_or_param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    path: str = "/v1/embeddings"
    key: str | None = BATCH_KEY


OK = {"model": "sim", "input": "hello"}
CASES = [
    Bad("no_key", OK, 401, "invalid_api_key", key=None),
    Bad("wrong_key", OK, 401, "invalid_api_key", key="sk-nope"),
    Bad("priority_above_the_keys_cap", OK, 403, "priority_above_cap", {"X-Priority": "high"}),
    Bad("priority_field_above_cap", {**OK, "priority": "high"}, 403, "priority_above_cap"),
    Bad("unknown_priority_name", OK, 400, "priority", {"X-Priority": "urgent"}),
    Bad("priority_index_out_of_range", OK, 400, "priority", {"X-Priority": "7"}),
    Bad("priority_wrong_type", {**OK, "priority": [1]}, 400, "priority"),
    # "²".isdigit() is True: int() then raised, and its text reached the client.
    Bad("priority_field_superscript_digit", {**OK, "priority": "²"}, 400, "priority"),
    Bad("invalid_json", "{nope", 400),
    Bad("empty_body", "", 400),
    Bad("body_not_an_object", [1, 2], 400),
    Bad("missing_model", {"input": "x"}, 400, "model"),
    Bad("model_not_a_string", {"model": 5, "input": "x"}, 400, "model"),
    Bad("unknown_model", {"model": "nope", "input": "x"}, 404, "model_not_found"),
    Bad("wrong_task", {"model": "sim", "prompt": "x"}, 400, "wrong_task", path="/v1/completions"),
    Bad("body_too_large", {"model": "sim", "input": "x" * 70_000}, 413),
    Bad("empty_input", {"model": "sim", "input": ""}, 400, "input"),
    Bad("input_a_boolean", {"model": "sim", "input": True}, 400, "input"),
    Bad("priority_a_boolean", {**OK, "priority": True}, 400, "priority"),
    Bad("json_nan", '{"model": "sim", "input": "x", "dimensions": NaN}', 400),
    Bad("lone_surrogate", '{"model": "sim", "input": "\\ud800"}', 400),
]


@pytest.mark.asyncio
async def test_bad_requests_get_4xx_and_the_gateway_keeps_serving(tmp_path: Path) -> None:
    profile = flat_profile(tmp_path / "flat.json", 1.0)
    with sim_worker(profile) as worker:
        data = sim_config(worker.url, keys=_keys(), gateway={"max_request_bytes": 65536})
        async with gateway_client(data, [worker.url], 4) as (client, _):
            for case in CASES:
                headers = dict(case.headers)
                if case.key is not None:
                    headers["Authorization"] = f"Bearer {case.key}"
                raw = case.body if isinstance(case.body, str) else json.dumps(case.body)
                response = await client.post(
                    case.path,
                    content=raw.encode(),
                    headers={"Content-Type": "application/json", **headers},
                )
                _check(response, case)
            ok = await client.post(
                "/v1/embeddings", json=OK, headers={"Authorization": f"Bearer {APP_KEY}"}
            )
            assert ok.status_code == 200
            assert ok.headers["X-Request-Id"].startswith("req-")
            assert float(ok.headers["X-Tidegate-Queue-Ms"]) >= 0
            lowered = await client.post(
                "/v1/embeddings",
                json=OK,
                headers={"Authorization": f"Bearer {APP_KEY}", "X-Priority": "low"},
            )
            assert lowered.status_code == 200  # lowering one's own priority is allowed
            metrics = (await client.get("/metrics")).text
    assert 'tidegate_requests_total{model="sim",outcome="completed",priority="high"} 1.0' in (
        metrics
    )
    assert 'outcome="invalid"' in metrics


def _check(response: httpx.Response, case: Bad) -> None:
    assert response.status_code == case.status, (case.name, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, case.name
    if case.code_or_param is not None:
        assert case.code_or_param in (error["code"], error["param"]), (case.name, error)
    assert "X-Request-Id" in response.headers, case.name
    for leak in LEAKS:
        assert leak not in error["message"], (case.name, error)


# What a client must never read: addresses of replicas, Python's own exception text.
LEAKS = ("http://", "127.0.0.1", "Traceback", "invalid literal", "Error:", "Exception")
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
CHAT_OK = {"model": "sim", "messages": MSG, "max_tokens": 2}
# Issue 11: each of these was a 500, or was read one way by the gateway and another by the
# worker, before the gateway validated requests with the worker's schemas.
GENERATION_CASES = [
    Bad("messages_a_number", {"model": "sim", "messages": 5}, 400, "messages", path=CHAT),
    Bad("messages_a_boolean", {"model": "sim", "messages": True}, 400, "messages", path=CHAT),
    Bad(
        "negative_max_tokens",
        {"model": "sim", "prompt": "hi", "max_tokens": -5},
        400,
        "max_tokens",
        path=CMPL,
    ),
    Bad("max_tokens_a_boolean", {**CHAT_OK, "max_tokens": True}, 400, "max_tokens", path=CHAT),
    Bad("stream_a_string", {**CHAT_OK, "stream": "yes"}, 400, "stream", path=CHAT),
    Bad("n_a_boolean", {**CHAT_OK, "n": True}, 400, "n", path=CHAT),
    Bad(
        "nested_100000_levels",
        '{"model": "sim", "prompt": "hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
        400,
        path=CMPL,
    ),
    Bad(
        "temperature_infinity",
        '{"model": "sim", "prompt": "hi", "temperature": Infinity}',
        400,
        path=CMPL,
    ),
]


@pytest.mark.asyncio
async def test_malformed_generation_requests_get_400_at_the_gateway(tmp_path: Path) -> None:
    profile = flat_profile(tmp_path / "gen.json", 1.0, task="generate")
    with sim_worker(profile) as worker:
        data = sim_config(worker.url, keys=_keys(), model={"task": "generate"})
        async with gateway_client(data, [worker.url], 4) as (client, _):
            for case in GENERATION_CASES:
                raw = case.body if isinstance(case.body, str) else json.dumps(case.body)
                response = await client.post(
                    case.path,
                    content=raw.encode(),
                    headers={
                        "Content-Type": "application/json",
                        "Authorization": f"Bearer {BATCH_KEY}",
                    },
                )
                _check(response, case)
            auth = {"Authorization": f"Bearer {APP_KEY}"}
            ok = await client.post(CHAT, json={**CHAT_OK, "priority": "low"}, headers=auth)
            assert ok.status_code == 200, ok.text
            assert ok.json()["usage"]["completion_tokens"] == 2
            streamed = await client.post(CHAT, json={**CHAT_OK, "stream": True}, headers=auth)
            assert streamed.status_code == 200
            assert streamed.headers["content-type"].startswith("text/event-stream")
            assert streamed.text.endswith("data: [DONE]\n\n")
            metrics = (await client.get("/metrics")).text
    assert 'outcome="failed"' not in metrics


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.asyncio
async def test_unreachable_replicas_answer_502_naming_the_replica_not_its_address() -> None:
    urls = [_closed_port_url(), _closed_port_url()]
    async with gateway_client(sim_config(urls[0]), urls, 1) as (client, _):
        response = await client.post("/v1/embeddings", json=OK)
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "replica_failed"
    assert "replica r" in error["message"]
    for leak in LEAKS:
        assert leak not in error["message"], error


@pytest.mark.asyncio
async def test_requests_sharing_a_client_request_id_are_each_served_and_keep_it(
    tmp_path: Path,
) -> None:
    """X-Request-Id is the client's: concurrent requests that reuse one (a retrying client,
    a constant in its code) are each queued and answered, each echoing it. It once keyed
    the queue, and the second request in flight with it got a 500."""
    import asyncio

    profile = flat_profile(tmp_path / "flat.json", latency_ms=50)
    with sim_worker(profile) as worker:
        async with gateway_client(sim_config(worker.url), [worker.url], slots=1) as (client, _):
            answers = await asyncio.gather(
                *(
                    client.post("/v1/embeddings", json=OK, headers={"X-Request-Id": "same"})
                    for _ in range(4)
                )
            )
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert {a.headers["x-request-id"] for a in answers} == {"same"}
