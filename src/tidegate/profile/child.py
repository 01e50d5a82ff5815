"""A process the profiler starts (one worker, or a whole ``tidegate serve``).

Each runs in a process group of its own, offline (no model hub), dies with the profiler
(``parent_death_signal``), and is stopped as a group: SIGTERM, then SIGKILL if it lingers.
Its stderr goes to a file whose tail explains a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping
from typing import IO, ClassVar

from tidegate.control.local import parent_death_signal

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


async def spawn(
    command: list[str], stderr: IO[bytes], *, stdout: int, env: Mapping[str, str] | None = None
) -> asyncio.subprocess.Process:
    """``command`` in a new session (its own process group), offline, with ``env`` added."""
    return await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        env={**os.environ, **(env or {}), **OFFLINE_ENV},
        start_new_session=True,  # its own process group: stopped as a whole
        preexec_fn=parent_death_signal(),
    )


class ChildGroup:
    """A started process and its group."""

    stop_timeout_s: ClassVar[float] = 15.0
    stderr_tail_bytes: ClassVar[int] = 2000

    def __init__(self, process: asyncio.subprocess.Process, stderr: IO[bytes]) -> None:
        self.process = process
        self._stderr = stderr

    async def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it if it lingers."""
        if self.process.returncode is None:
            self._signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), self.stop_timeout_s)
            except TimeoutError:
                self._signal(signal.SIGKILL)
                await self.process.wait()

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def _stderr_tail(self) -> str:
        self._stderr.seek(0, os.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - self.stderr_tail_bytes))
        return self._stderr.read().decode("utf-8", "replace").strip()
