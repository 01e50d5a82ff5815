"""Joining steps: what one step of transformers' continuous batching costs when sequences
join a batch that is decoding, against the simulator's two step models.

Why (sim/service.py, docs/benchmarks.md "Fidelity"): the simulator prices a step of ``n``
running sequences of which ``p`` join from a concurrency profile, the time to first token and
between tokens by running sequences. The profile's closed loop only ever sees joins into an
idle engine (its clients' equal answers keep them in step), while under real traffic
sequences join a batch that is decoding, one to a few at a time. How those steps cost decides
how fast a full engine refills, and so what it serves past capacity.

What: the real engine as a worker runs it (``TransformersGenerator``, one torch thread,
``--max-num-seqs`` 8), every step of its manager timed inside the manager's own thread and
labelled by the sequences decoding (``d``) and joining (``p``) in it. Two phases, one run:

1. idle joins: ``p`` chats (1, 2, 4 and every slot) sent at once to an idle engine,
   ``--rounds`` times each: the profile's closed loop;
2. staggered joins: ``--max-num-seqs`` clients, each sending its next chat as soon as its
   last one ended, for ``--seconds``, in ``--waves`` waves started 0.7 s apart, prompts
   drawn from bench_gateway's 512 sentences and answers of ``--answer-tokens`` (10 to 16):
   the chats of a wave end near each other and join, a few at a time, the batch the others
   are decoding (under a queue, chats that started together end together the same way).

From the decode-only steps (``decode(n)``, either phase) and the idle joins
(``prefill(p) = step(0, p) - decode(p)``), both models predict every mixed step (``d > 0``,
``p > 0``):

- shared prefill (the simulator before 2026-12-03): ``decode(n) + prefill(p)``;
- a lone prefill per joiner (the simulator now): ``decode(n) + p * prefill(1)``.

Printed: the steps by (``d``, ``p``) with their count, mean and each model's prediction; each
model's mean error over the mixed steps, and over those where more than one joined (with one
joiner the two models agree); the cost of a joiner in a mixed step over a lone prompt's.
Target: the simulator's model within 15% mean error on the mixed steps, and nearer than the
shared model.

Run (about 2 minutes):
    HF_HUB_OFFLINE=1 flock /tmp/bench.lock .venv/bin/python benchmarks/bench_join_steps.py
        [--model smollm2] [--max-num-seqs 8] [--rounds 4] [--seconds 40]
        [--answer-tokens 10,16] [--waves 3] [--json out.json] [--quick (2 rounds, 15 s)]
        [--verdict v.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bench_gateway as bg
import loadgen as lg
from summary import print_verdicts, write_verdicts
from tidegate.engines.base import SamplingParams
from tidegate.engines.profile import Curve
from tidegate.engines.registry import build_engine

TARGET = 0.15  # mean error of the simulator's model on the mixed steps, at most
WAVE_GAP_S = 0.7  # between the staggered phase's waves of clients


@dataclass(frozen=True, slots=True)
class Step:
    decoding: int
    joining: int
    ms: float


def time_steps(manager: Any) -> list[Step]:
    """Time every step of ``manager`` from now on (the list fills as it runs).

    The manager's loop calls ``_generation_loop_body`` once per step (prepare the batch, run
    it, update), and ``_generation_step`` inside it once the batch is prepared: that is when
    its scheduler's active requests are the step's, those without a token yet joining."""
    steps: list[Step] = []
    counts: dict[int, tuple[int, int]] = {}
    loop_body: Callable[[Any, bool], bool] = manager._generation_loop_body
    run_step: Callable[[], None] = manager._generation_step

    def timed_run() -> None:
        active = manager.batch_processor.scheduler.active_requests
        joining = sum(1 for state in active.values() if state.generated_len() == 0)
        counts[threading.get_ident()] = (len(active) - joining, joining)
        run_step()

    def timed_body(processor: Any, bootstrapping: bool) -> bool:
        counts.pop(threading.get_ident(), None)
        started = time.perf_counter()
        more = loop_body(processor, bootstrapping)
        labels = counts.pop(threading.get_ident(), None)
        if labels is not None:  # None: no batch, it waited for requests
            steps.append(Step(*labels, (time.perf_counter() - started) * 1e3))
        return more

    manager._generation_step = timed_run
    manager._generation_loop_body = timed_body
    return steps


async def chat(engine: Any, seq_id: str, prompt: list[int], max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    async for _ in engine.generate(seq_id, prompt, params):
        pass


async def idle_joins(engine: Any, prompts: list[list[int]], sizes: list[int], rounds: int) -> None:
    """``p`` chats at once on an idle engine, ``rounds`` times each (the closed loop), each
    round on other prompts (not from the prefix cache)."""
    for size in sizes:
        for r in range(rounds):
            await asyncio.gather(
                *(
                    chat(engine, f"idle-{size}-{r}-{i}", prompts[(r * size + i) % len(prompts)], 16)
                    for i in range(size)
                )
            )


async def staggered_joins(
    engine: Any,
    prompts: list[list[int]],
    clients: int,
    seconds: float,
    answers: tuple[int, int],
    waves: int,
    seed: int,
) -> None:
    """``clients`` loops, each sending its next chat as its last one ends, for ``seconds``.

    Client ``k`` is of wave ``k % waves``; the waves start ``WAVE_GAP_S`` apart, so the chats
    of a wave end near each other and join together the batch the other waves are decoding.
    Each chat's prompt is drawn from ``prompts`` (one prompt sent again and again would be
    prefilled from the manager's prefix cache) and its answer from ``answers``."""
    until = time.monotonic() + seconds
    waves = max(1, waves)

    async def client(k: int) -> None:
        draw = random.Random(f"{seed}:{k}")
        wave = k % waves
        await asyncio.sleep(wave * WAVE_GAP_S)
        n = 0
        while time.monotonic() < until:
            n += 1
            await chat(engine, f"s{k}-{n}", draw.choice(prompts), draw.randint(*answers))

    await asyncio.gather(*(client(k) for k in range(clients)))


