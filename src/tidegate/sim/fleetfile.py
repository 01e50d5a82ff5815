"""The fleet file of ``tidegate simulate --fleet``, and the ServeGen aggregate of every model.

A fleet file (YAML) says what the fleet-level simulator (``sim.fluid``) replays::

    config: {models: [...]}          # the tidegate config, inline, or a path to one
    trace: ../shared/traces/servegen/aggregate_rate_10min.csv
    profiles: ../shared/traces/profiles/perf_model.csv
    inventory: {nodes: 1250, gpus_per_node: 8, gpu_memory_mb: 81920}
    controller: tidegate             # or hpa-default, static, static-peak
    days: 14                         # the span; a model with fewer days repeats them
    window: [64800, 68400]           # optional: only these seconds, shifted to start at 0
    step_s: 5
    priority_mix: high=0.2,medium=0.3,low=0.5
    slo: high=1,medium=5,low=30      # seconds to the first token
    lifecycle: {cold_start_s: 60, warmup_s: 10, drain_timeout_s: 30}
    start: 2026-11-30T00:00:00+00:00 # wall time of t = 0 (schedules)
    groups:
      - {model: m-large, rates: language/m-large, profile: llama2-70b/h100-80gb/8,
         prompt: 1020, output: 129, replicas: 60, memory_mb: 73728}

Relative paths are relative to the fleet file. ``rates`` selects a model of the aggregate
(``CATEGORY/MODEL``); ``profile`` is a ``perf_model.csv`` selection (``MODEL/HW/TP``) or a
path to a ``tidegate profile`` JSON; ``prompt`` and ``output`` are the lognormal medians of
the lengths (the default ones: the Azure conversation trace's); ``replicas`` are ready at
t = 0 (default: the config's).

The aggregate (``aggregate_rate_10min.csv``, see the traces' README) sums each model's
tenants per 600 s window. Its zero windows (m-mid 84, m-small 37) are gaps in the data, not
idle time (the README): they hold the last rate before them. A model with one day of data
(mm-image, deepseek-r1) repeats it for the fleet's days.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from tidegate.config import load_config, parse_config
from tidegate.errors import ConfigError
from tidegate.sim.fleet import Lifecycle
from tidegate.sim.fluid import DEFAULT_STEP_S, FleetGroup, FleetScenario
from tidegate.sim.inventory import Inventory
from tidegate.sim.service import load_service
from tidegate.sim.specs import parse_slo
from tidegate.sim.synthetic import LognormalLengths, Segment
from tidegate.sim.workload import parse_mix

WINDOW_S = 600.0
DAY_S = 86_400.0
FLEET_KEYS = {
    "config",
    "trace",
    "profiles",
    "inventory",
    "controller",
    "days",
    "window",
    "step_s",
    "priority_mix",
    "slo",
    "lifecycle",
    "start",
    "groups",
    "seed",
}
GROUP_KEYS = {"model", "rates", "profile", "prompt", "output", "replicas", "memory_mb", "gpus"}


def read_aggregate(path: str | Path) -> dict[str, list[float]]:
    """``CATEGORY/MODEL`` -> its rate per 600 s window from t = 0, zero windows held."""
    windows: dict[str, dict[int, float]] = defaultdict(dict)
    try:
        with open(path, newline="") as file:
            for number, row in enumerate(csv.DictReader(file), start=2):
                try:
                    name = f"{row['category']}/{row['model']}"
                    index = round(float(row["window_start_s"]) / WINDOW_S)
                    windows[name][index] = float(row["total_rate_rps"])
                except (KeyError, TypeError, ValueError) as exc:
                    raise ConfigError(
                        str(path),
                        f"line {number}",
                        f"not an aggregate row ({exc})",
                        "give ServeGen's aggregate_rate_10min.csv (see traces/README.md)",
                    ) from None
    except OSError as exc:
        raise ConfigError(
            str(path), "(file)", f"cannot read it ({exc})", "check the path"
        ) from None
    curves: dict[str, list[float]] = {}
    for name, by_index in windows.items():
        rates = [by_index.get(i, 0.0) for i in range(max(by_index) + 1)]
        last = next((r for r in rates if r > 0), 0.0)
        held = []
        for rate in rates:
            last = rate if rate > 0 else last
            held.append(last)
        curves[name] = held
    return curves


def segments_of(
    rates: list[float], days: float, window: tuple[float, float] | None
) -> list[Segment]:
    """The rate curve over ``days`` (repeating a shorter one), cut to ``window`` and shifted
    to start at 0."""
    span = days * DAY_S
    count = math.ceil(span / WINDOW_S - 1e-9)
    segments = [
        Segment(i * WINDOW_S, min(span, (i + 1) * WINDOW_S), rates[i % len(rates)])
        for i in range(count)
    ]
    if window is None:
        return segments
    start, end = window
    cut = []
    for s in segments:
        low, high = max(s.start_s, start), min(s.end_s, end)
        if high > low:
            cut.append(Segment(low - start, high - start, s.arrivals_per_s))
    return cut


def load_fleet(path: str | Path, controller: str | None = None) -> FleetScenario:
    """A ``FleetScenario`` from a fleet file (module docstring); ConfigError names the key."""
    source = str(path)
    folder = Path(path).resolve().parent
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(source, "(file)", f"cannot read it ({exc})", "check the path") from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, "(file)", f"not YAML ({exc})", "fix the syntax") from None
    if not isinstance(raw, dict):
        raise ConfigError(source, "(file)", "not a mapping", "see docs/simulator.md, --fleet")
    unknown = set(raw) - FLEET_KEYS
    if unknown:
        raise ConfigError(
            source,
            ", ".join(sorted(unknown)),
            "unknown key",
            f"use only {', '.join(sorted(FLEET_KEYS))}",
        )

    def need(key: str) -> Any:
        if key not in raw:
            raise ConfigError(source, key, "missing", "see docs/simulator.md, --fleet")
        return raw[key]

    def resolve(text: Any, key: str) -> Path:
        if not isinstance(text, str):
            raise ConfigError(source, key, f"{text!r} is not a path", "give a file path")
        candidate = Path(text)
        return candidate if candidate.is_absolute() else folder / candidate

    config_value = need("config")
    if isinstance(config_value, dict):
        config = parse_config(config_value, f"{source}#config")
    else:
        config = load_config(resolve(config_value, "config"))
    curves = read_aggregate(resolve(need("trace"), "trace"))
    profiles = resolve(raw.get("profiles", "perf_model.csv"), "profiles")
    days = _number(raw.get("days", 14), source, "days")
    window = raw.get("window")
    if window is not None:
        if not (isinstance(window, list) and len(window) == 2 and window[0] < window[1]):
            raise ConfigError(source, "window", f"{window!r}", "write [START_S, END_S]")
        window = (float(window[0]), float(window[1]))
    groups = []
    for index, entry in enumerate(need("groups") or []):
        key = f"groups[{index}]"
        if not isinstance(entry, dict) or set(entry) - GROUP_KEYS or "model" not in entry:
            raise ConfigError(
                source, key, f"{entry!r}", f"a mapping with model and {sorted(GROUP_KEYS)}"
            )
        selection = entry.get("rates", entry["model"])
        if selection not in curves:
            raise ConfigError(
                source,
                f"{key}.rates",
                f"{selection!r} is not in the aggregate",
                f"pick one of {', '.join(sorted(curves))}",
            )
        profile = str(entry.get("profile", ""))
        if profile.endswith(".json"):
            service = load_service(str(resolve(profile, f"{key}.profile")))
        else:
            service = load_service(f"{profiles}#{profile}" if profile else str(profiles))
        lengths = LognormalLengths(
            prompt_median=_number(entry.get("prompt", 1020), source, f"{key}.prompt"),
            output_median=_number(entry.get("output", 129), source, f"{key}.output"),
        )
        groups.append(
            FleetGroup(
                model=entry["model"],
                rates=segments_of(curves[selection], days, window),
                service=service,
                lengths=lengths,
                memory_mb=_number(entry.get("memory_mb", 73_728), source, f"{key}.memory_mb"),
                replicas=entry.get("replicas"),
                gpus=entry.get("gpus"),
            )
        )
    inventory = Inventory(**(raw.get("inventory") or {}))
    life = raw.get("lifecycle") or {}
    from tidegate.sim.command import start_wall_s  # the same parsing as --start

    return FleetScenario(
        config=config,
        groups=groups,
        inventory=inventory,
        controller=controller or raw.get("controller", "tidegate"),
        lifecycle=Lifecycle(**life),
        mix=parse_mix(raw["priority_mix"]) if raw.get("priority_mix") else (),
        slo_ttft_s=parse_slo(raw["slo"]) if raw.get("slo") else {},
        step_s=_number(raw.get("step_s", DEFAULT_STEP_S), source, "step_s"),
        start_wall_s=start_wall_s(str(raw.get("start", "2026-11-30T00:00:00+00:00"))),
        end_s=(window[1] - window[0]) if window else days * DAY_S,
        seed=int(raw.get("seed", 0)),
    )


def _number(value: Any, source: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(source, key, f"{value!r}", "give a number above 0")
    return float(value)


def fleet_markdown(report: dict[str, Any]) -> str:
    """The fleet report as markdown: one row per model, then the fleet."""
    levels = list(report["slo_attainment"])
    head = "| model | GPUs/replica | GPU-hours | peak replicas | mean replicas | started | "
    head += " | ".join(f"{name} SLO met" for name in levels)
    head += " | refused | placement refusals |"
    lines = [
        f"Fleet-level simulation ({report['controller']}, {report['end_s'] / 3600:.1f} h in "
        f"steps of {report['step_s']:g} s; {report['inventory']['gpus']:,} GPUs on "
        f"{report['inventory']['nodes']:,} nodes)",
        "",
        head,
        "|---|" + "---:|" * (7 + len(levels)),
    ]
    for name, group in report["groups"].items():
        cells = [
            name,
            str(group["gpus_per_replica"]),
            f"{group['gpu_hours']:,.0f}",
            str(group["peak_replicas"]),
            f"{group['mean_replicas']:.1f}",
            str(group["replicas_started"]),
        ]
        refused = 0.0
        for level in levels:
            stats = group["levels"][level]
            met = stats["slo_attainment"]
            cells.append("n/a" if met is None else f"{met * 100:.2f}%")
            refused += stats["refused_holdback"] + stats["refused_full"] + stats["unavailable"]
        cells += [f"{refused:,.0f}", str(group["placement_refusals"])]
        lines.append("| " + " | ".join(cells) + " |")
    fleet = [
        "fleet",
        "",
        f"{report['gpu_hours']:,.0f}",
        f"peak {report['peak_gpus_in_use']:,} GPUs",
        "",
        "",
    ]
    fleet += [
        "n/a"
        if report["slo_attainment"][level] is None
        else f"{report['slo_attainment'][level] * 100:.2f}%"
        for level in levels
    ]
    fleet += ["", str(report["placement_refusals"])]
    lines.append("| " + " | ".join(fleet) + " |")
    return "\n".join(lines) + "\n"


def simulate_fleet(path: str | Path, controllers: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """``tidegate simulate --fleet``: the fleet file's run, or one per ``controllers``."""
    from tidegate.sim import autoscale  # noqa: F401  (registers the autoscalers)
    from tidegate.sim.fluid import FleetSimulation

    reports = []
    for controller in controllers or (None,):
        result = FleetSimulation(load_fleet(path, controller)).run()
        report = result.report()
        report["fleet_file"] = Path(path).name
        reports.append(report)
    return reports


def write_fleet_outputs(out: Path, reports: list[dict[str, Any]]) -> list[Path]:
    """``report.json`` (every run) and ``report.md`` (their tables) in ``out``."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    written = [out / "report.json", out / "report.md"]
    written[0].write_text(json.dumps({"runs": reports}, indent=1, sort_keys=True) + "\n")
    written[1].write_text("\n".join(fleet_markdown(report) for report in reports))
    return written
