"""Local worker processes (LocalWorkers) and static upstreams (UpstreamHealth), for real.

Workers use the simulated engine: a worker is ready about a second after its launch on an
idle machine, several on a busy one. Tests wait for the state changes they need (``Changes``)
with deadlines far beyond that, never for a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import Proc, child_env, stop, wait_for, worker_process
from tidegate.config import TidegateConfig, parse_config
from tidegate.control import local
from tidegate.control.controller import Controller
from tidegate.control.health import DEFAULT_UPSTREAM_SLOTS, UpstreamHealth
from tidegate.control.lifecycle import MIN_BACKOFF_S
from tidegate.control.local import LocalWorkers, device_env, resolve_devices, worker_command
from tidegate.control.orchestrator import ReplicaSpec
from tidegate.core.request import Request
from tidegate.gateway.replicas import Replica, ReplicaState
from tidegate.gateway.state import Gateway

READY, FAILED, STOPPED = ReplicaState.READY, ReplicaState.FAILED, ReplicaState.STOPPED
REPO = Path(__file__).resolve().parents[2]


def sim_config(*models: dict[str, Any], devices: list[str] | None = None) -> TidegateConfig:
    return parse_config(
        {"pools": {"shared": {"devices": devices or ["cpu"]}}, "models": list(models)}, "<test>"
    )


def sim(name: str = "sim", **extra: Any) -> dict[str, Any]:
    return {"name": name, "engine": "simulated", "task": "embeddings", **extra}


# A bound on waits for what happens within seconds on an idle machine: a worker's start-up,
# a restart. Far beyond it on a loaded one; reached only when the event never comes.
DEADLINE_S = 120.0


class Changes:
    """Records on_change calls (and when they came); tests wait on them, never on time."""

    def __init__(self) -> None:
        self.history: list[tuple[str, ReplicaState, str]] = []
        self.at: list[float] = []  # monotonic time of each history entry
        self._event = asyncio.Event()

    def __call__(self, replica: Replica) -> None:
        self.history.append((replica.id, replica.state, replica.detail))
        self.at.append(time.monotonic())
        self._event.set()

    def states(self, replica_id: str) -> list[ReplicaState]:
        return [state for rid, state, _ in self.history if rid == replica_id]

    def first_at(self, replica_id: str, state: ReplicaState, after: float = -math.inf) -> float:
        """When ``replica_id`` first entered ``state`` after ``after``."""
        return next(
            at
            for at, (rid, seen, _) in zip(self.at, self.history, strict=True)
            if rid == replica_id and seen is state and at > after
        )

    async def until(self, predicate: Callable[[], bool], timeout_s: float = DEADLINE_S) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while not predicate():
                    self._event.clear()
                    await self._event.wait()
        except TimeoutError:
            raise AssertionError(
                f"condition not met within {timeout_s:g}s; last changes: {self.history[-5:]}"
            ) from None


def alive(pid: int) -> bool:
    """A process exists and is not a zombie (a reparented zombie may linger unreaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@contextlib.asynccontextmanager
async def running(workers: LocalWorkers) -> AsyncIterator[LocalWorkers]:
    try:
        await workers.start()
        yield workers
    finally:
        await workers.stop(timeout_s=30)


# ----------------------------------------------------------------------------- no processes
def test_replicas_are_placed_round_robin_over_the_pool_devices() -> None:
    config = sim_config(
        sim("a", replicas=3), sim("b", replicas=1, slots=5), devices=["cuda:0", "cuda:3"]
    )
    workers = LocalWorkers(config, on_change=Changes())
    ids = [r.id for r in workers.replicas]
    assert ids == ["a-shared-0", "a-shared-1", "a-shared-2", "b-shared-0"]
    assert [workers.device_of(i) for i in ids] == ["cuda:0", "cuda:3", "cuda:0", "cuda:3"]
    assert {r.kind for r in workers.replicas} == {"local"}
    assert [r.state for r in workers.replicas] == [ReplicaState.STARTING] * 4
    assert workers.replicas[3].slots == 5
    # NVML numbers devices in PCI bus order; CUDA must count the same way.
    expected = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "3"}
    assert device_env("cuda:3") == ("cuda:0", expected)
    assert device_env("cpu") == ("cpu", {"CUDA_VISIBLE_DEVICES": ""})


def test_auto_is_the_gpus_nvml_finds_else_cpu() -> None:
    assert resolve_devices(["auto"], gpus=lambda: 0) == ["cpu"]
    assert resolve_devices(["auto"], gpus=lambda: 2) == ["cuda:0", "cuda:1"]
    assert resolve_devices(["cpu"], gpus=lambda: 2) == ["cpu"]
    assert local.gpu_count() >= 0  # without pynvml or a GPU: 0, never an error


