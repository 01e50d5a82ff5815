"""A worker whose engine runs in a process of its own (``--engine-process``).

The engine process dying is the engine dying: the worker turns unready for good, fails what
it holds, and exits 1 to be replaced. A worker stopped as usual (SIGTERM to its process
group, as supervisors do) stops its engine process too, exits 0 and logs no failure; a
worker killed outright takes its engine process with it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import httpx
import pytest

from tests.procs import Proc, children, gone, wait_for, worker_process
from tests.worker.test_engine_failure import (
    eventually,
    is_set,
    openai_error,
    sample,
    served,
    stats_are,
)
from tidegate.worker.runtime import WorkerSettings

EMBED = {"model": "minilm", "input": ["tide", "gate"], "encoding_format": "base64"}
SIMULATED = ("--model", "emb", "--engine", "simulated", "--task", "embeddings")


def engine_process(worker: Proc) -> int:
    (pid,) = children(worker.process.pid)
    return pid


@pytest.mark.asyncio
async def test_a_killed_engine_process_fails_what_it_held_and_the_worker_for_good() -> None:
    fatal = threading.Event()
    settings = WorkerSettings(
        model="emb", engine="simulated", task="embeddings", engine_process=True
    )
    async with served(settings, fatal.set) as (client, app):
        pid = app.state.worker.engine.pid
        body = {"model": "emb", "input": ["tide", "gate"]}
        assert (await client.post("/v1/embeddings", json=body)).status_code == 200

        os.kill(pid, signal.SIGSTOP)  # the batch below stays on the engine
        try:
            held = asyncio.create_task(client.post("/v1/embeddings", json=body))
            await eventually(stats_are(client, running=2))
        finally:
            os.kill(pid, signal.SIGKILL)
        response = await asyncio.wait_for(held, 60)
        assert response.status_code in {502, 503}, response.text
        openai_error(response)

        await eventually(is_set(fatal))
        readyz = await client.get("/readyz")
        assert readyz.status_code == 503
        assert readyz.json()["status"] == "failed"
        assert "killed by SIGKILL" in readyz.json()["error"]
        later = await client.post("/v1/embeddings", json=body)
        assert later.status_code == 503
        assert openai_error(later)["code"] == "engine_failed"
        metrics = (await client.get("/metrics")).text
        assert sample(metrics, 'tidegate_worker_engine_failures_total{model="emb"}') == 1


@pytest.mark.e2e
def test_a_worker_whose_engine_process_is_killed_exits_1_and_says_why(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # The simulated engine in the engine process: how the worker learns of its death and
    # exits is the same for any engine (the SIGTERM test below keeps the real model).
    with (
        worker_process(*SIMULATED, "--engine-process") as worker,
        httpx.Client(base_url=worker.url, timeout=60) as http,
    ):
        answer = http.post("/v1/embeddings", json={**EMBED, "model": "emb"})
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["data"]) == 2
        os.kill(engine_process(worker), signal.SIGKILL)
        assert worker.process.wait(timeout=60) == 1
    errors = [line for line in capfd.readouterr().err.splitlines() if " ERROR " in line]
    assert any("engine failed" in line and "killed by SIGKILL" in line for line in errors), errors


@pytest.mark.e2e
def test_sigterm_stops_the_worker_and_its_engine_process_cleanly(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with worker_process("--model", "minilm", "--engine-process") as worker:
        child = engine_process(worker)
        assert httpx.post(f"{worker.url}/v1/embeddings", json=EMBED, timeout=60).status_code == 200
        os.killpg(worker.process.pid, signal.SIGTERM)  # the whole group, as supervisors do
        # uvicorn raises the signal it caught again once it has shut down: status -15 is a
        # clean stop (a worker whose engine failed exits 1).
        assert worker.process.wait(timeout=60) in (0, -signal.SIGTERM)
        wait_for(lambda: gone(child))
    assert " ERROR " not in capfd.readouterr().err


@pytest.mark.e2e
def test_the_engine_process_does_not_outlive_a_killed_worker() -> None:
    with worker_process(*SIMULATED, "--engine-process") as worker:
        child = engine_process(worker)
        worker.process.kill()  # the worker alone: nobody closes the engine process
        worker.process.wait(timeout=60)
        wait_for(lambda: gone(child))
