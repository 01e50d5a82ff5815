"""The clock seam: shells read time through a Clock so the simulator can swap it."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


SYSTEM_CLOCK = MonotonicClock()
