"""An engine whose loop died never looks healthy (issue 11).

The worker turns unready for good (``/readyz`` 503 with the reason), answers what it holds
with an OpenAI-shaped error (502 for what ran, 503 ``engine_failed`` for what waited),
refuses new work, counts the failure, logs one line why, and calls ``on_fatal``: the server
exits 1 and ``tidegate serve``'s supervision replaces it. Faults are injected into the
engine's own loop: a forward pass that raises inside transformers' generation thread (in
this process by monkeypatching, in worker processes through ``fault_site/sitecustomize.py``)
and the worker's embedding batch loop. Issue 11's own fault, the empty prompt handed
straight to the manager, is in tests/engines/test_generation.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi import FastAPI

from tests.procs import Proc, gateway_process, wait_for, worker_process
from tidegate.worker import scheduling
from tidegate.worker.app import create_app
from tidegate.worker.runtime import WorkerSettings

FAULT_SITE = Path(__file__).with_name("fault_site")  # its sitecustomize injects the fault
TRIGGER = "inject a fault into the generation loop"
PROMPT = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 50}
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}


# --------------------------------------------------------------------------- helpers
@contextlib.asynccontextmanager
async def served(
    settings: WorkerSettings, on_fatal: Callable[[], None]
) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    """The worker app in this process, once it is ready."""
    app = create_app(settings, on_fatal=on_fatal)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://worker", timeout=60) as client,
    ):

        async def ready() -> bool:
            worker = app.state.worker
            assert worker.phase != "failed", worker.error
            return (await client.get("/readyz")).status_code == 200

        await eventually(ready, timeout_s=180)
        yield client, app


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 60) -> None:
    """Poll a condition (in a test, never in product code), bounded in time."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"condition not met within {timeout_s}s"
        await asyncio.sleep(0.05)


def is_set(event: threading.Event) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return event.is_set()

    return check


