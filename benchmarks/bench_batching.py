"""Adaptive batching against the fixed rule, side by side in one run.

The fixed rule (the default before 2026-12-03, ``window_ms_by_priority: {}`` now): a batch
leaves when full (max_batch_size 8, the minilm profile's knee) or 5 ms after its oldest member
arrived. Adaptive (the first lever is the config's default since, the others opt-in):
``window_ms_by_priority {high: 0}`` (a high request never waits for companions),
``load_aware_window`` (a partial batch leaves once under one arrival is expected in what is
left of its window) and ``target_p99_ms`` 100 (AIMD cap on the high level's P99 at the
worker). The mix: 20% high, 30% medium, 50% low, Poisson arrivals, one replica.

Parts (each optional):
1. ``sim``: the simulator on the minilm CPU profile (benchmarks/profiles/minilm-cpu), at 10%
   of its capacity (low load), 100% (the knee) and 200% (overload), through the gateway's
   queue and the worker's, in virtual time (deterministic, machine-independent); then at
   the knee and at 200% of a machine ``SLOW`` times slower (every batch costs that many times
   the profile's), where a batch of 8 runs past the 100 ms target and the AIMD cap binds, as
   on the real workers of the slow, shared machine of 2026-12-02.
2. ``real``: two real ``tidegate worker --model minilm`` processes, fixed and adaptive, the
   same seeded open loops (benchmarks/loadgen.py) sent to each in turn (ABAB per load) at
   low load, at the fixed worker's measured closed-loop capacity and at twice it. Latency
   runs from the scheduled arrival; throughput is answers per second of the schedule.
3. ``profile``: ``tidegate profile --model minilm`` on its default mixed workload (log-normal
   lengths, median 64 tokens) and its default SLO (none: the knee is where throughput stops
   growing), short (batch sweep to 8, 2-6 s per point), with the fixed rule's workers, then
   with workers that form batches of similar lengths, by the padding ratio
   (``--length-candidates 64 --max-padding-ratio 1.25``) and on cost
   (``--batch-overhead-tokens 35``, the pairing probe's fit here); the knee batch of each,
   the knee the same points give under a 200 ms p95 SLO, and each batch point's worker CPU
   per input.
4. ``pairs``: the pairing probe, minilm in this process: random pairs of that workload, each
   run as one padded batch and as two batches of one; the batch of one's overhead and
   per-token cost, and engine time together over apart for every pair and for the pairs
   each length-aware rule forms or leaves apart (the padding ratio 1.25; the rule on cost,
   ``batch_overhead_tokens``, with the overhead just measured): what batching by length can
   save here, and whether each rule picks the pairs that save.

Targets (PASS/MISS): at low load the high p50 improves by at least the window (5 ms); at the
knee and at 2x overload throughput within 5% of the fixed rule's and high p99 no worse
(10% slack in the real part: the machine is shared and noisy, see docs/benchmarks.md); the
profile knee on the mixed workload above batch 1 with length-aware formation; the pairs each
length-aware rule forms cost the engine less than apart.

Run:
    .venv/bin/python benchmarks/bench_batching.py [--parts sim real profile pairs] [--quick]
        [--verdict v.json]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import loadgen
from summary import write_verdicts
from tidegate.config import parse_config
from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.service import BatchService, ServiceModel, load_service
from tidegate.sim.workload import Arrival, Listed

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "benchmarks/profiles/minilm-cpu/profile.json"
MAX_BATCH = 8
WINDOW_MS = 5.0
TARGET_P99_MS = 100.0
MIX = (("high", 0.2), ("medium", 0.3), ("low", 0.5))
LEVEL_INDEX = {"high": "0", "medium": "1", "low": "2"}
# The fixed rule: every level waits the window (the config's default gives the most urgent
# level none, so the fixed side asks for no level windows).
FIXED: dict[str, Any] = {
    "max_batch_size": MAX_BATCH,
    "batch_window_ms": WINDOW_MS,
    "window_ms_by_priority": {},
}
ADAPTIVE: dict[str, Any] = {
    **FIXED,
    "window_ms_by_priority": {"high": 0},
    "load_aware_window": True,
    "target_p99_ms": TARGET_P99_MS,
}
ADAPTIVE_FLAGS: tuple[str, ...] = (
    "--level-windows-ms",
    "0,,",
    "--load-aware-window",
    "--target-p99-ms",
    "100",
)
LENGTH_CANDIDATES, MAX_PADDING_RATIO = 64, 1.25
LENGTH_FLAGS = {"length_candidates": LENGTH_CANDIDATES, "max_padding_ratio": MAX_PADDING_RATIO}
SLOW = 3.0  # the slow machine of the simulated part: every batch costs 3x the profile's
# The rule on cost: a batch of one's overhead in tokens of work, as the pairing probe fitted
# it on this machine (32 to 37 tokens at one engine thread, docs/benchmarks.md).
OVERHEAD_TOKENS = 35.0
SLO_P95_MS = 200.0  # reported beside the profile's own knee (which has no SLO by default)


def _verdict(ok: bool, text: str) -> str:
    return f"{'PASS' if ok else 'MISS'} {text}"


# ------------------------------------------------------------------ simulator


class _Slowed:
    """A batch service ``factor`` times slower than ``inner``."""

    def __init__(self, inner: BatchService, factor: float) -> None:
        self.inner = inner
        self.factor = factor

    def batch_s(self, num_requests: int, num_tokens: int) -> float:
        return float(self.factor * self.inner.batch_s(num_requests, num_tokens))


def _service(slowdown: float) -> ServiceModel:
    service = load_service(str(PROFILE))
    if slowdown == 1.0:
        return service
    assert service.batch is not None
    return ServiceModel(
        f"{service.name} x{slowdown:g}",
        service.task,
        batch=_Slowed(service.batch, slowdown),
        source=service.source,
    )


def _sim_run(
    batching: dict[str, Any], rate: float, duration_s: float, slowdown: float = 1.0
) -> dict[str, float]:
    data = {
        "models": [
            {
                "name": "emb",
                "task": "embeddings",
                "engine": "simulated",
                "replicas": 1,
                "batching": batching,
            }
        ]
    }
    config = parse_config(data, "<bench_batching>")
    arrivals = [
        Arrival(at, 14, 0, cls) for at, cls in loadgen.poisson(rate, duration_s, 7, MIX, 10_000_000)
    ]
    scenario = Scenario(
        config, "emb", _service(slowdown), Listed("poisson", arrivals), {"shared": 1}
    )
    result = Simulation(scenario).run()
    high = next(s for s in result.recorder.classes if s.name == "high")
    completed = sum(s.outcomes["completed"] for s in result.recorder.classes)
    span = max(duration_s, result.end_at - result.first_arrival_at)
    return {
        "high_p50_ms": 1e3 * (high.e2e.percentile(50) or math.nan),
        "high_p99_ms": 1e3 * (high.e2e.percentile(99) or math.nan),
        "throughput": completed / span,
        "completed": completed,
        "offered": len(arrivals),
    }


def sim_part(quick: bool) -> list[str]:
    service = load_service(str(PROFILE))
    assert service.batch is not None
    capacity = MAX_BATCH / service.batch.batch_s(MAX_BATCH, 0)
    print(f"\n## Simulator (profile {PROFILE.name}: capacity {capacity:.0f} req/s at batch 8)\n")
    print(
        f"The slow rows: every batch costs {SLOW:g}x the profile's (capacity "
        f"{capacity / SLOW:.0f} req/s, a batch of 8 takes "
        f"{1e3 * SLOW * service.batch.batch_s(MAX_BATCH, 0):.0f} ms).\n"
    )
    print("| load | rule | high p50 ms | high p99 ms | throughput req/s | completed/offered |")
    print("|---|---|---:|---:|---:|---:|")
    verdicts = []
    duration = 30.0 if quick else 120.0
    for name, share, slowdown in (
        ("low 10%", 0.1, 1.0),
        ("knee 100%", 1.0, 1.0),
        ("overload 200%", 2.0, 1.0),
        (f"slow {SLOW:g}x knee 100%", 1.0, SLOW),
        (f"slow {SLOW:g}x overload 200%", 2.0, SLOW),
    ):
        rate = capacity / slowdown * share
        rows = {
            rule: _sim_run(batching, rate, duration, slowdown)
            for rule, batching in (("fixed", FIXED), ("adaptive", ADAPTIVE))
        }
        for rule, row in rows.items():
            print(
                f"| {name} | {rule} | {row['high_p50_ms']:.1f} | {row['high_p99_ms']:.1f} | "
                f"{row['throughput']:.1f} | {row['completed']:.0f}/{row['offered']:.0f} |"
            )
        verdicts += _compare("sim", name, rows["fixed"], rows["adaptive"], p99_slack=0.0)
    return verdicts


def _compare(
    part: str, load: str, fixed: dict[str, float], adaptive: dict[str, float], p99_slack: float
) -> list[str]:
    if load.startswith("low"):
        gain = fixed["high_p50_ms"] - adaptive["high_p50_ms"]
        return [
            _verdict(
                gain >= WINDOW_MS,
                f"{part} low load: high p50 {fixed['high_p50_ms']:.1f} -> "
                f"{adaptive['high_p50_ms']:.1f} ms, better by {gain:.1f} ms (target >= "
                f"{WINDOW_MS:g} ms, the window)",
            )
        ]
    ratio = adaptive["throughput"] / fixed["throughput"]
    p99_ratio = adaptive["high_p99_ms"] / fixed["high_p99_ms"]
    return [
        _verdict(
            ratio >= 0.95,
            f"{part} {load}: throughput {fixed['throughput']:.1f} -> "
            f"{adaptive['throughput']:.1f} req/s ({ratio:.3f}x, target >= 0.95x)",
        ),
        _verdict(
            p99_ratio <= 1.0 + p99_slack,
            f"{part} {load}: high p99 {fixed['high_p99_ms']:.1f} -> "
            f"{adaptive['high_p99_ms']:.1f} ms ({p99_ratio:.3f}x, target <= "
            f"{1.0 + p99_slack:.2f}x)",
        ),
    ]


# ------------------------------------------------------------------ real worker


def _summarise(run: loadgen.OpenLoop) -> dict[str, float]:
    high = [r.latency for r in run.records if r.tag == "high" and r.status == 200]
    ok = [r for r in run.records if r.status == 200]
    last_end = max((r.end for r in ok), default=run.started)
    span = max(run.sending_s, last_end - run.started)
    return {
        "high_p50_ms": 1e3 * loadgen.percentile(high, 50) if high else math.nan,
        "high_p99_ms": 1e3 * loadgen.percentile(high, 99) if high else math.nan,
        "throughput": len(ok) / span if span > 0 else math.nan,
        "completed": len(ok),
        "offered": len(run.records),
        "other_cores": run.cores.get("other processes", math.nan),
    }


async def _open(url: str, rate: float, duration_s: float, seed: int) -> dict[str, float]:
    arrivals = loadgen.poisson(rate, duration_s, seed, MIX, 1_000_000)
    bodies = loadgen.embedding_bodies("minilm", loadgen.sentences(256))
    headers = {cls: {"x-tidegate-priority": LEVEL_INDEX[cls]} for cls, _ in MIX}
    run = await loadgen.open_loop(
        url,
        "/v1/embeddings",
        bodies,
        arrivals,
        headers,
        drain_s=30.0,
        timeout_s=60.0,
        meters={},
    )
    return _summarise(run)


async def _capacity(url: str, seconds: float) -> float:
    bodies = loadgen.embedding_bodies("minilm", loadgen.sentences(256))
    started = time.perf_counter()
    records = await loadgen.closed_loop(
        url, "/v1/embeddings", bodies, 2 * MAX_BATCH, asyncio.sleep(seconds)
    )
    elapsed = time.perf_counter() - started
    return sum(1 for r in records if r.status == 200) / elapsed


def real_part(quick: bool, adaptive_flags: tuple[str, ...] = ADAPTIVE_FLAGS) -> list[str]:
    logdir = Path(tempfile.mkdtemp(prefix="bench_batching_"))
    common = ("--model", "minilm", "--max-batch-size", str(MAX_BATCH))
    fixed = loadgen.start_worker("fixed", logdir, *common, "--batch-window-ms", "5")
    adaptive = loadgen.start_worker(
        "adaptive", logdir, *common, "--batch-window-ms", "5", *adaptive_flags
    )
    verdicts: list[str] = []
    try:
        capacity = asyncio.run(_capacity(fixed.url, 4.0 if quick else 8.0))
        if capacity < 20:  # low load (capacity / 10) would send next to nothing
            raise RuntimeError(
                f"the fixed worker's capacity is {capacity:.1f} req/s: the machine is too "
                f"busy to measure this part, run it again later"
            )
        seconds = 8.0 if quick else 15.0
        print(f"\n## Real minilm workers (fixed worker's closed-loop capacity {capacity:.0f}/s)\n")
        print("| load | rule | high p50 ms | high p99 ms | throughput req/s | completed/offered |")
        print("|---|---|---:|---:|---:|---:|")
        for name, rate in (
            ("low", min(10.0, capacity / 10)),
            ("knee", capacity),
            ("overload 2x", 2 * capacity),
        ):
            rows: dict[str, list[dict[str, float]]] = {"fixed": [], "adaptive": []}
            for seed, order in ((1, ("fixed", "adaptive")), (2, ("adaptive", "fixed"))):
                for rule in order:
                    url = fixed.url if rule == "fixed" else adaptive.url
                    rows[rule].append(asyncio.run(_open(url, rate, seconds / 2, seed)))
            merged = {rule: _merge(runs) for rule, runs in rows.items()}
            for rule, row in merged.items():
                print(
                    f"| {name} {rate:.0f}/s | {rule} | {row['high_p50_ms']:.1f} | "
                    f"{row['high_p99_ms']:.1f} | {row['throughput']:.1f} | "
                    f"{row['completed']:.0f}/{row['offered']:.0f} |"
                )
            verdicts += _compare("real", name, merged["fixed"], merged["adaptive"], 0.10)
        stats = asyncio.run(_stats(adaptive.url))
        print("\nadaptive worker /stats batching:", json.dumps(stats.get("batching")))
    finally:
        loadgen.stop(fixed)
        loadgen.stop(adaptive)
    return verdicts


def _merge(runs: list[dict[str, float]]) -> dict[str, float]:
    """Two halves (ABAB): medians of latency, means of throughput, sums of counts."""
    return {
        "high_p50_ms": sum(r["high_p50_ms"] for r in runs) / len(runs),
        "high_p99_ms": max(r["high_p99_ms"] for r in runs),
        "throughput": sum(r["throughput"] for r in runs) / len(runs),
        "completed": sum(r["completed"] for r in runs),
        "offered": sum(r["offered"] for r in runs),
    }


async def _stats(url: str) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient() as client:
        answer = await client.get(f"{url}/stats")
        result: dict[str, Any] = answer.json()
        return result


# ------------------------------------------------------------------ profile knee

_PATCHED_PROFILE = (
    "import functools, sys\n"
    "import tidegate.profile.sweep as sweep\n"
    "from tidegate.worker.runtime import WorkerSettings\n"
    "sweep.WorkerSettings = functools.partial(WorkerSettings, **{kwargs})\n"
    "from tidegate.cli import app\n"
    "sys.argv = ['tidegate', *sys.argv[1:]]\n"
    "app()\n"
)


def _profile_knee(out: Path, worker: dict[str, Any], quick: bool) -> dict[str, Any]:
    """``tidegate profile`` with its defaults (no SLO: the knee is where throughput stops
    growing), a short sweep, the workers' batching settings patched to ``worker``."""
    args = [
        "profile",
        "--model",
        "minilm",
        "--max-batch",
        "8",
        "--batch-windows-ms",
        "0,5",
        "--max-concurrency",
        "16",
        "--min-seconds-per-point",
        "2" if quick else "4",
        "--max-seconds-per-point",
        "6" if quick else "12",
        "--out",
        str(out),
    ]
    code = _PATCHED_PROFILE.replace("{kwargs}", repr(worker))
    subprocess.run(
        [sys.executable, "-c", code, *args], check=True, env=loadgen.child_env(), cwd=ROOT
    )
    profile: dict[str, Any] = json.loads((out / "profile.json").read_text())
    return profile


