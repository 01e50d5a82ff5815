"""The ``tidegate`` command line."""

from __future__ import annotations

import math
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tidegate import __version__

if TYPE_CHECKING:
    from tidegate.core.fairness import FairnessConfig

app = typer.Typer(
    name="tidegate",
    help="Schedule model inference on scarce GPUs: priorities with aging, admission with "
    "Retry-After, batching, pools, placement and autoscaling.",
    no_args_is_help=True,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"tidegate {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """tidegate: an inference scheduler for scarce GPUs."""


@app.command()
def levels() -> None:
    """Show the default priority levels and their admission rules."""
    from tidegate.core.queue import QueueConfig

    config = QueueConfig()
    typer.echo(
        f"queue max_size={config.max_size} aging: threshold "
        f"{config.aging.threshold_s:g}s, {config.aging.rate_per_s:g} levels/s"
    )
    for index, spec in enumerate(config.levels):
        holdback = "never" if spec.holdback_above is None else f"above {spec.holdback_above:.0%}"
        typer.echo(f"  {index} {spec.name:<8} holdback {holdback}")


class EngineKind(StrEnum):
    transformers = "transformers"
    simulated = "simulated"


class TaskKind(StrEnum):
    embeddings = "embeddings"
    generate = "generate"


def _level_windows(text: str) -> tuple[float | None, ...]:
    """``--level-windows-ms``: "0,,5" -> (0.0, None, 5.0); a bad number exits with status 2."""
    if not text:
        return ()
    try:
        return tuple(float(w) if w.strip() else None for w in text.split(","))
    except ValueError:
        typer.echo(
            f"error: --level-windows-ms {text!r}: not numbers. Fix: e.g. '0,,' (high 0 ms)",
            err=True,
        )
        raise typer.Exit(2) from None


def _flag_error(flag: str, problem: str, fix: str) -> typer.Exit:
    typer.echo(f"error: {flag}: {problem}. Fix: {fix}", err=True)
    return typer.Exit(2)


def _tenant_share(text: str) -> tuple[str, float]:
    """``--tenant-share NAME=SHARE`` -> (NAME, SHARE); a bad one exits with status 2."""
    from tidegate.worker.runtime import TENANT_RE

    name, _, share = text.rpartition("=")
    try:
        value = float(share)
    except ValueError:
        value = -1.0
    if not TENANT_RE.fullmatch(name) or not (value > 0 and math.isfinite(value)):
        raise _flag_error(
            "--tenant-share",
            f"{text!r} is not NAME=SHARE",
            "a tenant (printable ASCII, no spaces) = a share > 0, e.g. team-a=2",
        )
    return name, value


def _fairness(
    fair_sharing: bool, weights: dict[str, float | None], shares: list[str]
) -> FairnessConfig | None:
    """The worker's fair sharing from its flags: ``weights`` maps --fair-input-weight,
    --fair-output-weight and --fair-lag-tokens to their values (None: not given, the
    default). The worker holds no slots back (``reserve_fraction`` 0)."""
    from tidegate.core.fairness import FairnessConfig

    given = {flag: value for flag, value in weights.items() if value is not None}
    if not fair_sharing:
        if given or shares:
            flag = next(iter(given), "--tenant-share")
            raise _flag_error(flag, "needs --fair-sharing", "add --fair-sharing, or remove it")
        return None
    for flag, value in given.items():
        if not math.isfinite(value):
            raise _flag_error(flag, f"{value} is not a finite number", "give a number >= 0")
    parsed = sorted(map(_tenant_share, shares))
    names = [name for name, _ in parsed]
    if len(set(names)) < len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise _flag_error("--tenant-share", f"tenant {twice!r} given twice", "give each once")
    defaults = FairnessConfig()
    try:
        return FairnessConfig(
            input_weight=given.get("--fair-input-weight", defaults.input_weight),
            output_weight=given.get("--fair-output-weight", defaults.output_weight),
            lag_tokens=given.get("--fair-lag-tokens", defaults.lag_tokens),
            shares=tuple(parsed),
            reserve_fraction=0.0,
        )
    except ValueError as exc:  # both weights 0
        fix = "give it or --fair-output-weight a value > 0"
        raise _flag_error("--fair-input-weight", str(exc), fix) from None


@app.command()
def worker(
    model: Annotated[
        str, typer.Option(help="minilm, smollm2, tiny-llama, or a name with --model-path.")
    ],
    model_path: Annotated[
        Path | None, typer.Option(help="Local Hugging Face model folder or .gguf file.")
    ] = None,
    engine: Annotated[
        EngineKind, typer.Option(help="Engine that runs it.")
    ] = EngineKind.transformers,
    task: Annotated[TaskKind | None, typer.Option(help="Task of a model not built in.")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda:N.")] = "cpu",
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(help="0 picks a free port; the address is printed first.")
    ] = 0,
    max_batch_size: Annotated[int, typer.Option(min=1, help="Embeddings: largest batch.")] = 32,
    batch_window_ms: Annotated[
        float, typer.Option(min=0.0, help="Embeddings: longest wait for a fuller batch.")
    ] = 5.0,
    max_batch_tokens: Annotated[
        int | None, typer.Option(min=1, help="Embeddings: token budget of a batch.")
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="Generation: sequences at once.")] = 16,
    profile: Annotated[Path | None, typer.Option(help="Simulated engine: profile.json.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the simulated engine and sampling.")] = 0,
    memory_fraction: Annotated[
        float | None,
        typer.Option(min=0.01, max=1.0, help="CUDA: cap on this process's share of its GPU."),
    ] = None,
    probe_max_ms: Annotated[
        float | None,
        typer.Option(min=0.0, help="Ready only once a probe request after warm-up is this fast."),
    ] = None,
    engine_process: Annotated[
        bool | None,
        typer.Option(
            "--engine-process/--no-engine-process",
            help="Embeddings: run the model in a process of its own, off the HTTP server's "
            "GIL. Default: off.",
        ),
    ] = None,
    engine_threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="CPU: the engine's operator threads (torch). Default: every core; fewer "
            "keep it steady on a host it shares with the gateway.",
        ),
    ] = None,
    level_windows_ms: Annotated[
        str,
        typer.Option(
            help="Embeddings: batch window per level, high,medium,low (empty: "
            "--batch-window-ms), e.g. '0,,'."
        ),
    ] = "",
    load_aware_window: Annotated[
        bool,
        typer.Option(help="Embeddings: release when under one companion is expected."),
    ] = False,
    length_candidates: Annotated[
        int,
        typer.Option(min=0, help="Embeddings: form batches of similar lengths among this many."),
    ] = 0,
    max_padding_ratio: Annotated[
        float, typer.Option(min=1.0, help="Embeddings: padded / real tokens, at most.")
    ] = 1.25,
    batch_overhead_tokens: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="Embeddings, length-aware on cost: padding within (members - 1) x this "
            "many tokens (a batch's fixed cost); replaces --max-padding-ratio.",
        ),
    ] = None,
    target_p99_ms: Annotated[
        float | None,
        typer.Option(min=0.001, help="Embeddings: AIMD batch cap on the high level's P99."),
    ] = None,
    min_batch_size: Annotated[
        int, typer.Option(min=1, help="Embeddings: the AIMD cap's floor.")
    ] = 1,
    max_prefill_tokens: Annotated[
        int,
        typer.Option(
            min=0,
            help="Generation: a sequence joins the running batch only while the prompts not "
            "yet at their first token stay within this many tokens (one always joins). "
            "0: no bound.",
        ),
    ] = 0,
    fair_sharing: Annotated[
        bool,
        typer.Option(
            help="Generation: order the sequence queue inside a level by tenant (virtual "
            "token counters; the tenant the gateway sends in X-Tidegate-Tenant)."
        ),
    ] = False,
    fair_input_weight: Annotated[
        float | None, typer.Option(min=0.0, help="Fair sharing: weight of a prompt token (1).")
    ] = None,
    fair_output_weight: Annotated[
        float | None, typer.Option(min=0.0, help="Fair sharing: weight of an output token (2).")
    ] = None,
    fair_lag_tokens: Annotated[
        float | None,
        typer.Option(min=0.0, help="Fair sharing: most credit an idle tenant banks (1000)."),
    ] = None,
    tenant_share: Annotated[
        list[str] | None,
        typer.Option(help="Fair sharing: NAME=SHARE, a tenant's share (default 1); repeatable."),
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Serve one replica of one model over the OpenAI HTTP API."""
    from tidegate.worker.runtime import WorkerSettings
    from tidegate.worker.server import CannotBind, serve_worker

    settings = WorkerSettings(
        model=model,
        engine=engine.value,
        model_path=str(model_path) if model_path else None,
        task=task.value if task else None,
        device=device,
        max_batch_size=max_batch_size,
        batch_window_ms=batch_window_ms,
        max_batch_tokens=max_batch_tokens,
        level_windows_ms=_level_windows(level_windows_ms),
        load_aware_window=load_aware_window,
        length_candidates=length_candidates,
        max_padding_ratio=max_padding_ratio,
        batch_overhead_tokens=batch_overhead_tokens,
        target_p99_ms=target_p99_ms,
        min_batch_size=min_batch_size,
        max_num_seqs=max_num_seqs,
        max_prefill_tokens=max_prefill_tokens,
        fairness=_fairness(
            fair_sharing,
            {
                "--fair-input-weight": fair_input_weight,
                "--fair-output-weight": fair_output_weight,
                "--fair-lag-tokens": fair_lag_tokens,
            },
            tenant_share or [],
        ),
        profile=str(profile) if profile else None,
        seed=seed,
        memory_fraction=memory_fraction,
        probe_max_ms=probe_max_ms,
        engine_process=engine_process,
        engine_threads=engine_threads,
    )
    try:
        settings.batch_config()
    except ValueError as exc:
        typer.echo(f"error: {exc}. Fix: see tidegate worker --help", err=True)
        raise typer.Exit(2) from None
    try:
        code = serve_worker(settings, host, port, log_level)
    except CannotBind as exc:
        typer.echo(f"error: {exc}. Fix: stop what uses it, or choose another --port", err=True)
        raise typer.Exit(1) from None
    raise typer.Exit(code)


config_app = typer.Typer(help="Check and show configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("check")
def config_check(
    file: Annotated[
        Path | None, typer.Argument(help="YAML config; none: the embedded default.")
    ] = None,
) -> None:
    """Validate a config file and print it resolved, or the error with its key and fix."""
    from tidegate.config import check_config

    code, text = check_config(file)
    typer.echo(text, err=code != 0)
    raise typer.Exit(code)


class Policy(StrEnum):
    priority = "priority"
    fifo = "fifo"


@app.command()
def serve(
    config: Annotated[
        Path | None, typer.Option(help="YAML config; none: embedded default.")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8000).")] = None,
    policy: Annotated[Policy | None, typer.Option(help="priority, or fifo to compare.")] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Run the gateway and the model workers it supervises."""
    from tidegate.config import load_config
    from tidegate.errors import ConfigError
    from tidegate.gateway.serve import serve_gateway
    from tidegate.worker.server import CannotBind

    overrides = {
        k: v
        for k, v in {"host": host, "port": port, "policy": policy.value if policy else None}.items()
        if v is not None
    }
    try:
        resolved = load_config(config, overrides)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        code = serve_gateway(resolved, log_level)
    except CannotBind as exc:
        where = f"gateway.port in {config}" if config is not None else "gateway.port in a config"
        typer.echo(
            f"error: {exc}. Fix: stop what uses it, or choose another port with --port or {where}",
            err=True,
        )
        raise typer.Exit(1) from None
    raise typer.Exit(code)


@app.command()
def profile(
    model: Annotated[
        str,
        typer.Option(help="minilm, smollm2, tiny-llama, a name with --model-path, or as at --url."),
    ],
    model_path: Annotated[
        Path | None, typer.Option(help="Local Hugging Face model folder or .gguf file.")
    ] = None,
    url: Annotated[
        str | None,
        typer.Option(help="Measure this running OpenAI server (vLLM...): concurrency only."),
    ] = None,
    through_gateway: Annotated[
        bool,
        typer.Option(help="Measure inside tidegate serve: load through its gateway (docs)."),
    ] = False,
    config: Annotated[
        Path | None, typer.Option(help="--through-gateway: the deployment's serve config.")
    ] = None,
    open_loop: Annotated[
        float | None,
        typer.Option(
            help="--through-gateway: open-loop point at this fraction of capacity "
            "(default 0.85; 0: none)."
        ),
    ] = None,
    engine: Annotated[
        EngineKind, typer.Option(help="Engine of the workers it starts.")
    ] = EngineKind.transformers,
    sim_profile: Annotated[
        Path | None, typer.Option(help="Simulated engine: the profile.json it replays.")
    ] = None,
    task: Annotated[TaskKind | None, typer.Option(help="Task of a model not built in.")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda:N.")] = "cpu",
    slo_p95_ms: Annotated[
        float | None, typer.Option(min=0.0, help="SLO: end-to-end latency p95.")
    ] = None,
    slo_ttft_p95_ms: Annotated[
        float | None, typer.Option(min=0.0, help="SLO (generation): time to first token p95.")
    ] = None,
    slo_itl_p95_ms: Annotated[
        float | None, typer.Option(min=0.0, help="SLO (generation): inter-token latency p95.")
    ] = None,
    workload: Annotated[
        Path | None, typer.Option(help="Trace of token lengths (Azure CSV, Mooncake JSONL).")
    ] = None,
    max_batch: Annotated[int, typer.Option(min=1, help="Largest batch size swept.")] = 64,
    max_concurrency: Annotated[
        int, typer.Option(min=1, help="Most requests in flight swept.")
    ] = 64,
    batch_windows_ms: Annotated[
        str, typer.Option(help="Batch windows swept at the knee batch, comma-separated.")
    ] = "0,2,5,10",
    min_seconds_per_point: Annotated[
        float, typer.Option(min=0.0, help="Shortest measurement of one point.")
    ] = 5.0,
    max_seconds_per_point: Annotated[
        float, typer.Option(min=0.0, help="Longest; then the point is kept as unstable.")
    ] = 30.0,
    max_duration_s: Annotated[
        float | None, typer.Option(min=0.0, help="Stop the whole run after this long.")
    ] = None,
    max_output_tokens: Annotated[
        int, typer.Option(min=1, help="Generation: output lengths clipped to this.")
    ] = 256,
    seed: Annotated[int, typer.Option(help="Seed of the workload and its texts.")] = 0,
    out: Annotated[Path | None, typer.Option(help="Output folder (default profile-MODEL).")] = None,
) -> None:
    """Measure a model's capacity curves and write its profile and operating config."""
    import shlex
    import sys

    from tidegate.core.capacity import Slo
    from tidegate.errors import ConfigError
    from tidegate.profile import ProfileOptions, run_profile

    try:
        options = ProfileOptions(
            model=model,
            out=out or Path(f"profile-{model}"),
            model_path=str(model_path) if model_path else None,
            url=url,
            through_gateway=through_gateway,
            serve_config=config,
            open_loop=open_loop,
            engine=engine.value,
            sim_profile=str(sim_profile) if sim_profile else None,
            task=task.value if task else None,
            device=device,
            slo=Slo(slo_p95_ms, slo_ttft_p95_ms, slo_itl_p95_ms),
            workload=workload,
            max_batch=max_batch,
            max_concurrency=max_concurrency,
            batch_windows_ms=tuple(float(w) for w in batch_windows_ms.split(",") if w.strip()),
            min_seconds_per_point=min_seconds_per_point,
            max_seconds_per_point=max_seconds_per_point,
            max_duration_s=max_duration_s,
            max_output_tokens=max_output_tokens,
            seed=seed,
            command=shlex.join(["tidegate", *sys.argv[1:]]),
        )
    except (ConfigError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(run_profile(options))


@app.command()
def simulate(
    trace: Annotated[
        str | None, typer.Option(help="Trace file: Azure CSV, Mooncake JSONL, ServeGen, ours.")
    ] = None,
    workload: Annotated[
        str | None, typer.Option(help="Synthetic: poisson:rate=5,duration_s=600 (docs).")
    ] = None,
    config: Annotated[Path | None, typer.Option(help="The tidegate serve YAML config.")] = None,
    profile: Annotated[
        str | None, typer.Option(help="profile.json, or perf_model.csv (#MODEL/HW/TP).")
    ] = None,
    replicas: Annotated[int | None, typer.Option(min=0, help="Replicas of the model.")] = None,
    compare: Annotated[
        str | None, typer.Option(help="Policies side by side, e.g. fifo,priority.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of every random draw.")] = 0,
    speedup: Annotated[float, typer.Option(min=0.0, help="Same load, time K times shorter.")] = 1.0,
    rate_scale: Annotated[float, typer.Option(min=0.0, help="Load times F.")] = 1.0,
    priority_mix: Annotated[
        str | None, typer.Option(help="high=0.2,medium=0.3,low=0.5 where the trace has none.")
    ] = None,
    priority_rules: Annotated[
        str | None, typer.Option(help="tenant:NAME=high,prompt<256=high,*=low (first match).")
    ] = None,
    slo: Annotated[
        str | None, typer.Option(help="TTFT SLO seconds: high=1,medium=5,low=30.")
    ] = None,
    start: Annotated[
        str,
        typer.Option(help="Wall time of the workload's start (schedules, forecast), ISO 8601."),
    ] = "2026-11-30T00:00:00+00:00",
    out: Annotated[Path, typer.Option(help="Folder of report.json/.md/.png.")] = Path("sim-out"),
    validate: Annotated[
        Path | None,
        typer.Option(help="A recorded real run (docs/simulator.md): replay it and compare."),
    ] = None,
    sensitivity: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=0.49,
            help="With --validate: replay also with the engine this fraction faster and "
            "slower, e.g. 0.03.",
        ),
    ] = 0.0,
    fleet: Annotated[
        Path | None,
        typer.Option(help="Fleet-level mode: a fleet file (docs/simulator.md), every model."),
    ] = None,
    own_engine_time: Annotated[
        bool,
        typer.Option(
            "--own-engine-time",
            help="With --validate: the engine's speed from the run's own worker figures.",
        ),
    ] = False,
) -> None:
    """Replay a trace or a synthetic workload through the scheduler's own policies."""
    from tidegate.errors import ConfigError

    if fleet is not None:
        _simulate_fleet(fleet, compare, out, trace or workload)
        return
    from tidegate.sim import SimulateOptions, write_outputs
    from tidegate.sim import simulate as run_simulation
    from tidegate.sim.report import terminal

    if sensitivity and validate is None:
        typer.echo("error: --sensitivity needs --validate RUN (it varies a replay)", err=True)
        raise typer.Exit(2)
    if own_engine_time and validate is None:
        typer.echo("error: --own-engine-time needs --validate RUN (it reads the run)", err=True)
        raise typer.Exit(2)
    if validate is not None:
        from tidegate.sim.command import validate_run

        try:
            text, passed = validate_run(
                validate, profile, config, out, sensitivity, own_engine_time
            )
        except (ConfigError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        typer.echo(text)
        raise typer.Exit(0 if passed else 1)

    options = SimulateOptions(
        trace=trace,
        workload=workload,
        config=str(config) if config else None,
        profile=profile,
        replicas=replicas,
        compare=tuple(name.strip() for name in (compare or "").split(",") if name.strip()),
        seed=seed,
        speedup=speedup,
        rate_scale=rate_scale,
        priority_mix=priority_mix,
        priority_rules=priority_rules,
        slo=slo,
        start=start,
    )
    try:
        results, report = run_simulation(options)
    except (ConfigError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(terminal(report))
    for path in write_outputs(out, results, report):
        typer.echo(f"wrote {path}")


def _simulate_fleet(fleet: Path, compare: str | None, out: Path, other: str | None) -> None:
    from tidegate.errors import ConfigError
    from tidegate.sim.fleetfile import fleet_markdown, simulate_fleet, write_fleet_outputs

    if other is not None:
        typer.echo(
            "error: --fleet reads its traces from the fleet file; drop --trace/--workload",
            err=True,
        )
        raise typer.Exit(2)
    controllers = tuple(name.strip() for name in (compare or "").split(",") if name.strip())
    try:
        reports = simulate_fleet(fleet, controllers)
    except (ConfigError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for report in reports:
        typer.echo(fleet_markdown(report))
    for path in write_fleet_outputs(out, reports):
        typer.echo(f"wrote {path}")


k8s_app = typer.Typer(
    help="Kubernetes: manifests, and the workers' drain hook.", no_args_is_help=True
)
app.add_typer(k8s_app, name="k8s")


@k8s_app.command("render")
def k8s_render(
    config: Annotated[
        Path | None, typer.Option(help="YAML config; none: embedded default.")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Folder for one file per kind; none: stdout.")
    ] = None,
    image: Annotated[str | None, typer.Option(help="Container image with tidegate.")] = None,
    namespace: Annotated[str, typer.Option(help="Namespace of every object.")] = "default",
    keda: Annotated[bool, typer.Option(help="KEDA ScaledObjects instead of HPAs.")] = False,
    prometheus_url: Annotated[
        str | None, typer.Option(help="Prometheus that KEDA asks (with --keda).")
    ] = None,
    gateway_replicas: Annotated[int, typer.Option(min=1, help="Gateway copies.")] = 2,
) -> None:
    """Write Deployments, Services, PDBs, HPAs (or KEDA) and the gateway for a config."""
    import dataclasses

    from tidegate.config import load_config
    from tidegate.control.k8s import RenderOptions, render_manifests, write_manifests
    from tidegate.errors import ConfigError

    options = RenderOptions(namespace=namespace, keda=keda, gateway_replicas=gateway_replicas)
    options = dataclasses.replace(
        options,
        image=image or options.image,
        prometheus_url=prometheus_url or options.prometheus_url,
    )
    try:
        manifests = render_manifests(load_config(config), options)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for note in manifests.notes:
        typer.echo(f"note: {note}", err=True)
    if out is None:
        typer.echo(manifests.to_yaml(), nl=False)
        return
    for path in write_manifests(manifests, out):
        typer.echo(f"wrote {path}")


@k8s_app.command("drain")
def k8s_drain(
    url: Annotated[str, typer.Option(help="The worker's root URL.")] = "http://127.0.0.1:8080",
    timeout_s: Annotated[float, typer.Option(min=0.0, help="Longest wait.")] = 30.0,
) -> None:
    """A worker pod's preStop hook: drain it, wait for what runs (never fails)."""
    from tidegate.control.k8s import drain_worker

    typer.echo(drain_worker(url, timeout_s))


observability_app = typer.Typer(
    help="Prometheus rules and scrape config, Grafana dashboard.", no_args_is_help=True
)
app.add_typer(observability_app, name="observability")


@observability_app.command("render")
def observability_render(
    out: Annotated[Path, typer.Option(help="Folder for the rules, dashboard and scrape config.")],
    config: Annotated[
        Path | None, typer.Option(help="YAML config; none: embedded default.")
    ] = None,
) -> None:
    """Write Prometheus recording and alerting rules, a Prometheus scrape configuration and a
    Grafana dashboard for a config (docs/observability.md)."""
    from tidegate.config import load_config
    from tidegate.errors import ConfigError
    from tidegate.ops.observability import write_observability

    try:
        resolved = load_config(config)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for path in write_observability(resolved, out):
        typer.echo(f"wrote {path}")


@app.command()
def explain(
    model: Annotated[str, typer.Argument(help="An autoscaled model of the running gateway.")],
    url: Annotated[str, typer.Option(help="The gateway.")] = "http://127.0.0.1:8000",
    key: Annotated[
        str | None, typer.Option(envvar="TIDEGATE_ADMIN_KEY", help="Admin key, when keys are set.")
    ] = None,
    last: Annotated[int, typer.Option(min=1, help="How many decisions to show.")] = 20,
    all_decisions: Annotated[
        bool, typer.Option("--all", help="Show holds too, not only changes.")
    ] = False,
) -> None:
    """Why a model has the replicas it has (the autoscaler's recent decisions and their
    rules), and who its queue serves next (fair sharing's per-tenant counters)."""
    import httpx

    from tidegate.control.explain import (
        fetch_autoscaler,
        fetch_batching,
        fetch_failure,
        fetch_tenants,
        format_batching,
        format_decisions,
        format_tenants,
    )

    try:
        models = fetch_autoscaler(url, key)["models"]
        tenants = fetch_tenants(url, key)
        batching = fetch_batching(url, key, model)
    except httpx.HTTPError as exc:
        typer.echo(f"error: {fetch_failure(url, exc, key_given=bool(key))}", err=True)
        raise typer.Exit(1) from None
    if model not in models and model not in tenants:
        known = ", ".join(models) or "none"
        typer.echo(f"error: {model} is not autoscaled here; autoscaled: {known}", err=True)
        raise typer.Exit(1)
    if model in models:
        typer.echo(format_decisions(model, models[model], last, changes_only=not all_decisions))
    if model in tenants:
        typer.echo(format_tenants(model, tenants[model]))
    if batching:
        typer.echo(format_batching(model, batching))


@app.command()
def doctor(
    url: Annotated[str, typer.Option(help="The running gateway.")] = "http://127.0.0.1:8000",
    key: Annotated[
        str | None, typer.Option(envvar="TIDEGATE_ADMIN_KEY", help="Admin key, when keys are set.")
    ] = None,
    window: Annotated[str, typer.Option(help="Gateway: measure over this long (60s, 5m).")] = "60s",
    prometheus: Annotated[
        str | None, typer.Option(help="Read this Prometheus server instead of the gateway.")
    ] = None,
    range_: Annotated[
        str, typer.Option("--range", help="Prometheus: look back this far (6h, 1d).")
    ] = "6h",
    report: Annotated[
        Path | None, typer.Option(help="Read a tidegate simulate report.json instead.")
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="Prometheus or report: the config to diff fixes against.")
    ] = None,
    p99_slo: Annotated[
        float, typer.Option(min=0.0, help="End-to-end p99 (seconds) above which latency is high.")
    ] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="JSON for machines.")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Also list rules that had nothing to read.")
    ] = False,
) -> None:
    """Findings ranked by impact with their config fixes; exit 2 when one is critical."""
    from tidegate.core.diagnose import Thresholds
    from tidegate.ops.doctor import DoctorOptions, parse_duration, run_doctor

    try:
        options = DoctorOptions(
            url=url,
            key=key,
            window_s=parse_duration(window),
            prometheus=prometheus,
            range_s=parse_duration(range_),
            report=report,
            config=config,
            as_json=as_json,
            verbose=verbose,
            thresholds=Thresholds(p99_slo_s=p99_slo),
        )
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    raise typer.Exit(run_doctor(options, typer.echo, lambda line: typer.echo(line, err=True)))


@app.command()
def defrag(
    config: Annotated[Path, typer.Option(help="YAML config with declared devices.")],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan (the only mode offline).")
    ] = False,
) -> None:
    """Print where the configured replicas go and the fewest moves that free whole GPUs."""
    from tidegate.config import load_config
    from tidegate.control.explain import plan_config_defrag
    from tidegate.errors import ConfigError

    if not dry_run:
        typer.echo(
            "error: from the command line only --dry-run; a running gateway executes moves "
            "(make-before-break, in its off-peak window)",
            err=True,
        )
        raise typer.Exit(2)
    try:
        resolved = load_config(config, {})
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    lines, plan = plan_config_defrag(resolved)
    typer.echo("\n".join(lines))
    if plan is not None:
        typer.echo("\n".join(plan.describe()))
