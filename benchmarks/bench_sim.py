"""Simulator speed: simulated requests per CPU second, and the Azure trace per policy.

1. Queue + batching path. Embeddings (request-level batching) with the simulated engine's
   documented default profile (batch 32 in 36 ms: about 890 requests/s per replica), the
   embedded default config (queue 1000, holdback, aging; max batch 32, window 5 ms, 64
   slots), a 20/30/50 high/medium/low mix, Poisson arrivals generated beforehand (their
   generation is timed apart). Three loads: one replica at 70% (batches form by window),
   one at 150% (saturated: backlog, holdback refusals, full batches) and 16 replicas at
   90% (routing over many replicas). Figure: requests / CPU seconds (``time.process_time``)
   of ``Simulation.run``, best of ``--repeat``, one thread. Target: >= 200,000 requests/s.
2. The full Azure conversation trace (19,366 requests), per policy, ``simulate()`` as
   ``tidegate simulate`` calls it (reading the trace, priorities, the run, the report;
   no files written): llama2-70b on A100 TP8 from ``perf_model.csv``, 4 replicas of 32
   sequences, at 1x and 1.5x its rate. Target: well under a second per policy.
3. ``--cprofile``: the saturated scenario under cProfile: the top functions and the split
   of the time between ``tidegate/core`` and ``tidegate/sim``.

Run (about a minute on 2 cores):
    .venv/bin/python benchmarks/bench_sim.py [--requests 200000] [--repeat 3] [--cprofile]
        [--traces ../shared/traces] [--json out.json] [--quick] [--verdict v.json]
Prints markdown tables and PASS/MISS lines; always exits 0.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import json
import platform
import pstats
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from summary import write_verdicts
from tidegate.config import load_config
from tidegate.sim import SimulateOptions, simulate
from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.service import default_service
from tidegate.sim.workload import Arrival, Listed

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACES = ROOT.parent / "shared" / "traces"
TARGET_PER_S = 200_000.0
MIX = (("high", 0.2), ("medium", 0.3), ("low", 0.5))
REPLICA_CAPACITY_PER_S = 32 / 0.036  # default embeddings profile: batch 32 in 36 ms
AZURE_REPLICAS = 4
AZURE_CONFIG = """\
# llama2-70b on 8 A100s (TP8) per replica, 32 sequences at once; queue defaults.
models:
  - name: llama2-70b
    task: generate
    engine: simulated
    replicas: 4
    batching:
      max_num_seqs: 32
