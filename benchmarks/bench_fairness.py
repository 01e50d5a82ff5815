"""Fair sharing inside a level: FIFO-in-level against VTC, side by side in one run.

Two tenants send to the same priority level. The light one keeps below its fair share (half
the capacity, with two tenants); the heavy one floods at 10x its share. Target (issue 16):
the light tenant's p99 with the flood is at most 2x its p99 alone, and the total throughput
with VTC is within 5% of FIFO's. Each half prints PASS/MISS.

1. Simulator, ServeGen per-client arrivals: two clients of ``language/m-mid`` (``--light``,
   ``--heavy``; their 600 s windows' rates and Weibull/Gamma gaps, ``--speedup`` times
   faster), each rescaled to its offered load, on the simulated llama2-70b fleet of
   bench_sim (llama2-70b on A100 TP8, splitwise-sim's perf model, ``--replicas``). The
   capacity is measured first (the heavy client alone at 20x overload: completions per
   second); then the light client is offered ``--light-share`` of its fair share and the
   heavy one 10x its fair share. Runs: light alone; light + heavy under FIFO; under VTC.
   Latency: end-to-end per request (queue wait included), by tenant.
2. Real gateway: ``tidegate serve`` with a simulated embeddings engine (one replica, fixed
   service time per batch), two API keys ``light`` and ``heavy`` (the key's name is the
   tenant), loadgen's open-loop clients (benchmarks/loadgen.py): light alone, then light +
   heavy under FIFO and under VTC (``tenancy.fair_sharing``), one gateway each.

Run (about 3 minutes on 2 cores; ``--quick``: shorter runs, sim only):
    .venv/bin/python benchmarks/bench_fairness.py [--quick] [--no-gateway] [--json out.json]
        [--verdict v.json]
Prints markdown tables and PASS/MISS lines; always exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import json
import math
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_sim import AZURE_CONFIG
from summary import write_verdicts
from tidegate.config import load_config
from tidegate.sim.report import run_summary
from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.service import load_perf_model
from tidegate.sim.synthetic import LognormalLengths, RateWorkload, Segment
from tidegate.sim.traces import servegen_segments
from tidegate.sim.workload import Listed

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACES = ROOT.parent / "shared" / "traces"
FLOOD = 10.0  # the heavy tenant's offered load, in multiples of its fair share
P99_RATIO_TARGET = 2.0
THROUGHPUT_TOLERANCE = 0.05
TENANCY_ON = "tenancy:\n  fair_sharing: true\n"


@dataclass
class SimRow:
    run: str
    policy: str
    light_offered_per_s: float
    heavy_offered_per_s: float
    light_requests: int
    light_completed: int
    light_p50_s: float
    light_p99_s: float
    heavy_completed: int
    heavy_p99_s: float
    throughput_per_s: float
    output_tokens_per_s: float


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def client_segments(
    path: Path, start_s: float, duration_s: float, speedup: float, mean_per_s: float
) -> list[Segment]:
    """The client's windows over ``duration_s * speedup`` of trace from ``start_s``, time
    divided by ``speedup``, rates rescaled so that their mean is ``mean_per_s``."""
    span = duration_s * speedup
    windows = [s for s in servegen_segments(path) if start_s <= s.start_s < start_s + span]
    if not windows:
        raise SystemExit(f"{path}: no window in [{start_s}, {start_s + span})")
    mean = sum(s.arrivals_per_s * (s.end_s - s.start_s) for s in windows) / span
    if mean <= 0:
        raise SystemExit(f"{path}: no arrivals in [{start_s}, {start_s + span})")
    k = mean_per_s / mean
    return [
        Segment(
            (s.start_s - start_s) / speedup,
            (s.end_s - start_s) / speedup,
            s.arrivals_per_s * k,
            s.gaps,
        )
        for s in windows
    ]


def simulate(
    config_text: str,
    tenants: list[tuple[str, list[Segment]]],
    args: argparse.Namespace,
    label: str,
) -> tuple[dict[str, list[float]], dict[str, int], dict[str, int], float, float]:
    """Per tenant: e2e latencies of completed requests, arrivals, completions; throughput."""
    folder = Path(tempfile.mkdtemp(prefix="bench_fairness_"))
    (folder / "llama70b.yaml").write_text(config_text)
    config = load_config(str(folder / "llama70b.yaml"))
    service = load_perf_model(args.traces / "profiles" / "perf_model.csv")
    arrivals = list(RateWorkload(label, tenants, LognormalLengths(), seed=args.seed))
    tenant_of = {str(index): arrival.tenant for index, arrival in enumerate(arrivals)}
    scenario = Scenario(
        config,
        "llama2-70b",
        service,
        Listed(label, arrivals),
        {"shared": args.replicas},
        label=label,
        keep_requests=True,
    )
    result = Simulation(scenario).run()
    summary = run_summary(result)
    latencies: dict[str, list[float]] = {name: [] for name, _ in tenants}
    offered: dict[str, int] = dict.fromkeys(latencies, 0)
    completed: dict[str, int] = dict.fromkeys(latencies, 0)
    for tenant in tenant_of.values():
        offered[tenant] += 1
    assert result.recorder.requests is not None
    for record in result.recorder.requests:
        if record.outcome == "completed" and record.e2e_s is not None:
            tenant = tenant_of[record.id]
            latencies[tenant].append(record.e2e_s)
            completed[tenant] += 1
    overall = summary["overall"]
    return (
        latencies,
        offered,
        completed,
        overall["throughput_per_s"],
        overall.get("output_tokens_per_s", math.nan),
    )


def sim_rows(args: argparse.Namespace) -> list[SimRow]:
    folder = args.traces / "servegen" / "language" / "m-mid"
    light_path = folder / f"{args.light}-trace.csv"
    heavy_path = folder / f"{args.heavy}-trace.csv"
    duration = args.duration_s
    fifo_config = AZURE_CONFIG.replace("replicas: 4", f"replicas: {args.replicas}")
    vtc_config = fifo_config + TENANCY_ON

    # Capacity: the heavy client alone at an overload no fleet of this size keeps up with.
    probe = client_segments(heavy_path, args.start_s, duration, args.speedup, 50.0 * args.replicas)
    _, _, _, capacity, _ = simulate(fifo_config, [("heavy", probe)], args, "capacity")
    share = capacity / 2  # two tenants, equal shares
    light_rate = args.light_share * share
    heavy_rate = FLOOD * share
    print(
        f"sim capacity {capacity:.2f} req/s on {args.replicas} replicas; fair share "
        f"{share:.2f}; light offered {light_rate:.2f} req/s, heavy {heavy_rate:.2f} req/s",
        file=sys.stderr,
    )
    light = client_segments(light_path, args.start_s, duration, args.speedup, light_rate)
    heavy = client_segments(heavy_path, args.start_s, duration, args.speedup, heavy_rate)
    rows = []
    for run, policy, config_text, tenants in (
        ("light alone", "fifo", fifo_config, [("light", light)]),
        ("light + heavy", "fifo", fifo_config, [("light", light), ("heavy", heavy)]),
        ("light + heavy", "vtc", vtc_config, [("light", light), ("heavy", heavy)]),
    ):
        latencies, offered, completed, throughput, tokens = simulate(
            config_text, tenants, args, f"{run} {policy}"
        )
        rows.append(
            SimRow(
                run,
                policy,
                light_rate,
                heavy_rate if len(tenants) > 1 else 0.0,
                offered["light"],
                completed["light"],
                percentile(latencies["light"], 0.50),
                percentile(latencies["light"], 0.99),
                completed.get("heavy", 0),
                percentile(latencies.get("heavy", []), 0.99),
                throughput,
                tokens,
            )
        )
        print(f"  {run} {policy}: done", file=sys.stderr)
    return rows


def sim_table(rows: list[SimRow]) -> str:
    lines = [
        "| run | policy | light req/s | heavy req/s | light done / sent | light p50 s | "
        "light p99 s | heavy done | heavy p99 s | total req/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.run} | {r.policy} | {r.light_offered_per_s:.2f} | "
            f"{r.heavy_offered_per_s:.2f} | {r.light_completed:,} / {r.light_requests:,} | "
            f"{r.light_p50_s:.2f} | {r.light_p99_s:.2f} | {r.heavy_completed:,} | "
            f"{r.heavy_p99_s:.2f} | {r.throughput_per_s:.3f} |"
        )
    return "\n".join(lines)


def verdicts(
    where: str,
    solo_p99: float,
    fifo_p99: float,
    vtc_p99: float,
    fifo_throughput: float,
    vtc_throughput: float,
    light_lost: tuple[int, int] = (0, 0),
) -> list[tuple[bool, str]]:
    ratio = vtc_p99 / solo_p99 if solo_p99 > 0 else math.inf
    fifo_ratio = fifo_p99 / solo_p99 if solo_p99 > 0 else math.inf
    change = vtc_throughput / fifo_throughput - 1 if fifo_throughput > 0 else math.inf
    lost_fifo, lost_vtc = light_lost
    return [
        (
            ratio <= P99_RATIO_TARGET,
            f"{where}: light tenant p99 with a 10x flood, VTC {vtc_p99:.3f} s = {ratio:.2f}x "
            f"its solo p99 {solo_p99:.3f} s (target <= {P99_RATIO_TARGET:g}x; FIFO "
            f"{fifo_p99:.3f} s = {fifo_ratio:.2f}x; light requests not completed: FIFO "
            f"{lost_fifo}, VTC {lost_vtc})",
        ),
        (
            abs(change) <= THROUGHPUT_TOLERANCE,
            f"{where}: total throughput VTC {vtc_throughput:.3f}/s vs FIFO "
            f"{fifo_throughput:.3f}/s ({change * 100:+.1f}%, target within "
            f"{THROUGHPUT_TOLERANCE * 100:g}%)",
        ),
    ]


# ----------------------------------------------------------------------------- real gateway
@dataclass
class GatewayRow:
    run: str
    policy: str
    light_sent: int
    light_ok: int
    light_p50_ms: float
    light_p99_ms: float
    heavy_sent: int
    heavy_ok: int
    heavy_refused: int
    throughput_per_s: float


def gateway_config(profile: Path, fair: bool) -> dict[str, object]:
    """One simulated embeddings replica that serves one request at a time (``--service-ms``
    each): the backlog waits in the gateway's queue, where the policy applies."""
    config: dict[str, object] = {
        "models": [
            {
                "name": "sim",
                "task": "embeddings",
                "engine": "simulated",
                "profile": str(profile),
                "replicas": 1,
                "slots": 1,
                "batching": {"max_batch_size": 1, "batch_window_ms": 0},
            }
        ],
        "keys": [
            {"name": name, "sha256": hashlib.sha256(secret.encode()).hexdigest()}
            for name, secret in SECRETS.items()
        ],
    }
    if fair:
        config["tenancy"] = {"fair_sharing": True}
    return config


