"""Prefix-affinity routing against least loaded on the Mooncake conversation trace (simulated).

The trace's ``hash_ids`` are the prompts' 512-token prefix blocks. Each replica keeps an LRU
of blocks (``--capacity-blocks``, default 3000: llama2-70b's KV is 160 MiB per block, and
about 470 GB of 8 A100s is left after the weights: ~2900 blocks); a joining sequence's cached
leading blocks are not prefilled again, and the rest is priced by splitwise-sim's
``perf_model.csv`` (llama2-70b on A100, TP8: prefill by prompt tokens, decode by batch).
Routing: ``least_loaded`` (pick_replica as the gateway does), ``prefix`` (core.prefix's
default: the leading ``--prefix-blocks`` blocks hashed onto a ring, the preferred replica's
requests and tokens in flight bounded by ``--load-factor`` times its share) and, side by
side, ``prefix, requests bound only`` (``token_bound: false``, the rule before
2026-12-03). Two fleets: 4 replicas at 0.25x the trace's rate and 8 at 0.5x (the
prefill, the scarce part, is then busy about 55-60% of the time; the engine runs some step
nearly always, since decoding never stops at these loads).

Figures per (replicas, routing): block hit rate, TTFT p50/p95/p99, throughput, and the
replicas' busy and prefill shares (mean / max). Target per fleet: prefix's hit rate higher
and its TTFT p99 no worse than least loaded's (PASS), else MISS (the default rule's).

Run (about 15 s of CPU for the full trace; ``--quick``: the first 30 minutes, 4 replicas):
    .venv/bin/python benchmarks/bench_prefix.py [--quick] [--traces ../shared/traces]
        [--capacity-blocks 3000] [--prefix-blocks 2] [--load-factor 1.25] [--json out.json]
        [--verdict v.json]
Prints a markdown table and PASS/MISS lines; always exits 0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_sim import AZURE_CONFIG as CONFIG  # the same simulated llama2-70b fleet
from summary import write_verdicts
from tidegate.config import load_config
from tidegate.core.prefix import DEFAULT_LOAD_FACTOR, DEFAULT_NUM_BLOCKS, PrefixAffinity
from tidegate.sim.prefix_cache import PrefixCache
from tidegate.sim.report import run_summary
from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.service import load_perf_model
from tidegate.sim.traces import open_trace
from tidegate.sim.workload import Limited, Scale, Workload

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACES = ROOT.parent / "shared" / "traces"
FLEETS = ((4, 0.25), (8, 0.5))  # (replicas, rate scale of the trace)
QUICK_S = 1800.0


@dataclass
class Row:
    replicas: int
    rate_scale: float
    routing: str
    requests: int
    completed: int
    hit_rate: float
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_p99_s: float
    throughput_per_s: float
    busy_mean: float
    busy_max: float
    prefill_mean: float
    prefill_max: float


def routing_name(affinity: PrefixAffinity | None) -> str:
    if affinity is None:
        return "least_loaded"
    return "prefix" if affinity.token_bound else "prefix, requests bound only"


def run_one(
    workload: Workload,
    replicas: int,
    rate_scale: float,
    affinity: PrefixAffinity | None,
    args: argparse.Namespace,
) -> Row:
    folder = Path(tempfile.mkdtemp(prefix="bench_prefix_"))
    (folder / "llama70b.yaml").write_text(CONFIG)
    config = load_config(str(folder / "llama70b.yaml"))
    service = load_perf_model(args.traces / "profiles" / "perf_model.csv")
    scenario = Scenario(
        config,
        "llama2-70b",
        service,
        workload,
        {"shared": replicas},
        label=routing_name(affinity),
        affinity=affinity,
        prefix_blocks=args.prefix_blocks,
        prefix_cache=PrefixCache(args.capacity_blocks),
    )
    summary = run_summary(Simulation(scenario).run())
    overall = summary["overall"]
    cache = overall["prefix_cache"]
    (used,) = [c for c in summary["classes"].values() if c["requests"]]
    return Row(
        replicas,
        rate_scale,
        scenario.name,
        overall["requests"],
        overall["completed"],
        cache["hit_rate"],
        used["ttft_s"]["p50"],
        used["ttft_s"]["p95"],
        used["ttft_s"]["p99"],
        overall["throughput_per_s"],
        cache["busy_mean"],
        cache["busy_max"],
        cache["prefill_mean"],
        cache["prefill_max"],
    )


def table(rows: list[Row]) -> str:
    lines = [
        "| replicas | rate | routing | requests | hit rate | TTFT p50 s | TTFT p95 s | "
        "TTFT p99 s | req/s | busy mean/max | prefill mean/max |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.replicas} | {r.rate_scale:g}x | {r.routing} | {r.completed:,} | "
            f"{r.hit_rate * 100:.1f}% | {r.ttft_p50_s:.2f} | {r.ttft_p95_s:.2f} | "
            f"{r.ttft_p99_s:.2f} | {r.throughput_per_s:.3f} | "
            f"{r.busy_mean * 100:.0f}% / {r.busy_max * 100:.0f}% | "
            f"{r.prefill_mean * 100:.0f}% / {r.prefill_max * 100:.0f}% |"
        )
    return "\n".join(lines)


def verdicts(rows: list[Row]) -> list[str]:
    out = []
    by = {(r.replicas, r.routing): r for r in rows}
    for replicas in sorted({r.replicas for r in rows}):
        # the verdict is the default rule's (core.prefix: requests and tokens bounded)
        least, prefix = by[(replicas, "least_loaded")], by[(replicas, "prefix")]
        ok = prefix.hit_rate > least.hit_rate and prefix.ttft_p99_s <= least.ttft_p99_s
        out.append(
            f"{'PASS' if ok else 'MISS'} {replicas} replicas at {prefix.rate_scale:g}x: prefix "
            f"hit rate {prefix.hit_rate * 100:.1f}% vs least loaded {least.hit_rate * 100:.1f}%, "
            f"TTFT p50 {prefix.ttft_p50_s:.2f} vs {least.ttft_p50_s:.2f} s, "
            f"p99 {prefix.ttft_p99_s:.2f} vs {least.ttft_p99_s:.2f} s "
            "(target: higher hit rate, p99 no worse)"
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="first 30 minutes, 4 replicas")
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    parser.add_argument("--capacity-blocks", type=int, default=3000)
    parser.add_argument("--prefix-blocks", type=int, default=DEFAULT_NUM_BLOCKS)
    parser.add_argument("--load-factor", type=float, default=DEFAULT_LOAD_FACTOR)
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--verdict", type=Path, help="write the PASS/MISS rows as JSON here")
    args = parser.parse_args()
    trace = str(args.traces / "conversation_trace.jsonl")
    fleets = FLEETS[:1] if args.quick else FLEETS
    rows = []
    for replicas, rate_scale in fleets:
        workload: Workload = open_trace(trace, Scale(rate_scale))
        if args.quick:
            workload = Limited(workload, QUICK_S)
        for affinity in (
            None,
            PrefixAffinity(load_factor=args.load_factor, token_bound=False),
            PrefixAffinity(load_factor=args.load_factor),
        ):
            rows.append(run_one(workload, replicas, rate_scale, affinity, args))
            print(f"{replicas} replicas, {rows[-1].routing}: done", file=sys.stderr, flush=True)
    lines = verdicts(rows)
    print(
        f"# bench_prefix {dt.date.today()} on {platform.processor() or platform.machine()}: "
        f"capacity {args.capacity_blocks} blocks, key of {args.prefix_blocks} blocks, "
        f"load factor {args.load_factor:g}{', quick' if args.quick else ''}\n"
    )
    print(table(rows))
    print()
    for line in lines:
        print(line)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    write_verdicts(args.verdict, "bench_prefix", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
