"""What a point costs: CPU, memory and the worker's own batch counters, read at window edges.

A ``Snapshot`` is taken at the start and end of every measurement window; the difference of
two is what the window cost:

- CPU: the worker process's user + system seconds (psutil; 1.0 core = one core busy), the
  planner's own (its load generator), and the machine's busy time minus both: the other
  processes, which on a shared machine are the noise of the measurement.
- Memory: on CPU the worker's peak RSS (``VmHWM`` from /proc on Linux, else the RSS seen at
  the window edges); on a GPU the memory NVML sees the worker process use (the whole
  device's used memory with ``--url``), with the worker's own allocator peak from /metrics
  as a floor. The GPU path is written against the NVML API but untested here (no GPU).
- Batch counters: ``tidegate_batch_size`` and ``tidegate_batch_duration_seconds`` from a
  tidegate worker's /metrics, giving the mean batch and the engine time per batch; for a
  generation worker the engine's step table (``tidegate_engine_step*``,
  ``tidegate.engines.steps``), giving what a prompt joining a decoding batch costs and the
  engine's own decode and start steps of each point. Other servers (vLLM) have none: those
  fields stay empty.

psutil and nvidia-ml-py (both in the ``engine`` extra) are imported lazily; without
them the fields they feed are empty, never guessed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tidegate.engines.steps import (
    JoinCost,
    StepTable,
    join_cost_ms,
    parse_step_samples,
    table_between,
)

log = logging.getLogger("tidegate.profile")
_MB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Counters:
    """A tidegate worker's cumulative batch counters and memory gauges."""

    num_batches: float
    batched_inputs: float
    batch_seconds: float
    reported_peak_mb: float | None
    weights_mb: float | None
    steps: StepTable = field(default_factory=dict)  # a generation engine's step table


@dataclass(frozen=True, slots=True)
class Snapshot:
    at: float
    own_cpu_s: float  # this process: the load generator
    worker_cpu_s: float | None
    machine_busy_s: float | None  # all CPUs together
    memory_mb: float | None  # the worker's peak so far, as defined in the module docstring
    counters: Counters | None


@dataclass(frozen=True, slots=True)
class Usage:
    """What one stretch between two snapshots cost."""

    worker_cpu_cores: float | None
    loadgen_cpu_cores: float
    other_cpu_cores: float | None
    num_batches: float | None
    batch_latency_ms: float | None
    mean_batch_size: float | None
    join: JoinCost | None = None  # generation: a joiner's price over the stretch
    steps: StepTable = field(default_factory=dict)  # generation: the engine's steps in it


def usage_between(first: Snapshot, last: Snapshot) -> Usage:
    span = max(1e-9, last.at - first.at)
    own = (last.own_cpu_s - first.own_cpu_s) / span
    worker = _rate(first.worker_cpu_s, last.worker_cpu_s, span)
    busy = _rate(first.machine_busy_s, last.machine_busy_s, span)
    other = None if busy is None else max(0.0, busy - own - (worker or 0.0))
    batches = latency = mean_batch = join = None
    steps: StepTable = {}
    if first.counters is not None and last.counters is not None:
        batches = last.counters.num_batches - first.counters.num_batches
        if batches > 0:
            seconds = last.counters.batch_seconds - first.counters.batch_seconds
            latency = 1e3 * seconds / batches
            mean_batch = (last.counters.batched_inputs - first.counters.batched_inputs) / batches
        steps = table_between(first.counters.steps, last.counters.steps)
        join = join_cost_ms(steps)
    return Usage(worker, own, other, batches, latency, mean_batch, join, steps)


def _rate(first: float | None, last: float | None, span: float) -> float | None:
    return None if first is None or last is None else (last - first) / span


