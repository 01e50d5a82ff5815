"""Generation with the real chat model: smollm2 through a worker against transformers directly.

For each max_tokens M in 64, 256 and each concurrency C in 1, 4, 16, waves of C requests with
the same C chat prompts (open questions, so that answers run long), greedy:

  worker          ``tidegate worker --model smollm2 --max-num-seqs 16``; C streaming
                  /v1/chat/completions sent at once with ``stream_options.include_usage``.
                  tok/s = completion tokens (usage chunk) / wave time; TTFT = time to the
                  first chunk with text; ITL = gaps between successive chunks with text (one
                  token each, but for a token that decodes to nothing or completes a
                  character: the gap then spans two).
  generate_batch  transformers' ``model.generate_batch`` in this process on the same
                  converted folder (``model_folder.ensure_converted``), the same token ids
                  (the model's chat template), the same end-of-sequence tokens, greedy, with
                  the engine's KV cache sizing (``cache_sizing``, 16 requests per batch);
                  tok/s, TTFT and ITL from the per-token timestamps it records, from the
                  requests' creation to their last token (the manager's start and stop in
                  each call are not counted).

Both sides generate the same tokens (greedy on the same weights), so tokens/seq match and
tok/s compare like for like. Rows run as interleaved pairs of rounds (ABBA), each after a
bounded wait for the CPUs to go quiet, as in ``bench_worker.py``; the table shows the CPU
other processes used during the kept rounds.

Targets: at concurrency 16 the worker reaches >= 85% of generate_batch's tokens/s (for each
max_tokens); at concurrency 1 its TTFT p95 is within 1.5x of generate_batch's.

Run (about 15 minutes on a quiet 2-core machine; ``--quick``: one wave per round, one round,
max_tokens 64 at concurrencies 1 and 16):
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_generation.py [--quick] [--out r.json]
        [--verdict verdict.json]
Prints a markdown table and PASS/MISS lines, which ``--verdict`` also writes as JSON rows for
``make bench``. Always exits 0. Streams, waves, processes and quiet rounds: ``loadgen.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import loadgen as lg
from direct import GenerateBatch
from loadgen import StreamRound, fmt, ratio
from summary import write_verdicts

MODEL = "smollm2"
MAX_NUM_SEQS = 16
TARGET_OF_DIRECT = 0.85  # worker tok/s over generate_batch's, at concurrency 16
TARGET_TTFT_RATIO = 1.5  # worker TTFT p95 over generate_batch's, at concurrency 1

QUESTIONS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how tides work and why there are two high tides a day.",
    "Describe a walk through a busy market in the morning.",
    "Give advice to someone learning to cook for the first time.",
    "Explain how a bicycle stays upright when it moves.",
    "Write a letter to a friend about a trip to the mountains.",
    "Describe how bread is made, from flour to loaf.",
    "Explain why the sky changes colour at sunset.",
    "Write a short story about a robot who learns to paint.",
    "Describe the life cycle of a butterfly.",
    "Explain how a library organises its books.",
    "Give tips for keeping a garden healthy in summer.",
    "Write a short story about a cat that travels by train.",
    "Explain how rain forms in clouds.",
    "Describe a football match from the point of view of the ball.",
    "Explain what a computer does when it starts up.",
)


def messages(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(count)]


# --------------------------------------------------------------------------- rows
@dataclass
class Row:
    max_tokens: int
    concurrency: int
    worker_tok_per_s: float
    batch_tok_per_s: float
    worker_over_batch: float
    worker_ttft_p50_ms: float
    worker_ttft_p95_ms: float
    batch_ttft_p50_ms: float
    batch_ttft_p95_ms: float
    worker_itl_p50_ms: float
    worker_itl_p95_ms: float
    batch_itl_p50_ms: float
    batch_itl_p95_ms: float
    worker_tokens_per_seq: float
    batch_tokens_per_seq: float
    worker_errors: int
    error_samples: list[str]
    other_cores_worker: float
    other_cores_batch: float


# --------------------------------------------------------------------------- both sides
def chat_text(event: bytes) -> bool:
    """A chat stream event whose delta carries text (one token, but for a token that decodes
    to nothing or completes a character: the next gap then spans two)."""
    chunk = json.loads(event)
    return any(choice.get("delta", {}).get("content") for choice in chunk.get("choices", []))


def worker_round(
    url: str, chats: list[list[dict[str, str]]], max_tokens: int, duration_s: float
) -> StreamRound:
    """Waves of ``len(chats)`` streaming chat completions sent at once."""
    bodies = [
        json.dumps(
            {
                "model": MODEL,
                "messages": chat,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        for chat in chats
    ]
    return asyncio.run(lg.stream_waves(url, "/v1/chat/completions", bodies, duration_s, chat_text))


def smollm2_direct() -> GenerateBatch:
    """generate_batch on the converted smollm2 folder the worker loads."""
    from tidegate.engines import smollm2
    from tidegate.engines.model_folder import ensure_converted

    return GenerateBatch(ensure_converted(smollm2.gguf_path()), MAX_NUM_SEQS, None)


# --------------------------------------------------------------------------- rows
def make_row(
    max_tokens: int, concurrency: int, worker: list[StreamRound], batch: list[StreamRound]
) -> Row:
    w, b = lg.pool(worker, concurrency), lg.pool(batch, concurrency)
    return Row(
        max_tokens=max_tokens,
        concurrency=concurrency,
        batch_ttft_p95_ms=b.ms("ttfts_s", 95),
        worker_itl_p50_ms=w.ms("itls_s", 50),
        worker_itl_p95_ms=w.ms("itls_s", 95),
        batch_itl_p50_ms=b.ms("itls_s", 50),
        batch_itl_p95_ms=b.ms("itls_s", 95),
        **lg.pair_fields(w, b),
    )


def run(args: argparse.Namespace, logdir: Path) -> list[Row]:
    chats = messages(max(args.concurrencies))
    direct = smollm2_direct()
    ids = [direct.encode_chat(chat) for chat in chats]
    direct.wave(ids[:4], 8)  # warm the in-process path as the worker warms its own
    rows: list[Row] = []
    worker_args = ("--model", MODEL, "--max-num-seqs", str(MAX_NUM_SEQS))
    with lg.running(lg.start_worker("smollm2", logdir, *worker_args)) as proc:
        for max_tokens in args.max_tokens:
            for concurrency in args.concurrencies:
                # One unmeasured wave each, then interleaved rounds.
                worker_round(proc.url, chats[:concurrency], max_tokens, 0.0)
                direct.wave(ids[:concurrency], max_tokens)
                worker, batch = lg.measure_pairs(
                    functools.partial(
                        worker_round, proc.url, chats[:concurrency], max_tokens, args.round_s
                    ),
                    functools.partial(direct.round, ids[:concurrency], max_tokens, args.round_s),
                    rounds=args.rounds,
                    retries=args.retries,
                    quiet=lg.QuietWait(
                        max_s=args.quiet_wait_s, deadline=args.deadline, probe_s=0.3
                    ),
                )
                lg.report_errors(
                    f"max_tokens {max_tokens}, concurrency {concurrency}",
                    [x for s in worker for x in s.error_samples],
                    proc,
                )
                row = make_row(max_tokens, concurrency, worker, batch)
                rows.append(row)
                print(
                    f"  max_tokens {max_tokens:>3}, concurrency {concurrency:>2}: worker "
                    f"{row.worker_tok_per_s:,.1f} tok/s, generate_batch "
                    f"{row.batch_tok_per_s:,.1f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
    return rows


# --------------------------------------------------------------------------- report
def table(rows: list[Row]) -> str:
    head = (
        "| max_tokens | concurrency | worker tok/s | generate_batch tok/s | worker/direct "
        "| TTFT p50 ms worker, direct | TTFT p95 ms worker, direct "
        "| ITL p50 ms worker, direct | ITL p95 ms worker, direct | tokens/seq worker, direct "
        "| other CPU (cores) worker, direct |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r.max_tokens} | {r.concurrency} | {fmt(r.worker_tok_per_s)} "
        f"| {fmt(r.batch_tok_per_s)} | {fmt(r.worker_over_batch * 100, 0)}% "
        f"| {fmt(r.worker_ttft_p50_ms, 0)}, {fmt(r.batch_ttft_p50_ms, 0)} "
        f"| {fmt(r.worker_ttft_p95_ms, 0)}, {fmt(r.batch_ttft_p95_ms, 0)} "
        f"| {fmt(r.worker_itl_p50_ms)}, {fmt(r.batch_itl_p50_ms)} "
        f"| {fmt(r.worker_itl_p95_ms)}, {fmt(r.batch_itl_p95_ms)} "
        f"| {fmt(r.worker_tokens_per_seq)}, {fmt(r.batch_tokens_per_seq)} "
        f"| {fmt(r.other_cores_worker, 2)}, {fmt(r.other_cores_batch, 2)} |"
        for r in rows
    ]
    return head + "\n".join(lines)


def verdicts(rows: list[Row]) -> list[str]:
    lines: list[str] = []
    for row in rows:
        if row.concurrency == 16:
            ok = row.worker_over_batch >= TARGET_OF_DIRECT
            lines.append(
                f"{'PASS' if ok else 'MISS'} throughput at concurrency 16, max_tokens "
                f"{row.max_tokens}: worker {fmt(row.worker_tok_per_s)} tok/s = "
                f"{fmt(row.worker_over_batch * 100, 0)}% of generate_batch's "
                f"{fmt(row.batch_tok_per_s)} (target >= {TARGET_OF_DIRECT:.0%})"
            )
        if row.concurrency == 1:
            over = ratio(row.worker_ttft_p95_ms, row.batch_ttft_p95_ms)
            ok = over <= TARGET_TTFT_RATIO
            lines.append(
                f"{'PASS' if ok else 'MISS'} TTFT p95 at concurrency 1, max_tokens "
                f"{row.max_tokens}: worker {fmt(row.worker_ttft_p95_ms, 0)} ms = "
                f"{fmt(over, 2)}x generate_batch's {fmt(row.batch_ttft_p95_ms, 0)} ms "
                f"(target <= {TARGET_TTFT_RATIO}x)"
            )
    return lines or ["MISS generation: no results"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: one wave per round, one round per row, max_tokens 64 and "
        "concurrencies 1 and 16 (unless given)",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--verdict", type=Path, help="write the PASS/MISS rows as JSON here")
    parser.add_argument("--concurrencies", type=int, nargs="+", help="default: 1 4 16")
    parser.add_argument("--max-tokens", type=int, nargs="+", help="default: 64 256")
    parser.add_argument("--quiet-wait-s", type=float, default=15.0)
    parser.add_argument("--retries", type=int, default=1, help="extra pairs per row if noisy")
    parser.add_argument("--max-run-s", type=float, default=1200.0)
    args = parser.parse_args(argv)
    args.concurrencies = args.concurrencies or ([1, 16] if args.quick else [1, 4, 16])
    args.max_tokens = args.max_tokens or ([64] if args.quick else [64, 256])
    args.rounds = 1 if args.quick else 2
    args.round_s = 0.0 if args.quick else 5.0  # a round is at least one wave
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    started = time.monotonic()
    args.deadline = started + args.max_run_s
    meta: dict[str, Any] = {
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "quick": args.quick,
    }
    print(
        f"# bench_generation: {meta['date_utc']}, {meta['cpus']} CPUs, torch {meta['torch']} "
        f"with {meta['torch_threads']} threads (the worker: the same); model {MODEL}, greedy",
        flush=True,
    )
    rows: list[Row] = []
    failures: list[str] = []
    with lg.processes("bench_generation") as logdir:
        try:
            rows = run(args, logdir)
        except Exception:
            failures.append(traceback.format_exc())
    meta["total_s"] = round(time.monotonic() - started, 1)
    if rows:
        print(f"\n## Generation ({MODEL}, greedy, chat prompts)\n")
        print(table(rows))
    print()
    for line in verdicts(rows):
        print(line)
    noise = [r.other_cores_worker for r in rows] + [r.other_cores_batch for r in rows]
    lg.note_noise(noise)
    for row in rows:
        if row.worker_errors:
            print(f"ERRORS at {row.max_tokens}/{row.concurrency}: {row.error_samples[0]}")
    for failure in failures:
        print(f"\nFAILED {failure}")
    print(f"\ntotal {meta['total_s']:.0f} s")
    write_verdicts(args.verdict, "bench_generation", verdicts(rows), failures)
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {"meta": meta, "rows": [asdict(r) for r in rows], "verdicts": verdicts(rows)},
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
