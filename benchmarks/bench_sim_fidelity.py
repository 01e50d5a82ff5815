"""Fidelity: the simulator against the real ``tidegate serve`` on the same arrivals.

For each load (a fraction of the capacity the profile predicts: by default 0.8 and 1.5) and
each policy (fifo, priority), one open-loop schedule is replayed twice:

- real: ``tidegate serve`` on 127.0.0.1 with one ``minilm`` replica (``--engine
  transformers``, the real model; ``--engine simulated``: the simulated engine replaying
  a profile, cheap, to develop and check this benchmark: ``--engine-profile`` is what the
  engine replays, ``--profile`` what ``tidegate profile`` measured of it), default queue
  and batching (max batch 32, window 5 ms, 64 slots), ``policy`` as in the run. Each request is one
  sentence (12-16 tokens) to ``/v1/embeddings`` with ``X-Priority``; latency runs from its
  scheduled arrival to the answer (bench_gateway's load generator);
- simulated: ``tidegate.sim`` with the same config file (``load_config``), the profile as
  its service model and the identical arrivals; the round trip the simulator does not model
  (HTTP, JSON, the proxy) is measured once per server, before the load (median of 30
  requests one at a time, minus what the simulator predicts for a lone request), and added
  as ``network_s``. That figure is printed: it is a measurement, not a fitted parameter.

Arrivals: the Azure conversation trace's arrival times (its burstiness), scaled to the
target rate and repeated end to end as needed, cut at ``--duration-s``; priorities drawn
20/30/50 high/medium/low (seeded). Reported per load, policy and class: p50 and p95 of
completed requests, real and simulated, their error (simulated - real) / real, and the
refusals (429) of each. Ranking: for each load, whether priority beats fifo on high-priority
p95 in the simulation exactly when it does on the real server.

``--profile`` (default ``benchmarks/profiles/minilm-cpu/profile.json``, written by
``tidegate profile`` on this machine) is required: without it the benchmark says so and
exits 1. Run (about 2 minutes per load and policy, plus start-ups):
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_sim_fidelity.py
        [--profile PATH] [--engine transformers|simulated] [--loads 0.8,1.5]
        [--duration-s 60] [--policies fifo,priority] [--seed 0] [--json out.json]
        [--quick] [--verdict verdict.json]
Every process it starts is stopped at the end; logs are kept only when a run fails.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

import bench_gateway as bg
import loadgen as lg
from summary import write_verdicts
from tidegate.config import load_config
from tidegate.engines.profile import EngineProfile, load_profile
from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.service import load_service
from tidegate.sim.traces import open_trace
from tidegate.sim.workload import Arrival, Listed, Scale

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROFILE = ROOT / "benchmarks" / "profiles" / "minilm-cpu" / "profile.json"
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"
MODEL = "minilm"
MAX_BATCH = 32
WINDOW_MS = 5.0
PROMPT_TOKENS = 14  # the load generator's sentences: 12 to 16 tokens
MIX = (("high", 0.2), ("medium", 0.3), ("low", 0.5))
PROBES = 30
TARGET_ERROR = 0.15


@dataclass
class Batches:
    """Batches of one run: how many, their mean size and mean engine time."""

    count: float
    mean_size: float
    mean_ms: float


@dataclass
class ClassResult:
    load: float
    policy: str
    cls: str
    sent: int
    real_completed: int
    sim_completed: int
    real_429: int
    sim_refused: int
    real_p50_ms: float
    sim_p50_ms: float
    real_p95_ms: float
    sim_p95_ms: float

    @property
    def p50_error(self) -> float:
        return lg.ratio(self.sim_p50_ms - self.real_p50_ms, self.real_p50_ms)

    @property
    def p95_error(self) -> float:
        return lg.ratio(self.sim_p95_ms - self.real_p95_ms, self.real_p95_ms)


def capacity_per_s(profile: EngineProfile) -> float:
    """Inputs per second the profile predicts at best, with batches up to MAX_BATCH."""
    curve = profile.batch_latency_ms
    assert curve is not None
    return max(n / (curve(n) / 1e3) for n in range(1, MAX_BATCH + 1) if curve(n) > 0)


def arrivals_for(trace: Path, rate_per_s: float, duration_s: float, seed: int) -> list[Arrival]:
    """The trace's arrival pattern at ``rate_per_s``, repeated as needed, with priorities."""
    base = list(open_trace(str(trace)))
    span_s = base[-1].arrival_s
    scale = Scale(rate_scale=rate_per_s / (len(base) / span_s))
    one = [a.arrival_s for a in open_trace(str(trace), scale)]
    period_s = one[-1] + 1.0 / rate_per_s
    draw = random.Random(f"{seed}:fidelity")
    names = [name for name, _ in MIX]
    shares = [share for _, share in MIX]
    arrivals: list[Arrival] = []
    offset = 0.0
    while offset < duration_s:
        for at in one:
            if offset + at >= duration_s:
                break
            cls = draw.choices(names, shares)[0]
            arrivals.append(Arrival(offset + at, PROMPT_TOKENS, 0, cls))
        offset += period_s
    return arrivals


