"""Engine threads: the real MiniLM engine with torch's default threads against fewer, with
and without a competing process on the same cores.

Why (docs/engines.md, "Engine threads"): by default torch runs each operator on every core
of the host. Inside ``tidegate serve`` the gateway, the workers' HTTP and the clients need
CPU too; an operator split over every core then waits for its slowest thread whenever one
core is taken, and a batch's time swings by several times with what else runs. That swing
is what the simulator cannot know from a profile (docs/benchmarks.md, "Fidelity").

For each thread count (``--threads``, default ``1`` and every core) one child process loads
the engine (``TransformersEmbeddings`` with ``threads``, as a worker with
``engine_threads`` does), then times ``--repeats`` batches of each size, first alone, then
with a competitor: one process spinning on the CPU (pure Python, what a busy gateway looks
like to the scheduler), started after the warm-up and stopped before the next count. Both
children run at the caller's niceness. Reported per count, size and condition: median and
p90 ms per batch, and the ratio with the competitor to without (the swing).

Target (what docs/engines.md claims for ``engine_threads``): an engine given fewer threads
than the cores (1 here) keeps its median batch time with the competitor within 1.25x of
alone at every size; the default's swing is printed beside it.

Run (about 2 minutes):
    HF_HUB_OFFLINE=1 flock /tmp/bench.lock .venv/bin/python benchmarks/bench_engine_threads.py
        [--threads 1,0 (0: every core)] [--sizes 1,8,32] [--repeats 30] [--json out.json]
        [--quick (10 repeats)] [--verdict v.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import loadgen as lg
from summary import print_verdicts, write_verdicts

TEXT = "the quick brown fox number {} jumps over the lazy dog again today"


def spin() -> None:  # the competitor: a process that wants a whole core
    while True:
        pass


def child(threads: int, sizes: list[int], repeats: int) -> None:
    """In a fresh process: load, warm up, time alone, then with the competitor."""
    from tidegate.engines.embeddings import TransformersEmbeddings

    engine = TransformersEmbeddings("minilm", threads=threads or None)
    engine.load()
    import torch

    texts = [TEXT.format(i) for i in range(max(sizes))]
    out: dict[str, object] = {"threads": torch.get_num_threads(), "rows": []}
    rows: list[dict[str, object]] = []
    for condition in ("alone", "with a competitor"):
        competitor = None
        if condition != "alone":
            competitor = multiprocessing.get_context("spawn").Process(target=spin, daemon=True)
            competitor.start()
        try:
            for size in sizes:
                engine.embed_sync(texts[:size])  # warm this shape
                times = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    engine.embed_sync(texts[:size])
                    times.append((time.perf_counter() - started) * 1e3)
                times.sort()
                rows.append(
                    {
                        "condition": condition,
                        "size": size,
                        "median_ms": statistics.median(times),
                        "p90_ms": times[int(0.9 * (len(times) - 1))],
                    }
                )
        finally:
            if competitor is not None:
                competitor.kill()
                competitor.join()
    out["rows"] = rows
    print(json.dumps(out), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--threads", default="1,0", help="thread counts; 0: every core")
    parser.add_argument("--sizes", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--verdict", type=Path, help="write the PASS/MISS rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="10 repeats per size")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.quick:
        args.repeats = 10
    if args.child is not None:
        child(args.child, sizes, args.repeats)
        return 0
    print(
        f"bench_engine_threads: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M UTC}, "
        f"{os.cpu_count()} CPUs, {lg.cpu_model()}, Python {platform.python_version()}",
        flush=True,
    )
    results = []
    for threads in (int(x) for x in args.threads.split(",")):
        command = [sys.executable, __file__, "--child", str(threads), "--sizes", args.sizes]
        command += ["--repeats", str(args.repeats)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            write_verdicts(args.verdict, "bench_engine_threads", [], [done.stderr[-3000:]])
            return 1
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print()
    print(
        "| threads | batch | alone: median / p90 ms | with a competitor: median / p90 ms "
        "| swing (median, p90) |"
    )
    print("|---:|---:|---:|---:|---:|")
    for result in results:
        by = {(r["condition"], r["size"]): r for r in result["rows"]}
        for size in sizes:
            a, b = by[("alone", size)], by[("with a competitor", size)]
            print(
                f"| {result['threads']} | {size} | {a['median_ms']:.1f} / {a['p90_ms']:.1f} "
                f"| {b['median_ms']:.1f} / {b['p90_ms']:.1f} "
                f"| {b['median_ms'] / a['median_ms']:.2f}x, {b['p90_ms'] / a['p90_ms']:.2f}x |"
            )
    print()
    lines = verdicts(results, sizes, os.cpu_count() or 1)
    print_verdicts(args.verdict, "bench_engine_threads", lines)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def verdicts(results: list[dict], sizes: list[int], cpus: int) -> list[str]:
    """The target on each count below the cores; the others' swing, for comparison."""
    lines = []
    for result in results:
        by = {(r["condition"], r["size"]): r for r in result["rows"]}
        swings = [
            by[("with a competitor", n)]["median_ms"] / by[("alone", n)]["median_ms"] for n in sizes
        ]
        worst = max(swings)
        text = (
            f"{result['threads']} engine thread(s) of {cpus} cores, one competing process: "
            f"median batch time {worst:.2f}x alone at worst (sizes {','.join(map(str, sizes))})"
        )
        if result["threads"] < cpus:
            verdict = "PASS" if worst <= 1.25 else "MISS"
            lines.append(f"{verdict} {text} (target <= 1.25x)")
        else:
            print(f"for comparison, the default: {text}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
