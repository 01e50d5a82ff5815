"""The discrete-event kernel: time order, ties in scheduling order, the fed stream."""

from __future__ import annotations

import pytest

from tidegate.sim.kernel import Kernel


def test_events_run_in_time_order_and_ties_in_scheduling_order() -> None:
    kernel = Kernel()
    seen: list[tuple[float, str]] = []
    for at, name in ((2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b")):
        kernel.at(at, lambda n, at=at: seen.append((at, n)), name)
    kernel.run()
    assert seen == [(1.0, "a"), (1.0, "b"), (2.0, "c"), (2.0, "d")]
    assert kernel.now() == 2.0
    assert kernel.num_events == 4


def test_an_event_in_the_past_is_refused() -> None:
    kernel = Kernel()
    kernel.at(1.0, lambda _: kernel.at(0.5, print))
    with pytest.raises(ValueError, match="in the past"):
        kernel.run()


def test_fed_items_merge_with_events_and_events_win_ties() -> None:
    kernel = Kernel()
    seen: list[str] = []
    kernel.at(1.0, seen.append, "event@1")
    kernel.at(3.0, seen.append, "event@3")
    kernel.feed(iter([(0.5, "fed@0.5"), (1.0, "fed@1"), (2.0, "fed@2")]), seen.append)
    kernel.run()
    assert seen == ["fed@0.5", "event@1", "fed@1", "fed@2", "event@3"]


def test_run_until_stops_and_resumes_without_losing_a_fed_item() -> None:
    kernel = Kernel()
    seen: list[str] = []
    kernel.feed(iter([(1.0, "a"), (2.0, "b"), (3.0, "c")]), seen.append)
    kernel.run(until=2.5)
    assert seen == ["a", "b"]
    kernel.run()
    assert seen == ["a", "b", "c"]


def test_a_fed_stream_that_goes_back_in_time_is_refused() -> None:
    kernel = Kernel()
    kernel.feed(iter([(2.0, "a"), (1.0, "b")]), lambda _: None)
    with pytest.raises(ValueError, match="in the past"):
        kernel.run()
