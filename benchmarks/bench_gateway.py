"""Gateway overhead and priority under overload: side by side in one run.

Every server is a real process on 127.0.0.1: ``tidegate worker`` (the replica), ``tidegate
serve`` (the gateway, with the upstream as its static upstream, ``engine: openai``, ``slots:
64``: what the worker's /stats reports for max batch 32), in part 1 Debian's nginx as a plain
reverse proxy and guidellm's mock server as an upstream nobody here wrote, and in part 2 a
Ray Serve peer (``benchmarks/peers/ray_serve_minilm.py``, run by the Python of a separate
venv). The load generator is this process, a third one: asyncio with keep-alive connections,
by default a minimal HTTP/1.1 client (``--client httpx`` for one ``httpx.AsyncClient``, whose
connection pool costs the load generator milliseconds of CPU per request at 64 connections:
it would measure httpx, not the servers). Requests to tidegate workers are ``POST
/v1/embeddings`` of one sentence (12-16 tokens), ``encoding_format=base64``.

1. Overhead (``--only overhead``). The same upstream called three ways, closed loop, the same
   concurrency for each: 1 (the latency a hop adds) and 64 (throughput at saturation):
   "direct"; "nginx", the floor: Debian's nginx (``apt-get install -y nginx`` when it is not
   on PATH and this runs as root), started by the benchmark with a generated config
   (``worker_processes 1``, access log off, ``proxy_pass`` to an ``upstream {}`` block with
   ``keepalive``, HTTP/1.1 and ``Connection ""`` to the upstream, no temp files) on a free
   port; and "gateway". Rounds are interleaved, the order reversed every other round (direct,
   nginx, gateway, gateway, nginx, direct), so that noise hits all alike.
   (a) ``--engine simulated`` with zero service time and no batch window: pure serving
   cost; (b) guidellm's ``mock-server`` (``benchmarks/peers/guidellm_mock.py``, run by the
   Python of a separate venv, ``--guidellm-python``): it serves no embeddings, so ``POST
   /v1/chat/completions``, not streamed, one sentence, ``max_tokens`` 8, with ``--ttft-ms 0
   --itl-ms 0``: it answers at once, and the gateway serves it as a ``task: generate``
   model; (c) the real ``minilm``, max batch 32, window 5 ms. Reports req/s, p50, p99, added
   p50/p99 and % of direct req/s for nginx and the gateway, the proxy's CPU per
   request (nginx: master and worker together) and each process's CPU. Targets, for the
   gateway against direct: <= 1 ms added at p50, judged at concurrency 1 (at saturation the
   added latency is the throughput lost, by Little's law), and >= 70% of direct throughput
   at concurrency 64; a line per upstream (not a verdict) sets the gateway's added p50 and
   throughput beside nginx's. The 2 cores are shared by the load generator, the proxy and
   the upstream: through a proxy, the proxy's CPU is taken from the upstream. Without nginx
   or the guidellm venv, their rows say "not measured" with the reason and the run goes on.

2. Priority under 2x overload (``--only overload``), ``minilm``. First the capacity C: closed
   loop, concurrency 128, through the gateway. Then one open-loop Poisson schedule at 2*C
   for a fixed time (seeded: the same arrival times and classes for every system), 20% high,
   30% medium, 50% low, each request tagged ``X-Priority: high|medium|low``. Latency runs
   from the scheduled arrival, so a late load generator counts against the system. After
   the last arrival, answers are awaited for a bounded drain time; what is still open then
   is cancelled and counted as unfinished. All systems batch up to 32 with a 5 ms window and
   hold at most 1064 requests (tidegate: 64 at the worker, 1000 in the gateway queue):
   (i) tidegate, policy priority: queue ``max_size: 1000`` (the default), default holdback
       (medium refused above 90% full, low above 70%), ``timeout_s: {medium: 10, low: 5}``;
   (ii) tidegate, ``policy: fifo``: the same file (fifo keeps only ``max_size``);
   (iii) Ray Serve: ``@serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)``, one
        replica, the batch run in a thread as tidegate's engine does, the same model code
        (mean pooling + L2 norm), torch with the worker's thread count;
        ``max_ongoing_requests=1000`` (the backlog waits in the replica, first come first
        served) and ``max_queued_requests=64`` in its router (503 past it): see
        PEER_MAX_ONGOING for why not 64 + 1000.
   Reports per class p50/p99 of completed requests, 429s (and how many had Retry-After),
   504s, 503s, errors, unfinished, and completed req/s during the arrivals. Targets: high
   p99 >= 5x better than both fifo and the peer, and total throughput within 10% of the
   best of them.

Run (about 5 to 7 minutes, part 1 alone about 4; a busy machine adds up to 90 s of waiting
for quiet). ``--quick`` is a smoke run of about 3 (part 1 alone about 1.5) whose 5 s of
overload are too short for fifo's queue to fill, so that its verdicts mean little:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_gateway.py [--quick]
        [--only overhead|overload] [--skip-peer] [--ray-python /tmp/rayvenv/bin/python]
        [--guidellm-python /tmp/guidellm-venv/bin/python] [--out results.json]
        [--verdict verdict.json]
The two peers need venvs of their own. Ray Serve: see benchmarks/peers/ray_serve_minilm.py;
without it, or when it fails, the peer column is reported missing with the reason.
guidellm (install the CPU torch first, or pip pulls a CUDA build of several GB):
    python3.11 -m venv /tmp/guidellm-venv
    /tmp/guidellm-venv/bin/pip install torch==2.13.0
    /tmp/guidellm-venv/bin/pip install guidellm
Prints markdown tables, then PASS/MISS lines (``--verdict``: also as JSON rows, for
``benchmarks/summary.py``); always exits 0. Every process it starts is stopped at the end.
The load client, the drivers and the process handling are ``benchmarks/loadgen.py``'s, as in
every benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime as dt
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

import loadgen as lg
from loadgen import Child, fmt, ms, percentile, ratio, session_cpu_s, stop
from summary import write_verdicts

PEERS = Path(__file__).resolve().parent / "peers"
PEER_SCRIPT = PEERS / "ray_serve_minilm.py"
DEFAULT_RAY_PYTHON = "/tmp/rayvenv/bin/python"
MOCK_SCRIPT = PEERS / "guidellm_mock.py"
DEFAULT_GUIDELLM_PYTHON = "/tmp/guidellm-venv/bin/python"
GUIDELLM_VENV_HELP = (
    "python3.11 -m venv /tmp/guidellm-venv && /tmp/guidellm-venv/bin/pip install "
    "torch==2.13.0 && /tmp/guidellm-venv/bin/pip install guidellm"
)
MOCK_MODEL = "mock"
MOCK_MAX_TOKENS = 8
PARTS = ("overhead", "overload")


MAX_BATCH = 32
WINDOW_MS = 5.0
SLOTS = 2 * MAX_BATCH  # what the worker reports in /stats: the running batch and the next
QUEUE_MAX = 1000  # tidegate's default queue.max_size
QUEUE_TIMEOUTS = {"medium": 10.0, "low": 5.0}
# The peer holds the backlog in its replica (in front of @serve.batch), with a small margin
# in Ray's router: 1064 in all, as tidegate's 64 slots + 1000 queued. With the backlog in the
# router instead (max_ongoing_requests=64, max_queued_requests=1000), Ray Serve 2.60 completed
# about 4 req/s at concurrency 128 on this machine, against about 60 this way: requests
# waiting in its router are assigned with a backoff.
PEER_MAX_ONGOING = QUEUE_MAX
PEER_MAX_QUEUED = SLOTS
CLASSES = (("high", 0.2), ("medium", 0.3), ("low", 0.5))
OVERHEAD_CONCURRENCY = (1, 64)
CAPACITY_CONCURRENCY = 128
MAX_OPEN_LOOP_REQUESTS = 40_000
REQUEST_TIMEOUT_S = 60.0
PEER_READY_TIMEOUT_S = 240.0
MOCK_READY_TIMEOUT_S = 120.0
NGINX_READY_TIMEOUT_S = 30.0
APT_TIMEOUT_S = 600.0
TARGET_ADDED_P50_MS = 1.0
TARGET_OF_DIRECT = 0.70
TARGET_HIGH_P99_X = 5.0
TARGET_THROUGHPUT_OF_BEST = 0.90

TEXTS = lg.sentences(512)
QUIET = lg.QuietWait(max_s=20.0, budget_s=90.0, probe_s=0.5)  # at most 90 s per run in all
HEADERS = {name: {"x-priority": name} for name, _ in CLASSES}


def bodies(model: str) -> list[bytes]:
    return lg.embedding_bodies(model, TEXTS)


def chat_bodies(model: str) -> list[bytes]:
    """One short non-streamed chat per sentence, for an upstream that serves no embeddings."""
    return [
        json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": MOCK_MAX_TOKENS,
            }
        ).encode()
        for text in TEXTS
    ]


# --------------------------------------------------------------------------- processes


def gateway_config(model: str, upstream: str, policy: str, task: str) -> dict[str, Any]:
    return {
        "gateway": {"host": "127.0.0.1", "policy": policy, "shutdown_timeout_s": 5},
        "models": [
            {
                "name": model,
                "task": task,
                "engine": "openai",
                "upstreams": [upstream],
                "slots": SLOTS,
                "queue": {"max_size": QUEUE_MAX, "timeout_s": dict(QUEUE_TIMEOUTS)},
            }
        ],
    }


def start_gateway(
    name: str, logdir: Path, model: str, upstream: str, policy: str, task: str = "embeddings"
) -> Child:
    return lg.start_serve(name, logdir, gateway_config(model, upstream, policy, task), model)


def torch_threads() -> int:
    """torch's default thread count in the project's venv: what the worker runs with."""
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(out.stdout.strip())


def start_peer(ray_python: str, logdir: Path, threads: int) -> Child:
    port = lg.free_port()
    # Ray's session folder holds unix sockets: keep its path short (108 bytes at most).
    scratch = Path(tempfile.gettempdir()) / f"tg_bench_ray_{os.getpid()}"
    cmd = [
        ray_python,
        str(PEER_SCRIPT),
        "--port",
        str(port),
        "--max-batch-size",
        str(MAX_BATCH),
        "--batch-window-ms",
        str(WINDOW_MS),
        "--max-ongoing",
        str(PEER_MAX_ONGOING),
        "--max-queued",
        str(PEER_MAX_QUEUED),
        "--torch-threads",
        str(threads),
        "--temp-dir",
        str(scratch),
    ]
    child = lg.spawn("ray-peer", cmd, logdir, group_term=False, stop_timeout_s=40, scratch=scratch)
    child.url = lg.first_line(child, PEER_READY_TIMEOUT_S)
    if not child.url.startswith("http://127.0.0.1:"):
        raise RuntimeError(f"peer printed {child.url!r} instead of its address")
    return child


NGINX_CONF = """\
worker_processes 1;
pid {prefix}/nginx.pid;
error_log stderr warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream backend {{
        server {upstream};
        keepalive 128;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port};
        keepalive_requests 1000000;
        client_body_buffer_size 64k;
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_max_temp_file_size 0;
        }}
    }}
}}
"""


@contextlib.contextmanager
def stopped_on_failure(child: Child) -> Iterator[None]:
    """Stops ``child`` at once if its start fails: the run goes on without it."""
    try:
        yield
    except BaseException:
        stop(child)
        raise


def find_nginx() -> str | None:
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


def nginx_binary(logdir: Path) -> str:
    """Debian's nginx: the one installed, else ``apt-get install -y nginx`` (as root only).
    RuntimeError with the reason when there is none."""
    if found := find_nginx():
        return found
    if os.geteuid() != 0:
        raise RuntimeError("nginx is not installed and installing it needs root")
    if not shutil.which("apt-get"):
        raise RuntimeError("nginx is not installed and there is no apt-get")
    print("  installing nginx: apt-get update; apt-get install -y nginx", flush=True)
    log = logdir / "apt-get.log"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "nginx"]):
        with log.open("ab") as out:
            try:
                done = subprocess.run(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    timeout=APT_TIMEOUT_S,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{' '.join(cmd)} took over {APT_TIMEOUT_S:.0f} s") from None
        if done.returncode:
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
            raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}: {tail}")
    if found := find_nginx():
        return found
    raise RuntimeError("apt-get installed nginx, but no nginx binary was found")


def start_nginx(binary: str, name: str, logdir: Path, upstream: Upstream) -> Child:
    """nginx in front of ``upstream`` on a free port, its own config, pid and temp files in
    a folder of the logs; ready once a request through it reaches the upstream."""
    prefix = logdir / name
    prefix.mkdir()
    port = lg.free_port()
    conf = prefix / "nginx.conf"
    target = upstream.child.url.removeprefix("http://").rstrip("/")
    conf.write_text(NGINX_CONF.format(prefix=prefix, upstream=target, port=port))
    cmd = [binary, "-p", f"{prefix}/", "-c", str(conf), "-e", "stderr", "-g", "daemon off;"]
    child = lg.spawn(name, cmd, logdir)
    child.url = f"http://127.0.0.1:{port}"
    with stopped_on_failure(child):
        lg.wait_http_ready(child, upstream.ready_path, NGINX_READY_TIMEOUT_S, lambda body: True)
    return child


def start_mock(python: str, logdir: Path) -> Child:
    """guidellm's mock server (benchmarks/peers/guidellm_mock.py) with zero latencies."""
    cmd = [
        python,
        str(MOCK_SCRIPT),
        "--port",
        str(lg.free_port()),
        "--model",
        MOCK_MODEL,
        "--output-tokens",
        str(MOCK_MAX_TOKENS),
        "--ttft-ms",
        "0",
        "--itl-ms",
        "0",
    ]
    child = lg.spawn("guidellm-mock", cmd, logdir)
    with stopped_on_failure(child):
        child.url = lg.first_line(child, MOCK_READY_TIMEOUT_S)
        if not child.url.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"the mock server printed {child.url!r} instead of its address")
        lg.wait_http_ready(child, "/health", MOCK_READY_TIMEOUT_S, lambda body: True)
    return child


