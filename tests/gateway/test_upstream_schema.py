"""A vLLM-like upstream takes more of the OpenAI API than tidegate's own engines.

The gateway checks what it reads itself (model, priority, stream, output tokens) as
strictly for every model, and leaves the rest of an upstream model's request to the server.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.faults.test_faults import upstream
from tests.gateway.harness import gateway_client

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
MORE_THAN_OUR_ENGINES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [IMAGE]}]}),
    ("/v1/completions", {"prompt": [[1, 2, 3]], "max_tokens": 2}),
    ("/v1/completions", {"prompt": ["one", "two"], "max_tokens": 2}),
]
STILL_REFUSED = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}),
    ("/v1/chat/completions", {"messages": 5}),
    ("/v1/completions", {"prompt": "hi", "n": True}),
]


def _config(url: str) -> dict[str, Any]:
    model = {"name": "up", "task": "generate", "engine": "openai", "upstreams": [url]}
    return {"models": [model]}


@pytest.mark.asyncio
async def test_upstream_models_take_more_of_the_api_but_not_what_the_gateway_reads() -> None:
    with upstream("ok") as (url, _):
        async with gateway_client(_config(url), [url], 4) as (client, _gateway):
            for path, body in MORE_THAN_OUR_ENGINES:
                response = await client.post(path, json={"model": "up", **body})
                assert response.status_code == 200, (body, response.text)
            for path, body in STILL_REFUSED:
                response = await client.post(path, json={"model": "up", **body})
                assert response.status_code == 400, (body, response.text)
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