SECRETS = {"light": "sk-bench-light", "heavy": "sk-bench-heavy"}


def gateway_run(
    logdir: Path, profile: Path, policy: str, rates: dict[str, float], args: argparse.Namespace
) -> GatewayRow:
    import loadgen

    total = sum(rates.values())
    classes = [(name, rate / total) for name, rate in rates.items()]
    arrivals = loadgen.poisson(total, args.gateway_s, args.seed, classes, 1_000_000)
    headers = {name: {"Authorization": f"Bearer {secret}"} for name, secret in SECRETS.items()}
    payloads = loadgen.embedding_bodies("sim", loadgen.sentences(256))
    name = f"{policy}-{'+'.join(rates)}"
    serve = loadgen.start_serve(name, logdir, gateway_config(profile, policy == "vtc"), "sim")
    with loadgen.running(serve):
        loop = asyncio.run(
            loadgen.open_loop(
                serve.url,
                "/v1/embeddings",
                payloads,
                arrivals,
                headers,
                drain_s=120.0,
                timeout_s=180.0,
                meters={},
            )
        )
    by = {tenant: [r for r in loop.records if r.tag == tenant] for tenant in rates}
    light = by.get("light", [])
    heavy = by.get("heavy", [])
    ok = [r for r in loop.records if r.status == 200]
    span = max(r.end for r in ok) - loop.started if ok else math.nan
    light_ms = [r.latency * 1000 for r in light if r.status == 200]
    return GatewayRow(
        "light alone" if len(rates) == 1 else "light + heavy",
        policy,
        len(light),
        len(light_ms),
        loadgen.percentile(light_ms, 50),
        loadgen.percentile(light_ms, 99),
        len(heavy),
        sum(r.status == 200 for r in heavy),
        sum(r.status == 429 for r in heavy),
        len(ok) / span if span > 0 else math.nan,
    )


