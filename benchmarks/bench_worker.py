"""Worker batching: a real worker process against the same model called directly, side by side.

Embeddings (minilm). For each batch size B in 1, 2, 4, 8, 16, 32, 64:

  direct  ``TransformersEmbeddings("minilm").embed_sync(batch)`` in a loop in this process, on
          batches of B sentences of the same style as the worker's inputs: what this machine
          can do with the model and no serving at all. Each batch is timed alone.
  worker  ``tidegate worker --model minilm --max-batch-size B`` in its own process; a load
          generator in this process keeps 2*B requests in flight, each a POST /v1/embeddings
          of one sentence, so that the worker forms batches of B itself. Latency is per
          request (queueing included); inputs/s counts responses completed in the window; the
          mean batch and the engine time per batch come from the deltas of
          ``tidegate_batch_size_*`` and ``tidegate_batch_duration_seconds_*`` in /metrics.

  The load generator is a minimal asyncio HTTP/1.1 client (one keep-alive connection per
  request in flight, about 0.1 ms of CPU per request). ``--client httpx`` uses one
  ``httpx.AsyncClient`` instead; on this machine it costs 2 to 15 ms of CPU per request (more
  with more connections), which it takes from the worker on the same 2 CPUs. Requests ask for
  ``encoding_format=base64`` (the OpenAI SDK's default); failed requests are counted and shown.

Generation (tiny-llama, synthetic random weights). For each concurrency C in 1, 2, 4, 8, 16,
waves of C requests with the same C prompts, max_tokens 64, temperature 0 (greedy):

  worker          ``tidegate worker --model tiny-llama --max-num-seqs 16``; C streaming
                  /v1/completions sent at once; tok/s = completion tokens (from the usage chunk)
                  / wave time; TTFT = time to the first SSE chunk with text.
  generate_batch  transformers' ``model.generate_batch`` in this process on the same model
                  folder (``ensure_tiny_llama``) and token ids, greedy, with the engine's KV
                  cache sizing (``cache_sizing``, 16 requests per batch); tok/s and TTFT from the
                  per-token timestamps it records, from the requests' creation to their last
                  token, so the manager's start and stop in each call are not counted.

Noise. This machine is shared. The two variants of a row run as interleaved pairs of rounds
(ABBA order), each pair after a bounded wait for the CPUs to go quiet; a pair during which
other processes used more than 0.25 CPU is run again (``--retries``), and the tables show the
other processes' CPU in the kept rounds. torch runs with its default number of threads (one
per CPU) in this process and in the workers (``--torch-threads`` changes both).
Targets: at its best batch size the worker reaches >= 85% of the direct best throughput, and
>= 2.5x its own batch-1 throughput.

Run (about 3-4 minutes on a quiet machine; ``--quick`` for a smoke run of about a minute):
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_worker.py [--quick] [--out results.json]
Prints markdown tables, then PASS/MISS lines. Always exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import functools
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

# Before anything imports transformers or tokenizers: offline, and the same tokenizer
# threading in this process as in the worker processes started below.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx

TIDEGATE = str(Path(sys.executable).with_name("tidegate"))
EMBED_MODEL = "minilm"
GEN_MODEL = "tiny-llama"
GEN_MAX_NUM_SEQS = 16
GEN_MAX_TOKENS = 64
TARGET_OF_DIRECT = 0.85
TARGET_OVER_BATCH1 = 2.5
READY_TIMEOUT_S = 180.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
NOISY_CORES = 0.25  # other processes' CPU above this during a round: flagged

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


def prompts(count: int) -> list[str]:
    return [
        f"Request {i}: tell me a story about the sea, the ships and the harbour."
        for i in range(count)
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


def fmt(value: float, digits: int = 1) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


# --------------------------------------------------------------------------- processes
@dataclass
class WorkerProc:
    url: str
    process: subprocess.Popen[str]
    log: Path

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def cpu_s(self) -> float:
        """User + system CPU seconds of the worker process (all its threads)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK


@contextlib.contextmanager
def worker_process(*args: str) -> Iterator[WorkerProc]:
    """``tidegate worker ARGS --port 0`` in its own process group, ready; always stopped."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    fd, name = tempfile.mkstemp(prefix="bench_worker-", suffix=".log")
    log = Path(name)
    try:
        process = subprocess.Popen(
            [TIDEGATE, "worker", "--port", "0", "--log-level", "warning", *args],
            stdout=subprocess.PIPE,
            stderr=fd,
            text=True,
            env=env,
            start_new_session=True,
        )
    finally:
        os.close(fd)
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        if not url.startswith("http://"):
            raise RuntimeError(f"worker printed {url!r} instead of its address")
        proc = WorkerProc(url, process, log)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"worker exited with status {process.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker not ready after {READY_TIMEOUT_S:.0f}s")
            time.sleep(0.1)
        yield proc
    except Exception:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        print(f"worker log (last lines):\n{tail}", file=sys.stderr, flush=True)
        raise
    finally:
        stop_process(process)
        log.unlink(missing_ok=True)


def stop_process(process: subprocess.Popen[str]) -> None:
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


def system_busy_s() -> float:
    """CPU seconds spent by everything on this machine (all CPUs), from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / CLK_TCK  # minus idle and iowait


