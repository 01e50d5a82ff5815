"""The gateway's own HTTP/1.1 client to replicas (``proxy.ReplicaPool`` and ``forward``).

The replica is a raw asyncio server in this process that answers with bytes written by
hand, so each framing a replica may use (Content-Length, chunked, a body ended by the
connection's close) and each way it may fail is exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from tidegate.errors import ReplicaFailed
from tidegate.gateway.proxy import (
    ConnectFailed,
    CutAnswer,
    NoAnswer,
    ReplicaGone,
    ReplicaPool,
    forward,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
JSON = b"content-type: application/json\r\n"
pytestmark = pytest.mark.asyncio


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request: its head and its body (by Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)


class Replica:
    """A server whose ``handler(reader, writer, n)`` answers the n-th request of a connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while not reader.at_eof():
                try:
                    self.requests.append(await read_request(reader))
                except asyncio.IncompleteReadError:
                    break
                n += 1
                await self.handler(reader, writer, n)
                if writer.is_closing():
                    break
        finally:
            writer.close()


@asynccontextmanager
async def replica(handler: Handler) -> AsyncIterator[Replica]:
    server_side = Replica(handler)
    server = await asyncio.start_server(server_side._serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server_side.url = f"http://127.0.0.1:{port}"
    try:
        yield server_side
    finally:
        server.close()
        await server.wait_closed()


def whole(body: bytes, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    length = f"content-length: {len(body)}\r\n".encode()
    return b"HTTP/1.1 " + status + b"\r\n" + JSON + extra + length + b"\r\n" + body


async def ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
    writer.write(whole(b'{"n": %d}' % n, extra=b"x-replica: r1\r\nserver: fake\r\n"))
    await writer.drain()


async def test_keep_alive_one_connection_for_many_requests() -> None:
    pool = ReplicaPool()
    async with replica(ok) as rep:
        for n in (1, 2, 3):
            answer = await forward(pool, rep.url, "/v1/embeddings", b"{}", {}, stream=False)
            assert answer.status == 200
            assert answer.body == b'{"n": %d}' % n
        assert rep.connections == 1
        # hop-by-hop headers are the gateway's own business; the rest pass on, as ASGI has them
        assert (b"x-replica", b"r1") in answer.headers
        names = {name for name, _ in answer.headers}
        assert b"content-length" not in names
        assert b"server" not in names
    await pool.close()


async def test_the_request_as_written() -> None:
    pool = ReplicaPool()
    async with replica(ok) as rep:
        headers = {"content-type": "application/json", "x-tidegate-priority": "high"}
        await forward(pool, rep.url + "/base", "/v1/embeddings", b'{"a":1}', headers, stream=False)
        head, body = rep.requests[0]
    assert head.startswith(b"POST /base/v1/embeddings HTTP/1.1\r\n")
    port = rep.url.rsplit(":", 1)[1]
    assert f"host: 127.0.0.1:{port}\r\n".encode() in head
    assert b"x-tidegate-priority: high\r\n" in head
    assert body == b'{"a":1}'
    await pool.close()


async def test_a_header_with_a_line_break_is_never_sent() -> None:
    pool = ReplicaPool()
    async with replica(ok) as rep:
        with pytest.raises(ValueError, match="line break"):
            await forward(
                pool, rep.url, "/v1/x", b"{}", {"x-request-id": "a\r\nx-evil: 1"}, stream=False
            )
        assert rep.requests == []
    await pool.close()


async def test_chunked_stream_passes_through_part_by_part() -> None:
    step = asyncio.Event()

    async def sse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for event in (b"data: a\n\n", b"data: b\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await step.wait()  # the next part only once the gateway has passed this one on
            step.clear()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    pool = ReplicaPool()
    firsts: list[float] = []
    async with replica(sse) as rep:
        answer = await forward(
            pool, rep.url, "/v1/completions", b"{}", {}, stream=True, on_first_byte=firsts.append
        )
        assert answer.status == 200
        assert answer.chunks is not None
        got = []
        async for chunk in answer.chunks:
            got.append(chunk)
            step.set()
        assert got == [b"data: a\n\n", b"data: b\n\n"]
        assert len(firsts) == 1
        again = await forward(pool, rep.url, "/v1/completions", b"{}", {}, stream=True)
        assert again.chunks is not None
        async for _ in again.chunks:
            step.set()
        assert rep.connections == 1  # a stream read to its end gives the connection back
    await pool.close()


async def test_a_body_ended_by_the_close_of_the_connection() -> None:
    async def until_close(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n" + JSON + b'connection: close\r\n\r\n{"old": ')
        await writer.drain()
        writer.write(b"true}")
        await writer.drain()
        writer.close()

    pool = ReplicaPool()
    async with replica(until_close) as rep:
        answer = await forward(pool, rep.url, "/v1/embeddings", b"{}", {}, stream=False)
        assert answer.body == b'{"old": true}'
        await forward(pool, rep.url, "/v1/embeddings", b"{}", {}, stream=False)
        assert rep.connections == 2  # such a connection is never reused
    await pool.close()


async def test_nobody_listening_is_a_connect_failure() -> None:
    async with replica(ok) as rep:
        url = rep.url
    pool = ReplicaPool()
    with pytest.raises(ConnectFailed) as caught:
        await forward(pool, url, "/v1/embeddings", b"{}", {}, stream=False)
    assert not isinstance(caught.value, ReplicaGone)
    await pool.close()


async def test_a_kept_alive_connection_closed_unanswered_goes_to_another() -> None:
    """The server closed a kept-alive connection as the request went out: nothing was
    answered, so the request may go to another connection (ReplicaGone: no outlier vote)."""

    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            await ok(reader, writer, n)
        else:
            writer.close()

    pool = ReplicaPool()
    async with replica(once) as rep:
        await forward(pool, rep.url, "/v1/embeddings", b"{}", {}, stream=False)
        with pytest.raises(ReplicaGone):
            await forward(pool, rep.url, "/v1/embeddings", b"{}", {}, stream=False)
        answer = await forward(pool, rep.url, "/v1/embeddings", b"{}", {}, stream=False)
        assert answer.status == 200  # on a new connection
    await pool.close()


@pytest.mark.parametrize(
    ("answer", "raised"),
    [
        (b"", NoAnswer),  # closed without a byte
        (b'HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{"cut', CutAnswer),  # mid-body
        (b"HTTP/1.1 200 OK\r\ncontent-len", CutAnswer),  # inside the head
    ],
    ids=["no_byte", "cut_in_the_body", "cut_in_the_head"],
)
async def test_a_replica_that_dies_before_a_whole_answer_sends_the_request_elsewhere(
    answer: bytes, raised: type[NoAnswer]
) -> None:
    """A new connection closed before a whole answer came (the replica crashed, its node
    went): the gateway passes a whole answer on only once complete, so nothing reached the
    client; it is retried elsewhere and counts against the replica (a NoAnswer, not
    ReplicaGone)."""

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if answer:
            writer.write(answer)
            await writer.drain()
        writer.close()

    pool = ReplicaPool()
    async with replica(cut) as rep:
        with pytest.raises(raised) as caught:
            await forward(pool, rep.url, "/v1/embeddings", b"{}", {}, stream=False)
        assert not isinstance(caught.value, ReplicaGone)
    await pool.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",  # a bad length
    ],
)
async def test_a_broken_answer_is_a_replica_failure(answer: bytes) -> None:
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(answer)
        await writer.drain()
        writer.close()

    pool = ReplicaPool()
    async with replica(broken) as rep:
        with pytest.raises(ReplicaFailed):
            await forward(pool, rep.url, "/v1/embeddings", b"{}", {}, stream=False)
    await pool.close()


async def test_a_stream_cut_mid_way_is_a_replica_failure_and_not_reused() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: a\n\n\r\n")
        await writer.drain()
        writer.close()

    pool = ReplicaPool()
    async with replica(cut) as rep:
        answer = await forward(pool, rep.url, "/v1/completions", b"{}", {}, stream=True)
        assert answer.chunks is not None
        got: list[bytes] = []

        async def read_all() -> None:
            assert answer.chunks is not None
            async for chunk in answer.chunks:
                got.append(chunk)

        with pytest.raises(ReplicaFailed):
            await read_all()
        assert got == [b"data: a\n\n"]
    await pool.close()


async def test_cancelled_while_waiting_closes_the_connection() -> None:
    """The client went away: the forward is cancelled, and the replica sees its connection
    close (that is how it learns to stop the work)."""
    closed = asyncio.Event()
    received = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        received.set()
        await reader.read()  # until the gateway closes its side
        closed.set()

    pool = ReplicaPool()
    async with replica(slow) as rep:
        task = asyncio.create_task(
            forward(pool, rep.url, "/v1/embeddings", b"{}", {}, stream=False)
        )
        await asyncio.wait_for(received.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(closed.wait(), 30)
    await pool.close()