class ResourceMeter:
    """Takes snapshots of one server: a local worker (``pid``) or a remote one (no pid)."""

    def __init__(
        self, session: aiohttp.ClientSession, url: str, pid: int | None, device: str
    ) -> None:
        self.session = session
        self.url = url.rstrip("/")
        self.device = device
        self._process = _process(pid)
        self._psutil = _import_psutil()
        self._gpu = GpuMemory.open(device, pid) if device.startswith("cuda") else None
        self._has_metrics = True
        self._peak_mb: float | None = None

    async def snapshot(self) -> Snapshot:
        at = time.monotonic()  # the window edge; /metrics answers a few ms later
        counters = await self._counters()
        memory = self._memory_mb(counters)
        return Snapshot(
            at=at,
            own_cpu_s=time.process_time(),
            worker_cpu_s=self._worker_cpu_s(),
            machine_busy_s=self._machine_busy_s(),
            memory_mb=memory,
            counters=counters,
        )

    def close(self) -> None:
        if self._gpu is not None:
            self._gpu.close()

    def _worker_cpu_s(self) -> float | None:
        if self._process is None:
            return None
        try:
            times = self._process.cpu_times()
        except self._psutil.Error:  # the worker is gone; the point will show it
            return None
        return float(times.user + times.system)

    def _machine_busy_s(self) -> float | None:
        if self._psutil is None:
            return None
        times = self._psutil.cpu_times()
        # Linux counts guest time inside user time already; steal (the hypervisor's) is busy.
        not_busy = ("idle", "iowait", "guest", "guest_nice")
        return float(sum(times) - sum(getattr(times, name, 0.0) for name in not_busy))

    def _memory_mb(self, counters: Counters | None) -> float | None:
        seen = [
            self._gpu.used_mb() if self._gpu is not None else self._rss_peak_mb(),
            counters.reported_peak_mb if counters is not None else None,
        ]
        values = [v for v in seen if v is not None]
        if values:
            self._peak_mb = max([*values, self._peak_mb or 0.0])
        return self._peak_mb

    def _rss_peak_mb(self) -> float | None:
        if self._process is None:
            return None
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{self._process.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
        try:
            return float(self._process.memory_info().rss) / _MB
        except self._psutil.Error:  # the worker is gone
            return None

    async def _counters(self) -> Counters | None:
        if not self._has_metrics:
            return None
        try:
            async with self.session.get(f"{self.url}/metrics") as response:
                if response.status != 200:
                    self._has_metrics = False
                    return None
                text = await response.text()
        except aiohttp.ClientError as exc:
            log.debug("no /metrics at %s: %r", self.url, exc)
            return None
        counters = parse_counters(text)
        self._has_metrics = counters is not None
        return counters


def parse_counters(text: str) -> Counters | None:
    """The batch histograms and memory gauges of a tidegate worker; None for other servers.

    A histogram with labels has no samples before its first observation: zero batches then.
    """
    values: dict[str, float] = {}
    memory: dict[str, float] = {}
    steps: list[tuple[str, dict[str, str], float]] = []
    tidegate = False
    for family in text_string_to_metric_families(text):
        tidegate = tidegate or family.name.startswith("tidegate_")
        for sample in family.samples:
            if sample.name.startswith("tidegate_engine_step"):
                steps.append((sample.name, sample.labels, sample.value))
            elif sample.name.startswith(("tidegate_batch_size_", "tidegate_batch_duration_")):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
            elif sample.name == "tidegate_engine_memory_bytes":
                memory[sample.labels.get("kind", "")] = sample.value / _MB
    if not tidegate:
        return None  # another server: its batches are its own business
    return Counters(
        num_batches=values.get("tidegate_batch_duration_seconds_count", 0.0),
        batched_inputs=values.get("tidegate_batch_size_sum", 0.0),
        batch_seconds=values.get("tidegate_batch_duration_seconds_sum", 0.0),
        reported_peak_mb=memory.get("peak"),
        weights_mb=memory.get("weights"),
        steps=parse_step_samples(steps),
    )


def _import_psutil() -> Any:
    try:
        import psutil
    except ImportError:
        log.warning("psutil is not installed (extra `engine`): no CPU figures")
        return None
    return psutil


def _process(pid: int | None) -> Any:
    psutil = _import_psutil() if pid is not None else None
    if psutil is None:
        return None
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


class GpuMemory:
    """GPU memory through NVML: the worker process's, or the whole device's. Untested here."""

    def __init__(self, nvml: Any, handle: Any, pid: int | None) -> None:
        self._nvml = nvml
        self._handle = handle
        self._pid = pid

    @classmethod
    def open(cls, device: str, pid: int | None) -> GpuMemory | None:
        try:
            import pynvml
        except ImportError:
            log.warning("nvidia-ml-py is not installed (extra `engine`): no GPU memory figures")
            return None
        try:
            pynvml.nvmlInit()
            index = int(device.partition(":")[2] or 0)
            return cls(pynvml, pynvml.nvmlDeviceGetHandleByIndex(index), pid)
        except pynvml.NVMLError as exc:
            log.warning("NVML is unavailable (%s): no GPU memory figures", exc)
            return None

    def used_mb(self) -> float | None:
        nvml = self._nvml
        try:
            if self._pid is None:
                return float(nvml.nvmlDeviceGetMemoryInfo(self._handle).used) / _MB
            for process in nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
                if process.pid == self._pid and process.usedGpuMemory is not None:
                    return float(process.usedGpuMemory) / _MB
        except nvml.NVMLError as exc:
            log.debug("NVML memory query failed: %s", exc)
        return None

    def close(self) -> None:
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()