def other_benchmarks() -> list[str]:
    """Other benchmark processes running now (they would skew the figures)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "benchmarks/bench_" in cmdline and "bench_gateway" not in cmdline:
            found.append(f"{entry.name}: {cmdline.strip()[:100]}")
    return found


# --------------------------------------------------------------------------- load: closed loop
@dataclass
class Closed:
    """One closed-loop measurement: latencies of requests completed in the window."""

    latencies: list[float] = field(default_factory=list)
    completed: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)  # the first few, for stderr
    window_s: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds in the window
    other_cores: float = math.nan  # CPU of processes not ours, in the window


async def closed_loop(
    url: str,
    payloads: list[bytes],
    concurrency: int,
    warmup_s: float,
    measure_s: float,
    meters: dict[str, Callable[[], float]],
    client_kind: str,
    route: str = "/v1/embeddings",
) -> Closed:
    """``meters``: CPU seconds of each process to report, read at the window's ends."""
    QUIET()
    result = Closed(window_s=measure_s)
    begin = time.perf_counter() + warmup_s
    end = begin + measure_s
    marks: dict[str, list[float]] = {}

    def snapshot() -> list[float]:
        return [*(meter() for meter in meters.values()), time.process_time()]

    async def window() -> None:
        await asyncio.sleep(max(0.0, begin - time.perf_counter()))
        marks["begin"] = snapshot()
        other = lg.OtherLoad()
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        marks["end"] = snapshot()
        result.other_cores = other.cores()

    records = await lg.closed_loop(
        url,
        route,
        payloads,
        concurrency,
        window(),
        client_kind=client_kind,
        timeout_s=REQUEST_TIMEOUT_S,
    )
    for record in records:
        if begin <= record.end <= end and record.sent < end:
            if record.status == 200:
                result.completed += 1
                result.latencies.append(record.latency)
            else:
                result.errors += 1
                if len(result.error_samples) < 3:
                    result.error_samples.append(record.error)
    if result.error_samples:
        print(f"    {url}: failed requests, e.g. {result.error_samples}", file=sys.stderr)
    names = [*meters, "loadgen"]
    result.cpu = {
        name: b - a for name, a, b in zip(names, marks["begin"], marks["end"], strict=True)
    }
    return result


