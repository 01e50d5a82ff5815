"""The ``tidegate`` command line."""

from __future__ import annotations

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
