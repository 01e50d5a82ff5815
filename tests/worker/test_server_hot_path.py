"""The HTTP servers' transport: what a handler writes in one event-loop turn leaves in one
``write`` (uvicorn writes a response's head and body apart), and nothing is lost on close."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tidegate.worker.server import _OneWritePerTurn


class Recorder:
    """The socket's side of a transport: what was written, in which calls."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self.closed


def joined(recorder: Recorder) -> Any:
    return _OneWritePerTurn(recorder, asyncio.get_running_loop())  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_head_and_body_of_one_turn_leave_in_one_write() -> None:
    recorder = Recorder()
    transport = joined(recorder)
    transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    transport.write(b"{}")
    assert transport.get_write_buffer_size() == 40
    await asyncio.sleep(0)  # the end of this turn
    await asyncio.sleep(0)
    assert recorder.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
    transport.write(b"next")  # a later turn is a write of its own
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert recorder.writes[1:] == [b"next"]


@pytest.mark.asyncio
async def test_close_sends_what_is_pending_first() -> None:
    recorder = Recorder()
    transport = joined(recorder)
    transport.write(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
    transport.close()
    assert recorder.writes == [b"HTTP/1.1 408 Request Timeout\r\n\r\n"]
    assert recorder.closed
    assert transport.is_closing()  # the rest goes to the transport itself
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(recorder.writes) == 1  # the turn's flush finds nothing left
