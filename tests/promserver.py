"""A real Prometheus server (Debian's ``prometheus``) for a test: its own config, data folder
and free loopback port; always stopped."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import DEADLINE_S, stop, wait_for

PROMETHEUS_READY_S = 120.0  # a TSDB and a web server on a loaded machine


def prometheus_binary() -> str:
    found = shutil.which("prometheus") or shutil.which("prometheus", path="/usr/bin")
    if found is None:
        pytest.fail(
            "the prometheus binary is missing: run `make system-packages` "
            "(.ci/system-packages installs Debian's prometheus)"
        )
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def prometheus(
    config: Path,
    data: Path,
    *,
    flags: Sequence[str] = (),
    ready_s: float = PROMETHEUS_READY_S,
    poll_s: float = 0.05,
) -> Iterator[str]:
    """A Prometheus server on a free loopback port, storing in ``data`` and logging to
    prometheus.log beside it (``flags``: more command-line flags); yields its URL once it is
    ready (polled every ``poll_s`` for up to ``ready_s``). An assertion that fails inside
    the block gets the log's tail added: what Prometheus said explains most failures."""
    port = free_port()
    log_path = data.parent / "prometheus.log"
    log = log_path.open("w")
    process = subprocess.Popen(
        [
            prometheus_binary(),
            f"--config.file={config}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}",
            *flags,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert process.poll() is None, log_path.read_text()[-2000:]
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(f"{url}/-/ready", timeout=5).status_code == 200
            return False

        wait_for(ready, timeout_s=ready_s, interval_s=poll_s)
        try:
            yield url
        except AssertionError as exc:
            tail = log_path.read_text()[-3000:]
            raise AssertionError(f"{exc}\nthe prometheus log ends:\n{tail}") from exc
    finally:
        stop(process)
        log.close()


def api(url: str, path: str, **params: str) -> Any:
    """``GET /api/v1/<path>`` of the Prometheus at ``url``: its ``data``, asserted a success."""
    answer = httpx.get(f"{url}/api/v1/{path}", params=params, timeout=DEADLINE_S)
    answer.raise_for_status()
    body = answer.json()
    assert body["status"] == "success", body
    return body["data"]


def query(url: str, expr: str) -> list[dict[str, Any]]:
    """The series of an instant query."""
    result: list[dict[str, Any]] = api(url, "query", query=expr)["result"]
    return result


def query_sum(url: str, expr: str) -> float:
    """The sum of an instant query's values (0 when it has no series)."""
    return sum(float(series["value"][1]) for series in query(url, expr))
