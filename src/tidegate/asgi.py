"""HTTP plumbing shared by the worker and the gateway: bodies, errors, SSE, disconnects."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidegate.errors import InvalidRequest, TidegateError

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

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(TidegateError(f"internal error: {type(exc).__name__}"))

    app.add_exception_handler(TidegateError, on_tidegate_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientGone, on_client_gone)
    app.add_exception_handler(Exception, on_unexpected)


async def json_body(request: Request) -> Any:
    raw = await request.body()
    if not raw:
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client goes away first; then cancel it and raise ClientGone.

    Call after the body has been read: the only message left on the channel is the
    disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
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


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