@dataclass
class OverheadRow:
    engine: str
    concurrency: int
    path: str  # "direct", "nginx" or "gateway"
    req_per_s: float
    p50_ms: float
    p99_ms: float
    completed: int
    errors: int
    cpu_cores: dict[str, float]  # CPU seconds per second of window: loadgen, proxy, upstream
    other_cores: float  # CPU of processes not ours (noise), the noisiest of its rounds
    added_p50_ms: float = math.nan
    added_p99_ms: float = math.nan
    of_direct: float = math.nan
    proxy_cpu_us_per_req: float = math.nan
    not_measured: str = ""  # why, when it was not


def merge(engine: str, concurrency: int, path: str, runs: list[Closed]) -> OverheadRow:
    latencies = [x for run in runs for x in run.latencies]
    window = sum(run.window_s for run in runs)
    completed = sum(run.completed for run in runs)
    cpu: dict[str, float] = {}
    for run in runs:
        for name, seconds in run.cpu.items():
            cpu[name] = cpu.get(name, 0.0) + seconds
    row = OverheadRow(
        engine,
        concurrency,
        path,
        completed / window if window else math.nan,
        percentile(latencies, 50) * 1e3,
        percentile(latencies, 99) * 1e3,
        completed,
        sum(run.errors for run in runs),
        {name: seconds / window for name, seconds in cpu.items()},
        max(run.other_cores for run in runs),
    )
    if "proxy" in cpu and completed:
        row.proxy_cpu_us_per_req = cpu["proxy"] / completed * 1e6
    return row


