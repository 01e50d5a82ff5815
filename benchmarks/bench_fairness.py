"""Fair sharing inside a level: FIFO-in-level against VTC, side by side in one run.

Two tenants send to the same priority level. The light one keeps below its fair share (half
the capacity, with two tenants); the heavy one floods at 10x its share. Target (issue 16):
the light tenant's p99 with the flood is at most 2x its p99 alone, and the total throughput
with VTC is within 5% of FIFO's. Each half prints PASS/MISS. VTC runs with its slot shares
(a tenant at or over slots x share / active shares waits for a free slot while one under
its share waits: core.fairness), and in the simulator also without them ("counters only"),
side by side: the order before slot shares.

1. Simulator, ServeGen per-client arrivals: two clients of ``language/m-mid`` (``--light``,
   ``--heavy``; their 600 s windows' rates and Weibull/Gamma gaps, ``--speedup`` times
   faster), each rescaled to its offered load, on the simulated llama2-70b fleet of
   bench_sim (llama2-70b on A100 TP8, splitwise-sim's perf model, ``--replicas``). The
   capacity is measured first (the heavy client alone at 20x overload: completions per
   second); then the light client is offered ``--light-share`` of its fair share and the
   heavy one 10x its fair share. Runs: light alone; light + heavy under FIFO; under VTC
   with counters only; under VTC with slot shares and no slot reserve; under VTC with the
   slot reserve (``--reserve-fraction``, default the configuration's); the same with the
   workers' prefill budget (``batching.max_prefill_tokens`` = ``--prefill-budget``: a
   sequence joins the engine only while the prompts not yet prefilled stay within it, and
   the worker's own queue orders the rest by the tenants' counters); the same with fair
   sharing's preemption (``FairnessConfig.preemption``: with no slot free, a request of a
   tenant under its slot share is sent to the replica holding most of the tenant most over
   its own, which pauses that tenant's running sequence with the fewest tokens; the paused
   one resumes there later, recomputing its prompt and the tokens it had made), once with
   no slot reserve and once with the reserve; then one run per ``--reserve-sweep``
   fraction, with the budget (rows only). The verdicts' run: preemption with the slot reserve
   and the budget (the configuration docs/config.md recommends), whatever it measures. The
   FIFO runs have no budget (today's default). A second table gives every VTC run's light
   tenant figures over solo (TTFT p99, after the warm-up, less the gateway's wait, e2e
   p99), its throughput against FIFO's, and the sequences preempted and the tokens
   recomputed. Latency: end-to-end per request
   (queue wait included) and TTFT, by tenant; TTFT also of the arrivals after the first
   ``--warmup-s`` (the flood takes every slot at the start, before the light one sends).
0. Single-tenant cost: bench_queue's pick loop (pre-filled to a depth, then submit one, pick
   one, each pick timed alone) on a WaitQueue without fair sharing and on one with it, every
   request of the one anonymous tenant, in alternating rounds (ABAB...). Target: with fair
   sharing on, the single-tenant pick p50 and p99 within 10% of without (the fast path).
2. Real gateway: ``tidegate serve`` with a simulated embeddings engine (``--gateway-replicas``
   replicas, each serving one request at a time, fixed service time: the model has as many
   slots as replicas, for the slot shares), tenants ``light`` and ``heavy`` named by the
   trusted header ``X-Tenant`` (``tenancy.header``), loadgen's open-loop clients
   (benchmarks/loadgen.py): light alone, then light + heavy under FIFO and under VTC
   (``tenancy.fair_sharing``), one gateway each. Embeddings slots turn over every
   ``--service-ms``: preemption does not apply.
3. Real gateway, generation: ``tidegate serve`` with one simulated generation model (a flat
   profile: ``--gen-ttft-ms``, ``--gen-itl-ms`` whatever the batch; ``--gen-replicas`` x
   ``--gen-max-num-seqs`` slots, 32 by default so that the 1/32 slot reserve holds one; its
   queue bounded at ``--gen-queue`` so that the flood's backlog drains within the run), the
   tenants by ``X-Tenant``, each arrival one streamed /v1/completions (loadgen's open loop,
   Poisson, from 127.0.0.1): light ones of ``--gen-light-tokens`` tokens at ``--light-share``
   of its fair share, heavy ones of ``--gen-heavy-tokens`` at 10x its own; a fair share is
   half the slots in the tenant's own streams per second, computed from the profile (slots /
   (TTFT + (tokens - 1) x ITL)), not measured. Runs of ``--gen-s`` each: light alone; light +
   heavy under FIFO; under VTC (the configuration's reserve); under VTC with preemption
   (``tenancy.preemption``: the gateway sends a light request past the slots and a worker
   pauses a heavy stream at its next token); with ``--gen-reserve-zero`` (default) the same
   without the reserve. Per request: TTFT (the first event with text, from the scheduled
   arrival), e2e, status. Verdicts on the preemption run with the reserve: the light
   tenant's TTFT p99 and e2e p99 at most 2x solo, output tokens/s (text events after
   ``--gen-warmup-s``) within 5% of FIFO's, every accepted request (not 429) answered with
   a whole stream. Requests/s in the window is a NOTE: it moves with the mix of short and
   long streams that a policy completes. The gateway's preemptions and the workers' paused
   sequences and recomputed tokens come from /admin/replicas and /stats. About 4 minutes;
   ``--gateway-generation-only``: only this part; ``--no-gateway-generation``: without it.

Run (about 8 minutes on 2 cores; ``--quick``: shorter runs, sim only):
    .venv/bin/python benchmarks/bench_fairness.py [--quick] [--no-gateway] [--json out.json]
        [--verdict v.json] [--gateway-replicas N --service-ms MS]
        [--gateway-generation-only | --no-gateway-generation]
Prints markdown tables, PASS/MISS lines and NOTE lines (slot shares, the slot reserve, the
prefill budget, then preemption, before -> after, same run; which run the verdicts are on);
always exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import platform
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import bench_queue as bq
from bench_sim import AZURE_CONFIG
from summary import write_verdicts
from tidegate.config import load_config
from tidegate.core.fairness import FairnessConfig
from tidegate.core.queue import Admitted, AgingConfig, QueueConfig, WaitQueue
from tidegate.core.request import Request
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
VTC_COUNTERS = "vtc, counters only"  # VTC without slot shares: the order before them
VTC_SHARES = "vtc + slot shares"  # VTC with slot shares and no slot reserve: before it
VTC_BUDGET = "vtc + reserve + prefill budget"  # and the worker's prefill budget
VTC_PREEMPT = "vtc + preemption"  # fair sharing's preemption, with the prefill budget


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
    light_ttft_p50_s: float
    light_ttft_p99_s: float
    light_ttft_p99_late_s: float  # arrivals after the warm-up
    light_ttft_p99_engine_s: float  # TTFT less the gateway's queue wait: the engine's part
    heavy_completed: int
    heavy_p99_s: float
    throughput_per_s: float
    output_tokens_per_s: float
    preempted: int = 0  # sequences paused for another tenant's (every replica)
    recomputed_tokens: int = 0  # prefilled again by the resumed ones: prompt + tokens made


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
    slot_shares: bool = True,
    preemption: bool = False,
) -> tuple[
    dict[str, list[float]],
    dict[str, list[float]],
    dict[str, list[float]],
    dict[str, list[float]],
    dict[str, int],
    dict[str, int],
    float,
    float,
    tuple[int, int],
]:
    """Per tenant: e2e latencies and TTFTs of completed requests, TTFTs of those that arrived
    after the warm-up, TTFTs less the gateway's queue wait (the engine's part), arrivals,
    completions; the throughput while arrivals last
    (``--duration-s``, not the drain after): requests and output tokens completed in that
    window, per second; and the sequences preempted and tokens recomputed, all replicas.
    ``slot_shares``: fair sharing's slot shares (False: counters only); ``preemption``: fair
    sharing's preemption on."""
    folder = Path(tempfile.mkdtemp(prefix="bench_fairness_"))
    (folder / "llama70b.yaml").write_text(config_text)
    config = load_config(str(folder / "llama70b.yaml"))
    if preemption:  # FairnessConfig's flag: the gateway's queue and the workers' take it
        tenancy = config.tenancy
        fairness = replace(tenancy.fairness, preemption=True)
        config = replace(config, tenancy=replace(tenancy, fairness=fairness))
    service = load_perf_model(args.traces / "profiles" / "perf_model.csv")
    arrivals = list(RateWorkload(label, tenants, LognormalLengths(), seed=args.seed))
    tenant_of = {str(index): arrival.tenant for index, arrival in enumerate(arrivals)}
    by_id = {str(index): arrival for index, arrival in enumerate(arrivals)}
    scenario = Scenario(
        config,
        "llama2-70b",
        service,
        Listed(label, arrivals),
        {"shared": args.replicas},
        label=label,
        keep_requests=True,
    )
    simulation = Simulation(scenario)
    simulation.gateway.slot_shares = slot_shares
    result = simulation.run()
    latencies: dict[str, list[float]] = {name: [] for name, _ in tenants}
    ttfts: dict[str, list[float]] = {name: [] for name, _ in tenants}
    late: dict[str, list[float]] = {name: [] for name, _ in tenants}
    engine: dict[str, list[float]] = {name: [] for name, _ in tenants}
    offered: dict[str, int] = dict.fromkeys(latencies, 0)
    completed: dict[str, int] = dict.fromkeys(latencies, 0)
    for tenant in tenant_of.values():
        offered[tenant] += 1
    assert result.recorder.requests is not None
    window_done = window_tokens = 0
    for record in result.recorder.requests:
        if record.outcome == "completed" and record.e2e_s is not None:
            arrival = by_id[record.id]
            if arrival.arrival_s + record.e2e_s <= args.duration_s:
                window_done += 1
                window_tokens += arrival.output_tokens
            tenant = tenant_of[record.id]
            latencies[tenant].append(record.e2e_s)
            ttft = record.ttft_s if record.ttft_s is not None else math.nan
            ttfts[tenant].append(ttft)
            if arrival.arrival_s >= args.warmup_s:
                late[tenant].append(ttft)
            engine[tenant].append(ttft - (record.wait_s or 0.0))
            completed[tenant] += 1
    recorder = result.recorder
    return (
        latencies,
        ttfts,
        late,
        engine,
        offered,
        completed,
        window_done / args.duration_s,
        window_tokens / args.duration_s,
        (sum(recorder.preempted.values()), sum(recorder.recomputed_tokens.values())),
    )


