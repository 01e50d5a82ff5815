"""An in-process gateway over real worker processes: for scheduling behaviour tests."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.procs import Proc, worker_process
from tidegate.config import parse_config
from tidegate.gateway.app import Gateway, create_gateway_app
from tidegate.gateway.replicas import Replica, ReplicaState


def flat_profile(path: Path, latency_ms: float, task: str = "embeddings") -> Path:
    """A simulated model whose batches take the same time whatever their size."""
    if task == "embeddings":
        points = [
            {"batch_size": 1, "latency_ms": latency_ms},
            {"batch_size": 64, "latency_ms": latency_ms},
        ]
    else:
        points = [{"concurrency": 1, "ttft_ms": latency_ms, "itl_ms": latency_ms}]
    path.write_text(
        json.dumps({"version": 1, "model": "sim", "task": task, task: {"points": points}})
    )
    return path


@contextlib.contextmanager
def sim_worker(profile: Path, *extra: str) -> Iterator[Proc]:
    with worker_process(
        "--model",
        "sim",
        "--engine",
        "simulated",
        "--profile",
        str(profile),
        "--batch-window-ms",
        "0",
        *extra,
    ) as proc:
        yield proc


def sim_config(url: str, **sections: Any) -> dict[str, Any]:
    model = {"name": "sim", "task": "embeddings", "engine": "openai", "upstreams": [url]}
    model.update(sections.pop("model", {}))
    return {"models": [model], **sections}


@contextlib.asynccontextmanager
async def gateway_client(
    data: dict[str, Any], urls: list[str], slots: int
) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    """The gateway app in this process, its replicas READY at ``urls``."""
    config = parse_config(data, "<test>")
    (model,) = config.models
    pool = config.model(model).upstream_pool
    replicas = [
        Replica(f"r{i}", model, pool, "upstream", url, ReplicaState.READY, slots)
        for i, url in enumerate(urls)
    ]
    gateway = Gateway(config, replicas={model: replicas})
    app = create_gateway_app(gateway)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as client,
    ):
        yield client, gateway
