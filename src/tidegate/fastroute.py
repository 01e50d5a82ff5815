"""Routes served by the HTTP protocol itself, not through ASGI: the proxy's hot path.

The gateway's own work per proxied request (admission, a queue pick, a routing choice) is a
few dozen microseconds; the ASGI layering around it (uvicorn's scope and request cycle, the
body middleware, Starlette's request and response objects, uvicorn's checks of every header
it writes) cost as much again. A *fast route* is a ``POST`` to one of a few paths, taken off
uvicorn's protocol when its headers are complete: its body is read from the parser's
callbacks within the same limits as ``asgi.BodyLimits``, the handler gets the path, the
headers and the body, and its ``Reply`` is written in one piece (or as a chunked stream).
Everything else (other paths and methods, HTTP/1.0, ``Expect: 100-continue``, a path that is
not exactly a route's, with ``%`` escapes or an absolute URL) goes the ASGI way unchanged.

``_FastCycle`` stands in for uvicorn's ``RequestResponseCycle`` in the protocol: the parser's
callbacks fill its ``body``, ``connection_lost`` sets ``disconnected``, a graceful shutdown
clears ``keep_alive``, and a pipelined request waits in the protocol's queue until the one
before it has answered, all as uvicorn does for its own cycles.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Message, Receive
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from tidegate.asgi import REQUEST_TIMEOUT, ClientGone, ClientWatch
from tidegate.errors import InvalidRequest, PromptTooLong, TidegateError

log = logging.getLogger("tidegate")


@dataclass(slots=True)
class Reply:
    """A handler's answer: whole (``body``) or a stream of chunks (``chunks``, SSE)."""

    status: int
    headers: list[tuple[bytes, bytes]]  # lower-case names; no content-length or framing
    body: bytes = b""
    chunks: AsyncIterator[bytes] | None = None
    # Bookkeeping for once the answer is written, or cannot be (the client went away): the
    # writer calls ``settle()`` exactly once, so that the client does not wait for it.
    after: Callable[[], None] | None = None

    def settle(self) -> None:
        after, self.after = self.after, None
        if after is not None:
            after()


def json_reply(status: int, payload: Any, headers: Mapping[str, str] | None = None) -> Reply:
    """A whole JSON answer, with these extra headers."""
    extra = [(n.lower().encode("latin-1"), v.encode("latin-1")) for n, v in (headers or {}).items()]
    return Reply(
        status, [(b"content-type", b"application/json"), *extra], json.dumps(payload).encode()
    )


def error_reply(exc: TidegateError, headers: Mapping[str, str] | None = None) -> Reply:
    """The OpenAI-shaped answer of ``exc``, with its own headers (Retry-After, ...)."""
    return json_reply(exc.status, exc.body(), {**exc.headers(), **(headers or {})})


# path, headers (lower-case names, the first of repeated ones), body, and the channel on
# which the client's going away shows (an ASGI receive: after the body, only the disconnect).
Handler = Callable[[str, Mapping[str, str], bytes, Receive], Awaitable[Reply]]


@dataclass(frozen=True, slots=True)
class FastRoutes:
    """The ``POST`` paths a protocol serves itself, their handler and the body limits."""

    paths: frozenset[bytes]
    handler: Handler
    max_bytes: int
    body_timeout_s: float
    on_refused: Callable[[str, str], None] | None = None  # (path, outcome) of a refusal
    watch_streams: bool = field(default=True)  # a stream stops when its client goes away


