"""Local replicas: ``tidegate worker`` processes that the gateway starts, watches and restarts.

One ``Replica`` per local replica in the configuration (for each model that is not served by
upstreams, for each pool, ``count`` of them), with ids like ``minilm-shared-0``. Each gets a
device round-robin over its pool's devices (``auto``: the GPUs NVML finds, else cpu). A
``cuda:N`` replica runs with ``CUDA_VISIBLE_DEVICES=N`` (NVML's index, so with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``) and ``--device cuda:0``; a cpu one
with ``CUDA_VISIBLE_DEVICES`` empty, so it never touches a GPU.

Each replica has one supervisor task for its whole life:

1. launch ``tidegate worker ... --host 127.0.0.1 --port 0`` and read the address it prints
   as its first stdout line (STARTING);
2. poll its ``/readyz`` every 0.2 s: WARMING while it answers 503, READY once it answers
   200 (``slots`` from the config, else from the worker's ``/stats``). Not ready within
   ``ready_timeout_s`` of the launch: it is killed;
3. wait for the process to exit (event-driven: no liveness polling). Any exit that
   ``stop()`` did not cause is a failure: FAILED with the exit status (and the last line of
   its stderr), then a restart after a back-off of 1, 2, 4 ... ``max_backoff_s`` seconds,
   reset to 1 s once a replica has been ready for ``RESET_BACKOFF_AFTER_S`` (control.lifecycle).

No orphans: every worker runs in its own process group (stopped as a whole) and, on Linux,
with the parent-death signal set to SIGTERM, so even a SIGKILLed gateway takes its workers
down. The kernel sends that signal when the *thread* that forked the worker ends: run the
event loop that calls ``start()`` in a thread that lives as long as the gateway (the main
thread, as ``asyncio.run`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import functools
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from tidegate.config import TidegateConfig
from tidegate.control import lifecycle
from tidegate.control.inventory import initial_placement, memory_fraction, nvml_devices
from tidegate.control.lifecycle import MIN_BACKOFF_S
from tidegate.control.orchestrator import ReplicaSpec
from tidegate.gateway.replicas import Replica, ReplicaState
from tidegate.worker.runtime import WorkerSettings

log = logging.getLogger("tidegate.control")

WORKER_HOST = "127.0.0.1"
STDERR_TAIL_BYTES = 4000  # logged when a worker exits
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_CLI_FALLBACK = "import sys; from tidegate.cli import app; sys.exit(app(prog_name='tidegate'))"


# ----------------------------------------------------------------------------- placement
def gpu_count() -> int:
    """GPUs NVML finds; 0 without ``pynvml``, without a driver, or on an NVML error."""
    try:
        import pynvml
    except ImportError:
        log.info("pynvml is not installed: device auto means cpu")
        return 0
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.info("NVML is unavailable (%s): device auto means cpu", exc)
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError as exc:
        log.warning("NVML cannot count GPUs (%s): device auto means cpu", exc)
        return 0
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def resolve_devices(devices: Iterable[str], gpus: Callable[[], int] = gpu_count) -> list[str]:
    """A pool's devices with ``auto`` replaced by ``cuda:0..N-1`` (or ``cpu`` without GPUs)."""
    resolved: list[str] = []
    for device in devices:
        if device == "auto":
            count = gpus()
            resolved.extend([f"cuda:{index}" for index in range(count)] or ["cpu"])
        else:
            resolved.append(device)
    return resolved


