"""decide_quota: a key's rate limits as token buckets (requests per second, tokens per minute).

Design note. A bucket holds at most ``burst`` units and refills at ``rate_per_s`` units a
second; a request takes its amount from every bucket of its key (one request, its estimated
tokens) when each holds that much, and takes nothing otherwise, so a refused request costs
its key nothing and retrying early does not push its turn further back. The state of a
bucket is its level at its last take and the time of that take (``Bucket``); the level at a
later time is computed when asked, never stored per tick. A bucket never taken from is full.

Admission compares ``now`` with ``ready_at``, the moment the bucket holds the amount, and a
refusal hands the caller that same float (the latest over the key's buckets) as its
``retry_at``: retried then with nothing else taken meanwhile, it is admitted, exactly, with
no rounding in between. An amount larger than the burst never fits (``retry_at`` is
infinite): the caller must say so rather than ask the client to retry.

Invariants:
- over any window [t0, t1], a bucket gives at most ``burst + rate_per_s * (t1 - t0)`` units;
- a refusal changes no state;
- a request refused at ``now`` is admitted at its ``retry_at`` if nothing was taken since;
- the level stays within [0, burst].

Callers pass a ``now`` that never decreases for one key (a monotonic clock).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Limit(enum.Enum):
    REQUESTS = "requests"  # requests per second, one unit a request
    TOKENS = "tokens"  # estimated tokens (prompt + most output) per minute


@dataclass(frozen=True, slots=True)
class BucketSpec:
    rate_per_s: float  # units refilled per second
    burst: float  # capacity in units: what may be taken at once after a rest

    def __post_init__(self) -> None:
        if not (self.rate_per_s > 0 and math.isfinite(self.rate_per_s)):
            raise ValueError(f"rate_per_s must be a positive number, got {self.rate_per_s}")
        if not (self.burst > 0 and math.isfinite(self.burst)):
            raise ValueError(f"burst must be a positive number, got {self.burst}")


@dataclass(frozen=True, slots=True)
class Bucket:
    level: float  # units held just after the last take
    at: float  # monotonic s of the last take

    def available(self, spec: BucketSpec, now: float) -> float:
        """Units held at ``now`` (refilled since ``at``, never above the burst)."""
        return min(spec.burst, self.level + max(0.0, now - self.at) * spec.rate_per_s)

    def ready_at(self, spec: BucketSpec, amount: float) -> float:
        """When the bucket holds ``amount`` if nothing is taken first; inf: never (> burst)."""
        if amount > spec.burst:
            return math.inf
        missing = amount - self.level
        return self.at if missing <= 0 else self.at + missing / spec.rate_per_s

    def take(self, spec: BucketSpec, amount: float, now: float) -> Bucket:
        """The bucket after taking ``amount`` at ``now`` (the caller checked ``ready_at``)."""
        # max(0, ...): at now == ready_at the float sum may fall an ulp short of the amount.
        return Bucket(max(0.0, self.available(spec, now) - amount), now)


def full(spec: BucketSpec, now: float) -> Bucket:
    return Bucket(spec.burst, now)


@dataclass(frozen=True, slots=True)
class QuotaSpec:
    """A key's limits; None: that one is unlimited."""

    requests: BucketSpec | None = None  # one unit a request
    tokens: BucketSpec | None = None  # units: estimated tokens; rate = tokens per minute / 60


@dataclass(frozen=True, slots=True)
class QuotaState:
    """A key's buckets; None: never taken from (full)."""

    requests: Bucket | None = None
    tokens: Bucket | None = None


@dataclass(frozen=True, slots=True)
class Taken:
    state: QuotaState  # the key's buckets with this request's amounts taken


@dataclass(frozen=True, slots=True)
class Refused:
    limit: Limit  # the bucket that refills last (requests on a tie)
    retry_at: float  # when every bucket holds enough, if nothing is taken first; inf: never
    amount: float  # what the request asked of that bucket

    def wait_s(self, now: float) -> float:
        return self.retry_at - now

    @property
    def never(self) -> bool:
        """The amount is over the bucket's burst: no wait admits it."""
        return math.isinf(self.retry_at)


QuotaDecision = Taken | Refused


def decide_quota(
    spec: QuotaSpec, state: QuotaState, num_tokens: float, now: float
) -> QuotaDecision:
    """Take one request and ``num_tokens`` from a key's buckets at ``now``, or refuse both."""
    asks = (
        (Limit.REQUESTS, spec.requests, state.requests, 1.0),
        (Limit.TOKENS, spec.tokens, state.tokens, num_tokens),
    )
    latest: Refused | None = None
    for limit, bucket_spec, bucket, amount in asks:
        if bucket_spec is None:
            continue
        ready_at = (bucket or full(bucket_spec, now)).ready_at(bucket_spec, amount)
        if now < ready_at and (latest is None or ready_at > latest.retry_at):
            latest = Refused(limit, ready_at, amount)
    if latest is not None:
        return latest
    return Taken(
        QuotaState(
            requests=_take(spec.requests, state.requests, 1.0, now),
            tokens=_take(spec.tokens, state.tokens, num_tokens, now),
        )
    )


def _take(
    spec: BucketSpec | None, bucket: Bucket | None, amount: float, now: float
) -> Bucket | None:
    if spec is None:
        return None
    return (bucket or full(spec, now)).take(spec, amount, now)
