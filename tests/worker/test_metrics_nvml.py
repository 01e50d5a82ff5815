"""The worker's GPU metrics (DCGM exporter names) over a fake NVML binding.

This machine has no GPU: the fake stands at the library boundary (the ``pynvml`` module),
everything above it is the worker's own registry and exposition. The last tests use the
real import: with no binding or no driver, a CUDA worker's scrape still works.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tidegate.worker.nvml_metrics import MIB, nvml_selector
from tidegate.worker.runtime import Worker, WorkerSettings

DCGM = ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE")


class FakeNvmlError(Exception):
    """What pynvml raises: NVMLError and its subclasses."""


@dataclass
class FakeGpu:
    uuid: str
    utilization_pct: int
    used_bytes: int
    free_bytes: int


@dataclass
class FakeNvml:
    """The part of pynvml the collector calls; handles are NVML indexes."""

    gpus: list[FakeGpu]
    init_error: str | None = None
    scrape_errors: list[str] = field(default_factory=list)  # raised by the next reads
    calls: list[str] = field(default_factory=list)
    NVMLError = FakeNvmlError

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise FakeNvmlError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index >= len(self.gpus):
            raise FakeNvmlError("Invalid Argument")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        for index, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid:
                return index
        raise FakeNvmlError("Not Found")

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self.gpus[handle].uuid

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        if self.scrape_errors:
            raise FakeNvmlError(self.scrape_errors.pop(0))
        return SimpleNamespace(gpu=self.gpus[handle].utilization_pct, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        gpu = self.gpus[handle]
        return SimpleNamespace(
            total=gpu.used_bytes + gpu.free_bytes, used=gpu.used_bytes, free=gpu.free_bytes
        )


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu("GPU-aaaa", 5, 1 * 1024 * MIB, 79 * 1024 * MIB),
            FakeGpu("GPU-bbbb", 37, 20_000 * MIB + 123, 61_000 * MIB),
        ]
    )


def worker_on(device: str, load: Any) -> Worker:
    return Worker(WorkerSettings(model="chat", device=device), load_nvml=load)


def scrape(worker: Worker) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of the worker's /metrics text, by sample name."""
    text = generate_latest(worker.metrics.registry).decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


@pytest.mark.parametrize(
    ("device", "visible", "expected"),
    [
        ("cpu", None, None),
        ("cpu", "0", None),
        ("cuda", None, 0),
        ("cuda:1", None, 1),
        ("cuda:0", "3", 3),  # the local orchestrator's CUDA_VISIBLE_DEVICES=N, --device cuda:0
        ("cuda:1", "2, GPU-bbbb", "GPU-bbbb"),
    ],
)
def test_nvml_selector_names_the_workers_device(
    device: str, visible: str | None, expected: int | str | None
) -> None:
    assert nvml_selector(device, visible) == expected


def test_nvml_selector_refuses_a_device_beyond_the_visible_ones() -> None:
    with pytest.raises(ValueError, match="not among CUDA_VISIBLE_DEVICES"):
        nvml_selector("cuda:2", "0,1")


def test_a_worker_on_a_gpu_exports_its_devices_dcgm_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    nvml = two_gpus()
    samples = scrape(worker_on("cuda:0", lambda: nvml))
    labels = {"gpu": "1", "UUID": "GPU-bbbb", "model": "chat"}
    assert samples["DCGM_FI_DEV_GPU_UTIL"] == [(labels, 37.0)]
    assert samples["DCGM_FI_DEV_FB_USED"] == [(labels, 20_000.0)]  # whole MiB, as DCGM
    assert samples["DCGM_FI_DEV_FB_FREE"] == [(labels, 61_000.0)]
    assert samples["process_resident_memory_bytes"][0][1] > 0


def test_gpu_metrics_are_read_at_each_scrape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")
    nvml = two_gpus()
    worker = worker_on("cuda:0", lambda: nvml)
    assert scrape(worker)["DCGM_FI_DEV_GPU_UTIL"][0][1] == 5.0
    nvml.gpus[0].utilization_pct = 99
    nvml.gpus[0].used_bytes = 2048 * MIB
    after = scrape(worker)
    assert after["DCGM_FI_DEV_GPU_UTIL"][0][1] == 99.0
    assert after["DCGM_FI_DEV_FB_USED"][0][1] == 2048.0
    assert nvml.calls == ["init"]  # set up once, not per scrape


def test_a_cpu_worker_never_loads_nvml() -> None:
    def load() -> Any:
        raise AssertionError("a cpu worker loaded NVML")

    worker = worker_on("cpu", load)
    assert worker.gpu_metrics is None
    samples = scrape(worker)
    assert not set(DCGM) & samples.keys()
    assert samples["process_cpu_seconds_total"][0][1] > 0


def no_binding() -> Any:
    raise ImportError("No module named 'pynvml'")


@pytest.mark.parametrize(
    ("load", "reason"),
    [
        (no_binding, "nvidia-ml-py is not installed"),
        (lambda: FakeNvml([], init_error="Driver Not Loaded"), "NVML did not load"),
        (lambda: FakeNvml([]), "NVML does not know device 0"),
    ],
    ids=["no-binding", "no-driver", "no-such-device"],
)
def test_without_nvml_a_gpu_worker_scrapes_without_gpu_metrics_and_says_why_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, load: Any, reason: str
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    calls: list[int] = []

    def counted() -> Any:
        calls.append(1)
        return load()

    worker = worker_on("cuda:0", counted)
    with caplog.at_level(logging.WARNING, logger="tidegate.worker"):
        for _ in range(3):
            samples = scrape(worker)
            assert not set(DCGM) & samples.keys()
            assert samples["process_resident_memory_bytes"][0][1] > 0
    assert len(calls) == 1  # given up for good: no retry on every scrape
    warnings = [r.getMessage() for r in caplog.records if "no GPU metrics" in r.getMessage()]
    assert len(warnings) == 1
    assert reason in warnings[0]


def test_an_nvml_error_during_a_scrape_leaves_out_only_that_scrape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = two_gpus()
    worker = worker_on("cuda:1", lambda: nvml)
    nvml.scrape_errors.append("GPU is lost")
    first = scrape(worker)
    assert not set(DCGM) & first.keys()
    assert "process_cpu_seconds_total" in first
    assert scrape(worker)["DCGM_FI_DEV_GPU_UTIL"][0][1] == 37.0


@pytest.mark.asyncio
async def test_stopping_the_worker_releases_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = two_gpus()
    worker = worker_on("cuda:0", lambda: nvml)
    scrape(worker)
    await worker.stop()
    assert nvml.calls == ["init", "shutdown"]


def test_the_real_binding_without_a_gpu_breaks_no_scrape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # This machine has no NVIDIA driver: whether nvidia-ml-py is installed or not, the
    # real import path ends in "no GPU metrics", never in a failed scrape.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    worker = Worker(WorkerSettings(model="chat", device="cuda:0"))
    samples = scrape(worker)
    assert not set(DCGM) & samples.keys()
    assert samples["process_resident_memory_bytes"][0][1] > 0
