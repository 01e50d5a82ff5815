"""What a simulation run observed, in memory bounded whatever the length of the workload.

Latencies go into log-bucketed histograms (1% wide buckets: a percentile is reported at its
bucket's geometric middle, within 0.5% of the exact value), outcomes into counters, batch
sizes into a count per size, and the queue depth into a time series sampled at a fixed
interval that doubles (dropping every other sample) whenever the series grows past
``MAX_SAMPLES``, so a 14-day replay keeps as few points as a 10-minute one.

``keep_requests=True`` also keeps one exact record per request, for tests and small runs.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Final

OUTCOMES = (
    "completed",
    "shed",
    "rejected_full",
    "rejected_deadline",
    "rejected_holdback",
    "unavailable",  # 503: no ready replica when it arrived
    "expired",
    "failed",
    "unservable",  # still queued at the end: no pool of the model takes its level, even aged
    "stranded",  # still queued at the end: nothing left could serve it (see sim.run)
)
# Final: a compiled build reads these as constants, not from the module's dict per use
_STEP: Final = 1.01
_LOG_STEP: Final = math.log(_STEP)
_ZERO_BELOW_S: Final = 1e-9
MAX_SAMPLES: Final = 2000
FIRST_SAMPLE_INTERVAL_S: Final = 1.0


class Histogram:
    """Counts of positive values in buckets ``[1.01^b, 1.01^(b+1))`` plus a count of zeros."""

    __slots__ = ("_counts", "_low", "maximum", "total", "zeros")

    def __init__(self) -> None:
        # Counts of the buckets _low, _low + 1, ... in a list, grown to what was seen: a
        # compiled add is then a list index, not two dict lookups of a boxed int key.
        self._counts: list[int] = []
        self._low = 0
        self.zeros = 0
        self.total = 0
        self.maximum = 0.0

    @property
    def buckets(self) -> dict[int, int]:
        """Count per bucket, of the buckets that counted something (in bucket order)."""
        low = self._low
        return {low + index: count for index, count in enumerate(self._counts) if count}

    def add(self, value: float) -> None:
        self.total += 1
        if value > self.maximum:
            self.maximum = value
        if value < _ZERO_BELOW_S:
            self.zeros += 1
            return
        bucket = math.floor(math.log(value) / _LOG_STEP)
        index = bucket - self._low
        counts = self._counts
        if 0 <= index < len(counts):
            counts[index] = counts[index] + 1  # (+=: a generic add, compiled)
        else:
            self._add_outside(bucket)

    def _add_outside(self, bucket: int) -> None:
        """One more in ``bucket``, below or above the buckets held so far: grow the list."""
        counts = self._counts
        if not counts:
            self._low = bucket
            counts.append(1)
            return
        if bucket < self._low:
            counts = [0] * (self._low - bucket) + counts
            self._counts = counts
            self._low = bucket
        else:
            counts.extend([0] * (bucket - self._low - len(counts) + 1))
        counts[bucket - self._low] += 1

    def percentile(self, q: float) -> float | None:
        """The value at rank ``ceil(q/100 * n)`` (nearest rank); None when empty."""
        if self.total == 0:
            return None
        rank = max(1, math.ceil(q / 100.0 * self.total))
        seen = self.zeros
        if seen >= rank:
            return 0.0
        buckets = self.buckets
        for bucket in sorted(buckets):
            seen += buckets[bucket]
            if seen >= rank:
                return min(self.maximum, math.exp((bucket + 0.5) * _LOG_STEP))
        return self.maximum

    def cdf(self) -> list[tuple[float, float]]:
        """(value, fraction at or below it) at each bucket's upper edge."""
        points = [(0.0, self.zeros / self.total)] if self.total and self.zeros else []
        seen = self.zeros
        buckets = self.buckets
        for bucket in sorted(buckets):
            seen += buckets[bucket]
            points.append((math.exp((bucket + 1) * _LOG_STEP), seen / self.total))
        return points


@dataclass(slots=True)
class ClassStats:
    """One priority class (the name the workload gave, whatever the queue level)."""

    name: str
    slo_ttft_s: float
    # Outcomes but the completions' count, which num_completed keeps (an int: a Counter's
    # item update is a slow generic call, compiled); ``outcomes`` puts them together.
    counted: Counter[str] = field(default_factory=Counter)
    wait: Histogram = field(default_factory=Histogram)  # time in the gateway queue
    ttft: Histogram = field(default_factory=Histogram)  # to the first token (embeddings: e2e)
    e2e: Histogram = field(default_factory=Histogram)
    slo_met: int = 0  # completed with ttft <= slo_ttft_s
    max_wait_s: float = 0.0  # longest gateway-queue wait of any request of this class
    output_tokens: int = 0
    num_completed: int = 0

    @property
    def outcomes(self) -> Counter[str]:
        """Requests per outcome (a new Counter: write to ``counted``)."""
        outcomes = Counter(self.counted)
        if self.num_completed:  # its key is in ``counted`` since the first, in its place
            outcomes["completed"] = self.num_completed
        return outcomes


