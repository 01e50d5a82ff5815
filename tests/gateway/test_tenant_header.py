"""The gateway tells tidegate's own generation workers whose request it is
(``X-Tidegate-Tenant``, next to ``X-Tidegate-Priority``): their sequence queue shares a
level by it. Not to an ``openai`` upstream, and not for the anonymous tenant.

The replica is a raw asyncio server in this process that records each request's head.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.gateway.test_proxy_client import replica, whole
from tidegate.config import parse_config
from tidegate.gateway.app import Gateway, create_gateway_app
from tidegate.gateway.replicas import Replica, ReplicaState

CHAT = (
    b'{"id":"chatcmpl-1","object":"chat.completion","created":0,"model":"gen","choices":'
    b'[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)


async def chat_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
    writer.write(whole(CHAT))
    await writer.drain()


@contextlib.asynccontextmanager
async def gateway_to(url: str, model: dict[str, Any]) -> AsyncIterator[httpx.AsyncClient]:
    config = parse_config({"tenancy": {"header": "X-Tenant"}, "models": [model]}, "<test>")
    spec = config.model("gen")
    kind = "local" if spec.local else "upstream"
    ready = Replica("r0", "gen", spec.pools[0], kind, url, ReplicaState.READY, 4)
    app = create_gateway_app(Gateway(config, replicas={"gen": [ready]}))
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as client,
    ):
        yield client


LOCAL = {"name": "gen", "task": "generate", "engine": "simulated", "replicas": 0}


@pytest.mark.parametrize(
    ("model", "headers", "forwarded"),
    [
        (LOCAL, {"X-Tenant": "team-a"}, b"x-tidegate-tenant: team-a\r\n"),
        (LOCAL, {}, None),  # the anonymous tenant: no header
        ({"name": "gen", "task": "generate", "engine": "openai"}, {"X-Tenant": "team-a"}, None),
    ],
    ids=["own_worker_gets_the_tenant", "anonymous_sends_none", "openai_upstream_gets_none"],
)
@pytest.mark.asyncio
async def test_the_tenant_goes_to_tidegates_own_workers_only(
    model: dict[str, Any], headers: dict[str, str], forwarded: bytes | None
) -> None:
    async with replica(chat_answer) as rep:
        if model["engine"] == "openai":
            model = {**model, "upstreams": [rep.url]}
        async with gateway_to(rep.url, model) as client:
            answer = await client.post(
                "/v1/chat/completions",
                json={"model": "gen", "messages": [{"role": "user", "content": "hi"}]},
                headers=headers,
            )
        assert answer.status_code == 200, answer.text
        ((head, _),) = rep.requests
    assert b"x-tidegate-priority: medium\r\n" in head
    if forwarded is None:
        assert b"x-tidegate-tenant" not in head
    else:
        assert forwarded in head
