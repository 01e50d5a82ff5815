"""Accelerator metrics of a worker on a CUDA device, read from NVML at scrape time.

The names, units and ``gpu`` / ``UUID`` labels are DCGM exporter's, so a dashboard or an
alert written for DCGM reads a tidegate worker unchanged:

- ``DCGM_FI_DEV_GPU_UTIL{gpu,UUID,model}``: percent of the last sample period in which a
  kernel ran on the device (NVML's utilization rate);
- ``DCGM_FI_DEV_FB_USED`` / ``DCGM_FI_DEV_FB_FREE{gpu,UUID,model}``: frame buffer memory
  in use and free, MiB.

``gpu`` is NVML's index of the device, ``UUID`` its UUID, ``model`` the model the worker
serves. The numbers are the whole device's, not this process's share: replicas sharing a GPU
report the same values (aggregate them with ``max by (UUID)``, never ``sum``).

Which device: the worker's ``cuda:K`` is the K-th entry of ``CUDA_VISIBLE_DEVICES`` when it
is set (an index or a ``GPU-`` UUID: NVML itself ignores that variable), else NVML's index K.

NVML comes from nvidia-ml-py (module ``pynvml``), imported on the first scrape. Without it,
without a driver, or with a device NVML does not know, the worker exports none of these
metrics and logs why once; an NVML error during one scrape leaves them out of that scrape.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("tidegate.worker")
MIB = 1024 * 1024
LABELS = ("gpu", "UUID", "model")
_HELP = {
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %), from NVML.",
    "DCGM_FI_DEV_FB_USED": "Frame buffer memory used (in MiB), from NVML.",
    "DCGM_FI_DEV_FB_FREE": "Frame buffer memory free (in MiB), from NVML.",
}


def import_nvml() -> Any:
    """The NVML binding (nvidia-ml-py); ImportError when it is not installed."""
    import pynvml

    return pynvml


def nvml_selector(device: str, cuda_visible_devices: str | None) -> int | str | None:
    """What names the worker's device to NVML: an index, a UUID, or None when not on CUDA.

    ``cuda_visible_devices`` is the worker's ``CUDA_VISIBLE_DEVICES`` (None: not set).
    Raises ValueError when ``device`` is beyond the visible devices.
    """
    kind, _, index_text = device.partition(":")
    if kind != "cuda":
        return None
    index = int(index_text or "0")
    if cuda_visible_devices is None:
        return index
    visible = [entry.strip() for entry in cuda_visible_devices.split(",") if entry.strip()]
    if index >= len(visible):
        raise ValueError(
            f"device {device} is not among CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}"
        )
    entry = visible[index]
    return int(entry) if entry.isdigit() else entry


@dataclass(frozen=True, slots=True)
class _Device:
    nvml: Any
    handle: Any
    labels: tuple[str, str, str]  # gpu, UUID, model


class NvmlCollector(Collector):
    """DCGM-named gauges of one device, read when scraped; nothing when NVML is not there."""

    def __init__(
        self, model: str, selector: int | str, load: Callable[[], Any] = import_nvml
    ) -> None:
        self.model = model
        self.selector = selector
        self._load = load
        self._device: _Device | None = None
        self._unavailable = False  # NVML could not be set up: never try again
        self._last_error = ""  # the last scrape error logged, to log each new one once

    def describe(self) -> Iterable[Metric]:
        """The names, so that registering checks them without touching NVML."""
        return [GaugeMetricFamily(name, text, labels=LABELS) for name, text in _HELP.items()]

    def collect(self) -> Iterator[Metric]:
        device = self._open()
        if device is None:
            return
        nvml = device.nvml
        try:
            utilization = nvml.nvmlDeviceGetUtilizationRates(device.handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(device.handle)
        except nvml.NVMLError as exc:
            if str(exc) != self._last_error:
                self._last_error = str(exc)
                log.warning("NVML: no GPU metrics in this scrape: %s", exc)
            return
        values = {
            "DCGM_FI_DEV_GPU_UTIL": float(utilization.gpu),
            "DCGM_FI_DEV_FB_USED": float(int(memory.used) // MIB),
            "DCGM_FI_DEV_FB_FREE": float(int(memory.free) // MIB),
        }
        for name, value in values.items():
            family = GaugeMetricFamily(name, _HELP[name], labels=LABELS)
            family.add_metric(device.labels, value)
            yield family

    def close(self) -> None:
        """Release NVML (the worker stops); a later scrape would open it again."""
        device, self._device = self._device, None
        if device is not None:
            _shut_down(device.nvml)

    def _open(self) -> _Device | None:
        if self._device is not None or self._unavailable:
            return self._device
        try:
            nvml = self._load()
        except ImportError:
            self._give_up("nvidia-ml-py is not installed (pip install nvidia-ml-py)")
            return None
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            self._give_up(f"NVML did not load: {exc}")
            return None
        try:
            if isinstance(self.selector, int):
                handle = nvml.nvmlDeviceGetHandleByIndex(self.selector)
            else:
                handle = nvml.nvmlDeviceGetHandleByUUID(self.selector)
            index = int(nvml.nvmlDeviceGetIndex(handle))
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        except nvml.NVMLError as exc:
            self._give_up(f"NVML does not know device {self.selector!r}: {exc}")
            _shut_down(nvml)
            return None
        self._device = _Device(nvml, handle, (str(index), uuid, self.model))
        return self._device

    def _give_up(self, reason: str) -> None:
        self._unavailable = True
        log.warning("worker %s exports no GPU metrics (DCGM_FI_*): %s", self.model, reason)


def _shut_down(nvml: Any) -> None:
    with contextlib.suppress(nvml.NVMLError):  # nothing left to release
        nvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    """nvidia-ml-py answers str; releases before 11.5 answered bytes."""
    return value.decode() if isinstance(value, bytes) else value