def test_worker_command_carries_the_settings() -> None:
    config = sim_config(sim(batching={"max_batch_size": 8, "max_batch_tokens": 512}))
    command = worker_command(config.worker_settings("sim", "cuda:0"))
    pairs = dict(itertools.pairwise(command))
    assert "worker" in command
    assert pairs["--model"] == "sim"
    assert pairs["--engine"] == "simulated"
    assert pairs["--task"] == "embeddings"
    assert pairs["--device"] == "cuda:0"
    assert pairs["--max-batch-size"] == "8"
    assert pairs["--max-batch-tokens"] == "512"
    assert (pairs["--host"], pairs["--port"]) == ("127.0.0.1", "0")


def test_worker_command_round_trips_the_prefill_budget_and_fair_sharing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from typer.testing import CliRunner

    from tidegate.cli import app
    from tidegate.worker import server

    tenancy = {"fair_sharing": True, "input_weight": 0.5, "lag_tokens": 250, "weights": {"a": 3}}
    gen = sim(task="generate", batching={"max_prefill_tokens": 2048, "max_num_seqs": 8})
    config = parse_config(
        {"tenancy": tenancy, "pools": {"shared": {"devices": ["cpu"]}}, "models": [gen]}, "<t>"
    )
    settings = config.worker_settings("sim")
    assert settings.fairness is not None
    assert settings.fairness.reserve_fraction == 0.0
    command = worker_command(settings)
    started: list[Any] = []
    monkeypatch.setattr(server, "serve_worker", lambda s, *rest: started.append(s) or 0)
    result = CliRunner().invoke(app, command[command.index("worker") :])
    assert result.exit_code == 0, result.output
    assert started == [settings]  # every setting back as it was, the fairness included


def test_worker_command_leaves_the_defaults_out() -> None:
    settings = sim_config(sim(task="generate")).worker_settings("sim")
    command = worker_command(settings)
    assert settings.fairness is None
    assert not {"--max-prefill-tokens", "--fair-sharing", "--tenant-share"} & set(command)


# ----------------------------------------------------------------------------- local workers
@pytest.mark.asyncio
async def test_workers_start_restart_after_a_crash_and_stop(tmp_path: Path) -> None:
    changes = Changes()
    config = sim_config(sim(replicas=2), sim("fixed", slots=5))
    workers = LocalWorkers(config, on_change=changes, log_dir=tmp_path)
    a, b, fixed = workers.replicas
    assert (a.id, b.id, fixed.id) == ("sim-shared-0", "sim-shared-1", "fixed-shared-0")
    pids: list[int] = []
    async with running(workers):
        assert all(r.url is not None for r in workers.replicas)  # start() returns once bound
        await changes.until(lambda: all(r.state is READY for r in workers.replicas))
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            for replica in (a, b):
                stats = (await client.get(f"{replica.url}/stats")).json()
                assert replica.slots == stats["slots"] > 1
                answer = await client.post(
                    f"{replica.url}/v1/embeddings", json={"model": "sim", "input": "hi"}
                )
                assert answer.status_code == 200
            assert fixed.slots == 5  # the config's slots win over /stats
            pid_a, pid_b = workers.pid(a.id), workers.pid(b.id)
            assert pid_a is not None
            assert pid_b is not None
            pids += [pid_a, pid_b]

            workers.kill(a.id)
            await changes.until(lambda: a.state is FAILED)
            assert a.detail.startswith("killed by SIGKILL while ready"), a.detail
            assert a.url is None
            await changes.until(lambda: a.state is READY)
            assert a.restarts == 1
            new_pid = workers.pid(a.id)
            assert new_pid is not None
            assert new_pid != pid_a
            pids.append(new_pid)
            assert changes.states(a.id)[-4:] == [
                FAILED,
                ReplicaState.STARTING,
                ReplicaState.WARMING,
                READY,
            ] or changes.states(a.id)[-3:] == [FAILED, ReplicaState.STARTING, READY]
            assert (await client.get(f"{a.url}/readyz")).status_code == 200
            assert (b.state, b.restarts, workers.pid(b.id)) == (READY, 0, pid_b)
        fixed_pid = workers.pid(fixed.id)
        assert fixed_pid is not None
        pids.append(fixed_pid)
    assert [r.state for r in workers.replicas] == [STOPPED] * 3
    assert not any(alive(pid) for pid in pids), [pid for pid in pids if alive(pid)]
    assert workers.pid(a.id) is None
    await workers.stop()  # idempotent
    assert (tmp_path / "sim-shared-0.log").is_file()


