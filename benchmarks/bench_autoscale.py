"""Autoscaling on a tidal day, in the simulator: static peak vs a default HPA vs tidegate.

The day: 24 hours shaped like ServeGen's `language/m-small` (day 0 of
`servegen/aggregate_rate_10min.csv`, 10-minute windows), stretched to a 4:1 peak:trough,
plus one flash crowd (x2.5 for 15 minutes at 11:00). Its peak is sized so that the peak
needs about `--peak-replicas` x 75% of one replica's capacity, where a replica is `minilm`
on this machine's CPU as `tidegate profile` measured it (`--profile`, default
`benchmarks/profiles/minilm-cpu/profile.json`). 20/30/50 high/medium/low; SLO on
end-to-end latency: high 250 ms, medium 1 s, low 10 s.

The three controllers run the identical workload through the same gateway, queue and worker
model (`tidegate.sim`), differing only in who decides the replica count:

- static-peak: `--peak-replicas` all day;
- hpa-default: Kubernetes' HPA defaults on the same signal and target (up x2 or +4 per 15 s;
  down: 300 s window, 100% per 15 s), no schedules, no panic;
- tidegate: the config below: 600 s down window with at most 10% per minute, panic mode at
  2x target, a daytime schedule floor opened by the cold start early.

Time: the day is replayed `--speedup` times faster (default 96: 15 minutes of simulated
time) with every duration of the autoscalers and of the replica lifecycle divided alike (see
`tidegate.sim.autoscale`), so the control dynamics are those of the real day at a 96th of the
request count (the simulator does not manage 86 M requests in minutes). GPU-hours are
reported for the real day (replica-hours x speedup). Caveat: queueing (milliseconds) is not
compressed, so a backlog built while capacity lags is smaller than on the real day: SLO
misses are understated for every controller alike.

Targets (issue 7): tidegate uses >= 40% fewer GPU-hours than static peak at >= 99% high-
priority SLO attainment, and has fewer SLO misses (every level, refusals included) than
hpa-default at equal or lower GPU-hours.

Run (a few minutes on 2 cores):
    .venv/bin/python benchmarks/bench_autoscale.py [--profile P] [--speedup 48]
        [--peak-replicas 8] [--json out.json] [--quick] [--verdict v.json]
Prints a markdown table and PASS/MISS lines; exits 1 only when the profile is missing.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from summary import write_verdicts
from tidegate.config import parse_config
from tidegate.sim.command import compress_lifecycle
from tidegate.sim.fleet import Lifecycle
from tidegate.sim.report import run_summary
from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.service import ServiceModel, load_service
from tidegate.sim.synthetic import LognormalLengths, RateWorkload, Segment
from tidegate.sim.workload import Prioritized, Scale

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROFILE = ROOT / "benchmarks" / "profiles" / "minilm-cpu" / "profile.json"
SERVEGEN = ROOT.parent / "shared" / "traces" / "servegen" / "aggregate_rate_10min.csv"
SHAPE = ("language", "m-small", "0")  # category, model, day
PEAK_TO_TROUGH = 4.0
FLASH = (11 * 3600.0, 15 * 60.0, 2.5)  # at, length, multiplier
MAX_BATCH = 32
PEAK_LOAD = 0.75  # the peak's rate / the peak fleet's capacity
MIX = (("high", 0.2), ("medium", 0.3), ("low", 0.5))
SLO_S = {"high": 0.25, "medium": 1.0, "low": 10.0}
LIFECYCLE = Lifecycle(cold_start_s=12.0, warmup_s=3.0, drain_timeout_s=30.0)  # minilm here
MONDAY = dt.datetime(2026, 11, 30, tzinfo=dt.UTC).timestamp()
VARIANTS = ("static-peak", "hpa-default", "tidegate")


def day_shape() -> list[tuple[float, float]]:
    """(start_s, relative rate) of the 144 ten-minute windows of the ServeGen day."""
    category, model, day = SHAPE
    rows = []
    with SERVEGEN.open(newline="") as file:
        for row in csv.DictReader(file):
            if (row["category"], row["model"], row["day"]) == (category, model, day):
                rows.append((float(row["window_start_s"]) % 86400, float(row["total_rate_rps"])))
    if len(rows) != 144:
        raise SystemExit(f"{SERVEGEN}: expected 144 windows of {SHAPE}, found {len(rows)}")
    return sorted(rows)


def tidal_day(peak_per_s: float) -> list[Segment]:
    """The ServeGen shape stretched to PEAK_TO_TROUGH, peaking at ``peak_per_s``."""
    shape = day_shape()
    low = min(rate for _, rate in shape)
    high = max(rate for _, rate in shape)
    trough_per_s = peak_per_s / PEAK_TO_TROUGH
    flash_at, flash_s, flash_x = FLASH
    segments = []
    for start, rate in shape:
        share = (rate - low) / (high - low)
        per_s = trough_per_s + share * (peak_per_s - trough_per_s)
        end = start + 600.0
        if start < flash_at < end or flash_at <= start < flash_at + flash_s:
            cut = max(start, flash_at)
            if cut > start:
                segments.append(Segment(start, cut, per_s))
            flash_end = min(end, flash_at + flash_s)
            segments.append(Segment(cut, flash_end, per_s * flash_x))
            if flash_end < end:
                segments.append(Segment(flash_end, end, per_s))
        else:
            segments.append(Segment(start, end, per_s))
    return segments


def config_for(profile: Path, peak_replicas: int) -> Any:
    target = MAX_BATCH * 1.5  # in flight + queued per ready replica: 1.5 batches
    return parse_config(
        {
            "pools": {"shared": {"priorities": ["high", "medium", "low"], "devices": ["cpu"]}},
            "models": [
                {
                    "name": "minilm",
                    "task": "embeddings",
                    "engine": "simulated",
                    "profile": str(profile),
                    "pools": ["shared"],
                    "replicas": 2,
                    "batching": {"max_batch_size": MAX_BATCH, "batch_window_ms": 5},
                    "queue": {"max_size": 20000, "timeout_s": {"low": 60}},
                    "autoscaling": {
                        "min_replicas": 2,
                        "max_replicas": peak_replicas,
                        "target_per_replica": target,
                        "interval_s": 15,
                        "stable_window_s": 30,
                        "scale_down": {
                            "stabilization_window_s": 600,
                            "select_policy": "max",
                            "policies": [{"type": "percent", "value": 10, "period_s": 60}],
                        },
                        "panic": {"threshold": 2, "window_s": 15},
                        "cold_start_s": LIFECYCLE.cold_start_s + LIFECYCLE.warmup_s,
                        "schedules": [
                            {"days": "daily", "from": "08:00", "to": "23:00", "min_replicas": 3}
                        ],
                    },
                }
            ],
        },
        "bench_autoscale",
    )


def replica_capacity_per_s(service: ServiceModel) -> float:
    assert service.batch is not None, "an embeddings profile is needed"
    return MAX_BATCH / service.batch.batch_s(MAX_BATCH, MAX_BATCH * 16)


def _misses(klass: dict[str, Any]) -> int:
    """Requests of a class that did not complete within its SLO (refused ones included)."""
    return int(klass["requests"] - round((klass["slo_attainment"] or 0.0) * klass["requests"]))


def run(args: argparse.Namespace) -> dict[str, Any]:
    service = load_service(str(args.profile))
    capacity = replica_capacity_per_s(service)
    peak_per_s = PEAK_LOAD * args.peak_replicas * capacity
    segments = tidal_day(peak_per_s)
    scale = Scale(1.0, args.speedup)
    lengths = LognormalLengths(prompt_median=60, prompt_sigma=0.6, output_median=0)
    workload = Prioritized(
        RateWorkload("tidal day", [("all", segments)], lengths, scale, seed=args.seed),
        "medium",
        MIX,
        (),
        args.seed,
    )
    config = config_for(args.profile, args.peak_replicas)
    rows = []
    for variant in VARIANTS:
        scenario = Scenario(
            config,
            "minilm",
            service,
            workload,
            # Static peak runs its whole fleet from the start (a static controller only
            # replaces replicas; it would otherwise spend its first period on 2); the
            # autoscalers start from their floor and scale as the midnight load asks.
            {"shared": args.peak_replicas if variant == "static-peak" else 2},
            label=variant,
            controller=variant,
            lifecycle=compress_lifecycle(LIFECYCLE, args.speedup),
            slo_ttft_s=SLO_S,
            start_wall_s=MONDAY,
            speedup=args.speedup,
        )
        started = time.process_time()
        simulation = Simulation(scenario)
        result = simulation.run()
        cpu_s = time.process_time() - started
        summary = run_summary(result)
        high = summary["classes"]["high"]
        decisions = getattr(simulation.controller, "decisions", [])
        rows.append(
            {
                "variant": variant,
                "gpu_hours": result.replica_seconds * args.speedup / 3600.0,
                "high_slo": high["slo_attainment"],
                "high_misses": _misses(high),
                "misses": sum(_misses(c) for c in summary["classes"].values()),
                "high_p99_s": high["e2e_s"]["p99"],
                "low_completed": summary["classes"]["low"]["completed"],
                "low_requests": summary["classes"]["low"]["requests"],
                "scale_changes": len(decisions),
                "peak_ready": max(s[3] for s in result.recorder.samples),
                "requests": result.num_requests,
                "cpu_s": cpu_s,
            }
        )
        print(f"  {variant}: {cpu_s:.0f} s CPU", file=sys.stderr)
    return {
        "replica_capacity_per_s": capacity,
        "peak_per_s": peak_per_s,
        "rows": rows,
    }


def report(args: argparse.Namespace, out: dict[str, Any]) -> list[str]:
    rows = {row["variant"]: row for row in out["rows"]}
    print(
        f"# bench_autoscale {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, "
        f"{platform.node()} ({platform.processor() or platform.machine()})\n"
    )
    print(
        f"One replica of minilm ({args.profile.name}): {out['replica_capacity_per_s']:.0f} "
        f"req/s at batch {MAX_BATCH}; peak {out['peak_per_s']:.0f} req/s "
        f"(x{FLASH[2]} flash at 11:00), trough {out['peak_per_s'] / PEAK_TO_TROUGH:.0f}; "
        f"{rows['tidegate']['requests']:,} requests (a day at 1/{args.speedup:g}).\n"
    )
    print(
        "| controller | GPU-hours / day | high within 250 ms | high misses | high p99 | "
        "SLO misses, all | low completed | scale changes | peak ready |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in out["rows"]:
        print(
            f"| {row['variant']} | {row['gpu_hours']:.1f} | {row['high_slo'] * 100:.2f}% | "
            f"{row['high_misses']:,} | {row['high_p99_s'] * 1e3:.0f} ms | {row['misses']:,} | "
            f"{row['low_completed'] / row['low_requests'] * 100:.1f}% | "
            f"{row['scale_changes']} | {row['peak_ready']} |"
        )
    static, hpa, ours = rows["static-peak"], rows["hpa-default"], rows["tidegate"]
    saved = 1 - ours["gpu_hours"] / static["gpu_hours"]
    first = saved >= 0.40 and ours["high_slo"] >= 0.99
    second = ours["misses"] < hpa["misses"] and ours["gpu_hours"] <= hpa["gpu_hours"]
    lines = [
        f"{'PASS' if first else 'MISS'}: {saved * 100:.1f}% fewer GPU-hours than static peak "
        f"(target >= 40%) at {ours['high_slo'] * 100:.2f}% high SLO attainment (target >= 99%)",
        f"{'PASS' if second else 'MISS'}: {ours['misses']:,} SLO misses (all levels) vs "
        f"hpa-default {hpa['misses']:,}, at {ours['gpu_hours']:.1f} vs {hpa['gpu_hours']:.1f} "
        "GPU-hours (target: fewer misses at equal or lower GPU-hours)",
    ]
    print("\n" + "\n".join(lines))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    parser.add_argument("--speedup", type=float, default=96.0)
    parser.add_argument("--peak-replicas", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--verdict", type=Path, help="write the PASS/MISS rows as JSON here")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: the day 4x more compressed"
    )
    args = parser.parse_args()
    if args.quick:
        args.speedup *= 4
    if not args.profile.is_file():
        print(
            f"no profile at {args.profile}: measure one first with `tidegate profile --model "
            "minilm --out benchmarks/profiles/minilm-cpu`",
            file=sys.stderr,
        )
        return 1
    out = run(args)
    write_verdicts(args.verdict, "bench_autoscale", report(args, out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