def mean_by(steps: list[Step]) -> dict[tuple[int, int], list[float]]:
    by: dict[tuple[int, int], list[float]] = defaultdict(list)
    for s in steps:
        by[(s.decoding, s.joining)].append(s.ms)
    return by


def curve_of(values: dict[int, float]) -> Curve:
    xs = sorted(values)
    return Curve(tuple(map(float, xs)), tuple(values[x] for x in xs))


def models(by: dict[tuple[int, int], list[float]]) -> tuple[Curve, Curve] | None:
    """``decode(n)`` from the decode-only steps and ``prefill(p)`` from the idle joins."""
    decode = {n: statistics.mean(ms) for (n, p), ms in by.items() if p == 0 and n > 0}
    if not decode:
        return None
    decode_curve = curve_of(decode)
    idle = {p: statistics.mean(ms) - decode_curve(p) for (d, p), ms in by.items() if d == 0}
    if 1 not in idle:
        return None
    return decode_curve, curve_of(idle)


def predictions(step: Step, decode: Curve, prefill: Curve) -> tuple[float, float]:
    """(shared prefill, a lone prefill per joiner) for a mixed step."""
    n = step.decoding + step.joining
    return decode(n) + prefill(step.joining), decode(n) + step.joining * prefill(1)


def report(steps: list[Step]) -> tuple[list[str], dict[str, Any]]:
    by = mean_by(steps)
    fitted = models(by)
    if fitted is None:
        return ["MISS: no decode-only steps or no lone idle join measured"], {}
    decode, prefill = fitted
    print("| decoding | joining | steps | mean ms | shared prefill ms | lone prefill each ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for (d, p), ms in sorted(by.items()):
        row = f"| {d} | {p} | {len(ms)} | {statistics.mean(ms):.0f} |"
        if d and p:
            shared, lone = predictions(Step(d, p, 0.0), decode, prefill)
            row += f" {shared:.0f} | {lone:.0f} |"
        else:
            row += " | |"
        print(row)
    mixed = [s for s in steps if s.decoding and s.joining]
    if not mixed:
        return ["MISS: no step joined a decoding batch"], {}
    errors: dict[str, list[float]] = {"shared": [], "lone": []}
    per_joiner = []
    for s in mixed:
        shared, lone = predictions(s, decode, prefill)
        errors["shared"].append(abs(shared - s.ms) / s.ms)
        errors["lone"].append(abs(lone - s.ms) / s.ms)
        per_joiner.append((s.ms - decode(s.decoding + s.joining)) / s.joining)
    shared_err, lone_err = (statistics.mean(errors[k]) for k in ("shared", "lone"))
    several = [i for i, s in enumerate(mixed) if s.joining > 1]
    if several:
        print(
            f"steps where 2 or more joined ({len(several)}): mean error shared prefill "
            f"{statistics.mean(errors['shared'][i] for i in several):.1%}, a lone prefill "
            f"each {statistics.mean(errors['lone'][i] for i in several):.1%}"
        )
    joiner_ms, alone_ms = statistics.mean(per_joiner), prefill(1)
    print()
    print(
        f"a joiner in a decoding step: {joiner_ms:.0f} ms over the decode step (mean of "
        f"{len(mixed)} steps); a prompt alone on an idle engine: {alone_ms:.0f} ms "
        f"({joiner_ms / alone_ms:.2f}x); {len(mixed)} mixed steps joined "
        f"{sum(s.joining for s in mixed)} chats, {statistics.mean(s.joining for s in mixed):.1f} "
        f"a step"
    )
    lines = [
        f"{'PASS' if lone_err <= TARGET else 'MISS'} the simulator's model (a lone prefill per "
        f"joiner) on {len(mixed)} mixed steps: mean error {lone_err:.1%} (target <= "
        f"{TARGET:.0%})",
        f"{'PASS' if lone_err < shared_err else 'MISS'} nearer than the shared-prefill model: "
        f"{lone_err:.1%} against {shared_err:.1%}",
    ]
    data = {
        "steps": {f"{d},{p}": ms for (d, p), ms in sorted(by.items())},
        "mean_error": {"shared": shared_err, "lone": lone_err},
        "joiner_ms": joiner_ms,
        "alone_ms": alone_ms,
    }
    return lines, data


async def drive(engine: Any, args: argparse.Namespace) -> None:
    prompts = [engine.encode_chat([{"role": "user", "content": t}]) for t in bg.TEXTS]
    await chat(engine, "warm-up", prompts[0], 4)
    sizes = sorted({1, 2, 4, args.max_num_seqs})
    await idle_joins(engine, prompts, [s for s in sizes if s <= args.max_num_seqs], args.rounds)
    lo, _, hi = args.answer_tokens.partition(",")
    answers = (int(lo), int(hi or lo))
    await staggered_joins(
        engine, prompts, args.max_num_seqs, args.seconds, answers, args.waves, args.seed
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--answer-tokens", default="10,16", help="staggered answers: min,max")
    parser.add_argument("--waves", type=int, default=3, help="staggered clients' waves")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--verdict", type=Path, help="write the PASS/MISS rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 15 s staggered")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds = 2, 15.0
    print(
        f"bench_join_steps: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M UTC}, {os.cpu_count()} "
        f"CPUs, {lg.cpu_model()}, Python {platform.python_version()}, model {args.model}, "
        f"max_num_seqs {args.max_num_seqs}, threads {args.threads}",
        flush=True,
    )
    engine: Any = build_engine(args.model, max_num_seqs=args.max_num_seqs, threads=args.threads)
    engine.load()
    try:
        manager = engine._manager  # the engine's own; its steps are what is measured
        steps = time_steps(manager)
        asyncio.run(drive(engine, args))
    except Exception as exc:  # an engine or transformers without these internals
        write_verdicts(args.verdict, "bench_join_steps", [], [f"{type(exc).__name__}: {exc}"])
        raise
    finally:
        engine.close()
    lines, data = report(list(steps))
    print()
    print_verdicts(args.verdict, "bench_join_steps", lines)
    if args.json:
        args.json.write_text(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
