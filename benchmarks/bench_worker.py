"""Worker batching: a real worker process against the same model called directly, side by side.

Embeddings (minilm). For each batch size B in 1, 2, 4, 8, 16, 32, 64:

  direct  ``TransformersEmbeddings("minilm").embed_sync(batch)`` in a loop in this process, on
          batches of B sentences of the same style as the worker's inputs: what this machine
          can do with the model and no serving at all. Each batch is timed alone.
  worker  ``tidegate worker --model minilm --max-batch-size B`` in its own process, two of
          them side by side: ``--no-engine-process`` (the model in the worker's process,
          sharing its GIL with the HTTP server) and ``--engine-process`` (the model in a
          child process of the worker, engines/process.py). A load generator in this process
          keeps 2*B requests in flight, each a POST /v1/embeddings of one sentence, so that
          the worker forms batches of B itself. Latency is per request (queueing included);
          inputs/s counts responses completed in the window; the mean batch and the engine
          time per batch come from the deltas of ``tidegate_batch_size_*`` and
          ``tidegate_batch_duration_seconds_*`` in /metrics; the worker's CPU counts all its
          processes.

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

Noise. This machine is shared. Direct and the workers of a row run as interleaved pairs of
rounds (ABBA order; the worker side of a pair is a round of each worker, in alternating
order), each pair after a bounded wait for the CPUs to go quiet; a pair during which
other processes used more than 0.25 CPU is run again (``--retries``), and the tables show the
other processes' CPU in the kept rounds. torch runs with its default number of threads (one
per CPU) in this process and in the workers (``--torch-threads`` changes both).
Targets, for each worker: at its best batch size it reaches >= 85% of the direct best
throughput, and >= 2.5x its own batch-1 throughput.

Run (about 7 minutes on a quiet machine; ``--quick`` for a smoke run of about two minutes):
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_worker.py [--quick] [--out results.json]
    [--verdict verdict.json]
Prints markdown tables, then PASS/MISS lines (``--verdict``: also as JSON rows, for
``benchmarks/summary.py``). Always exits 0. The load client, the process handling and the
quiet-CPU rounds are ``benchmarks/loadgen.py``'s, as in every benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import functools
import itertools
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

import loadgen as lg
from direct import GenerateBatch
from loadgen import Child, StreamRound, fmt, percentile, ratio
from summary import write_verdicts

EMBED_MODEL = "minilm"
GEN_MODEL = "tiny-llama"
GEN_MAX_NUM_SEQS = 16
GEN_MAX_TOKENS = 64
TARGET_OF_DIRECT = 0.85
TARGET_OVER_BATCH1 = 2.5
R = TypeVar("R")


def prompts(count: int) -> list[str]:
    return [
        f"Request {i}: tell me a story about the sea, the ships and the harbour."
        for i in range(count)
    ]


def quiet_wait(args: argparse.Namespace) -> lg.QuietWait:
    """Before each pair of rounds: at most ``--quiet-wait-s``, none after ``--max-run-s``."""
    return lg.QuietWait(max_s=args.quiet_wait_s, deadline=args.deadline, probe_s=0.3)


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


# The worker variants of a row: the flag that picks it, and its name in the tables.
VARIANTS = {"in-process": "--no-engine-process", "engine process": "--engine-process"}


@dataclass
class WorkersRound:
    """One round of each worker variant, run one after the other."""

    rounds: dict[str, WorkerEmbed]
    other_cores: float


@dataclass
class WorkerStats:
    """One worker variant's figures in a row."""

    variant: str
    mean_batch: float
    p50_ms: float
    p95_ms: float
    inputs_per_s: float
    over_direct: float
    engine_ms_per_batch: float
    engine_busy: float  # share of the window the engine was running a batch
    cpu_cores: float  # all the worker's processes
    client_cpu_cores: float
    other_cores: float  # CPU of other processes during its rounds
    errors: int
    error_samples: list[str]