def not_measured(
    engine: str,
    paths: tuple[str, ...],
    reason: str,
    concurrencies: tuple[int, ...] = OVERHEAD_CONCURRENCY,
) -> list[OverheadRow]:
    """Rows that say why a path (or a whole upstream) was not measured."""
    nan = math.nan
    return [
        OverheadRow(engine, c, path, nan, nan, nan, 0, 0, {}, nan, not_measured=reason)
        for c in concurrencies
        for path in paths
    ]


@dataclass
class Upstream:
    """What part 1 calls: a server, the route and bodies it takes, the path that says ready."""

    engine: str  # the rows' label
    child: Child
    model: str
    route: str
    payloads: list[bytes]
    task: str = "embeddings"
    ready_path: str = "/readyz"


def overhead(
    upstream: Upstream,
    gateway: Child,
    floor: Child | None,
    floor_missing: str,
    args: argparse.Namespace,
) -> list[OverheadRow]:
    """Direct, nginx (when ``floor``) and the gateway, interleaved, at each concurrency."""
    meters = {"upstream": upstream.child.cpu_s}
    paths: dict[str, tuple[str, dict[str, Callable[[], float]]]] = {
        "direct": (upstream.child.url, meters)
    }
    if floor is not None:
        paths["nginx"] = (floor.url, {"proxy": lambda: session_cpu_s(floor.pid), **meters})
    paths["gateway"] = (gateway.url, {"proxy": gateway.cpu_s, **meters})
    rows = []
    for concurrency in OVERHEAD_CONCURRENCY:
        runs: dict[str, list[Closed]] = {path: [] for path in paths}
        for k in range(args.rounds):
            for path in list(paths)[:: 1 if k % 2 == 0 else -1]:
                url, path_meters = paths[path]
                runs[path].append(
                    asyncio.run(
                        closed_loop(
                            url,
                            upstream.payloads,
                            concurrency,
                            args.warmup_s,
                            args.measure_s,
                            path_meters,
                            args.client,
                            upstream.route,
                        )
                    )
                )
        direct = merge(upstream.engine, concurrency, "direct", runs["direct"])
        mine = [direct]
        for path in list(paths)[1:]:
            row = merge(upstream.engine, concurrency, path, runs[path])
            row.added_p50_ms = row.p50_ms - direct.p50_ms
            row.added_p99_ms = row.p99_ms - direct.p99_ms
            row.of_direct = ratio(row.req_per_s, direct.req_per_s)
            mine.append(row)
        if floor is None:
            mine[1:1] = not_measured(upstream.engine, ("nginx",), floor_missing, (concurrency,))
        rows += mine
        print(
            f"  {upstream.engine} c={concurrency}: "
            + "; ".join(
                f"{r.path} not measured"
                if r.not_measured
                else f"{r.path} {r.req_per_s:,.0f} req/s p50 {ms(r.p50_ms)} ms"
                + (f" (+{ms(r.added_p50_ms)})" if r.path != "direct" else "")
                for r in mine
            ),
            flush=True,
        )
    return rows


# --------------------------------------------------------------------------- load: open loop
def schedule(rate: float, duration_s: float, seed: int) -> list[tuple[float, str]]:
    """Poisson arrivals at ``rate`` for ``duration_s`` (bounded count), each with a class."""
    return lg.poisson(rate, duration_s, seed, CLASSES, MAX_OPEN_LOOP_REQUESTS)


def send_schedule(
    url: str,
    arrivals: list[tuple[float, str]],
    drain_s: float,
    client_kind: str,
    meters: dict[str, Callable[[], float]],
) -> lg.OpenLoop:
    """After a quiet wait, the open loop: each arrival a sentence tagged with its class."""
    QUIET()
    return asyncio.run(
        lg.open_loop(
            url,
            "/v1/embeddings",
            bodies("minilm"),
            arrivals,
            HEADERS,
            drain_s=drain_s,
            timeout_s=REQUEST_TIMEOUT_S,
            meters=meters,
            client_kind=client_kind,
        )
    )


@dataclass
class ClassRow:
    system: str
    cls: str
    sent: int
    completed: int
    p50_ms: float
    p99_ms: float
    rejected_429: int
    with_retry_after: int
    expired_504: int
    unavailable_503: int
    errors: int  # other statuses and transport errors
    unfinished: int  # no answer by the end of the drain: cancelled


@dataclass
class OverloadRun:
    system: str
    offered_per_s: float  # scheduled arrivals / duration
    sent_per_s: float  # achieved: arrivals / the time it took to send them
    completed_per_s: float  # 200s that completed during the arrivals / duration
    completed_total: int
    lag_p50_ms: float
    lag_p99_ms: float
    classes: list[ClassRow]
    cpu_cores: dict[str, float]  # while sending
    statuses: dict[str, int]

    def cls(self, name: str) -> ClassRow:
        return next(row for row in self.classes if row.cls == name)