def device_env(device: str) -> tuple[str, dict[str, str]]:
    """The worker's ``--device`` and environment for a placement (cpu or cuda:N)."""
    if device.startswith("cuda:"):
        # N is NVML's index, in PCI bus order; CUDA's own order (fastest first) may differ
        # on a host with mixed GPUs, and would put the worker on another device.
        index = device.removeprefix("cuda:")
        return "cuda:0", {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": index}
    return "cpu", {"CUDA_VISIBLE_DEVICES": ""}


def tidegate_command() -> list[str]:
    """How to run the ``tidegate`` CLI with this interpreter."""
    script = Path(sys.executable).with_name("tidegate")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-c", _CLI_FALLBACK]


def worker_command(settings: WorkerSettings, log_level: str = "info") -> list[str]:
    """``tidegate worker`` with the options of ``settings``, on a free loopback port.

    ``queue_max_size`` and ``warmup_tokens`` have no command-line option: workers use the
    defaults.
    """
    s = settings
    args = [
        *tidegate_command(),
        "worker",
        "--model",
        s.model,
        "--engine",
        s.engine,
        "--device",
        s.device,
        "--host",
        WORKER_HOST,
        "--port",
        "0",
        "--max-batch-size",
        str(s.max_batch_size),
        "--batch-window-ms",
        str(s.batch_window_ms),
        "--max-num-seqs",
        str(s.max_num_seqs),
        "--seed",
        str(s.seed),
        "--log-level",
        log_level,
    ]
    if s.model_path is not None:
        args += ["--model-path", s.model_path]
    if s.task is not None:
        args += ["--task", s.task]
    if s.max_batch_tokens is not None:
        args += ["--max-batch-tokens", str(s.max_batch_tokens)]
    args += _adaptive_batching_args(s)
    if s.profile is not None:
        args += ["--profile", s.profile]
    if s.probe_max_ms is not None:
        args += ["--probe-max-ms", f"{s.probe_max_ms:g}"]
    if s.memory_fraction is not None:
        args += ["--memory-fraction", f"{s.memory_fraction:.4f}"]
    if s.engine_process is not None:
        args.append("--engine-process" if s.engine_process else "--no-engine-process")
    if s.engine_threads is not None:
        args += ["--engine-threads", str(s.engine_threads)]
    if s.max_prefill_tokens:
        args += ["--max-prefill-tokens", str(s.max_prefill_tokens)]
    return args + _fairness_args(s)


def parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when its parent dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError) as exc:
        log.warning("prctl is unavailable (%s): workers outlive a killed gateway", exc)
        return None
    parent = os.getpid()

    def set_parent_death_signal() -> None:  # runs in the child, between fork and exec
        prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before prctl: nobody would signal us
            os.kill(os.getpid(), signal.SIGTERM)

    return set_parent_death_signal


def worker_preexec() -> Callable[[], None]:
    """The ``preexec_fn`` of a worker: the parent-death signal, and no inherited descriptor.

    Every descriptor above stdio is marked close-on-exec in the child, because the event
    loop the gateway runs on (uvloop) ignores ``close_fds``: whatever a library left
    inheritable (a listening socket, once) would otherwise live on in every worker.
    """
    death_signal = parent_death_signal()

    def preexec() -> None:  # runs in the child, between fork and exec
        if death_signal is not None:
            death_signal()
        _close_on_exec_above_stdio()

    return preexec


def _close_on_exec_above_stdio() -> None:
    try:
        fds: Iterable[int] = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: every descriptor the process may have
        fds = range(3, min(os.sysconf("SC_OPEN_MAX"), 65536))
    for fd in fds:
        if fd > 2:
            with contextlib.suppress(OSError):  # the listing's own, closed by now
                os.set_inheritable(fd, False)


# ----------------------------------------------------------------------------- processes
@dataclass(eq=False)
class _Slot:
    """One replica's process and tasks."""

    replica: Replica
    settings: WorkerSettings
    device: str  # the placement: cpu or cuda:N
    env: dict[str, str]
    log_path: Path | None
    process: asyncio.subprocess.Process | None = None
    supervisor: asyncio.Task[None] | None = None
    spawning: asyncio.Task[asyncio.subprocess.Process] | None = None
    drain: asyncio.Task[None] | None = None
    launched: asyncio.Event = field(default_factory=asyncio.Event)  # first launch settled
    log_offset: int = 0  # where this launch's stderr starts in the log file

    @property
    def running(self) -> asyncio.subprocess.Process | None:
        process = self.process
        return process if process is not None and process.returncode is None else None


