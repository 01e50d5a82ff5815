from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
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


class _RefusesWithoutAKey(BaseHTTPRequestHandler):
    """A gateway with keys, as far as ``explain`` can tell: 401 and its OpenAI error body."""

    def do_GET(self) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": "an API key is required: Authorization: Bearer <key>",
                    "type": "authentication_error",
                    "code": "invalid_api_key",
                }
            }
        ).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def gateway_with_keys() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RefusesWithoutAKey)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


@pytest.mark.parametrize(
    ("key", "says"),
    [(None, "needs an API key"), ("wrong", "refused the API key given")],
    ids=["no_key", "wrong_key"],
)
def test_explain_refused_says_which_option_or_variable_to_set(
    gateway_with_keys: str, key: str | None, says: str
) -> None:
    result = CliRunner().invoke(
        app,
        ["explain", "sim", "--url", gateway_with_keys],
        env={"TIDEGATE_ADMIN_KEY": key},  # None: unset, whatever the shell has
    )
    assert result.exit_code == 1
    (line,) = result.output.strip().splitlines()  # one line, no raw HTTP error and link
    assert line.startswith(f"error: {gateway_with_keys}/admin/autoscaler {says}"), line
    assert "--key KEY" in line
    assert "TIDEGATE_ADMIN_KEY=KEY" in line
    assert "http" not in line.removeprefix(f"error: {gateway_with_keys}")


def test_the_readme_status_names_what_works_and_nothing_as_to_come() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    status = " ".join(line for line in readme.splitlines() if line.startswith(">"))
    assert status.startswith("> Status:"), status
    assert "next issue" not in status
    for command in ("tidegate serve", "tidegate profile", "tidegate simulate", "tidegate k8s"):
        assert command in status, command


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--max-prefill-tokens", "-1"], "--max-prefill-tokens"),
        (["--fair-sharing", "--fair-input-weight", "-1"], "--fair-input-weight"),
        (["--fair-sharing", "--fair-output-weight", "nan"], "--fair-output-weight"),
        (["--fair-sharing", "--fair-lag-tokens", "inf"], "--fair-lag-tokens"),
        (
            ["--fair-sharing", "--fair-input-weight", "0", "--fair-output-weight", "0"],
            "--fair-input-weight",
        ),
        (["--fair-sharing", "--tenant-share", "team-a"], "--tenant-share"),
        (["--fair-sharing", "--tenant-share", "team-a=0"], "--tenant-share"),
        (["--fair-sharing", "--tenant-share", "team a=1"], "--tenant-share"),
        (["--fair-sharing", "--tenant-share", "a=1", "--tenant-share", "a=2"], "--tenant-share"),
        (["--fair-lag-tokens", "10"], "--fair-lag-tokens"),
        (["--tenant-share", "a=1"], "--tenant-share"),
    ],
    ids=[
        "negative_budget",
        "negative_weight",
        "nan_weight",
        "infinite_lag",
        "both_weights_zero",
        "share_without_a_value",
        "zero_share",
        "tenant_with_a_space",
        "tenant_twice",
        "fair_flag_without_fair_sharing",
        "share_without_fair_sharing",
    ],
)
def test_a_bad_worker_flag_exits_2_naming_it(
    flags: list[str], named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tidegate.worker import server

    started: list[object] = []
    monkeypatch.setattr(server, "serve_worker", lambda *args: started.append(args) or 0)
    result = CliRunner().invoke(app, ["worker", "--model", "sim", "--engine", "simulated", *flags])
    assert result.exit_code == 2, result.output
    assert named in result.output
    assert started == []
