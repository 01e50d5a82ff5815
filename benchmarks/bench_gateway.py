"""Gateway overhead and priority under overload: side by side in one run.

Every server is a real process on 127.0.0.1: ``tidegate worker`` (the replica), ``tidegate
serve`` (the gateway, with the worker as its static upstream, ``engine: openai``, ``slots:
64``: what the worker's /stats reports for max batch 32) and, in part 2, a Ray Serve peer
(``benchmarks/peers/ray_serve_minilm.py``, run by the Python of a separate venv). The load
generator is this process, a third one: asyncio with keep-alive connections, by default a
minimal HTTP/1.1 client (``--client httpx`` for one ``httpx.AsyncClient``, whose connection
pool costs the load generator milliseconds of CPU per request at 64 connections: it would
measure httpx, not the servers). Requests are ``POST /v1/embeddings`` of one sentence
(12-16 tokens), ``encoding_format=base64``.

1. Overhead. The same worker called directly and through the gateway, closed loop, the same
   concurrency for both: 1 (the latency the hop adds) and 64 (throughput at saturation).
   Rounds are interleaved (direct, gateway, direct, gateway) so that noise hits both alike.
   (a) ``--engine simulated`` with zero service time and no batch window: pure serving
   cost; (b) the real ``minilm``, max batch 32, window 5 ms. Reports req/s, p50, p99, added
   p50/p99 (gateway - direct), the gateway's CPU per request and each process's CPU.
   Targets: <= 1 ms added at p50, judged at concurrency 1 (at saturation the added latency
   is the throughput lost, by Little's law), and >= 70% of direct throughput at
   concurrency 64. The 2 cores are shared by the load generator, the gateway and the
   worker: through the gateway, the gateway's CPU is taken from the worker.

2. Priority under 2x overload, ``minilm``. First the capacity C: closed loop, concurrency
   128, through the gateway. Then one open-loop Poisson schedule at 2*C for a fixed time
   (seeded: the same arrival times and classes for every system), 20% high, 30% medium,
   50% low, each request tagged ``X-Priority: high|medium|low``. Latency runs from the
   scheduled arrival, so a late load generator counts against the system. After the last
   arrival, answers are awaited for a bounded drain time; what is still open then is
   cancelled and counted as unfinished. All systems batch up to 32 with a 5 ms window and
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

Run (about 4 to 5 minutes; ``--quick``: a smoke run of about 2, whose 5 s of overload are too
short for fifo's queue to fill, so its verdicts mean little):
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_gateway.py [--quick] [--skip-peer]
        [--ray-python /tmp/rayvenv/bin/python] [--out results.json] [--verdict verdict.json]
The peer needs a venv of its own (see benchmarks/peers/ray_serve_minilm.py); without it, or
when it fails, the peer column is reported missing with the reason. Prints markdown tables,
then PASS/MISS lines (``--verdict``: also as JSON rows, for ``benchmarks/summary.py``); always
exits 0. Every process it starts is stopped at the end. The load client, the drivers and the
process handling are ``benchmarks/loadgen.py``'s, as in every benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

import loadgen as lg
from loadgen import Child, cpu_s, fmt, ms, percentile, ratio, session_cpu_s, stop
from summary import write_verdicts

PEER_SCRIPT = Path(__file__).resolve().parent / "peers" / "ray_serve_minilm.py"
DEFAULT_RAY_PYTHON = "/tmp/rayvenv/bin/python"


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
TARGET_ADDED_P50_MS = 1.0
TARGET_OF_DIRECT = 0.70
TARGET_HIGH_P99_X = 5.0
TARGET_THROUGHPUT_OF_BEST = 0.90

TEXTS = lg.sentences(512)
QUIET = lg.QuietWait(max_s=20.0, budget_s=90.0, probe_s=0.5)  # at most 90 s per run in all
HEADERS = {name: {"x-priority": name} for name, _ in CLASSES}


def bodies(model: str) -> list[bytes]:
    return lg.embedding_bodies(model, TEXTS)


# --------------------------------------------------------------------------- processes


def gateway_config(model: str, upstream: str, policy: str) -> dict[str, Any]:
    return {
        "gateway": {"host": "127.0.0.1", "policy": policy, "shutdown_timeout_s": 5},
        "models": [
            {
                "name": model,
                "task": "embeddings",
                "engine": "openai",
                "upstreams": [upstream],
                "slots": SLOTS,
                "queue": {"max_size": QUEUE_MAX, "timeout_s": dict(QUEUE_TIMEOUTS)},
            }
        ],
    }


def start_gateway(name: str, logdir: Path, model: str, upstream: str, policy: str) -> Child:
    return lg.start_serve(name, logdir, gateway_config(model, upstream, policy), model)


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
    pids: dict[str, int],
    client_kind: str,
) -> Closed:
    QUIET()
    result = Closed(window_s=measure_s)
    begin = time.perf_counter() + warmup_s
    end = begin + measure_s
    marks: dict[str, list[float]] = {}

    def snapshot() -> list[float]:
        return [*(cpu_s(pid) for pid in pids.values()), time.process_time()]

    async def window() -> None:
        await asyncio.sleep(max(0.0, begin - time.perf_counter()))
        marks["begin"] = snapshot()
        other = lg.OtherLoad()
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        marks["end"] = snapshot()
        result.other_cores = other.cores()

    records = await lg.closed_loop(
        url,
        "/v1/embeddings",
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
    names = [*pids, "loadgen"]
    result.cpu = {
        name: b - a for name, a, b in zip(names, marks["begin"], marks["end"], strict=True)
    }
    return result


@dataclass
class OverheadRow:
    engine: str
    concurrency: int
    path: str  # "direct" or "gateway"
    req_per_s: float
    p50_ms: float
    p99_ms: float
    completed: int
    errors: int
    cpu_cores: dict[str, float]  # CPU seconds per second of window, per process
    other_cores: float  # CPU of processes not ours (noise), mean over its rounds
    added_p50_ms: float = math.nan
    added_p99_ms: float = math.nan
    of_direct: float = math.nan
    gateway_cpu_us_per_req: float = math.nan


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
    if "gateway" in cpu and completed:
        row.gateway_cpu_us_per_req = cpu["gateway"] / completed * 1e6
    return row


def overhead(
    engine: str,
    worker: Child,
    gateway: Child,
    model: str,
    args: argparse.Namespace,
) -> list[OverheadRow]:
    payloads = bodies(model)
    rows = []
    for concurrency in OVERHEAD_CONCURRENCY:
        runs: dict[str, list[Closed]] = {"direct": [], "gateway": []}
        for _ in range(args.rounds):
            for path, target in (("direct", worker), ("gateway", gateway)):
                pids = {"worker": worker.pid} | (
                    {"gateway": gateway.pid} if target is gateway else {}
                )
                runs[path].append(
                    asyncio.run(
                        closed_loop(
                            target.url,
                            payloads,
                            concurrency,
                            args.warmup_s,
                            args.measure_s,
                            pids,
                            args.client,
                        )
                    )
                )
        direct = merge(engine, concurrency, "direct", runs["direct"])
        via = merge(engine, concurrency, "gateway", runs["gateway"])
        via.added_p50_ms = via.p50_ms - direct.p50_ms
        via.added_p99_ms = via.p99_ms - direct.p99_ms
        via.of_direct = ratio(via.req_per_s, direct.req_per_s)
        rows += [direct, via]
        print(
            f"  {engine} c={concurrency}: direct {direct.req_per_s:,.0f} req/s p50 "
            f"{ms(direct.p50_ms)} ms; gateway {via.req_per_s:,.0f} req/s p50 {ms(via.p50_ms)} "
            f"ms (+{ms(via.added_p50_ms)})",
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
        "| of direct req/s | gateway CPU µs/req | CPU cores: loadgen / gateway / worker / other |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        cores = (
            " / ".join(
                fmt(r.cpu_cores[name], 2) if name in r.cpu_cores else "-"
                for name in ("loadgen", "gateway", "worker")
            )
            + f" / {fmt(r.other_cores, 2)}"
        )
        gw = r.path == "gateway"
        lines.append(
            f"| {r.engine} | {r.concurrency} | {r.path} | {fmt(r.req_per_s, 0)} | {ms(r.p50_ms)} "
            f"| {ms(r.p99_ms)} | {ms(r.added_p50_ms) if gw else ''} "
            f"| {ms(r.added_p99_ms) if gw else ''} "
            f"| {fmt(r.of_direct * 100, 0) + '%' if gw else ''} "
            f"| {fmt(r.gateway_cpu_us_per_req, 0) if gw else ''} | {cores} |"
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
    lines = []
    engines = dict.fromkeys(r.engine for r in rows)
    for engine in engines:
        mine = [r for r in rows if r.engine == engine and r.path == "gateway"]
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


def part_overhead_sim(logdir: Path, args: argparse.Namespace) -> list[OverheadRow]:
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
    try:
        gateway = start_gateway("sim-gateway", logdir, "sim", worker.url, "priority")
        try:
            return overhead("simulated (0 ms)", worker, gateway, "sim", args)
        finally:
            stop(gateway)
    finally:
        stop(worker)


def run(args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"notes": []}
    notes: list[str] = results["notes"]
    busy = other_benchmarks()
    if busy:
        notes.append(f"other benchmarks were running at the start: {'; '.join(busy)}")
        print(f"note: {notes[-1]}", flush=True)

    print("1a. overhead, simulated engine with zero service time", flush=True)
    rows = part_overhead_sim(logdir, args)

    print("1b. overhead, minilm; 2. priority under overload", flush=True)
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
    caps: list[Capacity] = []
    runs: list[OverloadRun] = []

    def meters(gateway: Child) -> dict[str, Callable[[], float]]:
        return {"gateway": lambda: cpu_s(gateway.pid), "worker": lambda: cpu_s(worker.pid)}

    try:
        reference = probe_vector(worker.url)
        gateway = start_gateway("gateway-priority", logdir, "minilm", worker.url, "priority")
        try:
            rows += overhead("minilm", worker, gateway, "minilm", args)
            caps.append(capacity("tidegate (gateway + worker)", gateway.url, args))
            rate = 2 * caps[0].req_per_s
            arrivals = schedule(rate, args.duration_s, args.seed)
            print(f"  open loop: {len(arrivals):,} arrivals at {rate:,.0f}/s", flush=True)
            runs.append(overload("tidegate priority", gateway.url, arrivals, args, meters(gateway)))
        finally:
            stop(gateway)
        gateway = start_gateway("gateway-fifo", logdir, "minilm", worker.url, "fifo")
        try:
            runs.append(overload("tidegate fifo", gateway.url, arrivals, args, meters(gateway)))
        finally:
            stop(gateway)
    finally:
        stop(worker)

    peer_missing: str | None = None
    if args.skip_peer:
        peer_missing = "--skip-peer"
    elif not args.ray_python or not Path(args.ray_python).exists():
        peer_missing = (
            f"no Ray Python at {args.ray_python or DEFAULT_RAY_PYTHON!r} "
            "(see benchmarks/peers/ray_serve_minilm.py for the venv)"
        )
    else:
        print("2. peer: Ray Serve", flush=True)
        try:
            peer = start_peer(args.ray_python, logdir, torch_threads())
        except Exception as exc:
            peer_missing = f"the peer did not start: {exc}"
        else:
            try:
                vector = probe_vector(peer.url)
                diff = max(abs(a - b) for a, b in zip(vector, reference, strict=True))
                results["peer_vs_tidegate_max_abs_diff"] = diff
                print(f"  peer vector vs tidegate worker: max |diff| = {diff:.2e}", flush=True)
                caps.append(capacity("ray serve", peer.url, args))
                ray_cpu = {"ray (all its processes)": lambda: session_cpu_s(peer.pid)}
                runs.append(overload("ray serve", peer.url, arrivals, args, ray_cpu))
            except Exception as exc:
                peer_missing = f"the peer failed during the run: {type(exc).__name__}: {exc}"
            finally:
                stop(peer)
    if peer_missing:
        print(f"peer column missing: {peer_missing}", flush=True)
    results.update(
        overhead=[asdict(r) for r in rows],
        capacity=[asdict(c) for c in caps],
        overload=[asdict(r) for r in runs],
        peer_missing=peer_missing,
        arrival_rate_per_s=2 * caps[0].req_per_s,
        arrivals=len(arrivals),
    )
    results["tables"] = {
        "overhead": overhead_table(rows),
        "capacity": capacity_table(caps),
        "overload": overload_tables(runs),
    }
    results["verdicts"] = overhead_verdicts(rows) + priority_verdicts(runs, peer_missing)
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--skip-peer", action="store_true", help="do not run Ray Serve")
    parser.add_argument(
        "--ray-python",
        default=DEFAULT_RAY_PYTHON if Path(DEFAULT_RAY_PYTHON).exists() else None,
        help=f"Python of the venv with ray[serve] (default {DEFAULT_RAY_PYTHON} if present)",
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
        f"{'quick' if args.quick else 'full'} run",
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
    print()
    print("### Overhead: the same worker, direct and through the gateway (closed loop)\n")
    print(results["tables"]["overhead"])
    print("\n### Capacity C (closed loop, single-input requests)\n")
    print(results["tables"]["capacity"])
    print(f"\n### Open loop at 2 x C = {results['arrival_rate_per_s']:,.0f} req/s\n")
    print(results["tables"]["overload"])
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