class LocalWorkers:
    """Starts, watches, restarts and stops the local worker processes of a configuration.

    ``replicas`` exist from construction on (STARTING); ``start()`` launches them, and every
    state change reaches ``on_change`` through ``Replica.set_state``.
    """

    def __init__(
        self,
        config: TidegateConfig,
        *,
        on_change: Callable[[Replica], None],
        log_dir: Path | None = None,
        ready_timeout_s: float = 300.0,
        max_backoff_s: float = 30.0,
    ) -> None:
        self.config = config
        self.log_dir = log_dir
        self.ready_timeout_s = ready_timeout_s
        self.max_backoff_s = max(max_backoff_s, MIN_BACKOFF_S)
        self._slots: dict[str, _Slot] = {}
        self._client: httpx.AsyncClient | None = None
        self._started = False
        self._stop_task: asyncio.Task[None] | None = None
        base_env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        base_env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._base_env = base_env
        gpus = functools.cache(gpu_count)  # NVML is asked once, and only for auto
        pool_devices: dict[str, list[str]] = {}
        next_device: dict[str, int] = {}
        # Declared devices: core placement (memory, exclusivity, spread); else turns.
        placed = initial_placement(config)[0].assignments
        for model in config.models.values():
            if not model.local:
                continue
            for pool, count in model.replicas.items():
                if pool not in pool_devices:
                    pool_devices[pool] = resolve_devices(config.pools[pool].devices, gpus)
                    next_device[pool] = 0
                devices = pool_devices[pool]
                for index in range(count):
                    device = (
                        placed.get(f"{model.name}-{pool}-{index}")
                        or devices[next_device[pool] % len(devices)]
                    )
                    next_device[pool] += 1
                    worker_device, env = device_env(device)
                    replica = Replica(
                        id=f"{model.name}-{pool}-{index}",
                        model=model.name,
                        pool=pool,
                        kind="local",
                        slots=model.slots or 1,
                        detail="not started",
                        on_change=on_change,
                    )
                    log_path = None if log_dir is None else log_dir / f"{replica.id}.log"
                    settings = dataclasses.replace(
                        config.worker_settings(model.name, worker_device),
                        memory_fraction=memory_fraction(
                            device,
                            model.memory_mb,
                            model.exclusive,
                            config.devices or nvml_devices(),
                        ),
                    )
                    self._slots[replica.id] = _Slot(
                        replica,
                        settings,
                        device,
                        {**base_env, **env},
                        log_path,
                    )
        self.replicas: list[Replica] = [slot.replica for slot in self._slots.values()]

    # ------------------------------------------------------------------ queries
    def device_of(self, replica_id: str) -> str:
        """Where a replica runs: cpu or cuda:N (``auto`` resolved)."""
        return self._slot(replica_id).device

    def pid(self, replica_id: str) -> int | None:
        """The process id of a replica's running worker, or None."""
        process = self._slot(replica_id).running
        return None if process is None else process.pid

    def log_path(self, replica_id: str) -> Path | None:
        """The file that holds a replica's stderr, or None when it is inherited."""
        return self._slot(replica_id).log_path

    def _slot(self, replica_id: str) -> _Slot:
        try:
            return self._slots[replica_id]
        except KeyError:
            known = ", ".join(self._slots) or "none"
            raise KeyError(f"unknown local replica {replica_id!r}; known: {known}") from None

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Launch every replica's worker at once; return when each has bound or failed once.

        Readiness comes later, through ``on_change``.
        """
        if self._started or self._stop_task is not None:
            raise RuntimeError("LocalWorkers.start() was already called, or stop() was")
        self._started = True
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(2.0, connect=1.0))
        for slot in self._slots.values():
            self._supervise_slot(slot)
        await asyncio.gather(*(slot.launched.wait() for slot in self._slots.values()))

    def _supervise_slot(self, slot: _Slot) -> None:
        slot.supervisor = asyncio.create_task(
            self._supervise(slot), name=f"supervise-{slot.replica.id}"
        )
        slot.supervisor.add_done_callback(self._supervisor_done)

    async def stop(self, timeout_s: float = 10) -> None:
        """Stop every worker: SIGTERM, SIGKILL after ``timeout_s``, reap. Idempotent."""
        if self._stop_task is None:
            self._stop_task = asyncio.create_task(self._stop(timeout_s), name="local-stop")
        # Shielded: a caller that gives up waiting does not leave workers half-stopped.
        await asyncio.shield(self._stop_task)

    # ------------------------------------------------------ the Orchestrator protocol
    async def start_replica(
        self, spec: ReplicaSpec, on_change: Callable[[Replica], None]
    ) -> Replica:
        """Launch one more replica (the controller scaling up); it is STARTING on return."""
        if self._stop_task is not None:
            raise RuntimeError("LocalWorkers were stopped: no new replica")
        if spec.replica_id in self._slots:
            raise ValueError(f"replica {spec.replica_id} exists already")
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(2.0, connect=1.0))
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        worker_device, env = device_env(spec.device)
        replica = Replica(
            id=spec.replica_id,
            model=spec.model,
            pool=spec.pool,
            kind="local",
            slots=spec.slots or 1,
            detail="not started",
            on_change=on_change,
        )
        settings = dataclasses.replace(spec.settings, device=worker_device)
        log_path = None if self.log_dir is None else self.log_dir / f"{replica.id}.log"
        slot = _Slot(replica, settings, spec.device, {**self._base_env, **env}, log_path)
        self._slots[replica.id] = slot
        self.replicas.append(replica)
        self._supervise_slot(slot)
        return replica

    async def stop_replica(self, replica_id: str, timeout_s: float) -> None:
        """Stop one replica's worker (SIGTERM, SIGKILL after ``timeout_s``): STOPPED."""
        slot = self._slots.pop(replica_id, None)
        if slot is None:
            return  # stopped already
        self.replicas.remove(slot.replica)
        await self._stop_slots([slot], timeout_s)

    def list_replicas(self) -> list[Replica]:
        return list(self.replicas)

    def endpoint(self, replica_id: str) -> str | None:
        slot = self._slots.get(replica_id)
        return None if slot is None else slot.replica.url

    async def close(self) -> None:
        await self.stop()

    def kill(self, replica_id: str) -> None:
        """SIGKILL a replica's process group, as a crash would (for tests)."""
        process = self._slot(replica_id).running
        if process is None:
            raise ProcessLookupError(f"replica {replica_id} has no running worker")
        _signal_group(process, signal.SIGKILL)

    async def _stop(self, timeout_s: float) -> None:
        await self._stop_slots(list(self._slots.values()), timeout_s)
        if self._client is not None:
            await self._client.aclose()

    async def _stop_slots(self, slots: list[_Slot], timeout_s: float) -> None:
        supervisors = [s.supervisor for s in slots if s.supervisor is not None]
        for task in supervisors:
            task.cancel()
        if supervisors:
            await asyncio.wait(supervisors)
        # A launch in progress finishes (it is shielded from its supervisor's cancellation),
        # so its process is known and stopped below.
        spawning = [s.spawning for s in slots if s.spawning is not None]
        if spawning:
            await asyncio.wait(spawning)
            for launch in spawning:
                lifecycle.retrieve(launch, "launch")
        running = [p for p in (s.running for s in slots) if p is not None]
        for process in running:
            _signal_group(process, signal.SIGTERM)
        if running:
            waits = [asyncio.create_task(process.wait()) for process in running]
            _, pending = await asyncio.wait(waits, timeout=timeout_s)
            for process in running:
                if process.returncode is None:
                    log.warning(
                        "worker %d ignored SIGTERM for %gs: SIGKILL", process.pid, timeout_s
                    )
                    _signal_group(process, signal.SIGKILL)
            if pending:
                await asyncio.wait(pending)
        drains = [s.drain for s in slots if s.drain is not None]
        await lifecycle.cancel(drains)
        for slot in slots:
            slot.replica.url = None
            slot.replica.set_state(ReplicaState.STOPPED, "stopped")
            slot.launched.set()

    def _supervisor_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # a bug: say so loudly, and keep the replica out of rotation
            log.error("supervisor %s crashed", task.get_name(), exc_info=exc)
            replica_id = task.get_name().removeprefix("supervise-")
            slot = self._slots.get(replica_id)
            if slot is None:
                return  # stopped by stop_replica meanwhile
            slot.replica.set_state(ReplicaState.FAILED, f"supervisor crashed: {exc!r}")
            slot.launched.set()

    # --------------------------------------------------------------- supervision
    async def _supervise(self, slot: _Slot) -> None:
        run_once = functools.partial(self._run_once, slot)
        await lifecycle.restart_forever(slot.replica, run_once, self.max_backoff_s)

    async def _run_once(self, slot: _Slot) -> float:
        """One worker process from launch to exit; returns how long it was READY."""
        replica = slot.replica
        replica.url = None
        what = "launching" if replica.restarts == 0 else f"restart {replica.restarts}"
        replica.set_state(ReplicaState.STARTING, f"{what} on {slot.device}")
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            slot.spawning = asyncio.create_task(self._spawn(slot), name=f"spawn-{replica.id}")
            try:
                process = await asyncio.shield(slot.spawning)
            except OSError as exc:
                replica.set_state(
                    ReplicaState.FAILED, lifecycle.clip(f"cannot launch the worker: {exc}")
                )
                return 0.0
            finally:
                if slot.spawning.done():
                    slot.spawning = None
            exited = asyncio.create_task(process.wait(), name=f"exit-{replica.id}")
            try:
                return await self._watch(slot, process, exited, deadline)
            finally:
                await lifecycle.cancel([exited])
        finally:
            slot.launched.set()

    async def _watch(
        self,
        slot: _Slot,
        process: asyncio.subprocess.Process,
        exited: asyncio.Task[int],
        deadline: float,
    ) -> float:
        replica = slot.replica
        url = await self._read_address(slot, process, deadline)
        ready_at: float | None = None
        if url is not None:
            replica.url = url
            slot.launched.set()
            assert self._client is not None
            configured = self.config.model(replica.model).slots
            slots = await lifecycle.ready_before(
                self._client, replica, url, configured, exited, deadline
            )
            if slots is not None:
                replica.slots = slots
                ready_at = time.monotonic()
                # launch to READY: the dispatcher's Retry-After when no replica is coming
                replica.startup_s = ready_at - (deadline - self.ready_timeout_s)
                replica.set_state(ReplicaState.READY, f"pid {process.pid} on {slot.device}")
                log.info(
                    "replica %s ready at %s (%d slots) %.1fs after its launch",
                    replica.id,
                    url,
                    replica.slots,
                    replica.startup_s,
                )
        killed_for = ""
        if ready_at is None and not exited.done():
            # No address (its stdout ended: it is exiting) or not ready by the deadline.
            await asyncio.wait({exited}, timeout=max(0.0, deadline - time.monotonic()))
            if not exited.done():
                killed_for = (
                    f"not ready within {self.ready_timeout_s:g}s of its launch"
                    if url is not None
                    else f"printed no address within {self.ready_timeout_s:g}s"
                )
                log.warning("replica %s %s: killing it", replica.id, killed_for)
                _signal_group(process, signal.SIGKILL)
        code = await exited  # the process's own exit: the only liveness signal
        ready_for_s = 0.0 if ready_at is None else time.monotonic() - ready_at
        await lifecycle.cancel([slot.drain] if slot.drain is not None else [])
        slot.drain = None
        replica.url = None
        detail = killed_for or (
            f"{_exit_text(code)} {'while ready' if ready_at is not None else 'while starting'}"
        )
        tail = self._stderr_tail(slot) if code > 0 else ""
        if tail:
            log.warning(
                "replica %s (pid %d) %s; its stderr ends:\n%s",
                replica.id,
                process.pid,
                detail,
                tail,
            )
            if reason := _reason(tail):
                detail = f"{detail}: {reason}"
        else:
            log.warning("replica %s (pid %d) %s", replica.id, process.pid, detail)
        replica.set_state(ReplicaState.FAILED, lifecycle.clip(detail))
        return ready_for_s

    async def _spawn(self, slot: _Slot) -> asyncio.subprocess.Process:
        quiet = slot.log_path is None  # inherited stderr: only warnings reach the console
        command = worker_command(slot.settings, "warning" if quiet else "info")
        stderr = self._open_log(slot, command)
        try:
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                env=slot.env,
                start_new_session=True,  # its own process group: stopped as a whole
                close_fds=True,  # honoured by asyncio's loop; uvloop's: see worker_preexec
                preexec_fn=worker_preexec(),
            )
        finally:
            if stderr is not None:
                stderr.close()  # the child has its own descriptor
        slot.process = process
        slot.replica.pid = process.pid
        log.info("replica %s: worker pid %d on %s", slot.replica.id, process.pid, slot.device)
        return process

    def _open_log(self, slot: _Slot, command: list[str]) -> IO[bytes] | None:
        if slot.log_path is None:
            return None
        file = slot.log_path.open("ab")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        file.write(f"--- {stamp} restarts={slot.replica.restarts}: {' '.join(command)}\n".encode())
        file.flush()
        slot.log_offset = file.tell()
        return file

    def _stderr_tail(self, slot: _Slot) -> str:
        if slot.log_path is None:
            return ""
        try:
            with slot.log_path.open("rb") as file:
                size = file.seek(0, os.SEEK_END)
                file.seek(max(slot.log_offset, size - STDERR_TAIL_BYTES))
                data = file.read()
        except OSError as exc:
            return f"(cannot read {slot.log_path}: {exc.strerror})"
        return data.decode("utf-8", "replace").strip()

    async def _read_address(
        self, slot: _Slot, process: asyncio.subprocess.Process, deadline: float
    ) -> str | None:
        """The worker's address (its first stdout line); None at EOF or past the deadline."""
        assert process.stdout is not None
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                while line := await process.stdout.readline():
                    text = line.decode("utf-8", "replace").strip()
                    if text.startswith("http://"):
                        break
                    log.warning("replica %s printed %r before its address", slot.replica.id, text)
                else:
                    return None
        except TimeoutError:
            return None
        slot.drain = asyncio.create_task(
            _drain(slot.replica.id, process.stdout), name=f"stdout-{slot.replica.id}"
        )
        return text


