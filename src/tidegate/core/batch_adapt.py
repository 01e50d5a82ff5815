"""What adaptive batching learns from what it sees: the arrival rate and the batch cap.

Design note. Both are small state objects the shell feeds with what happened (an arrival,
a request's latency) and the time it read; they read no clock and do no I/O, so the worker
and the simulator drive them identically and tests drive them with made-up times.

- ``ArrivalRate``: an exponentially decayed count of arrivals. With time constant ``tau_s``
  the count decays by ``exp(-dt / tau_s)``, and ``count / tau_s`` estimates arrivals per
  second (exact for a steady Poisson stream in expectation, once ``tau_s`` has passed). It
  forgets a burst within a few ``tau_s``.
- ``AdaptiveCap``: AIMD on the batch's count bound, driven by the most urgent level's
  latency and by what the batches found queued. Every ``num_samples`` latencies of that
  level it decides, from their P99 against the target, whether those requests spent more of
  their time (median) waiting than running ("queueing"), whether at least half the
  releases since the last decision left a cap's worth of requests still waiting
  ("backlog"), whether at least half were full at the cap ("full": the cap bound them),
  and the largest batch, in this order:

  1. backlog: the cap is multiplied by ``backlog_grow_factor`` (at least +1) up to
     ``max_batch_size`` (``grow_backlog``; ``hold_backlog`` at the bound), whatever the
     P99. A full next batch already waits, so the cap is what limits throughput: a larger
     batch drains the backlog in fewer, cheaper-per-request runs (the knee is where that
     stops paying). Measured before this rule: a cap halved while batches were short and
     held under a backlog cost 32% of the throughput at the knee and 50% at 2x overload.
  2. over target and queueing: +1 (``increase_queueing``; ``hold_queueing`` at the bound).
     The wait, not the batch, makes the level late; a smaller batch only drains the queue
     slower (measured: the cap spiralled to 1 and throughput fell to a third).
  3. over target, the batch's run time dominating, batches full: hold (``hold_full``).
     Batches that fill the cap mean at least a cap's worth arrives while one runs: the
     replica is saturated at this cap, and a smaller one would serve less than arrives and
     build a backlog (behind a gateway, which hands a replica at most two batches, the
     worker never sees that backlog: measured in the simulator with batches 3x slower than
     the minilm profile's, a cap that shrank there and grew back lost 9% of the
     throughput at the knee).
  4. over target, the batch's run time dominating, batches mostly under the cap and no
     backlog: multiplied by ``decrease_factor`` (``decrease``; ``hold`` at the floor),
     unless no batch since the last decision was larger than the smaller cap
     (``hold_short``): a cap no batch would have felt shortens nothing now, and only costs
     throughput when the load rises (measured on the real worker of a slow machine: a
     batch of 1 ran past the 100 ms target at low load, the cap halved, and the knee that
     followed ran at 0.79x the fixed rule's throughput until a backlog grew it back).
     Only here is the batch itself what makes urgent requests late while the cap has room
     the load does not need.
  5. under ``grow_below`` x target: +1 (``increase``), slowly back towards the throughput of
     large batches; in between it holds (``hold``: the dead band keeps it from flapping).

  The cap shrinks only while batches are mostly smaller than it and nothing waits, and
  grows while a cap's worth waits: it settles where its batches just keep up. It stays
  within ``[min_batch_size, max_batch_size]``: the upper bound is the configured maximum,
  which the profile's knee sets (``tidegate profile`` recommends it).
- ``BatchPlanner`` holds one replica's rule, rate and cap, and counts why batches left.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tidegate.core.batching import (
    RELEASE_REASONS,
    BatchConfig,
    BatchView,
    Release,
)
from tidegate.core.queue import WaitQueue
from tidegate.core.request import Request


class ArrivalRate:
    """Arrivals per second, exponentially weighted over ``tau_s`` (see the module note)."""

    __slots__ = ("_count", "_seen_at", "tau_s")

    def __init__(self, tau_s: float = 1.0) -> None:
        if tau_s <= 0:
            raise ValueError(f"tau_s must be > 0, got {tau_s}")
        self.tau_s = tau_s
        self._count = 0.0
        self._seen_at: float | None = None

    def observe(self, now: float, count: int = 1) -> None:
        self._count = self._decayed(now) + count
        self._seen_at = now if self._seen_at is None else max(self._seen_at, now)

    def rate_per_s(self, now: float) -> float | None:
        """None until the first arrival: no estimate yet."""
        if self._seen_at is None:
            return None
        return self._decayed(now) / self.tau_s

    def _decayed(self, now: float) -> float:
        if self._seen_at is None:
            return 0.0
        elapsed = max(0.0, now - self._seen_at)
        return self._count * math.exp(-elapsed / self.tau_s)


@dataclass(frozen=True, slots=True)
class CapConfig:
    target_p99_s: float  # the most urgent level's latency target at P99
    max_batch_size: int  # upper bound: the configured maximum (the profile's knee)
    min_batch_size: int = 1
    num_samples: int = 50  # latencies per decision
    decrease_factor: float = 0.5  # over target: cap *= this
    grow_below: float = 0.8  # P99 under this share of the target: cap += 1
    backlog_grow_factor: float = 2.0  # a cap's worth left waiting: cap *= this (>= +1)

    def __post_init__(self) -> None:
        if self.target_p99_s <= 0:
            raise ValueError(f"target_p99_s must be > 0, got {self.target_p99_s}")
        if not 1 <= self.min_batch_size <= self.max_batch_size:
            raise ValueError(
                f"need 1 <= min_batch_size <= max_batch_size, got "
                f"{self.min_batch_size} and {self.max_batch_size}"
            )
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if not 0 < self.decrease_factor < 1:
            raise ValueError(f"decrease_factor must be in (0, 1), got {self.decrease_factor}")
        if not 0 < self.grow_below <= 1:
            raise ValueError(f"grow_below must be in (0, 1], got {self.grow_below}")
        if self.backlog_grow_factor < 1:
            raise ValueError(f"backlog_grow_factor must be >= 1, got {self.backlog_grow_factor}")


def p99(samples: list[float]) -> float:
    """Nearest-rank 99th percentile of a non-empty list."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