def serve_config(policy: str, engine: str, profile: Path) -> dict[str, Any]:
    model: dict[str, Any] = {
        "name": MODEL,
        "task": "embeddings",
        "engine": engine,
        "replicas": 1,
        "batching": {"max_batch_size": MAX_BATCH, "batch_window_ms": WINDOW_MS},
    }
    if engine == "simulated":
        model["profile"] = str(profile)
    return {
        "gateway": {"host": "127.0.0.1", "policy": policy, "shutdown_timeout_s": 5},
        "models": [model],
    }


def probe_s(url: str) -> float:
    """Median latency of PROBES lone requests, one at a time (after a few to warm up)."""
    body = bg.bodies(MODEL)
    latencies = []
    with httpx.Client(timeout=30) as client:
        for i in range(PROBES + 5):
            started = time.perf_counter()
            response = client.post(
                f"{url}/v1/embeddings",
                content=body[i % len(body)],
                headers={"content-type": "application/json", "x-priority": "high"},
            )
            response.raise_for_status()
            if i >= 5:
                latencies.append(time.perf_counter() - started)
    return statistics.median(latencies)


def worker_batches(gateway_url: str) -> tuple[float, float, float]:
    """(batches, inputs, engine seconds) so far, from the worker's /metrics."""
    replicas = httpx.get(f"{gateway_url}/admin/replicas", timeout=10).json()
    url = replicas[MODEL]["replicas"][0]["url"]
    totals = {"count": 0.0, "sizes": 0.0, "seconds": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("tidegate_batch_size_sum"):
            totals["sizes"] = float(value)
        elif name.startswith("tidegate_batch_duration_seconds_sum"):
            totals["seconds"] = float(value)
        elif name.startswith("tidegate_batch_duration_seconds_count"):
            totals["count"] = float(value)
    return totals["count"], totals["sizes"], totals["seconds"]


def batches_between(
    before: tuple[float, float, float], after: tuple[float, float, float]
) -> Batches:
    count, sizes, seconds = (b - a for a, b in zip(before, after, strict=True))
    return Batches(count, sizes / count if count else 0.0, seconds / count * 1e3 if count else 0.0)


def simulate(
    config: Path, policy: str, profile: Path, arrivals: list[Arrival], network_s: float
) -> tuple[dict[str, tuple[list[float], int]], Batches]:
    """Per class: latencies of completed requests (exact), and how many were refused."""
    scenario = Scenario(
        load_config(config, {"policy": policy}),
        MODEL,
        load_service(str(profile)),
        Listed("fidelity", arrivals),
        {"shared": 1},
        network_s=network_s,
        keep_requests=True,
    )
    result = Simulation(scenario).run()
    assert result.recorder.requests is not None
    out: dict[str, tuple[list[float], int]] = {}
    for name, _ in MIX:
        mine = [r for r in result.recorder.requests if r.klass == name]
        done = [r.e2e_s for r in mine if r.outcome == "completed" and r.e2e_s is not None]
        refused = sum(r.outcome not in ("completed", "expired", "failed") for r in mine)
        out[name] = (done, refused)
    sizes = result.recorder.batch_sizes
    count = sum(sizes.values())
    service = scenario.service.batch
    assert service is not None
    engine_s = sum(service.batch_s(size, 0) * n for size, n in sizes.items())
    mean_size = sum(size * n for size, n in sizes.items()) / count if count else 0.0
    return out, Batches(count, mean_size, engine_s / count * 1e3 if count else 0.0)


def lone_request_s(config: Path, profile: Path) -> float:
    """What the simulator predicts for one request on an idle replica."""
    lone, _ = simulate(config, "priority", profile, [Arrival(0.0, PROMPT_TOKENS, 0, "high")], 0.0)
    return lone["high"][0][0]


def one_pair(
    load: float, policy: str, arrivals: list[Arrival], args: argparse.Namespace, logdir: Path
) -> tuple[list[ClassResult], dict[str, Any]]:
    config = logdir / f"{policy}.yaml"
    engine_profile = args.engine_profile or args.profile
    config.write_text(json.dumps(serve_config(policy, args.engine, engine_profile)))  # YAML 1.2
    child = lg.start_serve(f"serve-{policy}-{load:g}", logdir, config, MODEL)
    try:
        network_s = max(0.0, probe_s(child.url) - lone_request_s(config, args.profile))
        schedule_pairs = [(a.arrival_s, a.priority or "low") for a in arrivals]
        before = worker_batches(child.url)
        sent = bg.send_schedule(child.url, schedule_pairs, args.drain_s, "raw", {}).records
        real_batches = batches_between(before, worker_batches(child.url))
    finally:
        lg.stop(child)
    simulated, sim_batches = simulate(config, policy, args.profile, arrivals, network_s)
    rows = []
    for name, _ in MIX:
        real = [s for s in sent if s.tag == name]
        ok = [s.latency for s in real if s.status == 200]
        sim_done, sim_refused = simulated[name]
        rows.append(
            ClassResult(
                load,
                policy,
                name,
                len(real),
                len(ok),
                len(sim_done),
                sum(s.status == 429 for s in real),
                sim_refused,
                lg.percentile(ok, 50) * 1e3,
                lg.percentile(sim_done, 50) * 1e3,
                lg.percentile(ok, 95) * 1e3,
                lg.percentile(sim_done, 95) * 1e3,
            )
        )
    service = load_service(str(args.profile)).batch
    assert service is not None
    notes = {
        "network_ms": network_s * 1e3,
        "real_batches": asdict(real_batches),
        "sim_batches": asdict(sim_batches),
        # What the profile says a batch of the real mean size takes: against the real mean
        # engine time, how far the profile is from the engine under this load.
        "profile_ms_at_real_mean_size": service.batch_s(round(real_batches.mean_size), 0) * 1e3,
    }
    return rows, notes


def table(rows: list[ClassResult]) -> str:
    lines = [
        "| load | policy | class | sent | completed real / sim | 429 real / refused sim "
        "| p50 ms real / sim | p50 error | p95 ms real / sim | p95 error |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.load:.0%} | {r.policy} | {r.cls} | {r.sent:,} "
            f"| {r.real_completed:,} / {r.sim_completed:,} | {r.real_429:,} / {r.sim_refused:,} "
            f"| {lg.ms(r.real_p50_ms)} / {lg.ms(r.sim_p50_ms)} | {r.p50_error:+.1%} "
            f"| {lg.ms(r.real_p95_ms)} / {lg.ms(r.sim_p95_ms)} | {r.p95_error:+.1%} |"
        )
    return "\n".join(lines)


def diagnostics(notes: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| run | round trip added, ms | batches real / sim | mean batch real / sim "
        "| engine ms per batch: real / profile at that size / sim |",
        "|---|---:|---:|---:|---:|",
    ]
    for run, n in notes.items():
        real, sim = n["real_batches"], n["sim_batches"]
        lines.append(
            f"| {run} | {n['network_ms']:.1f} | {real['count']:,.0f} / {sim['count']:,.0f} "
            f"| {real['mean_size']:.1f} / {sim['mean_size']:.1f} "
            f"| {real['mean_ms']:.1f} / {n['profile_ms_at_real_mean_size']:.1f} "
            f"/ {sim['mean_ms']:.1f} |"
        )
    return "\n".join(lines)


def rankings(rows: list[ClassResult]) -> list[str]:
    lines = []
    for load in sorted({r.load for r in rows}):
        high = {r.policy: r for r in rows if r.load == load and r.cls == "high"}
        if not {"fifo", "priority"} <= set(high):
            continue
        real = high["priority"].real_p95_ms < high["fifo"].real_p95_ms
        sim = high["priority"].sim_p95_ms < high["fifo"].sim_p95_ms
        lines.append(
            f"{'PASS' if real == sim else 'MISS'} ranking at {load:.0%}: high p95 priority "
            f"{'<' if real else '>='} fifo on the server, {'<' if sim else '>='} in the simulator"
        )
    return lines


def verdicts(rows: list[ClassResult]) -> list[str]:
    errors = [abs(e) for r in rows for e in (r.p50_error, r.p95_error) if e == e]
    worst = max(errors, default=float("nan"))
    within = sum(e <= TARGET_ERROR for e in errors)
    return [
        f"{'PASS' if worst <= TARGET_ERROR else 'MISS'} p50/p95 error: {within} of {len(errors)} "
        f"within {TARGET_ERROR:.0%}, worst {worst:.1%}",
        *rankings(rows),
    ]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    parser.add_argument("--engine", choices=("transformers", "simulated"), default="transformers")
    parser.add_argument(
        "--engine-profile",
        type=Path,
        help="with --engine simulated: the profile the engine replays (default --profile); "
        "give the one `tidegate profile` was run on, and --profile what it measured",
    )
    parser.add_argument("--loads", default="0.8,1.5")
    parser.add_argument("--policies", default="fifo,priority")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--drain-s", type=float, default=30.0)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--verdict", type=Path, help="write the PASS/MISS rows as JSON here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: load 0.8 only, 10 s of arrivals, 10 s of drain",
    )
    args = parser.parse_args()
    if args.quick:
        args.loads, args.duration_s, args.drain_s = "0.8", 10.0, 10.0
    return args


