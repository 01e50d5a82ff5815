"""Real processes for end-to-end tests: started on loopback, always cleaned up.

Every wait here is for an event or a condition, bounded by a deadline that a busy machine
(other work on every core) stays far below: reaching one means the event never came.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

TIDEGATE = str(Path(sys.executable).with_name("tidegate"))
DEADLINE_S = 60.0  # for what takes a second or less on an idle machine


@dataclass
class Proc:
    url: str
    process: subprocess.Popen[str]

    def stats(self) -> dict[str, object]:
        return httpx.get(f"{self.url}/stats", timeout=DEADLINE_S).json()  # type: ignore[no-any-return]


def child_env() -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


@contextlib.contextmanager
def worker_process(
    *args: str, ready_timeout_s: float = 120.0, wait_ready: bool = True
) -> Iterator[Proc]:
    """``tidegate worker ARGS --port 0``; yields once its address is known (and it is ready)."""
    with tidegate_process(
        "worker", *args, ready_timeout_s=ready_timeout_s, wait_ready=wait_ready
    ) as proc:
        yield proc


@contextlib.contextmanager
def gateway_process(
    *args: str, ready_timeout_s: float = 180.0, wait_ready: bool = True
) -> Iterator[Proc]:
    """``tidegate serve ARGS --port 0``; yields once every model has a ready replica."""
    with tidegate_process(
        "serve", *args, ready_timeout_s=ready_timeout_s, wait_ready=wait_ready
    ) as proc:
        yield proc


@contextlib.contextmanager
def tidegate_process(
    command: str, *args: str, ready_timeout_s: float, wait_ready: bool
) -> Iterator[Proc]:
    """A tidegate server process that prints its address as the first line of output."""
    process = subprocess.Popen(
        [TIDEGATE, command, "--port", "0", "--log-level", "warning", *args],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
        start_new_session=True,  # its own process group: killed as a whole below
    )
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), f"tidegate {command} printed {url!r}"
        proc = Proc(url, process)
        if wait_ready:
            wait_until_ready(proc, ready_timeout_s)
        yield proc
    finally:
        stop(process)


def wait_until_ready(proc: Proc, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.process.poll() is None, f"worker exited with {proc.process.returncode}"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{proc.url}/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.05)
    raise AssertionError(f"worker at {proc.url} not ready after {timeout_s}s")


def stop(process: subprocess.Popen[str]) -> None:
    """SIGTERM the process group, SIGKILL it if it lingers, and reap it."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=5)
    if process.stdout is not None:
        process.stdout.close()


def wait_for(predicate: object, timeout_s: float = DEADLINE_S, interval_s: float = 0.05) -> None:
    """Poll a condition in a test (never in product code), bounded in time."""
    assert callable(predicate)
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        time.sleep(interval_s)


def children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"
