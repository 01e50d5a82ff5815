"""benchmarks/loadgen.py and benchmarks/summary.py: the load generator every benchmark shares.

The raw HTTP/1.1 client runs against real servers on free loopback ports: uvicorn serving a
small ASGI app (keep-alive, Content-Length and chunked SSE answers, Retry-After), and a plain
asyncio server that closes every connection after one answer (a stale kept-alive connection).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import uvicorn

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import loadgen as lg  # noqa: E402
import summary  # noqa: E402

HANG_GUARD_S = 60.0


class App:
    """POST /json: echo; /busy: 429 with Retry-After; /sse: three text events, a usage
    chunk and [DONE]; /fail: 503. Every request is remembered (path, body, x-priority)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes, str]] = []
        self.enough = asyncio.Event()
        self.enough_at = 1_000_000

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = dict(scope["headers"])
        self.seen.append((scope["path"], body, headers.get(b"x-priority", b"").decode()))
        if len(self.seen) >= self.enough_at:
            self.enough.set()
        path = scope["path"]
        if path == "/sse":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            for text in ("a", "b", "c"):
                chunk = {"choices": [{"text": text}]}
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"data: %s\n\n" % json.dumps(chunk).encode(),
                        "more_body": True,
                    }
                )
            usage = {"choices": [], "usage": {"completion_tokens": 3}}
            tail = b"data: %s\n\ndata: [DONE]\n\n" % json.dumps(usage).encode()
            await send({"type": "http.response.body", "body": tail})
            return
        status, extra = 200, []
        if path == "/busy":
            status, extra = 429, [(b"retry-after", b"1")]
        elif path == "/fail":
            status = 503
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), *extra],
            }
        )
        await send({"type": "http.response.body", "body": body or b"{}"})


@pytest_asyncio.fixture
async def server() -> AsyncIterator[tuple[str, App]]:
    app = App()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # connections wait in the backlog until uvicorn accepts: no start race
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(uv.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        uv.should_exit = True
        await task
        sock.close()


@pytest.mark.asyncio
async def test_post_keeps_one_connection_alive(server: tuple[str, App]) -> None:
    url, app = server
    client = lg.RawClient(url)
    try:
        answers = [await client.post("/json", b'{"n": %d}' % i) for i in range(3)]
    finally:
        await client.aclose()
    assert [(a.status, a.body) for a in answers] == [(200, b'{"n": %d}' % i) for i in range(3)]
    assert len(client.all) == 1
    assert [path for path, _, _ in app.seen] == ["/json"] * 3


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["raw", "httpx"])
async def test_post_reports_retry_after_and_headers(server: tuple[str, App], kind: str) -> None:
    url, app = server
    client = lg.load_client(kind, url, 4, HANG_GUARD_S)
    try:
        answer = await client.post("/busy", b"{}", {"x-priority": "high"})
    finally:
        await client.aclose()
    assert (answer.status, answer.retry_after) == (429, True)
    assert app.seen == [("/busy", b"{}", "high")]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["raw", "httpx"])
async def test_events_stream_status_then_each_event(server: tuple[str, App], kind: str) -> None:
    url, _ = server
    client = lg.load_client(kind, url, 4, HANG_GUARD_S)
    try:
        items = [item async for item in client.events("/sse", b"{}")]
        again = await client.post("/json", b"{}")  # the connection is reusable after a stream
    finally:
        await client.aclose()
    assert items[0] == 200
    assert [json.loads(x)["choices"][0]["text"] for x in items[1:4]] == ["a", "b", "c"]
    assert items[-1] == b"[DONE]"
    assert again.status == 200
    if isinstance(client, lg.RawClient):
        assert len(client.all) == 1


@pytest.mark.asyncio
async def test_stream_records_text_arrivals_and_usage(server: tuple[str, App]) -> None:
    url, _ = server
    client = lg.RawClient(url)
    try:
        record = await lg.stream(client, "/sse", b"{}", lambda event: b'"text"' in event)
        failed = await lg.stream(client, "/fail", b"{}", lambda event: True)
    finally:
        await client.aclose()
    assert (record.status, record.tokens, record.error) == (200, 3, "")
    assert len(record.text_at) == 3
    assert len(record.gaps) == 2
    assert 0 <= record.ttft <= record.latency
    assert failed.status == 503
    assert failed.error == "status 503"


