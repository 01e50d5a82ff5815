"""Real worker processes with the simulated engine: readiness, profile, slots, priority."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import wait_for, worker_process


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    """One keep-alive client: a new client per call costs tens of milliseconds of set-up."""
    with httpx.Client(timeout=10) as shared:
        yield shared


def write_profile(path: Path, task: str, points: list[dict[str, float]]) -> Path:
    path.write_text(
        json.dumps(
            {
                "version": 1,
                "model": "sim",
                "task": task,
                "device": "cpu",
                "memory_mb": 100,
                "weights_mb": 10,
                task: {"points": points},
            }
        )
    )
    return path


def test_readyz_is_503_until_warm_up_is_done(tmp_path: Path) -> None:
    # Warm-up runs batches 1, 2, 4, 8: 4 x 400 ms at least.
    profile = write_profile(
        tmp_path / "slow.json",
        "embeddings",
        [{"batch_size": 1, "latency_ms": 400}, {"batch_size": 8, "latency_ms": 400}],
    )
    with worker_process(
        "--model",
        "sim",
        "--engine",
        "simulated",
        "--profile",
        str(profile),
        "--max-batch-size",
        "8",
        wait_ready=False,
    ) as worker:
        wait_for(lambda: _get(worker.url, "/livez") == 200)
        readyz = httpx.get(f"{worker.url}/readyz", timeout=5)
        assert readyz.status_code == 503
        assert readyz.json()["status"] in {"loading", "warming"}
        early = httpx.post(f"{worker.url}/v1/embeddings", json={"model": "sim", "input": "a"})
        assert early.status_code == 503
        assert early.headers["Retry-After"] == "1"
        wait_for(lambda: _get(worker.url, "/readyz") == 200, timeout_s=20)
        assert (
            httpx.post(
                f"{worker.url}/v1/embeddings", json={"model": "sim", "input": "a"}, timeout=10
            ).status_code
            == 200
        )
        metrics = httpx.get(f"{worker.url}/metrics").text
        warmup = _sample(metrics, 'tidegate_worker_startup_seconds{model="sim",phase="warmup"}')
        assert warmup >= 1.6


def test_simulated_embeddings_follow_their_profile_within_10_percent(
    tmp_path: Path, client: httpx.Client
) -> None:
    profile = write_profile(
        tmp_path / "p.json",
        "embeddings",
        [{"batch_size": 1, "latency_ms": 200}, {"batch_size": 8, "latency_ms": 480}],
    )
    with worker_process(
        "--model",
        "sim",
        "--engine",
        "simulated",
        "--profile",
        str(profile),
        "--max-batch-size",
        "8",
        "--batch-window-ms",
        "0",
    ) as worker:
        for batch_size, expected_s in [(1, 0.200), (8, 0.480), (4, 0.320)]:
            elapsed = _best_of(
                3,
                lambda n=batch_size: client.post(
                    f"{worker.url}/v1/embeddings",
                    json={"model": "sim", "input": [f"text {i}" for i in range(n)]},
                    timeout=10,
                ),
            )
            assert expected_s <= elapsed <= expected_s * 1.10, (batch_size, elapsed)


def test_simulated_generation_follows_its_profile_within_10_percent(
    tmp_path: Path, client: httpx.Client
) -> None:
    profile = write_profile(
        tmp_path / "g.json", "generate", [{"concurrency": 1, "ttft_ms": 200, "itl_ms": 40}]
    )
    with worker_process(
        "--model", "sim", "--engine", "simulated", "--profile", str(profile)
    ) as worker:
        body = {"model": "sim", "prompt": "hello", "max_tokens": 11}
        elapsed = _best_of(
            3, lambda: client.post(f"{worker.url}/v1/completions", json=body, timeout=10)
        )
        expected_s = 0.200 + 10 * 0.040
        assert expected_s <= elapsed <= expected_s * 1.10, elapsed


def test_client_disconnect_mid_stream_frees_its_slot(tmp_path: Path) -> None:
    profile = write_profile(
        tmp_path / "g.json", "generate", [{"concurrency": 1, "ttft_ms": 10, "itl_ms": 50}]
    )
    with worker_process(
        "--model", "sim", "--engine", "simulated", "--profile", str(profile), "--max-num-seqs", "1"
    ) as worker:
        body = {"model": "sim", "prompt": "hi", "max_tokens": 1000, "stream": True}
        with (
            httpx.Client(timeout=10) as client,
            client.stream("POST", f"{worker.url}/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            num_chunks = 0
            for line in response.iter_lines():
                num_chunks += line.startswith("data:")
                if num_chunks == 3:
                    assert worker.stats()["running"] == 1
                    break
        # The stream is closed: the worker must notice and free the only slot.
        wait_for(lambda: worker.stats()["in_flight"] == 0, timeout_s=5)
        after = httpx.post(
            f"{worker.url}/v1/completions",
            json={"model": "sim", "prompt": "again", "max_tokens": 2},
            timeout=10,
        )
        assert after.status_code == 200
        metrics = httpx.get(f"{worker.url}/metrics").text
        assert (
            _sample(
                metrics,
                'tidegate_requests_total{model="sim",outcome="cancelled",priority="medium"}',
            )
            == 1
        )


def test_waiting_sequences_start_in_priority_order(tmp_path: Path) -> None:
    profile = write_profile(
        tmp_path / "g.json", "generate", [{"concurrency": 1, "ttft_ms": 5, "itl_ms": 100}]
    )
    with worker_process(
        "--model", "sim", "--engine", "simulated", "--profile", str(profile), "--max-num-seqs", "1"
    ) as worker:
        finished: list[str] = []
        lock = threading.Lock()

        def send(name: str, priority: str, max_tokens: int) -> None:
            httpx.post(
                f"{worker.url}/v1/completions",
                json={"model": "sim", "prompt": name, "max_tokens": max_tokens},
                headers={"X-Tidegate-Priority": priority},
                timeout=30,
            )
            with lock:
                finished.append(name)

        blocker = threading.Thread(target=send, args=("blocker", "low", 30))
        blocker.start()
        wait_for(lambda: worker.stats()["running"] == 1)
        threads = []
        for name, priority in [
            ("low1", "low"),
            ("low2", "low"),
            ("high", "high"),
            ("medium", "medium"),
        ]:
            thread = threading.Thread(target=send, args=(name, priority, 1))
            thread.start()
            threads.append(thread)
            expected = len(threads)
            wait_for(lambda n=expected: worker.stats()["queued"] == n)
        for thread in [blocker, *threads]:
            thread.join(timeout=30)
        assert finished == ["blocker", "high", "medium", "low1", "low2"]


def _get(url: str, path: str) -> int:
    try:
        return httpx.get(f"{url}{path}", timeout=2).status_code
    except httpx.TransportError:
        return 0


def _best_of(times: int, call: Any) -> float:
    """The fastest of a few runs: the profile is a floor, noise only adds."""
    best = float("inf")
    for _ in range(times):
        started = time.perf_counter()
        response = call()
        best = min(best, time.perf_counter() - started)
        assert response.status_code == 200, response.text
    return best


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    pytest.fail(f"{name} not in /metrics")


def test_drain_hands_back_waiting_requests_and_finishes_the_running_batch(
    tmp_path: Path,
) -> None:
    # One batch of at most 2 takes 600 ms: of 6 concurrent requests, 2 run and 4 wait.
    profile = write_profile(
        tmp_path / "slow.json",
        "embeddings",
        [{"batch_size": 1, "latency_ms": 600}, {"batch_size": 2, "latency_ms": 600}],
    )
    with worker_process(
        "--model",
        "sim",
        "--engine",
        "simulated",
        "--profile",
        str(profile),
        "--max-batch-size",
        "2",
        "--batch-window-ms",
        "0",
    ) as worker:
        results: list[httpx.Response] = []

        def send() -> None:
            results.append(
                httpx.post(
                    f"{worker.url}/v1/embeddings", json={"model": "sim", "input": "a"}, timeout=10
                )
            )

        threads = [threading.Thread(target=send) for _ in range(6)]
        for thread in threads:
            thread.start()
        wait_for(lambda: httpx.get(f"{worker.url}/stats").json()["queued"] >= 3)
        drained = httpx.post(f"{worker.url}/admin/drain", timeout=5).json()
        for thread in threads:
            thread.join()
        assert drained["status"] == "draining"
        statuses = sorted(r.status_code for r in results)
        handed_back = [r for r in results if r.status_code == 503]
        assert len(handed_back) == drained["returned"] >= 3
        assert all(r.json()["error"]["code"] == "draining" for r in handed_back)
        assert statuses.count(200) == 6 - drained["returned"] >= 1
        assert httpx.get(f"{worker.url}/readyz").status_code == 503
        late = httpx.post(f"{worker.url}/v1/embeddings", json={"model": "sim", "input": "a"})
        assert late.status_code == 503
        assert late.json()["error"]["code"] == "draining"


def test_a_worker_whose_probe_is_too_slow_never_becomes_ready(tmp_path: Path) -> None:
    profile = write_profile(
        tmp_path / "slow.json", "embeddings", [{"batch_size": 1, "latency_ms": 120}]
    )
    args = ("--model", "sim", "--engine", "simulated", "--profile", str(profile))
    args += ("--max-batch-size", "1")
    with worker_process(*args, "--probe-max-ms", "40", wait_ready=False) as slow:
        seen: set[int] = set()

        def exited() -> bool:
            code = slow.process.poll()
            if code is None:
                with contextlib.suppress(httpx.TransportError):
                    seen.add(httpx.get(f"{slow.url}/readyz", timeout=1).status_code)
            return code is not None

        wait_for(exited, timeout_s=20)
        assert slow.process.returncode == 1
        assert 200 not in seen
    with worker_process(*args, "--probe-max-ms", "1000") as fast:
        metrics = httpx.get(f"{fast.url}/metrics").text
        assert _sample(metrics, 'tidegate_worker_startup_seconds{model="sim",phase="probe"}') >= 0.1