@dataclass
class EmbedRow:
    batch: int
    direct_p50_ms: float
    direct_p95_ms: float
    direct_inputs_per_s: float
    other_cores_direct: float  # CPU of other processes during the direct rounds
    workers: list[WorkerStats]

    def worker(self, variant: str) -> WorkerStats:
        return next(w for w in self.workers if w.variant == variant)


def direct_round(engine: Any, texts: list[str], batch: int, duration_s: float) -> DirectEmbed:
    out = DirectEmbed()
    offset = 0
    engine.embed_sync(texts[:batch])  # one unmeasured batch: caches warm after the worker ran
    load = lg.OtherLoad()
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
    proc: Child,
    texts: list[str],
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    encoding: str,
    client_kind: str,
) -> WorkerEmbed:
    """Keep ``concurrency`` single-input requests in flight; measure a window after warm-up."""
    out = WorkerEmbed()
    span = [math.inf, math.inf]  # the window: [start, end] in perf_counter time
    metrics: list[str] = []

    async def window(side: httpx.AsyncClient) -> None:
        await asyncio.sleep(warmup_s)
        metrics.append((await side.get(f"{proc.url}/metrics")).text)
        cpu0, client0 = worker_cpu_s(proc), time.process_time()
        load = lg.OtherLoad()
        span[0] = time.perf_counter()
        await asyncio.sleep(duration_s)
        span[1] = time.perf_counter()
        out.worker_cpu_s = worker_cpu_s(proc) - cpu0
        out.client_cpu_s = time.process_time() - client0
        out.other_cores = load.cores()
        metrics.append((await side.get(f"{proc.url}/metrics")).text)

    bodies = lg.embedding_bodies(EMBED_MODEL, texts, encoding)
    async with httpx.AsyncClient(timeout=10) as side:
        records = await lg.closed_loop(
            proc.url,
            "/v1/embeddings",
            bodies,
            concurrency,
            window(side),
            client_kind=client_kind,
            error_pause_s=0.01,
        )
    for record in records:
        if record.status == 200:
            if span[0] <= record.end < span[1]:
                out.latencies_s.append(record.latency)
                out.inputs += 1
            continue
        # Every failure counts, in the window or not: none is expected.
        out.errors += 1
        if len(out.error_samples) < 5:
            out.error_samples.append(record.error)
    out.elapsed_s = span[1] - span[0]
    before, after = metrics
    for attr, name in (
        ("batches", "tidegate_batch_size_count"),
        ("batched_inputs", "tidegate_batch_size_sum"),
        ("engine_s", "tidegate_batch_duration_seconds_sum"),
    ):
        setattr(out, attr, lg.metric_sum(after, name) - lg.metric_sum(before, name))
    return out


def worker_cpu_s(proc: Child) -> float:
    """CPU seconds of the worker and its engine process (every process of its session)."""
    return sum(lg.cpu_s(pid) for pid in lg.session_pids(proc.pid))


def workers_round(
    procs: dict[str, Child],
    texts: list[str],
    concurrency: int,
    args: argparse.Namespace,
    turns: Iterator[int],
) -> WorkersRound:
    """A round of each worker; which goes first alternates from one call to the next."""
    names = list(procs)
    if next(turns) % 2:
        names.reverse()
    rounds = {
        name: asyncio.run(
            worker_round(
                procs[name],
                texts,
                concurrency,
                args.embed_warmup_s,
                args.embed_worker_s,
                args.encoding,
                args.client,
            )
        )
        for name in names
    }
    return WorkersRound(rounds, max(r.other_cores for r in rounds.values()))


def check_worker_answers(proc: Child, encoding: str) -> None:
    body = {"model": EMBED_MODEL, "input": "a check sentence", "encoding_format": encoding}
    response = httpx.post(f"{proc.url}/v1/embeddings", json=body, timeout=30)
    response.raise_for_status()
    data = response.json()["data"]
    if len(data) != 1 or not data[0]["embedding"]:
        raise RuntimeError(f"the worker returned {len(data)} embeddings for one input")