# ----------------------------------------------------------------------------- helpers
async def _drain(replica_id: str, stdout: asyncio.StreamReader) -> None:
    """Read what a worker prints after its address, so its stdout pipe never fills."""
    while line := await stdout.readline():
        log.debug("replica %s stdout: %s", replica_id, line.decode("utf-8", "replace").rstrip())


def _signal_group(process: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):  # it has just exited
            os.killpg(process.pid, sig)


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")


def _reason(stderr_tail: str) -> str:
    """The last exception line of a worker's stderr (its traceback's verdict), or ""."""
    lines = stderr_tail.splitlines()
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line):
            return line.strip()
    for line in reversed(lines):
        if " ERROR " in line or " CRITICAL " in line:
            return line.strip()
    return ""


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _fairness_args(s: WorkerSettings) -> list[str]:
    """The worker flags of fair sharing in its sequence queue (none when it is off); the
    worker holds no slots back, so ``reserve_fraction`` has no flag."""
    fairness = s.fairness
    if fairness is None:
        return []
    args = [
        "--fair-sharing",
        "--fair-input-weight",
        repr(fairness.input_weight),
        "--fair-output-weight",
        repr(fairness.output_weight),
        "--fair-lag-tokens",
        repr(fairness.lag_tokens),
    ]
    for tenant, share in fairness.shares:
        args += ["--tenant-share", f"{tenant}={share!r}"]
    return args


def _adaptive_batching_args(s: WorkerSettings) -> list[str]:
    """The worker flags of adaptive batching that differ from their defaults."""
    args: list[str] = []
    if s.level_windows_ms:
        windows = ",".join("" if w is None else f"{w:g}" for w in s.level_windows_ms)
        args += ["--level-windows-ms", windows]
    if s.load_aware_window:
        args.append("--load-aware-window")
    if s.length_candidates:
        args += ["--length-candidates", str(s.length_candidates)]
        args += ["--max-padding-ratio", f"{s.max_padding_ratio:g}"]
        if s.batch_overhead_tokens is not None:
            args += ["--batch-overhead-tokens", f"{s.batch_overhead_tokens:g}"]
    if s.target_p99_ms is not None:
        args += ["--target-p99-ms", f"{s.target_p99_ms:g}"]
        args += ["--min-batch-size", str(s.min_batch_size)]
    return args
