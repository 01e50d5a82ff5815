"""``tidegate serve`` shutting down: one deadline, 503 for what is left, a free port.

Real processes: the gateway and its simulated workers, SIGTERM from the test. Work is made
longer than the grace on purpose (a simulated generation of minutes), so the deadline, not
the work, ends it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.gateway.harness import flat_profile
from tests.procs import DEADLINE_S, TIDEGATE, Proc, child_env, stop, wait_for, wait_until_ready

GRACE_S = 10.0
# Beyond the grace, on a machine whose every core is busy with other work: for the 503
# answers to reach the clients, and for the process to exit (stopping a simulated worker,
# the interpreter's own exit). Both well below a second grace.
ANSWER_MARGIN_S = 3.0
EXIT_MARGIN_S = 6.0
ITL_MS = 100.0  # a token every 0.1 s: 2000 tokens take minutes


def _config(tmp_path: Path, **gateway: Any) -> Path:
    profile = flat_profile(tmp_path / "gen.json", ITL_MS, task="generate")
    config = {
        "gateway": {"shutdown_timeout_s": GRACE_S, **gateway},
        "models": [
            {
                "name": "sim",
                "task": "generate",
                "engine": "simulated",
                "profile": str(profile),
                "replicas": 1,
                "slots": 4,
                "batching": {"max_num_seqs": 8},
            }
        ],
    }
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def _serve(config: Path, log: Path) -> Iterator[Proc]:
    """``tidegate serve`` with its stderr in ``log`` (the shutdown's last line is read)."""
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [TIDEGATE, "serve", "--port", "0", "--log-level", "warning", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=child_env(),
            start_new_session=True,
        )
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        proc = Proc(url, process)
        wait_until_ready(proc, 180)
        yield proc
    finally:
        stop(process)


@dataclass
class _Answer:
    status: int | None = None
    body: bytes = b""
    events: list[str] = field(default_factory=list)  # SSE data lines, in order
    first_event: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    answered_at: float = 0.0  # monotonic, once the answer is complete


def _generate(url: str, answer: _Answer, *, stream: bool) -> None:
    payload = {"model": "sim", "prompt": "tide", "max_tokens": 2000, "stream": stream}
    try:
        with (
            httpx.Client(timeout=DEADLINE_S) as http,
            http.stream("POST", f"{url}/v1/completions", json=payload) as response,
        ):
            answer.status = response.status_code
            if not stream:
                answer.body = response.read()
                return
            for line in response.iter_lines():
                if line.startswith("data: "):
                    answer.events.append(line.removeprefix("data: "))
                    answer.first_event.set()
    except httpx.HTTPError as exc:
        answer.error = repr(exc)
    finally:
        answer.answered_at = time.monotonic()


def _state(gateway: Proc) -> dict[str, Any]:
    return httpx.get(f"{gateway.url}/admin/replicas", timeout=DEADLINE_S).json()["sim"]  # type: ignore[no-any-return]


def _is_shutting_down(body: bytes) -> bool:
    return json.loads(body)["error"]["code"] == "shutting_down"  # type: ignore[no-any-return]


def test_sigterm_answers_work_left_at_the_deadline_with_503_and_counts_it(
    tmp_path: Path,
) -> None:
    log = tmp_path / "gateway.log"
    with _serve(_config(tmp_path), log) as gateway:
        streams = [_Answer() for _ in range(2)]
        wholes = [_Answer() for _ in range(4)]  # 2 in flight (4 slots), 2 queued
        threads = [
            threading.Thread(target=_generate, args=(gateway.url, a), kwargs={"stream": True})
            for a in streams
        ]
        for thread in threads:
            thread.start()
        for answer in streams:
            assert answer.first_event.wait(DEADLINE_S), "a stream never started"
        more = [
            threading.Thread(target=_generate, args=(gateway.url, a), kwargs={"stream": False})
            for a in wholes
        ]
        for thread in more:
            thread.start()
        threads += more
        wait_for(lambda: _state(gateway)["queued"] == 2)
        assert sum(r["in_flight"] for r in _state(gateway)["replicas"]) == 4

        signalled_at = time.monotonic()
        gateway.process.send_signal(signal.SIGTERM)
        # Admission closes at once: readiness and new requests get 503.
        wait_for(lambda: httpx.get(f"{gateway.url}/readyz").status_code == 503)
        late = httpx.post(
            f"{gateway.url}/v1/completions",
            json={"model": "sim", "prompt": "late", "max_tokens": 1},
            timeout=DEADLINE_S,
        )
        assert late.status_code == 503
        assert _is_shutting_down(late.content)

        assert gateway.process.wait(timeout=GRACE_S + DEADLINE_S) == 0
        took_s = time.monotonic() - signalled_at
        for thread in threads:
            thread.join(timeout=DEADLINE_S)
            assert not thread.is_alive(), "a request hung"

    # One deadline: the grace, not the grace twice (drain wait + server timeout).
    for answer in [*streams, *wholes]:
        answered_s = answer.answered_at - signalled_at
        assert GRACE_S - 0.5 <= answered_s < GRACE_S + ANSWER_MARGIN_S, answered_s
    assert took_s < GRACE_S + EXIT_MARGIN_S, took_s
    for answer in wholes:
        assert answer.error is None, answer.error
        assert answer.status == 503, (answer.status, answer.body)
        assert _is_shutting_down(answer.body), answer.body
    for answer in streams:
        assert answer.error is None, answer.error
        assert answer.status == 200
        assert len(answer.events) > 2, "the stream did not run until the deadline"
        error = json.loads(answer.events[-2])
        assert error["error"]["code"] == "shutting_down", answer.events[-2:]
        assert answer.events[-1] == "[DONE]"
    # Counted once each: 6 cut at the deadline, 1 refused at admission.
    text = log.read_text()
    assert "2 queued and 4 in-flight requests answered 503 shutting_down" in text, text
    counted = re.search(r'tidegate_requests_total\{outcome="shutdown"\} (\d+)', text)
    assert counted is not None, text
    assert int(counted.group(1)) == 7, text


def test_idle_gateway_stops_at_once_on_sigterm(tmp_path: Path) -> None:
    with _serve(_config(tmp_path), tmp_path / "gateway.log") as gateway:
        signalled_at = time.monotonic()
        gateway.process.send_signal(signal.SIGTERM)
        assert gateway.process.wait(timeout=DEADLINE_S) == 0
    assert time.monotonic() - signalled_at < EXIT_MARGIN_S


def _listening_inode(port: int) -> str:
    """The inode of the socket listening on 127.0.0.1:``port`` (from /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "0A" and int(local.split(":")[1], 16) == port:
            return inode
    raise AssertionError(f"nothing listens on port {port}")


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target.removeprefix("socket:[").removesuffix("]"))
    return inodes


def test_workers_do_not_inherit_the_gateways_listening_socket(tmp_path: Path) -> None:
    with _serve(_config(tmp_path), tmp_path / "gateway.log") as gateway:
        port = int(gateway.url.rsplit(":", 1)[1])
        inode = _listening_inode(port)
        assert inode in _socket_inodes(gateway.process.pid)
        (replica,) = _state(gateway)["replicas"]
        assert inode not in _socket_inodes(replica["pid"]), (
            f"worker pid {replica['pid']} holds the gateway's listening socket"
        )
