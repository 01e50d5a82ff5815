"""The shared error handlers: a client that went away is not logged as a bug."""

from __future__ import annotations

import logging
from typing import Any

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


@pytest.mark.asyncio
async def test_client_watch_cancels_a_long_await_when_the_client_goes() -> None:
    """The watcher starts a moment into the await; the disconnect then ends it."""
    import asyncio

    from tidegate.asgi import ClientWatch

    disconnected = asyncio.Event()
    asked = asyncio.Event()

    async def receive() -> dict[str, str]:
        asked.set()  # the watcher is listening
        await disconnected.wait()
        return {"type": "http.disconnect"}

    watch = ClientWatch(receive)
    never = asyncio.get_running_loop().create_future()

    async def wait_forever() -> None:
        async with watch:
            await never

    task = asyncio.create_task(wait_forever())
    await asyncio.wait_for(asked.wait(), 30)
    disconnected.set()
    with pytest.raises(ClientGone):
        await asyncio.wait_for(task, 30)
    assert watch.gone
    with pytest.raises(ClientGone):  # once gone, every later bound fails at once
        async with watch:
            pass
    watch.close()


@pytest.mark.asyncio
async def test_client_watch_reads_nothing_of_a_quick_answer() -> None:
    """An await done before the watcher starts never takes a message from the channel:
    the response's own sending owns it from ``close()`` on."""
    import asyncio

    from tidegate.asgi import ClientWatch

    reads = 0

    async def receive() -> dict[str, str]:
        nonlocal reads
        reads += 1
        await asyncio.get_running_loop().create_future()
        return {"type": "http.disconnect"}

    watch = ClientWatch(receive)
    async with watch:
        await asyncio.sleep(0)
    watch.close()
    assert watch._timer is None  # its start is called off: no watcher will ever read
    assert watch._task is None
    assert reads == 0


@pytest.mark.asyncio
async def test_client_watch_of_a_channel_that_tells_reads_nothing_and_starts_nothing() -> None:
    """A channel whose owner calls back when its client goes (a fast route's cycle) is
    never read: no timer, no task; the callback ends the bounded await, and ``close()``
    stops the callbacks."""
    import asyncio

    from tidegate.asgi import ClientWatch

    class Channel:
        def __init__(self) -> None:
            self.callbacks: list[Any] = []
            self.gone = False

        async def receive(self) -> dict[str, str]:
            raise AssertionError("a channel that tells is never read")

        def tell_when_gone(self, callback: Any, tell: bool) -> None:
            if not tell:
                if callback in self.callbacks:
                    self.callbacks.remove(callback)
            elif self.gone:
                callback()
            else:
                self.callbacks.append(callback)

        def lose(self) -> None:
            self.gone = True
            for callback in self.callbacks:
                callback()

    channel = Channel()
    watch = ClientWatch(channel.receive)
    entered = asyncio.Event()

    async def wait_forever() -> None:
        async with watch:
            entered.set()
            await asyncio.get_running_loop().create_future()

    task = asyncio.create_task(wait_forever())
    await asyncio.wait_for(entered.wait(), 30)
    assert (watch._timer, watch._task) == (None, None)
    channel.lose()
    with pytest.raises(ClientGone):
        await asyncio.wait_for(task, 30)
    watch.close()
    assert channel.callbacks == []

    late = Channel()
    late.gone = True  # gone before the first bound: it fails at once
    watch = ClientWatch(late.receive)
    with pytest.raises(ClientGone):
        async with watch:
            pass
    watch.close()
    assert late.callbacks == []
