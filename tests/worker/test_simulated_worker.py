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

from tests.procs import DEADLINE_S, wait_for, worker_process


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    """One keep-alive client: a new client per call costs tens of milliseconds of set-up."""
    with httpx.Client(timeout=DEADLINE_S) as shared:
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
    # Warm-up runs batches 1, 2, 4, 8: 4 x 1 s at least, which the checks made while it runs
    # (two requests once /livez answers) stay far below even on a loaded machine.
    profile = write_profile(
        tmp_path / "slow.json",
        "embeddings",
        [{"batch_size": 1, "latency_ms": 1000}, {"batch_size": 8, "latency_ms": 1000}],
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
        readyz = httpx.get(f"{worker.url}/readyz", timeout=DEADLINE_S)
        assert readyz.status_code == 503
        assert readyz.json()["status"] in {"loading", "warming"}
        early = httpx.post(
            f"{worker.url}/v1/embeddings", json={"model": "sim", "input": "a"}, timeout=DEADLINE_S
        )
        assert early.status_code == 503
        assert early.headers["Retry-After"] == "1"
        wait_for(lambda: _get(worker.url, "/readyz") == 200)
        assert (
            httpx.post(
                f"{worker.url}/v1/embeddings",
                json={"model": "sim", "input": "a"},
                timeout=DEADLINE_S,
            ).status_code
            == 200
        )
        warmup = _sample(
            _metrics(worker.url), 'tidegate_worker_startup_seconds{model="sim",phase="warmup"}'
        )
        assert warmup >= 4.0


def test_engine_threads_reach_the_worker_and_its_stats() -> None:
    with worker_process("--model", "sim", "--engine", "simulated", "--engine-threads", "1") as w:
        assert httpx.get(f"{w.url}/stats", timeout=DEADLINE_S).json()["engine_threads"] == 1
    with worker_process("--model", "sim", "--engine", "simulated") as w:
        assert httpx.get(f"{w.url}/stats", timeout=DEADLINE_S).json()["engine_threads"] is None


def test_prefill_budget_and_fair_sharing_from_the_command_line_to_stats() -> None:
    flags = ("--task", "generate", "--max-prefill-tokens", "512", "--fair-sharing")
    with worker_process("--model", "sim", "--engine", "simulated", *flags) as w:
        chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        headers = {"X-Tidegate-Tenant": "team-a"}
        answer = httpx.post(
            f"{w.url}/v1/chat/completions", json=chat, headers=headers, timeout=DEADLINE_S
        )
        assert answer.status_code == 200, answer.text
        stats = httpx.get(f"{w.url}/stats", timeout=DEADLINE_S).json()
    assert (stats["max_prefill_tokens"], stats["prefilling_tokens"]) == (512, 0)
    assert stats["fair_sharing"] is True
    assert set(stats["tenants"]) == {"team-a"}


def test_length_aware_on_cost_from_the_command_line_to_stats() -> None:
    flags = ("--length-candidates", "8", "--batch-overhead-tokens", "35")
    with worker_process("--model", "sim", "--engine", "simulated", *flags) as w:
        batching = httpx.get(f"{w.url}/stats", timeout=DEADLINE_S).json()["batching"]
    assert batching["length_rule"] == "cost: padding within (members - 1) x 35 tokens"


def test_simulated_embeddings_take_their_profiled_batch_latency(
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
            before = _batches(worker.url)
            elapsed = _best_of(
                3,
                lambda n=batch_size: client.post(
                    f"{worker.url}/v1/embeddings",
                    json={"model": "sim", "input": [f"text {i}" for i in range(n)]},
                ),
            )
            after = _batches(worker.url)
            # Each request ran as one engine batch of all its inputs (not one per input) ...
            assert (after[0] - before[0], after[1] - before[1]) == (3, 3 * batch_size)
            # ... that took the profile's latency for its size, interpolated: a floor, which
            # a loaded machine only adds to.
            assert elapsed >= expected_s, (batch_size, elapsed)


def test_simulated_generation_takes_its_profiled_ttft_and_itl(
    tmp_path: Path, client: httpx.Client
) -> None:
    profile = write_profile(
        tmp_path / "g.json", "generate", [{"concurrency": 1, "ttft_ms": 200, "itl_ms": 40}]
    )
    with worker_process(
        "--model", "sim", "--engine", "simulated", "--profile", str(profile)
    ) as worker:
        body = {"model": "sim", "prompt": "hello", "max_tokens": 11}
        tokens: list[int] = []

        def complete() -> httpx.Response:
            response = client.post(f"{worker.url}/v1/completions", json=body)
            tokens.append(response.json()["usage"]["completion_tokens"])
            return response

        elapsed = _best_of(3, complete)
        assert tokens == [11, 11, 11]
        # The first token after the TTFT, each of the 10 others after an ITL: a floor, which
        # a loaded machine only adds to.
        expected_s = 0.200 + 10 * 0.040
        assert elapsed >= expected_s, elapsed


def test_client_disconnect_mid_stream_frees_its_slot(tmp_path: Path) -> None:
    profile = write_profile(
        tmp_path / "g.json", "generate", [{"concurrency": 1, "ttft_ms": 10, "itl_ms": 50}]
    )
    with worker_process(
        "--model", "sim", "--engine", "simulated", "--profile", str(profile), "--max-num-seqs", "1"
    ) as worker:
        body = {"model": "sim", "prompt": "hi", "max_tokens": 1000, "stream": True}
        with (
            httpx.Client(timeout=DEADLINE_S) as client,
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
        wait_for(lambda: worker.stats()["in_flight"] == 0)
        after = httpx.post(
            f"{worker.url}/v1/completions",
            json={"model": "sim", "prompt": "again", "max_tokens": 2},
            timeout=DEADLINE_S,
        )
        assert after.status_code == 200
        assert (
            _sample(
                _metrics(worker.url),
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
        finished: list[tuple[str, int]] = []
        lock = threading.Lock()

        def send(name: str, priority: str) -> None:
            response = httpx.post(
                f"{worker.url}/v1/completions",
                # four tokens (~0.3 s at 100 ms each) apart: the answers' order is the order
                # the worker ran them even when a loaded machine wakes client threads late
                # (one token each, 5 ms apart, once came back out of order under CPU hogs)
                json={"model": "sim", "prompt": name, "max_tokens": 4},
                headers={"X-Tidegate-Priority": priority},
                timeout=DEADLINE_S,
            )
            with lock:
                finished.append((name, response.status_code))

        # The blocker holds the only slot until the test lets go: a long stream (minutes of
        # tokens) that it leaves once all the others wait, however long that took.
        blocker = {"model": "sim", "prompt": "blocker", "max_tokens": 2000, "stream": True}
        threads = []
        with (
            httpx.Client(timeout=DEADLINE_S) as http,
            http.stream(
                "POST",
                f"{worker.url}/v1/completions",
                json=blocker,
                headers={"X-Tidegate-Priority": "low"},
            ) as running,
        ):
            assert running.status_code == 200
            wait_for(lambda: worker.stats()["running"] == 1)
            for name, priority in [
                ("low1", "low"),
                ("low2", "low"),
                ("high", "high"),
                ("medium", "medium"),
            ]:
                thread = threading.Thread(target=send, args=(name, priority))
                thread.start()
                threads.append(thread)
                expected = len(threads)
                wait_for(lambda n=expected: worker.stats()["queued"] == n)
            stats = worker.stats()
            assert (stats["running"], stats["queued"]) == (1, 4)  # none took the blocker's slot
        # The blocker left: its slot goes to the waiting sequences, most urgent first.
        for thread in threads:
            thread.join(timeout=DEADLINE_S)
            assert not thread.is_alive(), "a request hung"
        assert finished == [("high", 200), ("medium", 200), ("low1", 200), ("low2", 200)]


def _get(url: str, path: str) -> int:
    try:
        return httpx.get(f"{url}{path}", timeout=DEADLINE_S).status_code
    except httpx.TransportError:
        return 0  # not listening yet, or gone


def _metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=DEADLINE_S).text


def _batches(url: str) -> tuple[float, float]:
    """Engine batches the worker ran for requests so far, and the inputs in them."""
    metrics = _metrics(url)
    if 'tidegate_batch_size_count{model="sim"}' not in metrics:
        return (0.0, 0.0)  # none yet: the series appears with the first batch
    return (
        _sample(metrics, 'tidegate_batch_size_count{model="sim"}'),
        _sample(metrics, 'tidegate_batch_size_sum{model="sim"}'),
    )


def _arrived(url: str) -> float:
    """Requests the worker has received: waiting, running and finished (one /metrics read)."""
    metrics = _metrics(url)
    prefixes = (
        "tidegate_queue_depth{",
        'tidegate_worker_inflight{model="sim"}',
        "tidegate_requests_total{",
    )
    return sum(
        float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(prefixes)
    )


def _best_of(times: int, call: Any) -> float:
    """The fastest of a few runs: the profile is a floor that every run stays above."""
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
    # One batch of at most 2 takes 3 s: of 6 requests, at most 4 have started 6 s after the
    # first arrived; the few requests this test makes before the drain fit in that many times
    # over, however busy the machine (the engine's time is a floor, load only adds to it).
    profile = write_profile(
        tmp_path / "slow.json",
        "embeddings",
        [{"batch_size": 1, "latency_ms": 3000}, {"batch_size": 2, "latency_ms": 3000}],
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
                    f"{worker.url}/v1/embeddings",
                    json={"model": "sim", "input": "a"},
                    timeout=DEADLINE_S,
                )
            )

        threads = [threading.Thread(target=send) for _ in range(6)]
        for thread in threads:
            thread.start()
        # All six arrived (none comes after the drain, where it would be refused, not handed
        # back): waiting, running or finished, in one snapshot of the worker's counts.
        wait_for(lambda: _arrived(worker.url) == 6)
        drained = httpx.post(f"{worker.url}/admin/drain", timeout=DEADLINE_S).json()
        left = worker.stats()
        for thread in threads:
            thread.join(timeout=DEADLINE_S)
            assert not thread.is_alive(), "a request hung"
        assert drained["status"] == "draining"
        assert left["queued"] == 0  # every waiting request was handed back at once
        statuses = sorted(r.status_code for r in results)
        handed_back = [r for r in results if r.status_code == 503]
        assert len(handed_back) == drained["returned"] >= 1
        assert all(r.json()["error"]["code"] == "draining" for r in handed_back)
        assert statuses.count(200) == 6 - drained["returned"] >= 1  # the running batch finished
        assert httpx.get(f"{worker.url}/readyz", timeout=DEADLINE_S).status_code == 503
        late = httpx.post(
            f"{worker.url}/v1/embeddings", json={"model": "sim", "input": "a"}, timeout=DEADLINE_S
        )
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
                    seen.add(httpx.get(f"{slow.url}/readyz", timeout=DEADLINE_S).status_code)
            return code is not None

        wait_for(exited)
        assert slow.process.returncode == 1
        assert 200 not in seen
    # A limit far above the probe's 120 ms, which a loaded machine cannot push it past.
    with worker_process(*args, "--probe-max-ms", "30000") as fast:
        probe_s = _sample(
            _metrics(fast.url), 'tidegate_worker_startup_seconds{model="sim",phase="probe"}'
        )
        assert probe_s >= 0.1