"""


@dataclass
class PathRow:
    scenario: str
    replicas: int
    load: float
    requests: int
    completed: int
    refused: int
    cpu_s: float
    per_s: float
    events: int


@dataclass
class AzureRow:
    policy: str
    rate_scale: float
    requests: int
    cpu_s: float
    per_s: float


def poisson(count: int, rate_per_s: float, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    names = [name for name, _ in MIX]
    weights = [share for _, share in MIX]
    at = 0.0
    arrivals = []
    for _ in range(count):
        at += rng.expovariate(rate_per_s)
        arrivals.append(Arrival(at, 14, 0, rng.choices(names, weights)[0]))
    return arrivals


def cpu_time(run: Callable[[], Any]) -> tuple[float, Any]:
    started = time.process_time()
    result = run()
    return time.process_time() - started, result


def queue_path(requests: int, repeat: int) -> list[PathRow]:
    config = load_config(None)
    service = default_service("embeddings")
    rows = []
    for label, replicas, load in (
        ("one replica, 70% load", 1, 0.7),
        ("one replica, 150% load (saturated)", 1, 1.5),
        ("16 replicas, 90% load", 16, 0.9),
    ):
        arrivals = poisson(requests, load * replicas * REPLICA_CAPACITY_PER_S, seed=1)
        scenario = Scenario(
            config, "minilm", service, Listed("poisson", arrivals), {"shared": replicas}
        )
        best = float("inf")
        result = None
        for _ in range(repeat):
            seconds, result = cpu_time(Simulation(scenario).run)
            best = min(best, seconds)
        assert result is not None
        outcomes = [stats.outcomes for stats in result.recorder.classes]
        completed = sum(o["completed"] for o in outcomes)
        row = PathRow(
            label,
            replicas,
            load,
            requests,
            completed,
            requests - completed,
            best,
            requests / best,
            result.num_events,
        )
        print(f"  {label}: {row.per_s:,.0f} requests/s ({best:.2f} s CPU)", flush=True)
        rows.append(row)
    return rows


def workload_generation(requests: int) -> float:
    seconds, _ = cpu_time(lambda: poisson(requests, 600.0, seed=1))
    return requests / seconds


def azure(traces: Path) -> tuple[list[AzureRow], float]:
    trace = traces / "AzureLLMInferenceTrace_conv.csv"
    profile = traces / "profiles" / "perf_model.csv"
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "llama70b.yaml"
        config.write_text(AZURE_CONFIG)
        from tidegate.sim.traces import open_trace

        read_s, arrivals = cpu_time(lambda: list(open_trace(str(trace))))
        for rate_scale in (1.0, 1.5):
            for policy in ("fifo", "priority"):
                options = SimulateOptions(
                    trace=str(trace),
                    config=str(config),
                    profile=str(profile),
                    replicas=AZURE_REPLICAS,
                    rate_scale=rate_scale,
                    compare=(policy,),
                    priority_mix="high=0.2,medium=0.3,low=0.5",
                )
                seconds, _ = cpu_time(lambda options=options: simulate(options))
                rows.append(
                    AzureRow(policy, rate_scale, len(arrivals), seconds, len(arrivals) / seconds)
                )
                print(f"  azure x{rate_scale:g} {policy}: {seconds:.2f} s CPU", flush=True)
    return rows, read_s


def profile_saturated(requests: int) -> str:
    config = load_config(None)
    arrivals = poisson(requests, 1.5 * REPLICA_CAPACITY_PER_S, seed=1)
    scenario = Scenario(
        config, "minilm", default_service("embeddings"), Listed("p", arrivals), {"shared": 1}
    )
    profiler = cProfile.Profile()
    profiler.enable()
    Simulation(scenario).run()
    profiler.disable()
    stats = pstats.Stats(profiler)
    split: dict[str, float] = {}
    for (path, _, _), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        key = (
            "tidegate/core" if "/core/" in path else "tidegate/sim" if "/sim/" in path else "other"
        )
        split[key] = split.get(key, 0.0) + tottime
    total = sum(split.values())
    lines = ["| where | share of CPU time |", "|---|---:|"]
    lines += [f"| {key} | {value / total:.0%} |" for key, value in sorted(split.items())]
    stats.sort_stats("tottime").print_stats(20)
    return "\n".join(lines)


def machine() -> str:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{cpu}, Python {platform.python_version()}, {platform.system()} {platform.release()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--verdict", type=Path, help="write the PASS/MISS rows as JSON here")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 20,000 requests, no repeat"
    )
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeat = 20_000, 1
    started = time.perf_counter()
    print(f"# bench_sim {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {machine()}", flush=True)
    path_rows = queue_path(args.requests, args.repeat)
    generation = workload_generation(args.requests)
    azure_rows, read_s = azure(args.traces)
    print()
    print("| scenario | replicas | requests | completed | refused | CPU s | requests/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in path_rows:
        print(
            f"| {r.scenario} | {r.replicas} | {r.requests:,} | {r.completed:,} | {r.refused:,} "
            f"| {r.cpu_s:.2f} | {r.per_s:,.0f} |"
        )
    print(f"\nWorkload generation (Poisson, in memory): {generation:,.0f} arrivals/s.\n")
    print("| Azure conversation trace | policy | requests | CPU s | requests/s |")
    print("|---|---|---:|---:|---:|")
    for a in azure_rows:
        print(
            f"| x{a.rate_scale:g} | {a.policy} | {a.requests:,} | {a.cpu_s:.2f} | {a.per_s:,.0f} |"
        )
    print(f"\nReading the trace alone: {read_s:.2f} s CPU.\n")
    if args.cprofile:
        print(profile_saturated(min(args.requests, 100_000)))
    best = max(row.per_s for row in path_rows)
    worst = min(row.per_s for row in path_rows)
    slowest = max(a.cpu_s for a in azure_rows)
    lines = [
        f"{'PASS' if worst >= TARGET_PER_S else 'MISS'} queue + batching path: "
        f"{worst:,.0f} to {best:,.0f} requests/s (target >= {TARGET_PER_S:,.0f})",
        f"{'PASS' if slowest < 1.0 else 'MISS'} Azure conversation trace: at most {slowest:.2f} "
        "s CPU per policy (target: well under 1 s)",
    ]
    print("\n".join(lines))
    write_verdicts(args.verdict, "bench_sim", lines)
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine(),
                    "path": [asdict(r) for r in path_rows],
                    "azure": [asdict(a) for a in azure_rows],
                    "workload_generation_per_s": generation,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    sys.exit(main())
