"""Run every benchmark and print one PASS/MISS table of their targets at the end.

Each benchmark takes ``--verdict PATH`` and writes its targets there as JSON rows
(``write_verdicts``): ``{"benchmark": name, "rows": [{"verdict": "PASS" | "MISS" | "ERROR",
"target": text}]}``. This script runs the benchmarks one after the other (their own output
goes through as it comes), then prints a table with one row per target; a benchmark that
exits non-zero, or writes no verdict, shows as ERROR with its exit code, and the others' rows
are still there.

Run (``make bench``; ``--quick`` passes each benchmark its short mode):
    .venv/bin/python benchmarks/summary.py [--quick] [--only bench_worker bench_gateway]
        [--out DIR] [--table-only]
Exits 1 when a benchmark errored, 0 otherwise (a MISS is a measured result, not an error).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = (
    "bench_queue",
    "bench_worker",
    "bench_engine_threads",
    "bench_generation",
    "bench_gateway",
    "bench_sim",
    "bench_sim_fidelity",
    "bench_join_steps",
    "bench_autoscale",
    "bench_prefix",
    "bench_fairness",
    "bench_batching",
)
VERDICTS = ("PASS", "MISS", "ERROR")


def verdict_rows(lines: Sequence[str], errors: Sequence[str] = ()) -> list[dict[str, str]]:
    """Rows from a benchmark's printed verdict lines ("PASS ...", "MISS: ..."), and one ERROR
    row per failure."""
    rows = []
    for line in lines:
        word, _, rest = line.strip().partition(" ")
        verdict = word.rstrip(":")
        if verdict not in VERDICTS:
            verdict, rest = "MISS", line.strip()
        rows.append({"verdict": verdict, "target": rest.strip()})
    for error in errors:
        text = error.strip().splitlines()
        rows.append({"verdict": "ERROR", "target": text[-1] if text else "failed"})
    return rows


def print_verdicts(path: Path | None, benchmark: str, lines: Sequence[str]) -> None:
    """Print the verdict lines as one fenced block, and write them to ``path``."""
    print("```")
    print("\n".join(lines))
    print("```")
    write_verdicts(path, benchmark, lines)


def write_verdicts(
    path: Path | None, benchmark: str, lines: Sequence[str], errors: Sequence[str] = ()
) -> None:
    """Write the benchmark's verdict rows to ``path`` (nothing when it is None)."""
    if path is None:
        return
    rows = verdict_rows(lines, errors)
    path.write_text(
        json.dumps({"benchmark": benchmark, "rows": rows}, indent=2, ensure_ascii=False)
    )


def read_rows(name: str, path: Path, status: int | None) -> list[tuple[str, str, str]]:
    """(benchmark, verdict, target) rows of one benchmark's run."""
    rows: list[tuple[str, str, str]] = []
    try:
        data = json.loads(path.read_text())
        rows = [(name, r["verdict"], r["target"]) for r in data["rows"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if status is None:
            rows.append((name, "ERROR", "no verdict file"))
        elif status == 0:
            rows.append((name, "ERROR", f"exit 0 but no verdict ({type(exc).__name__})"))
    if status:
        rows.append((name, "ERROR", f"exit code {status}"))
    return rows


def table(rows: Sequence[tuple[str, str, str]]) -> str:
    lines = ["| benchmark | verdict | target |", "|---|---|---|"]
    lines += [
        f"| {name} | {verdict} | {target.replace('|', '/')} |" for name, verdict, target in rows
    ]
    counts = {v: sum(r[1] == v for r in rows) for v in VERDICTS}
    lines.append("")
    lines.append(", ".join(f"{counts[v]} {v}" for v in VERDICTS))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark's short mode")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, help="these benchmarks only")
    parser.add_argument("--out", type=Path, help="folder for the verdict files (default: temp)")
    parser.add_argument(
        "--table-only",
        action="store_true",
        help="run nothing: print the table of the verdict files already in --out",
    )
    args = parser.parse_args(argv)
    names = args.only or list(BENCHMARKS)
    out = args.out or Path(tempfile.mkdtemp(prefix="tidegate_bench_"))
    out.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, str, str]] = []
    for name in names:
        path = out / f"{name}.json"
        if args.table_only:
            rows += read_rows(name, path, None)
            continue
        path.unlink(missing_ok=True)
        cmd = [sys.executable, str(HERE / f"{name}.py"), "--verdict", str(path)]
        cmd += ["--quick"] if args.quick else []
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        started = time.monotonic()
        status = subprocess.run(cmd, check=False).returncode
        print(f"=== {name}: exit {status} after {time.monotonic() - started:.0f} s", flush=True)
        rows += read_rows(name, path, status)
    print("\n## Benchmark verdicts\n")
    print(table(rows))
    print(f"\nverdict files: {out}")
    return 1 if any(verdict == "ERROR" for _, verdict, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
