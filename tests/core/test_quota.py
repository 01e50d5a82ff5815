"""decide_quota: token buckets per key, one scenario per row, and their invariants (Hypothesis)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.core.quota import (
    Bucket,
    BucketSpec,
    Limit,
    QuotaSpec,
    QuotaState,
    Refused,
    Taken,
    decide_quota,
)

TAKEN = "taken"
NEVER = math.inf
R, T = Limit.REQUESTS, Limit.TOKENS


@dataclass(frozen=True)
class Steps:
    name: str
    spec: QuotaSpec
    asks: list[tuple[float, float]]  # (now, tokens), in time order
    expected: list[str | tuple[Limit, float]]  # TAKEN, or (limit, retry_at) of a refusal


def per_s(rate_per_s: float, burst: float) -> BucketSpec:
    return BucketSpec(rate_per_s, burst)


SCENARIOS = [
    Steps(
        "burst_passes_at_once_then_the_next_waits_one_refill",
        QuotaSpec(requests=per_s(2, 3)),
        [(0, 1), (0, 1), (0, 1), (0, 1)],
        [TAKEN, TAKEN, TAKEN, (R, 0.5)],
    ),
    Steps(
        "a_refill_admits_one_more_then_the_next_waits_again",
        QuotaSpec(requests=per_s(2, 3)),
        [(0, 1), (0, 1), (0, 1), (0.5, 1), (0.5, 1)],
        [TAKEN, TAKEN, TAKEN, TAKEN, (R, 1.0)],
    ),
    Steps(
        "a_refused_request_takes_nothing_so_retrying_early_does_not_push_the_turn_back",
        QuotaSpec(requests=per_s(1, 1)),
        [(0, 1), (0.5, 1), (0.9, 1), (1.0, 1)],
        [TAKEN, (R, 1.0), (R, 1.0), TAKEN],
    ),
    Steps(
        "a_rest_refills_no_more_than_the_burst",
        QuotaSpec(requests=per_s(1, 2)),
        [(0, 1), (0, 1), (100, 1), (100, 1), (100, 1)],
        [TAKEN, TAKEN, TAKEN, TAKEN, (R, 101.0)],
    ),
    Steps(
        "tokens_wait_for_the_missing_amount_only",
        QuotaSpec(tokens=per_s(10, 100)),  # 600 tokens/min
        [(0, 80), (0, 30), (0, 20), (0.5, 5)],
        [TAKEN, (T, 1.0), TAKEN, TAKEN],
    ),
    Steps(
        "a_request_over_the_token_burst_never_fits_even_on_a_full_bucket",
        QuotaSpec(requests=per_s(1, 1), tokens=per_s(10, 100)),
        [(0, 101), (0, 100)],
        [(T, NEVER), TAKEN],
    ),
    Steps(
        "a_token_refusal_takes_no_request_either",
        QuotaSpec(requests=per_s(1, 1), tokens=per_s(1, 10)),
        [(0, 11), (0, 5), (0, 1)],
        [(T, NEVER), TAKEN, (R, 1.0)],
    ),
    Steps(
        "both_short_the_one_that_refills_last_is_named",
        QuotaSpec(requests=per_s(1, 1), tokens=per_s(1, 10)),
        [(0, 10), (0, 5), (0, 1)],
        [TAKEN, (T, 5.0), (R, 1.0)],  # 1 token: both ready at 1.0, requests named on a tie
    ),
    Steps(
        "no_limits_take_everything",
        QuotaSpec(),
        [(0, 10**9), (0, 10**9)],
        [TAKEN, TAKEN],
    ),
    Steps(
        "a_fraction_of_a_request_per_second",
        QuotaSpec(requests=per_s(0.25, 1)),
        [(0, 1), (3, 1), (4, 1)],
        [TAKEN, (R, 4.0), TAKEN],
    ),
]


@pytest.mark.parametrize("case", SCENARIOS, ids=lambda case: case.name)
def test_quota_scenarios(case: Steps) -> None:
    state = QuotaState()
    got: list[str | tuple[Limit, float]] = []
    for now, tokens in case.asks:
        decision = decide_quota(case.spec, state, tokens, now)
        if isinstance(decision, Taken):
            state = decision.state
            got.append(TAKEN)
        else:
            got.append((decision.limit, decision.retry_at))
    assert got == case.expected


def test_refusal_says_how_long_and_how_much() -> None:
    spec = QuotaSpec(tokens=per_s(10, 100))
    taken = decide_quota(spec, QuotaState(), 100, 5.0)
    assert isinstance(taken, Taken)
    refused = decide_quota(spec, taken.state, 40, 6.0)
    assert refused == Refused(T, 9.0, 40)
    assert refused.wait_s(6.0) == 3.0
    assert not refused.never
    assert decide_quota(spec, taken.state, 101, 6.0) == Refused(T, math.inf, 101)


@pytest.mark.parametrize(
    ("rate_per_s", "burst"), [(0, 1), (-1, 1), (1, 0), (math.inf, 1), (1, math.nan)]
)
def test_bucket_spec_refuses_nonsense(rate_per_s: float, burst: float) -> None:
    with pytest.raises(ValueError, match="must be a positive number"):
        BucketSpec(rate_per_s, burst)


# ----------------------------------------------------------------------------- properties

specs = st.builds(
    BucketSpec,
    rate_per_s=st.floats(0.01, 1000),
    burst=st.floats(1, 10_000),
)
# (seconds since the previous ask, or None: at the last refusal's retry_at, as a client that
# obeys Retry-After exactly; tokens as a share of the token burst, above 1: never fits)
asks = st.lists(
    st.tuples(st.one_of(st.none(), st.floats(0, 5)), st.floats(0, 1.2)), min_size=1, max_size=40
)


def _run(
    requests: BucketSpec,
    tokens: BucketSpec,
    start: float,
    steps: list[tuple[float | None, float]],
) -> list[tuple[float, float, QuotaState, Taken | Refused]]:
    """Every ask in order: (now, tokens, state before it, decision)."""
    spec = QuotaSpec(requests=requests, tokens=tokens)
    state, now, out = QuotaState(), start, []
    retry_at: float | None = None
    for dt, share in steps:
        if dt is not None:
            now += dt
        elif retry_at is not None and not math.isinf(retry_at):
            now = max(now, retry_at)
        amount = round(share * tokens.burst)
        decision = decide_quota(spec, state, amount, now)
        out.append((now, amount, state, decision))
        if isinstance(decision, Taken):
            state = decision.state
        else:
            retry_at = decision.retry_at
    return out


@settings(max_examples=300, deadline=None)
@given(specs, specs, st.floats(0, 1e6), asks)
def test_no_window_gives_more_than_burst_plus_rate_times_its_length(
    requests: BucketSpec, tokens: BucketSpec, start: float, steps: list[tuple[float | None, float]]
) -> None:
    taken = [
        (now, amount)
        for now, amount, _, d in _run(requests, tokens, start, steps)
        if isinstance(d, Taken)
    ]
    for i in range(len(taken)):
        num_requests, num_tokens = 0.0, 0.0
        for j in range(i, len(taken)):
            num_requests += 1
            num_tokens += taken[j][1]
            window_s = taken[j][0] - taken[i][0]
            for spec, got in ((requests, num_requests), (tokens, num_tokens)):
                bound = spec.burst + spec.rate_per_s * window_s
                # Slack: float sums, and the refill over the clock's resolution (its ulp).
                slack = bound * 1e-9 + spec.rate_per_s * 4 * math.ulp(taken[j][0])
                assert got <= bound + slack, (spec, i, j, got, bound)


@settings(max_examples=300, deadline=None)
@given(specs, specs, st.floats(0, 1e6), asks)
def test_a_refused_request_waiting_its_retry_at_is_admitted_and_not_an_instant_before(
    requests: BucketSpec, tokens: BucketSpec, start: float, steps: list[tuple[float | None, float]]
) -> None:
    spec = QuotaSpec(requests=requests, tokens=tokens)
    for now, amount, state, decision in _run(requests, tokens, start, steps):
        if not isinstance(decision, Refused):
            continue
        assert decision.retry_at > now
        if decision.never:
            assert amount > tokens.burst
            assert decision.limit is Limit.TOKENS
            continue
        assert isinstance(decide_quota(spec, state, amount, decision.retry_at), Taken)
        before = math.nextafter(decision.retry_at, -math.inf)
        assert isinstance(decide_quota(spec, state, amount, before), Refused)


@settings(max_examples=300, deadline=None)
@given(specs, specs, st.floats(0, 1e6), asks)
def test_levels_stay_within_zero_and_the_burst(
    requests: BucketSpec, tokens: BucketSpec, start: float, steps: list[tuple[float | None, float]]
) -> None:
    for _, _, state, _ in _run(requests, tokens, start, steps):
        for spec, bucket in ((requests, state.requests), (tokens, state.tokens)):
            if bucket is not None:
                assert 0 <= bucket.level <= spec.burst
                assert isinstance(bucket, Bucket)
