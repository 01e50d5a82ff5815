from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from tidegate import __version__
from tidegate.cli import app


def test_version_flag_prints_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"tidegate {__version__}"


def test_help_lists_commands() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "levels" in result.output


def test_levels_shows_default_holdback() -> None:
    result = CliRunner().invoke(app, ["levels"])
    assert result.exit_code == 0
    assert "low" in result.output
    assert "above 70%" in result.output


def test_installed_entry_point_runs() -> None:
    # The console script installed by pip, in the same environment as the tests.
    script = Path(sys.executable).with_name("tidegate")
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=True)
    assert __version__ in out.stdout


def test_defrag_dry_run_moves_a_replica_to_free_a_whole_device(tmp_path: Path) -> None:
    config = tmp_path / "spread.yaml"
    config.write_text(
        """
devices:
  - {id: gpu-a, memory_mb: 1000, node: n1}
  - {id: gpu-b, memory_mb: 1000, node: n1}
pools:
  shared: {priorities: [high, medium, low], devices: [gpu-a, gpu-b], placement: spread}
models:
  - {name: one, task: embeddings, engine: simulated, pools: [shared], memory_mb: 300}
  - {name: two, task: embeddings, engine: simulated, pools: [shared], memory_mb: 200}
"""
    )
    result = CliRunner().invoke(app, ["defrag", "--dry-run", "--config", str(config)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    # Spread put one replica on each device; one move frees a whole device.
    assert lines[0].startswith("gpu-a")
    assert lines[1].startswith("gpu-b")
    assert lines[0].split("MB")[1].strip() != "-"
    assert lines[1].split("MB")[1].strip() != "-"
    assert len([line for line in lines if line.startswith("move ")]) == 1
    assert lines[-1].startswith("frees 1: gpu-")


def test_defrag_without_dry_run_refuses_offline() -> None:
    result = CliRunner().invoke(app, ["defrag", "--config", "examples/autoscaling.yaml"])
    assert result.exit_code == 2
