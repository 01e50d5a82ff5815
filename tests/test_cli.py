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
