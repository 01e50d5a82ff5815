"""Gateway code A/B: two (or more) source trees of tidegate, each serving as a gateway in
front of the same zero-cost simulated worker, measured in interleaved rounds.

What a change to the proxy path gives, on one machine in one run: req/s, the gateway's CPU
per request and p50 at concurrency 1 and 64, per round (the spread is the noise). Each tree
is a ``src`` folder: check the old commit out beside this one first, e.g.

    git worktree add /tmp/tidegate-old <commit>
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/ab_gateway.py \\
        old=/tmp/tidegate-old/src new=src [--rounds 3] [--seconds 5]

The gateway processes run this venv's ``tidegate`` with ``PYTHONPATH`` set to the tree, so
the trees must work with this venv's packages. Every process it starts is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from pathlib import Path

import bench_gateway as bg
import loadgen as lg

CONCURRENCY = (1, 64)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", help="NAME=PATH of a tidegate src folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="per round and tree")
    return parser.parse_args()


async def measure(
    gateways: dict[str, lg.Child], rounds: int, seconds: float
) -> dict[tuple[str, int], list[tuple[float, float, float]]]:
    payloads = bg.bodies("sim")
    results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for c in CONCURRENCY:  # warm every gateway's connections first
        for gateway in gateways.values():
            await lg.closed_loop(gateway.url, "/v1/embeddings", payloads, c, asyncio.sleep(1))
    for _ in range(rounds):
        for c in CONCURRENCY:
            for name, gateway in gateways.items():
                before = lg.cpu_s(gateway.pid)
                window = asyncio.sleep(seconds)
                records = await lg.closed_loop(gateway.url, "/v1/embeddings", payloads, c, window)
                cpu = lg.cpu_s(gateway.pid) - before
                ok = [r for r in records if r.status == 200]
                p50 = statistics.median((r.end - r.start) * 1e3 for r in ok) if ok else None
                row = (len(ok) / seconds, 1e6 * cpu / max(len(ok), 1), p50 or float("nan"))
                results.setdefault((name, c), []).append(row)
    return results


def main() -> int:
    args = parse_args()
    trees = dict(tree.split("=", 1) for tree in args.trees)
    logdir = Path(tempfile.mkdtemp(prefix="ab_gateway_"))
    profile = bg.write_profile(logdir / "zero.json")
    worker = lg.start_worker(
        "worker", logdir, "--model", "sim", "--engine", "simulated", "--profile", str(profile),
        "--max-batch-size", str(bg.MAX_BATCH), "--batch-window-ms", "0",
    )  # fmt: skip
    gateways: dict[str, lg.Child] = {}
    try:
        for name, src in trees.items():
            os.environ["PYTHONPATH"] = str(Path(src).resolve())
            try:
                gateways[name] = bg.start_gateway(
                    f"gw-{name}", logdir, "sim", worker.url, "priority"
                )
            finally:
                del os.environ["PYTHONPATH"]
        results = asyncio.run(measure(gateways, args.rounds, args.seconds))
    finally:
        for gateway in gateways.values():
            lg.stop(gateway)
        lg.stop(worker)
    print("| tree | concurrency | req/s per round | gateway CPU µs/req | p50 ms |")
    print("|---|---:|---|---|---|")
    for (name, c), rows in results.items():
        cells = [", ".join(lg.fmt(r[i], d) for r in rows) for i, d in ((0, 0), (1, 0), (2, 2))]
        print(f"| {name} | {c} | {' | '.join(cells)} |")
    print(f"logs: {logdir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
