"""``tidegate profile --through-gateway``: the serve config of each point, and end to end.

The e2e test profiles a simulated engine with a known curve inside a real ``tidegate serve``:
the curve comes from the worker's /metrics (the engine's own time, so it recovers the known
one), the load went through the gateway, and no process is left behind.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.procs import TIDEGATE, child_env
from tidegate.config import parse_config
from tidegate.engines.profile import load_profile
from tidegate.errors import ConfigError
from tidegate.profile.gateway import configured_window, stack_config
from tidegate.profile.openloop import calibrated_curve, closed_loop_curve, embeddings_capacity
from tidegate.profile.options import DEFAULT_WINDOW_MS, ProfileOptions

KNOWN_BATCH_MS = {1: 60.0, 2: 70.0, 4: 90.0}
PROFILE_TIMEOUT_S = 900


def stack(base: dict[str, Any], model: str, task: str, batch: int) -> dict[str, Any]:
    data: dict[str, Any] = stack_config(
        base,
        model,
        task,
        batch,
        engine="simulated",
        sim_profile="/p.json",
        model_path=None,
        device="cpu",
        port=12345,
    )
    return data


def test_generated_config_is_one_replica_of_the_model_at_the_batch() -> None:
    data = stack({}, "m", "embeddings", 8)
    assert data["gateway"]["host"] == "127.0.0.1"
    assert data["gateway"]["port"] == 12345
    (entry,) = data["models"]
    assert entry == {
        "name": "m",
        "task": "embeddings",
        "engine": "simulated",
        "profile": "/p.json",
        "replicas": 1,
        "batching": {"max_batch_size": 8},
    }
    parse_config(data, "<test>")  # a valid serve config


def test_the_deployment_config_keeps_its_settings_but_one_replica_and_the_batch() -> None:
    base: dict[str, Any] = {
        "gateway": {"policy": "fifo", "port": 9000},
        "models": [
            {"name": "other", "task": "embeddings", "engine": "simulated", "profile": "/o"},
            {
                "name": "m",
                "task": "generate",
                "engine": "simulated",
                "profile": "/q",
                "replicas": 3,
                "batching": {"max_num_seqs": 64},
                "queue": {"max_size": 50},
                "autoscaling": {"min_replicas": 1, "max_replicas": 4},
            },
        ],
    }
    data = stack(base, "m", "generate", 16)
    assert data["gateway"] == {
        "policy": "fifo",
        "port": 12345,
        "host": "127.0.0.1",
        "shutdown_timeout_s": 5,
    }
    (entry,) = data["models"]
    assert entry["replicas"] == 1
    assert entry["batching"] == {"max_num_seqs": 16}
    assert entry["queue"] == {"max_size": 50}
    assert entry["profile"] == "/q"
    assert "autoscaling" not in entry
    assert base["models"][1]["replicas"] == 3  # the caller's data is not changed


def test_a_config_without_the_model_names_it() -> None:
    base: dict[str, Any] = {"models": [{"name": "a", "task": "embeddings"}]}
    with pytest.raises(ConfigError, match="no model named 'm'"):
        stack(base, "m", "embeddings", 1)


def test_the_window_comes_from_the_config() -> None:
    base: dict[str, Any] = {"models": [{"name": "m", "batching": {"batch_window_ms": 2}}]}
    assert configured_window(base, "m") == 2.0
    assert configured_window({}, "m") == DEFAULT_WINDOW_MS


def test_config_without_through_gateway_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--through-gateway"):
        ProfileOptions(model="m", out=tmp_path, serve_config=tmp_path / "c.yaml")


@pytest.mark.e2e
def test_through_the_gateway_recovers_the_engine_curve_and_cleans_up(tmp_path: Path) -> None:
    known = tmp_path / "known.json"
    points = [{"batch_size": b, "latency_ms": ms} for b, ms in KNOWN_BATCH_MS.items()]
    known.write_text(
        json.dumps(
            {"version": 1, "model": "k", "task": "embeddings", "embeddings": {"points": points}}
        )
    )
    model = f"gw{uuid.uuid4().hex[:8]}"  # names its processes: none may outlive the run
    out = tmp_path / "out"
    result = subprocess.run(
        [
            TIDEGATE, "profile", "--model", model, "--engine", "simulated", "--sim-profile",
            str(known), "--through-gateway", "--max-batch", "4", "--min-seconds-per-point",
            "1.5", "--max-seconds-per-point", "8", "--out", str(out),
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=PROFILE_TIMEOUT_S,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("starting tidegate serve") == 1, result.stderr
    profile = load_profile(out / "profile.json")
    assert profile.raw["measured"]["through_gateway"] is True
    assert profile.engine == "simulated"
    assert [(p.sweep, p.concurrency) for p in profile.points] == [
        ("concurrency", 1), ("concurrency", 2), ("concurrency", 4), ("concurrency", 8)
    ]  # fmt: skip
    curve = profile.batch_latency_ms
    assert curve is not None
    assert len(curve.xs) >= 2  # batches of several sizes formed
    for point in profile.points:
        assert point.batch_size == 4  # the stack's max batch, whatever it formed
        assert point.mean_batch_size is not None
        assert 1.0 <= point.mean_batch_size <= min(4.0, point.concurrency) + 1e-9
        assert point.num_requests > 0
        # The engine's own time per batch: the known curve at the batch it formed; a loaded
        # machine adds time, never takes it away.
        lower = max(b for b in KNOWN_BATCH_MS if b <= point.mean_batch_size)
        assert point.batch_latency_ms is not None
        assert point.batch_latency_ms >= KNOWN_BATCH_MS[lower] * 0.9
    eight = profile.points[-1]
    assert eight.mean_batch_size is not None
    assert eight.mean_batch_size > 3.0  # 8 in flight, 8 slots: batches leave nearly full
    # The drift check: the top level once more before the sweep (not one of its points),
    # against the sweep's own; the engine sleeps a known curve, so both are of that curve.
    drift = profile.raw["measured"]["drift"]
    assert drift["concurrency"] == 8
    assert drift["figure"] == "engine time per batch"
    assert drift["last_ms"] == pytest.approx(eight.batch_latency_ms, rel=1e-3)
    assert drift["first_ms"] >= KNOWN_BATCH_MS[1] * 0.9
    assert drift["ratio"] == pytest.approx(drift["last_ms"] / drift["first_ms"], rel=1e-2)
    assert "(drift check, before the sweep)" in result.stderr
    assert "drift check: 8 in flight, measured before the sweep" in result.stderr
    assert "Drift check: 8 in flight" in (out / "report.md").read_text()
    # The open-loop point: Poisson arrivals at 85% of the capacity the closed-loop curve
    # predicts when arrivals keep coming, in the same stack; the curve written is the
    # closed-loop one times its factor.
    assert "open loop: Poisson arrivals" in result.stderr
    open_loop = profile.raw["measured"]["open_loop"]
    first = open_loop["tries"][0]
    closed = closed_loop_curve(profile.points)
    assert closed is not None
    capacity, best = embeddings_capacity(closed, 4, DEFAULT_WINDOW_MS)
    assert capacity <= best * 1.03
    assert first["capacity_rps"] == pytest.approx(capacity, rel=0.01)
    assert first["offered_rps"] == pytest.approx(0.85 * capacity, rel=0.35)
    assert first["mean_batch_size"] >= 1.0
    # The engine sleeps the known curve: a loaded machine adds time, never takes it away.
    # (Not the factor itself: it is over the closed loop's times, which a burst of other
    # work during those points inflates as much as it likes.)
    chosen = next(t for t in reversed(open_loop["tries"]) if t["factor"] is not None)
    floor_batch = max(b for b in KNOWN_BATCH_MS if b <= chosen["mean_batch_size"])
    assert chosen["batch_latency_ms"] >= KNOWN_BATCH_MS[floor_batch] * 0.9
    assert open_loop["factor"] == pytest.approx(
        chosen["batch_latency_ms"] / chosen["curve_ms"], rel=0.01
    )
    assert curve == calibrated_curve(closed, open_loop["at_mean_batch"], open_loop["factor"])
    leftovers = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any(model in part for part in (p.info["cmdline"] or []))
    ]
    assert leftovers == []