def summarize(system: str, sent: lg.OpenLoop, duration_s: float) -> OverloadRun:
    records = sent.records
    classes = []
    for name, _ in (*CLASSES, ("all", 1.0)):
        mine = [s for s in records if name in ("all", s.tag)]
        ok = [s.latency for s in mine if s.status == 200]
        r429 = [s for s in mine if s.status == 429]
        classes.append(
            ClassRow(
                system,
                name,
                len(mine),
                len(ok),
                percentile(ok, 50) * 1e3,
                percentile(ok, 99) * 1e3,
                len(r429),
                sum(s.retry_after for s in r429),
                sum(s.status == 504 for s in mine),
                sum(s.status == 503 for s in mine),
                sum(s.status not in (0, 200, 429, 503, 504) for s in mine),
                sum(s.status == 0 for s in mine),
            )
        )
    lags = [s.sent - s.start for s in records if s.status != 0]
    in_window = sum(1 for s in records if s.status == 200 and s.end - sent.started <= duration_s)
    return OverloadRun(
        system,
        len(records) / duration_s,
        len(records) / sent.sending_s if sent.sending_s > 0 else math.nan,
        in_window / duration_s,
        sum(s.status == 200 for s in records),
        percentile(lags, 50) * 1e3,
        percentile(lags, 99) * 1e3,
        classes,
        sent.cores,
        {str(k): v for k, v in sorted(Counter(s.status for s in records).items())},
    )


def overload(
    system: str,
    url: str,
    arrivals: list[tuple[float, str]],
    args: argparse.Namespace,
    meters: dict[str, Callable[[], float]],
) -> OverloadRun:
    meters = {"loadgen": time.process_time, **meters}
    run = summarize(
        system, send_schedule(url, arrivals, args.drain_s, args.client, meters), args.duration_s
    )
    high = run.cls("high")
    print(
        f"  {system}: sent {run.sent_per_s:,.0f}/s, completed {run.completed_per_s:,.0f}/s, "
        f"high p99 {ms(high.p99_ms)} ms, 429s {run.cls('all').rejected_429}",
        flush=True,
    )
    return run


@dataclass
class Capacity:
    system: str
    req_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int
    other_cores: float


def capacity(system: str, url: str, args: argparse.Namespace) -> Capacity:
    run = asyncio.run(
        closed_loop(
            url,
            bodies("minilm"),
            CAPACITY_CONCURRENCY,
            args.warmup_s * 2,
            args.capacity_s,
            {},
            args.client,
        )
    )
    cap = Capacity(
        system,
        run.completed / run.window_s,
        percentile(run.latencies, 50) * 1e3,
        percentile(run.latencies, 99) * 1e3,
        run.errors,
        run.other_cores,
    )
    print(f"  capacity {system}: {cap.req_per_s:,.0f} req/s (p50 {ms(cap.p50_ms)} ms)", flush=True)
    return cap


def probe_vector(url: str) -> list[float]:
    body = {"model": "minilm", "input": TEXTS[0], "encoding_format": "base64"}
    response = httpx.post(f"{url}/v1/embeddings", json=body, timeout=30)
    response.raise_for_status()
    raw = base64.b64decode(response.json()["data"][0]["embedding"])
    return list(array("f", raw))


