"""``tidegate simulate``: options in, runs on one workload, report files out.

The configuration comes from ``tidegate.config.load_config``, the loader of ``tidegate
serve``; a policy of ``--compare`` is applied the way ``serve --policy`` applies it (a
gateway override before validation), so ``fifo`` here is exactly the server's fifo. A name
of ``--compare`` that is not a gateway policy is a controller of ``control.CONTROLLERS``
(``static``, the autoscalers of ``sim.autoscale`` and the ``oracle`` of ``sim.oracle``).

Task and model: the profile's task when ``--profile`` is given, else ``generate`` when the
workload's first request has output tokens and ``embeddings`` otherwise; the model is the
config's first model of that task. Replicas: ``--replicas N`` in the model's first pool,
else the config's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tidegate.config import TidegateConfig, load_config
from tidegate.sim import autoscale, oracle  # noqa: F401  (register their controllers)
from tidegate.sim.control import CONTROLLERS
from tidegate.sim.fleet import Lifecycle
from tidegate.sim.report import build_report, dumps, markdown
from tidegate.sim.run import RunResult, Scenario, Simulation
from tidegate.sim.service import ServiceModel, default_service, load_service
from tidegate.sim.specs import parse_slo, parse_workload
from tidegate.sim.traces import open_trace
from tidegate.sim.workload import Prioritized, Scale, Workload, parse_mix, parse_rules

GATEWAY_POLICIES = ("priority", "fifo")
DEFAULT_START = "2026-11-30T00:00:00+00:00"  # a Monday at midnight UTC


@dataclass(frozen=True)
class SimulateOptions:
    trace: str | None = None
    workload: str | None = None
    config: str | None = None
    profile: str | None = None
    replicas: int | None = None
    compare: tuple[str, ...] = ()
    seed: int = 0
    speedup: float = 1.0
    rate_scale: float = 1.0
    priority_mix: str | None = None
    priority_rules: str | None = None
    slo: str | None = None
    network_ms: float = 0.0
    keep_requests: bool = False
    start: str = DEFAULT_START  # wall time of virtual time 0 (ISO 8601), for schedules


@dataclass(frozen=True)
class Variant:
    name: str
    gateway_policy: str | None  # None: the config's own
    controller: str


def parse_variants(names: Sequence[str]) -> list[Variant]:
    variants = []
    for name in names:
        if name in GATEWAY_POLICIES:
            variants.append(Variant(name, name, "static"))
        elif name in CONTROLLERS:
            variants.append(Variant(name, None, name))
        else:
            known = ", ".join([*GATEWAY_POLICIES, *CONTROLLERS])
            raise ValueError(f"unknown policy {name!r} in --compare; known: {known}")
    return variants


def base_workload(options: SimulateOptions) -> Workload:
    if (options.trace is None) == (options.workload is None):
        raise ValueError("give exactly one of --trace FILE and --workload SPEC")
    scale = Scale(options.rate_scale, options.speedup)
    if options.trace is not None:
        return open_trace(options.trace, scale, options.seed)
    assert options.workload is not None
    return parse_workload(options.workload, scale, options.seed)


def service_for(options: SimulateOptions, workload: Workload) -> ServiceModel:
    if options.profile is not None:
        return load_service(options.profile)
    first = next(iter(workload), None)
    return default_service(
        "generate" if first is not None and first.output_tokens else "embeddings"
    )


def model_for_task(config: TidegateConfig, task: str) -> str:
    for name, spec in config.models.items():
        if spec.task == task:
            return name
    raise ValueError(
        f"the config ({config.source}) has no {task} model; add one to models: "
        f"(the service model is for {task})"
    )


def initial_replicas(config: TidegateConfig, model: str, count: int | None) -> dict[str, int]:
    spec = config.model(model)
    if count is not None:
        return {spec.pools[0]: count}
    if not spec.local:
        return {spec.upstream_pool: len(spec.upstreams)}
    return dict(spec.replicas)


def prepare(options: SimulateOptions) -> tuple[list[Scenario], dict[str, Any]]:
    """The scenarios of every variant, and the workload's description for the report."""
    variants = parse_variants(options.compare) or [Variant("", None, "static")]
    raw = base_workload(options)
    service = service_for(options, raw)
    base_config = load_config(options.config)
    mix = parse_mix(options.priority_mix) if options.priority_mix else ()
    rules = parse_rules(options.priority_rules) if options.priority_rules else ()
    workload = Prioritized(raw, base_config.default_priority, mix, rules, options.seed)
    unknown = workload.levels_named() - set(base_config.levels)
    if unknown:
        raise ValueError(
            f"priority {', '.join(sorted(unknown))} is not a level of the config "
            f"({', '.join(base_config.levels)})"
        )
    model = model_for_task(base_config, service.task)
    replicas = initial_replicas(base_config, model, options.replicas)
    slo = parse_slo(options.slo) if options.slo else {}
    scenarios = []
    for variant in variants:
        overrides = {"policy": variant.gateway_policy} if variant.gateway_policy else None
        config = load_config(options.config, overrides)
        scenarios.append(
            Scenario(
                config,
                model,
                service,
                workload,
                replicas,
                label=variant.name or config.policy,
                controller=variant.controller,
                slo_ttft_s=slo,
                network_s=options.network_ms / 1e3,
                keep_requests=options.keep_requests,
                speedup=options.speedup,
                lifecycle=compress_lifecycle(Lifecycle(), options.speedup),
                start_wall_s=start_wall_s(options.start),
            )
        )
    described = {
        "name": raw.name,
        "rate_scale": options.rate_scale,
        "speedup": options.speedup,
        "seed": options.seed,
        "priorities": _priorities(options),
    }
    return scenarios, described


