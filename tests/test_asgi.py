"""The shared error handlers: a client that went away is not logged as a bug."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import FastAPI

from tidegate.asgi import ClientGone, install_error_handlers


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/gone")
    async def gone() -> None:
        raise ClientGone

    @app.post("/bug")
    async def bug() -> None:
        raise RuntimeError("a real bug")

    return app


@pytest.mark.asyncio
async def test_a_client_that_went_away_is_answered_499_without_an_error_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    transport = httpx.ASGITransport(app=_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        with caplog.at_level(logging.DEBUG, logger="tidegate"):
            gone = await client.post("/gone")
            bug = await client.post("/bug")
    assert gone.status_code == 499
    assert gone.json()["error"]["code"] == "client_closed_request"
    assert bug.status_code == 500
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == ["unexpected error on POST /bug"]