# --------------------------------------------------------------------------- report
def overhead_table(rows: list[OverheadRow]) -> str:
    lines = [
        "| engine | concurrency | path | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms "
        "| of direct req/s | proxy CPU µs/req | CPU cores: loadgen / proxy / upstream / other |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r.not_measured:
            lines.append(
                f"| {r.engine} | {r.concurrency} | {r.path} | not measured ({r.not_measured}) "
                "| | | | | | | |"
            )
            continue
        cores = (
            " / ".join(
                fmt(r.cpu_cores[name], 2) if name in r.cpu_cores else "-"
                for name in ("loadgen", "proxy", "upstream")
            )
            + f" / {fmt(r.other_cores, 2)}"
        )
        via = r.path != "direct"
        lines.append(
            f"| {r.engine} | {r.concurrency} | {r.path} | {fmt(r.req_per_s, 0)} | {ms(r.p50_ms)} "
            f"| {ms(r.p99_ms)} | {ms(r.added_p50_ms) if via else ''} "
            f"| {ms(r.added_p99_ms) if via else ''} "
            f"| {fmt(r.of_direct * 100, 0) + '%' if via else ''} "
            f"| {fmt(r.proxy_cpu_us_per_req, 0) if via else ''} | {cores} |"
        )
    return "\n".join(lines)


def capacity_table(caps: list[Capacity]) -> str:
    lines = [
        "| system | concurrency | req/s | p50 ms | p99 ms | errors | other processes, cores |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in caps:
        lines.append(
            f"| {c.system} | {CAPACITY_CONCURRENCY} | {fmt(c.req_per_s, 0)} | {ms(c.p50_ms)} "
            f"| {ms(c.p99_ms)} | {c.errors} | {fmt(c.other_cores, 2)} |"
        )
    return "\n".join(lines)


def overload_tables(runs: list[OverloadRun]) -> str:
    lines = [
        "| system | offered req/s | sent req/s | completed req/s | completed | "
        "high p99 ms | medium p99 ms | low p99 ms | send lag p50 / p99 ms | CPU cores while "
        "sending |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for run in runs:
        lines.append(
            f"| {run.system} | {fmt(run.offered_per_s, 0)} | {fmt(run.sent_per_s, 0)} "
            f"| {fmt(run.completed_per_s, 0)} | {run.completed_total:,} "
            f"| {ms(run.cls('high').p99_ms)} | {ms(run.cls('medium').p99_ms)} "
            f"| {ms(run.cls('low').p99_ms)} | {ms(run.lag_p50_ms)} / {ms(run.lag_p99_ms)} "
            f"| {', '.join(f'{k} {v:.2f}' for k, v in run.cpu_cores.items())} |"
        )
    lines += [
        "",
        "| system | class | sent | completed | p50 ms | p99 ms | 429 (with Retry-After) | 504 "
        "| 503 | errors | unfinished |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        for c in run.classes:
            lines.append(
                f"| {c.system} | {c.cls} | {c.sent:,} | {c.completed:,} | {ms(c.p50_ms)} "
                f"| {ms(c.p99_ms)} | {c.rejected_429:,} ({c.with_retry_after:,}) "
                f"| {c.expired_504:,} | {c.unavailable_503:,} | {c.errors:,} "
                f"| {c.unfinished:,} |"
            )
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def overhead_verdicts(rows: list[OverheadRow]) -> list[str]:
    """The gateway against direct, per upstream; MISS "not measured" for one that was not."""
    lines = []
    for engine in dict.fromkeys(r.engine for r in rows):
        mine = [r for r in rows if r.engine == engine and r.path == "gateway"]
        if any(r.not_measured for r in mine):
            lines.append(f"MISS {engine}: not measured ({mine[0].not_measured})")
            continue
        low = min(mine, key=lambda r: r.concurrency)
        high = max(mine, key=lambda r: r.concurrency)
        lines.append(
            f"{verdict(low.added_p50_ms <= TARGET_ADDED_P50_MS)} {engine}: added p50 at "
            f"concurrency {low.concurrency} = {ms(low.added_p50_ms)} ms "
            f"(target <= {TARGET_ADDED_P50_MS:g})"
        )
        lines.append(
            f"{verdict(high.of_direct >= TARGET_OF_DIRECT)} {engine}: gateway throughput at "
            f"concurrency {high.concurrency} = {fmt(high.of_direct * 100, 0)}% of direct "
            f"(target >= {TARGET_OF_DIRECT:.0%})"
        )
    return lines


def floor_lines(rows: list[OverheadRow]) -> list[str]:
    """Per upstream, the gateway beside nginx (information, not verdicts)."""
    lines = []
    for engine in dict.fromkeys(r.engine for r in rows):
        by = {(r.path, r.concurrency): r for r in rows if r.engine == engine}
        low, high = min(OVERHEAD_CONCURRENCY), max(OVERHEAD_CONCURRENCY)
        gateway, nginx = by[("gateway", low)], by[("nginx", low)]
        if gateway.not_measured or nginx.not_measured:
            why = gateway.not_measured or nginx.not_measured
            lines.append(f"{engine}: gateway vs nginx not measured ({why})")
            continue
        lines.append(
            f"{engine}: added p50 at concurrency {low}: gateway {ms(gateway.added_p50_ms)} ms, "
            f"nginx {ms(nginx.added_p50_ms)} ms (the gateway adds "
            f"{ms(gateway.added_p50_ms - nginx.added_p50_ms)} ms more); throughput at "
            f"concurrency {high}: gateway {fmt(by[('gateway', high)].of_direct * 100, 0)}%, "
            f"nginx {fmt(by[('nginx', high)].of_direct * 100, 0)}% of direct"
        )
    return lines


def priority_verdicts(runs: list[OverloadRun], peer_missing: str | None) -> list[str]:
    by = {run.system: run for run in runs}
    prio = by.get("tidegate priority")
    if prio is None:
        return ["MISS priority under overload: not measured"]
    lines = []
    others = [s for s in ("tidegate fifo", "ray serve") if s in by]
    high = prio.cls("high").p99_ms
    for system in others:
        x = ratio(by[system].cls("high").p99_ms, high)
        open_high = by[system].cls("high").unfinished
        unfinished = f"; {open_high} high requests unfinished, not counted" if open_high else ""
        lines.append(
            f"{verdict(x >= TARGET_HIGH_P99_X)} high p99: tidegate priority {ms(high)} ms vs "
            f"{system} {ms(by[system].cls('high').p99_ms)} ms = {fmt(x, 1)}x better "
            f"(target >= {TARGET_HIGH_P99_X:g}x)" + unfinished
        )
    if peer_missing:
        lines.append(f"MISS high p99 vs ray serve: not measured ({peer_missing})")
    if others:
        best = max(others, key=lambda s: by[s].completed_per_s)
        share = ratio(prio.completed_per_s, by[best].completed_per_s)
        lines.append(
            f"{verdict(share >= TARGET_THROUGHPUT_OF_BEST)} throughput: tidegate priority "
            f"{fmt(prio.completed_per_s, 0)} req/s = {fmt(share * 100, 0)}% of the best other "
            f"({best}, {fmt(by[best].completed_per_s, 0)} req/s; target >= "
            f"{TARGET_THROUGHPUT_OF_BEST:.0%})"
        )
    return lines


# --------------------------------------------------------------------------- the run
def write_profile(path: Path) -> Path:
    points = [{"batch_size": 1, "latency_ms": 0.0}, {"batch_size": 64, "latency_ms": 0.0}]
    profile = {"version": 1, "model": "sim", "task": "embeddings", "embeddings": {"points": points}}
    path.write_text(json.dumps(profile))
    return path


@dataclass
class Floor:
    """nginx for part 1: its binary, or why there is none."""

    binary: str | None
    missing: str = ""

    @classmethod
    def find(cls, logdir: Path) -> Floor:
        try:
            return cls(nginx_binary(logdir))
        except Exception as exc:
            print(f"  nginx rows not measured: {exc}", flush=True)
            return cls(None, str(exc))


def measure_upstream(
    name: str, upstream: Upstream, logdir: Path, floor: Floor, args: argparse.Namespace
) -> list[OverheadRow]:
    """Part 1 for one upstream: a gateway and nginx in front of it, measured, stopped."""
    gateway = start_gateway(
        f"{name}-gateway", logdir, upstream.model, upstream.child.url, "priority", upstream.task
    )
    with lg.running(gateway):
        nginx, missing = None, floor.missing
        if floor.binary is not None:
            try:
                nginx = start_nginx(floor.binary, f"{name}-nginx", logdir, upstream)
            except Exception as exc:
                missing = f"nginx did not start: {exc}"
                print(f"  {missing}", flush=True)
        try:
            return overhead(upstream, gateway, nginx, missing, args)
        finally:
            if nginx is not None:
                stop(nginx)


def part_overhead_sim(logdir: Path, floor: Floor, args: argparse.Namespace) -> list[OverheadRow]:
    profile = write_profile(logdir / "zero.json")
    worker = lg.start_worker(
        "sim-worker",
        logdir,
        "--model",
        "sim",
        "--engine",
        "simulated",
        "--profile",
        str(profile),
        "--max-batch-size",
        str(MAX_BATCH),
        "--batch-window-ms",
        "0",
    )
    with lg.running(worker):
        upstream = Upstream("simulated (0 ms)", worker, "sim", "/v1/embeddings", bodies("sim"))
        return measure_upstream("sim", upstream, logdir, floor, args)


def part_overhead_mock(logdir: Path, floor: Floor, args: argparse.Namespace) -> list[OverheadRow]:
    """guidellm's mock server as the upstream; rows "not measured" when it cannot be had."""
    engine = "guidellm mock-server"
    python = args.guidellm_python
    if not python or not Path(python).exists():
        reason = (
            f"no guidellm Python at {python or DEFAULT_GUIDELLM_PYTHON!r}, "
            "see benchmarks/peers/guidellm_mock.py"
        )
        print(f"  not measured: {reason}; create the venv with:\n    {GUIDELLM_VENV_HELP}")
        return not_measured(engine, ("direct", "nginx", "gateway"), reason)
    try:
        mock = start_mock(python, logdir)
        with lg.running(mock):
            upstream = Upstream(
                engine,
                mock,
                MOCK_MODEL,
                "/v1/chat/completions",
                chat_bodies(MOCK_MODEL),
                task="generate",
                ready_path="/health",
            )
            return measure_upstream("mock", upstream, logdir, floor, args)
    except Exception as exc:
        reason = f"the mock server failed: {type(exc).__name__}: {exc}"
        print(f"  not measured: {reason}", flush=True)
        return not_measured(engine, ("direct", "nginx", "gateway"), reason)


def part_overload(
    worker: Child, logdir: Path, args: argparse.Namespace
) -> tuple[list[Capacity], list[OverloadRun], list[tuple[float, str]]]:
    """Capacity through the gateway, then the open loop at 2x it: priority, then fifo."""

    def meters(gateway: Child) -> dict[str, Callable[[], float]]:
        return {"gateway": gateway.cpu_s, "worker": worker.cpu_s}

    gateway = start_gateway("gateway-priority", logdir, "minilm", worker.url, "priority")
    with lg.running(gateway):
        caps = [capacity("tidegate (gateway + worker)", gateway.url, args)]
        rate = 2 * caps[0].req_per_s
        arrivals = schedule(rate, args.duration_s, args.seed)
        print(f"  open loop: {len(arrivals):,} arrivals at {rate:,.0f}/s", flush=True)
        runs = [overload("tidegate priority", gateway.url, arrivals, args, meters(gateway))]
    gateway = start_gateway("gateway-fifo", logdir, "minilm", worker.url, "fifo")
    with lg.running(gateway):
        runs.append(overload("tidegate fifo", gateway.url, arrivals, args, meters(gateway)))
    return caps, runs, arrivals


def part_peer(
    args: argparse.Namespace,
    logdir: Path,
    reference: list[float],
    arrivals: list[tuple[float, str]],
    caps: list[Capacity],
    runs: list[OverloadRun],
    results: dict[str, Any],
) -> str | None:
    """Ray Serve under the same schedule; why it is missing, when it is."""
    if args.skip_peer:
        return "--skip-peer"
    if not args.ray_python or not Path(args.ray_python).exists():
        return (
            f"no Ray Python at {args.ray_python or DEFAULT_RAY_PYTHON!r} "
            "(see benchmarks/peers/ray_serve_minilm.py for the venv)"
        )
    print("2. peer: Ray Serve", flush=True)
    try:
        peer = start_peer(args.ray_python, logdir, torch_threads())
    except Exception as exc:
        return f"the peer did not start: {exc}"
    try:
        vector = probe_vector(peer.url)
        diff = max(abs(a - b) for a, b in zip(vector, reference, strict=True))
        results["peer_vs_tidegate_max_abs_diff"] = diff
        print(f"  peer vector vs tidegate worker: max |diff| = {diff:.2e}", flush=True)
        caps.append(capacity("ray serve", peer.url, args))
        ray_cpu = {"ray (all its processes)": lambda: session_cpu_s(peer.pid)}
        runs.append(overload("ray serve", peer.url, arrivals, args, ray_cpu))
    except Exception as exc:
        return f"the peer failed during the run: {type(exc).__name__}: {exc}"
    finally:
        stop(peer)
    return None


def run(args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    parts = args.only or PARTS
    results: dict[str, Any] = {"notes": [], "parts": list(parts)}
    notes: list[str] = results["notes"]
    busy = other_benchmarks()
    if busy:
        notes.append(f"other benchmarks were running at the start: {'; '.join(busy)}")
        print(f"note: {notes[-1]}", flush=True)

    rows: list[OverheadRow] = []
    caps: list[Capacity] = []
    runs: list[OverloadRun] = []
    arrivals: list[tuple[float, str]] = []
    reference: list[float] = []
    floor = Floor(None, "part 1 not run")
    if "overhead" in parts:
        floor = Floor.find(logdir)
        print("1a. overhead, simulated engine with zero service time", flush=True)
        rows += part_overhead_sim(logdir, floor, args)
        print("1b. overhead, guidellm mock-server (chat completions, zero latency)", flush=True)
        rows += part_overhead_mock(logdir, floor, args)

    print(
        " ".join(
            {"overhead": "1c. overhead, minilm;", "overload": "2. priority under overload"}[p]
            for p in parts
        ),
        flush=True,
    )
    worker = lg.start_worker(
        "minilm-worker",
        logdir,
        "--model",
        "minilm",
        "--max-batch-size",
        str(MAX_BATCH),
        "--batch-window-ms",
        str(WINDOW_MS),
    )
    with lg.running(worker):
        if "overhead" in parts:
            upstream = Upstream("minilm", worker, "minilm", "/v1/embeddings", bodies("minilm"))
            rows += measure_upstream("minilm", upstream, logdir, floor, args)
        if "overload" in parts:
            reference = probe_vector(worker.url)
            caps, runs, arrivals = part_overload(worker, logdir, args)

    peer_missing: str | None = None
    if "overload" in parts:
        peer_missing = part_peer(args, logdir, reference, arrivals, caps, runs, results)
        if peer_missing:
            print(f"peer column missing: {peer_missing}", flush=True)
    results.update(
        overhead=[asdict(r) for r in rows],
        capacity=[asdict(c) for c in caps],
        overload=[asdict(r) for r in runs],
        peer_missing=peer_missing,
        arrival_rate_per_s=2 * caps[0].req_per_s if caps else None,
        arrivals=len(arrivals),
        floor=floor_lines(rows),
    )
    results["tables"] = {
        "overhead": overhead_table(rows) if rows else "",
        "capacity": capacity_table(caps) if caps else "",
        "overload": overload_tables(runs) if runs else "",
    }
    results["verdicts"] = overhead_verdicts(rows) + (
        priority_verdicts(runs, peer_missing) if "overload" in parts else []
    )
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument(
        "--only",
        choices=PARTS,
        action="append",
        help="run only this part (1: overhead, 2: overload); may be given twice",
    )
    parser.add_argument("--skip-peer", action="store_true", help="do not run Ray Serve")
    parser.add_argument(
        "--ray-python",
        default=DEFAULT_RAY_PYTHON if Path(DEFAULT_RAY_PYTHON).exists() else None,
        help=f"Python of the venv with ray[serve] (default {DEFAULT_RAY_PYTHON} if present)",
    )
    parser.add_argument(
        "--guidellm-python",
        default=DEFAULT_GUIDELLM_PYTHON if Path(DEFAULT_GUIDELLM_PYTHON).exists() else None,
        help=f"Python of the venv with guidellm (default {DEFAULT_GUIDELLM_PYTHON} if present)",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--verdict", type=Path, help="write the PASS/MISS rows as JSON here")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--client",
        choices=("raw", "httpx"),
        default="raw",
        help=lg.CLIENT_HELP,
    )
    args = parser.parse_args()
    if args.only:
        args.only = tuple(p for p in PARTS if p in args.only)
    args.rounds = 1 if args.quick else 2
    args.warmup_s = 0.5 if args.quick else 1.0
    args.measure_s = 1.5 if args.quick else 4.0
    args.capacity_s = 2.0 if args.quick else 6.0
    args.duration_s = 5.0 if args.quick else 20.0
    args.drain_s = 15.0 if args.quick else 30.0
    return args


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    print(
        f"bench_gateway: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M UTC}, {os.cpu_count()} CPUs, "
        f"{lg.cpu_model()}, Python {platform.python_version()}, "
        f"{'quick' if args.quick else 'full'} run, parts: {', '.join(args.only or PARTS)}",
        flush=True,
    )
    try:
        with lg.processes("bench_gateway") as logdir:  # SIGTERM too: every child stopped
            results = run(args, logdir)
    except BaseException:
        traceback.print_exc()
        write_verdicts(args.verdict, "bench_gateway", [], [traceback.format_exc()])
        return 0
    results["elapsed_s"] = time.monotonic() - started
    tables = results["tables"]
    print()
    if tables["overhead"]:
        print("### Overhead: the same upstream direct, through nginx and through the gateway\n")
        print(tables["overhead"])
        print()
        for line in results["floor"]:
            print(f"vs nginx, {line}")
        print()
    if tables["capacity"]:
        print("### Capacity C (closed loop, single-input requests)\n")
        print(tables["capacity"])
        print(f"\n### Open loop at 2 x C = {results['arrival_rate_per_s']:,.0f} req/s\n")
        print(tables["overload"])
        print()
    if results["peer_missing"]:
        print(f"peer column missing: {results['peer_missing']}")
    if "peer_vs_tidegate_max_abs_diff" in results:
        print(
            "peer vs tidegate embedding of the same sentence: max |diff| = "
            f"{results['peer_vs_tidegate_max_abs_diff']:.2e}"
        )
    print("```")
    for line in results["verdicts"]:
        print(line)
    print("```")
    print(f"total run time: {results['elapsed_s']:.0f} s")
    write_verdicts(args.verdict, "bench_gateway", results["verdicts"])
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
