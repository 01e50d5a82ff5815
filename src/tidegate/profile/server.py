"""The server under measurement: a ``tidegate worker`` the planner starts, or one at ``--url``.

A local worker is started once per worker configuration (batch size, batch window): the
batch a worker forms is fixed at start-up, so this is the only way to measure a batch size
as the worker really runs it. It runs in its own process group, with the parent-death
signal set (a killed planner leaves no worker behind), on a free loopback port it prints
first; it counts as started once ``/readyz`` answers 200, i.e. after its warm-up.
Its stderr goes to a temporary file whose tail is shown if it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import IO, Any

import aiohttp

from tidegate.control.local import device_env, worker_command
from tidegate.errors import ReplicaFailed
from tidegate.profile.child import ChildGroup, spawn
from tidegate.worker.runtime import WorkerSettings

log = logging.getLogger("tidegate.profile")
READY_POLL_S = 0.2  # /readyz while a worker loads and warms up, as the gateway does


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What the server says about the model (``/v1/models``)."""

    task: str | None  # embeddings or generate; None when the server does not say
    engine: str  # transformers, simulated, or the server's own name
    max_model_len: int | None


async def server_info(session: aiohttp.ClientSession, url: str, model: str) -> ServerInfo:
    """The model's entry of ``/v1/models``; a server that does not list it is an error."""
    try:
        async with session.get(f"{url.rstrip('/')}/v1/models") as response:
            payload: dict[str, Any] = await response.json(content_type=None)
    except (aiohttp.ClientError, ValueError) as exc:
        raise ReplicaFailed(f"{url}: GET /v1/models failed ({exc})") from exc
    for entry in payload.get("data") or []:
        if entry.get("id") == model:
            length = entry.get("max_model_len")
            return ServerInfo(
                task=entry.get("task"),
                engine=str(entry.get("engine") or entry.get("owned_by") or "openai"),
                max_model_len=int(length) if length else None,
            )
    names = [entry.get("id") for entry in payload.get("data") or []]
    raise ReplicaFailed(f"{url} does not serve model {model!r} (it lists {names})")


class LocalWorker(ChildGroup):
    """One ``tidegate worker`` process; use ``async with LocalWorker.start(...)``."""

    def __init__(self, process: asyncio.subprocess.Process, url: str, stderr: IO[bytes]) -> None:
        super().__init__(process, stderr)
        self.url = url

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    @contextlib.asynccontextmanager
    async def start(
        cls,
        session: aiohttp.ClientSession,
        settings: WorkerSettings,
        ready_timeout_s: float,
        stop: asyncio.Event,
    ) -> AsyncIterator[LocalWorker]:
        """Start it and wait until ready, or until ``stop`` is set (the caller checks it)."""
        device, device_vars = device_env(settings.device)
        command = worker_command(dataclasses.replace(settings, device=device), "warning")
        with tempfile.TemporaryFile() as stderr:
            process = await spawn(command, stderr, stdout=asyncio.subprocess.PIPE, env=device_vars)
            worker = cls(process, "", stderr)
            try:
                worker.url = await worker._address(ready_timeout_s)
                await worker._until_ready(session, time.monotonic() + ready_timeout_s, stop)
                yield worker
            finally:
                await worker.stop()

    async def _address(self, timeout_s: float) -> str:
        assert self.process.stdout is not None
        try:
            async with asyncio.timeout(timeout_s):
                line = await self.process.stdout.readline()
        except TimeoutError:
            line = b""
        url = line.decode("utf-8", "replace").strip()
        if not url.startswith("http://"):
            raise self._failure(f"printed {url!r} instead of its address")
        return url

    async def _until_ready(
        self, session: aiohttp.ClientSession, deadline: float, stop: asyncio.Event
    ) -> None:
        while time.monotonic() < deadline and not stop.is_set():
            if self.process.returncode is not None:
                raise self._failure(f"exited with status {self.process.returncode}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{self.url}/readyz") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(READY_POLL_S)
        if not stop.is_set():
            raise self._failure("was not ready in time")

    def _failure(self, what: str) -> ReplicaFailed:
        tail = self._stderr_tail()
        return ReplicaFailed(f"worker pid {self.process.pid} {what}; its last output:\n{tail}")
