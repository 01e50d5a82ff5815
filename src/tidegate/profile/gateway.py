"""``tidegate profile --through-gateway``: service times measured inside ``tidegate serve``.

A worker measured alone (the default sweeps) has the machine to itself and its load
generator; inside ``tidegate serve`` the gateway, the workers' HTTP and the clients share the
CPUs, and on a small machine the same batch takes far longer there (docs/benchmarks.md,
"Fidelity": 160 ms against 109 ms for a batch of 31 on 2 CPUs). Through the gateway the
planner starts ``tidegate serve`` (the deployment's ``--config``, or one replica of
``--model`` with the default gateway), sends its load to the gateway, and reads the service
times the stack itself reports: the worker's ``tidegate_batch_duration_seconds`` and
``tidegate_batch_size`` on its own /metrics (the worker is found through the gateway's
``/admin/replicas``), never the client's latencies. The profile it writes is the ordinary
one, so the simulator and the simulated engine read it unchanged.

- Embeddings: one ``tidegate serve`` with the model's ``batching.max_batch_size`` set to
  ``--max-batch`` (one replica, the config's window and slots) and 1, 2, 4 ... 2 x max batch
  requests in flight through the gateway, every level measured: the batches it forms span 1
  to max batch, and the curve is the worker's mean engine time per batch against the mean
  batch it formed at each level. One start instead of one per batch size (a stack takes
  about 10 s to start here), so the profile can be measured again just before the load it
  is meant for on a machine whose other work comes and goes.
- Generation: one ``tidegate serve`` with ``max_num_seqs`` = ``--max-batch``, the concurrency
  sweep through the gateway (the worker reports no per-step time: the time to first token
  and inter-token latency are the client's, which include the gateway and the HTTP, so the
  simulator's round trip measured against it comes out near zero).
- ``--url`` with ``--through-gateway``: a ``tidegate serve`` already running there; the
  concurrency sweep only (its batching cannot be set), batch counters from its first
  replica of the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tidegate.control.local import tidegate_command
from tidegate.errors import ConfigError, ReplicaFailed
from tidegate.profile.child import ChildGroup, spawn

READY_POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class Stack:
    """A running ``tidegate serve``: where to send load, and the worker to read."""

    gateway_url: str
    worker_url: str
    worker_pid: int | None


def base_config(config: Path | None) -> dict[str, Any]:
    """The deployment's config (``--config``) as data; {} for the generated one."""
    if config is None:
        return {}
    try:
        data = yaml.safe_load(config.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(
            str(config), "(file)", f"cannot read it ({exc})", "check the path"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(str(config), "(top level)", "not a mapping", "pass a serve config")
    return data


def stack_config(
    base: dict[str, Any],
    model: str,
    task: str,
    batch: int,
    *,
    engine: str,
    sim_profile: str | None,
    model_path: str | None,
    device: str,
    port: int,
) -> dict[str, Any]:
    """``base`` with one replica of ``model`` batching at most ``batch``, on 127.0.0.1:port.

    Without a ``base`` (no ``--config``) the model entry is built from the options; with one,
    the entry named ``model`` must be there (a ConfigError names the file otherwise). Other
    models of the config are left out: the point measures this one.
    """
    data = copy.deepcopy(base)
    gateway = dict(data.get("gateway") or {})
    gateway.update({"host": "127.0.0.1", "port": port})
    gateway.setdefault("shutdown_timeout_s", 5)
    data["gateway"] = gateway
    models = [m for m in data.get("models") or [] if isinstance(m, dict)]
    entry = next((dict(m) for m in models if m.get("name") == model), None)
    if entry is None:
        if base:
            names = [m.get("name") for m in models]
            raise ConfigError(
                "--config",
                "models",
                f"has no model named {model!r} (it has {names})",
                "give --model one of them",
            )
        entry = {"name": model, "task": task, "engine": engine}  # placement: the config's
        if model_path is not None:
            entry["model_path"] = model_path
        if sim_profile is not None:
            entry["profile"] = sim_profile
    entry["replicas"] = 1
    entry.pop("autoscaling", None)  # one replica, held: the point measures one
    batching = dict(entry.get("batching") or {})
    if task == "embeddings":
        batching["max_batch_size"] = batch
    else:
        batching["max_num_seqs"] = batch
    entry["batching"] = batching
    data["models"] = [entry]
    return data


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def find_worker(session: aiohttp.ClientSession, gateway_url: str, model: str) -> Stack:
    """The first ready replica of ``model``, from the gateway's ``/admin/replicas``."""
    url = gateway_url.rstrip("/")
    try:
        async with session.get(f"{url}/admin/replicas") as response:
            if response.status != 200:
                raise ReplicaFailed(
                    f"{url}/admin/replicas answered {response.status}: --through-gateway "
                    "reads the worker from it (an open gateway, or one without keys)"
                )
            replicas = await response.json(content_type=None)
    except aiohttp.ClientError as exc:
        raise ReplicaFailed(f"{url}: GET /admin/replicas failed ({exc})") from exc
    for replica in (replicas.get(model) or {}).get("replicas") or []:
        if replica.get("state") == "ready" and replica.get("url"):
            pid = replica.get("pid")
            return Stack(url, str(replica["url"]).rstrip("/"), int(pid) if pid else None)
    raise ReplicaFailed(f"{url} has no ready replica of {model!r} (/admin/replicas)")


class LocalStack(ChildGroup):
    """One ``tidegate serve`` process; use ``async with LocalStack.start(...)``."""

    stop_timeout_s = 20.0  # the gateway drains, then stops its workers
    stderr_tail_bytes = 3000

    @classmethod
    @contextlib.asynccontextmanager
    async def start(
        cls,
        session: aiohttp.ClientSession,
        config: dict[str, Any],
        model: str,
        ready_timeout_s: float,
        stop: asyncio.Event,
    ) -> AsyncIterator[Stack | None]:
        """Start it and wait until ``model`` is ready; None when ``stop`` came first."""
        port = int(config["gateway"]["port"])
        with (
            tempfile.NamedTemporaryFile("w", suffix=".yaml") as file,
            tempfile.TemporaryFile() as stderr,
        ):
            yaml.safe_dump(config, file)
            file.flush()
            command = [*tidegate_command(), "serve", "--config", file.name]
            process = await spawn(
                [*command, "--log-level", "warning"], stderr, stdout=asyncio.subprocess.DEVNULL
            )
            stack = cls(process, stderr)
            try:
                url = f"http://127.0.0.1:{port}"
                ready = await stack._until_ready(session, url, model, ready_timeout_s, stop)
                yield await find_worker(session, url, model) if ready else None
            finally:
                await stack.stop()

    async def _until_ready(
        self,
        session: aiohttp.ClientSession,
        url: str,
        model: str,
        timeout_s: float,
        stop: asyncio.Event,
    ) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not stop.is_set():
            if self.process.returncode is not None:
                raise self._failure(f"exited with status {self.process.returncode}")
            with contextlib.suppress(aiohttp.ClientError, ValueError):
                async with session.get(f"{url}/readyz") as response:
                    body = await response.json(content_type=None)
                    if response.status == 200 and model in body.get("ready_models", []):
                        return True
            await asyncio.sleep(READY_POLL_S)
        if stop.is_set():
            return False
        raise self._failure("was not ready in time")

    async def stop(self) -> None:
        """SIGTERM the process group (the gateway drains and stops its workers)."""
        await super().stop()
        # Workers live in the gateway's group unless they made their own: make sure.
        self._signal(signal.SIGKILL)

    def _failure(self, what: str) -> ReplicaFailed:
        return ReplicaFailed(
            f"tidegate serve (pid {self.process.pid}, {sys.executable}) {what}; "
            f"its last output:\n{self._stderr_tail()}"
        )


def configured_window(base: dict[str, Any], model: str) -> float:
    """The batch window the deployment's config gives ``model``; the default otherwise."""
    from tidegate.profile.options import DEFAULT_WINDOW_MS

    for entry in base.get("models") or []:
        if isinstance(entry, dict) and entry.get("name") == model:
            window = (entry.get("batching") or {}).get("batch_window_ms")
            if window is not None:
                return float(window)
    return DEFAULT_WINDOW_MS