# Why the cap moved or not: what /stats and explain show (the module note's rules).
CAP_DECISIONS = (
    "start",  # no decision yet: the cap starts at max_batch_size
    "grow_backlog",  # rule 1: a cap's worth was left waiting: a larger batch drains it
    "hold_backlog",  # rule 1 at max_batch_size
    "increase_queueing",  # rule 2: late from waiting, not from the batch: +1
    "hold_queueing",  # rule 2 at max_batch_size
    "hold_full",  # rule 3: late from the run, but batches fill the cap: saturated
    "decrease",  # rule 4: late from the batch's own run, room under the cap: shrink
    "hold_short",  # rule 4, but no batch was larger than the smaller cap: it would not bind
    "increase",  # rule 5: slack under grow_below x target: +1
    "hold",  # the dead band, or rule 4 / 5 at a bound
)


def decide_batch_cap(
    cap: int,
    p99_s: float,
    config: CapConfig,
    queueing: bool = False,
    backlogged: bool = False,
    full: bool = False,
    largest: int | None = None,
) -> tuple[int, str]:
    """The next cap and why (one of ``CAP_DECISIONS``; the module note's rules in order).

    ``largest``: the largest batch since the last decision (None: unknown, as if larger
    than any cap)."""
    low, high = config.min_batch_size, config.max_batch_size
    cap = min(max(cap, low), high)
    if backlogged:
        grown = min(high, max(cap + 1, math.floor(cap * config.backlog_grow_factor)))
        return (grown, "grow_backlog") if grown > cap else (cap, "hold_backlog")
    over = p99_s > config.target_p99_s
    if over and queueing:
        return (cap + 1, "increase_queueing") if cap < high else (cap, "hold_queueing")
    if over and full:
        return cap, "hold_full"
    if over:
        shrunk = max(low, math.floor(cap * config.decrease_factor))
        if shrunk == cap:
            return cap, "hold"
        if largest is not None and largest <= shrunk:
            return cap, "hold_short"
        return shrunk, "decrease"
    if p99_s < config.grow_below * config.target_p99_s and cap < high:
        return cap + 1, "increase"
    return cap, "hold"