class FastCycle:
    """One fast-routed request on a connection: uvicorn's cycle interface, our own work."""

    __slots__ = (
        "_default_headers",
        "_disconnected",
        "_gone_callbacks",
        "_headers",
        "_path",
        "_routes",
        "_transport",
        "body",
        "flow",
        "keep_alive",
        "message_event",
        "more_body",
        "on_response",
        "response_complete",
        "response_started",
    )

    def __init__(
        self,
        routes: FastRoutes,
        path: str,
        headers: Mapping[str, str],
        *,
        transport: asyncio.Transport,
        flow: Any,
        default_headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
        on_response: Callable[[], None],
    ) -> None:
        self._routes = routes
        self._path = path
        self._headers = headers
        self._transport = transport
        self._default_headers = default_headers
        self.flow = flow
        self.keep_alive = keep_alive
        self.on_response = on_response
        self.message_event = asyncio.Event()
        self.body = bytearray()
        self.more_body = True
        self._disconnected = False
        self._gone_callbacks: list[Callable[[], None]] = []
        self.response_started = False
        self.response_complete = False

    @property
    def disconnected(self) -> bool:
        return self._disconnected

    @disconnected.setter
    def disconnected(self, value: bool) -> None:
        """Set by the protocol when the connection is lost: the watches are told at once."""
        self._disconnected = value
        if value:
            callbacks, self._gone_callbacks = self._gone_callbacks, []
            for callback in callbacks:
                callback()

    def tell_when_gone(self, callback: Callable[[], None], tell: bool) -> None:
        """Call ``callback`` when the client goes away (at once when it has gone), or
        (``tell`` False) no longer: ``asgi.ClientWatch`` without a task or a timer."""
        if not tell:
            if callback in self._gone_callbacks:
                self._gone_callbacks.remove(callback)
        elif self._disconnected:
            callback()
        else:
            self._gone_callbacks.append(callback)

    async def run_asgi(self, app: object) -> None:
        """Called as uvicorn calls its own cycle's (``app`` is the ASGI app: unused)."""
        try:
            body = await self._read_body()
            if body is None:
                return
            reply = await self._routes.handler(self._path, self._headers, body, self.receive)
            try:
                if reply.chunks is None:
                    self._write_whole(reply)
                else:
                    await self._write_stream(reply)
            finally:
                reply.settle()
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError | ClientGone):
                log.error("fast route %s failed", self._path, exc_info=exc)
            if not self.response_started and not self.disconnected:
                failure = TidegateError("internal error: the server failed on this request")
                self._refuse(failure, "failed", close=True, report=False)
            elif not self.response_complete:
                self._transport.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self.on_response = _nothing

    async def receive(self) -> Message:
        """ASGI's receive, for the handler's disconnect watch (the body is already read)."""
        while not self.disconnected and not self.response_complete:
            self.flow.resume_reading()
            await self.message_event.wait()
            self.message_event.clear()
        return {"type": "http.disconnect"}

    # The body, within the limits (asgi.BodyLimits says the same in ASGI terms).

    async def _read_body(self) -> bytes | None:
        length = self._headers.get("content-length")
        limit = self._routes.max_bytes
        if length is not None:
            if not length.isdigit():
                bad = InvalidRequest(f"Content-Length {length!r} is not a number")
                self._refuse(bad, "invalid", close=True)
                return None
            if int(length) > limit:
                self._refuse(_too_large(int(length), limit), "invalid", close=True)
                return None
        if not self.more_body:  # the whole body came with the headers: the common case
            if len(self.body) > limit:
                self._refuse(_too_large(len(self.body), limit), "invalid", close=True)
                return None
            return bytes(self.body)
        try:
            async with asyncio.timeout(self._routes.body_timeout_s):
                while self.more_body and not self.disconnected:
                    if len(self.body) > limit:
                        self._refuse(_too_large(len(self.body), limit), "invalid", close=True)
                        return None
                    self.flow.resume_reading()
                    await self.message_event.wait()
                    self.message_event.clear()
        except TimeoutError:
            late = InvalidRequest(
                f"the request body was not complete {self._routes.body_timeout_s:g}s after "
                f"its headers ({len(self.body)} bytes received)",
                code="request_timeout",
            )
            self._refuse(late, "invalid", close=True, status=REQUEST_TIMEOUT)
            return None
        if self.disconnected:
            self._report("cancelled")
            return None
        if len(self.body) > limit:
            self._refuse(_too_large(len(self.body), limit), "invalid", close=True)
            return None
        return bytes(self.body)

    def _refuse(
        self,
        error: TidegateError,
        outcome: str,
        *,
        close: bool,
        status: int | None = None,
        report: bool = True,
    ) -> None:
        if report:
            self._report(outcome)
        if close:
            self.keep_alive = False  # the rest of the body is not read: its framing is lost
        self._write_whole(error_reply(error), status)

    def _report(self, outcome: str) -> None:
        if self._routes.on_refused is not None:
            self._routes.on_refused(self._path, outcome)

    # The answer.

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], framing: bytes) -> list[bytes]:
        parts = [STATUS_LINE[status]]
        for name, value in self._default_headers:
            parts += (name, b": ", value, b"\r\n")
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts.append(framing)
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return parts

    def _write_whole(self, reply: Reply, status: int | None = None) -> None:
        self.response_started = True
        if self.disconnected:
            self._complete()
            return
        body = reply.body
        parts = self._head(
            status or reply.status, reply.headers, b"content-length: %d\r\n" % len(body)
        )
        parts.append(body)
        self._transport.write(b"".join(parts))
        # The whole answer is one write already: send it now, not at the end of the loop's
        # turn (worker.server's joining transport), so that ``Reply.settle`` runs after it.
        flush = getattr(self._transport, "flush", None)
        if flush is not None:
            flush()
        self._complete()

    async def _write_stream(self, reply: Reply) -> None:
        chunks = reply.chunks
        assert chunks is not None
        self.response_started = True
        headers = reply.headers
        if not any(name == b"content-type" for name, _ in headers):
            headers = [*headers, (b"content-type", b"text/event-stream")]
        transport = self._transport
        transport.write(
            b"".join(self._head(reply.status, headers, b"transfer-encoding: chunked\r\n"))
        )
        watch = ClientWatch(self.receive) if self._routes.watch_streams else None
        try:
            while not self.disconnected:
                if watch is None:
                    chunk = await anext(chunks, None)
                else:
                    async with watch:  # the client gone cancels the read
                        chunk = await anext(chunks, None)
                if chunk is None:
                    transport.write(b"0\r\n\r\n")
                    break
                if chunk:
                    transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                if self.flow.write_paused and not self.disconnected:
                    await self.flow.drain()
        except ClientGone:
            pass
        finally:
            if watch is not None:
                watch.close()
            await chunks.aclose()  # type: ignore[attr-defined]
        if self.disconnected:
            self.response_complete = True
            self.message_event.set()
            return
        self._complete()

    def _complete(self) -> None:
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self._transport.close()
        self.on_response()


def _too_large(size: int, limit: int) -> TidegateError:
    return PromptTooLong(
        f"request body of {size} bytes or more is over the limit of {limit}",
        code="request_too_large",
    )


def _nothing() -> None:
    pass


def fast_path_of(url: bytes, routes: FastRoutes) -> str | None:
    """The route of a request target, when it is exactly one (a query string allowed)."""
    path, _, _ = url.partition(b"?")
    return path.decode("ascii") if path in routes.paths else None


def headers_of(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """uvicorn's header list (lower-case names) as a dict: the first of repeated ones."""
    headers: dict[str, str] = {}
    for name, value in raw:
        key = name.decode("latin-1")
        if key not in headers:
            headers[key] = value.decode("latin-1")
    return headers
