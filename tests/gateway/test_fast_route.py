"""The proxy routes as ``tidegate serve`` serves them: off the HTTP protocol, not ASGI
(``tidegate.fastroute``). Raw sockets against a real gateway, for what a client library
hides: pipelining, keep-alive, framing, the fallbacks to the ASGI path, a client leaving."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from tests.faults.accounting import scrape
from tests.gateway.harness import flat_profile
from tests.procs import DEADLINE_S, Proc, gateway_process, wait_for
from tests.rawhttp import connect, read_until_closed

EMBED = json.dumps({"model": "sim", "input": "tide"}).encode()
SLOW_MS = 2000.0  # the slow model's batch: long enough to leave while it runs or waits


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    folder = tmp_path_factory.mktemp("fast-route")
    config = {
        "models": [
            {
                "name": "sim",
                "task": "embeddings",
                "engine": "simulated",
                "profile": str(flat_profile(folder / "sim.json", 1.0)),
                "replicas": 1,
            },
            {
                "name": "slow",
                "task": "embeddings",
                "engine": "simulated",
                "profile": str(flat_profile(folder / "slow.json", SLOW_MS)),
                "replicas": 1,
                "slots": 1,
                "batching": {"max_batch_size": 1},
            },
            {
                "name": "chat",
                "task": "generate",
                "engine": "simulated",
                "profile": str(flat_profile(folder / "chat.json", 1.0, task="generate")),
                "replicas": 1,
            },
        ],
    }
    path = folder / "tidegate.yaml"
    path.write_text(yaml.safe_dump(config))
    with gateway_process("--config", str(path)) as proc:
        yield proc


def request(
    body: bytes = EMBED, target: bytes = b"/v1/embeddings", *extra: bytes, version: bytes = b"1.1"
) -> bytes:
    lines = [
        b"POST " + target + b" HTTP/" + version,
        b"Host: gateway",
        b"Content-Type: application/json",
        b"Content-Length: %d" % len(body),
        *extra,
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def read_response(sock: socket.socket, buffer: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One response off a kept-alive connection (Content-Length or chunked framing)."""
    while b"\r\n\r\n" not in buffer:
        buffer += _recv(sock)
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    buffer[:] = rest
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            while b"\r\n" not in buffer:
                buffer += _recv(sock)
            size_line, _, rest = bytes(buffer).partition(b"\r\n")
            size = int(size_line, 16)
            while len(rest) < size + 2:
                buffer[:] = size_line + b"\r\n" + rest
                buffer += _recv(sock)
                size_line, _, rest = bytes(buffer).partition(b"\r\n")
            body += rest[:size]
            buffer[:] = rest[size + 2 :]
            if size == 0:
                return int(status_line.split()[1]), headers, body
    length = int(headers.get("content-length", "0"))
    while len(buffer) < length:
        buffer += _recv(sock)
    body = bytes(buffer[:length])
    del buffer[:length]
    return int(status_line.split()[1]), headers, body


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    assert chunk, "the server closed the connection mid-response"
    return chunk


def test_pipelined_requests_are_answered_in_order_on_one_connection(gateway: Proc) -> None:
    with connect(gateway.url) as sock:
        ids = [b"pipe-%d" % i for i in range(3)]
        sock.sendall(
            b"".join(request(EMBED, b"/v1/embeddings", b"X-Request-Id: " + i) for i in ids)
        )
        buffer = bytearray()
        answers = [read_response(sock, buffer) for _ in ids]
    assert [status for status, _, _ in answers] == [200, 200, 200]
    assert [headers["x-request-id"] for _, headers, _ in answers] == [i.decode() for i in ids]
    for _, headers, body in answers:
        assert json.loads(body)["object"] == "list"
        assert "date" in headers
        assert "x-tidegate-queue-ms" in headers


def test_a_kept_alive_connection_serves_one_request_after_another(gateway: Proc) -> None:
    with connect(gateway.url) as sock:
        buffer = bytearray()
        for target in (b"/v1/embeddings", b"/v1/embeddings?trace=1", b"/v1/embeddings"):
            sock.sendall(request(EMBED, target))
            status, headers, _ = read_response(sock, buffer)
            assert status == 200
            assert headers.get("connection") != "close"