def gateway_rows(args: argparse.Namespace) -> list[GatewayRow]:
    import loadgen

    logdir = Path(tempfile.mkdtemp(prefix="bench_fairness_gw_"))
    profile = logdir / "flat.json"
    points = [
        {"batch_size": 1, "latency_ms": args.service_ms},
        {"batch_size": 64, "latency_ms": args.service_ms},
    ]
    profile.write_text(
        json.dumps(
            {"version": 1, "model": "sim", "task": "embeddings", "embeddings": {"points": points}}
        )
    )
    capacity = 1000.0 / args.service_ms
    share = capacity / 2
    light_rate = args.light_share * share
    heavy_rate = FLOOD * share
    print(
        f"gateway: capacity {capacity:.1f} req/s (1 slot, {args.service_ms:g} ms each); light "
        f"{light_rate:.1f} req/s, heavy {heavy_rate:.1f} req/s, {args.gateway_s:g} s each",
        file=sys.stderr,
    )
    rows = []
    try:
        for policy, rates in (
            ("fifo", {"light": light_rate}),
            ("fifo", {"light": light_rate, "heavy": heavy_rate}),
            ("vtc", {"light": light_rate, "heavy": heavy_rate}),
        ):
            rows.append(gateway_run(logdir, profile, policy, rates, args))
            print(f"  gateway {policy} {'+'.join(rates)}: done", file=sys.stderr)
    finally:
        loadgen.stop_all()
    return rows


