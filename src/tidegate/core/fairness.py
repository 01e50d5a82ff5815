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

Slots (``slots`` > 0, set by the caller: the model's in-flight slots). The counters order
the queue, but a generation request holds its slot for its whole decode: a tenant that took
every slot while it was alone keeps them, and a light tenant waits for one to free however
low its counter. So a tenant also has a *slot share*, ``slot_share(slots, share, active)``:
``slots x its share / the shares of the active tenants`` (queued or in flight), at least 1.
A tenant holding fewer slots than its slot share is *under* it, more is *over* it; when a
slot frees and a tenant under its share waits, no tenant over its share gets it: the least
counter among the others does (``slot_standing``, the caller's pick). A tenant at its share
exactly still competes by its counter, so a light tenant whose requests are short is not
held to its slot share against a tenant under it (the counters already favour the light
one). Work-conserving: when no waiting tenant is under its share, the counters alone
decide, so a slot never idles while anyone waits. The caller counts a tenant's slots:
``occupy`` at a pick, ``vacate`` when its request ends.

The slot reserve (``reserve_fraction`` > 0). A work-conserving rule cannot give a newcomer a
slot that nobody gives back: a tenant alone takes every slot, its decodes started together,
and the first tenant to arrive after it waits for the first of them to end, however far under
its share. So the last ``reserve_slots(slots, reserve_fraction)`` free slots (at most
``slots - 1``) are held for a tenant under its slot share, and slot shares divide the other
``slots - reserve``: while no more than the reserve is free, a tenant at or over its share
does not get a slot (``may_take``), even if nobody else waits; with more free, the rules
above are unchanged. It costs at most reserve / slots of the model, and only while one
tenant (or every active tenant at its share) fills it; a newcomer's first request starts at
once.

Preemption (``preemption`` on). The reserve keeps a slot or two; a newcomer's burst beyond
them still waits for a decode to end, however far under its share it is. With preemption, when
no slot is free and a waiting tenant is under its slot share while another is over its own,
the waiting one's next request may take a slot from the one over it (``victim``: the tenant
most slots above its share): the caller sends it to a replica holding the victim's requests
and that replica pauses one of them, which resumes there when a slot frees (vLLM's priority
preemption, by tenant standing instead of priority). The paused request still counts as its
tenant's (the caller's ``occupy`` is not undone): the slots held may exceed ``slots`` by the
preemptions not yet resumed, which keeps the victim over its share and no new pick past the
slots until they resume. Each preemption costs the paused request its recomputation (prompt
and the tokens it had made) and nothing more.

Pure: no clock, no I/O. Counters of tenants that are neither backlogged nor above the lift
floor are forgotten (they would be lifted to the floor anyway), so memory follows the
number of active tenants, not of every tenant ever seen.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

K = TypeVar("K")

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
    # of the model's slots, the last free ones held for a tenant under its slot share
    reserve_fraction: float = 0.03125  # 1/32: 2 of 64 (bench_fairness)
    # with no slot free, a tenant under its slot share may pause one of a tenant over its own
    preemption: bool = False

    def __post_init__(self) -> None:
        if self.input_weight < 0 or self.output_weight < 0:
            raise ValueError("fairness token weights must be >= 0")
        if self.input_weight == 0 and self.output_weight == 0:
            raise ValueError("fairness needs a positive input or output token weight")
        if self.lag_tokens < 0:
            raise ValueError(f"fairness lag_tokens must be >= 0, got {self.lag_tokens}")
        if not 0.0 <= self.reserve_fraction < 1.0:
            raise ValueError(
                f"fairness reserve_fraction must be in [0, 1), got {self.reserve_fraction}"
            )
        for tenant, share in self.shares:
            if not share > 0:
                raise ValueError(f"tenant {tenant!r}: share must be > 0, got {share}")

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        """Weighted tokens of one request's service, before its tenant's share."""
        return self.input_weight * input_tokens + self.output_weight * output_tokens


def slot_share(slots: int, share: float, active_shares: float) -> float:
    """A tenant's fair share of ``slots`` in-flight slots: ``slots * share / active_shares``
    (the shares of the tenants queued or in flight, its own included), at least one slot."""
    if active_shares <= 0:
        return float(max(1, slots))
    return max(1.0, slots * share / active_shares)