class OtherLoad:
    """CPU used by processes other than this one and the worker, over a span, in cores."""

    def __init__(self, proc: WorkerProc | None) -> None:
        self.proc = proc
        self.wall0 = time.perf_counter()
        self.busy0 = system_busy_s()
        self.ours0 = self._ours()

    def _ours(self) -> float:
        return time.process_time() + (self.proc.cpu_s() if self.proc is not None else 0.0)

    def cores(self) -> float:
        wall = time.perf_counter() - self.wall0
        others = (system_busy_s() - self.busy0) - (self._ours() - self.ours0)
        return max(0.0, others) / wall if wall > 0 else math.nan


def wait_quiet(proc: WorkerProc, args: argparse.Namespace) -> None:
    """Wait (bounded) until other processes leave this machine's CPUs nearly idle."""
    deadline = min(time.monotonic() + args.quiet_wait_s, args.deadline)
    announced = False
    while True:
        load = OtherLoad(proc)
        time.sleep(0.3)
        if load.cores() <= NOISY_CORES or time.monotonic() >= deadline:
            return
        if not announced:
            print("    (waiting for other processes to quiet down)", file=sys.stderr, flush=True)
            announced = True


class Noisy(Protocol):
    other_cores: float


A = TypeVar("A", bound=Noisy)
B = TypeVar("B", bound=Noisy)


def measure_pairs(
    proc: WorkerProc,
    args: argparse.Namespace,
    first: Callable[[], A],
    second: Callable[[], B],
) -> tuple[list[A], list[B]]:
    """``args.rounds`` interleaved pairs of rounds, ABBA order, each after a quiet wait.

    A pair during which other processes used more than NOISY_CORES is run again (up to
    ``args.retries`` extra pairs, while the run's deadline allows); if too few quiet pairs
    come, the least noisy ones are kept, and the table's noise columns show it.
    """
    quiet: list[tuple[A, B]] = []
    noisy: list[tuple[A, B]] = []
    tries = 0
    while len(quiet) < args.rounds:
        if tries >= args.rounds and (tries >= args.rounds + args.retries or past(args)):
            break
        wait_quiet(proc, args)
        if tries % 2 == 0:
            a, b = first(), second()
        else:
            b, a = second(), first()
        tries += 1
        noise = max(a.other_cores, b.other_cores)
        (quiet if noise <= NOISY_CORES else noisy).append((a, b))
    noisy.sort(key=lambda pair: max(pair[0].other_cores, pair[1].other_cores))
    kept = quiet + noisy[: args.rounds - len(quiet)]
    return [a for a, _ in kept], [b for _, b in kept]


def past(args: argparse.Namespace) -> bool:
    return bool(time.monotonic() >= args.deadline)


def metric_sum(text: str, name: str) -> float:
    """Sum of every sample of ``name`` (all label sets) in Prometheus text format."""
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE):
        total += float(match.group(1))
    return total


# --------------------------------------------------------------------------- load clients
class LoadClient(Protocol):
    """What the load generator needs: POST a JSON body, whole or as a stream of SSE events."""

    async def post(self, user: int, path: str, body: bytes) -> tuple[int, bytes]: ...

    def events(self, user: int, path: str, body: bytes) -> AsyncIterator[bytes | int]:
        """The status code first, then the data of each SSE event."""
        ...

    async def reset(self, user: int) -> None:
        """Drop the user's connection after a failure: the next request opens a new one."""

    async def aclose(self) -> None: ...


