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
   With a compiled build (``make compiled``, tidegate.native) both run twice, side by side:
   compiled here and interpreted in a child process (``TIDEGATE_PURE_PYTHON=1``), with the
   ratio; the verdicts are the compiled figures. Without one, the interpreted figures only.
3. ``--cprofile``: the saturated scenario under cProfile: the top functions and the split
   of the time between ``tidegate/core`` and ``tidegate/sim``.
4. Fleet level (``sim.fluid``, ``examples/fleets/servegen.yaml``): (a) the 14 days of the
   ServeGen aggregate for its 5 models at once on 10,000 GPUs (1,250 nodes of 8), tidegate
   autoscaling each: wall time (target <= 600 s), GPU-hours, SLO attainment per level, peak
   GPUs, placement refusals; (b) slices of single models (``SLICES``: one hour each of
   m-large 18:00, its evening ramp, deepseek-r1 21:00, before its 22h peak, and mm-image
   16:00, 2,000-token prompts; 15 minutes of m-small at 02:00, its night trough) through the
   fleet mode and the request-level simulator with the same config, service model, lengths,
   priorities, controller, lifecycle and starting replicas (enough for the slice's first
   window at the autoscaler's target): GPU-hours over the slice and attainment per level of
   each, and their relative differences (target: every one within 5%). The request-level run
   is timed too.

Run (about a minute on 2 cores for 1-3; about 10 minutes for 4, 4.5 of them the
request-level m-large hour):
    .venv/bin/python benchmarks/bench_sim.py [--requests 200000] [--repeat 3] [--cprofile]
        [--traces ../shared/traces] [--json out.json] [--quick] [--verdict v.json]
        [--skip-fleet | --fleet-only] [--fleet examples/fleets/servegen.yaml] [--fleet-days N]
Prints markdown tables and PASS/MISS lines; always exits 0.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime as dt
import json
import math
import os
import platform
import pstats
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from summary import write_verdicts
from tidegate import native
from tidegate.config import load_config
from tidegate.sim import SimulateOptions, simulate
from tidegate.sim.fleetfile import DAY_S, fleet_markdown, load_fleet
from tidegate.sim.fluid import EngineCurve, FleetScenario, FleetSimulation
from tidegate.sim.report import run_summary
from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.service import default_service
from tidegate.sim.synthetic import RateWorkload, Segment
from tidegate.sim.workload import NO_SCALE, Arrival, Listed, Prioritized

ROOT = Path(__file__).resolve().parent.parent
FLEET_FILE = ROOT / "examples" / "fleets" / "servegen.yaml"
FLEET_TARGET_S = 600.0
FLEET_AGREEMENT = 0.05
# (model, start, length): m-large's evening ramp, deepseek-r1 before its 22h peak (80 s
# sequences), mm-image's afternoon (2,000-token prompts: the engine part of the TTFT decides
# high's attainment), and a quarter of an hour of m-small at its night trough (~480
# requests/s on ~200 TP2 replicas: an hour would take the request-level simulator ~8 minutes)
SLICES = (
    ("m-large", 18 * 3600.0, 3600.0),
    ("deepseek-r1", 21 * 3600.0, 3600.0),
    ("mm-image", 16 * 3600.0, 3600.0),
    ("m-small", 2 * 3600.0, 900.0),
)
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


def fleet_replay(path: Path, days: float) -> dict[str, Any]:
    """The fleet file's whole span (or ``days`` of it) in the fleet-level mode, timed."""
    scenario = load_fleet(path)
    scenario = dataclasses.replace(scenario, end_s=days * DAY_S)
    started = time.perf_counter()
    cpu_started = time.process_time()
    result = FleetSimulation(scenario).run()
    wall_s = time.perf_counter() - started
    report: dict[str, Any] = result.report()
    report["wall_s"] = wall_s
    report["cpu_s"] = time.process_time() - cpu_started
    report["days"] = days
    print(f"  fleet {days:g} days: {wall_s:.0f} s wall", flush=True)
    return report


def _window(rates: list[Segment], start: float, end: float) -> list[Segment]:
    cut = []
    for s in rates:
        low, high = max(s.start_s, start), min(s.end_s, end)
        if high > low:
            cut.append(Segment(low - start, high - start, s.arrivals_per_s))
    return cut


def fleet_slice(path: Path, model: str, start_s: float, length_s: float) -> dict[str, Any]:
    """``length_s`` of one model from ``start_s`` through both simulators, same inputs."""
    base = load_fleet(path)
    group = next(g for g in base.groups if g.model == model)
    spec = base.config.model(model)
    autoscaling = spec.autoscaling
    assert autoscaling is not None
    rates = _window(list(group.rates), start_s, start_s + length_s)
    slots = spec.slots if spec.slots is not None else spec.batching.max_num_seqs
    engine = EngineCurve(group.service, group.lengths, slots, base.seed)
    target = min(slots, round(autoscaling.target_per_replica))
    replicas = max(1, math.ceil(rates[0].arrivals_per_s / engine.mu[target]))
    start_wall_s = base.start_wall_s + start_s
    fluid = FleetScenario(
        base.config,
        [dataclasses.replace(group, rates=rates, replicas=replicas)],
        inventory=base.inventory,
        controller=base.controller,
        lifecycle=base.lifecycle,
        mix=base.mix,
        slo_ttft_s=base.slo_ttft_s,
        step_s=base.step_s,
        start_wall_s=start_wall_s,
        end_s=length_s,
        seed=base.seed,
    )
    started = time.perf_counter()
    fluid_result = FleetSimulation(fluid).run()
    fluid_s = time.perf_counter() - started
    workload = Prioritized(
        RateWorkload(model, [(model, rates)], group.lengths, NO_SCALE, base.seed),
        base.config.default_priority,
        base.mix,
        (),
        base.seed,
    )
    request = Scenario(
        base.config,
        model,
        group.service,
        workload,
        {spec.pools[-1]: replicas},
        controller=base.controller,
        lifecycle=base.lifecycle,
        slo_ttft_s=base.slo_ttft_s,
        start_wall_s=start_wall_s,
    )
    started = time.perf_counter()
    simulation = Simulation(request)
    request_result = simulation.run()
    request_s = time.perf_counter() - started
    # the same window as the fleet mode's: the request-level run goes on until its last
    # request ends (long outputs: minutes), with the replicas still held
    replicas_seen = (*simulation.fleet.live.values(), *simulation.fleet.stopped)
    held_s = sum(
        max(0.0, min(length_s, math.inf if r.stopped_at is None else r.stopped_at) - r.started_at)
        for r in replicas_seen
    )
    summary = run_summary(request_result)
    gpus = group.gpus or group.service.gpus_per_replica
    fluid_levels = fluid_result.attainment()
    request_levels = {name: klass["slo_attainment"] for name, klass in summary["classes"].items()}
    row = {
        "model": model,
        "start_h": start_s / 3600.0,
        "length_s": length_s,
        "rates_per_s": [s.arrivals_per_s for s in rates],
        "replicas_at_start": replicas,
        "fluid_gpu_hours": fluid_result.gpu_hours,
        "request_gpu_hours": held_s * gpus / 3600.0,
        "request_gpu_hours_to_last_request": request_result.replica_seconds * gpus / 3600.0,
        "fluid_attainment": fluid_levels,
        "request_attainment": request_levels,
        "requests": request_result.num_requests,
        "request_end_s": request_result.end_at,
        "fluid_wall_s": fluid_s,
        "request_wall_s": request_s,
        "fluid_peak_replicas": fluid_result.report()["groups"][model]["peak_replicas"],
        "request_peak_ready": max(s[3] for s in request_result.recorder.samples),
    }
    print(
        f"  slice {_label(row)}: fluid {row['fluid_gpu_hours']:.1f} GPU-h "
        f"({fluid_s:.1f} s), request-level {row['request_gpu_hours']:.1f} GPU-h "
        f"({request_s:.0f} s, {row['requests']:,} requests)",
        flush=True,
    )
    return row


def _label(row: dict[str, Any]) -> str:
    length = "" if row["length_s"] == 3600.0 else f" ({row['length_s'] / 60:g} min)"
    return f"{row['model']} {row['start_h']:g}:00{length}"


def _relative(fluid: float | None, request: float | None) -> float | None:
    if fluid is None or request is None or request == 0:
        return None
    return (fluid - request) / request


def fleet_lines(replay: dict[str, Any], slices: list[dict[str, Any]]) -> list[str]:
    """The fleet part's tables (printed) and PASS/MISS lines (returned)."""
    print(fleet_markdown(replay))
    print(
        f"Wall time {replay['wall_s']:.0f} s ({replay['cpu_s']:.0f} s CPU) for "
        f"{replay['days']:g} days, {replay['steps']:,} steps of {replay['step_s']:g} s.\n"
    )
    print(
        "| slice | requests | replicas at start | GPU-hours fluid | GPU-hours request-level | "
        "diff | level | attainment fluid | attainment request-level | diff |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    worst = 0.0
    each = []
    for row in slices:
        gpu_diff = _relative(row["fluid_gpu_hours"], row["request_gpu_hours"])
        largest = abs(gpu_diff or 0.0)
        for index, level in enumerate(row["request_attainment"]):
            fluid = row["fluid_attainment"].get(level)
            request = row["request_attainment"][level]
            diff = _relative(fluid, request)
            largest = max(largest, abs(diff or 0.0))
            head = (
                f"| {_label(row)} | {row['requests']:,} | "
                f"{row['replicas_at_start']} | {row['fluid_gpu_hours']:.1f} | "
                f"{row['request_gpu_hours']:.1f} | {_pct(gpu_diff)} "
                if index == 0
                else "| | | | | | "
            )
            print(
                f"{head}| {level} | {_pct(fluid, signed=False)} | "
                f"{_pct(request, signed=False)} | {_pct(diff)} |"
            )
        worst = max(worst, largest)
        each.append(f"{_label(row)} {largest * 100:.1f}%")
    print()
    minutes = replay["wall_s"]
    return [
        f"{'PASS' if minutes <= FLEET_TARGET_S else 'MISS'} fleet level: {replay['days']:g} days "
        f"of {len(replay['groups'])} models on {replay['inventory']['gpus']:,} GPUs in "
        f"{minutes:.0f} s (target <= {FLEET_TARGET_S:.0f} s)",
        f"{'PASS' if worst <= FLEET_AGREEMENT else 'MISS'} fleet level vs request level on "
        f"{len(slices)} slices: GPU-hours and attainment per level within "
        f"{worst * 100:.1f}% ({', '.join(each)}; target <= {FLEET_AGREEMENT * 100:.0f}% on each)",
    ]


def _pct(value: float | None, signed: bool = True) -> str:
    if value is None:
        return "n/a"
    return f"{value * 100:+.2f}%" if signed else f"{value * 100:.2f}%"


def machine() -> str:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{cpu}, Python {platform.python_version()}, {platform.system()} {platform.release()}"


def build() -> str:
    """Which build of tidegate this process runs."""
    modules = native.compiled_modules()
    if not modules or os.environ.get(native.PURE_ENV, "") not in ("", "0"):
        return "interpreted"
    return f"compiled (mypyc: {len(modules)} modules)"


def interpreted_figures(args: argparse.Namespace) -> dict[str, Any]:
    """Parts 1-2 in a child process that imports every module from its .py."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "interpreted.json"
        command = [sys.executable, __file__, "--skip-fleet", "--json", str(out)]
        command += ["--requests", str(args.requests), "--repeat", str(args.repeat)]
        command += ["--traces", str(args.traces)]
        env = {**os.environ, native.PURE_ENV: "1"}
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--verdict", type=Path, help="write the PASS/MISS rows as JSON here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 20,000 requests, no repeat; fleet: 1 day, deepseek-r1 and mm-image",
    )
    parser.add_argument("--fleet", type=Path, default=FLEET_FILE, help="the fleet file of part 4")
    parser.add_argument("--fleet-days", type=float, help="part 4a: replay these days only")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--skip-fleet", action="store_true", help="parts 1-3 only")
    group.add_argument("--fleet-only", action="store_true", help="part 4 only")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeat = 20_000, 1
    started = time.perf_counter()
    print(
        f"# bench_sim {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {machine()}, {build()}",
        flush=True,
    )
    lines: list[str] = []
    out: dict[str, Any] = {"machine": machine(), "build": build()}
    if not args.fleet_only:
        lines += request_level(args, out)
    if not args.skip_fleet:
        days = args.fleet_days or (1.0 if args.quick else 14.0)
        replay = fleet_replay(args.fleet, days)
        slices = [
            fleet_slice(args.fleet, model, start_s, length_s)
            for model, start_s, length_s in (SLICES[1:3] if args.quick else SLICES)
        ]
        lines += fleet_lines(replay, slices)
        replay.pop("gpus_in_use")
        for group in replay["groups"].values():
            group.pop("replicas_over_time")
        out["fleet"] = {"replay": replay, "slices": slices}
    print("\n".join(lines))
    write_verdicts(args.verdict, "bench_sim", lines)
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


def request_level(args: argparse.Namespace, out: dict[str, Any]) -> list[str]:
    """Parts 1-3: their tables (printed) and PASS/MISS lines (returned)."""
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
    if build() != "interpreted":
        print(side_by_side(interpreted_figures(args), path_rows, azure_rows))
    best = max(row.per_s for row in path_rows)
    worst = min(row.per_s for row in path_rows)
    slowest = max(a.cpu_s for a in azure_rows)
    out["path"] = [asdict(r) for r in path_rows]
    out["azure"] = [asdict(a) for a in azure_rows]
    out["workload_generation_per_s"] = generation
    return [
        f"{'PASS' if worst >= TARGET_PER_S else 'MISS'} queue + batching path, {build()}: "
        f"{worst:,.0f} to {best:,.0f} requests/s (target >= {TARGET_PER_S:,.0f})",
        f"{'PASS' if slowest < 1.0 else 'MISS'} Azure conversation trace, {build()}: at most "
        f"{slowest:.2f} s CPU per policy (target: well under 1 s)",
    ]


def side_by_side(
    interpreted: dict[str, Any], path_rows: list[PathRow], azure_rows: list[AzureRow]
) -> str:
    """The interpreted child's figures beside this process's compiled ones."""
    lines = [
        "| run | interpreted requests/s | compiled requests/s | compiled / interpreted "
        "| same outcomes |",
        "|---|---:|---:|---:|---|",
    ]
    for before, row in zip(interpreted["path"], path_rows, strict=True):
        same = (before["completed"], before["refused"], before["events"]) == (
            row.completed,
            row.refused,
            row.events,
        )
        lines.append(
            f"| {row.scenario} | {before['per_s']:,.0f} | {row.per_s:,.0f} "
            f"| {row.per_s / before['per_s']:.2f}x | {'yes' if same else 'NO'} |"
        )
    for before, a in zip(interpreted["azure"], azure_rows, strict=True):
        lines.append(
            f"| Azure x{a.rate_scale:g} {a.policy} | {before['per_s']:,.0f} | {a.per_s:,.0f} "
            f"| {a.per_s / before['per_s']:.2f}x | |"
        )
    heading = "Side by side, the same run interpreted (a child process; same outcomes: the same "
    heading += "completed, refused and event counts):"
    return "\n".join(["", heading, "", *lines])


if __name__ == "__main__":
    sys.exit(main())
