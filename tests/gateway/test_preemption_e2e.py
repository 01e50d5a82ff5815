"""Fair sharing's preemption end to end: ``tidegate serve`` with a simulated generation model
of two slots, a heavy tenant holding both with long streams, a light one arriving.

The gateway sends the light request past the slots naming the heavy tenant; the worker
pauses one heavy stream at its next token, serves the light one, and resumes the heavy one
from its tokens: its client gets every word once and its full length. Waits are on the
responses themselves, never on wall time.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import yaml

from tests.gateway.harness import flat_profile
from tests.procs import DEADLINE_S, gateway_process

HEAVY_TOKENS = 300  # at 10 ms a token: 3 s a stream, the light one needs a few tokens' time
LIGHT_TOKENS = 4


def _config(folder: Path) -> Path:
    config = {
        "models": [
            {
                "name": "chat",
                "task": "generate",
                "engine": "simulated",
                "profile": str(flat_profile(folder / "chat.json", 10.0, task="generate")),
                "replicas": 1,
                "batching": {"max_num_seqs": 2},
            }
        ],
        "tenancy": {
            "header": "X-Tenant",
            "fair_sharing": True,
            "preemption": True,
            "slot_reserve_fraction": 0.0,
        },
    }
    path = folder / "tidegate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def _stream(
    client: httpx.AsyncClient, tenant: str, max_tokens: int, started: asyncio.Event
) -> tuple[str, str | None]:
    body = {"model": "chat", "prompt": "tide", "max_tokens": max_tokens, "stream": True}
    text, finish = "", None
    async with client.stream(
        "POST", "/v1/completions", json=body, headers={"X-Tenant": tenant}
    ) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            text += choice["text"]
            finish = choice.get("finish_reason") or finish
            started.set()
    return text, finish


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_a_light_tenant_preempts_a_heavy_stream_which_resumes_whole(tmp_path: Path) -> None:
    with gateway_process("--config", str(_config(tmp_path))) as gateway:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=DEADLINE_S) as client:
            started = [asyncio.Event(), asyncio.Event()]
            heavy = [
                asyncio.create_task(_stream(client, "heavy", HEAVY_TOKENS, event))
                for event in started
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), DEADLINE_S)
            light = await client.post(
                "/v1/completions",
                json={"model": "chat", "prompt": "gate", "max_tokens": LIGHT_TOKENS},
                headers={"X-Tenant": "light"},
            )
            assert light.status_code == 200, light.text
            # Answered while both heavy streams (2 slots' worth) were still running.
            assert not any(task.done() for task in heavy)
            assert light.json()["usage"]["completion_tokens"] == LIGHT_TOKENS
            answers = await asyncio.wait_for(asyncio.gather(*heavy), DEADLINE_S)
            replicas = (await client.get("/admin/replicas")).json()["chat"]
            (replica,) = replicas["replicas"]
            stats = (await client.get(f"{replica['url']}/stats")).json()
    for text, finish in answers:
        assert finish == "length"
        assert len(text.split()) == HEAVY_TOKENS  # every word once: none lost or repeated
    assert replicas["tenants"]["preemptions"] == 1
    assert stats["batching"]["preempted"] == 1
    assert stats["batching"]["recomputed_tokens"] >= 1