class RawConnection:
    """One keep-alive HTTP/1.1 connection, no more than the load generator needs."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _send(self, path: str, body: bytes) -> asyncio.StreamReader:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(
            b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s"
            % (path.encode(), self.host.encode(), self.port, len(body), body)
        )
        return self.reader

    async def _head(self, reader: asyncio.StreamReader) -> tuple[int, int | None, bool]:
        """(status, content length or None when chunked, close after this response)."""
        lines = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length: int | None = 0
        close = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                length = None
            elif name == b"connection" and b"close" in value.lower():
                close = True
        return status, length, close

    async def _chunks(self, reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                return
            yield data[:-2]

    def _done(self, close: bool) -> None:
        if close and self.writer is not None:
            self.writer.close()
            self.writer = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        reader = await self._send(path, body)
        status, length, close = await self._head(reader)
        if length is None:
            data = b"".join([chunk async for chunk in self._chunks(reader)])
        else:
            data = await reader.readexactly(length)
        self._done(close)
        return status, data

    async def events(self, path: str, body: bytes) -> AsyncIterator[bytes | int]:
        reader = await self._send(path, body)
        status, length, close = await self._head(reader)
        yield status
        if length is not None:
            await reader.readexactly(length)
        else:
            pending = b""
            async for chunk in self._chunks(reader):
                pending += chunk
                *complete, pending = pending.split(b"\n\n")
                for event in complete:
                    if event.startswith(b"data: "):
                        yield event[6:]
        self._done(close)

    async def aclose(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()


class RawClient:
    """One raw connection per simulated user: about 0.1 ms of CPU per request."""

    def __init__(self, url: str) -> None:
        host, _, port = url.removeprefix("http://").rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.connections: dict[int, RawConnection] = {}

    def _connection(self, user: int) -> RawConnection:
        if user not in self.connections:
            self.connections[user] = RawConnection(self.host, self.port)
        return self.connections[user]

    async def post(self, user: int, path: str, body: bytes) -> tuple[int, bytes]:
        return await self._connection(user).post(path, body)

    def events(self, user: int, path: str, body: bytes) -> AsyncIterator[bytes | int]:
        return self._connection(user).events(path, body)

    async def reset(self, user: int) -> None:
        connection = self.connections.pop(user, None)
        if connection is not None:
            await connection.aclose()

    async def aclose(self) -> None:
        for connection in self.connections.values():
            await connection.aclose()


class HttpxClient:
    """One ``httpx.AsyncClient`` with a keep-alive pool of ``concurrency`` connections."""

    def __init__(self, url: str, concurrency: int) -> None:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.client = httpx.AsyncClient(base_url=url, limits=limits, timeout=120)
        self.headers = {"content-type": "application/json"}

    async def post(self, user: int, path: str, body: bytes) -> tuple[int, bytes]:
        response = await self.client.post(path, content=body, headers=self.headers)
        return response.status_code, response.content

    async def events(self, user: int, path: str, body: bytes) -> AsyncIterator[bytes | int]:
        request = self.client.build_request("POST", path, content=body, headers=self.headers)
        response = await self.client.send(request, stream=True)
        try:
            yield response.status_code
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    yield line[6:].encode()
        finally:
            await response.aclose()

    async def reset(self, user: int) -> None:
        pass  # the pool drops a broken connection by itself

    async def aclose(self) -> None:
        await self.client.aclose()


def load_client(kind: str, url: str, concurrency: int) -> LoadClient:
    return RawClient(url) if kind == "raw" else HttpxClient(url, concurrency)


# --------------------------------------------------------------------------- embeddings
@dataclass
class DirectEmbed:
    batch_latencies_s: list[float] = field(default_factory=list)
    inputs: int = 0
    elapsed_s: float = 0.0
    other_cores: float = 0.0


@dataclass
class WorkerEmbed:
    latencies_s: list[float] = field(default_factory=list)
    inputs: int = 0
    elapsed_s: float = 0.0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    batches: float = 0.0
    batched_inputs: float = 0.0
    engine_s: float = 0.0  # summed engine time per batch, from /metrics
    worker_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    other_cores: float = 0.0


@dataclass
class EmbedRow:
    batch: int
    direct_p50_ms: float
    direct_p95_ms: float
    direct_inputs_per_s: float
    worker_mean_batch: float
    worker_p50_ms: float
    worker_p95_ms: float
    worker_inputs_per_s: float
    worker_over_direct: float
    worker_engine_ms_per_batch: float
    worker_engine_busy: float  # share of the window the engine was running a batch
    worker_cpu_cores: float
    client_cpu_cores: float
    error_samples: list[str]
    other_cores_direct: float  # CPU of other processes during the direct rounds
    other_cores_worker: float  # ... during the worker rounds
    worker_errors: int


def direct_round(
    engine: Any, proc: WorkerProc, texts: list[str], batch: int, duration_s: float
) -> DirectEmbed:
    out = DirectEmbed()
    offset = 0
    engine.embed_sync(texts[:batch])  # one unmeasured batch: caches warm after the worker ran
    load = OtherLoad(proc)
    started = time.perf_counter()
    while time.perf_counter() - started < duration_s:
        chunk = [texts[(offset + i) % len(texts)] for i in range(batch)]
        offset += batch
        t0 = time.perf_counter()
        vectors = engine.embed_sync(chunk)
        out.batch_latencies_s.append(time.perf_counter() - t0)
        out.inputs += len(vectors)
    out.elapsed_s = time.perf_counter() - started
    out.other_cores = load.cores()
    return out


async def worker_round(
    proc: WorkerProc,
    texts: list[str],
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    encoding: str,
    client_kind: str,
) -> WorkerEmbed:
    """Keep ``concurrency`` single-input requests in flight; measure a window after warm-up."""
    out = WorkerEmbed()
    window = [math.inf, math.inf]  # [start, end] in perf_counter time
    stopping = False
    bodies = [
        json.dumps({"model": EMBED_MODEL, "input": text, "encoding_format": encoding}).encode()
        for text in texts
    ]
    client = load_client(client_kind, proc.url, concurrency)
    async with httpx.AsyncClient(timeout=10) as side:

        async def user(k: int) -> None:
            index = k
            while not stopping:
                body = bodies[index % len(bodies)]
                index += concurrency
                t0 = time.perf_counter()
                try:
                    status, data = await client.post(k, "/v1/embeddings", body)
                except (OSError, asyncio.IncompleteReadError, httpx.HTTPError) as exc:
                    status, data = 0, f"{type(exc).__name__}: {exc}".encode()
                    await client.reset(k)
                t1 = time.perf_counter()
                if status == 200:
                    if window[0] <= t1 < window[1]:
                        out.latencies_s.append(t1 - t0)
                        out.inputs += 1
                    continue
                # Every failure counts, in the window or not: none is expected.
                out.errors += 1
                if len(out.error_samples) < 5:
                    out.error_samples.append(f"{status} {data[:300].decode(errors='replace')}")
                await asyncio.sleep(0.01)

        users = [asyncio.create_task(user(k)) for k in range(concurrency)]
        try:
            await asyncio.sleep(warmup_s)
            before = (await side.get(f"{proc.url}/metrics")).text
            cpu0, client0 = proc.cpu_s(), time.process_time()
            load = OtherLoad(proc)
            window[0] = time.perf_counter()
            await asyncio.sleep(duration_s)
            window[1] = time.perf_counter()
            cpu1, client1 = proc.cpu_s(), time.process_time()
            out.other_cores = load.cores()
            after = (await side.get(f"{proc.url}/metrics")).text
        finally:
            stopping = True
            await asyncio.gather(*users, return_exceptions=True)
            await client.aclose()
    out.elapsed_s = window[1] - window[0]
    out.worker_cpu_s = cpu1 - cpu0
    out.client_cpu_s = client1 - client0
    for attr, name in (
        ("batches", "tidegate_batch_size_count"),
        ("batched_inputs", "tidegate_batch_size_sum"),
        ("engine_s", "tidegate_batch_duration_seconds_sum"),
    ):
        setattr(out, attr, metric_sum(after, name) - metric_sum(before, name))
    return out


def worker_round_sync(
    proc: WorkerProc, texts: list[str], concurrency: int, args: argparse.Namespace
) -> WorkerEmbed:
    return asyncio.run(
        worker_round(
            proc,
            texts,
            concurrency,
            args.embed_warmup_s,
            args.embed_worker_s,
            args.encoding,
            args.client,
        )
    )


def report_errors(where: str, samples: list[str], proc: WorkerProc) -> None:
    if samples:
        print(f"  {where}: failed requests, e.g.:", file=sys.stderr)
        for sample in samples:
            print(f"    {sample}", file=sys.stderr)
        tail = proc.log_tail()
        print(f"  worker log (last lines):\n{tail or '  (empty)'}", file=sys.stderr, flush=True)


def check_worker_answers(proc: WorkerProc, encoding: str) -> None:
    body = {"model": EMBED_MODEL, "input": "a check sentence", "encoding_format": encoding}
    response = httpx.post(f"{proc.url}/v1/embeddings", json=body, timeout=30)
    response.raise_for_status()
    data = response.json()["data"]
    if len(data) != 1 or not data[0]["embedding"]:
        raise RuntimeError(f"the worker returned {len(data)} embeddings for one input")


def embed_row(batch: int, direct: list[DirectEmbed], worker: list[WorkerEmbed]) -> EmbedRow:
    d_lat = [x for r in direct for x in r.batch_latencies_s]
    d_rate = sum(r.inputs for r in direct) / sum(r.elapsed_s for r in direct)
    w_lat = [x for r in worker for x in r.latencies_s]
    w_time = sum(r.elapsed_s for r in worker)
    w_rate = sum(r.inputs for r in worker) / w_time
    batches = sum(r.batches for r in worker)
    engine_s = sum(r.engine_s for r in worker)
    return EmbedRow(
        batch=batch,
        direct_p50_ms=percentile(d_lat, 50) * 1e3,
        direct_p95_ms=percentile(d_lat, 95) * 1e3,
        direct_inputs_per_s=d_rate,
        worker_mean_batch=ratio(sum(r.batched_inputs for r in worker), batches),
        worker_p50_ms=percentile(w_lat, 50) * 1e3,
        worker_p95_ms=percentile(w_lat, 95) * 1e3,
        worker_inputs_per_s=w_rate,
        worker_over_direct=ratio(w_rate, d_rate),
        worker_engine_ms_per_batch=ratio(engine_s, batches) * 1e3,
        worker_engine_busy=ratio(engine_s, w_time),
        worker_cpu_cores=ratio(sum(r.worker_cpu_s for r in worker), w_time),
        client_cpu_cores=ratio(sum(r.client_cpu_s for r in worker), w_time),
        error_samples=[x for r in worker for x in r.error_samples][:5],
        other_cores_direct=max(r.other_cores for r in direct),
        other_cores_worker=max(r.other_cores for r in worker),
        worker_errors=sum(r.errors for r in worker),
    )


def run_embeddings(args: argparse.Namespace) -> list[EmbedRow]:
    from tidegate.engines.embeddings import TransformersEmbeddings

    engine = TransformersEmbeddings(EMBED_MODEL)
    engine.load()
    texts = sentences(512)
    rows: list[EmbedRow] = []
    for batch in args.batch_sizes:
        size = 1
        while size <= batch:  # the worker warms every size up to its max, so do we
            engine.embed_sync(texts[:size])
            size *= 2
        worker_args = ["--model", EMBED_MODEL, "--max-batch-size", str(batch)]
        worker_args += ["--batch-window-ms", str(args.batch_window_ms)]
        with worker_process(*worker_args) as proc:
            check_worker_answers(proc, args.encoding)
            direct, worker = measure_pairs(
                proc,
                args,
                functools.partial(direct_round, engine, proc, texts, batch, args.embed_direct_s),
                functools.partial(worker_round_sync, proc, texts, 2 * batch, args),
            )
            report_errors(f"batch {batch}", [x for r in worker for x in r.error_samples], proc)
        row = embed_row(batch, direct, worker)
        rows.append(row)
        print(
            f"  batch {batch:>2}: direct {row.direct_inputs_per_s:,.0f}/s, worker "
            f"{row.worker_inputs_per_s:,.0f}/s (mean batch {row.worker_mean_batch:.1f})",
            file=sys.stderr,
            flush=True,
        )
    engine.close()
    return rows


# --------------------------------------------------------------------------- generation
@dataclass
class GenSample:
    tokens: int = 0
    busy_s: float = 0.0  # summed wave times
    ttfts_s: list[float] = field(default_factory=list)
    waves: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    other_cores: float = 0.0


@dataclass
class GenRow:
    concurrency: int
    worker_tok_per_s: float
    worker_ttft_p50_ms: float
    worker_ttft_p95_ms: float
    batch_tok_per_s: float
    batch_ttft_p50_ms: float
    worker_over_batch: float
    worker_tokens_per_seq: float
    batch_tokens_per_seq: float
    worker_waves: int
    batch_waves: int
    worker_errors: int
    error_samples: list[str]
    other_cores_worker: float
    other_cores_batch: float


async def stream_completion(
    client: LoadClient, user: int, prompt: str, max_tokens: int
) -> tuple[float, int, str]:
    """(TTFT, completion tokens, failure: "" when it succeeded) of one streaming completion."""
    body = {
        "model": GEN_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = math.nan
    tokens = 0
    failure = ""
    async for item in client.events(user, "/v1/completions", json.dumps(body).encode()):
        if isinstance(item, int):
            failure = "" if item == 200 else f"status {item}"
            continue
        if b'"error"' in item:
            failure = failure or item[:300].decode(errors="replace")
        if math.isnan(ttft) and b'"choices":[{' in item and b'"text":""' not in item:
            ttft = time.perf_counter() - t0
        if b'"usage"' in item:
            tokens = int(json.loads(item)["usage"]["completion_tokens"])
    if not failure and tokens == 0:
        failure = "no usage chunk"
    return ttft, tokens, failure


async def worker_gen_round(
    proc: WorkerProc,
    texts: list[str],
    concurrency: int,
    duration_s: float,
    max_tokens: int,
    client_kind: str,
) -> GenSample:
    out = GenSample()
    load = OtherLoad(proc)
    client = load_client(client_kind, proc.url, concurrency)
    try:
        started = time.perf_counter()
        while out.waves == 0 or time.perf_counter() - started < duration_s:
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(stream_completion(client, i, texts[i], max_tokens) for i in range(concurrency)),
                return_exceptions=True,
            )
            out.busy_s += time.perf_counter() - t0
            out.waves += 1
            for i, result in enumerate(results):
                if isinstance(result, BaseException):
                    result = (math.nan, 0, f"{type(result).__name__}: {result}")
                    await client.reset(i)
                ttft, tokens, failure = result
                out.tokens += tokens
                if failure:
                    out.errors += 1
                    if len(out.error_samples) < 5:
                        out.error_samples.append(failure)
                if not math.isnan(ttft):
                    out.ttfts_s.append(ttft)
    finally:
        await client.aclose()
    out.other_cores = load.cores()
    return out


def worker_gen_round_sync(
    proc: WorkerProc, texts: list[str], concurrency: int, args: argparse.Namespace
) -> GenSample:
    return asyncio.run(
        worker_gen_round(proc, texts, concurrency, args.gen_round_s, args.max_tokens, args.client)
    )


class BatchGenerator:
    """transformers' ``generate_batch`` on the tiny-llama folder, sized like the engine."""

    def __init__(self, max_tokens: int) -> None:
        import torch
        import transformers

        from tidegate.engines.generation import cache_sizing
        from tidegate.engines.hf_runtime import quiet_transformers
        from tidegate.engines.tiny_llama import CONTEXT_TOKENS, ensure_tiny_llama

        quiet_transformers()
        folder = ensure_tiny_llama()
        hf: Any = transformers  # partly untyped
        self.tokenizer: Any = hf.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.model: Any = hf.AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, attn_implementation="sdpa", dtype=torch.float32
        )
        self.model.eval()
        sizing = cache_sizing(GEN_MAX_NUM_SEQS, CONTEXT_TOKENS)
        self.cb_config = hf.ContinuousBatchingConfig(
            page_size=sizing.page_size,
            num_blocks=sizing.num_blocks,
            max_batch_tokens=sizing.max_batch_tokens,
            max_requests_per_batch=GEN_MAX_NUM_SEQS,
            seed=0,
        )
        eos = self.model.generation_config.eos_token_id
        self.gen_config = hf.GenerationConfig(
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=eos if eos is not None else -1,
            pad_token_id=self.tokenizer.pad_token_id or 0,
        )
        self.max_tokens = max_tokens

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def wave(self, inputs: list[list[int]]) -> tuple[int, float, list[float]]:
        """(tokens, span from first request created to last token, TTFTs)."""
        results = self.model.generate_batch(
            inputs,
            generation_config=self.gen_config,
            continuous_batching_config=self.cb_config,
            record_timestamps=True,
            progress_bar=False,
            max_new_tokens=self.max_tokens,
        )
        outputs = list(results.values())
        if len(outputs) != len(inputs):
            raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(inputs)} outputs")
        tokens = sum(len(o.generated_tokens) for o in outputs)
        created = min(o.created_time for o in outputs)
        last = max(o.timestamps[-1] for o in outputs if o.timestamps)
        ttfts = [o.timestamps[0] - o.created_time for o in outputs if o.timestamps]
        return tokens, last - created, ttfts

    def round(self, proc: WorkerProc, inputs: list[list[int]], duration_s: float) -> GenSample:
        out = GenSample()
        load = OtherLoad(proc)
        started = time.perf_counter()
        while out.waves == 0 or time.perf_counter() - started < duration_s:
            tokens, span, ttfts = self.wave(inputs)
            out.tokens += tokens
            out.busy_s += span
            out.ttfts_s += ttfts
            out.waves += 1
        out.other_cores = load.cores()
        return out


