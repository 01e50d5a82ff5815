"""benchmarks/host_speed.py: the probe of the host's own steadiness beside bench_sim_fidelity."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import host_speed  # noqa: E402


def test_spread_and_range_read_the_samples() -> None:
    speed = host_speed.HostSpeed("work", 10.0, (10.0, 11.0, 12.0, 13.0, 20.0))
    assert speed.quantile(0.1) == 10.0
    assert speed.quantile(0.5) == 12.0
    assert speed.quantile(0.9) == 20.0
    assert speed.spread == pytest.approx(2.0)
    assert speed.range == pytest.approx(2.0)
    assert "p90/p10 2.00x" in speed.line()
    assert speed.as_dict()["samples_ms"] == (10.0, 11.0, 12.0, 13.0, 20.0)


def test_the_command_times_real_work_and_writes_its_samples(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    probe = [sys.executable, str(BENCHMARKS / "host_speed.py"), "--seconds", "0", "--every-s", "0"]
    done = subprocess.run(
        [*probe, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("host speed (")
    data = json.loads(out.read_text())
    assert len(data["samples_ms"]) == 1  # at least one sample, however short the probe
    assert data["samples_ms"][0] > 0
    assert data["spread"] == data["range"] == 1.0
