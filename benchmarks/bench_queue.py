"""Queue pick cost: WaitQueue against the two designs it replaces.

At each queue depth, measures the latency of one pick of the most urgent request (p50 and p99,
each pick timed alone with ``time.perf_counter_ns``) and the throughput of a steady loop of
(submit one request, pick one), for three implementations of the same ordering, the key
(effective priority with aging, arrival, submission seq):

  (a) sorted list   a plain list re-sorted by the key before every pick (the original design);
  (b) heap rebuild  a heap whose keys are all recomputed and re-heapified at every pick where
                    the clock has moved (aging changes keys), then heappop;
  (c) WaitQueue     tidegate.core.queue.WaitQueue: per-level FIFOs, a pick merges level heads.

Workload, identical for all three: pre-fill to depth D with levels 0/1/2 drawn at random
(seeded) and arrivals spread uniformly over the 60 s before the start, so that under the
default aging (threshold 30 s, rate 0.5 level/s) part of the queue has aged; then 3 warm-up
steps and the timed steps, each (clock += 1 ms, submit one request arriving now, pick one), so
the depth stays at D. A cell runs until its time budget is spent, with at least --min-steps
and at most --max-steps steps, so slow approaches run fewer steps (below 100 steps, p99 is the
maximum). The garbage collector is off during timed steps. Before measuring, a small run with
a coarse clock (aging crossings between levels) asserts that all three pick the same ids.

Run (about half a minute on 2 cores):
    .venv/bin/python benchmarks/bench_queue.py [--depths 1000 10000 100000] [--seed 0]
        [--budget-s 2.0] [--min-steps 50] [--max-steps 20000] [--quick] [--verdict v.json]
Prints a markdown table, then PASS/MISS lines for the targets (at depth 100k: WaitQueue pick
p99 under 20 us, and at least 1000x below the sorted list's). Always exits 0.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from summary import write_verdicts
from tidegate.core.queue import Admitted, AgingConfig, QueueConfig, WaitQueue, effective_priority
from tidegate.core.request import Request

START_S = 1000.0  # clock at the end of the pre-fill
SPREAD_S = 60.0  # pre-filled arrivals lie in [START_S - SPREAD_S, START_S)
STEP_S = 0.001  # clock advance per steady step
WARMUP_STEPS = 3
TARGET_DEPTH = 100_000
TARGET_P99_US = 20.0
TARGET_RATIO = 1000.0  # keep in step with the PASS/MISS text


class Approach(Protocol):
    name: str

    def submit(self, request: Request, now: float) -> None: ...

    def pick(self, now: float) -> Request: ...


class SortedList:
    name = "(a) sorted list"

    def __init__(self, aging: AgingConfig, depth: int) -> None:
        self._aging = aging
        self._items: list[tuple[int, Request]] = []
        self._seq = 0

    def submit(self, request: Request, now: float) -> None:
        self._items.append((self._seq, request))
        self._seq += 1

    def pick(self, now: float) -> Request:
        aging = self._aging

        def key(item: tuple[int, Request]) -> tuple[float, float, int]:
            seq, r = item
            return (effective_priority(r.priority, r.arrival_at, now, aging), r.arrival_at, seq)

        self._items.sort(key=key)
        return self._items.pop(0)[1]


class HeapRebuild:
    name = "(b) heap rebuild"

    def __init__(self, aging: AgingConfig, depth: int) -> None:
        self._aging = aging
        self._heap: list[tuple[float, float, int, Request]] = []
        self._seq = 0
        self._keyed_at = -math.inf  # the clock the keys in the heap were computed at

    def submit(self, request: Request, now: float) -> None:
        prio = effective_priority(request.priority, request.arrival_at, now, self._aging)
        heapq.heappush(self._heap, (prio, request.arrival_at, self._seq, request))
        self._seq += 1

    def pick(self, now: float) -> Request:
        if now != self._keyed_at:
            aging = self._aging
            self._heap = [
                (effective_priority(r.priority, r.arrival_at, now, aging), r.arrival_at, seq, r)
                for _, _, seq, r in self._heap
            ]
            heapq.heapify(self._heap)
            self._keyed_at = now
        return heapq.heappop(self._heap)[3]


class WaitQueueAdapter:
    name = "(c) WaitQueue"

    def __init__(self, aging: AgingConfig, depth: int) -> None:
        self._queue = WaitQueue(QueueConfig(max_size=depth + 1000, aging=aging))

    def submit(self, request: Request, now: float) -> None:
        # saturation 0.0: no holdback of the medium and low levels.
        if not isinstance(self._queue.admit(request, now, 0.0), Admitted):
            raise RuntimeError(f"WaitQueue refused {request.id}")

    def pick(self, now: float) -> Request:
        return self._queue.pop(1, now)[0]


APPROACHES = (SortedList, HeapRebuild, WaitQueueAdapter)


def prefill_requests(depth: int, rng: random.Random) -> list[Request]:
    """``depth`` requests of mixed levels, in arrival order, arrived over the last SPREAD_S."""
    arrivals = sorted(START_S - rng.uniform(0.0, SPREAD_S) for _ in range(depth))
    return [Request(f"p{i}", "m", rng.randrange(3), at) for i, at in enumerate(arrivals)]


def step_requests(count: int, rng: random.Random, step_s: float) -> list[Request]:
    """One request per step, arriving at that step's clock."""
    return [
        Request(f"s{i}", "m", rng.randrange(3), START_S + (i + 1) * step_s) for i in range(count)
    ]


