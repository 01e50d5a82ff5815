"""How steady this machine's CPU is: the same work, timed over and over on one thread.

A benchmark that compares latency percentiles between runs (bench_sim_fidelity's 15% target)
needs a host that does the same work in the same time from one minute to the next. On a
shared virtual machine it may not: the hypervisor's other tenants take caches, memory
bandwidth and clock, and none of it shows as steal time. This probe measures it directly:
every ``--every-s`` it runs a fixed piece of work (a float32 matrix product on one torch
thread, or a pure-Python loop without torch) ``REPEATS`` times and records the median of
the thread's own CPU time (``time.thread_time``), so that waiting for a core does not count,
only how fast the core ran. Nothing else of the benchmark runs meanwhile.

It reports the spread of those medians: p10, p50, p90 and the ratios p90/p10 and max/min.
A dedicated core should keep p90/p10 within a few percent (this machine has none to show
it); at 1.3x, measured here, a workload at 80% of its measured capacity spends part of every
run at or past 100%. bench_sim_fidelity calls a host steady at p90/p10 <= 1.06.

Run:
    .venv/bin/python benchmarks/host_speed.py [--seconds 60] [--every-s 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

REPEATS = 5  # timings per sample; the sample is their median
MATRIX = 384  # float32 square matrices: about 13 ms of one core per repeat here
PRODUCTS = 8


@dataclass(frozen=True)
class HostSpeed:
    work: str  # what was timed
    seconds: float  # how long the probe ran
    samples_ms: tuple[float, ...]  # per sample, the median thread CPU time of the work

    def quantile(self, q: float) -> float:
        ordered = sorted(self.samples_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def spread(self) -> float:
        """p90 / p10 of the samples."""
        return self.quantile(0.9) / self.quantile(0.1)

    @property
    def range(self) -> float:
        """max / min of the samples."""
        return max(self.samples_ms) / min(self.samples_ms)

    def line(self) -> str:
        return (
            f"host speed ({self.work}, {len(self.samples_ms)} samples over {self.seconds:.0f} s, "
            f"one thread's CPU time): p10 {self.quantile(0.1):.1f}, p50 {self.quantile(0.5):.1f}, "
            f"p90 {self.quantile(0.9):.1f} ms; p90/p10 {self.spread:.2f}x, max/min "
            f"{self.range:.2f}x"
        )

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "spread": self.spread, "range": self.range}


def _work() -> tuple[str, Callable[[], None]]:
    """The fixed piece of work: torch on one thread where installed, else pure Python."""
    try:
        import torch
    except ImportError:

        def loop() -> None:
            total = 0
            for i in range(400_000):
                total += i * i % 7
            if total < 0:
                raise AssertionError

        return "a pure-Python loop", loop
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    a = torch.rand(MATRIX, MATRIX, generator=generator)
    b = torch.rand(MATRIX, MATRIX, generator=generator)

    def products() -> None:
        c = a
        for _ in range(PRODUCTS):
            c = torch.tanh(c @ b)

    return f"{PRODUCTS} products of {MATRIX}x{MATRIX} float32 matrices", products


def probe(seconds: float, every_s: float = 1.0) -> HostSpeed:
    """Sample the work's thread CPU time for ``seconds`` (at least one sample)."""
    work, run = _work()
    for _ in range(3):  # warm up: allocator, caches, lazy initialisation
        run()
    samples: list[float] = []
    started = time.monotonic()
    while not samples or time.monotonic() - started < seconds:
        times = []
        for _ in range(REPEATS):
            before = time.thread_time()
            run()
            times.append(time.thread_time() - before)
        samples.append(statistics.median(times) * 1e3)
        time.sleep(every_s)
    return HostSpeed(work, time.monotonic() - started, tuple(samples))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--every-s", type=float, default=1.0)
    parser.add_argument("--json", type=Path, help="write the samples and the spread here")
    args = parser.parse_args()
    speed = probe(args.seconds, args.every_s)
    print(speed.line())
    if args.json:
        args.json.write_text(json.dumps(speed.as_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
