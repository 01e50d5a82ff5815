"""Forwarding one request to one replica: whole, or streamed through as it arrives."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx

from tidegate.errors import ReplicaFailed

# Replicas are on a trusted network; a generation may run for minutes, so no read timeout.
REPLICA_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
REPLICA_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=256)
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}


def replica_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=REPLICA_TIMEOUT, limits=REPLICA_LIMITS)


class ConnectFailed(Exception):
    """Nothing reached the replica: the request may safely go to another one."""


@dataclass
class Forwarded:
    status: int
    headers: dict[str, str]
    body: bytes | None  # None: streaming, read ``chunks``
    chunks: AsyncIterator[bytes] | None = None
    first_byte_at: float | None = None


async def forward(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    stream: bool,
    on_first_byte: Callable[[float], None] | None = None,
) -> Forwarded:
    """POST ``body`` to ``url``. Raises ConnectFailed before any byte, ReplicaFailed after."""
    request = client.build_request("POST", url, content=body, headers=headers)
    try:
        response = await client.send(request, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise ConnectFailed(f"{url}: {exc}") from exc
    except httpx.TransportError as exc:
        raise ReplicaFailed(f"replica at {url} failed: {type(exc).__name__}: {exc}") from exc
    passed = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
    if not stream or response.status_code != 200:
        try:
            content = await response.aread()
        except httpx.TransportError as exc:
            raise ReplicaFailed(f"replica at {url} failed mid-response: {exc}") from exc
        finally:
            await response.aclose()
        return Forwarded(response.status_code, passed, content)
    return Forwarded(response.status_code, passed, None, _chunks(response, url, on_first_byte))


async def _chunks(
    response: httpx.Response, url: str, on_first_byte: Callable[[float], None] | None
) -> AsyncIterator[bytes]:
    first = True
    try:
        async for chunk in response.aiter_raw():
            if first and on_first_byte is not None:
                on_first_byte(time.monotonic())
                first = False
            yield chunk
    except httpx.TransportError as exc:
        raise ReplicaFailed(f"replica at {url} failed mid-stream: {exc}") from exc
    finally:
        await response.aclose()
