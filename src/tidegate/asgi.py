"""HTTP plumbing shared by the worker and the gateway: bodies, errors, SSE, disconnects.

``BodyLimits`` reads a request's body before the app runs, within a size and a time limit:
the app never waits on a slow client, and never holds more than ``max_bytes`` of one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tidegate.errors import InvalidRequest, PromptTooLong, TidegateError

log = logging.getLogger("tidegate")
T = TypeVar("T")


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client went away


class ClientGone(Exception):
    """The client closed the connection before the response was ready."""


def error_response(exc: TidegateError, extra_headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), exc.status, headers={**exc.headers(), **(extra_headers or {})})


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-shaped body; an unexpected one is logged as a bug."""

    async def on_tidegate_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, TidegateError)
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        error = TidegateError(str(exc.detail), code=str(exc.status_code))
        body = error.body()
        body["error"]["type"] = "invalid_request_error" if exc.status_code < 500 else "error"
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    async def on_client_gone(request: Request, exc: Exception) -> JSONResponse:
        # Not an error of ours: the request is already counted as cancelled, and nobody
        # reads this answer (499, as nginx logs a client that closed the connection).
        log.debug("client went away during %s %s", request.method, request.url.path)
        error = TidegateError("the client closed the connection", code="client_closed_request")
        return JSONResponse(error.body(), CLIENT_CLOSED_REQUEST)

    async def on_bad_parameter(request: Request, exc: Exception) -> JSONResponse:
        # FastAPI's own validation of a typed parameter (a query flag): 400, not its 422.
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        param = str(first["loc"][-1]) if first["loc"] else None
        return error_response(InvalidRequest(f"{where}: {first['msg']}", param=param))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        return internal_error_response(request)

    app.add_exception_handler(TidegateError, on_tidegate_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_bad_parameter)
    app.add_exception_handler(ClientGone, on_client_gone)
    app.add_exception_handler(Exception, on_unexpected)


def internal_error_response(request: Request) -> JSONResponse:
    """The 500 of a bug, logged with its traceback (call it in the ``except``). The details
    (exception text, addresses) are for the log, never for the client."""
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return error_response(
        TidegateError("internal error: the server failed on this request; it is logged")
    )


REQUEST_TIMEOUT = 408


class BodyLimits:
    """ASGI middleware: a request's whole body, read within ``max_bytes`` and ``timeout_s``.

    Refused by its ``Content-Length`` before a byte of the body is read (413, and no
    ``100 Continue``); a chunked body is counted while read and cut at the limit (413); a
    body not complete ``timeout_s`` after its headers gets 408. Each refusal closes the
    connection (its framing is lost) and is reported to ``on_refused(scope, outcome)``:
    ``invalid`` (too large, too slow, or a bad Content-Length) or ``cancelled`` (the client
    went away mid-body). The app then reads the body from memory.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        timeout_s: float,
        on_refused: Callable[[Scope, str], None] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is None and _header(scope, b"transfer-encoding") is None:
            await self.app(scope, receive, send)  # no body (GET, HEAD)
            return
        if length is not None and not length.isdigit():
            error: TidegateError = InvalidRequest(f"Content-Length {length!r} is not a number")
            await self._refuse(scope, send, error, "invalid")
            return
        if length is not None and int(length) > self.max_bytes:
            await self._refuse(scope, send, self._too_large(int(length)), "invalid")
            return
        body = await self._read(scope, receive, send)
        if body is None:
            return  # refused, or the client went away
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # what is left is the disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        self._report(scope, "cancelled")
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_bytes:
                        await self._refuse(scope, send, self._too_large(size), "invalid")
                        return None
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            error = InvalidRequest(
                f"the request body was not complete {self.timeout_s:g}s after its headers "
                f"({size} bytes received)",
                code="request_timeout",
            )
            await self._refuse(scope, send, error, "invalid", REQUEST_TIMEOUT)
            return None

    def _too_large(self, size: int) -> TidegateError:
        return PromptTooLong(
            f"request body of {size} bytes or more is over the limit of {self.max_bytes}",
            code="request_too_large",
        )

    async def _refuse(
        self,
        scope: Scope,
        send: Send,
        error: TidegateError,
        outcome: str,
        status: int | None = None,
    ) -> None:
        self._report(scope, outcome)
        body = json.dumps(error.body()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status or error.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),  # the rest of the body is not read
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _report(self, scope: Scope, outcome: str) -> None:
        if self.on_refused is not None:
            self.on_refused(scope, outcome)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1")).strip()
    return None


async def json_body(request: Request) -> Any:
    """The request's body decoded as strict JSON; a 400 on anything else.

    pydantic-core's parser, not ``json``: it is faster, refuses what JSON does not have
    (``NaN``, ``Infinity``, lone surrogates, invalid UTF-8), and stops at 200 levels of
    nesting with an error instead of a RecursionError deep in the interpreter.
    """
    return decode_json(await request.body())


def decode_json(raw: bytes) -> Any:
    if not raw or raw.isspace():
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        return pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        # jiter's message says what and where ("expected value at line 1 column 7").
        reason = str(exc)
        if reason.startswith("recursion limit exceeded"):
            reason = f"nested more than {MAX_JSON_DEPTH} levels deep"
        raise InvalidRequest(f"request body is not valid JSON: {reason}") from None


MAX_JSON_DEPTH = 200  # pydantic-core's (jiter's) recursion limit; OpenAI bodies need ~6


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``unless_gone`` on a Starlette request's channel."""
    return await unless_gone(request.receive, work)


