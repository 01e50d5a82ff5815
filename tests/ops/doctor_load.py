"""Doctor's tests' helpers: a tidegate serve from a config dict, closed-loop load, the
command, one metric of a /metrics page, and the one-slot model the overload tests use."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.loadthreads import ClosedLoop, Send
from tests.procs import DEADLINE_S, TIDEGATE, child_env, gateway_process
from tidegate.ops.snapshot import parse_exposition


def serve(tmp_path: Path, models: list[dict[str, Any]], **sections: Any) -> Any:
    """``tidegate serve`` of these models (a context manager yielding its Proc)."""
    return gateway_process("--config", str(write_config(tmp_path, models, **sections)))


def write_config(tmp_path: Path, models: list[dict[str, Any]], **sections: Any) -> Path:
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump({"models": models, **sections}))
    return path


@contextlib.contextmanager
def load(
    url: str, model: str, clients: dict[str, int], text: str = "tide"
) -> Iterator[Counter[tuple[str, int]]]:
    """Closed-loop clients per priority that retry a 429 at once (ignoring Retry-After);
    counts (priority, status) of their answers."""
    body = json.dumps({"model": model, "input": text})

    def send(priority: str) -> Send:
        headers = {"X-Priority": priority, "Content-Type": "application/json"}

        def post(client: httpx.Client) -> httpx.Response:
            return client.post(f"{url}/v1/embeddings", content=body, headers=headers)

        return post

    loops = [(priority, send(priority)) for priority, n in clients.items() for _ in range(n)]
    with ClosedLoop(loops, daemon=True) as threads:
        yield threads.counts


def tidegate(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The ``tidegate`` command (``env``: more variables), its output captured."""
    return subprocess.run(
        [TIDEGATE, *args],
        capture_output=True,
        text=True,
        timeout=3 * DEADLINE_S,
        env={**child_env(), **env},
        check=False,
    )


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the series of ``name`` on ``url``'s /metrics that carry these labels."""
    samples = parse_exposition(httpx.get(f"{url}/metrics", timeout=DEADLINE_S).text)
    return sum(
        value
        for (n, found), value in samples.items()
        if n == name and all((k, v) in found for k, v in labels.items())
    )


def sim_model(profile: Path, **fields: Any) -> dict[str, Any]:
    return {
        "name": "sim",
        "task": "embeddings",
        "engine": "simulated",
        "profile": str(profile),
        "replicas": 1,
        **fields,
    }


def one_slot_model(profile: Path, **fields: Any) -> dict[str, Any]:
    """One replica that takes one request at a time (batches of one, one slot), a queue of
    four, and an autoscaler whose target per replica is never reached."""
    return sim_model(
        profile,
        slots=1,
        batching={"max_batch_size": 1, "batch_window_ms": 0},
        queue={"max_size": 4},
        autoscaling={"min_replicas": 1, "max_replicas": 2, "target_per_replica": 1000},
        **fields,
    )
