"""Trace readers: the files in ``../shared/traces`` (see its README) and our own CSV.

- Azure LLM inference (``TIMESTAMP,ContextTokens,GeneratedTokens``): times relative to
  the first row;
- Mooncake JSONL (``timestamp`` ms, ``input_length``, ``output_length``): its timestamps
  are quantised into ~3 s buckets, so the requests of a bucket are spread uniformly (seeded)
  over the bucket, up to the next distinct timestamp;
- ServeGen: a per-tenant ``chunk-N-trace.csv`` (no header; ``window_start_s, rate_rps, cv,
  pattern, shape, scale`` per 600 s window), a folder of them (one tenant each), or
  ``aggregate_rate_10min.csv#CATEGORY/MODEL`` (the summed rate, Poisson within a window).
  They carry no lengths: lengths come from a ``Lengths``;
- ours: ``arrival_s,prompt_tokens,output_tokens,priority,tenant`` with a header; priority
  and tenant may be empty.

``open_trace`` tells them apart by content, not by name, and returns a ``Workload``.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import random
from collections.abc import Iterator
from pathlib import Path

from tidegate.errors import ConfigError
from tidegate.sim.synthetic import Gaps, Lengths, LognormalLengths, RateWorkload, Segment
from tidegate.sim.workload import NO_SCALE, Arrival, Scale, TraceWorkload, Workload

OWN_HEADER = ("arrival_s", "prompt_tokens", "output_tokens", "priority", "tenant")
SERVEGEN_WINDOW_S = 600.0


def read_azure(path: str | Path) -> Iterator[Arrival]:
    """``2023-11-16 18:15:46.6805900`` (7 fractional digits): days and seconds apart."""
    with open(path, newline="") as file:
        header = file.readline()
        if not header.startswith("TIMESTAMP"):
            raise ConfigError(str(path), "line 1", "not an Azure trace header", _AZURE_FIX)
        first: tuple[int, float] | None = None
        days: dict[str, int] = {}
        for number, line in enumerate(file, start=2):
            if not line.strip():
                continue
            try:
                stamp, context, generated = line.rstrip("\n").split(",")
                date, clock = stamp.split(" ")
                day = days.get(date)
                if day is None:
                    day = days[date] = dt.date.fromisoformat(date).toordinal()
                hours, minutes, seconds_text = clock.split(":")
                seconds = int(hours) * 3600.0 + int(minutes) * 60.0 + float(seconds_text)
                prompt, output = int(context), int(generated)
            except ValueError as exc:
                raise ConfigError(str(path), f"line {number}", str(exc), _AZURE_FIX) from None
            if first is None:
                first = (day, seconds)
            yield Arrival((day - first[0]) * 86400.0 + seconds - first[1], prompt, output)


_AZURE_FIX = "expected TIMESTAMP,ContextTokens,GeneratedTokens rows (see traces/README.md)"


def read_mooncake(path: str | Path, seed: int = 0) -> Iterator[Arrival]:
    """Each request with its ``hash_ids`` as ``Arrival.blocks`` (prefix blocks, 512 tokens)."""
    rng = random.Random(f"{seed}:mooncake")
    bucket: list[_Row] = []
    bucket_ms: int | None = None
    with open(path) as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                stamp = int(row["timestamp"])
                blocks = tuple(int(block) for block in row.get("hash_ids", ()))
                entry = (int(row["input_length"]), int(row["output_length"]), blocks)
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(
                    str(path),
                    f"line {number}",
                    f"not a Mooncake record ({exc})",
                    "expected {timestamp, input_length, output_length, hash_ids} per line",
                ) from None
            if bucket_ms is not None and stamp != bucket_ms:
                yield from _spread(bucket, bucket_ms, stamp, rng)
                bucket = []
            bucket_ms = stamp
            bucket.append(entry)
    if bucket_ms is not None:
        yield from _spread(bucket, bucket_ms, bucket_ms + 3000, rng)


_Row = tuple[int, int, tuple[int, ...]]  # prompt tokens, output tokens, prefix blocks


def _spread(
    bucket: list[_Row], start_ms: int, end_ms: int, rng: random.Random
) -> Iterator[Arrival]:
    width_s = max(0.0, (end_ms - start_ms) / 1e3)
    times = sorted(start_ms / 1e3 + rng.random() * width_s for _ in bucket)
    for at, (prompt, output, blocks) in zip(times, bucket, strict=True):
        yield Arrival(at, prompt, output, blocks=blocks)


def read_own(path: str | Path) -> Iterator[Arrival]:
    with open(path, newline="") as file:
        reader = csv.reader(file)
        header = tuple(column.strip() for column in next(reader, []))
        if header[:3] != OWN_HEADER[:3]:
            raise ConfigError(
                str(path), "line 1", f"header {','.join(header)!r}", f"use {','.join(OWN_HEADER)}"
            )
        last = 0.0
        for number, row in enumerate(reader, start=2):
            if not row:
                continue
            try:
                at, prompt, output = float(row[0]), int(row[1]), int(row[2])
            except (ValueError, IndexError) as exc:
                raise ConfigError(
                    str(path), f"line {number}", str(exc), f"columns: {','.join(OWN_HEADER)}"
                ) from None
            if at < last:
                raise ConfigError(
                    str(path), f"line {number}", "arrival_s goes backwards", "sort by arrival_s"
                )
            last = at
            priority = row[3].strip() if len(row) > 3 and row[3].strip() else None
            tenant = row[4].strip() if len(row) > 4 else ""
            yield Arrival(at, prompt, output, priority, tenant)


def servegen_segments(path: str | Path) -> list[Segment]:
    segments = []
    with open(path, newline="") as file:
        for number, row in enumerate(csv.reader(file), start=1):
            if not row:
                continue
            try:
                start, rate = float(row[0]), float(row[1])
                pattern, shape = row[3].strip().lower(), float(row[4] or 0)
            except (ValueError, IndexError) as exc:
                raise ConfigError(
                    str(path),
                    f"line {number}",
                    str(exc),
                    "expected window_start_s,rate_rps,cv,pattern,shape,scale",
                ) from None
            gaps = Gaps(pattern, shape) if pattern in ("gamma", "weibull") and shape > 0 else Gaps()
            segments.append(Segment(start, start + SERVEGEN_WINDOW_S, rate, gaps))
    return segments


def servegen_aggregate(path: str | Path, selection: str) -> list[Segment]:
    category, _, model = selection.partition("/")
    segments = []
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            if row["category"] == category and row["model"] == model:
                start = float(row["window_start_s"])
                segments.append(
                    Segment(start, start + SERVEGEN_WINDOW_S, float(row["total_rate_rps"]))
                )
    if not segments:
        raise ConfigError(
            str(path), "(selection)", f"no rows for {selection!r}", "write PATH#CATEGORY/MODEL"
        )
    return segments


def _chunk_key(path: Path) -> tuple[int, str]:
    middle = path.name.removeprefix("chunk-").removesuffix("-trace.csv")
    return (int(middle), path.name) if middle.isdigit() else (1 << 30, path.name)


def _sniff(path: Path) -> str:
    if path.is_dir():
        return "servegen-dir"
    with open(path) as file:
        first = file.readline()
    if first.lstrip().startswith("{"):
        return "mooncake"
    if first.startswith("TIMESTAMP"):
        return "azure"
    if first.startswith("arrival_s"):
        return "own"
    if first.startswith("category,model,window_start_s"):
        return "servegen-aggregate"
    if len(first.split(",")) == 6:
        return "servegen"
    raise ConfigError(
        str(path),
        "line 1",
        "not a trace format tidegate knows",
        "use an Azure CSV, Mooncake JSONL, ServeGen rate file, or arrival_s,prompt_tokens,"
        "output_tokens,priority,tenant",
    )


def open_trace(
    spec: str, scale: Scale = NO_SCALE, seed: int = 0, lengths: Lengths | None = None
) -> Workload:
    """A workload from a trace file (``PATH`` or ``PATH#SELECTION`` for the aggregate)."""
    raw, _, selection = spec.partition("#")
    path = Path(raw)
    if not path.exists():
        raise ConfigError(raw, "(file)", "no such file or folder", "check the path")
    kind = _sniff(path)
    name = path.name + (f"#{selection}" if selection else "")
    lengths = lengths or LognormalLengths()
    if kind == "azure":
        return TraceWorkload(name, lambda: read_azure(path), scale, seed)
    if kind == "mooncake":
        return TraceWorkload(name, lambda: read_mooncake(path, seed), scale, seed)
    if kind == "own":
        return TraceWorkload(name, lambda: read_own(path), scale, seed)
    if kind == "servegen-aggregate":
        if not selection:
            raise ConfigError(raw, "(selection)", "which model?", "write PATH#CATEGORY/MODEL")
        segments = servegen_aggregate(path, selection)
        return RateWorkload(name, [(selection, segments)], lengths, scale, seed)
    files = sorted(path.glob("chunk-*-trace.csv"), key=_chunk_key) if path.is_dir() else [path]
    if not files:
        raise ConfigError(raw, "(folder)", "no chunk-N-trace.csv files", "give a ServeGen folder")
    tenants = [(file.name.removesuffix("-trace.csv"), servegen_segments(file)) for file in files]
    return RateWorkload(name, tenants, lengths, scale, seed)
