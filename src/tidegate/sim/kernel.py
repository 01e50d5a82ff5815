"""The discrete-event kernel: a heap of ``(time, seq, callback, argument)`` and a clock.

Design note. As in SimPy, the whole kernel is one heap: ``at`` pushes an event, ``run`` pops
the earliest and calls it with the clock set to its time. ``seq`` is a counter, so events at
the same time run in the order they were scheduled and the heap never compares callbacks:
a run is a pure function of its inputs. Cancelling is the caller's business (a handler
checks whether its event is still current, e.g. a version number): a lazy heap is cheaper
than removal.

Arrivals, the bulk of the events, do not go through the heap: ``feed`` attaches a stream
already sorted by time, and ``run`` takes from it whenever its next item is earlier than
the heap's first event (at equal times the heap goes first). The stream is read lazily, one
item ahead, so a workload of any length costs no memory.

Invariants:
- ``now`` never goes backwards: scheduling in the past raises;
- no wall clock, no threads, no asyncio: a simulated hour costs what its events cost.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Any

Callback = Callable[[Any], None]


class Kernel:
    """The virtual clock and the event heap. ``now()`` makes it a ``tidegate.clock.Clock``."""

    __slots__ = ("_feed", "_feed_callback", "_heap", "_seq", "num_events", "time")

    def __init__(self, start_at: float = 0.0) -> None:
        self.time = start_at  # virtual seconds; read it directly on hot paths
        self._heap: list[tuple[float, int, Callback, Any]] = []
        self._seq = 0
        self.num_events = 0  # events run so far
        self._feed: Iterator[tuple[float, Any]] = iter(())
        self._feed_callback: Callback | None = None

    def feed(self, items: Iterator[tuple[float, Any]], callback: Callback) -> None:
        """Run ``callback(argument)`` for each ``(time, argument)`` of a time-sorted stream."""
        self._feed = items
        self._feed_callback = callback

    def now(self) -> float:
        return self.time

    def at(self, time: float, callback: Callback, argument: Any = None) -> None:
        """Run ``callback(argument)`` at virtual ``time`` (not before anything already due)."""
        if time < self.time:
            raise ValueError(f"event at {time!r} is in the past (now {self.time!r})")
        heapq.heappush(self._heap, (time, self._seq, callback, argument))
        self._seq += 1

    def after(self, delay_s: float, callback: Callback, argument: Any = None) -> None:
        self.at(self.time + delay_s, callback, argument)

    def run(self, until: float = float("inf")) -> None:
        """Run events in time order until none is left or the next is after ``until``."""
        heap = self._heap
        pop = heapq.heappop
        feed = self._feed
        on_item = self._feed_callback
        item = _next(feed)
        count = 0
        try:
            while True:
                if item is not None and (not heap or item[0] < heap[0][0]):
                    time, argument = item
                    if time > until:
                        break
                    if time < self.time:
                        raise ValueError(f"fed item at {time!r} is in the past (now {self.time!r})")
                    self.time = time
                    count += 1
                    assert on_item is not None
                    on_item(argument)
                    item = _next(feed)
                    continue
                if not heap or heap[0][0] > until:
                    break
                time, _, callback, argument = pop(heap)
                self.time = time
                count += 1
                callback(argument)
        finally:
            self.num_events += count
            if item is not None:  # not reached: put it back in front of the rest
                self._feed = itertools.chain((item,), feed)


def _next(items: Iterator[tuple[float, Any]]) -> tuple[float, Any] | None:
    """``next(items, None)``: compiled, a loop's step instead of looking ``next`` up per item."""
    for item in items:
        return item
    return None