@pytest.mark.asyncio
async def test_a_worker_that_cannot_load_fails_and_is_retried_with_backoff(
    tmp_path: Path,
) -> None:
    changes = Changes()
    config = sim_config(sim(profile=str(tmp_path / "missing.json")))
    workers = LocalWorkers(config, on_change=changes, log_dir=tmp_path / "logs")
    (replica,) = workers.replicas
    async with running(workers):
        await changes.until(lambda: replica.state is FAILED)
        assert replica.detail.startswith("exited with status 1 while starting"), replica.detail
        assert "missing.json" in replica.detail  # the last line of its stderr
        await changes.until(lambda: replica.restarts == 1 and replica.state is FAILED)
        # It backed off (1 s) before the retry: from the failure to the next launch, as the
        # changes were reported (a busy machine only makes the gap longer).
        failed_at = changes.first_at(replica.id, FAILED)
        relaunched_at = changes.first_at(replica.id, ReplicaState.STARTING, after=failed_at)
        assert relaunched_at - failed_at >= MIN_BACKOFF_S - 0.01
    assert replica.state is STOPPED
    log_text = (tmp_path / "logs" / f"{replica.id}.log").read_text()
    assert log_text.count("ConfigError") >= 2  # both attempts' stderr


# A worker that binds at once and then answers every request 503 "warming", forever.
NEVER_READY = textwrap.dedent(
    """
    import http.server

    class Warming(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"status": "warming"}'
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Warming)
    print(f"http://127.0.0.1:{server.server_port}", flush=True)
    server.serve_forever()
    """
)


@pytest.mark.asyncio
async def test_a_worker_not_ready_in_time_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    # The deadline runs from the launch, and a worker that has not even printed its address
    # by then is killed too (pid None, "printed no address"): it must cover the start-up on a
    # busy machine. The real worker binds after 1.3 s idle and 4.4 s beside `stress-ng --cpu
    # 2`; this stand-in after 0.1 s and 0.7 s, and then never gets ready, whatever the load.
    ready_timeout_s = 10.0
    monkeypatch.setattr(local, "tidegate_command", lambda: [sys.executable, "-c", NEVER_READY])
    changes = Changes()
    workers = LocalWorkers(sim_config(sim()), on_change=changes, ready_timeout_s=ready_timeout_s)
    (replica,) = workers.replicas
    before_launch = time.monotonic()
    async with running(workers):
        await changes.until(lambda: replica.state is ReplicaState.WARMING)  # bound, answering
        pid = workers.pid(replica.id)
        assert pid is not None
        assert alive(pid)
        await changes.until(lambda: replica.state is FAILED, ready_timeout_s + DEADLINE_S)
        assert replica.detail == "not ready within 10s of its launch", replica.detail
        assert not alive(pid)
        assert changes.first_at(replica.id, FAILED) - before_launch >= ready_timeout_s - 0.01


class _Watched:
    """LocalWorkers whose replicas also report to ``changes`` (the controller owns on_change)."""

    def __init__(self, workers: LocalWorkers, changes: Changes) -> None:
        self.workers = workers
        self.changes = changes

    async def start_replica(
        self, spec: ReplicaSpec, on_change: Callable[[Replica], None]
    ) -> Replica:
        def both(replica: Replica) -> None:
            on_change(replica)
            self.changes(replica)

        return await self.workers.start_replica(spec, both)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.workers, name)


@pytest.mark.asyncio
async def test_a_replica_the_autoscaler_places_is_listed_on_its_device() -> None:
    # A declared device that is no local cuda:N: the worker runs on the cpu, and the replica
    # is still listed on the device the controller placed it on, as its log says.
    config = parse_config(
        {
            "devices": [{"id": "node-c/gpu-0", "memory_mb": 1000, "node": "node-c"}],
            "pools": {"shared": {"devices": ["node-c/gpu-0"]}},
            "models": [
                sim(
                    replicas=0,
                    memory_mb=100,
                    autoscaling={
                        "min_replicas": 0,
                        "max_replicas": 1,
                        "target_per_replica": 4,
                        "scale_to_zero": True,
                    },
                )
            ],
        },
        "<test>",
    )
    changes = Changes()
    workers = LocalWorkers(config, on_change=changes)
    gateway = Gateway(config, replicas={})
    controller = Controller(gateway, _Watched(workers, changes), config)
    try:
        gateway.dispatchers["sim"].submit(Request("r0", "sim", 1, time.monotonic()))
        assert (await controller.tick("sim")).desired_replicas == 1  # a cold start from zero
        (added,) = workers.replicas
        await changes.until(lambda: added.state is READY)
        pid = workers.pid(added.id)
        assert added.describe()["detail"] == f"pid {pid} on node-c/gpu-0"
        assert workers.device_of(added.id) == "node-c/gpu-0"
        cmdline = await asyncio.to_thread(Path(f"/proc/{pid}/cmdline").read_bytes)
        argv = cmdline.split(b"\0")
        assert argv[argv.index(b"--device") + 1] == b"cpu"
    finally:
        await workers.stop(timeout_s=30)