class AdaptiveCap:
    """The cap, the latencies and the releases since the last decision (the module note)."""

    __slots__ = (
        "_backlogged",
        "_full",
        "_largest",
        "_releases",
        "_runs",
        "_samples",
        "_waits",
        "cap",
        "config",
        "decisions",
        "last_decision",
        "last_p99_s",
    )

    def __init__(self, config: CapConfig) -> None:
        self.config = config
        self.cap = config.max_batch_size  # start optimistic: the knee
        self._samples: list[float] = []
        self._waits: list[float] = []
        self._runs: list[float] = []
        self._releases = 0
        self._backlogged = 0
        self._full = 0
        self._largest = 0
        self.last_p99_s: float | None = None
        self.last_decision = "start"
        self.decisions: dict[str, int] = dict.fromkeys(CAP_DECISIONS[1:], 0)

    def released(self, size: int, left_waiting: int) -> None:
        """A batch of ``size`` left; ``left_waiting`` requests stayed queued behind it. A
        cap's worth or more is a backlog: the next batch is full before it starts."""
        self._releases += 1
        self._largest = max(self._largest, size)
        if size >= self.cap:
            self._full += 1
        if left_waiting >= self.cap:
            self._backlogged += 1

    def observe(self, latency_s: float, run_s: float) -> None:
        """One request of the most urgent level: its latency and the part its batch ran
        (the rest it waited); decides every ``num_samples``."""
        self._samples.append(latency_s)
        self._runs.append(run_s)
        self._waits.append(max(0.0, latency_s - run_s))
        if len(self._samples) >= self.config.num_samples:
            self.last_p99_s = p99(self._samples)
            queueing = _median(self._waits) > _median(self._runs)
            backlogged = self._releases > 0 and 2 * self._backlogged >= self._releases
            full = self._releases > 0 and 2 * self._full >= self._releases
            largest = self._largest if self._releases else None
            self._samples.clear()
            self._waits.clear()
            self._runs.clear()
            self._releases = 0
            self._backlogged = 0
            self._full = 0
            self._largest = 0
            self.cap, self.last_decision = decide_batch_cap(
                self.cap, self.last_p99_s, self.config, queueing, backlogged, full, largest
            )
            self.decisions[self.last_decision] += 1


def _median(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2]