def start_wall_s(text: str) -> float:
    """``--start`` as epoch seconds; a time without a zone is UTC."""
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"--start {text!r} is not an ISO 8601 time; write e.g. 2026-11-30T08:00:00+01:00"
        ) from None
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


def compress_lifecycle(lifecycle: Lifecycle, speedup: float) -> Lifecycle:
    """Cold start and warm-up in the compressed time of ``--speedup``.

    The drain timeout is not compressed: it bounds the work in flight on a draining
    replica, whose service time is not compressed either (a 30 s timeout at speedup 768
    would be 39 ms, shorter than one batch: every scale-down would fail its batch).
    """
    return Lifecycle(
        lifecycle.cold_start_s / speedup,
        lifecycle.warmup_s / speedup,
        lifecycle.drain_timeout_s,
    )


def _priorities(options: SimulateOptions) -> str:
    parts = []
    if options.priority_rules:
        parts.append(f"rules {options.priority_rules}")
    if options.priority_mix:
        parts.append(f"mix {options.priority_mix}")
    return "; ".join(parts) or "from the workload, else the config's default"


def simulate(options: SimulateOptions) -> tuple[list[RunResult], dict[str, Any]]:
    scenarios, described = prepare(options)
    results = [Simulation(scenario).run() for scenario in scenarios]
    described["requests"] = results[0].num_requests
    return results, build_report(results, described)


def write_outputs(
    out: Path, results: Sequence[RunResult], report: dict[str, Any], png: bool = True
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "report.json", out / "report.md"]
    written[0].write_text(dumps(report))
    written[1].write_text(markdown(report))
    if png:
        from tidegate.sim.plot import write_png

        write_png(results, out / "report.png")
        written.append(out / "report.png")
    return written


def validate_run(
    run_path: Path,
    profile: str | None,
    config: Path | None,
    out: Path | None,
    sensitivity: float = 0.0,
    own_engine_time: bool = False,
) -> tuple[str, bool]:
    """``--validate RUN``: the run replayed (sim.validate); the text and whether it passed.

    ``--profile`` is required (the service model to check); ``--config`` replaces the config
    the run recorded; ``--sensitivity S`` replays it also with the engine S faster and S
    slower; ``--own-engine-time`` takes the engine's speed from the run's own worker figures
    (``own_engine_service``; a profile.json, not a perf_model table). ``out/validation.json``
    gets the figures.
    """
    import json

    import yaml

    from tidegate.sim.validate import batch_line, load_run, render, validate, validation_data

    if profile is None:
        raise ValueError("--validate needs --profile: the service model to check against the run")
    run = load_run(run_path)
    if config is not None:
        from dataclasses import replace

        run = replace(run, config=yaml.safe_load(config.read_text()))
    if own_engine_time:
        from tidegate.engines.profile import load_profile
        from tidegate.sim.validate import own_engine_service

        if profile.partition("#")[0].endswith(".csv"):
            raise ValueError("--own-engine-time needs a profile.json, not a perf_model table")
        service = own_engine_service(run, load_profile(profile), Path(profile).name)
    else:
        service = load_service(profile)
    validation, _, simulated = validate(run, service, sensitivity=sensitivity)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "validation.json").write_text(json.dumps(validation_data(validation), indent=2))
    title = f"{run_path.name}: {run.model} ({run.task}), policy {_policy(run.config)}"
    if own_engine_time:
        title += ", the engine at the run's own speed (its worker's figures)"
    text = render(validation, title)
    batches = batch_line(run, simulated, service)
    return (f"{text}\n{batches}" if batches else text), validation.passed


def _policy(config: Any) -> str:
    gateway = config.get("gateway") if isinstance(config, dict) else None
    return str((gateway or {}).get("policy", "priority"))