@dataclass(frozen=True, slots=True)
class RequestRecord:
    id: str
    klass: str
    outcome: str
    wait_s: float | None
    ttft_s: float | None
    e2e_s: float | None


class Recorder:
    def __init__(self, slo_ttft_s: dict[str, float], keep_requests: bool = False) -> None:
        self.classes = [ClassStats(name, slo) for name, slo in slo_ttft_s.items()]
        self.batch_sizes: Counter[int] = Counter()  # size -> batches (generation: steps)
        self.requests: list[RequestRecord] | None = [] if keep_requests else None
        self.samples: list[tuple[float, int, int, int]] = []  # (at, queued, in flight, ready)
        self.sample_interval_s = FIRST_SAMPLE_INTERVAL_S
        self.first_arrival_at: float | None = None
        self.last_done_at = 0.0
        # generation: seconds each replica's engine ran steps (its busy time)
        self.busy_s: defaultdict[str, float] = defaultdict(float)
        # generation: seconds of steps that prefilled joining sequences (the scarce part)
        self.prefill_s: defaultdict[str, float] = defaultdict(float)
        # a simulated prefix cache: prompt blocks prefilled, and of them the cached ones
        self.cache_blocks = 0
        self.cache_hit_blocks = 0
        # fair sharing's preemption (generation), per replica: sequences paused for another
        # tenant's, and the tokens resumed ones prefilled again (prompt + tokens made)
        self.preempted: defaultdict[str, int] = defaultdict(int)
        self.recomputed_tokens: defaultdict[str, int] = defaultdict(int)

    def class_index(self, name: str) -> int:
        for index, stats in enumerate(self.classes):
            if stats.name == name:
                return index
        raise KeyError(name)

    # ----------------------------------------------------------------- outcomes
    def ended(
        self, klass: int, outcome: str, request_id: str, at: float, wait_s: float | None
    ) -> None:
        """A request that did not complete: shed, rejected, expired, unavailable, failed."""
        stats = self.classes[klass]
        stats.counted[outcome] += 1
        if wait_s is not None and wait_s > stats.max_wait_s:
            stats.max_wait_s = wait_s
        if at > self.last_done_at:
            self.last_done_at = at
        if self.requests is not None:
            self.requests.append(RequestRecord(request_id, stats.name, outcome, wait_s, None, None))

    def unserved(self, klass: int, outcome: str, request_id: str, wait_s: float) -> None:
        """A request still queued when the run ended (``unservable`` or ``stranded``).

        Unlike ``ended``, the end of the run does not move ``last_done_at``: the span of the
        run (throughput, goodput) stays that of the work that was done.
        """
        stats = self.classes[klass]
        stats.counted[outcome] += 1
        if self.requests is not None:
            self.requests.append(RequestRecord(request_id, stats.name, outcome, wait_s, None, None))

    def completed(
        self,
        klass: int,
        request_id: str,
        arrival_at: float,
        dispatched_at: float,
        first_at: float,
        done_at: float,
        output_tokens: int,
    ) -> None:
        stats = self.classes[klass]
        if not stats.num_completed:
            stats.counted["completed"] = 0  # its place among the outcomes, as the first came
        stats.num_completed += 1
        wait = dispatched_at - arrival_at
        ttft = first_at - arrival_at
        e2e = done_at - arrival_at
        stats.wait.add(wait)
        stats.ttft.add(ttft)
        stats.e2e.add(e2e)
        stats.output_tokens += output_tokens
        if wait > stats.max_wait_s:
            stats.max_wait_s = wait
        if ttft <= stats.slo_ttft_s:
            stats.slo_met += 1
        if done_at > self.last_done_at:
            self.last_done_at = done_at
        if self.requests is not None:
            record = RequestRecord(request_id, stats.name, "completed", wait, ttft, e2e)
            self.requests.append(record)

    # ----------------------------------------------------------------- series
    def sample(self, at: float, queued: int, in_flight: int, ready: int) -> None:
        self.samples.append((at, queued, in_flight, ready))
        if len(self.samples) >= MAX_SAMPLES:
            self.samples = self.samples[::2]
            self.sample_interval_s *= 2