def _knee_and_points(profile: dict[str, Any]) -> tuple[int | None, list[str]]:
    """The knee batch, and each batch-sweep point with its worker CPU per input."""
    knee = profile.get("knee") or {}
    points = []
    for p in profile.get("points", []):
        if p.get("sweep") != "batch":
            continue
        rps = p["throughput_rps"]
        cores = p.get("worker_cpu_cores")
        cpu = f"{1e3 * cores / rps:.1f}" if cores is not None and rps > 0 else "?"
        points.append(
            f"B{p['batch_size']} {rps:.1f} req/s, p95 {p['latency_p95_ms']:.0f} ms, mean batch "
            f"{p.get('mean_batch_size') or 0:.2f}, {p.get('batch_latency_ms') or 0:.0f} ms/batch, "
            f"worker CPU {cpu} ms per input"
        )
    return knee.get("batch_size"), points


def _knee_under_slo(path: Path, p95_ms: float) -> int | None:
    """The batch sweep's knee under a p95 SLO, from the same points (the profiler's rule)."""
    from tidegate.core.capacity import Slo
    from tidegate.engines.profile import load_profile
    from tidegate.profile.recommend import sweep_knee

    knee = sweep_knee(load_profile(path).points, "batch", Slo(p95_ms=p95_ms), "embeddings")
    if knee is None or not knee.meets_slo:
        return None
    return knee.point.batch_size


