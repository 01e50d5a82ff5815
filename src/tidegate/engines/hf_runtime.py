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
        # ru_maxrss is KiB on Linux, bytes on macOS.
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = rss if sys.platform == "darwin" else rss * 1024
    return MemoryReport(device=device, weights_bytes=weights, peak_bytes=peak)
