"""On a saturated trace, priority serves high before fifo does, and low pays for it."""

from __future__ import annotations

from tidegate.sim import SimulateOptions, simulate

from .conftest import FIXTURES


def test_priority_beats_fifo_for_high_on_a_saturated_azure_slice() -> None:
    # The first 300 Azure conversation requests at 1.5x their rate (8.3 requests/s) on four
    # llama2-70b replicas (A100, TP8, 16 sequences at once, about 1.2 requests/s each): the
    # queue grows to about 90 and waits reach 25 s, inside the default aging threshold (30
    # s; past it every level ages to the top and priority becomes fifo).
    _, report = simulate(
        SimulateOptions(
            trace=str(FIXTURES / "azure_conv_head.csv"),
            profile=str(FIXTURES / "perf_model_slice.csv"),
            replicas=4,
            rate_scale=1.5,
            compare=("fifo", "priority"),
            priority_mix="high=0.2,medium=0.3,low=0.5",
        )
    )
    fifo, priority = (run["classes"] for run in report["runs"])
    assert report["runs"][0]["overall"]["max_queued"] > 50  # saturated
    assert fifo["high"]["ttft_s"]["p95"] > 10  # behind everyone under fifo
    assert priority["high"]["ttft_s"]["p95"] < fifo["high"]["ttft_s"]["p95"] / 5
    assert priority["high"]["e2e_s"]["p95"] < fifo["high"]["e2e_s"]["p95"]
    assert priority["high"]["slo_attainment"] > fifo["high"]["slo_attainment"]
    assert priority["low"]["queue_wait_s"]["p95"] > fifo["low"]["queue_wait_s"]["p95"]
    # The same work is done: the order differs, not the amount.
    assert sum(c["completed"] for c in fifo.values()) == sum(
        c["completed"] for c in priority.values()
    )
