"""plan_batch: when a replica should release the batch it is forming.

Design note. Waiting makes batches larger (throughput) and requests later (latency). The
rule bounds the cost of waiting: a batch is released as soon as it is full, by count
(``max_batch_size``) or by tokens (``max_batch_tokens``), and never later than
``batch_window_ms`` after its oldest member arrived. When more than a full batch is queued
the batch is full by construction, so it goes at once: waiting could not make it larger.

The view is the head of a WaitQueue in pick order; the caller then pops exactly the
released requests (``WaitQueue.pop`` with the same ``now`` returns the same ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tidegate.core.request import Request


@dataclass(frozen=True, slots=True)
class BatchConfig:
    max_batch_size: int = 32
    max_batch_tokens: int | None = None  # None: only the count bounds a batch
    batch_window_ms: float = 5.0  # longest a request waits for companions

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.batch_window_ms < 0:
            raise ValueError(f"batch_window_ms must be >= 0, got {self.batch_window_ms}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")


@dataclass(frozen=True, slots=True)
class BatchView:
    """What the planner sees: the head of the queue in pick order, and its size."""

    head: Sequence[Request]  # at least max_batch_size + 1 requests when that many are queued
    num_queued: int


@dataclass(frozen=True, slots=True)
class Release:
    batch: tuple[Request, ...]
    reason: str  # "full_size", "full_tokens", "backlog" or "window"


@dataclass(frozen=True, slots=True)
class WaitUntil:
    at: float | None  # None: nothing queued, wait for an arrival


BatchPlan = Release | WaitUntil


def plan_batch(view: BatchView, config: BatchConfig, now: float) -> BatchPlan:
    """Release the batch now, or say when to look again (see the module design note)."""
    batch, stopped_by_tokens = _fill(view.head, config)
    if not batch:
        return WaitUntil(None)
    if len(batch) >= config.max_batch_size:
        return Release(batch, "full_size")
    if stopped_by_tokens:
        return Release(batch, "full_tokens")
    if view.num_queued > len(batch):
        # Unreachable with a complete head (the batch would be full); kept for a short view.
        return Release(batch, "backlog")
    window_ends_at = min(request.arrival_at for request in batch) + config.batch_window_ms / 1e3
    if now >= window_ends_at:
        return Release(batch, "window")
    return WaitUntil(window_ends_at)


def _fill(head: Sequence[Request], config: BatchConfig) -> tuple[tuple[Request, ...], bool]:
    """Take requests in order while they fit; True when the token budget stopped it."""
    taken: list[Request] = []
    tokens = 0
    for request in head:
        if len(taken) >= config.max_batch_size:
            break
        budget = config.max_batch_tokens
        if budget is not None and taken and tokens + request.cost_tokens > budget:
            return tuple(taken), True
        taken.append(request)
        tokens += request.cost_tokens
    # A batch whose budget is spent cannot grow either, even if nothing more is queued.
    return tuple(taken), config.max_batch_tokens is not None and tokens >= config.max_batch_tokens
