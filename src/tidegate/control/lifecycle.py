"""What every orchestrator does the same way in a replica's life: readiness and restarts.

A replica's worker (a ``tidegate worker`` server, wherever it runs) is READY once its
``/readyz`` answers 200, i.e. after warm-up passed; until then it is WARMING with the phase
the worker reports. Its ``slots`` come from the configuration, else from its ``/stats``.

A replica that dies without being stopped is restarted, one life after another, after a
back-off of 1, 2, 4 ... ``max_backoff_s`` seconds, reset to 1 s once a life was READY for
``RESET_BACKOFF_AFTER_S``. Used by ``control.local`` (processes) and ``control.ray`` (actors).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import httpx

from tidegate.gateway.replicas import Replica, ReplicaState

log = logging.getLogger("tidegate.control")

POLL_INTERVAL_S = 0.2  # /readyz while a worker starts
MIN_BACKOFF_S = 1.0  # first restart delay; doubles up to max_backoff_s
RESET_BACKOFF_AFTER_S = 60.0  # ready this long: the next failure backs off from 1 s again
DETAIL_MAX_CHARS = 300


async def until_ready(
    client: httpx.AsyncClient, replica: Replica, url: str, configured_slots: int | None
) -> int:
    """Poll ``url``/readyz until 200 (WARMING meanwhile); then the replica's slots."""
    while True:
        try:
            response = await client.get(f"{url}/readyz")
            if response.status_code == 200:
                if configured_slots is not None:
                    return configured_slots
                stats = await client.get(f"{url}/stats")
                stats.raise_for_status()
                return slots_from(stats, replica.id)
            replica.set_state(ReplicaState.WARMING, f"worker {phase(response)}")
        except httpx.HTTPError as exc:  # not listening yet, or busy loading: ask again
            log.debug("replica %s not answering yet: %r", replica.id, exc)
        await asyncio.sleep(POLL_INTERVAL_S)


async def ready_before(
    client: httpx.AsyncClient,
    replica: Replica,
    url: str,
    configured_slots: int | None,
    exited: asyncio.Future[Any],
    deadline: float,
) -> int | None:
    """``until_ready`` raced against the worker's end (``exited``) and a monotonic deadline:
    the slots when it became ready first, else None."""
    readiness = asyncio.create_task(
        until_ready(client, replica, url, configured_slots), name=f"ready-{replica.id}"
    )
    try:
        left = max(0.0, deadline - time.monotonic())
        await asyncio.wait({exited, readiness}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel([readiness])
    if readiness.cancelled() or not readiness.done() or exited.done():
        return None
    return readiness.result()


async def restart_forever(
    replica: Replica, run_once: Callable[[], Awaitable[float]], max_backoff_s: float
) -> None:
    """Run one life of a replica after another; ``run_once`` returns how long it was READY.

    Ends only when cancelled (the orchestrator stops the replica).
    """
    max_backoff_s = max(max_backoff_s, MIN_BACKOFF_S)
    backoff = MIN_BACKOFF_S
    while True:
        ready_for_s = await run_once()
        if ready_for_s >= RESET_BACKOFF_AFTER_S:
            backoff = MIN_BACKOFF_S
        delay = min(backoff, max_backoff_s)
        backoff = min(backoff * 2, max_backoff_s)
        log.warning("replica %s: restarting in %gs (%s)", replica.id, delay, replica.detail)
        await asyncio.sleep(delay)
        replica.restarts += 1


async def cancel(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel tasks and wait until they are done (a cancellation of the caller still works)."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
    for task in tasks:
        retrieve(task, task.get_name() if isinstance(task, asyncio.Task) else "future")


def retrieve(task: asyncio.Future[Any], what: str) -> None:
    """Log a finished task's exception (instead of leaving it unretrieved)."""
    if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("%s failed: %r", what, exc)


def slots_from(stats: httpx.Response, replica_id: str) -> int:
    """The ``slots`` a worker's ``/stats`` reports; 1 (with a warning) when unusable."""
    try:
        slots = stats.json().get("slots")
    except ValueError:
        slots = None
    if isinstance(slots, int) and not isinstance(slots, bool) and slots > 0:
        return slots
    log.warning("replica %s: /stats has no usable slots (%r); using 1", replica_id, slots)
    return 1


def phase(response: httpx.Response) -> str:
    """The phase a worker's ``/readyz`` body reports (``loading``, ``warming`` ...)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("status"), str):
        return str(body["status"])
    return f"answers {response.status_code}"


def clip(text: str) -> str:
    """A replica's ``detail``, cut to ``DETAIL_MAX_CHARS``."""
    return text if len(text) <= DETAIL_MAX_CHARS else text[: DETAIL_MAX_CHARS - 3] + "..."
