"""The GPU inventory: NVML on a GPU host, else what the config declares.

Placement (core ``place``) needs each device's memory; a replica that shares a GPU is held
to its share with a per-process CUDA memory fraction (``memory_fraction``): its ``memory_mb``
over the device's total. NVML is imported lazily (``pip install nvidia-ml-py``); without it,
or without a driver, the inventory is empty and replicas run on the CPU.

Untested here: this machine has no GPU. The CPU paths (declared devices, no NVML) are.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
from typing import TYPE_CHECKING

from tidegate.core.placement import Device, Placement, Refused, ReplicaAsk, place

if TYPE_CHECKING:
    from tidegate.config import TidegateConfig

log = logging.getLogger("tidegate.control")
_MIB = 1024 * 1024


@functools.cache
def nvml_devices() -> tuple[Device, ...]:
    """The GPUs of this host as ``cuda:N`` devices with their total memory; () without NVML."""
    try:
        import pynvml
    except ImportError:
        return ()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.info("NVML is unavailable (%s): no GPU inventory", exc)
        return ()
    try:
        node = socket.gethostname()
        devices = []
        for index in range(int(pynvml.nvmlDeviceGetCount())):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            devices.append(Device(f"cuda:{index}", total / _MIB, node))
        return tuple(devices)
    except pynvml.NVMLError as exc:
        log.warning("NVML cannot list GPUs (%s): no GPU inventory", exc)
        return ()
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def memory_fraction(
    device: str, memory_mb: float, exclusive: bool, devices: tuple[Device, ...]
) -> float | None:
    """The CUDA memory cap of a replica on ``device`` (cuda:N); None: not capped."""
    if exclusive or memory_mb <= 0 or not device.startswith("cuda:"):
        return None
    total = next((d.memory_mb for d in devices if d.id == device), None)
    if not total:
        return None
    return min(1.0, memory_mb / total)


def initial_placement(config: TidegateConfig) -> tuple[Placement, tuple[Refused, ...]]:
    """Where the configured local replicas go on the declared devices, pool by pool.

    Replica ids are those of ``LocalWorkers`` (``model-pool-index``); each pool is placed
    with its own strategy (binpack or spread). Empty without declared devices.
    """
    placement = Placement()
    refused: list[Refused] = []
    if not config.devices:
        return placement, ()
    for pool in config.pools.values():
        asks = [
            ReplicaAsk(f"{m.name}-{pool.name}-{i}", m.name, pool.name, m.memory_mb, m.exclusive)
            for m in config.models.values()
            if m.local
            for i in range(m.replicas.get(pool.name, 0))
        ]
        devices = [d for d in config.devices if d.id in pool.devices]
        result = place(asks, devices, placement, pool.placement)
        placement = result.placement
        refused.extend(result.refused)
    return placement, tuple(refused)