def gen_row(concurrency: int, worker: list[GenSample], batch: list[GenSample]) -> GenRow:
    w_tok = sum(r.tokens for r in worker)
    b_tok = sum(r.tokens for r in batch)
    w_rate = w_tok / sum(r.busy_s for r in worker)
    b_rate = b_tok / sum(r.busy_s for r in batch)
    w_waves = sum(r.waves for r in worker)
    b_waves = sum(r.waves for r in batch)
    return GenRow(
        concurrency=concurrency,
        worker_tok_per_s=w_rate,
        worker_ttft_p50_ms=percentile([x for r in worker for x in r.ttfts_s], 50) * 1e3,
        worker_ttft_p95_ms=percentile([x for r in worker for x in r.ttfts_s], 95) * 1e3,
        batch_tok_per_s=b_rate,
        batch_ttft_p50_ms=percentile([x for r in batch for x in r.ttfts_s], 50) * 1e3,
        worker_over_batch=ratio(w_rate, b_rate),
        worker_tokens_per_seq=w_tok / (w_waves * concurrency),
        batch_tokens_per_seq=b_tok / (b_waves * concurrency),
        worker_waves=w_waves,
        batch_waves=b_waves,
        worker_errors=sum(r.errors for r in worker),
        error_samples=[x for r in worker for x in r.error_samples][:5],
        other_cores_worker=max(r.other_cores for r in worker),
        other_cores_batch=max(r.other_cores for r in batch),
    )


