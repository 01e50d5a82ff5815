"""Tiny scenarios whose every wait is worked out by hand in the comments."""

from __future__ import annotations

from typing import Any

import pytest

from tidegate.sim.recorder import RequestRecord
from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.workload import Arrival, Listed

from .conftest import config_of, flat_batch_service, flat_step_service, run_records

# One embeddings replica that holds one request at a time (slots 1, max batch 1) and takes
# 100 ms per batch: the gateway's queue decides every order.
ONE_AT_A_TIME: dict[str, Any] = {
    "models": [
        {
            "name": "emb",
            "task": "embeddings",
            "engine": "simulated",
            "replicas": 1,
            "slots": 1,
            "batching": {"max_batch_size": 1, "batch_window_ms": 0},
        }
    ]
}
ARRIVALS = [
    Arrival(0.00, 10, 0, "low"),  # r0
    Arrival(0.01, 10, 0, "low"),  # r1
    Arrival(0.02, 10, 0, "high"),  # r2
    Arrival(0.03, 10, 0, "medium"),  # r3
    Arrival(0.25, 10, 0, "high"),  # r4
]


def run(data: dict[str, Any], policy: str) -> dict[str, RequestRecord]:
    return run_records(data, flat_batch_service(100.0), ARRIVALS, policy)


def waits(records: dict[str, RequestRecord]) -> dict[str, float | None]:
    return {rid: None if r.wait_s is None else round(r.wait_s, 9) for rid, r in records.items()}


def test_priority_serves_the_most_urgent_waiting_request_first() -> None:
    # r0 starts at once (0.00-0.10). Queued meanwhile: r1 low, r2 high, r3 medium.
    # 0.10: r2 (high) goes: waited 0.10 - 0.02 = 0.08; runs to 0.20.
    # 0.20: r3 (medium): 0.20 - 0.03 = 0.17; runs to 0.30. r4 (high) arrived at 0.25.
    # 0.30: r4 (high): 0.30 - 0.25 = 0.05; runs to 0.40.
    # 0.40: r1 (low) at last: 0.40 - 0.01 = 0.39.
    records = run(ONE_AT_A_TIME, "priority")
    assert waits(records) == {"0": 0.0, "2": 0.08, "3": 0.17, "4": 0.05, "1": 0.39}
    # End to end = wait + 100 ms in the engine.
    assert records["1"].e2e_s == pytest.approx(0.49)
    assert records["4"].e2e_s == pytest.approx(0.15)


def test_fifo_serves_in_arrival_order() -> None:
    # Under fifo every level is 0: r0 0.00; r1 0.10 - 0.01; r2 0.20 - 0.02; r3 0.30 - 0.03;
    # r4 0.40 - 0.25.
    records = run(ONE_AT_A_TIME, "fifo")
    assert waits(records) == {"0": 0.0, "1": 0.09, "2": 0.18, "3": 0.27, "4": 0.15}


def test_aging_lets_the_old_low_request_overtake_a_new_high_one() -> None:
    # Aging 0.1 s threshold, 20 levels/s: effective = max(0, level - 20 * (wait - 0.1)).
    # 0.10: r1 low waited 0.09 (< 0.1) -> 2; r2 high -> 0; r3 medium -> 1: r2 goes (0.08).
    # 0.20: r1 waited 0.19 -> 2 - 20 * 0.09 = 0.2; r3 waited 0.17 -> max(0, 1 - 1.4) = 0:
    #       r3 goes (0.17).
    # 0.30: r1 waited 0.29 -> max(0, 2 - 3.8) = 0; r4 high -> 0: a tie goes to the earlier
    #       arrival, r1 (0.29); then r4 at 0.40 (0.15).
    aged = {**ONE_AT_A_TIME, "priorities": {"aging": {"threshold_s": 0.1, "rate_per_s": 20}}}
    records = run(aged, "priority")
    assert waits(records) == {"0": 0.0, "2": 0.08, "3": 0.17, "1": 0.29, "4": 0.15}


def test_a_queue_timeout_expires_the_waiting_request() -> None:
    # low times out after 0.2 s in the queue: r1 (arrived 0.01) is still queued at 0.21,
    # behind r2 and r3, so it expires then, having waited 0.2 s.
    timed = {
        "models": [
            {**ONE_AT_A_TIME["models"][0], "queue": {"timeout_s": {"low": 0.2}}},
        ]
    }
    records = run(timed, "priority")
    assert records["1"].outcome == "expired"
    assert records["1"].wait_s == pytest.approx(0.2)
    assert waits(records)["4"] == 0.05  # 0.30 - 0.25 as before: r1 no longer competes


def test_continuous_batching_joins_sequences_between_steps() -> None:
    # One generation replica, 2 sequences at once (slots 2), every engine step 10 ms.
    # a (3 tokens) and b (1 token) arrive at 0; c (2 tokens) at 0.005.
    # 0.00: a starts its prefill step; b is granted a slot but joins at the next step.
    # 0.01: a's first token; b's prefill step (a decodes) -> 0.02: b's token, b is done.
    # c waited in the gateway queue (both slots taken) until 0.02: wait 0.015. The step
    # 0.02-0.03 had already started when c reached the worker: it joins at 0.03.
    # 0.03: a's third token, a done (e2e 0.03). c prefills 0.03-0.04 (first token: TTFT
    # 0.04 - 0.005 = 0.035), decodes 0.04-0.05: done, e2e 0.045.
    data = {
        "models": [
            {
                "name": "gen",
                "task": "generate",
                "engine": "simulated",
                "replicas": 1,
                "batching": {"max_num_seqs": 2},
            }
        ]
    }
    arrivals = [
        Arrival(0.0, 5, 3, "high"),
        Arrival(0.0, 5, 1, "high"),
        Arrival(0.005, 5, 2, "high"),
    ]
    scenario = Scenario(
        config_of(data),
        "gen",
        flat_step_service(10.0),
        Listed("hand", arrivals),
        {"shared": 1},
        keep_requests=True,
    )
    result = Simulation(scenario).run()
    assert result.recorder.requests is not None
    got = {
        r.id: tuple(round(x or 0.0, 9) for x in (r.wait_s, r.ttft_s, r.e2e_s))
        for r in result.recorder.requests
    }
    assert got == {
        "0": (0.0, 0.01, 0.03),
        "1": (0.0, 0.02, 0.02),
        "2": (0.015, 0.035, 0.045),
    }
    # Steps: 0-0.01 one running (a), 0.01-0.02 two (a, b), 0.02-0.03 one (a), 0.03-0.04
    # and 0.04-0.05 one (c).
    assert dict(result.recorder.batch_sizes) == {1: 4, 2: 1}