def sim_rows(args: argparse.Namespace) -> list[SimRow]:
    folder = args.traces / "servegen" / "language" / "m-mid"
    light_path = folder / f"{args.light}-trace.csv"
    heavy_path = folder / f"{args.heavy}-trace.csv"
    duration = args.duration_s
    fifo_config = AZURE_CONFIG.replace("replicas: 4", f"replicas: {args.replicas}")
    shares_config = fifo_config + TENANCY_ON + reserve_line(0.0)
    reserve_config = fifo_config + TENANCY_ON + reserve_line(args.reserve_fraction)
    # The worker's prefill budget (batching.max_prefill_tokens) on top: the verdicts' run.
    budget_config = with_prefill_budget(fifo_config, args.prefill_budget) + TENANCY_ON
    vtc_config = budget_config + reserve_line(args.reserve_fraction)
    preempt_config = budget_config + reserve_line(0.0)

    # Capacity: the heavy client alone at an overload no fleet of this size keeps up with
    # (completions per second while it lasts).
    probe = client_segments(heavy_path, args.start_s, duration, args.speedup, 50.0 * args.replicas)
    capacity = simulate(fifo_config, [("heavy", probe)], args, "capacity")[6]
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
    both = [("light", light), ("heavy", heavy)]
    budget = f"prefill budget {args.prefill_budget:,}"
    reserve = f"reserve {args.reserve_fraction:g}"
    runs = [
        ("light alone", "fifo", fifo_config, [("light", light)], True, False),
        ("light + heavy", "fifo", fifo_config, both, True, False),
        ("light + heavy", VTC_COUNTERS, shares_config, both, False, False),
        ("light + heavy", VTC_SHARES, shares_config, both, True, False),
        ("light + heavy", f"vtc + {reserve}", reserve_config, both, True, False),
        ("light + heavy", f"{VTC_BUDGET} {args.prefill_budget:,}", vtc_config, both, True, False),
        ("light + heavy", f"{VTC_PREEMPT} + {budget}", preempt_config, both, True, True),
        ("light + heavy", f"{VTC_PREEMPT} + {reserve} + {budget}", vtc_config, both, True, True),
    ]
    for fraction in args.reserve_sweep:  # more rows, no verdicts: the reserve's curve
        sweep_config = budget_config + reserve_line(fraction)
        policy = f"vtc + reserve {fraction:g} + {budget}"
        runs.append(("light + heavy", policy, sweep_config, both, True, False))
    rows = []
    for run, policy, config_text, tenants, slot_shares, preemption in runs:
        latencies, ttfts, late, engine, offered, completed, throughput, tokens, paused = simulate(
            config_text, tenants, args, f"{run} {policy}", slot_shares, preemption
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
                percentile(ttfts["light"], 0.50),
                percentile(ttfts["light"], 0.99),
                percentile(late["light"], 0.99),
                percentile(engine["light"], 0.99),
                completed.get("heavy", 0),
                percentile(latencies.get("heavy", []), 0.99),
                throughput,
                tokens,
                *paused,
            )
        )
        print(f"  {run} {policy}: done", file=sys.stderr)
    return rows


