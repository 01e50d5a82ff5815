"""How a run of the planner went, besides its points: what every output file states.

``RunRecord`` is filled by ``profile.run`` once the sweeps end (complete or not) and read by
the writers of the four files (``outputs``, ``report``, ``plots``), which import it from
here and never from each other's modules.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from tidegate.profile.drift import Drift
from tidegate.profile.openloop import OpenLoopPoint
from tidegate.profile.options import ProfileOptions
from tidegate.profile.recommend import available_cores


@dataclass
class RunRecord:
    """How the run went, besides its points."""

    options: ProfileOptions
    task: str
    engine: str
    started_at: str  # ISO 8601, UTC
    duration_s: float
    workload: dict[str, Any]
    stopped: str | None = None  # why it ended early: None when complete
    climb_stops: dict[str, str] = field(default_factory=dict)
    weights_mb: float | None = None
    calibration: dict[str, float] = field(default_factory=dict)
    open_loop: tuple[OpenLoopPoint, ...] = ()  # --through-gateway's open-loop tries
    drift: Drift | None = None  # --through-gateway's drift check (profile/drift.py)


def host_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "cpus": available_cores(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    for package in ("torch", "transformers"):
        try:
            facts[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return facts


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
