"""Helpers of the simulator tests: fixture traces, configs from dicts, flat profiles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tidegate.config import TidegateConfig, parse_config
from tidegate.engines.profile import parse_profile
from tidegate.sim.recorder import RequestRecord
from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.service import ServiceModel, from_profile
from tidegate.sim.workload import Arrival, Listed

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def config_of(data: dict[str, Any], policy: str = "priority") -> TidegateConfig:
    """A resolved config from a dict, as ``load_config`` resolves a file (policy overridden)."""
    return parse_config(
        {**data, "gateway": {**data.get("gateway", {}), "policy": policy}}, "<test>"
    )


def flat_batch_service(latency_ms: float) -> ServiceModel:
    """Embeddings: every batch takes ``latency_ms`` whatever its size."""
    data = {
        "version": 1,
        "model": "flat",
        "task": "embeddings",
        "embeddings": {"points": [{"batch_size": 1, "latency_ms": latency_ms}]},
    }
    return from_profile(parse_profile(data, "<test>"), "<test>")


def flat_step_service(step_ms: float) -> ServiceModel:
    """Generation: every engine step takes ``step_ms``, prefill or not."""
    data = {
        "version": 1,
        "model": "flat",
        "task": "generate",
        "generate": {"points": [{"concurrency": 1, "ttft_ms": step_ms, "itl_ms": step_ms}]},
    }
    return from_profile(parse_profile(data, "<test>"), "<test>")


def run_records(
    data: dict[str, Any],
    service: ServiceModel,
    arrivals: list[Arrival],
    policy: str = "priority",
    replicas: int = 1,
) -> dict[str, RequestRecord]:
    """Run the config's first model on ``arrivals``; one exact record per request, by id."""
    scenario = Scenario(
        config_of(data, policy),
        data["models"][0]["name"],
        service,
        Listed("test", arrivals),
        {"shared": replicas},
        keep_requests=True,
    )
    result = Simulation(scenario).run()
    assert result.recorder.requests is not None
    return {record.id: record for record in result.recorder.requests}


def autoscaled_data(**autoscaling: Any) -> dict[str, Any]:
    """One embeddings model ``m`` of 4 slots in pool ``shared``, autoscaled 1..6 every 1 s
    on 4 per replica (``autoscaling`` overrides its keys)."""
    return {
        "pools": {"shared": {"priorities": ["high", "medium", "low"], "devices": ["cpu"]}},
        "models": [
            {
                "name": "m",
                "task": "embeddings",
                "engine": "simulated",
                "pools": ["shared"],
                "slots": 4,
                "batching": {"max_batch_size": 4, "batch_window_ms": 0},
                "queue": {"max_size": 100000},
                "autoscaling": {
                    "min_replicas": 1,
                    "max_replicas": 6,
                    "target_per_replica": 4,
                    "interval_s": 1,
                    "stable_window_s": 0,
                    **autoscaling,
                },
            }
        ],
    }