def with_prefill_budget(config_text: str, tokens: int) -> str:
    """``config_text`` with the model's batching.max_prefill_tokens set (0: none)."""
    if not tokens:
        return config_text
    line = "      max_num_seqs: 32\n"
    assert line in config_text
    return config_text.replace(line, f"{line}      max_prefill_tokens: {tokens}\n")


def reserve_line(fraction: float) -> str:
    """The tenancy key of the slot reserve."""
    return f"  slot_reserve_fraction: {fraction}\n"


def sim_table(rows: list[SimRow]) -> str:
    lines = [
        "| run | policy | light req/s | heavy req/s | light done / sent | light e2e p50 s | "
        "light e2e p99 s | light TTFT p50 s | light TTFT p99 s | light TTFT p99 after warm-up s "
        "| heavy done | heavy e2e p99 s | total req/s | total output tok/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.run} | {r.policy} | {r.light_offered_per_s:.2f} | "
            f"{r.heavy_offered_per_s:.2f} | {r.light_completed:,} / {r.light_requests:,} | "
            f"{r.light_p50_s:.2f} | {r.light_p99_s:.2f} | {r.light_ttft_p50_s:.2f} | "
            f"{r.light_ttft_p99_s:.2f} | {r.light_ttft_p99_late_s:.2f} | {r.heavy_completed:,} | "
            f"{r.heavy_p99_s:.2f} | {r.throughput_per_s:.3f} | {r.output_tokens_per_s:,.0f} |"
        )
    return "\n".join(lines)


def vtc_table(rows: list[SimRow], solo: SimRow, fifo: SimRow) -> str:
    """Every VTC run's light tenant figures over its solo ones, its throughput against
    FIFO's, and what preemption did."""
    lines = [
        "| policy | light TTFT p99 x solo | after warm-up x solo | less the gateway's wait x "
        "solo | light e2e p99 x solo | req/s vs FIFO | output tok/s vs FIFO | preempted | "
        "recomputed tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if not r.policy.startswith("vtc"):
            continue
        lines.append(
            f"| {r.policy} | {r.light_ttft_p99_s / solo.light_ttft_p99_s:.2f} | "
            f"{r.light_ttft_p99_late_s / solo.light_ttft_p99_late_s:.2f} | "
            f"{r.light_ttft_p99_engine_s / solo.light_ttft_p99_s:.2f} | "
            f"{r.light_p99_s / solo.light_p99_s:.2f} | "
            f"{(r.throughput_per_s / fifo.throughput_per_s - 1) * 100:+.1f}% | "
            f"{(r.output_tokens_per_s / fifo.output_tokens_per_s - 1) * 100:+.1f}% | "
            f"{r.preempted:,} | {r.recomputed_tokens:,} |"
        )
    return "\n".join(lines)


def verdicts(
    where: str,
    what: str,
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
            f"{where}: light tenant {what} p99 with a 10x flood, VTC {vtc_p99:.3f} s = "
            f"{ratio:.2f}x its solo p99 {solo_p99:.3f} s (target <= {P99_RATIO_TARGET:g}x; FIFO "
            f"{fifo_p99:.3f} s = {fifo_ratio:.2f}x; light requests not completed: FIFO "
            f"{lost_fifo}, VTC {lost_vtc})",
        ),
        (
            abs(change) <= THROUGHPUT_TOLERANCE,
            f"{where}: total requests/s while the flood lasts, VTC {vtc_throughput:.3f} vs FIFO "
            f"{fifo_throughput:.3f} ({change * 100:+.1f}%, target within "
            f"{THROUGHPUT_TOLERANCE * 100:g}%)",
        ),
    ]