# The pairing probe: what the rule's choice costs the engine itself, without the closed loop.
PROBE_SEED = 0  # tidegate profile's default seed: the same mixed workload
PROBE_PAIRS, PROBE_PAIRS_QUICK = 300, 100
MINILM_MAX_TOKENS = 256  # the engine truncates longer inputs


def _probe_engine() -> tuple[Any, Any]:
    """minilm loaded in this process, and texts of a wanted token count for its tokenizer."""
    from tidegate.engines.registry import build_engine
    from tidegate.profile.workload import TextSizer, probe_text

    engine: Any = build_engine("minilm")
    engine.load()
    probes = [
        (words, engine.count_tokens([probe_text(words, "calibrate")])[0])
        for words in TextSizer.PROBE_WORDS
    ]
    return engine, TextSizer.calibrated(probes, PROBE_SEED)


def _engine_ms(engine: Any, texts: list[str]) -> float:
    started = time.perf_counter()
    engine.embed_sync(texts)
    return (time.perf_counter() - started) * 1e3


@dataclass(frozen=True)
class _Pair:
    tokens: tuple[int, int]  # as the worker counts them (the engine truncates past 256)
    padded_ms: float  # one batch of the two
    alone_ms: tuple[float, float]  # each in a batch of one


def _forms(config: Any, pair: _Pair) -> bool:
    """Whether length-aware formation under ``config`` batches the pair together: a queue of
    the two, the head and one candidate, as in the profile's batch sweep at batch 2."""
    from tidegate.core.batching import BatchView, plan_batch
    from tidegate.core.request import Request

    head = [Request(f"p{n}", "minilm", 1, 0.0, cost_tokens=t) for n, t in enumerate(pair.tokens)]
    return len(getattr(plan_batch(BatchView(head, 2), config, 0.0), "batch", ())) == 2