def check_same_order(seed: int) -> None:
    """All three approaches pick the same ids, across many aging crossings."""
    aging = AgingConfig()
    rng = random.Random(seed)
    prefill = prefill_requests(300, rng)
    # 0.1 s a step: a request waits about 30 s, so levels overtake by urgency and by aging.
    steps = step_requests(600, rng, 0.1)
    orders = []
    for cls in APPROACHES:
        approach = cls(aging, len(prefill))
        for request in prefill:
            approach.submit(request, START_S)
        picked = []
        for request in steps:
            approach.submit(request, request.arrival_at)
            picked.append(approach.pick(request.arrival_at).id)
        now = steps[-1].arrival_at
        for _ in prefill:  # drain the rest, the clock still moving
            now += 0.1
            picked.append(approach.pick(now).id)
        orders.append(picked)
    assert orders[0] == orders[1] == orders[2], "approaches disagree on the pick order"
    by_arrival = [r.id for r in sorted([*prefill, *steps], key=lambda r: r.arrival_at)]
    assert orders[0] != by_arrival, "workload too easy: the pick order is plain FIFO"


@dataclass(frozen=True, slots=True)
class Cell:
    approach: str
    depth: int
    steps: int
    p50_us: float
    p99_us: float
    ops_per_s: float


def percentile(sorted_ns: list[int], q: float) -> float:
    """Nearest-rank percentile, in microseconds."""
    return sorted_ns[max(0, math.ceil(q * len(sorted_ns)) - 1)] / 1000.0


def run_cell(
    approach: Approach,
    prefill: list[Request],
    steps: list[Request],
    budget_s: float,
    min_steps: int,
) -> Cell:
    for request in prefill:
        approach.submit(request, START_S)
    for request in steps[:WARMUP_STEPS]:
        approach.submit(request, request.arrival_at)
        approach.pick(request.arrival_at)
    latencies: list[int] = []
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        began = clock()
        budget_end = began + int(budget_s * 1e9)
        for done, request in enumerate(steps[WARMUP_STEPS:], start=1):
            now = request.arrival_at
            approach.submit(request, now)
            t0 = clock()
            approach.pick(now)
            t1 = clock()
            latencies.append(t1 - t0)
            if done >= min_steps and t1 >= budget_end:
                break
        elapsed_s = (clock() - began) / 1e9
    finally:
        gc.enable()
    latencies.sort()
    p50, p99 = percentile(latencies, 0.50), percentile(latencies, 0.99)
    return Cell(approach.name, len(prefill), len(latencies), p50, p99, len(latencies) / elapsed_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=2.0, help="timed seconds per cell")
    parser.add_argument("--min-steps", type=int, default=50)
    parser.add_argument("--max-steps", type=int, default=20_000)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: depths 1,000 and 100,000, 0.5 s per cell, at least 20 steps",
    )
    parser.add_argument("--verdict", type=Path, help="write the PASS/MISS rows as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.depths, args.budget_s, args.min_steps = [1000, TARGET_DEPTH], 0.5, 20

    check_same_order(args.seed)
    print("order check: all three approaches pick the same request ids\n")

    aging = AgingConfig()
    cells: dict[tuple[str, int], Cell] = {}
    for depth in args.depths:
        rng = random.Random(args.seed * 1_000_003 + depth)
        prefill = prefill_requests(depth, rng)
        steps = step_requests(WARMUP_STEPS + args.max_steps, rng, STEP_S)
        for cls in APPROACHES:
            cell = run_cell(cls(aging, depth), prefill, steps, args.budget_s, args.min_steps)
            cells[(cell.approach, depth)] = cell
            gc.collect()

    wq = WaitQueueAdapter.name
    print(
        "| approach | depth | steps | pick p50 µs | pick p99 µs | submit+pick ops/s "
        "| p99 / WaitQueue p99 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for depth in args.depths:
        base = cells[(wq, depth)].p99_us
        for cls in APPROACHES:
            c = cells[(cls.name, depth)]
            print(
                f"| {c.approach} | {depth:,} | {c.steps:,} | {c.p50_us:,.1f} | {c.p99_us:,.1f} "
                f"| {c.ops_per_s:,.0f} | {c.p99_us / base:,.1f}x |"
            )
    print()
    if TARGET_DEPTH not in args.depths:
        print(f"targets: n/a (depth {TARGET_DEPTH:,} not run)")
        write_verdicts(args.verdict, "bench_queue", [f"MISS depth {TARGET_DEPTH:,} not run"])
        return
    p99 = cells[(wq, TARGET_DEPTH)].p99_us
    ratio = cells[(SortedList.name, TARGET_DEPTH)].p99_us / p99
    lines: list[str] = []
    for ok, text in (
        (p99 < TARGET_P99_US, f"WaitQueue pick p99 = {p99:,.1f} µs (target < {TARGET_P99_US:g})"),
        (ratio >= TARGET_RATIO, f"sorted list / WaitQueue p99 = {ratio:,.0f}x (target >= 1,000x)"),
    ):
        lines.append(f"{'PASS' if ok else 'MISS'} at {TARGET_DEPTH:,} queued: {text}")
        print(lines[-1])
    write_verdicts(args.verdict, "bench_queue", lines)


if __name__ == "__main__":
    main()
