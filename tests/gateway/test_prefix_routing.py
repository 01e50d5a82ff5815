"""Prefix-affinity routing in the gateway (``routing: {policy: prefix_affinity}``): chats that
share a system prompt go to one replica while its load allows; other prefixes spread."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import flat_profile, gateway_client, sim_worker
from tests.procs import DEADLINE_S

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