def _time_pairs(num_pairs: int) -> list[_Pair]:
    """Random pairs of the mixed workload, each run padded together and apart, back to back
    (order alternating), so load on the machine shifts both alike."""
    import numpy as np

    from tidegate.profile.workload import synthetic_workload

    engine, sizer = _probe_engine()
    lengths = synthetic_workload("embeddings", PROBE_SEED).input_tokens
    rng = np.random.default_rng(PROBE_SEED)
    _engine_ms(engine, [sizer.text(64, 0)] * 2)  # warm up
    pairs = []
    for k in range(num_pairs):
        i, j = (int(x) for x in rng.choice(len(lengths), 2))
        texts = [sizer.text(lengths[i], i), sizer.text(lengths[j], j)]
        a, b = engine.count_tokens(texts)
        if k % 2:
            padded = _engine_ms(engine, texts)
            alone = (_engine_ms(engine, texts[:1]), _engine_ms(engine, texts[1:]))
        else:
            alone = (_engine_ms(engine, texts[:1]), _engine_ms(engine, texts[1:]))
            padded = _engine_ms(engine, texts)
        pairs.append(_Pair((a, b), padded, alone))
    return pairs


def _padded_over_apart(pairs: list[_Pair]) -> str:
    """Engine time of the pairs padded together over the same pairs apart."""
    if not pairs:
        return "none (0 pairs)"
    padded = sum(p.padded_ms for p in pairs)
    return f"{padded / sum(sum(p.alone_ms) for p in pairs):.3f}x ({len(pairs)} pairs)"


