"""The fault suite: real processes, real faults, and an account of every request.

Each test breaks something under load and then checks the two promises of the serving path:
every request got exactly one HTTP answer (a status code; a stream that ends with
``[DONE]``, after an error event when it was cut), and the gateway counted each one exactly
once in ``tidegate_requests_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.faults.accounting import Answer, counted_since, fire, scrape
from tests.procs import Proc, child_env, gateway_process, stop, wait_for
from tests.worker.test_engine_failure import TRIGGER, fault_site  # noqa: F401 (a fixture)

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"


@contextlib.contextmanager
def upstream(mode: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """The scriptable upstream of tests/faults/upstream.py, in a process of its own."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.faults.upstream", "--mode", mode],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=Path(__file__).parents[2],
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        yield url, process
    finally:
        stop(process)


def write_config(tmp_path: Path, models: list[dict[str, Any]], **extra: Any) -> str:
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump({"models": models, **extra}))
    return str(path)


def upstream_model(name: str, urls: list[str], **extra: Any) -> dict[str, Any]:
    return {"name": name, "task": "generate", "engine": "openai", "upstreams": urls, **extra}


def sim_profile(tmp_path: Path, latency_ms: float) -> str:
    path = tmp_path / "profile.json"
    points = [{"batch_size": 1, "latency_ms": latency_ms}, {"batch_size": 64, "latency_ms": 5}]
    path.write_text(
        json.dumps(
            {"version": 1, "model": "sim", "task": "embeddings", "embeddings": {"points": points}}
        )
    )
    return str(path)


def chat(stream: bool = False) -> dict[str, object]:
    return {
        "model": "up",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": stream,
    }


def assert_all_answered_and_counted(
    answers: list[Answer], gateway: Proc, model: str, before: Any
) -> Any:
    missing = [a for a in answers if a.status is None]
    assert not missing, f"{len(missing)} requests got no HTTP answer: {missing[:3]}"
    cut = [a for a in answers if a.status == 200 and a.stream_events and not a.stream_ended_cleanly]
    assert not cut, f"{len(cut)} streams did not end with [DONE]: {cut[:3]}"
    counted = counted_since(before, scrape(gateway.url, model))
    assert sum(counted.values()) == len(answers), (counted, len(answers))
    return counted


def test_upstream_answering_500_is_answered_and_counted(tmp_path: Path) -> None:
    with (
        upstream("fail") as (url, _),
        gateway_process("--config", write_config(tmp_path, [upstream_model("up", [url])])) as gw,
    ):
        before = scrape(gw.url, "up")
        answers = asyncio.run(
            fire(gw.url, CHAT, [chat(i % 2 == 0) for i in range(40)], concurrency=8)
        )
        counted = assert_all_answered_and_counted(answers, gw, "up", before)
        # The upstream's own 500 passes through (as Envoy and vLLM's router do); a replica
        # ejected for failing answers 503 with Retry-After.
        assert {a.status for a in answers} <= {500, 502, 503}, {a.status for a in answers}
        assert counted["failed"] + counted["rejected_unavailable"] == 40, counted
        # The bodies say what failed without naming where the upstream lives.
        assert all(url not in a.body.decode() for a in answers)


def test_upstream_killed_mid_stream_ends_every_stream_with_an_error_then_done(
    tmp_path: Path,
) -> None:
    with (
        upstream("die-mid-stream") as (dying, _),
        upstream("ok") as (healthy, _),
        gateway_process(
            "--config", write_config(tmp_path, [upstream_model("up", [dying, healthy])])
        ) as gw,
    ):
        before = scrape(gw.url, "up")
        answers = asyncio.run(fire(gw.url, CHAT, [chat(True) for _ in range(20)], concurrency=4))
        counted = assert_all_answered_and_counted(answers, gw, "up", before)
        cut = [a for a in answers if any('"error"' in e for e in a.stream_events)]
        assert cut, "no stream reached the dying upstream"
        for answer in cut:
            assert answer.stream_events[-2].startswith('{"error"'), answer.stream_events
        assert counted["failed"] == len(cut), counted
        assert counted["completed"] == len(answers) - len(cut), counted


def test_upstream_dying_before_it_answers_has_its_request_retried_elsewhere(
    tmp_path: Path,
) -> None:
    """ARCHITECTURE: a crashed replica's in-flight requests that had not started streaming
    are retried once on another replica. The upstream dies on the first request it gets."""
    with (
        upstream("die-before-answer") as (dying, process),
        upstream("ok") as (healthy, _),
        gateway_process(
            "--config", write_config(tmp_path, [upstream_model("up", [dying, healthy])])
        ) as gw,
    ):
        before = scrape(gw.url, "up")
        answers = asyncio.run(fire(gw.url, CHAT, [chat() for _ in range(20)], concurrency=4))
        assert process.wait(timeout=30) == 17, "no request reached the dying upstream"
        counted = assert_all_answered_and_counted(answers, gw, "up", before)
        assert [a.status for a in answers] == [200] * 20, [(a.status, a.body) for a in answers]
        assert counted["completed"] == 20, counted


