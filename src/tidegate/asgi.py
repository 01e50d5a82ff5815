"""HTTP plumbing shared by the worker and the gateway: bodies, errors, SSE, disconnects."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
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

    async def on_bad_parameter(request: Request, exc: Exception) -> JSONResponse:
        # FastAPI's own validation of a typed parameter (a query flag): 400, not its 422.
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        param = str(first["loc"][-1]) if first["loc"] else None
        return error_response(InvalidRequest(f"{where}: {first['msg']}", param=param))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # The details (exception text, addresses) are for the log, never for the client.
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(
            TidegateError("internal error: the server failed on this request; it is logged")
        )

    app.add_exception_handler(TidegateError, on_tidegate_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_bad_parameter)
    app.add_exception_handler(ClientGone, on_client_gone)
    app.add_exception_handler(Exception, on_unexpected)


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
