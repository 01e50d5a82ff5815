"""The ``tidegate`` command line."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from tidegate import __version__

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


@app.command()
def worker(
    model: Annotated[str, typer.Option(help="minilm, tiny-llama, or a name with --model-path.")],
    model_path: Annotated[
        Path | None, typer.Option(help="Local Hugging Face model folder.")
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
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Serve one replica of one model over the OpenAI HTTP API."""
    from tidegate.worker.runtime import WorkerSettings
    from tidegate.worker.server import serve_worker

    settings = WorkerSettings(
        model=model,
        engine=engine.value,
        model_path=str(model_path) if model_path else None,
        task=task.value if task else None,
        device=device,
        max_batch_size=max_batch_size,
        batch_window_ms=batch_window_ms,
        max_batch_tokens=max_batch_tokens,
        max_num_seqs=max_num_seqs,
        profile=str(profile) if profile else None,
        seed=seed,
    )
    raise typer.Exit(serve_worker(settings, host, port, log_level))


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
    raise typer.Exit(serve_gateway(resolved, log_level))
