"""Run one worker process: bind, print the address, serve until told to stop.

Also the HTTP server both the worker and the gateway run: uvicorn with read limits it lacks
on its own. A client gets ``header_timeout_s`` from its connection (or its next request's
first byte) to the end of its headers, then ``body_timeout_s`` for the body, which is
refused by its ``Content-Length`` before it is read when over ``max_request_bytes``
(asgi.BodyLimits). The listening socket is never inherited by a child process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import uvicorn
from starlette.types import ASGIApp, Scope
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tidegate.asgi import BodyLimits
from tidegate.errors import InvalidRequest
from tidegate.fastroute import FastCycle, FastRoutes, fast_path_of, headers_of
from tidegate.worker.runtime import WorkerSettings

log = logging.getLogger("tidegate.worker")


@dataclass(frozen=True, slots=True)
class ReadLimits:
    """How long and how much a client may send before it is cut off."""

    header_timeout_s: float  # connection (or a request's first byte) to the end of headers
    body_timeout_s: float  # end of headers to the end of the body
    max_request_bytes: int  # larger bodies get 413, by Content-Length before reading


# The worker's own: its clients are the gateway and the profiler, on loopback. The body
# limit is well above the gateway's default (4 MiB) so that a gateway's limit decides.
WORKER_READ_LIMITS = ReadLimits(
    header_timeout_s=10.0, body_timeout_s=30.0, max_request_bytes=64 * 1024 * 1024
)


class CannotBind(OSError):
    """The address is taken, or not this host's: one line for the user, not a traceback."""

    def __init__(self, host: str, port: int, exc: OSError) -> None:
        super().__init__(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}")
        self.host = host
        self.port = port


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 lets the OS pick a free one. Raises CannotBind.

    Not inheritable (Python's default, kept): a child process that held it would keep the
    port bound, and accepting connections nobody answers, for as long as it lives.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise CannotBind(host, port, exc) from exc
    return sock


class _OneWritePerTurn:
    """A transport whose writes of one event-loop turn leave in one ``write``.

    uvicorn writes a response's head and its body apart: two packets, so the client wakes
    up twice and the server pays two system calls (a loopback write delivers the packet
    inside the call). Joined here at the end of the turn, before any close. Everything
    else goes to the transport as it is.
    """

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a deadline on each request's headers, and the
    fast routes (``tidegate.fastroute``) served without ASGI.

    The deadline is armed when the connection is made and when a request's first byte
    arrives (an idle keep-alive connection is uvicorn's ``timeout_keep_alive``); disarmed
    when the headers are complete. When it fires, the client gets 408 (unless a response is
    under way on this connection) and the connection is closed.
    """

    header_timeout_s: ClassVar[float] = WORKER_READ_LIMITS.header_timeout_s
    fast_routes: ClassVar[FastRoutes | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        joined = cast(asyncio.Transport, _OneWritePerTurn(transport, self.loop))
        super().connection_made(joined)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()  # no-op while armed: a byte does not buy more time

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        if self.fast_routes is None or not self._serve_fast(self.fast_routes):
            super().on_headers_complete()

    def _serve_fast(self, routes: FastRoutes) -> bool:
        """Take this request off ASGI when it is a plain HTTP/1.1 POST to a fast route."""
        parser = self.parser
        if (
            parser.get_method() != b"POST"
            or self.expect_100_continue
            or parser.get_http_version() != "1.1"
            or parser.should_upgrade()
        ):
            return False
        path = fast_path_of(self.url, routes)
        if path is None:
            return False
        existing = self.cycle
        cycle = FastCycle(
            routes,
            path,
            headers_of(self.headers),
            transport=self.transport,
            flow=self.flow,
            default_headers=self.server_state.default_headers,
            keep_alive=parser.should_keep_alive(),
            on_response=self.on_response_complete,
        )
        self.cycle = cycle  # type: ignore[assignment]  # uvicorn's cycle interface
        if existing is None or existing.response_complete:
            self._start_asgi_task(cycle, self.app)  # type: ignore[arg-type]
        else:  # pipelined: it starts when the one before it has answered (uvicorn's queue)
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, self.app))  # type: ignore[arg-type]
        return True

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            error = InvalidRequest(
                f"the request headers were not complete within {self.header_timeout_s:g}s",
                code="request_timeout",
            )
            body = json.dumps(error.body()).encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
            )
        self.transport.close()


def header_timeout_protocol(
    header_timeout_s: float, fast_routes: FastRoutes | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (``Config(http=...)``) with this header deadline, serving
    ``fast_routes`` itself."""
    return type(
        "HeaderTimeoutProtocol",
        (_HeaderTimeoutProtocol,),
        {"header_timeout_s": header_timeout_s, "fast_routes": fast_routes},
    )


def limited_app(
    app: ASGIApp,
    limits: ReadLimits,
    on_refused: Callable[[Scope, str], None] | None = None,
) -> ASGIApp:
    """``app`` behind the body limits (asgi.BodyLimits)."""
    return BodyLimits(
        app,
        max_bytes=limits.max_request_bytes,
        timeout_s=limits.body_timeout_s,
        on_refused=on_refused,
    )


def server_config(
    app: ASGIApp,
    limits: ReadLimits,
    log_level: str,
    fast_routes: FastRoutes | None = None,
    **options: Any,
) -> uvicorn.Config:
    """uvicorn's config for ``app`` (already behind ``limited_app``) with the header limit,
    and ``fast_routes`` served by the protocol itself."""
    return uvicorn.Config(
        app,
        http=header_timeout_protocol(limits.header_timeout_s, fast_routes),
        log_level=log_level,
        access_log=False,
        # Nothing reads the client's address: no X-Forwarded-* rewriting on every request.
        proxy_headers=False,
        lifespan="on",
        **options,
    )


def address_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_worker(settings: WorkerSettings, host: str, port: int, log_level: str = "info") -> int:
    """Serve until SIGINT/SIGTERM; exit status 1 when the engine failed to load or warm up.

    Raises CannotBind when the address is taken: nothing has started yet.
    """
    # Here, not at the top: the gateway runs this module's server without the worker's app
    # and its engines (numpy among them).
    from tidegate.worker.app import create_app, fast_routes

    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    sock = bind(host, port)
    # The first line of output is the address: the gateway and tests read it.
    print(address_of(sock), flush=True)
    server: uvicorn.Server | None = None
    failed = False

    def on_fatal() -> None:
        nonlocal failed
        failed = True
        if server is not None:
            server.should_exit = True

    inner = create_app(settings, on_fatal=on_fatal)
    limits = WORKER_READ_LIMITS
    app = limited_app(inner, limits)
    routes = fast_routes(inner, limits.max_request_bytes, limits.body_timeout_s)
    config = server_config(app, limits, log_level, fast_routes=routes, timeout_graceful_shutdown=10)
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    return 1 if failed else 0