def before_after_note(what: str, solo: SimRow, before: SimRow, after: SimRow) -> str:
    """``what`` before -> after, same run: the light tenant's TTFT p99 and e2e p99 over solo,
    and the throughput (informative: the verdicts are on the last VTC run)."""

    def ratio(value: float, base: float) -> str:
        return f"{value:.2f} s = {value / base:.2f}x" if base > 0 else f"{value:.2f} s"

    return (
        f"sim, {what} before -> after: light TTFT p99 "
        f"{ratio(before.light_ttft_p99_s, solo.light_ttft_p99_s)} -> "
        f"{ratio(after.light_ttft_p99_s, solo.light_ttft_p99_s)} solo; after the "
        f"warm-up: {ratio(before.light_ttft_p99_late_s, solo.light_ttft_p99_late_s)} -> "
        f"{ratio(after.light_ttft_p99_late_s, solo.light_ttft_p99_late_s)}; less the "
        f"gateway's wait: {ratio(before.light_ttft_p99_engine_s, solo.light_ttft_p99_s)} -> "
        f"{ratio(after.light_ttft_p99_engine_s, solo.light_ttft_p99_s)}; e2e p99 "
        f"{ratio(before.light_p99_s, solo.light_p99_s)} -> "
        f"{ratio(after.light_p99_s, solo.light_p99_s)}; req/s {before.throughput_per_s:.3f}"
        f" -> {after.throughput_per_s:.3f}; output tok/s {before.output_tokens_per_s:,.0f} -> "
        f"{after.output_tokens_per_s:,.0f}"
    )


# ----------------------------------------------------------------------------- one tenant
COST_TOLERANCE = 0.10


@dataclass
class CostRow:
    depth: int
    policy: str
    rounds: int
    p50_us: float
    p99_us: float
    ops_per_s: float


class _Adapter:
    """bench_queue's Approach: one WaitQueue, fair sharing off or on."""

    def __init__(self, name: str, depth: int, fair: bool) -> None:
        self.name = name
        config = QueueConfig(
            max_size=depth + 100_000,
            aging=AgingConfig(),
            fairness=FairnessConfig() if fair else None,
        )
        self._queue = WaitQueue(config)

    def submit(self, request: Request, now: float) -> None:
        if not isinstance(self._queue.admit(request, now, 0.0), Admitted):
            raise RuntimeError(f"WaitQueue refused {request.id}")

    def pick(self, now: float) -> Request:
        return self._queue.pop(1, now)[0]


def cost_rows(args: argparse.Namespace) -> list[CostRow]:
    rows = []
    for depth in args.cost_depths:
        cells: dict[str, list[bq.Cell]] = {"fifo": [], "vtc": []}
        for round_index in range(args.cost_rounds):
            order = ("fifo", "vtc") if round_index % 2 == 0 else ("vtc", "fifo")
            for policy in order:
                rng = random.Random(args.seed)
                prefill = bq.prefill_requests(depth, rng)
                steps = bq.step_requests(args.cost_steps, rng, bq.STEP_S)
                adapter = _Adapter(policy, depth, policy == "vtc")
                cells[policy].append(bq.run_cell(adapter, prefill, steps, args.cost_budget_s, 50))
        for policy, found in cells.items():
            rows.append(
                CostRow(
                    depth,
                    policy,
                    len(found),
                    statistics.median(c.p50_us for c in found),
                    statistics.median(c.p99_us for c in found),
                    statistics.median(c.ops_per_s for c in found),
                )
            )
    return rows


def cost_table(rows: list[CostRow]) -> str:
    lines = [
        "| depth | fair sharing | rounds | pick p50 µs | pick p99 µs | submit+pick ops/s |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.depth:,} | {'on (VTC)' if r.policy == 'vtc' else 'off (FIFO)'} | {r.rounds} | "
            f"{r.p50_us:.2f} | {r.p99_us:.2f} | {r.ops_per_s:,.0f} |"
        )
    return "\n".join(lines)


def cost_verdicts(rows: list[CostRow]) -> list[tuple[bool, str]]:
    out = []
    by = {(r.depth, r.policy): r for r in rows}
    for depth in sorted({r.depth for r in rows}):
        off, on = by[(depth, "fifo")], by[(depth, "vtc")]
        p50 = on.p50_us / off.p50_us - 1
        p99 = on.p99_us / off.p99_us - 1
        out.append(
            (
                p50 <= COST_TOLERANCE and p99 <= COST_TOLERANCE,
                f"one tenant at depth {depth:,}: pick with fair sharing on p50 {on.p50_us:.2f} "
                f"µs ({p50 * 100:+.0f}%), p99 {on.p99_us:.2f} µs ({p99 * 100:+.0f}%) vs off "
                f"{off.p50_us:.2f} / {off.p99_us:.2f} µs (target within "
                f"+{COST_TOLERANCE * 100:g}%)",
            )
        )
    return out


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


def gateway_config(profile: Path, fair: bool, replicas: int) -> dict[str, object]:
    """``replicas`` simulated embeddings replicas that serve one request at a time
    (``--service-ms`` each): the backlog waits in the gateway's queue, where the policy
    applies. (One replica with several slots would batch what arrives together, so its
    capacity would depend on how the releases line up.)"""
    config: dict[str, object] = {
        "models": [
            {
                "name": "sim",
                "task": "embeddings",
                "engine": "simulated",
                "profile": str(profile),
                "replicas": replicas,
                "slots": 1,
                "batching": {"max_batch_size": 1, "batch_window_ms": 0},
            }
        ],
        # An open service: the tenant is a header the operator trusts (as a proxy in
        # front would set it); keys would name it the same way, by the key's name.
        "tenancy": {"header": "X-Tenant", "fair_sharing": fair},
    }
    return config


