"""The proxy route served straight by the proxy loop (``GatewayApp`` → ``serve_proxy``),
outside FastAPI's error handlers: a bug still gets the OpenAI-shaped 500 and is counted."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from tests.gateway.harness import gateway_client, sim_config

SECRET = "replica at 10.1.2.3:8000 said no"  # what a client must never read


@pytest.mark.asyncio
async def test_a_bug_in_the_proxy_loop_is_a_counted_500_that_says_nothing_of_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # No replica is ever reached: the request fails at submit.
    async with gateway_client(sim_config("http://127.0.0.1:9"), ["http://127.0.0.1:9"], 1) as (
        client,
        gateway,
    ):

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError(SECRET)

        gateway.dispatchers["sim"].submit = broken  # type: ignore[method-assign,assignment]
        answer = await client.post("/v1/embeddings", json={"model": "sim", "input": "tide"})
        exposition = generate_latest(gateway.metrics.registry).decode()
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert "internal error" in error["message"]
    assert SECRET not in answer.text
    assert SECRET in caplog.text  # the log has the traceback
    counted = 'tidegate_requests_total{model="sim",outcome="failed",priority="'
    assert counted in exposition
