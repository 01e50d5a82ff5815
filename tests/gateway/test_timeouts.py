"""Slow and oversized clients of ``tidegate serve``: cut off in time, refused before reading.

Raw sockets against a real gateway on port 0, with short read limits in its config.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.gateway.harness import flat_profile
from tests.procs import DEADLINE_S, TIDEGATE, Proc, child_env, gateway_process, wait_for
from tests.rawhttp import connect, error_of, read_until_closed

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
MAX_REQUEST_BYTES = 65536
# A loaded machine answers late, never early: the bound below is the limit plus this.
LATE_S = 5.0


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    folder = tmp_path_factory.mktemp("timeouts")
    config = {
        "gateway": {
            "header_timeout_s": HEADER_TIMEOUT_S,
            "body_timeout_s": BODY_TIMEOUT_S,
            "max_request_bytes": MAX_REQUEST_BYTES,
        },
        "models": [
            {
                "name": "sim",
                "task": "embeddings",
                "engine": "simulated",
                "profile": str(flat_profile(folder / "sim.json", 5.0)),
                "replicas": 1,
            }
        ],
    }
    path = folder / "tidegate.yaml"
    path.write_text(yaml.safe_dump(config))
    with gateway_process("--config", str(path)) as proc:
        yield proc


def _headers(content_length: int | None = None, chunked: bool = False) -> bytes:
    lines = [b"POST /v1/embeddings HTTP/1.1", b"Host: gateway", b"Content-Type: application/json"]
    if content_length is not None:
        lines.append(b"Content-Length: %d" % content_length)
    if chunked:
        lines.append(b"Transfer-Encoding: chunked")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def test_slowloris_headers_are_cut_off_at_the_header_timeout(gateway: Proc) -> None:
    with connect(gateway.url) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: gateway\r\n")
        sock.sendall(b"X-Slow: a")  # headers never end: one more byte buys no time
        response = read_until_closed(sock)
        took_s = time.monotonic() - started
    assert HEADER_TIMEOUT_S - 0.1 <= took_s < HEADER_TIMEOUT_S + LATE_S, took_s
    status, error = error_of(response)
    assert status == 408
    assert error["code"] == "request_timeout"


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(gateway: Proc) -> None:
    with connect(gateway.url) as sock:
        started = time.monotonic()
        read_until_closed(sock)
        took_s = time.monotonic() - started
    assert HEADER_TIMEOUT_S - 0.1 <= took_s < HEADER_TIMEOUT_S + LATE_S, took_s


def test_a_body_shorter_than_its_content_length_is_cut_off_at_the_body_timeout(
    gateway: Proc,
) -> None:
    with connect(gateway.url) as sock:
        sock.sendall(_headers(content_length=1000))
        started = time.monotonic()
        sock.sendall(b'{"model": "sim", ')  # and nothing more
        response = read_until_closed(sock)
        took_s = time.monotonic() - started
    assert BODY_TIMEOUT_S - 0.1 <= took_s < BODY_TIMEOUT_S + LATE_S, took_s
    status, error = error_of(response)
    assert status == 408
    assert error["code"] == "request_timeout"
    assert error["type"] == "invalid_request_error"


def test_a_50_mb_content_length_is_refused_before_the_body_is_sent(gateway: Proc) -> None:
    with connect(gateway.url) as sock:
        sock.sendall(_headers(content_length=50 * 1024 * 1024))  # headers only
        response = read_until_closed(sock)
    status, error = error_of(response)
    assert status == 413
    assert error["code"] == "request_too_large"
    assert str(MAX_REQUEST_BYTES) in str(error["message"])


def test_a_chunked_body_is_cut_at_the_limit_while_it_is_read(gateway: Proc) -> None:
    chunk = b"x" * 16384
    with connect(gateway.url) as sock:
        sock.sendall(_headers(chunked=True))
        for _ in range(MAX_REQUEST_BYTES // len(chunk) + 1):  # over the limit, never ended
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        response = read_until_closed(sock)
    status, error = error_of(response)
    assert status == 413
    assert error["code"] == "request_too_large"


def test_refusals_are_counted_and_the_gateway_keeps_serving(gateway: Proc) -> None:
    with connect(gateway.url) as sock:
        sock.sendall(_headers(content_length=MAX_REQUEST_BYTES + 1))
        assert error_of(read_until_closed(sock))[0] == 413
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=DEADLINE_S).text
    assert 'tidegate_requests_total{model="-",outcome="invalid",priority="none"}' in metrics

    def post() -> httpx.Response:
        return httpx.post(
            f"{gateway.url}/v1/embeddings",
            json={"model": "sim", "input": "still here"},
            timeout=DEADLINE_S,
        )

    # This module's header deadline is 1 s: a client thread that a loaded machine leaves
    # unscheduled between its connect and its send is rightly cut off (seen at load 7 on
    # 2 cores). Such a 408 says nothing of the gateway; any other answer must be a 200.
    answers: list[httpx.Response] = []
    wait_for(lambda: answers.append(post()) or answers[-1].status_code != 408)
    assert answers[-1].status_code == 200, answers[-1].text


def test_a_busy_port_is_one_line_with_the_fix(gateway: Proc, tmp_path: Path) -> None:
    port = gateway.url.rsplit(":", 1)[1]
    config = tmp_path / "busy.yaml"
    config.write_text(yaml.safe_dump({"gateway": {"port": int(port)}}))
    done = subprocess.run(
        [TIDEGATE, "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=DEADLINE_S,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"127.0.0.1:{port}" in lines[0]
    assert "--port" in lines[0]
    assert f"gateway.port in {config}" in lines[0]
