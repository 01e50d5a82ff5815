"""The worker's HTTP server: slow clients cut off in time, oversized bodies refused unread.

Raw sockets against real servers on port 0: the worker's app behind the server it runs
(``worker.server``) with short limits, in a thread; and ``tidegate worker`` itself with its
own limits.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from tests.procs import DEADLINE_S, TIDEGATE, Proc, child_env, wait_for, worker_process
from tests.rawhttp import connect, error_of, read_until_closed
from tidegate.worker.app import create_app
from tidegate.worker.runtime import WorkerSettings
from tidegate.worker.server import (
    WORKER_READ_LIMITS,
    ReadLimits,
    address_of,
    bind,
    limited_app,
    server_config,
)

LIMITS = ReadLimits(header_timeout_s=0.5, body_timeout_s=0.5, max_request_bytes=4096)
LATE_S = 5.0  # a loaded machine answers late, never early


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The worker's app, served as ``tidegate worker`` serves it but with ``LIMITS``."""
    app = create_app(WorkerSettings(model="emb", engine="simulated", task="embeddings"))
    uv = uvicorn.Server(server_config(limited_app(app, LIMITS), LIMITS, "warning"))
    sock = bind("127.0.0.1", 0)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: uv.started)
    yield address_of(sock)
    uv.should_exit = True
    thread.join(DEADLINE_S)


def _post_head(content_length: int) -> bytes:
    return (
        b"POST /v1/embeddings HTTP/1.1\r\nHost: worker\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % content_length
    )


def test_slow_headers_get_408_at_the_header_timeout(server: str) -> None:
    with connect(server) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: wor")
        response = read_until_closed(sock)
        took_s = time.monotonic() - started
    assert LIMITS.header_timeout_s - 0.1 <= took_s < LIMITS.header_timeout_s + LATE_S
    status, error = error_of(response)
    assert (status, error["code"]) == (408, "request_timeout")


def test_a_short_body_gets_408_at_the_body_timeout(server: str) -> None:
    with connect(server) as sock:
        sock.sendall(_post_head(100) + b'{"model": "emb"')
        started = time.monotonic()
        response = read_until_closed(sock)
        took_s = time.monotonic() - started
    assert took_s < LIMITS.body_timeout_s + LATE_S
    status, error = error_of(response)
    assert (status, error["code"]) == (408, "request_timeout")


def test_a_body_over_the_limit_is_refused_by_its_content_length(server: str) -> None:
    with connect(server) as sock:
        sock.sendall(_post_head(LIMITS.max_request_bytes + 1))
        status, error = error_of(read_until_closed(sock))
    assert (status, error["code"]) == (413, "request_too_large")


def test_a_request_within_the_limits_is_served(server: str) -> None:
    body = json.dumps({"model": "emb", "input": "tide"}).encode()
    wait_for(lambda: _status(server, b"GET /readyz HTTP/1.1\r\nHost: w\r\n\r\n") == 200)
    with connect(server) as sock:
        sock.sendall(_post_head(len(body)) + body)
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 200 "), head


def _status(url: str, request: bytes) -> int:
    with connect(url) as sock:
        sock.sendall(request)
        return int(sock.recv(65536).split(b" ", 2)[1])


@pytest.fixture(scope="module")
def worker() -> Iterator[Proc]:
    with worker_process("--model", "emb", "--engine", "simulated", "--task", "embeddings") as proc:
        yield proc


def test_tidegate_worker_refuses_a_body_over_its_limit_unread(worker: Proc) -> None:
    with connect(worker.url) as sock:
        sock.sendall(_post_head(WORKER_READ_LIMITS.max_request_bytes + 1))  # headers only
        status, error = error_of(read_until_closed(sock))
    assert (status, error["code"]) == (413, "request_too_large")


def test_tidegate_worker_on_a_busy_port_is_one_line_with_the_fix(worker: Proc) -> None:
    port = worker.url.rsplit(":", 1)[1]
    done = subprocess.run(
        [TIDEGATE, "worker", "--model", "emb", "--engine", "simulated", "--port", port],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=DEADLINE_S,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert f"127.0.0.1:{port}" in line
    assert "--port" in line