def sequence_to_pause(running: Iterable[tuple[K, int, int]]) -> K | None:
    """Of the victim tenant's running sequences, as ``(key, tokens made, grant order)``, the
    one a preemption pauses: a decoding one (at least one token made: an engine stops a
    sequence only at a token) with the fewest tokens made, the least to recompute; ties: the
    latest granted. None when none is decoding."""
    best: tuple[int, int] | None = None
    chosen: K | None = None
    for key, made, order in running:
        if made < 1:
            continue
        rank = (made, -order)
        if best is None or rank < best:
            best, chosen = rank, key
    return chosen


def reserve_slots(slots: int, fraction: float) -> int:
    """How many of ``slots`` the reserve holds: ``fraction`` of them rounded down, and never
    every slot (at most ``slots - 1``), so a tenant alone always has one."""
    if slots <= 1:
        return 0
    return min(slots - 1, math.floor(slots * fraction + 1e-9))


class VirtualTokenCounters:
    """Per-tenant counters of weighted tokens served, which tenants are backlogged, and how
    many slots each holds."""

    __slots__ = (
        "_active_shares",
        "_backlog",
        "_config",
        "_counters",
        "_floor",
        "_held",
        "_input_weight",
        "_num_held",
        "_prune_above",
        "_reserve",
        "_shares",
        "_slots",
    )

    def __init__(self, config: FairnessConfig | None = None) -> None:
        self._config = config or FairnessConfig()
        self._shares: Mapping[str, float] = dict(self._config.shares)
        self._input_weight = self._config.input_weight
        self._counters: dict[str, float] = {}
        self._backlog: dict[str, int] = {}  # tenant -> queued requests; present iff > 0
        self._floor = 0.0  # the counter the last backlogged tenant left with
        self._prune_above = _PRUNE_SLACK  # prune once this many counters are kept
        self._held: dict[str, int] = {}  # tenant -> slots it holds; present iff > 0
        self._active_shares = 0.0  # sum of the shares of tenants backlogged or holding slots
        self._num_held = 0  # slots held by all tenants together
        self._slots = 0  # the model's in-flight slots (the caller's); 0: no slot bound
        self._reserve = 0  # of them, held for a tenant under its share (``reserve_slots``)

    @property
    def config(self) -> FairnessConfig:
        return self._config

    @property
    def slots(self) -> int:
        """The model's in-flight slots, set by the caller; 0: no slot bound."""
        return self._slots

    @slots.setter
    def slots(self, slots: int) -> None:
        self._slots = slots
        self._reserve = reserve_slots(slots, self._config.reserve_fraction)

    @property
    def reserve(self) -> int:
        """Of ``slots``, those held for a tenant under its slot share (module docstring)."""
        return self._reserve

    # ------------------------------------------------------------------ backlog
    def arrive(self, tenant: str) -> None:
        """One more unit of ``tenant``'s backlog (a queued request; WaitQueue counts a level
        where it has requests queued); a newcomer's counter is lifted first."""
        queued = self._backlog.get(tenant, 0)
        if queued == 0:
            self._lift(tenant)
            if tenant not in self._held:
                self._active_shares += self._shares.get(tenant, 1.0)
        self._backlog[tenant] = queued + 1

    def leave(self, tenant: str) -> None:
        """One unit of ``tenant``'s backlog left (``arrive``): picked, shed, expired..."""
        queued = self._backlog[tenant] - 1
        if queued:
            self._backlog[tenant] = queued
            return
        del self._backlog[tenant]
        if tenant not in self._held:
            self._inactive(tenant)
        if not self._backlog:
            self._floor = self._counters.get(tenant, self._floor)
        if len(self._counters) > self._prune_above:
            self._prune()

    def backlogged(self) -> int:
        return len(self._backlog)

    # ------------------------------------------------------------------ slots
    def occupy(self, tenant: str) -> None:
        """``tenant`` was given a slot (a pick). Call before its ``leave``."""
        held = self._held.get(tenant, 0)
        if held == 0 and tenant not in self._backlog:
            self._active_shares += self._shares.get(tenant, 1.0)
        self._held[tenant] = held + 1
        self._num_held += 1

    def vacate(self, tenant: str) -> None:
        """A request of ``tenant`` gave its slot back (ended, failed, or put back in the
        queue). No-op when it holds none: the caller could not tell whose request ended."""
        held = self._held.get(tenant, 0)
        if held > 1:
            self._held[tenant] = held - 1
            self._num_held -= 1
        elif held == 1:
            del self._held[tenant]
            self._num_held -= 1
            if tenant not in self._backlog:
                self._inactive(tenant)

    def held(self, tenant: str) -> int:
        """How many slots ``tenant`` holds."""
        return self._held.get(tenant, 0)

    def slot_share(self, tenant: str) -> float:
        """``tenant``'s share of the slots outside the reserve among the active tenants
        (``slot_share``)."""
        share = self._shares.get(tenant, 1.0)
        active = self._active_shares
        if tenant not in self._backlog and tenant not in self._held:
            active += share  # not active yet: as if it were
        return slot_share(self._slots - self._reserve, share, active)

    def slot_standing(self, tenant: str, extra: int = 0) -> int:
        """``tenant``, holding ``extra`` more slots than it does, against its slot share:
        -1 under it, 0 at it, 1 over it; 0 with no slot bound (``slots`` 0)."""
        if not self._slots:
            return 0
        held = self._held.get(tenant, 0) + extra
        share = self.slot_share(tenant)
        return -1 if held < share else (1 if held > share else 0)

    def in_reserve(self, extra_total: int = 0) -> bool:
        """Whether the free slots, with ``extra_total`` more held, are only the reserve."""
        reserve = self._reserve
        return bool(reserve) and self._slots - self._num_held - extra_total <= reserve

    def may_take(self, tenant: str, extra: int = 0, extra_total: int = 0) -> bool:
        """Whether a pick may give ``tenant`` a free slot, it holding ``extra`` more and all
        tenants ``extra_total`` more than counted: outside the reserve always; in it, only
        while under its slot share."""
        reserve = self._reserve  # (``in_reserve`` inline: every pick of a sole tenant asks)
        if not reserve or self._slots - self._num_held - extra_total > reserve:
            return True
        return self._held.get(tenant, 0) + extra < self.slot_share(tenant)

    def victim(self, tenant: str) -> str | None:
        """With preemption on and no slot free: the tenant one of whose requests ``tenant``'s
        next one may pause (module docstring), the one most slots over its slot share (ties:
        the larger counter, then the name); None when ``tenant`` is not under its own share,
        a slot is free, or no other tenant is over its share."""
        slots = self._slots
        if not self._config.preemption or not slots or self._num_held < slots:
            return None
        if self.slot_standing(tenant) >= 0:
            return None
        best: str | None = None
        best_key: tuple[float, float, str] | None = None
        for other, held in self._held.items():
            if other == tenant:
                continue
            over = held - self.slot_share(other)
            if over <= 0:
                continue
            key = (-over, -self.counter(other), other)
            if best_key is None or key < best_key:
                best, best_key = other, key
        return best

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

    def picked(self, tenant: str, cost_tokens: int) -> None:
        """A pick of ``tenant``'s request: ``charge_estimate`` and ``occupy`` in one step."""
        weighted = self._input_weight * cost_tokens
        if self._shares:
            weighted /= self._shares.get(tenant, 1.0)
        counters = self._counters
        counters[tenant] = counters.get(tenant, self._floor) + weighted
        held = self._held.get(tenant, 0)
        if held == 0 and tenant not in self._backlog:
            self._active_shares += self._shares.get(tenant, 1.0)
        self._held[tenant] = held + 1
        self._num_held += 1

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
        """Per tenant: its counter, backlog (``arrive``'s units), slots held and slot share
        (for /admin and ``tidegate explain``, through ``WaitQueue.tenants``)."""
        tenants = sorted(set(self._counters) | set(self._backlog) | set(self._held))
        return {
            tenant: {
                "counter": round(self.counter(tenant), 1),
                "queued": self._backlog.get(tenant, 0),
                "share": self._shares.get(tenant, 1.0),
                "in_flight": self._held.get(tenant, 0),
                "slot_share": round(self.slot_share(tenant), 1) if self._slots else 0.0,
            }
            for tenant in tenants
        }

    # ------------------------------------------------------------------ internals
    def _inactive(self, tenant: str) -> None:
        """``tenant`` neither waits nor holds a slot any more: its share leaves the sum."""
        if self._backlog or self._held:
            self._active_shares -= self._shares.get(tenant, 1.0)
        else:
            self._active_shares = 0.0  # nobody active: no float drift carried over

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