def worker_stats(variant: str, worker: list[WorkerEmbed], direct_rate: float) -> WorkerStats:
    latencies = [x for r in worker for x in r.latencies_s]
    window_s = sum(r.elapsed_s for r in worker)
    rate = sum(r.inputs for r in worker) / window_s
    batches = sum(r.batches for r in worker)
    engine_s = sum(r.engine_s for r in worker)
    return WorkerStats(
        variant=variant,
        mean_batch=ratio(sum(r.batched_inputs for r in worker), batches),
        p50_ms=percentile(latencies, 50) * 1e3,
        p95_ms=percentile(latencies, 95) * 1e3,
        inputs_per_s=rate,
        over_direct=ratio(rate, direct_rate),
        engine_ms_per_batch=ratio(engine_s, batches) * 1e3,
        engine_busy=ratio(engine_s, window_s),
        cpu_cores=ratio(sum(r.worker_cpu_s for r in worker), window_s),
        client_cpu_cores=ratio(sum(r.client_cpu_s for r in worker), window_s),
        other_cores=max(r.other_cores for r in worker),
        errors=sum(r.errors for r in worker),
        error_samples=[x for r in worker for x in r.error_samples][:5],
    )


def embed_row(batch: int, direct: list[DirectEmbed], workers: list[WorkersRound]) -> EmbedRow:
    d_lat = [x for r in direct for x in r.batch_latencies_s]
    d_rate = sum(r.inputs for r in direct) / sum(r.elapsed_s for r in direct)
    return EmbedRow(
        batch=batch,
        direct_p50_ms=percentile(d_lat, 50) * 1e3,
        direct_p95_ms=percentile(d_lat, 95) * 1e3,
        direct_inputs_per_s=d_rate,
        other_cores_direct=max(r.other_cores for r in direct),
        workers=[
            worker_stats(variant, [w.rounds[variant] for w in workers], d_rate)
            for variant in VARIANTS
        ],
    )


def run_embeddings(args: argparse.Namespace, logdir: Path) -> list[EmbedRow]:
    from tidegate.engines.embeddings import TransformersEmbeddings

    engine = TransformersEmbeddings(EMBED_MODEL)
    engine.load()
    texts = lg.sentences(512)
    rows: list[EmbedRow] = []
    for batch in args.batch_sizes:
        size = 1
        while size <= batch:  # the worker warms every size up to its max, so do we
            engine.embed_sync(texts[:size])
            size *= 2
        worker_args = ["--model", EMBED_MODEL, "--max-batch-size", str(batch)]
        worker_args += ["--batch-window-ms", str(args.batch_window_ms)]
        with contextlib.ExitStack() as stack:
            procs: dict[str, Child] = {}
            for variant, flag in VARIANTS.items():
                name = f"minilm-{batch}-{variant.replace(' ', '-')}"
                procs[variant] = stack.enter_context(
                    lg.running(lg.start_worker(name, logdir, *worker_args, flag))
                )
                check_worker_answers(procs[variant], args.encoding)
            direct, workers = lg.measure_pairs(
                functools.partial(direct_round, engine, texts, batch, args.embed_direct_s),
                functools.partial(workers_round, procs, texts, 2 * batch, args, itertools.count()),
                rounds=args.rounds,
                retries=args.retries,
                quiet=quiet_wait(args),
            )
            for variant, proc in procs.items():
                samples = [x for w in workers for x in w.rounds[variant].error_samples]
                lg.report_errors(f"batch {batch} {variant}", samples, proc)
        row = embed_row(batch, direct, workers)
        rows.append(row)
        figures = ", ".join(
            f"{w.variant} {w.inputs_per_s:,.0f}/s (mean batch {w.mean_batch:.1f})"
            for w in row.workers
        )
        print(
            f"  batch {batch:>2}: direct {row.direct_inputs_per_s:,.0f}/s, worker {figures}",
            file=sys.stderr,
            flush=True,
        )
    engine.close()
    return rows


