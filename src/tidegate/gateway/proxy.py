"""Forwarding one request to one replica: whole, or streamed through as it arrives.

The client is a small HTTP/1.1 one of the gateway's own (``ReplicaPool``): keep-alive
connections per replica, the request written in one ``write``, the answer parsed by
httptools (the parser uvicorn serves with) straight from the protocol's callbacks. On the
proxy's path a general client cost more than the scheduling: aiohttp took 15% of the
gateway's CPU per request (a request object, a payload writer and a response object per
call), httpx's connection pool 70% at 64 concurrent requests.

Errors carry no replica address or library text: a client reads them. Those details go to
the log, where the message of ``ConnectFailed`` also goes (the caller logs it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import NamedTuple, cast
from urllib.parse import urlsplit

import httptools

from tidegate.errors import ReplicaFailed

log = logging.getLogger("tidegate.gateway")
HOP_HEADERS = {
    b"content-length",
    b"transfer-encoding",
    b"connection",
    b"keep-alive",
    b"date",
    b"server",
}
CONNECT_TIMEOUT_S = 5.0
# Idle keep-alive connections older than this are closed rather than reused: servers close
# theirs after a few seconds (uvicorn: 5 s), and a request written into a connection the
# server is closing gets no answer.
IDLE_S = 3.0
STREAM_HIGH_WATER = 256 * 1024  # bytes of a stream held before reading from the replica pauses


class ConnectFailed(Exception):
    """Nothing reached the replica: the request may safely go to another one."""


class ReplicaGone(ConnectFailed):
    """The replica stopped between its slot being given and the request being sent.

    Not a failure of the replica's answers (outlier detection does not count it): its
    orchestrator already knows, and restarts or removes it.
    """


class NoAnswer(ConnectFailed):
    """The replica closed a new connection without a byte of answer: it crashed, or its
    node went, mid-request. Nothing reached the client, so the request goes once to another
    replica (ARCHITECTURE: in-flight requests of a crashed replica that had not started
    streaming are retried once); the replica's outlier record counts it."""


class CutAnswer(NoAnswer):
    """The connection broke inside a whole (not streamed) answer, after its head: the
    replica crashed or its node went while it wrote. The gateway passes a whole answer on
    only once it has all of it, so nothing reached the client: retried as ``NoAnswer``."""


@dataclass
class Forwarded:
    status: int
    headers: list[tuple[bytes, bytes]]  # as ASGI has them: lower-case names, hop-by-hop ones out
    body: bytes | None  # None: streaming, read ``chunks``
    chunks: AsyncIterator[bytes] | None = None
    head_at: float = 0.0  # monotonic time its head came


class _Origin(NamedTuple):
    scheme: str
    host: str
    port: int
    prefix: str  # the URL's own path, before the endpoint's
    host_header: bytes