def pairing_probe(quick: bool) -> list[str]:
    """What length-aware pairs cost the engine itself, without the closed loop: the batch of
    one's overhead and per-token cost (least squares over the singles), then engine time
    padded together over apart for every pair and for the pairs each rule forms or leaves:
    the ratio rule (``LENGTH_FLAGS``) and the rule on cost with the overhead just measured."""
    import numpy as np

    from tidegate.core.batching import BatchConfig

    num_pairs = PROBE_PAIRS_QUICK if quick else PROBE_PAIRS
    pairs = _time_pairs(num_pairs)
    singles = [
        (min(t, MINILM_MAX_TOKENS), ms)
        for p in pairs
        for t, ms in zip(p.tokens, p.alone_ms, strict=True)
    ]
    fit = np.array([[1.0, t] for t, _ in singles])
    (overhead, per_token), *_ = np.linalg.lstsq(fit, np.array([ms for _, ms in singles]))
    overhead_tokens = max(0.0, float(overhead / per_token))
    mean_tokens = float(np.mean([t for t, _ in singles]))
    mean_ms = overhead + per_token * mean_tokens
    print(f"\n## Pairing probe: {num_pairs} random pairs of the mixed workload on minilm\n")
    print(
        f"- a batch of one: {overhead:.1f} ms + {per_token:.3f} ms per token (the overhead is "
        f"{overhead_tokens:.0f} tokens of work); mean input {mean_tokens:.1f} tokens"
    )
    print(
        f"- the most batch 2 can gain (pairs of equal length, half the overhead saved per "
        f"input): {mean_ms / (mean_ms - overhead / 2):.3f}x the inputs per engine second"
    )
    print(f"- engine time padded together / apart, every pair: {_padded_over_apart(pairs)}")
    rules = {
        f"ratio {MAX_PADDING_RATIO:g}": None,
        f"cost, overhead {overhead_tokens:.0f} tokens": overhead_tokens,
    }
    verdicts = []
    for name, on_cost in rules.items():
        config = BatchConfig(
            max_batch_size=2,
            batch_window_ms=0.0,
            length_candidates=LENGTH_CANDIDATES,
            max_padding_ratio=MAX_PADDING_RATIO,
            batch_overhead_tokens=on_cost,
        )
        formed = [p for p in pairs if _forms(config, p)]
        left = [p for p in pairs if not _forms(config, p)]
        print(
            f"- rule {name}: the pairs it forms {_padded_over_apart(formed)}, "
            f"those it leaves apart {_padded_over_apart(left)}"
        )
        saves = sum(p.padded_ms for p in formed) < sum(sum(p.alone_ms) for p in formed)
        verdicts.append(
            _verdict(
                bool(formed) and saves,
                f"length-aware pairs ({name}) cost the engine less than apart: "
                f"{_padded_over_apart(formed)}",
            )
        )
    return verdicts


