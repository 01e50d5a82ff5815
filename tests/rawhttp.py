"""Raw HTTP/1.1 over a socket, for tests of what a client library would never send:
headers that never end, bodies shorter than their Content-Length, oversized claims."""

from __future__ import annotations

import json
import socket

from tests.procs import DEADLINE_S


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=DEADLINE_S)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by the socket's
    timeout: a server that never closes fails the test)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def error_of(response: bytes) -> tuple[int, dict[str, object]]:
    """The status and the OpenAI error object of a raw response."""
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]
