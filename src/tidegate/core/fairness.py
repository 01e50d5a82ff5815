"""Fair sharing between tenants inside a priority level: virtual token counters (VTC).

After "Fairness in Serving Large Language Models" (Sheng et al., OSDI 2024). Each tenant has
a counter of the weighted tokens it was served, divided by its share:
``input_weight * input_tokens + output_weight * output_tokens``. Inside one level the
backlogged tenant with the least counter goes next (ties: the caller's order, which is the
arrival of each tenant's oldest request). A tenant that becomes backlogged has its counter
lifted to at least ``min(counters of the backlogged tenants) - lag_tokens`` (or, when none is
backlogged, to the counter the last one left with, minus the lag): idling banks at most
``lag_tokens`` of credit, so a newcomer gets a bounded head start and can never lock the
others out by having been quiet.

Charging happens in two steps, both the caller's: ``charge`` when a request is picked (its
cost estimate, at the input weight: VTC charges the prompt at dispatch), then ``settle`` on
completion with the tokens actually served, which replaces the estimate. A request that
never completes keeps its estimate charged: it held a slot.

Pure: no clock, no I/O. Counters of tenants that are neither backlogged nor above the lift
floor are forgotten (they would be lifted to the floor anyway), so memory follows the
number of active tenants, not of every tenant ever seen.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# Forget idle tenants' counters once there are this many more counters than backlogged ones.
_PRUNE_SLACK = 64


@dataclass(frozen=True, slots=True)
class FairnessConfig:
    """How the virtual token counters weigh service. The VTC paper uses input 1, output 2."""

    input_weight: float = 1.0
    output_weight: float = 2.0
    lag_tokens: float = 1000.0  # the most credit a tenant can bank by being idle
    # tenant -> share (default 1): a tenant of share 2 is served twice the weighted tokens
    shares: tuple[tuple[str, float], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.input_weight < 0 or self.output_weight < 0:
            raise ValueError("fairness token weights must be >= 0")
        if self.input_weight == 0 and self.output_weight == 0:
            raise ValueError("fairness needs a positive input or output token weight")
        if self.lag_tokens < 0:
            raise ValueError(f"fairness lag_tokens must be >= 0, got {self.lag_tokens}")
        for tenant, share in self.shares:
            if not share > 0:
                raise ValueError(f"tenant {tenant!r}: share must be > 0, got {share}")

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        """Weighted tokens of one request's service, before its tenant's share."""
        return self.input_weight * input_tokens + self.output_weight * output_tokens


class VirtualTokenCounters:
    """Per-tenant counters of weighted tokens served, and which tenants are backlogged."""

    __slots__ = (
        "_backlog",
        "_config",
        "_counters",
        "_floor",
        "_input_weight",
        "_prune_above",
        "_shares",
    )

    def __init__(self, config: FairnessConfig | None = None) -> None:
        self._config = config or FairnessConfig()
        self._shares: Mapping[str, float] = dict(self._config.shares)
        self._input_weight = self._config.input_weight
        self._counters: dict[str, float] = {}
        self._backlog: dict[str, int] = {}  # tenant -> queued requests; present iff > 0
        self._floor = 0.0  # the counter the last backlogged tenant left with
        self._prune_above = _PRUNE_SLACK  # prune once this many counters are kept

    @property
    def config(self) -> FairnessConfig:
        return self._config

    # ------------------------------------------------------------------ backlog
    def arrive(self, tenant: str) -> None:
        """One more queued request of ``tenant``; a newcomer's counter is lifted first."""
        queued = self._backlog.get(tenant, 0)
        if queued == 0:
            self._lift(tenant)
        self._backlog[tenant] = queued + 1

    def leave(self, tenant: str) -> None:
        """One queued request of ``tenant`` left the queue (picked, shed, expired...)."""
        queued = self._backlog[tenant] - 1
        if queued:
            self._backlog[tenant] = queued
            return
        del self._backlog[tenant]
        if not self._backlog:
            self._floor = self._counters.get(tenant, self._floor)
        if len(self._counters) > self._prune_above:
            self._prune()

    def backlogged(self) -> int:
        return len(self._backlog)

    # ------------------------------------------------------------------ charging
    def charge(self, tenant: str, weighted_tokens: float) -> None:
        """Add ``weighted_tokens`` (already weighted, see ``FairnessConfig.cost``) of service."""
        self._counters[tenant] = self._counters.get(tenant, self._floor) + self.scaled(
            tenant, weighted_tokens
        )

    def charge_estimate(self, tenant: str, cost_tokens: int) -> None:
        """``charge(tenant, estimate(cost_tokens))`` in one step: a pick's charge."""
        weighted = self._input_weight * cost_tokens
        if self._shares:
            weighted /= self._shares.get(tenant, 1.0)
        self._counters[tenant] = self._counters.get(tenant, self._floor) + weighted

    def scaled(self, tenant: str, weighted_tokens: float) -> float:
        """What ``charge(tenant, weighted_tokens)`` adds to the counter: divided by the share."""
        return weighted_tokens / self._shares.get(tenant, 1.0)

    def estimate(self, cost_tokens: int) -> float:
        """What a pick charges: the request's cost estimate at the input weight."""
        return self._config.input_weight * cost_tokens

    def settle(
        self, tenant: str, estimate_tokens: int, input_tokens: int, output_tokens: int
    ) -> None:
        """A completed request served ``input_tokens`` + ``output_tokens``: replace the
        estimate charged at its pick (``estimate(estimate_tokens)``) with that."""
        self.charge(
            tenant,
            self._config.cost(input_tokens, output_tokens) - self.estimate(estimate_tokens),
        )

    # ------------------------------------------------------------------ choice
    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, self._floor)

    def least_served(self, tenants: Iterable[str]) -> str:
        """The tenant with the least counter; ties go to the first in ``tenants``."""
        counters = self._counters
        floor = self._floor
        best = ""
        best_counter = 0.0
        first = True
        for tenant in tenants:
            value = counters.get(tenant, floor)
            if first or value < best_counter:
                best, best_counter, first = tenant, value, False
        if first:
            raise ValueError("least_served needs at least one tenant")
        return best

    def describe(self) -> dict[str, dict[str, float | int]]:
        """Per tenant: its counter and queued requests (for /stats and ``tidegate explain``)."""
        tenants = sorted(set(self._counters) | set(self._backlog))
        return {
            tenant: {
                "counter": round(self.counter(tenant), 1),
                "queued": self._backlog.get(tenant, 0),
                "share": self._shares.get(tenant, 1.0),
            }
            for tenant in tenants
        }

    # ------------------------------------------------------------------ internals
    def _lift(self, tenant: str) -> None:
        if self._backlog:
            floor = min(self._counters.get(other, self._floor) for other in self._backlog)
        else:
            floor = self._floor
        lifted = floor - self._config.lag_tokens
        current = self._counters.get(tenant)
        if current is None or current < lifted:
            self._counters[tenant] = lifted

    def _prune(self) -> None:
        """Forget idle tenants whose counter a lift would restore anyway."""
        if self._backlog:
            floor = min(self._counters.get(other, self._floor) for other in self._backlog)
        else:
            floor = self._floor
        lifted = floor - self._config.lag_tokens
        self._counters = {
            tenant: value
            for tenant, value in self._counters.items()
            if tenant in self._backlog or value > lifted
        }
        # Counters above the floor stay; wait for as many again before the next pass.
        self._prune_above = 2 * len(self._counters) + _PRUNE_SLACK
