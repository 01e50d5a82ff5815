"""tidegate serve as a user meets it: real processes, the official openai client."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.procs import DEADLINE_S, Proc, gateway_process, wait_for

KEY = "sk-test-interactive"
BATCH_KEY = "sk-test-batch"


def client(proc: Proc, key: str = "unused") -> openai.OpenAI:
    """Use it in a ``with`` block: it closes its connections there (an unclosed socket is a
    ResourceWarning, an error in this suite)."""
    return openai.OpenAI(base_url=f"{proc.url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def embedded(smollm2_folder: Path) -> Iterator[Proc]:
    """The embedded default: minilm and smollm2, one local worker each."""
    with gateway_process() as proc:
        yield proc


def test_embedded_default_serves_embeddings_completions_chat_and_streams(
    embedded: Proc,
) -> None:
    with client(embedded) as c:
        assert {m.id for m in c.models.list().data} == {"minilm", "smollm2"}
        vectors = c.embeddings.create(model="minilm", input=["tide", "gate"]).data
        assert len(vectors) == 2
        assert len(vectors[0].embedding) == 384
        completion = c.completions.create(
            model="smollm2", prompt="Hi", max_tokens=5, temperature=0.0
        )
        assert completion.usage.completion_tokens <= 5
        chat = c.chat.completions.with_raw_response.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8,
            temperature=0,
            extra_headers={"X-Priority": "high"},
        )
        assert chat.headers["x-request-id"].startswith("req-")
        assert float(chat.headers["x-tidegate-queue-ms"]) >= 0
        message = chat.parse().choices[0].message
        assert message.role == "assistant"
        assert "Paris" in (message.content or "")  # the README's first chat is a real answer
        stream = c.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            stream=True,
        )
        finishes = [choice.finish_reason for chunk in stream for choice in chunk.choices]
        assert finishes[-1] in {"stop", "length"}


def test_unknown_model_is_404(embedded: Proc) -> None:
    with client(embedded) as c, pytest.raises(openai.NotFoundError):
        c.embeddings.create(model="gpt-17", input="x")


def test_metrics_expose_queue_outcomes_and_the_autoscaling_signal(embedded: Proc) -> None:
    with client(embedded) as c:
        c.embeddings.create(model="minilm", input="count me")
    text = httpx.get(f"{embedded.url}/metrics", timeout=DEADLINE_S).text
    for name in (
        "tidegate_queue_depth{",
        "tidegate_inflight{",
        "tidegate_replicas{",
        "tidegate_request_duration_seconds_bucket{",
        "inference_queue_depth{",
        'tidegate_requests_total{model="minilm",outcome="completed"',
        'tidegate_arrivals_total{model="minilm"}',
    ):
        assert name in text, name
    # The offered load, counted as the autoscaler counts it: the one embedding above at least.
    series = 'tidegate_arrivals_total{model="minilm"}'
    (arrivals,) = (line for line in text.splitlines() if line.startswith(series))
    assert float(arrivals.rpartition(" ")[2]) >= 1


def _sim_config(tmp_path: Path, latency_ms: float = 20.0, **extra: object) -> Path:
    profile = tmp_path / "sim.json"
    profile.write_text(
        json.dumps(
            {
                "version": 1,
                "model": "sim",
                "task": "embeddings",
                "embeddings": {
                    "points": [
                        {"batch_size": 1, "latency_ms": latency_ms},
                        {"batch_size": 8, "latency_ms": latency_ms},
                    ]
                },
            }
        )
    )
    config = {
        "models": [
            {
                "name": "sim",
                "task": "embeddings",
                "engine": "simulated",
                "profile": str(profile),
                "replicas": 2,
                "batching": {"max_batch_size": 8, "batch_window_ms": 0},
            }
        ],
        **extra,
    }
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_keys_cap_priorities(tmp_path: Path) -> None:
    keys = [
        {
            "name": "app",
            "sha256": hashlib.sha256(KEY.encode()).hexdigest(),
            "default_priority": "high",
            "max_priority": "high",
        },
        {
            "name": "batch",
            "sha256": hashlib.sha256(BATCH_KEY.encode()).hexdigest(),
            "default_priority": "low",
            "max_priority": "medium",
        },
    ]
    with (
        gateway_process("--config", str(_sim_config(tmp_path, keys=keys))) as gateway,
        client(gateway, KEY) as app,
        client(gateway, "sk-wrong") as wrong,
        client(gateway, BATCH_KEY) as batch,
    ):
        assert len(app.embeddings.create(model="sim", input="x").data) == 1
        with pytest.raises(openai.AuthenticationError):
            wrong.embeddings.create(model="sim", input="x")
        with pytest.raises(openai.PermissionDeniedError):
            batch.embeddings.create(model="sim", input="x", extra_headers={"X-Priority": "high"})
        medium = batch.embeddings.create(model="sim", input="x", extra_body={"priority": "medium"})
        assert len(medium.data) == 1


def test_killed_worker_under_load_loses_no_request_and_is_replaced(tmp_path: Path) -> None:
    with gateway_process("--config", str(_sim_config(tmp_path))) as gateway:
        statuses: list[int] = []
        lock = threading.Lock()
        stop = threading.Event()

        def load() -> None:
            with httpx.Client(timeout=DEADLINE_S) as http:
                while not stop.is_set():
                    response = http.post(
                        f"{gateway.url}/v1/embeddings", json={"model": "sim", "input": "load"}
                    )
                    with lock:
                        statuses.append(response.status_code)

        threads = [threading.Thread(target=load) for _ in range(8)]
        for thread in threads:
            thread.start()
        wait_for(lambda: len(statuses) > 50)
        victim = _replicas(gateway)[0]
        os.killpg(victim["pid"], signal.SIGKILL)
        wait_for(lambda: _replica(gateway, victim["id"])["restarts"] == 1)
        wait_for(lambda: _replica(gateway, victim["id"])["state"] == "ready")
        served_before = len(statuses)
        wait_for(lambda: len(statuses) > served_before + 50)
        stop.set()
        for thread in threads:
            thread.join(timeout=DEADLINE_S)
            assert not thread.is_alive(), "a request hung"
    # Every request got an answer: its result, or 502 for one cut off on the dead worker.
    assert set(statuses) <= {200, 502}, set(statuses)
    assert statuses.count(200) > 100


def _replica(gateway: Proc, rid: str) -> dict[str, object]:
    return next(r for r in _replicas(gateway) if r["id"] == rid)


def test_sigterm_drains_in_flight_work_then_stops_workers(tmp_path: Path) -> None:
    with gateway_process("--config", str(_sim_config(tmp_path, 300.0))) as gateway:
        wait_for(lambda: all(r["state"] == "ready" for r in _replicas(gateway)))
        pids = [r["pid"] for r in _replicas(gateway)]
        results: list[int | str] = []

        def one() -> None:
            try:
                response = httpx.post(
                    f"{gateway.url}/v1/embeddings",
                    json={"model": "sim", "input": ["x"] * 8},
                    timeout=DEADLINE_S,
                )
                results.append(response.status_code)
            except httpx.TransportError:
                results.append("refused")  # arrived after the gateway closed its socket

        # 16 requests of one 300 ms batch each: queued well past the 4 awaited below, and
        # drained in about 2.5 s on the two replicas (40 took 6 s, and proved no more).
        threads = [threading.Thread(target=one) for _ in range(16)]
        for thread in threads:
            thread.start()
        wait_for(lambda: _pending(gateway) >= 4)
        pending_at_signal = _pending(gateway)
        gateway.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=DEADLINE_S)
            assert not thread.is_alive(), "a request hung"
        assert gateway.process.wait(timeout=DEADLINE_S) == 0
    # Admitted before the signal: served. Arrived after it: 503 shutting_down, or refused
    # once the socket closed.
    assert set(results) <= {200, 503, "refused"}, results
    assert results.count(200) >= pending_at_signal - 1  # at most one read raced the signal
    for pid in pids:
        wait_for(lambda p=pid: not _alive(p))


def _replicas(gateway: Proc) -> list[dict[str, Any]]:
    return _sim(gateway)["replicas"]  # type: ignore[no-any-return]


def _sim(gateway: Proc) -> dict[str, Any]:
    return httpx.get(f"{gateway.url}/admin/replicas", timeout=DEADLINE_S).json()["sim"]  # type: ignore[no-any-return]


def _pending(gateway: Proc) -> int:
    state = _sim(gateway)
    return int(state["queued"]) + sum(r["in_flight"] for r in state["replicas"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