ORPHAN_PARENT = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from tidegate.config import parse_config
    from tidegate.control.local import LocalWorkers

    async def main():
        config = parse_config(
            {"pools": {"shared": {"devices": ["cpu"]}},
             "models": [{"name": "sim", "engine": "simulated", "task": "embeddings"}]},
            "<orphan test>",
        )
        workers = LocalWorkers(config, on_change=lambda r: None, log_dir=Path(sys.argv[1]))
        await workers.start()
        print(workers.pid(workers.replicas[0].id), flush=True)
        await asyncio.Event().wait()  # until killed

    asyncio.run(main())
    """
)


def test_workers_die_with_a_killed_parent(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_PARENT, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=child_env(),
        cwd=REPO,
        start_new_session=True,
    )
    worker_pid: int | None = None
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline().strip()
        assert line.isdigit(), f"parent printed {line!r}"
        worker_pid = int(line)
        assert alive(worker_pid)
        parent.kill()  # SIGKILL: no clean-up code runs in the parent
        parent.wait(timeout=DEADLINE_S)
        # The worker gets SIGTERM from the kernel and shuts down: slower on a busy machine.
        wait_for(lambda pid=worker_pid: not alive(pid), timeout_s=DEADLINE_S)
    finally:
        stop(parent)
        if worker_pid is not None and alive(worker_pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker_pid, signal.SIGKILL)


# ----------------------------------------------------------------------------- upstreams
@pytest.fixture
def upstream() -> Iterator[Proc]:
    with worker_process("--model", "sim", "--engine", "simulated", "--task", "embeddings") as proc:
        yield proc


@pytest.mark.asyncio
async def test_an_upstream_is_ready_while_it_answers(upstream: Proc) -> None:
    changes = Changes()
    config = parse_config(
        {
            "models": [
                {
                    "name": "vllm",
                    "engine": "openai",
                    "task": "embeddings",
                    "upstreams": [f"{upstream.url}/v1"],
                }
            ]
        },
        "<test>",
    )
    # A probe that times out would fail the replica: give a busy machine time to answer.
    health = UpstreamHealth(config, on_change=changes, interval_s=0.2, timeout_s=DEADLINE_S)
    (replica,) = health.replicas
    assert (replica.id, replica.kind, replica.url) == ("vllm-0", "upstream", upstream.url)
    assert replica.slots == DEFAULT_UPSTREAM_SLOTS
    assert replica.pool == config.model("vllm").upstream_pool
    await health.start()
    try:
        await changes.until(lambda: replica.state is READY)
        assert replica.detail == "/readyz answers 200"
        await asyncio.to_thread(stop, upstream.process)
        await changes.until(lambda: replica.state is FAILED)
        # A check during the shutdown may have failed otherwise (the server closing its
        # connection); every check after it cannot connect. The detail changes without a state
        # change (no on_change): ask again until a check has seen the process gone.
        async with asyncio.timeout(DEADLINE_S):
            while "ConnectError" not in replica.detail:  # noqa: ASYNC110 (no event to wait on)
                await asyncio.sleep(0.05)
        assert replica.state is FAILED
    finally:
        await health.stop()
    assert replica.state is STOPPED
    await health.stop()  # idempotent


@pytest.mark.asyncio
async def test_upstream_probes_fall_back_on_404() -> None:
    answers: dict[str, dict[str, int]] = {
        "http://vllm.test": {"/health": 200},
        "http://plain.test": {"/v1/models": 200},
        "http://warming.test": {"/readyz": 503},
        "http://none.test": {},
    }
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        root = f"{request.url.scheme}://{request.url.host}"
        asked.append(f"{root}{request.url.path}")
        status = answers[root].get(request.url.path, 404)
        return httpx.Response(status, json={"status": "warming"} if status == 503 else {})

    config = parse_config(
        {
            "models": [
                {
                    "name": "m",
                    "engine": "openai",
                    "task": "generate",
                    "upstreams": list(answers),
                    "slots": 3,
                },
            ]
        },
        "<test>",
    )
    changes = Changes()
    health = UpstreamHealth(config, on_change=changes, transport=httpx.MockTransport(handler))
    vllm, plain, warming, none = health.replicas
    await health.start()
    try:
        await changes.until(
            lambda: all(r.state is not ReplicaState.STARTING for r in health.replicas)
        )
        assert (vllm.state, vllm.detail) == (READY, "/health answers 200")
        assert (plain.state, plain.detail) == (READY, "/v1/models answers 200")
        assert (warming.state, warming.detail) == (FAILED, "/readyz answers 503: warming")
        assert none.state is FAILED
        assert none.detail.startswith("no health endpoint")
        assert vllm.slots == 3
        asked.clear()
        await health.check(vllm)  # the path that answered is asked first
        assert asked == ["http://vllm.test/health"]
    finally:
        await health.stop()