def test_connection_close_is_honoured(gateway: Proc) -> None:
    with connect(gateway.url) as sock:
        sock.sendall(request(EMBED, b"/v1/embeddings", b"Connection: close"))
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200")
    assert b"connection: close" in answer.lower()


@pytest.mark.parametrize(
    ("extra", "version", "target"),
    [
        ((), b"1.0", b"/v1/embeddings"),  # HTTP/1.0: the ASGI path
        ((b"Expect: 100-continue",), b"1.1", b"/v1/embeddings"),  # the ASGI path
        ((), b"1.1", b"/v1/%65mbeddings"),  # an escape: the ASGI path decodes it
    ],
)
def test_what_the_fast_route_leaves_to_asgi_is_served_the_same(
    gateway: Proc, extra: tuple[bytes, ...], version: bytes, target: bytes
) -> None:
    with connect(gateway.url) as sock:
        sock.sendall(request(EMBED, target, *extra, b"Connection: close", version=version))
        answer = read_until_closed(sock)
    if extra:
        assert answer.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        answer = answer.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert answer.split(b"\r\n", 1)[0].endswith(b"200 OK")
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["object"] == "list"


def test_a_bad_body_is_a_400_and_the_connection_goes_on(gateway: Proc) -> None:
    with connect(gateway.url) as sock:
        buffer = bytearray()
        sock.sendall(request(b'{"model": "sim", "input": '))
        status, _, body = read_response(sock, buffer)
        assert status == 400
        assert "not valid JSON" in json.loads(body)["error"]["message"]
        sock.sendall(request(b'{"model": "nope", "input": "x"}'))
        status, _, body = read_response(sock, buffer)
        assert status == 404
        assert json.loads(body)["error"]["code"] == "model_not_found"


def test_a_chunked_request_body_is_read_whole(gateway: Proc) -> None:
    head = b"\r\n".join(
        [
            b"POST /v1/embeddings HTTP/1.1",
            b"Host: gateway",
            b"Transfer-Encoding: chunked",
            b"Connection: close",
        ]
    )
    half = len(EMBED) // 2
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (EMBED[:half], EMBED[half:]))
    with connect(gateway.url) as sock:
        sock.sendall(head + b"\r\n\r\n" + chunks + b"0\r\n\r\n")
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200")


def test_a_stream_is_chunked_and_ends_with_done(gateway: Proc) -> None:
    body = json.dumps(
        {
            "model": "chat",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
        }
    ).encode()
    with connect(gateway.url) as sock:
        buffer = bytearray()
        sock.sendall(request(body, b"/v1/chat/completions"))
        status, headers, answer = read_response(sock, buffer)
        assert status == 200
        assert headers["content-type"].startswith("text/event-stream")
        assert answer.rstrip().endswith(b"data: [DONE]")
        sock.sendall(request())  # the connection goes on after a stream
        assert read_response(sock, buffer)[0] == 200


def test_a_client_that_leaves_is_counted_cancelled(gateway: Proc) -> None:
    before = scrape(gateway.url, "slow")["cancelled"]
    slow = json.dumps({"model": "slow", "input": "tide"}).encode()
    with connect(gateway.url) as busy, connect(gateway.url) as leaver:
        busy.sendall(request(slow))
        leaver.sendall(request(slow))
        # One runs, one waits (in the gateway's queue or the worker's): both are the
        # gateway's until answered.
        wait_for(lambda: _queued(gateway, "slow") + _in_flight(gateway, "slow") >= 2)
        leaver.close()
        wait_for(lambda: scrape(gateway.url, "slow")["cancelled"] > before)
        assert read_response(busy, bytearray())[0] == 200
    wait_for(lambda: _queued(gateway, "slow") + _in_flight(gateway, "slow") == 0)


def _replicas(gateway: Proc, model: str) -> dict[str, Any]:
    answer = httpx.get(f"{gateway.url}/admin/replicas", timeout=DEADLINE_S).json()
    return answer[model]  # type: ignore[no-any-return]


def _queued(gateway: Proc, model: str) -> int:
    return int(_replicas(gateway, model)["queued"])


def _in_flight(gateway: Proc, model: str) -> int:
    return sum(int(replica["in_flight"]) for replica in _replicas(gateway, model)["replicas"])
