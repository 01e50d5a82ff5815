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

Run (about 15 minutes on a quiet 2-core machine; ``--quick``: one round, shorter):
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_generation.py [--quick] [--out r.json]
Prints markdown tables, then PASS/MISS lines. Always exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench_worker import (
    NOISY_CORES,
    LoadClient,
    OtherLoad,
    WorkerProc,
    fmt,
    load_client,
    measure_pairs,
    percentile,
    ratio,
    report_errors,
    worker_process,
)

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


# --------------------------------------------------------------------------- samples
@dataclass
class Sample:
    tokens: int = 0
    busy_s: float = 0.0  # summed wave times
    ttfts_s: list[float] = field(default_factory=list)
    itls_s: list[float] = field(default_factory=list)
    waves: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    other_cores: float = 0.0


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


# --------------------------------------------------------------------------- worker side
async def stream_chat(
    client: LoadClient, user: int, chat: list[dict[str, str]], max_tokens: int
) -> tuple[float, list[float], int, str]:
    """(TTFT, gaps between text chunks, completion tokens, failure: "" if it succeeded)."""
    body = {
        "model": MODEL,
        "messages": chat,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    failure = ""
    async for item in client.events(user, "/v1/chat/completions", json.dumps(body).encode()):
        if isinstance(item, int):
            failure = "" if item == 200 else f"status {item}"
            continue
        if item == b"[DONE]":
            continue
        if b'"error"' in item:
            failure = failure or item[:300].decode(errors="replace")
            continue
        chunk = json.loads(item)
        if chunk.get("usage"):
            tokens = int(chunk["usage"]["completion_tokens"])
        for choice in chunk.get("choices", []):
            if choice.get("delta", {}).get("content"):
                arrivals.append(time.perf_counter())
    if not failure and tokens == 0:
        failure = "no usage chunk"
    ttft = arrivals[0] - t0 if arrivals else math.nan
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return ttft, gaps, tokens, failure


async def worker_round(
    proc: WorkerProc, chats: list[list[dict[str, str]]], max_tokens: int, duration_s: float
) -> Sample:
    out = Sample()
    load = OtherLoad(proc)
    client = load_client("raw", proc.url, len(chats))
    try:
        started = time.perf_counter()
        while out.waves == 0 or time.perf_counter() - started < duration_s:
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(stream_chat(client, i, chat, max_tokens) for i, chat in enumerate(chats)),
                return_exceptions=True,
            )
            out.busy_s += time.perf_counter() - t0
            out.waves += 1
            for i, result in enumerate(results):
                if isinstance(result, BaseException):
                    result = (math.nan, [], 0, f"{type(result).__name__}: {result}")
                    await client.reset(i)
                ttft, gaps, tokens, failure = result
                out.tokens += tokens
                out.itls_s += gaps
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


# --------------------------------------------------------------------------- direct side
class BatchGenerator:
    """transformers' ``generate_batch`` on the converted smollm2 folder, sized like the engine."""

    def __init__(self) -> None:
        import torch
        import transformers

        from tidegate.engines import smollm2
        from tidegate.engines.generation import cache_sizing
        from tidegate.engines.hf_runtime import quiet_transformers
        from tidegate.engines.model_folder import ensure_converted

        quiet_transformers()
        folder = ensure_converted(smollm2.gguf_path())
        hf: Any = transformers  # partly untyped
        self.hf = hf
        self.tokenizer: Any = hf.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.model: Any = hf.AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, attn_implementation="sdpa", dtype=torch.float32
        )
        self.model.eval()
        context = int(self.model.config.max_position_embeddings)
        sizing = cache_sizing(MAX_NUM_SEQS, min(context, 8192))
        self.cb_config = hf.ContinuousBatchingConfig(
            page_size=sizing.page_size,
            num_blocks=sizing.num_blocks,
            max_batch_tokens=sizing.max_batch_tokens,
            max_requests_per_batch=MAX_NUM_SEQS,
            seed=0,
        )
        self.eos = self.model.generation_config.eos_token_id

    def encode_chat(self, chat: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def wave(self, inputs: list[list[int]], max_tokens: int) -> tuple[int, float, list, list]:
        """(tokens, span from first request created to last token, TTFTs, ITLs)."""
        config = self.hf.GenerationConfig(
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=self.eos,
            pad_token_id=self.tokenizer.pad_token_id or 0,
        )
        results = self.model.generate_batch(
            inputs,
            generation_config=config,
            continuous_batching_config=self.cb_config,
            record_timestamps=True,
            progress_bar=False,
            max_new_tokens=max_tokens,
        )
        outputs = list(results.values())
        if len(outputs) != len(inputs):
            raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(inputs)} outputs")
        tokens = sum(len(o.generated_tokens) for o in outputs)
        created = min(o.created_time for o in outputs)
        last = max(o.timestamps[-1] for o in outputs if o.timestamps)
        ttfts = [o.timestamps[0] - o.created_time for o in outputs if o.timestamps]
        itls = [b - a for o in outputs for a, b in itertools.pairwise(o.timestamps)]
        return tokens, last - created, ttfts, itls

    def round(
        self, proc: WorkerProc, inputs: list[list[int]], max_tokens: int, duration_s: float
    ) -> Sample:
        out = Sample()
        load = OtherLoad(proc)
        started = time.perf_counter()
        while out.waves == 0 or time.perf_counter() - started < duration_s:
            tokens, span, ttfts, itls = self.wave(inputs, max_tokens)
            out.tokens += tokens
            out.busy_s += span
            out.ttfts_s += ttfts
            out.itls_s += itls
            out.waves += 1
        out.other_cores = load.cores()
        return out