def _origin(url: str) -> _Origin:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    default = 443 if parts.scheme == "https" else 80
    port = parts.port or default
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    host_header = shown if port == default else f"{shown}:{port}"
    return _Origin(parts.scheme, host, port, parts.path.rstrip("/"), host_header.encode())


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time. httptools calls the ``on_*``."""

    def __init__(self, pool: ReplicaPool, origin: _Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.lost = False
        self._reset()

    def _reset(self) -> None:
        loop = asyncio.get_running_loop()
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.got_bytes = False
        self.head: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.parts: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.streaming = False
        self.more = asyncio.Event()  # streaming: a part arrived, or the end
        self.paused = False
        self.complete = False
        self.keep_alive = False
        self.until_eof = False  # no length and not chunked: the body ends with the connection

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.until_eof and self.head.done() and not self.complete:
            self.on_message_complete()  # the body ran to the connection's end, as announced
        else:
            self._fail(exc or ConnectionResetError("the replica closed the connection"))

    # httptools
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        names = {name.lower() for name, _ in self.headers}
        self.until_eof = b"content-length" not in names and b"transfer-encoding" not in names
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)
        self.buffered += len(body)
        if self.streaming:
            self.more.set()
            if self.buffered > STREAM_HIGH_WATER and not self.paused and self.transport:
                self.paused = True
                self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # asked now: the parser resets after
        self.more.set()
        if not self.done.done():
            self.done.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        self.more.set()
        for future in (self.head, self.done):
            if not future.done():
                future.set_exception(exc)
                future.exception()  # retrieved here: a reader may never come

    # the pool's side
    def take(self) -> bytes:
        body = b"".join(self.parts)
        self.parts.clear()
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        self.buffered = 0
        return body

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.lost and not self.until_eof

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class ReplicaPool:
    """Keep-alive HTTP/1.1 connections to the replicas, any number per replica."""

    def __init__(self) -> None:
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._origins: dict[str, _Origin] = {}
        self._ssl: ssl.SSLContext | None = None
        self.closed = False

    def origin(self, url: str) -> _Origin:
        origin = self._origins.get(url)
        if origin is None:
            if len(self._origins) > 4096:  # replicas come and go; the cache must not grow
                self._origins.clear()
            origin = self._origins[url] = _origin(url)
        return origin

    async def connect(self, origin: _Origin) -> tuple[_Connection, bool]:
        """An idle connection to ``origin`` (reused: True), or a new one."""
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since < IDLE_S:
                conn._reset()
                return conn, True
            conn.close()
        loop = asyncio.get_running_loop()
        context = None
        if origin.scheme == "https":
            context = self._ssl = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=context,
                    server_hostname=origin.host if context else None,
                )
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            raise ConnectFailed(
                f"{origin.host}:{origin.port}: {type(exc).__name__}: {exc}"
            ) from exc
        return conn, False

    def release(self, conn: _Connection) -> None:
        if self.closed or not conn.reusable():
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.origin, []).append(conn)

    async def close(self) -> None:
        self.closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def _request_bytes(origin: _Origin, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [
        b"POST ",
        (origin.prefix + path).encode(),
        b" HTTP/1.1\r\nhost: ",
        origin.host_header,
        b"\r\ncontent-length: ",
        str(len(body)).encode(),
        b"\r\n",
    ]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} has a line break")  # never sent: no injection
        lines += (name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n")
    lines += (b"\r\n", body)
    return b"".join(lines)


async def forward(
    pool: ReplicaPool,
    url: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    *,
    stream: bool,
    on_first_byte: Callable[[float], None] | None = None,
) -> Forwarded:
    """POST ``body`` to ``url + path``. Raises ConnectFailed before any byte, ReplicaFailed
    after. ``on_first_byte(monotonic time)``: when a stream's first chunk with content
    came (a whole answer's first byte is its ``head_at``, for the caller to record once it
    has passed the answer on)."""
    origin = pool.origin(url)
    message = _request_bytes(origin, path, body, headers)
    conn, reused = await pool.connect(origin)
    assert conn.transport is not None
    try:
        conn.transport.write(message)
        await conn.head
    except BaseException as exc:
        conn.close()
        if not conn.got_bytes and isinstance(exc, OSError):
            if reused:
                # The server closed an idle connection as the request went out: not a
                # failure of the replica, and no answer came. Another connection takes it.
                raise ReplicaGone(f"{url}: kept-alive connection closed: {exc}") from exc
            raise NoAnswer(f"{url}: closed without answering: {exc}") from exc
        if isinstance(exc, OSError):  # inside the head: nothing of it reached the client
            raise CutAnswer(f"{url}: the answer broke off in its head: {exc}") from exc
        if isinstance(exc, httptools.HttpParserError):
            log.warning("replica at %s failed: %s: %s", url, type(exc).__name__, exc)
            raise ReplicaFailed("the replica failed before it answered") from exc
        raise
    head_at = time.monotonic()
    passed = [
        (lower, value) for name, value in conn.headers if (lower := name.lower()) not in HOP_HEADERS
    ]
    if not stream or conn.status != 200:
        try:
            await conn.done
        except BaseException as exc:
            conn.close()
            if isinstance(exc, OSError):
                raise CutAnswer(f"{url}: the answer broke off after its head: {exc}") from exc
            if isinstance(exc, httptools.HttpParserError):
                log.warning("replica at %s failed mid-response: %s", url, exc)
                raise ReplicaFailed("the replica failed while it answered") from exc
            raise
        content = conn.take()
        pool.release(conn)
        return Forwarded(conn.status, passed, content, head_at=head_at)
    conn.streaming = True
    conn.more.set()  # what came with the head
    return Forwarded(
        conn.status, passed, None, _chunks(pool, conn, url, on_first_byte), head_at=head_at
    )


async def _chunks(
    pool: ReplicaPool,
    conn: _Connection,
    url: str,
    on_first_byte: Callable[[float], None] | None,
) -> AsyncIterator[bytes]:
    first = True
    try:
        while True:
            await conn.more.wait()
            conn.more.clear()
            if conn.parts:
                if first and on_first_byte is not None:
                    on_first_byte(time.monotonic())
                    first = False
                yield conn.take()
            if conn.complete:
                break
            if conn.done.done():  # failed: the connection broke mid-stream
                conn.done.result()
        pool.release(conn)
    except (OSError, httptools.HttpParserError) as exc:
        log.warning("replica at %s failed mid-stream: %s: %s", url, type(exc).__name__, exc)
        raise ReplicaFailed("the replica failed while it streamed its answer") from exc
    finally:
        if not conn.complete:
            conn.close()  # an unfinished stream must not go back to the pool