def run_generation(args: argparse.Namespace) -> list[GenRow]:
    texts = prompts(max(args.concurrencies))
    batch_gen = BatchGenerator(args.max_tokens)
    ids = [batch_gen.encode(t) for t in texts]
    batch_gen.wave(ids[:4])  # warm the in-process path as the worker warms its own
    rows: list[GenRow] = []
    worker_args = ["--model", GEN_MODEL, "--max-num-seqs", str(GEN_MAX_NUM_SEQS)]
    with worker_process(*worker_args) as proc:
        for concurrency in args.concurrencies:
            # One unmeasured wave each, then interleaved rounds.
            asyncio.run(
                worker_gen_round(proc, texts, concurrency, 0.0, args.max_tokens, args.client)
            )
            batch_gen.wave(ids[:concurrency])
            worker, batch = measure_pairs(
                proc,
                args,
                functools.partial(worker_gen_round_sync, proc, texts, concurrency, args),
                functools.partial(batch_gen.round, proc, ids[:concurrency], args.gen_round_s),
            )
            report_errors(
                f"concurrency {concurrency}", [x for r in worker for x in r.error_samples], proc
            )
            row = gen_row(concurrency, worker, batch)
            rows.append(row)
            print(
                f"  concurrency {concurrency:>2}: worker {row.worker_tok_per_s:,.0f} tok/s, "
                f"generate_batch {row.batch_tok_per_s:,.0f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    return rows


# --------------------------------------------------------------------------- report
def embed_table(rows: list[EmbedRow]) -> str:
    head = (
        "| batch | direct batch latency p50 ms | direct p95 | direct inputs/s | worker mean batch "
        "| worker p50 ms | worker p95 ms | worker inputs/s | worker/direct |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r.batch} | {fmt(r.direct_p50_ms)} | {fmt(r.direct_p95_ms)} "
        f"| {fmt(r.direct_inputs_per_s, 0)} | {fmt(r.worker_mean_batch, 2)} "
        f"| {fmt(r.worker_p50_ms)} | {fmt(r.worker_p95_ms)} "
        f"| {fmt(r.worker_inputs_per_s, 0)} | {fmt(r.worker_over_direct * 100, 0)}% |"
        for r in rows
    ]
    return head + "\n".join(lines)


def embed_diag_table(rows: list[EmbedRow]) -> str:
    head = (
        "| batch | worker engine ms/batch | direct p50 ms | engine busy | worker CPU (cores) "
        "| load generator CPU (cores) | other processes CPU (cores) direct, worker | errors |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r.batch} | {fmt(r.worker_engine_ms_per_batch)} | {fmt(r.direct_p50_ms)} "
        f"| {fmt(r.worker_engine_busy * 100, 0)}% | {fmt(r.worker_cpu_cores, 2)} "
        f"| {fmt(r.client_cpu_cores, 2)} "
        f"| {fmt(r.other_cores_direct, 2)}, {fmt(r.other_cores_worker, 2)} | {r.worker_errors} |"
        for r in rows
    ]
    return head + "\n".join(lines)


def gen_table(rows: list[GenRow]) -> str:
    head = (
        "| concurrency | worker tok/s | worker TTFT p50 ms | generate_batch tok/s | ratio "
        "| worker TTFT p95 ms | generate_batch TTFT p50 ms | tokens/seq worker, batch "
        "| other processes CPU (cores) worker, batch |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r.concurrency} | {fmt(r.worker_tok_per_s, 0)} | {fmt(r.worker_ttft_p50_ms)} "
        f"| {fmt(r.batch_tok_per_s, 0)} | {fmt(r.worker_over_batch, 2)}x "
        f"| {fmt(r.worker_ttft_p95_ms)} | {fmt(r.batch_ttft_p50_ms)} "
        f"| {fmt(r.worker_tokens_per_seq, 1)}, {fmt(r.batch_tokens_per_seq, 1)} "
        f"| {fmt(r.other_cores_worker, 2)}, {fmt(r.other_cores_batch, 2)} |"
        for r in rows
    ]
    return head + "\n".join(lines)


def verdicts(rows: list[EmbedRow]) -> list[str]:
    if not rows:
        return ["MISS embeddings: no results"]
    best_worker = max(rows, key=lambda r: r.worker_inputs_per_s)
    best_direct = max(rows, key=lambda r: r.direct_inputs_per_s)
    of_direct = ratio(best_worker.worker_inputs_per_s, best_direct.direct_inputs_per_s)
    lines = [
        f"{'PASS' if of_direct >= TARGET_OF_DIRECT else 'MISS'} worker best "
        f"{best_worker.worker_inputs_per_s:,.0f} inputs/s (batch {best_worker.batch}) = "
        f"{of_direct * 100:.0f}% of direct best {best_direct.direct_inputs_per_s:,.0f} inputs/s "
        f"(batch {best_direct.batch}) (target >= {TARGET_OF_DIRECT * 100:.0f}%)"
    ]
    one = next((r for r in rows if r.batch == 1), None)
    if one is None:
        lines.append("MISS worker best / worker batch 1: batch size 1 was not measured")
    else:
        gain = ratio(best_worker.worker_inputs_per_s, one.worker_inputs_per_s)
        lines.append(
            f"{'PASS' if gain >= TARGET_OVER_BATCH1 else 'MISS'} worker best / worker batch 1 = "
            f"{gain:.2f}x ({best_worker.worker_inputs_per_s:,.0f} / "
            f"{one.worker_inputs_per_s:,.0f} inputs/s) (target >= {TARGET_OVER_BATCH1}x)"
        )
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, shorter rounds")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="override the sizes")
    parser.add_argument("--concurrencies", type=int, nargs="+", help="override them")
    parser.add_argument("--skip-embeddings", action="store_true")
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument(
        "--client",
        choices=("raw", "httpx"),
        default="raw",
        help="load generator: a minimal asyncio HTTP/1.1 client, or httpx (costs more CPU)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="torch threads in this process and the workers (OMP_NUM_THREADS); "
        "default: torch's default in both",
    )
    parser.add_argument("--encoding", choices=("base64", "float"), default="base64")
    parser.add_argument("--batch-window-ms", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=GEN_MAX_TOKENS)
    parser.add_argument(
        "--quiet-wait-s",
        type=float,
        default=15.0,
        help="longest wait, before a pair of rounds, for other processes to go quiet",
    )
    parser.add_argument("--retries", type=int, default=2, help="extra pairs per row if noisy")
    parser.add_argument(
        "--max-run-s",
        type=float,
        default=180.0,
        help="after this, no more quiet waits nor retries",
    )
    args = parser.parse_args(argv)
    sizes, concurrencies = args.batch_sizes, args.concurrencies
    if args.quick:
        args.batch_sizes = [1, 8, 32]
        args.concurrencies = [1, 4, 16]
        args.rounds = 1
        args.embed_direct_s, args.embed_warmup_s, args.embed_worker_s = 1.0, 0.5, 1.5
        args.gen_round_s = 0.7
    else:
        args.batch_sizes = [1, 2, 4, 8, 16, 32, 64]
        args.concurrencies = [1, 2, 4, 8, 16]
        args.rounds = 2
        args.embed_direct_s, args.embed_warmup_s, args.embed_worker_s = 2.0, 1.0, 2.5
        args.gen_round_s = 2.0
    args.batch_sizes = sizes or args.batch_sizes
    args.concurrencies = concurrencies or args.concurrencies
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.torch_threads is not None:
        # Before torch loads, here and in every worker process started below.
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
    import torch

    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)

    started = time.monotonic()
    args.deadline = started + args.max_run_s
    meta: dict[str, Any] = {
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "encoding_format": args.encoding,
        "load_client": args.client,
        "batch_window_ms": args.batch_window_ms,
        "quick": args.quick,
    }
    print(
        f"# bench_worker: {meta['date_utc']}, {meta['cpus']} CPUs, torch {meta['torch']} with "
        f"{meta['torch_threads']} threads (the worker processes: the same); "
        f"load client {args.client}, encoding_format {args.encoding}",
        flush=True,
    )
    embed_rows: list[EmbedRow] = []
    gen_rows: list[GenRow] = []
    failures: list[str] = []
    if not args.skip_embeddings:
        print("embeddings ...", file=sys.stderr, flush=True)
        try:
            embed_rows = run_embeddings(args)
        except Exception:
            failures.append("embeddings:\n" + traceback.format_exc())
    if not args.skip_generation:
        print("generation ...", file=sys.stderr, flush=True)
        try:
            gen_rows = run_generation(args)
        except Exception:
            failures.append("generation:\n" + traceback.format_exc())
    meta["total_s"] = round(time.monotonic() - started, 1)

    if embed_rows:
        print("\n## Embeddings (minilm)\n")
        print(embed_table(embed_rows))
        print("\nDiagnostics (worker side, same windows):\n")
        print(embed_diag_table(embed_rows))
    if gen_rows:
        print(f"\n## Generation ({GEN_MODEL}, max_tokens {args.max_tokens}, greedy)\n")
        print(gen_table(gen_rows))
    print()
    if not args.skip_embeddings:
        for line in verdicts(embed_rows):
            print(line)
    noise = [r.other_cores_direct for r in embed_rows] + [r.other_cores_worker for r in embed_rows]
    noise += [r.other_cores_worker for r in gen_rows] + [r.other_cores_batch for r in gen_rows]
    if noise and max(noise) > NOISY_CORES:
        print(
            f"NOTE: other processes used up to {max(noise):.2f} of {os.cpu_count()} CPUs during "
            "a measured round: the figures of those rows are disturbed"
        )
    for label, rows in (("batch", embed_rows), ("concurrency", gen_rows)):
        for row in rows:
            if row.worker_errors:
                print(
                    f"ERRORS at {label} {getattr(row, label)}: {row.worker_errors} failed "
                    f"worker requests, e.g. {row.error_samples[0]}"
                )
    for failure in failures:
        print(f"\nFAILED {failure}")
    print(f"\ntotal {meta['total_s']:.0f} s")
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "meta": meta,
                    "embeddings": [asdict(r) for r in embed_rows],
                    "generation": [asdict(r) for r in gen_rows],
                    "verdicts": verdicts(embed_rows) if embed_rows else [],
                    "failures": failures,
                },
                indent=2,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    try:
        main()
    except Exception:  # a benchmark reports, it does not fail the build
        traceback.print_exc()
    sys.exit(0)