def profile_part(quick: bool) -> list[str]:
    root = Path(tempfile.mkdtemp(prefix="bench_batching_profile_"))
    workers = {
        "fixed rule": {},
        f"length-aware, ratio {MAX_PADDING_RATIO:g}": LENGTH_FLAGS,
        f"length-aware, on cost ({OVERHEAD_TOKENS:g} tokens)": {
            **LENGTH_FLAGS,
            "batch_overhead_tokens": OVERHEAD_TOKENS,
        },
    }
    folders = {name: root / f"workers-{index}" for index, name in enumerate(workers)}
    profiles = {name: _profile_knee(folders[name], workers[name], quick) for name in workers}
    print(f"\n## tidegate profile, default mixed workload (files under {root})\n")
    knees = {}
    for name, profile in profiles.items():
        knee, points = _knee_and_points(profile)
        knees[name] = knee
        print(
            f"- {name}: knee batch {knee} (with a {SLO_P95_MS:g} ms p95 SLO, from the same "
            f"points: {_knee_under_slo(folders[name] / 'profile.json', SLO_P95_MS)}); "
            f"{', '.join(points)}"
        )
    fixed = knees.pop("fixed rule")
    return [
        _verdict(
            knee is not None and knee > 1,
            f"profile knee on the default mixed workload: {fixed} (fixed rule) -> {knee} "
            f"({name}), target above batch 1",
        )
        for name, knee in knees.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["sim", "real", "profile", "pairs"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--verdict", type=Path)
    parser.add_argument(
        "--without-cap",
        action="store_true",
        help="adaptive without the AIMD cap (the windows alone), to tell the levers apart",
    )
    parser.add_argument(
        "--lever",
        choices=("level", "load"),
        help="adaptive with one window lever alone, no cap: the level windows (high: 0) or "
        "the load-aware window",
    )
    args = parser.parse_args()
    global ADAPTIVE, ADAPTIVE_FLAGS
    if args.without_cap or args.lever:
        ADAPTIVE = {k: v for k, v in ADAPTIVE.items() if k != "target_p99_ms"}
        ADAPTIVE_FLAGS = ADAPTIVE_FLAGS[:-2]
    if args.lever:  # the other window's setting and flags go too
        other = "load_aware_window" if args.lever == "level" else "window_ms_by_priority"
        ADAPTIVE = {**ADAPTIVE, other: FIXED.get(other, False)}  # as the fixed rule has it
        ADAPTIVE_FLAGS = ADAPTIVE_FLAGS[:2] if args.lever == "level" else ("--load-aware-window",)
    verdicts: list[str] = []
    errors: list[str] = []
    real = functools.partial(real_part, adaptive_flags=ADAPTIVE_FLAGS)
    parts = (("sim", sim_part), ("real", real), ("profile", profile_part), ("pairs", pairing_probe))
    for part, run in parts:
        if part not in args.parts:
            continue
        try:
            verdicts += run(args.quick)
        except Exception as exc:  # a part that failed is an ERROR row, the others still count
            errors.append(f"{part}: {exc!r}")
            print(f"ERROR {part}: {exc!r}", file=sys.stderr)
    print("\n## Verdicts\n")
    for line in verdicts:
        print(line)
    write_verdicts(args.verdict, "bench_batching", verdicts, errors)


if __name__ == "__main__":
    main()