# --------------------------------------------------------------------------- rows
def make_row(max_tokens: int, concurrency: int, worker: list[Sample], batch: list[Sample]) -> Row:
    def pct(samples: list[Sample], name: str, q: float) -> float:
        return percentile([x for s in samples for x in getattr(s, name)], q) * 1e3

    w_tok, b_tok = sum(s.tokens for s in worker), sum(s.tokens for s in batch)
    w_rate = w_tok / sum(s.busy_s for s in worker)
    b_rate = b_tok / sum(s.busy_s for s in batch)
    return Row(
        max_tokens=max_tokens,
        concurrency=concurrency,
        worker_tok_per_s=w_rate,
        batch_tok_per_s=b_rate,
        worker_over_batch=ratio(w_rate, b_rate),
        worker_ttft_p50_ms=pct(worker, "ttfts_s", 50),
        worker_ttft_p95_ms=pct(worker, "ttfts_s", 95),
        batch_ttft_p50_ms=pct(batch, "ttfts_s", 50),
        batch_ttft_p95_ms=pct(batch, "ttfts_s", 95),
        worker_itl_p50_ms=pct(worker, "itls_s", 50),
        worker_itl_p95_ms=pct(worker, "itls_s", 95),
        batch_itl_p50_ms=pct(batch, "itls_s", 50),
        batch_itl_p95_ms=pct(batch, "itls_s", 95),
        worker_tokens_per_seq=w_tok / (sum(s.waves for s in worker) * concurrency),
        batch_tokens_per_seq=b_tok / (sum(s.waves for s in batch) * concurrency),
        worker_errors=sum(s.errors for s in worker),
        error_samples=[x for s in worker for x in s.error_samples][:5],
        other_cores_worker=max(s.other_cores for s in worker),
        other_cores_batch=max(s.other_cores for s in batch),
    )


def run(args: argparse.Namespace) -> list[Row]:
    chats = messages(max(args.concurrencies))
    direct = BatchGenerator()
    ids = [direct.encode_chat(chat) for chat in chats]
    direct.wave(ids[:4], 8)  # warm the in-process path as the worker warms its own
    rows: list[Row] = []
    with worker_process("--model", MODEL, "--max-num-seqs", str(MAX_NUM_SEQS)) as proc:
        for max_tokens in args.max_tokens:
            for concurrency in args.concurrencies:
                # One unmeasured wave each, then interleaved rounds.
                asyncio.run(worker_round(proc, chats[:concurrency], max_tokens, 0.0))
                direct.wave(ids[:concurrency], max_tokens)
                worker, batch = measure_pairs(
                    proc,
                    args,
                    lambda c=concurrency, m=max_tokens: asyncio.run(
                        worker_round(proc, chats[:c], m, args.round_s)
                    ),
                    functools.partial(
                        direct.round, proc, ids[:concurrency], max_tokens, args.round_s
                    ),
                )
                report_errors(
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
    parser.add_argument("--quick", action="store_true", help="one round per row, shorter")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--concurrencies", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--quiet-wait-s", type=float, default=15.0)
    parser.add_argument("--retries", type=int, default=1, help="extra pairs per row if noisy")
    parser.add_argument("--max-run-s", type=float, default=1200.0)
    args = parser.parse_args(argv)
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
    try:
        rows = run(args)
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
    if noise and max(noise) > NOISY_CORES:
        print(
            f"NOTE: other processes used up to {max(noise):.2f} of {os.cpu_count()} CPUs during "
            "a measured round: the figures of those rows are disturbed"
        )
    for row in rows:
        if row.worker_errors:
            print(f"ERRORS at {row.max_tokens}/{row.concurrency}: {row.error_samples[0]}")
    for failure in failures:
        print(f"\nFAILED {failure}")
    print(f"\ntotal {meta['total_s']:.0f} s")
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
