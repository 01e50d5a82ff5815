"""Per-key quotas on the proxy path: the shell around ``core.quota``.

The gateway holds the buckets of every key with a ``rate_limit``, by key name (the config
holds only the limits). A request's quota is decided after authentication and validation
and before it takes a place in the queue, so a key over its quota never displaces anybody:
``check`` refuses it (429 with Retry-After, or 413 when no wait would ever admit it, counted
by key and limit) or returns what taking it would leave; ``charge`` keeps that once the queue
has admitted the request. Nothing awaits between the two, so no other request of the key
can slip in between, and a request the queue refuses (429 full, 503) spends nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from tidegate.clock import SYSTEM_CLOCK, Clock
from tidegate.config import KeySpec, RateLimitSpec
from tidegate.core.quota import Limit, QuotaSpec, QuotaState, Refused, Taken, decide_quota
from tidegate.errors import Overloaded, PromptTooLong, TidegateError
from tidegate.metrics import GatewayMetrics

ESTIMATE = "estimated: prompt at 4 characters a token, plus max_tokens x n"


class KeyQuotas:
    def __init__(
        self, keys: Iterable[KeySpec], metrics: GatewayMetrics, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.clock = clock
        self.metrics = metrics
        self._limits: dict[str, tuple[RateLimitSpec, QuotaSpec]] = {}
        self._states: dict[str, QuotaState] = {}
        for key in keys:
            if key.rate_limit is None:
                continue
            spec = key.rate_limit.quota()
            self._limits[key.name] = (key.rate_limit, spec)
            for limit, bucket in ((Limit.REQUESTS, spec.requests), (Limit.TOKENS, spec.tokens)):
                if bucket is not None:  # a series at 0 from the start, for rate() and alerts
                    metrics.quota_rejections.labels(key.name, limit.value)

    def check(self, key: KeySpec | None, num_tokens: int) -> Taken | None:
        """What the key's buckets would be with this request taken; None: no quota.

        Raises Overloaded (429, Retry-After) when the key is over a limit now, PromptTooLong
        (413) when the request counts more tokens than the key's burst; either is counted.
        """
        if key is None or key.name not in self._limits:
            return None
        limits, spec = self._limits[key.name]
        now = self.clock.now()
        state = self._states.get(key.name, QuotaState())
        decision = decide_quota(spec, state, num_tokens, now)
        if isinstance(decision, Taken):
            return decision
        self.metrics.quota_rejections.labels(key.name, decision.limit.value).inc()
        raise _refusal(key.name, limits, decision, now)

    def charge(self, key: KeySpec | None, taken: Taken | None) -> None:
        """Keep what ``check`` decided: the request was admitted."""
        if key is not None and taken is not None:
            self._states[key.name] = taken.state


def _refusal(name: str, limits: RateLimitSpec, refused: Refused, now: float) -> TidegateError:
    if refused.never:
        return PromptTooLong(
            f"key {name}: this request counts {refused.amount:.0f} tokens ({ESTIMATE}), more "
            f"than the {limits.burst_tokens} its rate limit allows at once, so no wait would "
            "admit it; lower max_tokens or shorten the prompt",
            code="token_burst_exceeded",
        )
    wait_s = refused.wait_s(now)
    if refused.limit is Limit.REQUESTS:
        over = f"{limits.requests_per_s:g} requests/s (bursts of {limits.burst_requests})"
        code = "request_rate_exceeded"
    else:
        over = (
            f"{limits.tokens_per_min} tokens/min (bursts of {limits.burst_tokens}); this "
            f"request counts {refused.amount:.0f} tokens ({ESTIMATE})"
        )
        code = "token_rate_exceeded"
    return Overloaded(
        f"key {name}: over its rate limit of {over}; retry in {wait_s:.3f} s",
        code=code,
        # Whole seconds, rounded up: retried after Retry-After, the request fits.
        retry_after_s=math.ceil(wait_s),
    )