def stats_are(client: httpx.AsyncClient, **expected: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        stats = (await client.get("/stats")).json()
        return all(stats[key] == value for key, value in expected.items())

    return check


def openai_error(response: httpx.Response) -> dict[str, Any]:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"]
    return error  # type: ignore[no-any-return]


def sample(metrics: str, name: str) -> float:
    """The value of one series, as ``name{labels}`` appears in the exposition."""
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def total(metrics: str, name: str, label: str) -> float:
    """The sum of every series of ``name`` that carries ``label`` (as ``key="value"``)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name + "{") and label in line
    )


def failure_lines(records: list[logging.LogRecord]) -> list[str]:
    return [
        r.getMessage()
        for r in records
        if r.name == "tidegate.worker" and r.levelno >= logging.ERROR
    ]


@pytest.fixture
def fault_site(monkeypatch: pytest.MonkeyPatch) -> None:
    """Child processes load the fault hook; the trigger prompt breaks their generation loop."""
    path = os.pathsep.join(p for p in (str(FAULT_SITE), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("TIDEGATE_TEST_FAULT_PROMPT", TRIGGER)


# --------------------------------------------------------------------------- in process
@pytest.mark.asyncio
async def test_an_empty_prompt_is_refused_and_generation_goes_on() -> None:
    fatal = threading.Event()
    async with served(WorkerSettings(model="tiny-llama", max_num_seqs=2), fatal.set) as (
        client,
        _,
    ):
        empty = await client.post(
            "/v1/completions", json={"model": "tiny-llama", "prompt": "", "max_tokens": 1}
        )
        assert empty.status_code == 400, empty.text
        error = openai_error(empty)
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error",
            "prompt",
            "empty_prompt",
        )
        assert (await client.post("/v1/completions", json=PROMPT)).status_code == 200
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await client.get("/readyz")).status_code == 200
    assert not fatal.is_set()


@pytest.mark.asyncio
async def test_a_generation_loop_that_dies_fails_what_it_holds_and_the_worker_for_good(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fatal = threading.Event()
    async with served(WorkerSettings(model="tiny-llama", max_num_seqs=2), fatal.set) as (
        client,
        app,
    ):
        gate = threading.Event()

        def broken_forward(*args: object, **kwargs: object) -> None:
            gate.wait(120)  # hold the generation thread in its step while requests pile up
            raise RuntimeError("injected fault in the generation loop")

        monkeypatch.setattr(app.state.worker.engine._model, "forward", broken_forward)
        try:
            streamed = asyncio.create_task(
                client.post("/v1/completions", json=PROMPT | {"stream": True})
            )
            whole = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
            await eventually(stats_are(client, running=2))
            waiting = asyncio.create_task(client.post("/v1/completions", json=PROMPT))
            await eventually(stats_are(client, running=2, queued=1))
        finally:
            gate.set()
        answers = await asyncio.wait_for(asyncio.gather(streamed, whole, waiting), 60)

        # What ran fails (the reason in the log, not the answer); what waited gets 502 or
        # 503, never a hang.
        for response in answers[:2]:
            assert response.status_code == 502, response.text
            error = openai_error(response)
            assert error["type"] == "upstream_error"
            assert "injected fault" not in error["message"]
        assert answers[2].status_code in {502, 503}, answers[2].text
        openai_error(answers[2])

        # The worker says it is done, and asks to be replaced.
        await eventually(is_set(fatal))
        readyz = await client.get("/readyz")
        assert readyz.status_code == 503
        assert readyz.json()["status"] == "failed"
        assert "injected fault" in readyz.json()["error"]
        again = await client.post("/v1/completions", json=PROMPT)
        assert again.status_code == 503
        assert openai_error(again)["code"] == "engine_failed"
        assert again.headers["Retry-After"] == "1"
        metrics = (await client.get("/metrics")).text
        assert sample(metrics, 'tidegate_worker_engine_failures_total{model="tiny-llama"}') == 1
        assert sample(metrics, 'tidegate_worker_ready{model="tiny-llama"}') == 0
        assert total(metrics, "tidegate_requests_total", 'outcome="failed"') >= 3
    (line,) = failure_lines(caplog.records)
    assert "engine failed" in line
    assert "injected fault in the generation loop" in line


@pytest.mark.asyncio
async def test_an_embedding_batch_loop_that_dies_fails_the_worker_for_good(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fatal = threading.Event()
    settings = WorkerSettings(model="emb", engine="simulated", task="embeddings")
    async with served(settings, fatal.set) as (client, _):

        def broken_plan(*args: object, **kwargs: object) -> None:
            raise RuntimeError("injected fault in the batch loop")

        # The loop's next iteration, woken by this request, dies.
        monkeypatch.setattr(scheduling, "plan_batch", broken_plan)
        body = {"model": "emb", "input": ["tide", "gate"]}
        response = await asyncio.wait_for(client.post("/v1/embeddings", json=body), 30)
        assert response.status_code == 503, response.text
        error = openai_error(response)
        assert error["code"] == "engine_failed"
        assert "injected fault" not in error["message"]  # Python's text stays in the log

        await eventually(is_set(fatal))
        readyz = await client.get("/readyz")
        assert readyz.status_code == 503
        assert "injected fault in the batch loop" in readyz.json()["error"]
        later = await asyncio.wait_for(client.post("/v1/embeddings", json=body), 30)
        assert later.status_code == 503
        assert openai_error(later)["code"] == "engine_failed"
        metrics = (await client.get("/metrics")).text
        assert sample(metrics, 'tidegate_worker_engine_failures_total{model="emb"}') == 1
        assert sample(metrics, 'tidegate_worker_ready{model="emb"}') == 0
    (line,) = failure_lines(caplog.records)
    assert "batch loop died" in line


# --------------------------------------------------------------------------- real processes
@pytest.mark.e2e
@pytest.mark.usefixtures("fault_site")
def test_a_worker_whose_generation_loop_dies_exits_1_and_says_why(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with (
        worker_process("--model", "tiny-llama", "--max-num-seqs", "4") as worker,
        httpx.Client(base_url=worker.url, timeout=60) as http,
    ):
        # Greedy from "hi": 960 tokens before its end of sequence, seconds of work.
        long = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 1000, "temperature": 0}
        with http.stream("POST", "/v1/completions", json=long | {"stream": True}) as stream:
            events = (line for line in stream.iter_lines() if line.startswith("data: "))
            assert "choices" in json.loads(next(events).removeprefix("data: "))
            broken = http.post(
                "/v1/completions", json={"model": "tiny-llama", "prompt": TRIGGER, "max_tokens": 5}
            )
            rest = list(events)
        assert broken.status_code == 502, broken.text
        assert "injected fault" not in openai_error(broken)["message"]
        # The stream in flight ends with an error event, then [DONE].
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["error"]["type"] == "upstream_error"
        wait_for(lambda: not _ready(worker), timeout_s=30)
        assert worker.process.wait(timeout=60) == 1
    lines = [line for line in capfd.readouterr().err.splitlines() if "tidegate.worker" in line]
    (line,) = [line for line in lines if " ERROR " in line]
    assert "engine failed" in line
    assert "injected fault in the generation loop" in line


@pytest.mark.e2e
@pytest.mark.usefixtures("fault_site")
def test_serve_replaces_a_worker_whose_generation_loop_died(tmp_path: Path) -> None:
    config = tmp_path / "tidegate.yaml"
    model = {"name": "tiny-llama", "task": "generate", "engine": "transformers", "replicas": 1}
    config.write_text(yaml.safe_dump({"models": [model]}))
    with (
        gateway_process("--config", str(config)) as gateway,
        httpx.Client(base_url=gateway.url, timeout=60) as http,
    ):
        # The empty prompt of the issue is refused; the model answers on.
        empty = http.post(
            "/v1/completions", json={"model": "tiny-llama", "prompt": "", "max_tokens": 1}
        )
        assert empty.status_code == 400, empty.text
        assert openai_error(empty)["param"] == "prompt"
        assert http.post("/v1/completions", json=PROMPT).status_code == 200
        assert _replica(http)["restarts"] == 0

        # A loop that dies anyway: the request gets an error, the worker exits 1, the gateway
        # shows it (not ready, the replica failed) and restarts it.
        broken = http.post(
            "/v1/completions", json={"model": "tiny-llama", "prompt": TRIGGER, "max_tokens": 5}
        )
        assert broken.status_code in {502, 503}, broken.text
        openai_error(broken)
        seen: list[dict[str, Any]] = []

        def failed() -> bool:
            seen.append(_replica(http))
            return seen[-1]["state"] == "failed"

        wait_for(failed, timeout_s=60)
        assert "status 1" in str(seen[-1]["detail"])
        assert http.get("/readyz").status_code == 503  # failed for at least its 1 s back-off
        wait_for(
            lambda: _replica(http)["restarts"] == 1 and _replica(http)["state"] == "ready",
            timeout_s=180,
        )
        assert http.get("/readyz").status_code == 200
        answer = http.post("/v1/completions", json=PROMPT)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] >= 1


def _ready(proc: Proc) -> bool:
    try:
        return httpx.get(f"{proc.url}/readyz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False  # it has closed its socket: on its way out


def _replica(http: httpx.Client) -> dict[str, Any]:
    (replica,) = http.get("/admin/replicas").json()["tiny-llama"]["replicas"]
    return replica  # type: ignore[no-any-return]
