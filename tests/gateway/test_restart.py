"""No ready replica: wait for one that is coming, or learn when to come back.

While the only replica restarts, a request waits in the queue (bounded by its level's queue
timeout) instead of getting 503 with a made-up Retry-After; when no replica is coming, the
503 carries the measured start-up time as its Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.gateway.harness import flat_profile, sim_worker
from tests.procs import DEADLINE_S, Proc, gateway_process, wait_for
from tidegate.config import parse_config
from tidegate.core.request import Request as CoreRequest
from tidegate.gateway.app import Gateway, create_gateway_app
from tidegate.gateway.dispatcher import Ticket
from tidegate.gateway.replicas import Replica, ReplicaState

LEVELS_TIMEOUT_S = {"high": 120, "medium": 120, "low": 120}


def _model(profile: Path, **extra: Any) -> dict[str, Any]:
    return {
        "name": "sim",
        "task": "embeddings",
        "engine": "simulated",
        "profile": str(profile),
        "batching": {"batch_window_ms": 0},
        **extra,
    }


def _sim(gateway: Proc) -> dict[str, Any]:
    answer = httpx.get(f"{gateway.url}/admin/replicas", timeout=DEADLINE_S)  # no keys: open
    answer.raise_for_status()
    state: dict[str, Any] = answer.json()["sim"]
    return state


def _embed(url: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/embeddings", json={"model": "sim", "input": "during"}, timeout=DEADLINE_S * 3
    )


def test_requests_during_a_restart_of_the_only_worker_wait_for_it(tmp_path: Path) -> None:
    profile = flat_profile(tmp_path / "flat.json", 10.0)
    config = {"models": [_model(profile, queue={"timeout_s": LEVELS_TIMEOUT_S})]}
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump(config))
    with gateway_process("--config", str(path)) as gateway:
        (before,) = _sim(gateway)["replicas"]
        assert before["state"] == "ready"
        os.killpg(before["pid"], signal.SIGKILL)
        wait_for(lambda: _sim(gateway)["replicas"][0]["state"] != "ready")
        num = 6
        with ThreadPoolExecutor(num) as pool:
            pending = [pool.submit(_embed, gateway.url) for _ in range(num)]
            # Admitted and waiting while nothing is ready: the replica is known to be coming.
            queued: list[int] = []

            def all_queued_or_answered() -> bool:
                queued.append(_sim(gateway)["queued"])
                return queued[-1] == num or any(f.done() for f in pending)

            wait_for(all_queued_or_answered)
            answers = [future.result() for future in pending]
        (after,) = _sim(gateway)["replicas"]
    assert [a.status_code for a in answers] == [200] * num, [a.text for a in answers]
    assert max(queued) == num  # all of them waited for the restart
    assert all(float(a.headers["X-Tidegate-Queue-Ms"]) > 0 for a in answers)
    assert after["restarts"] == 1
    assert after["state"] == "ready"
    assert before["startup_s"] > 0  # measured: from its launch to ready
    assert after["startup_s"] > 0  # and again for the restart


# ----------------------------------------------------------------------------- in process
@contextlib.asynccontextmanager
async def in_process(
    profile: Path, replica: Replica, **queue: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    """The gateway app over one local replica whose state the test sets."""
    config = parse_config({"models": [_model(profile, queue=queue)]}, "<test>")
    gateway = Gateway(config, replicas={"sim": [replica]})
    replica.on_change = gateway.on_replica_change
    app = create_gateway_app(gateway)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=DEADLINE_S
        ) as client,
    ):
        yield client, gateway


async def _post(client: httpx.AsyncClient) -> httpx.Response:
    return await client.post("/v1/embeddings", json={"model": "sim", "input": "x"})


@pytest.mark.asyncio
async def test_no_replica_coming_is_503_with_the_measured_startup_as_retry_after(
    tmp_path: Path,
) -> None:
    profile = flat_profile(tmp_path / "flat.json", 10.0)
    replica = Replica("sim-shared-0", "sim", "shared", "local", None, ReplicaState.STOPPED)
    replica.startup_s = 7.3  # its last start took this long
    async with in_process(profile, replica) as (client, _):
        refused = await _post(client)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "no_ready_replica"
    assert int(refused.headers["Retry-After"]) >= 7.3


@pytest.mark.asyncio
async def test_request_waits_for_a_failed_local_replica_that_restarts(tmp_path: Path) -> None:
    profile = flat_profile(tmp_path / "flat.json", 10.0)
    with sim_worker(profile) as worker:
        replica = Replica("sim-shared-0", "sim", "shared", "local", None, ReplicaState.FAILED)
        async with in_process(profile, replica) as (client, gateway):
            dispatcher = gateway.dispatchers["sim"]
            admitted = asyncio.Event()
            submit = dispatcher.submit

            def submit_and_tell(request: CoreRequest, prefix_key: int | None = None) -> Ticket:
                ticket = submit(request, prefix_key)
                admitted.set()  # admitted, not refused: it waits in the queue
                return ticket

            dispatcher.submit = submit_and_tell
            waiting = asyncio.create_task(_post(client))
            told = asyncio.create_task(admitted.wait())
            await asyncio.wait({waiting, told}, return_when=asyncio.FIRST_COMPLETED)
            told.cancel()
            assert admitted.is_set(), (await waiting).text  # not refused at once
            assert len(dispatcher.queue) == 1
            replica.url = worker.url
            replica.set_state(ReplicaState.READY, "restarted")
            served = await waiting
    assert served.status_code == 200, served.text


@pytest.mark.asyncio
async def test_request_waiting_for_a_replica_that_never_comes_gets_504(tmp_path: Path) -> None:
    profile = flat_profile(tmp_path / "flat.json", 10.0)
    replica = Replica("sim-shared-0", "sim", "shared", "local", None, ReplicaState.STARTING)
    async with in_process(profile, replica, timeout_s={"medium": 0.3}) as (client, _):
        timed_out = await _post(client)
    assert timed_out.status_code == 504
    assert timed_out.json()["error"]["code"] == "queue_timeout"


@pytest.mark.asyncio
async def test_failed_upstream_is_not_waited_for(tmp_path: Path) -> None:
    profile = flat_profile(tmp_path / "flat.json", 10.0)
    replica = Replica(
        "sim-0", "sim", "shared", "upstream", "http://127.0.0.1:9", ReplicaState.FAILED
    )
    async with in_process(profile, replica) as (client, _):
        refused = await _post(client)
    # Nothing restarts an upstream: no start-up to wait for, the health check will see it.
    assert refused.status_code == 503
    assert int(refused.headers["Retry-After"]) >= 1
