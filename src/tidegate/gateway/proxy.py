"""Forwarding one request to one replica: whole, or streamed through as it arrives.

The client is aiohttp: bench_gateway measured httpx's connection pool at 70% of the
gateway's CPU under 64 concurrent requests (it rescans the pool on every request and
response), which cut the gateway to 8-35% of the replica's own throughput.

Errors carry no replica address or library text: a client reads them. Those details go to
the log, where the message of ``ConnectFailed`` also goes (the caller logs it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp

from tidegate.errors import ReplicaFailed

log = logging.getLogger("tidegate.gateway")
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}


def replica_client() -> aiohttp.ClientSession:
    """One keep-alive pool for all replicas. No read timeout: a generation may run minutes."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=None)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
    )


class ConnectFailed(Exception):
    """Nothing reached the replica: the request may safely go to another one."""


class ReplicaGone(ConnectFailed):
    """The replica stopped between its slot being given and the request being sent.

    Not a failure of the replica's answers (outlier detection does not count it): its
    orchestrator already knows, and restarts or removes it.
    """


@dataclass
class Forwarded:
    status: int
    headers: dict[str, str]
    body: bytes | None  # None: streaming, read ``chunks``
    chunks: AsyncIterator[bytes] | None = None


async def forward(
    client: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    stream: bool,
    on_first_byte: Callable[[float], None] | None = None,
) -> Forwarded:
    """POST ``body`` to ``url``. Raises ConnectFailed before any byte, ReplicaFailed after."""
    try:
        response = await client.post(url, data=body, headers=headers)
    except (aiohttp.ClientConnectorError, aiohttp.ServerTimeoutError) as exc:
        raise ConnectFailed(f"{url}: {exc}") from exc
    except aiohttp.ClientError as exc:
        log.warning("replica at %s failed: %s: %s", url, type(exc).__name__, exc)
        raise ReplicaFailed("the replica failed before it answered") from exc
    passed = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
    if not stream or response.status != 200:
        try:
            content = await response.read()
        except aiohttp.ClientError as exc:
            log.warning("replica at %s failed mid-response: %s: %s", url, type(exc).__name__, exc)
            raise ReplicaFailed("the replica failed while it answered") from exc
        finally:
            response.release()
        return Forwarded(response.status, passed, content)
    return Forwarded(response.status, passed, None, _chunks(response, url, on_first_byte))


async def _chunks(
    response: aiohttp.ClientResponse, url: str, on_first_byte: Callable[[float], None] | None
) -> AsyncIterator[bytes]:
    first = True
    try:
        async for chunk in response.content.iter_any():
            if first and on_first_byte is not None:
                on_first_byte(time.monotonic())
                first = False
            yield chunk
    except aiohttp.ClientError as exc:
        log.warning("replica at %s failed mid-stream: %s: %s", url, type(exc).__name__, exc)
        raise ReplicaFailed("the replica failed while it streamed its answer") from exc
    finally:
        response.close()  # not release(): an unfinished stream must not go back to the pool
