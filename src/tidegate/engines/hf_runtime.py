"""What the transformers engines share: quiet logs and the memory report."""

from __future__ import annotations

import logging
import resource
import sys
from typing import Any

from tidegate.engines.base import MemoryReport


def quiet_transformers() -> None:
    """No progress bars nor info logs from transformers; errors still show."""
    from transformers.utils import logging as transformers_logging

    hf_logging: Any = transformers_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)


def engine_memory(model: Any, device: str) -> MemoryReport:
    """Weights: parameters and buffers. Peak: the CUDA allocator's, or the process RSS."""
    import torch

    weights = 0
    if model is not None:
        tensors = [*model.parameters(), *model.buffers()]
        weights = sum(t.numel() * t.element_size() for t in tensors)
    if device.startswith("cuda"):
        peak = int(torch.cuda.max_memory_allocated(torch.device(device)))
    else:
        peak = peak_rss_bytes()
    return MemoryReport(device=device, weights_bytes=weights, peak_bytes=peak)


def peak_rss_bytes() -> int:
    """The peak resident memory of this process."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # KiB on Linux, bytes on macOS


def claim_device(device: str, memory_fraction: float | None, threads: int | None = None) -> Any:
    """The torch device to load on; on CUDA, cap this process's share of its memory.

    The cap (``torch.cuda.set_per_process_memory_fraction``) is what keeps replicas that
    share a GPU inside the memory placement gave them: an allocation beyond it fails in
    this process instead of starving the others. ``threads`` sets torch's intra-op threads
    for the process (``engine_threads``): by default torch takes every core, and when the
    gateway or another worker needs one of them, each operator waits for its slowest thread
    (docs/configuration.md, ``engine_threads``).
    """
    import torch

    if memory_fraction is not None and not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1], not {memory_fraction}")
    if threads is not None:
        torch.set_num_threads(check_threads(threads))
    target = torch.device(device)
    if target.type == "cuda":
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        if memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(memory_fraction, target)
        torch.cuda.reset_peak_memory_stats(target)
    return target


def check_threads(threads: int) -> int:
    """``threads`` if it is a valid intra-op thread count; ValueError otherwise."""
    if threads < 1:
        raise ValueError(f"engine threads must be at least 1, not {threads}")
    return threads