def main() -> int:
    args = parse_args()
    if not args.profile.is_file():
        print(
            f"no profile at {args.profile}: measure minilm on this machine first, e.g.\n"
            f"  HF_HUB_OFFLINE=1 .venv/bin/tidegate profile --model minilm "
            f"--out {args.profile.parent}\nor pass --profile PATH",
            file=sys.stderr,
        )
        return 1
    profile = load_profile(args.profile)
    if profile.task != "embeddings":
        print(
            f"{args.profile} is a {profile.task} profile; minilm needs embeddings", file=sys.stderr
        )
        return 1
    capacity = capacity_per_s(profile)
    started = time.monotonic()
    print(
        f"bench_sim_fidelity: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M UTC}, {os.cpu_count()} "
        f"CPUs, {lg.cpu_model()}, Python {platform.python_version()}, engine {args.engine}, "
        f"profile {args.profile.name} (capacity {capacity:,.0f} inputs/s)",
        flush=True,
    )
    rows: list[ClassResult] = []
    notes: dict[str, dict[str, Any]] = {}
    failure = ""
    try:
        with lg.processes("bench_sim_fidelity") as logdir:  # SIGTERM too: every child stopped
            for load in (float(x) for x in args.loads.split(",")):
                arrivals = arrivals_for(args.trace, load * capacity, args.duration_s, args.seed)
                for policy in args.policies.split(","):
                    print(f"  load {load:.0%} ({len(arrivals):,} requests), {policy}", flush=True)
                    key = f"{load:.0%} {policy}"
                    pair, notes[key] = one_pair(load, policy, arrivals, args, logdir)
                    rows += pair
    except BaseException:
        failure = traceback.format_exc()
        traceback.print_exc()
    write_verdicts(
        args.verdict,
        "bench_sim_fidelity",
        verdicts(rows) if rows else [],
        [failure] if failure else [],
    )
    if not rows:
        return 1
    print()
    print(table(rows))
    print()
    print(diagnostics(notes))
    print("```")
    for line in verdicts(rows):
        print(line)
    print("```")
    print(f"total run time: {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "engine": args.engine,
                    "profile": str(args.profile),
                    "capacity_per_s": capacity,
                    "runs": notes,
                    "rows": [
                        {**asdict(r), "p50_error": r.p50_error, "p95_error": r.p95_error}
                        for r in rows
                    ],
                    "verdicts": verdicts(rows),
                },
                indent=2,
            )
        )
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