def gateway_run(
    logdir: Path, profile: Path, policy: str, rates: dict[str, float], args: argparse.Namespace
) -> GatewayRow:
    import loadgen

    total = sum(rates.values())
    classes = [(name, rate / total) for name, rate in rates.items()]
    arrivals = loadgen.poisson(total, args.gateway_s, args.seed, classes, 1_000_000)
    headers = {name: {"X-Tenant": name} for name in ("light", "heavy")}
    payloads = loadgen.embedding_bodies("sim", loadgen.sentences(256))
    name = f"{policy}-{'+'.join(rates)}"
    config = gateway_config(profile, policy == "vtc", args.gateway_replicas)
    serve = loadgen.start_serve(name, logdir, config, "sim")
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
    # Throughput while the load lasts: answers completed within the sending window.
    in_window = [
        r for r in loop.records if r.status == 200 and r.end - loop.started <= args.gateway_s
    ]
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
        len(in_window) / args.gateway_s,
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
    capacity = args.gateway_replicas * 1000.0 / args.service_ms
    share = capacity / 2
    light_rate = args.light_share * share
    heavy_rate = FLOOD * share
    print(
        f"gateway: capacity {capacity:.1f} req/s ({args.gateway_replicas} replicas of 1 slot, "
        f"{args.service_ms:g} ms each); light "
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
        "heavy 429 | total ok/s in window |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.run} | {r.policy} | {r.light_ok:,} / {r.light_sent:,} | {r.light_p50_ms:.1f} | "
            f"{r.light_p99_ms:.1f} | {r.heavy_ok:,} / {r.heavy_sent:,} | {r.heavy_refused:,} | "
            f"{r.throughput_per_s:.2f} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------- real gateway, generation
GEN_VTC = "vtc"  # fair sharing, the configuration's slot reserve, no preemption
GEN_PREEMPT = "vtc + preemption"


@dataclass
class GenRow:
    run: str
    policy: str
    reserve_fraction: float
    reserve_slots: int  # as the gateway counts them (/admin/replicas)
    light_sent: int
    light_ok: int
    light_refused: int  # 429: not accepted
    light_ttft_p50_ms: float
    light_ttft_p99_ms: float
    light_ttft_p99_late_ms: float  # arrivals after --gen-warmup-s (the flood starts with all)
    light_e2e_p50_ms: float
    light_e2e_p99_ms: float
    heavy_sent: int
    heavy_ok: int
    heavy_refused: int
    heavy_e2e_p99_ms: float
    unanswered: int  # accepted (not 429) yet not a whole 200 stream: any other status, error
    requests_per_s: float  # whole 200 streams ended in the window, per second
    output_tokens_per_s: float  # streamed text events (one a token) in the window, per second
    preemptions: int  # the gateway's (/admin/replicas)
    preempted: int  # sequences the workers paused (/stats batching)
    recomputed_tokens: int
    error_samples: list[str]


@dataclass(frozen=True)
class GenLoad:
    """What the generation runs offer, from the profile and the model's slots."""

    slots: int
    light_service_s: float  # one light stream alone on a slot: TTFT + (tokens - 1) x ITL
    heavy_service_s: float
    light_per_s: float
    heavy_per_s: float


def gen_load(args: argparse.Namespace) -> GenLoad:
    """The light tenant at ``--light-share`` of its fair share, the heavy one at 10x its own;
    a fair share is half the slots (two tenants), in its own streams per second: computed
    from the flat profile, slots / (TTFT + (max_tokens - 1) x ITL), not measured."""
    slots = args.gen_replicas * args.gen_max_num_seqs

    def service_s(tokens: int) -> float:
        return (args.gen_ttft_ms + (tokens - 1) * args.gen_itl_ms) / 1000

    light_s, heavy_s = service_s(args.gen_light_tokens), service_s(args.gen_heavy_tokens)
    share = slots / 2
    return GenLoad(
        slots, light_s, heavy_s, args.light_share * share / light_s, FLOOD * share / heavy_s
    )


def gen_config(
    profile: Path, policy: str, reserve_fraction: float, args: argparse.Namespace
) -> dict[str, object]:
    """One simulated generation model (``--gen-replicas`` x ``--gen-max-num-seqs`` slots);
    its queue bounded at ``--gen-queue`` so that the flood's backlog drains within the run
    (the rest of it is refused: 429); tenants by the trusted header X-Tenant."""
    tenancy: dict[str, object] = {"header": "X-Tenant"}
    if policy != "fifo":
        tenancy |= {"fair_sharing": True, "slot_reserve_fraction": reserve_fraction}
        tenancy["preemption"] = policy.startswith(GEN_PREEMPT)
    return {
        "models": [
            {
                "name": "chat",
                "task": "generate",
                "engine": "simulated",
                "profile": str(profile),
                "replicas": args.gen_replicas,
                "batching": {"max_num_seqs": args.gen_max_num_seqs},
                "queue": {"max_size": args.gen_queue},
            }
        ],
        "tenancy": tenancy,
    }


def completion_text(event: bytes) -> bool:
    """A /v1/completions stream event with text (a resumed stream's catch-up may send "")."""
    return b'"choices":[{' in event and b'"text":""' not in event


def gen_counters(url: str) -> tuple[int, int, int, int]:
    """The gateway's reserve slots and preemptions, the workers' paused sequences and
    recomputed tokens (all replicas): read before the gateway stops."""
    import httpx

    with httpx.Client(timeout=10.0) as client:
        model = client.get(f"{url}/admin/replicas").json()["chat"]
        stats = [
            client.get(f"{replica['url']}/stats").json()["batching"]
            for replica in model["replicas"]
        ]
    tenants = model["tenants"]
    return (
        int(tenants["reserve_slots"]),
        int(tenants["preemptions"]),
        sum(int(s.get("preempted", 0)) for s in stats),
        sum(int(s.get("recomputed_tokens", 0)) for s in stats),
    )


def gen_run(
    logdir: Path,
    profile: Path,
    policy: str,
    reserve_fraction: float,
    rates: dict[str, float],
    args: argparse.Namespace,
) -> GenRow:
    import loadgen

    total = sum(rates.values())
    classes = [(name, rate / total) for name, rate in rates.items()]
    arrivals = loadgen.poisson(total, args.gen_s, args.seed, classes, 1_000_000)
    headers = {name: {"X-Tenant": name} for name in ("light", "heavy")}
    tokens = {"light": args.gen_light_tokens, "heavy": args.gen_heavy_tokens}
    # One body per arrival, by its tenant's length (open_loop sends payloads[i]).
    payloads = [
        json.dumps(
            {
                "model": "chat",
                "prompt": f"{tenant} request {i}",
                "max_tokens": tokens[tenant],
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        for i, (_, tenant) in enumerate(arrivals)
    ]
    name = f"gen-{policy.replace(' ', '')}-{reserve_fraction:g}-{'+'.join(rates)}"
    serve = loadgen.start_serve(
        name, logdir, gen_config(profile, policy, reserve_fraction, args), "chat"
    )
    with loadgen.running(serve):
        loop = asyncio.run(
            loadgen.open_loop(
                serve.url,
                "/v1/completions",
                payloads,
                arrivals,
                headers,
                drain_s=args.gen_drain_s,
                timeout_s=args.gen_s + args.gen_drain_s,
                meters={},
                has_text=completion_text,
            )
        )
        reserve, preemptions, preempted, recomputed = gen_counters(serve.url)
    records = loop.records
    whole = [r for r in records if r.status == 200 and not r.error]
    light = [r for r in records if r.tag == "light"]
    heavy = [r for r in records if r.tag == "heavy"]
    light_whole = [r for r in whole if r.tag == "light"]
    unanswered = [r for r in records if r.status != 429 and (r.status != 200 or r.error)]
    window_from, window_to = loop.started + args.gen_warmup_s, loop.started + args.gen_s
    window_s = args.gen_s - args.gen_warmup_s
    late = [r for r in light_whole if r.start >= window_from]
    events = sum(window_from <= at <= window_to for r in records for at in r.text_at)
    return GenRow(
        "light alone" if len(rates) == 1 else "light + heavy",
        policy,
        reserve_fraction,
        reserve,
        len(light),
        len(light_whole),
        sum(r.status == 429 for r in light),
        loadgen.percentile([r.ttft * 1000 for r in light_whole], 50),
        loadgen.percentile([r.ttft * 1000 for r in light_whole], 99),
        loadgen.percentile([r.ttft * 1000 for r in late], 99),
        loadgen.percentile([r.latency * 1000 for r in light_whole], 50),
        loadgen.percentile([r.latency * 1000 for r in light_whole], 99),
        len(heavy),
        sum(r.tag == "heavy" for r in whole),
        sum(r.status == 429 for r in heavy),
        loadgen.percentile([r.latency * 1000 for r in whole if r.tag == "heavy"], 99),
        len(unanswered),
        sum(window_from <= r.end <= window_to for r in whole) / window_s,
        events / window_s,
        preemptions,
        preempted,
        recomputed,
        [f"{r.tag} {r.status} {r.error}" for r in unanswered[:5]],
    )


def gen_rows(args: argparse.Namespace) -> list[GenRow]:
    import loadgen

    logdir = Path(tempfile.mkdtemp(prefix="bench_fairness_gen_"))
    profile = logdir / "flat-generate.json"
    point = {"concurrency": 1, "ttft_ms": args.gen_ttft_ms, "itl_ms": args.gen_itl_ms}
    profile.write_text(
        json.dumps(
            {"version": 1, "model": "chat", "task": "generate", "generate": {"points": [point]}}
        )
    )
    load = gen_load(args)
    light = {"light": load.light_per_s}
    both = {"light": load.light_per_s, "heavy": load.heavy_per_s}
    print(
        f"gateway, generation: {load.slots} slots ({args.gen_replicas} replicas x max_num_seqs "
        f"{args.gen_max_num_seqs}), TTFT {args.gen_ttft_ms:g} ms, ITL {args.gen_itl_ms:g} ms: "
        f"a light stream ({args.gen_light_tokens} tokens) holds a slot {load.light_service_s:.2f}"
        f" s, a heavy one ({args.gen_heavy_tokens}) {load.heavy_service_s:.2f} s; light "
        f"{load.light_per_s:.1f} streams/s, heavy {load.heavy_per_s:.1f}/s, {args.gen_s:g} s "
        "each",
        file=sys.stderr,
    )
    reserve = args.reserve_fraction
    runs = [
        ("fifo", reserve, light),
        ("fifo", reserve, both),
        (GEN_VTC, reserve, both),
        (GEN_PREEMPT, reserve, both),
    ]
    if args.gen_reserve_zero:
        runs.append((GEN_PREEMPT, 0.0, both))
    rows = []
    try:
        for policy, fraction, rates in runs:
            rows.append(gen_run(logdir, profile, policy, fraction, rates, args))
            print(f"  gateway, generation: {policy} {'+'.join(rates)}: done", file=sys.stderr)
    finally:
        loadgen.stop_all()
    return rows


def gen_table(rows: list[GenRow]) -> str:
    lines = [
        "| run | policy | reserve (slots) | light ok / sent | light 429 | light TTFT p50 / p99 "
        "ms | light TTFT p99 after warm-up ms | light e2e p50 / p99 ms | heavy ok / sent | "
        "heavy 429 | heavy e2e p99 s | not answered | req/s in window | output tok/s in window "
        "| preemptions | paused / recomputed tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        reserve = "-" if r.policy == "fifo" else f"{r.reserve_fraction:g} ({r.reserve_slots})"
        lines.append(
            f"| {r.run} | {r.policy} | {reserve} | {r.light_ok:,} / {r.light_sent:,} | "
            f"{r.light_refused:,} | {r.light_ttft_p50_ms:.0f} / {r.light_ttft_p99_ms:.0f} | "
            f"{r.light_ttft_p99_late_ms:.0f} | "
            f"{r.light_e2e_p50_ms:.0f} / {r.light_e2e_p99_ms:.0f} | {r.heavy_ok:,} / "
            f"{r.heavy_sent:,} | {r.heavy_refused:,} | {r.heavy_e2e_p99_ms / 1000:.1f} | "
            f"{r.unanswered} | {r.requests_per_s:.1f} | {r.output_tokens_per_s:,.0f} | "
            f"{r.preemptions:,} | {r.preempted:,} / {r.recomputed_tokens:,} |"
        )
    return "\n".join(lines)


def gen_verdicts(rows: list[GenRow]) -> tuple[list[tuple[bool, str]], list[str]]:
    """On the preemption run with the configuration's reserve: the light tenant's TTFT p99
    and e2e p99 within 2x solo, output tokens/s within 5% of FIFO's, and every accepted
    request answered (every run). Requests/s is a note: the policy changes the mix of short
    and long streams completed, so it moves with the mix, not with the work done."""
    solo, fifo, vtc, preempt = rows[:4]

    def times(field: str) -> dict[str, float]:
        return {r.policy: getattr(r, field) / getattr(solo, field) for r in (fifo, vtc, preempt)}

    def p99_line(what: str, field: str, also: str = "") -> tuple[bool, str]:
        found = times(field)
        return (
            found[GEN_PREEMPT] <= P99_RATIO_TARGET,
            f"gateway, generation: light tenant {what} p99 with a 10x flood, VTC + preemption "
            f"{getattr(preempt, field):.0f} ms = {found[GEN_PREEMPT]:.2f}x its solo p99 "
            f"{getattr(solo, field):.0f} ms (target <= {P99_RATIO_TARGET:g}x; VTC without "
            f"preemption {found[GEN_VTC]:.2f}x, FIFO {found['fifo']:.2f}x; light 429s: FIFO "
            f"{fifo.light_refused}, VTC {vtc.light_refused}, VTC + preemption "
            f"{preempt.light_refused}{also})",
        )

    late = times("light_ttft_p99_late_ms")
    late_line = (
        f"; arrivals after the warm-up: VTC + preemption {late[GEN_PREEMPT]:.2f}x, VTC "
        f"{late[GEN_VTC]:.2f}x, FIFO {late['fifo']:.2f}x"
    )
    change = preempt.output_tokens_per_s / fifo.output_tokens_per_s - 1
    unanswered = sum(r.unanswered for r in rows)
    results = [
        p99_line("TTFT", "light_ttft_p99_ms", late_line),
        p99_line("e2e", "light_e2e_p99_ms"),
        (
            abs(change) <= THROUGHPUT_TOLERANCE,
            f"gateway, generation: output tokens/s while the flood lasts, VTC + preemption "
            f"{preempt.output_tokens_per_s:,.0f} vs FIFO {fifo.output_tokens_per_s:,.0f} "
            f"({change * 100:+.1f}%, target within {THROUGHPUT_TOLERANCE * 100:g}%; VTC "
            f"without preemption {vtc.output_tokens_per_s:,.0f})",
        ),
        (
            unanswered == 0,
            f"gateway, generation: accepted requests not answered with a whole stream, every "
            f"run: {unanswered} {[s for r in rows for s in r.error_samples][:3]}",
        ),
    ]
    notes = [
        f"gateway, generation: completed requests/s in the window, FIFO "
        f"{fifo.requests_per_s:.1f}, VTC {vtc.requests_per_s:.1f}, VTC + preemption "
        f"{preempt.requests_per_s:.1f} (not a verdict: FIFO serves the streams in arrival "
        f"order, mostly long ones; fair sharing serves the light tenant's short ones)",
        f"gateway, generation: VTC + preemption paused {preempt.preempted:,} sequences "
        f"({preempt.preemptions:,} preemptions at the gateway), {preempt.recomputed_tokens:,} "
        "tokens recomputed",
    ]
    return results, notes


def parse_args() -> argparse.Namespace:
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
    parser.add_argument("--gateway-replicas", type=int, default=1, help="gateway: 1 slot each")
    parser.add_argument("--warmup-s", type=float, default=30.0, help="sim: TTFT after this")
    parser.add_argument(
        "--reserve-fraction",
        type=float,
        default=None,
        help="sim: tenancy.slot_reserve_fraction of the last VTC run (default: the config's)",
    )
    parser.add_argument(
        "--prefill-budget",
        type=int,
        default=2048,
        help="sim: the workers' batching.max_prefill_tokens in the verdicts' VTC run",
    )
    parser.add_argument(
        "--reserve-sweep",
        type=float,
        nargs="*",
        default=[],
        help="sim: more VTC runs, one per slot_reserve_fraction (rows, no verdicts)",
    )

    parser.add_argument("--cost-depths", type=int, nargs="+", default=[1000, 100_000])
    parser.add_argument("--cost-rounds", type=int, default=6)
    parser.add_argument("--cost-steps", type=int, default=20_000)
    parser.add_argument("--cost-budget-s", type=float, default=1.0)
    gen = parser.add_argument_group("real gateway, generation")
    gen.add_argument(
        "--gateway-generation",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the generation part on the real gateway (off with --no-gateway too)",
    )
    gen.add_argument("--gateway-generation-only", action="store_true", help="only that part")
    gen.add_argument("--gen-s", type=float, default=30.0, help="sending, per run")
    gen.add_argument("--gen-warmup-s", type=float, default=5.0, help="throughput after this")
    gen.add_argument("--gen-drain-s", type=float, default=60.0, help="answers after sending")
    gen.add_argument("--gen-replicas", type=int, default=2)
    gen.add_argument("--gen-max-num-seqs", type=int, default=16, help="slots of a replica")
    gen.add_argument("--gen-ttft-ms", type=float, default=50.0, help="flat profile")
    gen.add_argument("--gen-itl-ms", type=float, default=20.0, help="flat profile")
    gen.add_argument("--gen-light-tokens", type=int, default=16, help="light max_tokens")
    gen.add_argument("--gen-heavy-tokens", type=int, default=200, help="heavy max_tokens")
    gen.add_argument("--gen-queue", type=int, default=96, help="the model's queue.max_size")
    gen.add_argument(
        "--gen-reserve-zero",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one more preemption run without the slot reserve",
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-gateway", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--verdict", type=Path)
    args = parser.parse_args()
    if args.reserve_fraction is None:
        args.reserve_fraction = FairnessConfig().reserve_fraction
    if args.quick:
        args.duration_s = min(args.duration_s, 200.0)
        args.cost_rounds, args.cost_budget_s = 2, 0.3
        args.no_gateway = True
    return args


def sim_and_embeddings(
    args: argparse.Namespace,
) -> tuple[list[tuple[bool, str]], list[str], dict[str, object]]:
    """The one-tenant cost, the simulator and (unless ``--no-gateway``) the real gateway with
    embeddings: their tables printed; their verdicts, notes and rows returned."""
    results: list[tuple[bool, str]] = []
    costs = cost_rows(args)
    print("## One tenant: the pick's cost with fair sharing off and on\n")
    print(cost_table(costs) + "\n")
    results += cost_verdicts(costs)
    rows = sim_rows(args)
    print("## Simulator: ServeGen m-mid clients, llama2-70b fleet\n")
    print(sim_table(rows) + "\n")
    solo, fifo, counters, shares, reserve, budget, preempt, preempt_reserve = rows[:8]
    print(vtc_table(rows, solo, fifo) + "\n")
    # The verdicts: on the configuration docs/config.md recommends, whatever it measures:
    # preemption with the configuration's slot reserve (and the prefill budget).
    vtc = preempt_reserve
    lost = (fifo.light_requests - fifo.light_completed, vtc.light_requests - vtc.light_completed)
    results += verdicts(
        "sim",
        "e2e",
        solo.light_p99_s,
        fifo.light_p99_s,
        vtc.light_p99_s,
        fifo.throughput_per_s,
        vtc.throughput_per_s,
        lost,
    )
    change = vtc.output_tokens_per_s / fifo.output_tokens_per_s - 1
    results.append(
        (
            abs(change) <= THROUGHPUT_TOLERANCE,
            f"sim: output tokens/s while the flood lasts, VTC {vtc.output_tokens_per_s:,.0f} vs "
            f"FIFO {fifo.output_tokens_per_s:,.0f} ({change * 100:+.1f}%, target within "
            f"{THROUGHPUT_TOLERANCE * 100:g}%)",
        )
    )
    results.append(
        verdicts(
            "sim",
            "TTFT",
            solo.light_ttft_p99_s,
            fifo.light_ttft_p99_s,
            vtc.light_ttft_p99_s,
            fifo.throughput_per_s,
            vtc.throughput_per_s,
            lost,
        )[0]
    )
    notes = [
        before_after_note("slot shares", solo, counters, shares),
        before_after_note(f"slot reserve {args.reserve_fraction:g}", solo, shares, reserve),
        before_after_note(f"prefill budget {args.prefill_budget:,}", solo, reserve, budget),
        before_after_note(
            f"preemption (and reserve {args.reserve_fraction:g} -> 0)", solo, budget, preempt
        ),
        before_after_note(
            f"preemption (reserve {args.reserve_fraction:g} kept)", solo, budget, preempt_reserve
        ),
        f"sim, preemption: {preempt.preempted:,} sequences paused, {preempt.recomputed_tokens:,}"
        f" tokens recomputed (reserve 0); {preempt_reserve.preempted:,} and "
        f"{preempt_reserve.recomputed_tokens:,} with the reserve",
        f"sim: the verdicts are on the run '{vtc.policy}'",
    ]
    payload: dict[str, object] = {
        "cost": [asdict(r) for r in costs],
        "sim": [asdict(r) for r in rows],
    }
    if not args.no_gateway:
        gw = gateway_rows(args)
        print("## Real gateway: tidegate serve, simulated embeddings, tenants by X-Tenant\n")
        print(gateway_table(gw) + "\n")
        g_solo, g_fifo, g_vtc = gw
        results += verdicts(
            "gateway",
            "latency",
            g_solo.light_p99_ms / 1000,
            g_fifo.light_p99_ms / 1000,
            g_vtc.light_p99_ms / 1000,
            g_fifo.throughput_per_s,
            g_vtc.throughput_per_s,
            (g_fifo.light_sent - g_fifo.light_ok, g_vtc.light_sent - g_vtc.light_ok),
        )
        payload["gateway"] = [asdict(r) for r in gw]
    return results, notes, payload


def main() -> None:
    args = parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    print(
        f"# bench_fairness  {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC  commit {commit}  "
        f"{platform.processor() or platform.machine()}\n"
    )
    results: list[tuple[bool, str]] = []
    notes: list[str] = []
    payload: dict[str, object] = {"commit": commit}
    if not args.gateway_generation_only:
        found, more, parts = sim_and_embeddings(args)
        results += found
        notes += more
        payload |= parts
    if args.gateway_generation and not args.no_gateway:
        gen = gen_rows(args)
        print(
            "## Real gateway: tidegate serve, a simulated generation model, tenants by X-Tenant\n"
        )
        print(gen_table(gen) + "\n")
        found, more = gen_verdicts(gen)
        results += found
        notes += more
        payload["gateway_generation"] = [asdict(r) for r in gen]
    for ok, line in results:
        print(f"{'PASS' if ok else 'MISS'} {line}")
    for line in notes:
        print(f"NOTE {line}")
    if args.json:
        args.json.write_text(json.dumps(payload, indent=2))
    if args.verdict:
        lines = [f"{'PASS' if ok else 'MISS'} {line}" for ok, line in results]
        write_verdicts(args.verdict, "bench_fairness", lines)


if __name__ == "__main__":
    main()