def gateway_table(rows: list[GatewayRow]) -> str:
    lines = [
        "| run | policy | light ok / sent | light p50 ms | light p99 ms | heavy ok / sent | "
        "heavy 429 | total ok/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.run} | {r.policy} | {r.light_ok:,} / {r.light_sent:,} | {r.light_p50_ms:.1f} | "
            f"{r.light_p99_ms:.1f} | {r.heavy_ok:,} / {r.heavy_sent:,} | {r.heavy_refused:,} | "
            f"{r.throughput_per_s:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    parser.add_argument("--light", default="chunk-36", help="m-mid client of the light tenant")
    parser.add_argument("--heavy", default="chunk-73", help="m-mid client of the heavy tenant")
    parser.add_argument("--start-s", type=float, default=36_000.0, help="trace time to start")
    parser.add_argument("--duration-s", type=float, default=600.0, help="virtual seconds")
    parser.add_argument("--speedup", type=float, default=12.0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--light-share", type=float, default=0.5, help="of its fair share")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gateway-s", type=float, default=30.0, help="gateway run length")
    parser.add_argument("--service-ms", type=float, default=40.0, help="gateway: per request")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-gateway", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--verdict", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.duration_s = min(args.duration_s, 200.0)
        args.no_gateway = True

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    print(
        f"# bench_fairness  {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC  commit {commit}  "
        f"{platform.processor() or platform.machine()}\n"
    )
    results: list[tuple[bool, str]] = []
    rows = sim_rows(args)
    print("## Simulator: ServeGen m-mid clients, llama2-70b fleet\n")
    print(sim_table(rows) + "\n")
    solo, fifo, vtc = rows
    results += verdicts(
        "sim",
        solo.light_p99_s,
        fifo.light_p99_s,
        vtc.light_p99_s,
        fifo.throughput_per_s,
        vtc.throughput_per_s,
        (
            fifo.light_requests - fifo.light_completed,
            vtc.light_requests - vtc.light_completed,
        ),
    )
    payload: dict[str, object] = {"commit": commit, "sim": [asdict(r) for r in rows]}
    if not args.no_gateway:
        gw = gateway_rows(args)
        print("## Real gateway: tidegate serve, simulated embeddings, two API keys\n")
        print(gateway_table(gw) + "\n")
        g_solo, g_fifo, g_vtc = gw
        results += verdicts(
            "gateway",
            g_solo.light_p99_ms / 1000,
            g_fifo.light_p99_ms / 1000,
            g_vtc.light_p99_ms / 1000,
            g_fifo.throughput_per_s,
            g_vtc.throughput_per_s,
            (g_fifo.light_sent - g_fifo.light_ok, g_vtc.light_sent - g_vtc.light_ok),
        )
        payload["gateway"] = [asdict(r) for r in gw]
    for ok, line in results:
        print(f"{'PASS' if ok else 'MISS'} {line}")
    if args.json:
        args.json.write_text(json.dumps(payload, indent=2))
    if args.verdict:
        lines = [f"{'PASS' if ok else 'MISS'} {line}" for ok, line in results]
        write_verdicts(args.verdict, "bench_fairness", lines)


if __name__ == "__main__":
    main()
