"""The files of ``--out``: profile.json and recommended.yaml (report.md: report.py, .png: plots.py).

``profile.json`` is an ``EngineProfile`` (engines/profile.py) written by ``profile_data``:
the curves the simulated engine replays, every measured point, the knee, the SLO, the
workload, and under ``measured`` how and where it was measured. ``recommended.yaml`` is a
model entry for ``tidegate serve`` with a comment above every setting that says which
measurement chose it. All four files are written even when the run was cut short; they say
so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from tidegate import __version__
from tidegate.engines.profile import Curve, EngineProfile, MeasuredPoint, profile_data
from tidegate.profile.openloop import (
    CLIENT_CURVES,
    calibrated_curve,
    chosen,
    generation_curves,
    measured_join,
)
from tidegate.profile.options import ProfileOptions
from tidegate.profile.plots import write_report_png
from tidegate.profile.recommend import Recommendation, Setting, slo_text
from tidegate.profile.record import RunRecord, host_facts
from tidegate.profile.report import report_markdown


def build_profile(
    record: RunRecord, points: Sequence[MeasuredPoint], rec: Recommendation
) -> tuple[EngineProfile, str]:
    """The profile and a sentence on where its curve came from."""
    o = record.options
    latency, ttft, itl, source = _curves(points, record.task, o)
    latency, ttft, itl, source = _open_loop_calibrated((latency, ttft, itl), source, record)
    joined = measured_join(record.open_loop) if ttft is not None else None
    if joined is not None:
        source = (
            f"{source}; a prompt joining a decoding batch costs {joined.join_ms:.1f} ms (the "
            f"engine's own steps in the open loop, {joined.num_joins} joins)"
        )
    profile = EngineProfile(
        model=o.model,
        task=record.task,
        device=o.device,
        memory_mb=rec.memory_mb,
        weights_mb=record.weights_mb or 0.0,
        batch_latency_ms=latency,
        ttft_ms=ttft,
        itl_ms=itl,
        join_ms=None if joined is None else joined.join_ms,
        engine=record.engine,
        points=tuple(points),
        knee=rec.knee,
        slo=o.slo,
        workload=record.workload,
    )
    return profile, source


def _curves(
    points: Sequence[MeasuredPoint], task: str, o: ProfileOptions
) -> tuple[Curve | None, Curve | None, Curve | None, str]:
    if task == "generate":
        # Beyond max_num_seqs the extra sequences wait: their TTFT is queueing, not the engine.
        running = [
            p
            for p in points
            if p.ttft_mean_ms is not None
            and p.num_requests > 0  # a point cut before any answer measured nothing
            and (not o.local or p.concurrency <= o.max_batch)
        ]
        if not running:
            return None, None, None, CLIENT_CURVES
        return (None, *generation_curves(running))
    batch = [p for p in points if p.sweep == "batch" and p.batch_latency_ms is not None]
    if not batch:
        batch = [p for p in points if p.batch_latency_ms is not None]
    if batch:
        pairs = {(p.mean_batch_size or p.batch_size or 1): p.batch_latency_ms or 0.0 for p in batch}
        return _curve(pairs), None, None, "engine time per batch from the worker's /metrics"
    pairs = {p.concurrency: p.latency_p50_ms for p in points if p.sweep == "concurrency"}
    source = (
        "request latency p50 per concurrency: the server's batching is unknown, so a "
        "concurrency of C stands for a batch of C (an approximation)"
    )
    return _curve(pairs), None, None, source


def _open_loop_calibrated(
    curves: tuple[Curve | None, Curve | None, Curve | None], source: str, record: RunRecord
) -> tuple[Curve | None, Curve | None, Curve | None, str]:
    """The batch curve (generation: the TTFT and ITL curves) times the open-loop factor
    (profile/openloop.py), where one was measured."""
    point = chosen(record.open_loop)
    factor = None if point is None else point.factor
    at = None if point is None else point.at_batch
    if factor is None or at is None or all(c is None for c in curves):
        return (*curves, source)
    latency, ttft, itl = (None if c is None else calibrated_curve(c, at, factor) for c in curves)
    what = "sequences decoding" if record.task == "generate" else "batch"
    source = (
        f"{source}, times the open-loop factor {factor:.2f} (measured at mean {what} "
        f"{at:.1f}; from 1 at 1, linear up to there)"
    )
    return latency, ttft, itl, source


def _curve(pairs: dict[float, float]) -> Curve | None:
    if not pairs:
        return None
    xs = tuple(sorted(float(round(x, 2)) for x in pairs))
    by_x = {float(round(x, 2)): y for x, y in pairs.items()}
    return Curve(xs, tuple(round(by_x[x], 3) for x in xs))


def measured_record(record: RunRecord, curve_source: str) -> dict[str, Any]:
    o = record.options
    return {
        "at": record.started_at,
        "duration_s": round(record.duration_s, 1),
        "complete": record.stopped is None,
        "stopped": record.stopped,
        "command": o.command,
        "url": o.url,
        "through_gateway": o.through_gateway,
        "serve_config": None if o.serve_config is None else str(o.serve_config),
        "tidegate": __version__,
        "host": host_facts(),
        "climb_stops": record.climb_stops,
        "curve_source": curve_source,
        "calibration": record.calibration,
        "open_loop": _open_loop_record(record),
        "drift": None if record.drift is None else record.drift.describe(),
        "rules": {
            "stable": "last 3 windows agree within 10% on throughput and p95",
            "min_seconds_per_point": o.min_seconds_per_point,
            "max_seconds_per_point": o.max_seconds_per_point,
            "stop_climbing": "SLO broken, or < 5% throughput gain over 4 steps",
            "knee": "highest throughput under the SLO; smaller config when within 5%",
        },
    }


def _open_loop_record(record: RunRecord) -> dict[str, Any] | None:
    if not record.open_loop:
        return None
    point = chosen(record.open_loop)
    return {
        "fraction": record.options.open_loop_fraction(),
        "tries": [t.describe() for t in record.open_loop],
        "factor": None if point is None else point.factor,
        "at_mean_batch": None if point is None else point.at_batch,
    }


def write_profile_json(
    path: Path, profile: EngineProfile, rec: Recommendation, measured: dict[str, Any]
) -> None:
    recommended = {s.key: s.value for s in rec.settings}
    data = profile_data(profile, {"measured": measured, "recommended": recommended})
    if profile.batch_latency_ms is None and profile.ttft_ms is None:
        data[profile.task] = {"points": []}  # nothing measured: the file says so, loudly
    path.write_text(json.dumps(data, indent=2) + "\n")


# ----------------------------------------------------------------------------- recommended.yaml
def recommended_yaml(record: RunRecord, rec: Recommendation) -> str:
    o = record.options
    lines = [
        f"# tidegate profile: {o.model} ({record.engine}, {o.device}), measured "
        f"{record.started_at}",
        f"# SLO: {slo_text(o.slo)}. A model entry for `tidegate serve`: merge it into `models:`.",
    ]
    if o.url is not None and not o.through_gateway and rec.knee is not None:
        lines.append(
            f"# Upstream servers are scaled outside tidegate: {rec.knee.concurrency} in flight "
            "per server is the target for their autoscaler."
        )
    if record.stopped is not None:
        lines.append(f"# INCOMPLETE: the run stopped early ({record.stopped}).")
    if rec.knee is not None and not rec.knee.meets_slo:
        lines.append("# WARNING: no measured configuration met the SLO; the closest was used.")
    lines += ["models:", f"  - name: {_scalar(o.model)}"]
    lines += [f"    {key}: {_scalar(value)}" for key, value in _identity(record).items()]
    groups: dict[str, list[Setting]] = {}
    for setting in rec.settings:
        head, _, rest = setting.key.partition(".")
        groups.setdefault(head if rest else "", []).append(setting)
    for setting in groups.pop("", []):
        lines += [f"    # {setting.why}", f"    {setting.key}: {_scalar(setting.value)}"]
    for head, settings in groups.items():
        lines.append(f"    {head}:")
        for setting in settings:
            key = setting.key.partition(".")[2]
            lines += [f"      # {setting.why}", f"      {key}: {_scalar(setting.value)}"]
    return "\n".join(lines) + "\n"


def _identity(record: RunRecord) -> dict[str, Any]:
    """What the model entry needs to name the same model and engine."""
    from tidegate.engines.registry import known_models

    o = record.options
    entry: dict[str, Any] = {}
    if o.model not in known_models():
        entry["task"] = record.task
    if o.url is not None and not o.through_gateway:
        return entry | {"engine": "openai", "upstreams": [o.url]}
    if o.engine == "simulated":
        entry |= {"engine": "simulated", "profile": "profile.json"}
    if o.model_path is not None:
        entry["model_path"] = o.model_path
    return entry


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("\n...")


def write_outputs(
    out: Path, record: RunRecord, points: Sequence[MeasuredPoint], rec: Recommendation
) -> list[Path]:
    """Every file of ``--out``; report.png only where there is something to plot."""
    out.mkdir(parents=True, exist_ok=True)
    profile, curve_source = build_profile(record, points, rec)
    write_profile_json(out / "profile.json", profile, rec, measured_record(record, curve_source))
    (out / "recommended.yaml").write_text(recommended_yaml(record, rec))
    png = write_report_png(out / "report.png", record, points, rec)
    (out / "report.md").write_text(report_markdown(record, points, rec, png))
    written = ["profile.json", "recommended.yaml", "report.md"] + (["report.png"] if png else [])
    return [out / name for name in written]