# --------------------------------------------------------------------------- generation
@dataclass
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


def completion_text(event: bytes) -> bool:
    """A /v1/completions stream event that carries text (the first one marks TTFT)."""
    return b'"choices":[{' in event and b'"text":""' not in event


def worker_gen_round(
    proc: Child, texts: list[str], concurrency: int, duration_s: float, args: argparse.Namespace
) -> StreamRound:
    """Waves of ``concurrency`` streaming completions sent at once (texts[i] for user i)."""
    bodies = [
        json.dumps(
            {
                "model": GEN_MODEL,
                "prompt": texts[i],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        for i in range(concurrency)
    ]
    return asyncio.run(
        lg.stream_waves(
            proc.url, "/v1/completions", bodies, duration_s, completion_text, args.client
        )
    )


def tiny_llama_direct() -> GenerateBatch:
    from tidegate.engines.tiny_llama import CONTEXT_TOKENS, ensure_tiny_llama

    return GenerateBatch(ensure_tiny_llama(), GEN_MAX_NUM_SEQS, CONTEXT_TOKENS)


def gen_row(concurrency: int, worker: list[StreamRound], batch: list[StreamRound]) -> GenRow:
    w, b = lg.pool(worker, concurrency), lg.pool(batch, concurrency)
    return GenRow(
        concurrency=concurrency, worker_waves=w.waves, batch_waves=b.waves, **lg.pair_fields(w, b)
    )


def run_generation(args: argparse.Namespace, logdir: Path) -> list[GenRow]:
    texts = prompts(max(args.concurrencies))
    batch_gen = tiny_llama_direct()
    ids = [batch_gen.encode(t) for t in texts]
    batch_gen.wave(ids[:4], args.max_tokens)  # warm the in-process path as the worker does
    rows: list[GenRow] = []
    worker_args = ["--model", GEN_MODEL, "--max-num-seqs", str(GEN_MAX_NUM_SEQS)]
    with lg.running(lg.start_worker("tiny-llama", logdir, *worker_args)) as proc:
        for concurrency in args.concurrencies:
            # One unmeasured wave each, then interleaved rounds.
            worker_gen_round(proc, texts, concurrency, 0.0, args)
            batch_gen.wave(ids[:concurrency], args.max_tokens)
            worker, batch = lg.measure_pairs(
                functools.partial(
                    worker_gen_round, proc, texts, concurrency, args.gen_round_s, args
                ),
                functools.partial(
                    batch_gen.round, ids[:concurrency], args.max_tokens, args.gen_round_s
                ),
                rounds=args.rounds,
                retries=args.retries,
                quiet=quiet_wait(args),
            )
            lg.report_errors(
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
        "| batch | direct batch latency p50 ms | direct p95 | direct inputs/s | worker "
        "| worker mean batch | worker p50 ms | worker p95 ms | worker inputs/s | worker/direct |\n"
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in rows:
        direct = (
            f"| {r.batch} | {fmt(r.direct_p50_ms)} | {fmt(r.direct_p95_ms)} "
            f"| {fmt(r.direct_inputs_per_s, 0)} "
        )
        for index, w in enumerate(r.workers):
            lines.append(
                (direct if index == 0 else "| | | | ")
                + f"| {w.variant} | {fmt(w.mean_batch, 2)} | {fmt(w.p50_ms)} | {fmt(w.p95_ms)} "
                f"| {fmt(w.inputs_per_s, 0)} | {fmt(w.over_direct * 100, 0)}% |"
            )
    return head + "\n".join(lines)


def embed_diag_table(rows: list[EmbedRow]) -> str:
    head = (
        "| batch | worker | engine ms/batch | direct p50 ms | engine busy | worker CPU (cores) "
        "| load generator CPU (cores) | other processes CPU (cores) direct, worker | errors |\n"
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r.batch} | {w.variant} | {fmt(w.engine_ms_per_batch)} | {fmt(r.direct_p50_ms)} "
        f"| {fmt(w.engine_busy * 100, 0)}% | {fmt(w.cpu_cores, 2)} "
        f"| {fmt(w.client_cpu_cores, 2)} "
        f"| {fmt(r.other_cores_direct, 2)}, {fmt(w.other_cores, 2)} | {w.errors} |"
        for r in rows
        for w in r.workers
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
    """PASS/MISS of both targets for each worker variant, the engine process first."""
    if not rows:
        return ["MISS embeddings: no results"]
    return [line for variant in reversed(VARIANTS) for line in variant_verdicts(rows, variant)]


def variant_verdicts(rows: list[EmbedRow], variant: str) -> list[str]:
    best = max(rows, key=lambda r: r.worker(variant).inputs_per_s)
    best_rate = best.worker(variant).inputs_per_s
    best_direct = max(rows, key=lambda r: r.direct_inputs_per_s)
    of_direct = ratio(best_rate, best_direct.direct_inputs_per_s)
    lines = [
        f"{'PASS' if of_direct >= TARGET_OF_DIRECT else 'MISS'} worker ({variant}) best "
        f"{best_rate:,.0f} inputs/s (batch {best.batch}) = "
        f"{of_direct * 100:.0f}% of direct best {best_direct.direct_inputs_per_s:,.0f} inputs/s "
        f"(batch {best_direct.batch}) (target >= {TARGET_OF_DIRECT * 100:.0f}%)"
    ]
    one = next((r for r in rows if r.batch == 1), None)
    if one is None:
        lines.append(
            f"MISS worker ({variant}) best / worker batch 1: batch size 1 was not measured"
        )
    else:
        one_rate = one.worker(variant).inputs_per_s
        gain = ratio(best_rate, one_rate)
        lines.append(
            f"{'PASS' if gain >= TARGET_OVER_BATCH1 else 'MISS'} worker ({variant}) best / "
            f"worker batch 1 = {gain:.2f}x ({best_rate:,.0f} / {one_rate:,.0f} inputs/s) "
            f"(target >= {TARGET_OVER_BATCH1}x)"
        )
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, shorter rounds")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--verdict", type=Path, help="write the PASS/MISS rows as JSON here")
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
    failures: list[str] = []

    def part(name: str, skip: bool, run: Callable[[argparse.Namespace, Path], list[R]]) -> list[R]:
        if skip:
            return []
        print(f"{name} ...", file=sys.stderr, flush=True)
        try:
            return run(args, logdir)
        except Exception:
            failures.append(f"{name}:\n" + traceback.format_exc())
            return []

    with lg.processes("bench_worker") as logdir:
        embed_rows = part("embeddings", args.skip_embeddings, run_embeddings)
        gen_rows = part("generation", args.skip_generation, run_generation)
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
    noise = [r.other_cores_direct for r in embed_rows]
    noise += [w.other_cores for r in embed_rows for w in r.workers]
    noise += [r.other_cores_worker for r in gen_rows] + [r.other_cores_batch for r in gen_rows]
    lg.note_noise(noise)
    for embed in embed_rows:
        for w in embed.workers:
            if w.errors:
                print(
                    f"ERRORS at batch {embed.batch} ({w.variant}): {w.errors} failed worker "
                    f"requests, e.g. {w.error_samples[0]}"
                )
    for gen in gen_rows:
        if gen.worker_errors:
            print(
                f"ERRORS at concurrency {gen.concurrency}: {gen.worker_errors} failed worker "
                f"requests, e.g. {gen.error_samples[0]}"
            )
    for failure in failures:
        print(f"\nFAILED {failure}")
    print(f"\ntotal {meta['total_s']:.0f} s")
    write_verdicts(
        args.verdict,
        "bench_worker",
        verdicts(embed_rows) if not args.skip_embeddings else [],
        failures,
    )
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