class BatchPlanner:
    """One replica's batching state: the rule, the rate, the cap and why batches left.

    The cap is ``cap`` when given, else built from ``config.target_p99_ms`` (bounded by
    ``config.min_batch_size`` and ``config.max_batch_size``), else there is none.

    The worker and the simulator each hold one per replica and call it the same way:
    ``arrived`` for each queued input; when the engine is idle, ``plan_batch(view(...),
    config, now)``, then for a release ``released`` and ``take`` (which removes it from the
    queue); ``finished`` when the engine answered it.
    """

    __slots__ = ("_num_queued", "cap", "config", "last_reason", "rate", "releases")

    def __init__(
        self, config: BatchConfig, cap: CapConfig | None = None, rate_tau_s: float = 1.0
    ) -> None:
        self.config = config
        self.rate = ArrivalRate(rate_tau_s) if config.load_aware else None
        if cap is None and config.target_p99_ms is not None:
            cap = CapConfig(
                target_p99_s=config.target_p99_ms / 1e3,
                max_batch_size=config.max_batch_size,
                min_batch_size=config.min_batch_size,
            )
        if cap is not None and cap.max_batch_size > config.max_batch_size:
            raise ValueError(
                f"the cap's bound {cap.max_batch_size} is over max_batch_size "
                f"{config.max_batch_size}"
            )
        self.cap = AdaptiveCap(cap) if cap is not None else None
        self.releases: dict[str, int] = dict.fromkeys(RELEASE_REASONS, 0)
        self.last_reason: str | None = None
        self._num_queued = 0  # the last view's queue length: what a release left behind

    @property
    def peek_size(self) -> int:
        return self.config.peek_size()

    @property
    def max_batch_size(self) -> int:
        """The count bound now: the adaptive cap, or the configured maximum."""
        return self.cap.cap if self.cap is not None else self.config.max_batch_size

    def arrived(self, now: float, count: int = 1) -> None:
        if self.rate is not None:
            self.rate.observe(now, count)

    def view(self, head: Sequence[Request], num_queued: int, now: float) -> BatchView:
        """What ``plan_batch`` sees now: the head, with the rate and the cap."""
        self._num_queued = num_queued
        rate = self.rate.rate_per_s(now) if self.rate is not None else None
        cap = self.cap.cap if self.cap is not None else None
        return BatchView(head, num_queued, rate, cap)

    def released(self, release: Release) -> None:
        """Count why a batch left (for /stats and explain); tell the cap how many stayed
        queued behind it (the last ``view``'s queue less the batch)."""
        self.releases[release.reason] += 1
        self.last_reason = release.reason
        if self.cap is not None:
            size = len(release.batch)
            self.cap.released(size, max(0, self._num_queued - size))

    def take(self, queue: WaitQueue, release: Release, now: float) -> tuple[Request, ...]:
        """Remove exactly the released requests from ``queue`` (peeked at ``now``).

        A prefix is popped. A length-aware batch that skips some of the head is taken by
        id, through ``cancel``: the queue has no pop by id yet, so its outcome tally counts
        those as cancelled rather than dispatched (nothing reads a worker queue's tally).
        """
        if release.is_prefix:
            return queue.pop(len(release.batch), now, self.config.max_batch_tokens)
        for request in release.batch:
            queue.cancel(request.id)
        return release.batch

    def finished(self, batch: Sequence[Request], now: float, started_at: float) -> None:
        """The engine answered ``batch`` at ``now``, started at ``started_at``: the most
        urgent level's latencies, and how much of each was the batch running."""
        if self.cap is None:
            return
        for request in batch:
            if request.priority == 0:
                self.cap.observe(now - request.arrival_at, now - started_at)

    def describe(self, now: float, num_levels: int = 3) -> dict[str, Any]:
        """What /stats and explain show: the current cap, windows, rate and reasons."""
        config = self.config
        rate = self.rate.rate_per_s(now) if self.rate is not None else None
        levels = max(len(config.level_windows_ms), num_levels)
        described: dict[str, Any] = {
            "max_batch_size": self.max_batch_size,
            "configured_max_batch_size": config.max_batch_size,
            "window_ms_by_level": [config.window_ms(level) for level in range(levels)],
            "load_aware": config.load_aware,
            "arrival_rate_per_s": None if rate is None else round(rate, 3),
            "length_candidates": config.length_candidates if config.length_aware else 0,
            "length_rule": _length_rule(config),
            "last_release_reason": self.last_reason,
            "releases_by_reason": {k: v for k, v in self.releases.items() if v},
        }
        if self.cap is not None:
            described["adaptive_cap"] = {
                "target_p99_ms": round(self.cap.config.target_p99_s * 1e3, 3),
                "last_p99_ms": None
                if self.cap.last_p99_s is None
                else round(self.cap.last_p99_s * 1e3, 3),
                "last_decision": self.cap.last_decision,
                "decisions": {k: v for k, v in self.cap.decisions.items() if v},
                "bounds": [self.cap.config.min_batch_size, self.cap.config.max_batch_size],
            }
        return described


def _length_rule(config: BatchConfig) -> str | None:
    """When length-aware formation lets padding in (core.batching's note); None: off."""
    if not config.length_aware:
        return None
    if config.batch_overhead_tokens is not None:
        return f"cost: padding within (members - 1) x {config.batch_overhead_tokens:g} tokens"
    return f"ratio: padded tokens within {config.max_padding_ratio:g} x real"
