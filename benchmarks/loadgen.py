"""Load generation shared by every benchmark, so that a figure means the same thing everywhere.

- Texts: the short sentences (12 to 16 MiniLM tokens) every embeddings benchmark sends.
- Statistics: percentiles (linear between closest ranks), ratios and number formats.
- CPU: seconds of one process or a whole session from /proc, the CPU that processes this
  benchmark did not start used over a span (``OtherLoad``), a bounded wait for the CPUs to go
  quiet (``QuietWait``) and interleaved pairs of rounds in ABBA order (``measure_pairs``).
- Processes: ``tidegate worker``, ``tidegate serve`` and peers on free loopback ports, each
  in a session of its own, logs in a folder; every one is stopped (SIGTERM, then SIGKILL of
  whatever is left in its session) when the benchmark ends, fails or is interrupted.
- HTTP: a minimal asyncio HTTP/1.1 client (keep-alive connections, one per request in flight,
  about 0.1 ms of CPU per request, flat in the number of connections; whole answers or SSE
  events as they stream), and ``httpx.AsyncClient`` behind the same interface (``--client
  httpx``: its pool costs milliseconds of CPU per request at 64 connections).
- Drivers, each returning one ``Record`` per request (start, send time, end, status,
  Retry-After, the arrival of each streamed event with text, completion tokens): a closed
  loop (N users, each sends again as soon as it is answered), an open loop (a seeded Poisson
  schedule, sent on time whatever the answers) and waves of streamed requests sent at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import platform
import random
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

# Before anything imports transformers or tokenizers: offline, and the same tokenizer
# threading in the benchmark's process as in the servers it starts (child_env).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx

ROOT = Path(__file__).resolve().parent.parent
TIDEGATE = str(Path(sys.executable).with_name("tidegate"))
CLK_TCK = os.sysconf("SC_CLK_TCK")
NOISY_CORES = 0.25  # CPU of other processes above this during a measurement: flagged
READY_TIMEOUT_S = 180.0
ADDRESS_TIMEOUT_S = 120.0  # a hang guard: a worker prints its address before it loads

TOPICS = (
    "the weather",
    "a train timetable",
    "the price of coffee",
    "a football match",
    "the new library",
    "a mountain hike",
    "an old bicycle",
    "the city council",
)


def sentences(count: int) -> list[str]:
    """Short sentences of one style (12 to 16 tokens for MiniLM), all different."""
    return [
        f"Note {i}: a short remark about {TOPICS[i % len(TOPICS)]} written on day {i % 31 + 1}."
        for i in range(count)
    ]


def embedding_bodies(model: str, texts: Sequence[str], encoding: str = "base64") -> list[bytes]:
    """One ``POST /v1/embeddings`` body per text (one input each)."""
    return [
        json.dumps({"model": model, "input": text, "encoding_format": encoding}).encode()
        for text in texts
    ]


# --------------------------------------------------------------------------- statistics
def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(a) and not math.isnan(b) else math.nan


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value:,.{digits}f}"


def ms(value: float | None) -> str:
    """Milliseconds with precision that suits their size."""
    if value is None or math.isnan(value):
        return "n/a"
    return fmt(value, 2 if abs(value) < 10 else 1 if abs(value) < 1000 else 0)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------- CPU
def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads); NaN when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def session_pids(sid: int) -> list[int]:
    """Every live process of session ``sid`` (a child started with start_new_session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def session_cpu_s(sid: int) -> float:
    """CPU seconds of every live process of a session (a peer's many processes, together)."""
    return sum(x for pid in session_pids(sid) if not math.isnan(x := cpu_s(pid)))


def system_busy_s() -> float:
    """CPU seconds spent by everything on this machine (all CPUs), from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / CLK_TCK  # minus idle and iowait


def ours_s() -> float:
    """CPU seconds of this process and of every process this benchmark started."""
    return time.process_time() + sum(session_cpu_s(child.pid) for child in CHILDREN)


class OtherLoad:
    """CPU used by processes this benchmark did not start, over a span, in cores."""

    def __init__(self) -> None:
        self.wall0, self.busy0, self.ours0 = time.perf_counter(), system_busy_s(), ours_s()

    def cores(self) -> float:
        wall = time.perf_counter() - self.wall0
        others = (system_busy_s() - self.busy0) - (ours_s() - self.ours0)
        return max(0.0, others) / wall if wall > 0 else math.nan


@dataclass
class QuietWait:
    """Waits, bounded, until other processes leave this machine's CPUs nearly idle.

    One wait lasts at most ``max_s``; all of them together at most ``budget_s``; none goes
    past ``deadline`` (``time.monotonic``). Each probe measures ``probe_s`` of other load.
    """

    max_s: float = 20.0
    budget_s: float = math.inf
    deadline: float = math.inf
    probe_s: float = 0.5
    waited_s: float = 0.0

    def __call__(self) -> None:
        started = time.monotonic()
        until = min(started + min(self.max_s, self.budget_s - self.waited_s), self.deadline)
        announced = False
        while time.monotonic() < until:
            load = OtherLoad()
            time.sleep(self.probe_s)
            if load.cores() <= NOISY_CORES:
                break
            if not announced:
                print("    (waiting for other processes to quiet down)", file=sys.stderr)
                announced = True
        self.waited_s += time.monotonic() - started

    def past(self) -> bool:
        return time.monotonic() >= self.deadline


class Noisy(Protocol):
    other_cores: float


A = TypeVar("A", bound=Noisy)
B = TypeVar("B", bound=Noisy)


def measure_pairs(
    first: Callable[[], A],
    second: Callable[[], B],
    *,
    rounds: int,
    retries: int,
    quiet: QuietWait,
) -> tuple[list[A], list[B]]:
    """``rounds`` interleaved pairs of rounds, ABBA order, each after a quiet wait.

    A pair during which other processes used more than NOISY_CORES is run again (up to
    ``retries`` extra pairs, while the quiet wait's deadline allows); if too few quiet pairs
    come, the least noisy ones are kept, and the tables' noise columns show it.
    """
    quiet_pairs: list[tuple[A, B]] = []
    noisy: list[tuple[A, B]] = []
    tries = 0
    while len(quiet_pairs) < rounds:
        if tries >= rounds and (tries >= rounds + retries or quiet.past()):
            break
        quiet()
        if tries % 2 == 0:
            a, b = first(), second()
        else:
            b, a = second(), first()
        tries += 1
        noise = max(a.other_cores, b.other_cores)
        (quiet_pairs if noise <= NOISY_CORES else noisy).append((a, b))
    noisy.sort(key=lambda pair: max(pair[0].other_cores, pair[1].other_cores))
    kept = quiet_pairs + noisy[: rounds - len(quiet_pairs)]
    return [a for a, _ in kept], [b for _, b in kept]


def note_noise(noise: Sequence[float]) -> None:
    """Say so when other processes used more than NOISY_CORES during a kept round."""
    if noise and max(noise) > NOISY_CORES:
        print(
            f"NOTE: other processes used up to {max(noise):.2f} of {os.cpu_count()} CPUs during "
            "a measured round: the figures of those rows are disturbed"
        )


def metric_sum(text: str, name: str) -> float:
    """Sum of every sample of ``name`` (all label sets) in Prometheus text format."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --------------------------------------------------------------------------- processes
def child_env() -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Child:
    """A process this benchmark started, in a session of its own."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path
    url: str = ""
    group_term: bool = True  # SIGTERM its whole group (tidegate) or only itself (Ray)
    stop_timeout_s: float = 15.0
    scratch: Path | None = None  # a folder of its own, removed once it has stopped

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def cpu_s(self) -> float:
        return cpu_s(self.pid)

    def log_tail(self, lines: int = 8, sep: str = " | ") -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return sep.join(text[-lines:])


CHILDREN: list[Child] = []


def spawn(name: str, cmd: list[str], logdir: Path, **kwargs: Any) -> Child:
    log = logdir / f"{name}.log"
    with log.open("wb") as err:
        process = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=child_env(),
            cwd=ROOT,
            start_new_session=True,  # its own session and group: stopped as a whole below
        )
    child = Child(name, process, log, **kwargs)
    CHILDREN.append(child)
    return child


def first_line(child: Child, timeout_s: float) -> str:
    """The first line the child prints (its address), without blocking past the timeout."""
    assert child.process.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(child.process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    buffer = b""
    try:
        while b"\n" not in buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{child.name}: no address after {timeout_s:.0f}s")
            if not selector.select(min(left, 1.0)):
                if not child.alive():
                    raise RuntimeError(
                        f"{child.name} exited with {child.process.returncode}: {child.log_tail()}"
                    )
                continue
            chunk = os.read(child.process.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(
                    f"{child.name} closed its output (status {child.process.poll()}): "
                    f"{child.log_tail()}"
                )
            buffer += chunk
    finally:
        selector.close()
    return buffer.split(b"\n", 1)[0].decode().strip()


def stop(child: Child) -> None:
    """SIGTERM, wait, then SIGKILL everything left in its session; reap it."""
    if child.alive():
        with contextlib.suppress(ProcessLookupError):
            if child.group_term:
                os.killpg(child.pid, signal.SIGTERM)
            else:
                os.kill(child.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(timeout=child.stop_timeout_s)
    deadline = time.monotonic() + 10
    while (left := session_pids(child.pid)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.process.wait(timeout=5)
    if child.process.stdout is not None:
        child.process.stdout.close()
    if child.scratch is not None and not session_pids(child.pid):
        shutil.rmtree(child.scratch, ignore_errors=True)
    if child in CHILDREN:
        CHILDREN.remove(child)


def stop_all() -> None:
    for child in reversed(list(CHILDREN)):
        with contextlib.suppress(Exception):
            stop(child)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def processes(prefix: str) -> Iterator[Path]:
    """A folder for the logs of the processes started inside; on the way out, however it
    goes (SIGTERM included), every one is stopped, and the logs are removed unless it failed."""
    previous = signal.signal(signal.SIGTERM, _interrupted)
    logdir = Path(tempfile.mkdtemp(prefix=f"{prefix}_"))
    failed = False
    try:
        yield logdir
    except BaseException:
        failed = True
        print(f"the run failed; process logs kept in {logdir}", file=sys.stderr, flush=True)
        raise
    finally:
        stop_all()
        signal.signal(signal.SIGTERM, previous)
        if not failed:
            shutil.rmtree(logdir, ignore_errors=True)


@contextlib.contextmanager
def running(child: Child) -> Iterator[Child]:
    """Stops ``child`` on the way out; on a failure, shows the end of its log first."""
    try:
        yield child
    except BaseException:
        tail = child.log_tail(20, "\n")
        print(f"{child.name} log (last lines):\n{tail}", file=sys.stderr, flush=True)
        raise
    finally:
        stop(child)


def report_errors(where: str, samples: Sequence[str], child: Child) -> None:
    """Show a few failed requests and the end of the server's log (stderr)."""
    if samples:
        print(f"  {where}: failed requests, e.g.:", file=sys.stderr)
        for sample in samples:
            print(f"    {sample}", file=sys.stderr)
        tail = child.log_tail(20, "\n")
        print(
            f"  {child.name} log (last lines):\n{tail or '  (empty)'}", file=sys.stderr, flush=True
        )


def wait_http_ready(
    child: Child, path: str, timeout_s: float, check: Callable[[Any], bool]
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if not child.alive():
            raise RuntimeError(
                f"{child.name} exited with {child.process.returncode}: {child.log_tail()}"
            )
        with contextlib.suppress(httpx.HTTPError, ValueError):
            response = httpx.get(f"{child.url}{path}", timeout=2)
            if response.status_code == 200 and check(response.json()):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} not ready after {timeout_s:.0f}s: {child.log_tail()}")
        time.sleep(0.1)


def start_worker(name: str, logdir: Path, *args: str) -> Child:
    """``tidegate worker ARGS --port 0``, ready (its /readyz answers 200)."""
    child = spawn(
        name, [TIDEGATE, "worker", "--port", "0", "--log-level", "warning", *args], logdir
    )
    child.url = first_line(child, ADDRESS_TIMEOUT_S)
    if not child.url.startswith("http://127.0.0.1:"):
        raise RuntimeError(f"{name} printed {child.url!r} instead of its address")
    wait_http_ready(child, "/readyz", READY_TIMEOUT_S, lambda body: True)
    return child


def start_serve(name: str, logdir: Path, config: Mapping[str, Any] | Path, model: str) -> Child:
    """``tidegate serve`` with ``config`` (a file, or what to write in one) on a free port,
    ready for ``model``."""
    if isinstance(config, Path):
        path = config
    else:
        path = logdir / f"{name}.yaml"
        path.write_text(json.dumps(config, indent=2))  # JSON is YAML 1.2
    port = free_port()
    cmd = [TIDEGATE, "serve", "--config", str(path), "--port", str(port), "--log-level", "warning"]
    child = spawn(name, cmd, logdir)
    child.url = f"http://127.0.0.1:{port}"
    wait_http_ready(
        child, "/readyz", READY_TIMEOUT_S, lambda body: model in body.get("ready_models", [])
    )
    wait_http_ready(
        child, "/v1/models", 10, lambda body: any(m["id"] == model for m in body["data"])
    )
    return child


# --------------------------------------------------------------------------- HTTP clients
class StaleConnection(Exception):
    """A kept-alive connection the server had closed: nothing was answered on it."""


@dataclass(slots=True)
class Head:
    status: int
    length: int | None  # None: chunked
    close: bool
    retry_after: bool


@dataclass(slots=True)
class Answer:
    status: int
    body: bytes
    retry_after: bool


class RawConnection:
    """One keep-alive HTTP/1.1 connection: no more than the load generator needs."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    @property
    def open(self) -> bool:
        return self.writer is not None and not self.writer.is_closing()

    @property
    def reusable(self) -> bool:
        return self.open and not (self.reader is not None and self.reader.at_eof())

    async def send(self, path: str, body: bytes, extra: bytes) -> Head:
        """POST and read the answer's head; StaleConnection if the server had closed it."""
        if not self.open:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        assert self.writer is not None
        self.writer.write(
            b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\n\r\n%s"
            % (path.encode(), self.host.encode(), self.port, extra, len(body), body)
        )
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            if isinstance(exc, asyncio.IncompleteReadError) and exc.partial:
                raise
            raise StaleConnection from exc  # closed before a byte of the answer came back
        lines = head.split(b"\r\n")
        out = Head(int(lines[0].split(b" ", 2)[1]), 0, False, False)
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                out.length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                out.length = None
            elif name == b"connection" and b"close" in value.lower():
                out.close = True
            elif name == b"retry-after":
                out.retry_after = True
        return out

    async def chunks(self) -> AsyncIterator[bytes]:
        assert self.reader is not None
        while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
            yield (await self.reader.readexactly(size + 2))[:-2]
        await self.reader.readuntil(b"\r\n")

    async def body(self, head: Head) -> bytes:
        assert self.reader is not None
        if head.length is None:
            return b"".join([chunk async for chunk in self.chunks()])
        return await self.reader.readexactly(head.length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class RawClient:
    """Keep-alive connections to one server, one per request in flight: about 0.1 ms of CPU
    per request, flat in the number of connections."""

    def __init__(self, url: str) -> None:
        host, _, port = url.removeprefix("http://").rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.idle: list[RawConnection] = []
        self.all: list[RawConnection] = []

    async def _start(
        self, path: str, body: bytes, headers: Mapping[str, str] | None
    ) -> tuple[RawConnection, Head]:
        extra = b"".join(f"{k}: {v}\r\n".encode() for k, v in (headers or {}).items())
        while self.idle:  # the most recently used first: the least likely to have timed out
            connection = self.idle.pop()
            if connection.reusable:
                try:
                    return connection, await connection.send(path, body, extra)
                except StaleConnection:
                    # The server closed it while it was idle (its keep-alive timeout): the
                    # request was not processed, so send it again on another connection.
                    connection.close()
                except BaseException:
                    connection.close()
                    raise
        connection = RawConnection(self.host, self.port)
        self.all.append(connection)
        try:
            return connection, await connection.send(path, body, extra)
        except BaseException:
            connection.close()  # mid-request: never reuse it
            raise

    def _release(self, connection: RawConnection, head: Head) -> None:
        if head.close:
            connection.close()
        elif connection.open:
            self.idle.append(connection)

    async def post(
        self, path: str, body: bytes, headers: Mapping[str, str] | None = None
    ) -> Answer:
        connection, head = await self._start(path, body, headers)
        try:
            data = await connection.body(head)
        except BaseException:
            connection.close()
            raise
        self._release(connection, head)
        return Answer(head.status, data, head.retry_after)

    async def events(
        self, path: str, body: bytes, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[bytes | int]:
        """The status code first, then the data of each SSE event as it arrives."""
        connection, head = await self._start(path, body, headers)
        try:
            yield head.status
            if head.length is not None:
                await connection.body(head)
            else:
                pending = b""
                async for chunk in connection.chunks():
                    pending += chunk
                    *complete, pending = pending.split(b"\n\n")
                    for event in complete:
                        if event.startswith(b"data: "):
                            yield event[6:]
        except BaseException:
            connection.close()
            raise
        self._release(connection, head)

    async def aclose(self) -> None:
        for connection in self.all:
            connection.close()


class HttpxClient:
    """One ``httpx.AsyncClient`` with keep-alive. Its pool (httpcore 1.0) costs CPU that
    grows with the square of the open connections: milliseconds per request at 64."""

    def __init__(self, url: str, max_connections: int, timeout_s: float) -> None:
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        timeout = httpx.Timeout(timeout_s, connect=10.0)
        self.client = httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout)

    @staticmethod
    def _headers(headers: Mapping[str, str] | None) -> dict[str, str]:
        return {"content-type": "application/json", **(headers or {})}

    async def post(
        self, path: str, body: bytes, headers: Mapping[str, str] | None = None
    ) -> Answer:
        response = await self.client.post(path, content=body, headers=self._headers(headers))
        return Answer(response.status_code, response.content, "retry-after" in response.headers)

    async def events(
        self, path: str, body: bytes, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[bytes | int]:
        request = self.client.build_request(
            "POST", path, content=body, headers=self._headers(headers)
        )
        response = await self.client.send(request, stream=True)
        try:
            yield response.status_code
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    yield line[6:].encode()
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        await self.client.aclose()


LoadClient = RawClient | HttpxClient
CLIENT_HELP = (
    "load generator: a minimal asyncio HTTP/1.1 client (default), or one httpx.AsyncClient "
    "(its pool costs the load generator milliseconds of CPU per request at 64 connections)"
)


def load_client(kind: str, url: str, max_connections: int, timeout_s: float = 120.0) -> LoadClient:
    return RawClient(url) if kind == "raw" else HttpxClient(url, max_connections, timeout_s)


# --------------------------------------------------------------------------- drivers
@dataclass(slots=True)
class Record:
    """One request: times are ``time.perf_counter`` seconds."""

    start: float  # closed loop: when it was sent; open loop: its scheduled arrival
    sent: float = math.nan  # when it actually left
    end: float = math.nan  # when its answer was complete; NaN: it never was
    status: int = 0  # HTTP status; -1: transport error or timeout; 0: never finished
    retry_after: bool = False
    error: str = ""  # why it failed ("" when it did not)
    tag: str = ""  # the open loop's class
    text_at: list[float] = field(default_factory=list)  # streamed events with text
    tokens: int = 0  # completion tokens, from a stream's usage chunk

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float:
        return self.text_at[0] - self.start if self.text_at else math.nan

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.text_at)]


async def _post(
    client: LoadClient,
    record: Record,
    path: str,
    body: bytes,
    headers: Mapping[str, str] | None,
    timeout_s: float | None,
) -> Record:
    try:
        answer = await asyncio.wait_for(client.post(path, body, headers), timeout_s)
    except Exception as exc:
        record.status, record.error = -1, f"{type(exc).__name__}: {exc}"
    else:
        record.status, record.retry_after = answer.status, answer.retry_after
        if answer.status != 200:
            record.error = f"{answer.status} {answer.body[:300].decode(errors='replace')}"
    record.end = time.perf_counter()
    return record


async def _stream_post(
    client: LoadClient,
    record: Record,
    path: str,
    body: bytes,
    headers: Mapping[str, str] | None,
    has_text: Callable[[bytes], bool],
    timeout_s: float | None,
) -> Record:
    """``stream`` into ``record`` within ``timeout_s``; a transport error or the timeout is
    status -1, as for ``_post``."""
    try:
        await asyncio.wait_for(stream(client, path, body, has_text, headers, record), timeout_s)
    except Exception as exc:
        record.status, record.error = -1, f"{type(exc).__name__}: {exc}"
        record.end = time.perf_counter()
    return record


async def closed_loop(
    url: str,
    path: str,
    payloads: Sequence[bytes],
    concurrency: int,
    window: Awaitable[object],
    *,
    client_kind: str = "raw",
    timeout_s: float | None = None,
    error_pause_s: float = 0.0,
) -> list[Record]:
    """``concurrency`` users, each sending again as soon as it is answered, until ``window``
    (the measurement, which marks its own span) is over. User k sends payloads k, k+N, ...
    Every request is recorded, the ones in flight when the window ends included."""
    records: list[Record] = []
    stopping = False
    client = load_client(client_kind, url, concurrency, timeout_s or 120.0)

    async def user(k: int) -> None:
        n = k
        while not stopping:
            now = time.perf_counter()
            record = await _post(
                client, Record(now, now), path, payloads[n % len(payloads)], None, timeout_s
            )
            records.append(record)
            n += concurrency
            if record.status != 200 and error_pause_s:
                await asyncio.sleep(error_pause_s)

    users = [asyncio.create_task(user(k)) for k in range(concurrency)]
    try:
        await window
    finally:
        stopping = True
        await asyncio.gather(*users, return_exceptions=True)
        await client.aclose()
    return records


def poisson(
    rate: float,
    duration_s: float,
    seed: int,
    classes: Sequence[tuple[str, float]],
    max_count: int,
) -> list[tuple[float, str]]:
    """Seeded Poisson arrivals at ``rate`` for ``duration_s`` (at most ``max_count``), each
    with a class drawn by the shares of ``classes``."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, str]] = []
    at = 0.0
    while len(arrivals) < max_count:
        at += rng.expovariate(rate)
        if at >= duration_s:
            break
        draw = rng.random()
        cumulative = 0.0
        cls = classes[-1][0]
        for name, share in classes:
            cumulative += share
            if draw < cumulative:
                cls = name
                break
        arrivals.append((at, cls))
    return arrivals


@dataclass
class OpenLoop:
    records: list[Record]  # one per arrival, in schedule order
    started: float  # perf_counter of the schedule's time 0
    sending_s: float  # how long it took to send everything
    cores: dict[str, float]  # CPU of each metered process while sending, and of the others


async def open_loop(
    url: str,
    path: str,
    payloads: Sequence[bytes],
    arrivals: Sequence[tuple[float, str]],
    headers: Mapping[str, Mapping[str, str]],
    *,
    drain_s: float,
    timeout_s: float,
    meters: Mapping[str, Callable[[], float]],
    client_kind: str = "raw",
    has_text: Callable[[bytes], bool] | None = None,
) -> OpenLoop:
    """Send on schedule whatever the answers (request i carries ``headers[class]``); after the
    last arrival, wait at most ``drain_s`` for answers, then cancel what is still open
    (status 0). Latency runs from the scheduled arrival, so a late sender counts against the
    server; ``meters`` give CPU seconds of the processes to report while sending. With
    ``has_text``, each request is streamed (``stream``): its record gets the times of the
    events with text and the completion tokens of its usage chunk."""
    client = load_client(client_kind, url, 4096, timeout_s)
    try:
        records = [Record(math.nan, tag=cls) for _, cls in arrivals]
        start = time.perf_counter() + 0.2
        cpu0 = {name: meter() for name, meter in meters.items()}
        other = OtherLoad()

        async def send(i: int) -> None:
            record = records[i]
            record.sent = time.perf_counter()
            payload = payloads[i % len(payloads)]
            if has_text is None:
                await _post(client, record, path, payload, headers[record.tag], timeout_s)
            else:
                await _stream_post(
                    client, record, path, payload, headers[record.tag], has_text, timeout_s
                )

        tasks = []
        for i, (at, _) in enumerate(arrivals):
            due = records[i].start = start + at
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            elif i % 16 == 0:
                await asyncio.sleep(0)  # behind schedule: still let answers in
            tasks.append(asyncio.create_task(send(i)))
        sending_s = time.perf_counter() - start
        cores = {name: (meter() - cpu0[name]) / sending_s for name, meter in meters.items()}
        cores["other processes"] = other.cores()
        _, pending = await asyncio.wait(tasks, timeout=drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for record in records:
            if record.status == 0 or math.isnan(record.end):  # cancelled: never finished
                record.status, record.end = 0, math.nan  # (a stream's status came first)
    finally:
        await client.aclose()
    return OpenLoop(records, start, sending_s, cores)


async def stream(
    client: LoadClient,
    path: str,
    body: bytes,
    has_text: Callable[[bytes], bool],
    headers: Mapping[str, str] | None = None,
    record: Record | None = None,
) -> Record:
    """One streaming request: when each event with text came (``has_text``), the completion
    tokens of its usage chunk, and why it failed ("" when it did not); into ``record`` when
    given (its start kept), else a new one that starts now."""
    record = Record(time.perf_counter()) if record is None else record
    async for item in client.events(path, body, headers):
        if isinstance(item, int):
            record.status = item
            record.error = "" if item == 200 else f"status {item}"
            continue
        if item == b"[DONE]":
            continue
        if b'"error"' in item:
            record.error = record.error or item[:300].decode(errors="replace")
            continue
        if has_text(item):
            record.text_at.append(time.perf_counter())
        if b'"usage"' in item and (usage := json.loads(item).get("usage")):
            record.tokens = int(usage["completion_tokens"])
    record.end = time.perf_counter()
    if not record.error and record.tokens == 0:
        record.error = "no usage chunk"
    return record


@dataclass
class StreamRound:
    """Waves of streamed requests (or of direct generation), added up."""

    tokens: int = 0
    busy_s: float = 0.0  # summed wave times
    ttfts_s: list[float] = field(default_factory=list)
    itls_s: list[float] = field(default_factory=list)
    waves: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    other_cores: float = 0.0


@dataclass
class Pooled:
    """The rounds of one side of a row, pooled: rates over the summed wave times."""

    tok_per_s: float
    tokens_per_seq: float  # completion tokens per request
    waves: int
    errors: int
    error_samples: list[str]
    other_cores: float  # the noisiest round's
    ttfts_s: list[float]
    itls_s: list[float]

    def ms(self, name: str, q: float) -> float:
        """Percentile ``q`` of the pooled ``ttfts_s`` or ``itls_s``, in milliseconds."""
        return percentile(getattr(self, name), q) * 1e3


def pool(rounds: Sequence[StreamRound], concurrency: int) -> Pooled:
    tokens = sum(r.tokens for r in rounds)
    waves = sum(r.waves for r in rounds)
    return Pooled(
        tok_per_s=tokens / sum(r.busy_s for r in rounds),
        tokens_per_seq=tokens / (waves * concurrency),
        waves=waves,
        errors=sum(r.errors for r in rounds),
        error_samples=[x for r in rounds for x in r.error_samples][:5],
        other_cores=max(r.other_cores for r in rounds),
        ttfts_s=[x for r in rounds for x in r.ttfts_s],
        itls_s=[x for r in rounds for x in r.itls_s],
    )


def pair_fields(worker: Pooled, direct: Pooled) -> dict[str, Any]:
    """The columns a generation row of worker against direct has in every benchmark."""
    return {
        "worker_tok_per_s": worker.tok_per_s,
        "batch_tok_per_s": direct.tok_per_s,
        "worker_over_batch": ratio(worker.tok_per_s, direct.tok_per_s),
        "worker_ttft_p50_ms": worker.ms("ttfts_s", 50),
        "worker_ttft_p95_ms": worker.ms("ttfts_s", 95),
        "batch_ttft_p50_ms": direct.ms("ttfts_s", 50),
        "worker_tokens_per_seq": worker.tokens_per_seq,
        "batch_tokens_per_seq": direct.tokens_per_seq,
        "worker_errors": worker.errors,
        "error_samples": worker.error_samples,
        "other_cores_worker": worker.other_cores,
        "other_cores_batch": direct.other_cores,
    }


async def stream_waves(
    url: str,
    path: str,
    bodies: Sequence[bytes],
    duration_s: float,
    has_text: Callable[[bytes], bool],
    client_kind: str = "raw",
) -> StreamRound:
    """Waves of ``len(bodies)`` streamed requests sent at once, one after the other, for at
    least one wave and ``duration_s``; tokens/s = completion tokens / summed wave times."""
    out = StreamRound()
    load = OtherLoad()
    client = load_client(client_kind, url, len(bodies))
    try:
        started = time.perf_counter()
        while out.waves == 0 or time.perf_counter() - started < duration_s:
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(stream(client, path, body, has_text) for body in bodies),
                return_exceptions=True,
            )
            out.busy_s += time.perf_counter() - t0
            out.waves += 1
            for result in results:
                if isinstance(result, BaseException):
                    result = Record(math.nan, error=f"{type(result).__name__}: {result}")
                out.tokens += result.tokens
                out.itls_s += result.gaps
                if result.error:
                    out.errors += 1
                    if len(out.error_samples) < 5:
                        out.error_samples.append(result.error)
                if not math.isnan(result.ttft):
                    out.ttfts_s.append(result.ttft)
    finally:
        await client.aclose()
    out.other_cores = load.cores()
    return out