@pytest.mark.asyncio
async def test_stream_waves_add_up_tokens_and_errors(server: tuple[str, App]) -> None:
    url, _ = server
    out = await lg.stream_waves(url, "/sse", [b"{}", b"{}"], 0.0, lambda e: b'"text"' in e)
    assert (out.waves, out.tokens, out.errors) == (1, 6, 0)
    assert len(out.ttfts_s) == 2
    assert len(out.itls_s) == 4


@pytest.mark.asyncio
async def test_a_connection_the_server_closed_is_replaced() -> None:
    connections = 0

    async def one_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # no Connection: close header: the client believes it kept alive
        await writer.wait_closed()

    srv = await asyncio.start_server(one_answer, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    client = lg.RawClient(f"http://127.0.0.1:{port}")
    try:
        answers = [await client.post("/x", b"{}") for _ in range(3)]
    finally:
        await client.aclose()
        srv.close()
        await srv.wait_closed()
    assert [(a.status, a.body) for a in answers] == [(200, b"ok")] * 3
    assert connections == 3


@pytest.mark.asyncio
async def test_closed_loop_users_send_their_own_payloads(server: tuple[str, App]) -> None:
    url, app = server
    app.enough_at = 24
    payloads = [b'{"n": %d}' % i for i in range(8)]
    records = await lg.closed_loop(
        url, "/json", payloads, 4, app.enough.wait(), timeout_s=HANG_GUARD_S
    )
    assert len(records) >= 24
    assert all(r.status == 200 and r.latency >= 0 for r in records)
    # User k sends payloads k, k+4, k+8, ...: in all, every payload about as often.
    counts = [sum(body == p for _, body, _ in app.seen) for p in payloads]
    assert max(counts) - min(counts) <= 2


@pytest.mark.asyncio
async def test_closed_loop_records_failures(server: tuple[str, App]) -> None:
    url, app = server
    app.enough_at = 3
    records = await lg.closed_loop(url, "/fail", [b"{}"], 1, app.enough.wait())
    assert records
    assert all(r.status == 503 and r.error.startswith("503") for r in records)


@pytest.mark.asyncio
async def test_open_loop_sends_the_schedule_with_class_headers(server: tuple[str, App]) -> None:
    url, app = server
    arrivals = [(0.0, "high"), (0.001, "low"), (0.002, "medium"), (0.003, "high")]
    headers = {name: {"x-priority": name} for name in ("high", "medium", "low")}
    out = await lg.open_loop(
        url,
        "/json",
        [b"{}"],
        arrivals,
        headers,
        drain_s=HANG_GUARD_S,
        timeout_s=HANG_GUARD_S,
        meters={"loadgen": lambda: 0.0},
    )
    assert [(r.tag, r.status) for r in out.records] == [(c, 200) for _, c in arrivals]
    assert all(r.sent >= r.start and r.end >= r.sent for r in out.records)
    assert sorted(p for _, _, p in app.seen) == sorted(c for _, c in arrivals)
    assert set(out.cores) == {"loadgen", "other processes"}


@pytest.mark.asyncio
async def test_open_loop_streams_each_arrival_with_its_class_headers(
    server: tuple[str, App],
) -> None:
    url, app = server
    arrivals = [(0.0, "high"), (0.001, "low")]
    headers = {name: {"x-priority": name} for name in ("high", "low")}
    out = await lg.open_loop(
        url,
        "/sse",
        [b"{}"],
        arrivals,
        headers,
        drain_s=HANG_GUARD_S,
        timeout_s=HANG_GUARD_S,
        meters={},
        has_text=lambda event: b'"text"' in event,
    )
    assert [(r.tag, r.status, r.tokens, r.error) for r in out.records] == [
        ("high", 200, 3, ""),
        ("low", 200, 3, ""),
    ]
    # TTFT from the scheduled arrival, as the latency: a late sender counts against the server.
    assert all(len(r.text_at) == 3 and 0 <= r.ttft <= r.latency for r in out.records)
    assert sorted(p for _, _, p in app.seen) == ["high", "low"]


def test_poisson_is_seeded_bounded_and_shared_by_class() -> None:
    classes = (("high", 0.2), ("medium", 0.3), ("low", 0.5))
    first = lg.poisson(1000.0, 10.0, 7, classes, 100_000)
    assert first == lg.poisson(1000.0, 10.0, 7, classes, 100_000)
    assert first != lg.poisson(1000.0, 10.0, 8, classes, 100_000)
    assert 9_000 < len(first) < 11_000
    assert all(0 <= a < b < 10.0 for (a, _), (b, _) in itertools.pairwise(first))
    high = sum(c == "high" for _, c in first) / len(first)
    assert 0.17 < high < 0.23
    assert len(lg.poisson(1000.0, 10.0, 7, classes, 50)) == 50


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert lg.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert lg.percentile([1.0, 2.0], 100) == 2.0
    assert lg.percentile([5.0], 99) == 5.0
    assert lg.percentile([], 50) != lg.percentile([], 50)  # NaN


def test_metric_sum_adds_every_label_set() -> None:
    text = (
        "# HELP tidegate_batch_size_count x\n"
        'tidegate_batch_size_count{model="a"} 3.0\n'
        'tidegate_batch_size_count{model="b"} 4.0\n'
        "tidegate_batch_size_sum 10.0\n"
    )
    assert lg.metric_sum(text, "tidegate_batch_size_count") == 7.0
    assert lg.metric_sum(text, "tidegate_batch_size_sum") == 10.0
    assert lg.metric_sum(text, "tidegate_batch_size") == 0.0


def test_measure_pairs_runs_abba_and_reruns_a_noisy_pair() -> None:
    order: list[str] = []
    noise = iter([0.0, 0.0, 1.0, 1.0, 0.0, 0.0])

    class Round:
        def __init__(self, name: str) -> None:
            order.append(name)
            self.other_cores = next(noise)

    a, b = lg.measure_pairs(
        lambda: Round("A"),
        lambda: Round("B"),
        rounds=2,
        retries=1,
        quiet=lg.QuietWait(max_s=0.0),
    )
    assert order == ["A", "B", "B", "A", "A", "B"]
    assert [r.other_cores for r in a + b] == [0.0, 0.0, 0.0, 0.0]


def test_processes_stops_every_child_and_reads_its_address() -> None:
    code = "import time; print('http://127.0.0.1:1', flush=True); time.sleep(600)"
    handler = signal.getsignal(signal.SIGTERM)
    with lg.processes("test_bench_loadgen") as logdir:
        child = lg.spawn("printer", [sys.executable, "-c", code], logdir)
        assert lg.first_line(child, HANG_GUARD_S) == "http://127.0.0.1:1"
        assert child.alive()
    assert not child.alive()
    assert lg.CHILDREN == []
    assert not logdir.exists()
    assert signal.getsignal(signal.SIGTERM) is handler


def test_processes_keeps_the_logs_of_a_failed_run() -> None:
    code = "import time; time.sleep(600)"
    started: list[lg.Child] = []

    def failing_run() -> None:
        with lg.processes("test_bench_loadgen") as logdir:
            started.append(lg.spawn("sleeper", [sys.executable, "-c", code], logdir))
            raise RuntimeError("the benchmark failed")

    with pytest.raises(RuntimeError, match="the benchmark failed"):
        failing_run()
    (child,) = started
    logdir = child.log.parent
    assert not child.alive()
    assert (logdir / "sleeper.log").exists()
    shutil.rmtree(logdir)


def test_summary_rows_and_errors(tmp_path: Path) -> None:
    lines = ["PASS worker best = 90%", "MISS: 10% fewer GPU-hours", "no verdict word"]
    summary.write_verdicts(tmp_path / "a.json", "bench_a", lines, ["Traceback\nValueError: x"])
    rows = summary.read_rows("bench_a", tmp_path / "a.json", 0)
    assert rows == [
        ("bench_a", "PASS", "worker best = 90%"),
        ("bench_a", "MISS", "10% fewer GPU-hours"),
        ("bench_a", "MISS", "no verdict word"),
        ("bench_a", "ERROR", "ValueError: x"),
    ]
    assert summary.read_rows("bench_b", tmp_path / "b.json", 3) == [
        ("bench_b", "ERROR", "exit code 3")
    ]
    assert summary.read_rows("bench_c", tmp_path / "c.json", 0)[0][1] == "ERROR"
    text = summary.table([*rows, ("bench_b", "ERROR", "exit code 3")])
    assert "| bench_a | PASS | worker best = 90% |" in text
    assert text.endswith("1 PASS, 2 MISS, 2 ERROR")


def test_summary_shows_a_failing_benchmark_beside_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary.write_verdicts(tmp_path / "bench_queue.json", "bench_queue", ["PASS fast"])
    status = summary.main(
        ["--only", "bench_queue", "bench_sim", "--out", str(tmp_path), "--table-only"]
    )
    out = capsys.readouterr().out
    assert "| bench_queue | PASS | fast |" in out
    assert "| bench_sim | ERROR | no verdict file |" in out
    assert status == 1