def test_worker_killed_under_load_every_request_answered_and_counted(tmp_path: Path) -> None:
    model = {
        "name": "sim",
        "task": "embeddings",
        "engine": "simulated",
        "profile": sim_profile(tmp_path, 20.0),
        "replicas": 2,
        "batching": {"max_batch_size": 8, "batch_window_ms": 0},
    }
    with gateway_process("--config", write_config(tmp_path, [model])) as gw:
        before = scrape(gw.url, "sim")
        payloads: list[dict[str, object]] = [{"model": "sim", "input": "x"} for _ in range(300)]
        started = asyncio.Event()

        async def load_and_kill() -> list[Answer]:
            work = asyncio.ensure_future(
                fire(gw.url, "/v1/embeddings", payloads, concurrency=16, started=started)
            )
            await started.wait()
            replicas = await asyncio.to_thread(_replicas, gw, "sim")
            os.killpg(replicas[0]["pid"], signal.SIGKILL)
            return await work

        answers = asyncio.run(load_and_kill())
        counted = assert_all_answered_and_counted(answers, gw, "sim", before)
        assert {a.status for a in answers} <= {200, 502, 503}, counted
        wait_for(lambda: all(r["state"] == "ready" for r in _replicas(gw, "sim")), timeout_s=120)
        assert (
            httpx.post(f"{gw.url}/v1/embeddings", json=payloads[0], timeout=60).status_code == 200
        )


def test_clients_that_go_away_mid_stream_are_counted_cancelled(tmp_path: Path) -> None:
    with (
        upstream("ok") as (url, _),
        gateway_process("--config", write_config(tmp_path, [upstream_model("up", [url])])) as gw,
    ):
        before = scrape(gw.url, "up")

        async def read_one_event_then_leave() -> None:
            async with (
                httpx.AsyncClient(base_url=gw.url, timeout=60) as client,
                client.stream("POST", CHAT, json=chat(True)) as response,
            ):
                async for _ in response.aiter_lines():
                    break

        async def many() -> None:
            await asyncio.gather(*(read_one_event_then_leave() for _ in range(10)))

        asyncio.run(many())
        wait_for(lambda: sum(counted_since(before, scrape(gw.url, "up")).values()) == 10)
        counted = counted_since(before, scrape(gw.url, "up"))
        assert set(counted) <= {"completed", "cancelled"}, counted


@pytest.mark.usefixtures("fault_site")
def test_engine_loop_dying_under_load_every_request_answered_and_counted(tmp_path: Path) -> None:
    model = {"name": "tiny-llama", "task": "generate", "engine": "transformers", "replicas": 1}
    with gateway_process("--config", write_config(tmp_path, [model])) as gw:
        before = scrape(gw.url, "tiny-llama")

        def completion(prompt: str) -> dict[str, object]:
            return {"model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0}

        # The trigger breaks the loop with sequences of the same batch in flight; what comes
        # after it waits for the replacement worker (or is refused with Retry-After).
        prompts = ["tide"] * 8 + [TRIGGER] + ["gate"] * 15
        payloads = [completion(p) | {"stream": i % 3 == 0} for i, p in enumerate(prompts)]
        answers = asyncio.run(fire(gw.url, "/v1/completions", payloads, concurrency=4))
        counted = assert_all_answered_and_counted(answers, gw, "tiny-llama", before)
        assert {a.status for a in answers} <= {200, 502, 503}, counted
        assert answers[8].status in {502, 503} or answers[8].stream_events[-2].startswith(
            '{"error"'
        ), answers[8]
        wait_for(lambda: _replicas(gw, "tiny-llama")[0]["restarts"] >= 1, timeout_s=120)
        wait_for(lambda: _replicas(gw, "tiny-llama")[0]["state"] == "ready", timeout_s=240)
        again = httpx.post(f"{gw.url}/v1/completions", json=completion("tide"), timeout=120)
        assert again.status_code == 200, again.text


def _replicas(gateway: Proc, model: str) -> list[dict[str, Any]]:
    state = httpx.get(f"{gateway.url}/admin/replicas", timeout=30).json()
    return state[model]["replicas"]  # type: ignore[no-any-return]
