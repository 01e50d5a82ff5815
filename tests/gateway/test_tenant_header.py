"""The gateway tells tidegate's own generation workers whose request it is
(``X-Tidegate-Tenant``, next to ``X-Tidegate-Priority``): their sequence queue shares a
level by it. Not to an ``openai`` upstream unless it says its upstreams are tidegate workers
(``upstream_workers``, as a gateway rendered for Kubernetes does), and not for the anonymous
tenant.

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
OPENAI = {"name": "gen", "task": "generate", "engine": "openai"}


@pytest.mark.parametrize(
    ("model", "headers", "forwarded"),
    [
        (LOCAL, {"X-Tenant": "team-a"}, b"x-tidegate-tenant: team-a\r\n"),
        (LOCAL, {}, None),  # the anonymous tenant: no header
        (OPENAI, {"X-Tenant": "team-a"}, None),
        (
            {**OPENAI, "upstream_workers": True},
            {"X-Tenant": "team-a"},
            b"x-tidegate-tenant: team-a\r\n",
        ),
    ],
    ids=[
        "own_worker_gets_the_tenant",
        "anonymous_sends_none",
        "openai_upstream_gets_none",
        "upstream_workers_get_the_tenant",
    ],
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


@pytest.mark.parametrize(
    ("model", "status"),
    [(OPENAI, 200), ({**OPENAI, "upstream_workers": True}, 400)],
    ids=["openai_upstream_takes_n_2", "upstream_workers_refuse_it_at_the_gateway"],
)
@pytest.mark.asyncio
async def test_requests_to_upstream_workers_are_checked_with_the_workers_schema(
    model: dict[str, Any], status: int
) -> None:
    """``n: 2`` is valid OpenAI but not what a tidegate worker serves: refused before it
    queues when the upstreams are tidegate workers, passed on to any other upstream."""
    async with replica(chat_answer) as rep:
        async with gateway_to(rep.url, {**model, "upstreams": [rep.url]}) as client:
            answer = await client.post(
                "/v1/chat/completions",
                json={"model": "gen", "n": 2, "messages": [{"role": "user", "content": "hi"}]},
            )
        assert answer.status_code == status, answer.text
        assert len(rep.requests) == (1 if status == 200 else 0)
