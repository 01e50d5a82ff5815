"""Prefix-affinity routing in the gateway (``routing: {policy: prefix_affinity}``): chats that
share a system prompt go to one replica while its load allows; other prefixes spread; the
dispatcher counts each replica's tokens in flight for the bound in tokens."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tests.gateway.harness import flat_profile, gateway_client, sim_worker
from tests.procs import DEADLINE_S
from tidegate.core.prefix import PrefixAffinity, build_ring
from tidegate.core.queue import QueueConfig
from tidegate.core.request import Request
from tidegate.core.routing import PoolSpec
from tidegate.gateway.dispatcher import ModelDispatcher
from tidegate.gateway.replicas import Replica, ReplicaState
from tidegate.metrics import GatewayMetrics

BLOCK = 64  # characters per prefix block in these tests


def _completed(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=DEADLINE_S).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tidegate_requests_total{") and 'outcome="completed"' in line
    )


def _chat(system: str, question: str) -> dict[str, object]:
    return {
        "model": "sim",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 2,
    }


@pytest.mark.asyncio
async def test_a_shared_system_prompt_stays_on_one_replica(tmp_path: Path) -> None:
    profile = flat_profile(tmp_path / "chat.json", 1.0, task="generate")
    with sim_worker(profile) as first, sim_worker(profile) as second:
        urls = [first.url, second.url]
        model = {
            "name": "sim",
            "task": "generate",
            "engine": "openai",
            "upstreams": urls,
            "routing": {"policy": "prefix_affinity", "block_chars": BLOCK, "num_blocks": 2},
        }
        async with gateway_client({"models": [model]}, urls, 4) as (client, _):
            system = "You answer questions about tides. " * 8  # several whole blocks
            for question in range(12):  # one at a time: the preferred replica is never full
                answer = await client.post(
                    "/v1/chat/completions", json=_chat(system, f"question {question}")
                )
                assert answer.status_code == 200, answer.text
            counts = sorted(_completed(url) for url in urls)
            assert counts == [0.0, 12.0]  # every one where the prefix's cache would be
            for prompt in range(16):  # other system prompts spread over both replicas
                system = f"Assistant number {prompt} of the harbour office. " * 4
                answer = await client.post("/v1/chat/completions", json=_chat(system, "hi"))
                assert answer.status_code == 200, answer.text
            after = [_completed(url) for url in urls]
    assert sum(after) == 28
    assert min(after) > min(counts)


@pytest.mark.asyncio
@pytest.mark.parametrize("token_bound", [True, False])
async def test_the_dispatcher_counts_tokens_in_flight_for_the_bound(token_bound: bool) -> None:
    """A replica holding a long prompt is passed over for its key's next short request while
    the tokens are bounded (request counts alone would take it); release and retry give the
    tokens back."""
    replicas = [
        Replica(rid, "m", "shared", "upstream", "http://unused", ReplicaState.READY, 8)
        for rid in ("r0", "r1")
    ]
    dispatcher = ModelDispatcher(
        "m",
        QueueConfig(),
        {"shared": PoolSpec("shared", frozenset({0, 1, 2}))},
        replicas,
        GatewayMetrics(CollectorRegistry()),
        affinity=PrefixAffinity(token_bound=token_bound),
    )
    key = 12345
    owner = next(r for r in replicas if r.id == build_ring(["r0", "r1"]).owner(key))
    other = next(r for r in replicas if r is not owner)
    long = dispatcher.submit(Request("long", "m", 1, 0.0, None, 40_000), prefix_key=key)
    assert long.assigned.result() is owner
    assert owner.tokens == 40_000
    assert owner.view().tokens == 40_000
    short = dispatcher.submit(Request("short", "m", 1, 0.0, None, 500), prefix_key=key)
    # tokens: 40,000 <= 1.25 * 40,500 / 2 = 25,312 does not hold; requests: 2 <= 2.25 does
    assert short.assigned.result() is (other if token_bound else owner)
    assert owner.tokens + other.tokens == 40_500
    dispatcher.release(long.assigned.result(), completed=True, request=long.request)
    assert owner.tokens == (0 if token_bound else 500)
    again = dispatcher.retry(short, short.assigned.result())
    dispatcher.release(again.assigned.result(), completed=True, request=again.request)
    assert owner.tokens == other.tokens == 0
    assert owner.in_flight == other.in_flight == 0