async def unless_gone(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client goes away first; then cancel it and raise ClientGone.

    Call after the body has been read: the only message left on the channel is the
    disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        watcher.cancel()
        task.cancel()  # no-op when it finished
        # Collect both, so neither is left pending; their outcome was handled above.
        await asyncio.gather(task, watcher, return_exceptions=True)


class ClientWatch:
    """One request's connection, watched for the client going away.

    ``async with watch:`` bounds an await: when the client goes away meanwhile, the await is
    cancelled and ClientGone raised (at once when it already went). The bound is an
    ``asyncio.timeout`` scope that the watch expires, so it nests with other scopes (the
    gateway's shutdown cut-off) as asyncio's own timeouts do.

    Two ways to learn of the client going away. A channel whose owner says so itself
    (``receive.__self__`` has ``tell_when_gone``: a fast route's cycle,
    ``fastroute.FastCycle``, whose connection calls back when it is lost) costs nothing per
    request: no timer, no task. Any other ASGI channel is read by one watcher task,
    started ``START_AFTER_S`` into the first ``async with`` (after the body was read: the
    only message left on the channel is the disconnect), so that a request answered sooner
    never starts one; cheaper than ``unless_disconnected`` on a proxy's path (no task per
    await). ``close()`` stops watching before the response is sent (it then owns the
    channel).
    """

    START_AFTER_S = 0.05  # a client gone is noticed this much later, at worst

    __slots__ = ("_receive", "_scopes", "_task", "_tell", "_timer", "_told", "gone")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._scopes: list[asyncio.Timeout] = []
        self._tell: Callable[[Callable[[], None], bool], None] | None = getattr(
            getattr(receive, "__self__", None), "tell_when_gone", None
        )
        self._told = False  # the channel's owner will call back
        self.gone = False

    def _start(self) -> None:
        self._timer = None
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._went()

    def _went(self) -> None:
        self.gone = True
        if self._scopes:
            now = asyncio.get_running_loop().time()
            for scope in self._scopes:
                scope.reschedule(now)

    async def __aenter__(self) -> asyncio.Timeout:
        if self._tell is not None:
            if not self._told:
                self._told = True
                self._tell(self._went, True)  # at once when it already went
        elif self._task is None and self._timer is None and not self.gone:
            self._timer = asyncio.get_running_loop().call_later(self.START_AFTER_S, self._start)
        if self.gone:
            raise ClientGone
        scope = asyncio.timeout(None)
        await scope.__aenter__()
        self._scopes.append(scope)
        return scope  # its bound: others may reschedule it too (Gateway.until_cut_off)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        scope = self._scopes.pop()
        try:
            await scope.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            if scope.expired() and self.gone:
                raise ClientGone from None
            raise

    def close(self) -> None:
        if self._told:
            assert self._tell is not None
            self._told = False
            self._tell(self._went, False)
        # Cancelled, not awaited: the watcher is parked in ``receive()`` and the cancellation
        # reaches it there before it can take another message from the channel.
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()
            self._task = None


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
