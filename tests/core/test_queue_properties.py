"""WaitQueue invariants under random operation sequences (Hypothesis).

A brute-force model keeps every request's status and recomputes the pick order by sorting;
the queue must agree with it on every step, without ever sorting itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from tidegate.core.queue import (
    Admitted,
    AgingConfig,
    LevelSpec,
    QueueConfig,
    Rejected,
    WaitQueue,
    effective_priority,
)
from tidegate.core.request import Request

CONFIG = QueueConfig(
    levels=(
        LevelSpec("high"),
        LevelSpec("medium", timeout_s=20.0, holdback_above=0.9),
        LevelSpec("low", max_size=4, holdback_above=0.7),
    ),
    max_size=8,
    aging=AgingConfig(threshold_s=5.0, rate_per_s=0.5),
    min_drain_samples=2,
)


@dataclass
class Tracked:
    request: Request
    seq: int
    deadline_at: float | None
    status: str  # "queued", "dispatched" or "terminal"


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.queue = WaitQueue(CONFIG)
        self.twin = WaitQueue(CONFIG)  # same inputs, must give the same outputs
        self.now = 0.0
        self.next_id = 0
        self.next_seq = 0
        self.tracked: dict[str, Tracked] = {}
        self.requeued: set[str] = set()

    # ------------------------------------------------------------------ helpers
    def _ids(self, status: str) -> list[str]:
        return sorted(rid for rid, t in self.tracked.items() if t.status == status)

    def _end(self, rid: str, expected_status: str) -> None:
        tracked = self.tracked[rid]
        assert tracked.status == expected_status, (rid, tracked.status, expected_status)
        tracked.status = "terminal"

    def _key(self, t: Tracked) -> tuple[float, float, int]:
        r = t.request
        return (
            effective_priority(r.priority, r.arrival_at, self.now, CONFIG.aging),
            r.arrival_at,
            t.seq,
        )

    def _servable(self, r: Request, allowed: set[int]) -> bool:
        """At its own level, or at a served level it has aged to (by the formula)."""
        aging = CONFIG.aging
        return any(
            s == r.priority
            or (
                s < r.priority
                and self.now
                >= r.arrival_at + aging.threshold_s + (r.priority - s) / aging.rate_per_s
            )
            for s in allowed
        )

    # ------------------------------------------------------------------ rules
    # Round steps make exact ties in effective priority (aged to the floor) common.
    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0, 10.0]) | st.floats(0.0, 8.0))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(
        level=st.integers(0, 2),
        deadline_in_s=st.none() | st.floats(min_value=0.0, max_value=30.0),
        tokens=st.integers(1, 8),
        saturation=st.sampled_from([0.0, 0.5, 0.8, 0.95]),
    )
    def arrive(
        self, level: int, deadline_in_s: float | None, tokens: int, saturation: float
    ) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        deadline_at = None if deadline_in_s is None else self.now + deadline_in_s
        request = Request(rid, "m", level, self.now, deadline_at, tokens)
        decision = self.queue.admit(request, self.now, saturation)
        assert decision == self.twin.admit(request, self.now, saturation)
        if isinstance(decision, Rejected):
            self.tracked[rid] = Tracked(request, -1, None, "terminal")
            return
        assert isinstance(decision, Admitted)
        for victim in decision.shed:
            assert victim.priority > level  # only less urgent work is shed
            self._end(victim.id, "queued")
        self.tracked[rid] = Tracked(request, self.next_seq, decision.deadline_at, "queued")
        self.next_seq += 1

    @rule(
        n=st.integers(1, 4),
        max_tokens=st.none() | st.integers(1, 12),
        levels=st.none() | st.sets(st.integers(0, 2), min_size=1),
    )
    def pick(self, n: int, max_tokens: int | None, levels: set[int] | None) -> None:
        allowed = {0, 1, 2} if levels is None else levels
        candidates = sorted(
            (
                t
                for t in self.tracked.values()
                if t.status == "queued" and self._servable(t.request, allowed)
            ),
            key=self._key,
        )
        expected: list[str] = []
        budget = 0
        for t in candidates[:n]:
            if max_tokens is not None and expected and budget + t.request.cost_tokens > max_tokens:
                break
            expected.append(t.request.id)
            budget += t.request.cost_tokens
        popped = self.queue.pop(n, self.now, max_tokens, levels)
        assert popped == self.twin.pop(n, self.now, max_tokens, levels)
        assert [r.id for r in popped] == expected
        for r in popped:
            self.tracked[r.id].status = "dispatched"

    @rule(levels=st.sets(st.integers(0, 2), min_size=1))
    def aging_timer(self, levels: set[int]) -> None:
        at = self.queue.next_eligible_at(levels)
        assert at == self.twin.next_eligible_at(frozenset(levels))
        aging = CONFIG.aging
        times = [
            t.request.arrival_at + aging.threshold_s + (t.request.priority - s) / aging.rate_per_s
            for t in self.tracked.values()
            if t.status == "queued" and t.request.priority not in levels
            for s in levels
            if s < t.request.priority
        ]
        assert at == (min(times) if times else None)

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tracked) or ["none"]))
        result = self.queue.cancel(rid)
        assert result == self.twin.cancel(rid)
        queued = rid in self.tracked and self.tracked[rid].status == "queued"
        assert (result is not None) == queued
        if queued:
            self._end(rid, "queued")

    @rule()
    def expire(self) -> None:
        expired = self.queue.expire(self.now)
        assert expired == self.twin.expire(self.now)
        for r in expired:
            deadline_at = self.tracked[r.id].deadline_at
            assert deadline_at is not None
            assert deadline_at <= self.now
            self._end(r.id, "queued")
        for rid in self._ids("queued"):
            deadline_at = self.tracked[rid].deadline_at
            assert deadline_at is None or deadline_at > self.now

    @precondition(lambda self: bool(self._ids("dispatched")))
    @rule(data=st.data(), succeed=st.booleans())
    def finish(self, data: st.DataObject, succeed: bool) -> None:
        rid = data.draw(st.sampled_from(self._ids("dispatched")))
        if succeed:
            self._end(rid, "dispatched")
            self.queue.drain.record(self.now)
            self.twin.drain.record(self.now)
            return
        # The replica failed before the first byte: the request goes back to the queue.
        tracked = self.tracked[rid]
        self.queue.requeue(tracked.request, self.now)
        self.twin.requeue(tracked.request, self.now)
        tracked.status = "queued"
        self.requeued.add(rid)
        tracked.seq = self.next_seq
        self.next_seq += 1

    # ------------------------------------------------------------------ invariants
    @invariant()
    def every_request_is_in_exactly_one_place(self) -> None:
        queued = self._ids("queued")
        assert len(self.queue) == len(queued)
        assert all(rid in self.queue for rid in queued)
        for rid in self._ids("dispatched") + self._ids("terminal"):
            assert rid not in self.queue

    @invariant()
    def depths_and_tokens_match(self) -> None:
        depths = [0, 0, 0]
        tokens = 0
        for rid in self._ids("queued"):
            depths[self.tracked[rid].request.priority] += 1
            tokens += self.tracked[rid].request.cost_tokens
        assert list(self.queue.depths()) == depths
        assert self.queue.num_tokens == tokens

    @invariant()
    def limits_hold_except_for_retries(self) -> None:
        # A requeued request bypasses admission (refusing it would lose it): allow for those.
        retried = [rid for rid in self._ids("queued") if rid in self.requeued]
        retried_low = [rid for rid in retried if self.tracked[rid].request.priority == 2]
        assert len(self.queue) <= CONFIG.max_size + len(retried)
        low_limit = CONFIG.levels[2].max_size
        assert low_limit is not None
        assert self.queue.depth(2) <= low_limit + len(retried_low)

    @invariant()
    def outputs_are_deterministic(self) -> None:
        assert self.queue.depths() == self.twin.depths()
        assert self.queue.next_deadline_at() == self.twin.next_deadline_at()


@given(
    arrivals=st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0])),
        min_size=1,
        max_size=120,
    ),
    pick_every_s=st.sampled_from([0.2, 0.5, 1.0, 2.0]),
    aging=st.sampled_from([AgingConfig(5.0, 0.5), AgingConfig(2.0, 2.0), AgingConfig(30.0, 0.5)]),
)
@settings(max_examples=200, deadline=None)
def test_aging_bounds_the_wait_of_every_request(
    arrivals: list[tuple[int, float]], pick_every_s: float, aging: AgingConfig
) -> None:
    """Picked no later than threshold + level/rate after arrival, plus the service of what
    was already ahead of it (one pick per ``pick_every_s``), under any arrival pattern.

    After its effective priority reaches the top level, a request can only be passed by
    requests at the top level that arrived earlier, i.e. were queued when it was admitted.
    """
    queue = WaitQueue(QueueConfig(max_size=10_000, aging=aging))
    pending = []  # (arrival_at, level) in arrival order
    now = 0.0
    for level, gap_s in arrivals:
        now += gap_s
        pending.append((now, level))
    ahead_at_admission: dict[str, int] = {}
    bound_at: dict[str, float] = {}
    clock = 0.0
    index = 0
    while index < len(pending) or len(queue):
        # Admit everything that has arrived by this pick.
        while index < len(pending) and pending[index][0] <= clock:
            arrival_at, level = pending[index]
            rid = f"r{index}"
            ahead_at_admission[rid] = len(queue)
            request = Request(rid, "m", level, arrival_at)
            assert isinstance(queue.admit(request, arrival_at), Admitted)
            bound_at[rid] = (
                arrival_at
                + aging.threshold_s
                + level / aging.rate_per_s
                + (ahead_at_admission[rid] + 1) * pick_every_s
            )
            index += 1
        for picked in queue.pop(1, clock):
            assert clock <= bound_at[picked.id] + 1e-9, (picked, clock, bound_at[picked.id])
        clock += pick_every_s


QueueMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestQueueMachine = QueueMachine.TestCase


@given(
    arrivals=st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0])),
        min_size=1,
        max_size=80,
    ),
    served=st.sets(st.integers(0, 2), min_size=1),
    pick_every_s=st.sampled_from([0.2, 0.5, 1.0, 2.0]),
    aging=st.sampled_from([AgingConfig(5.0, 0.5), AgingConfig(2.0, 2.0), AgingConfig(30.0, 0.5)]),
)
@settings(max_examples=150, deadline=None)
def test_every_request_aging_can_bring_to_a_served_level_is_picked_within_the_bound(
    arrivals: list[tuple[int, float]],
    served: set[int],
    pick_every_s: float,
    aging: AgingConfig,
) -> None:
    """Picks restricted to ``served`` (the levels of the only pools there are), as the
    dispatcher's: a request whose level is not served but aging reaches a served level is
    picked within the same bound as an unrestricted pick; one that aging cannot bring to a
    served level (more urgent than every served one) is never picked.

    The bound holds because at ``threshold + level / rate`` a request is at the top level,
    eligible for any served level at or above its own, and only earlier arrivals tie with it.
    """
    queue = WaitQueue(QueueConfig(max_size=10_000, aging=aging))
    never = set(queue.unreachable_levels(served))
    assert never == {level for level in range(3) if level < min(served)}
    bound_at: dict[str, float] = {}
    picked: set[str] = set()
    pending = []
    now = 0.0
    for level, gap_s in arrivals:
        now += gap_s
        pending.append((now, level))
    last_bound_at = 0.0
    clock = 0.0
    index = 0
    while index < len(pending) or clock <= last_bound_at:
        while index < len(pending) and pending[index][0] <= clock:
            arrival_at, level = pending[index]
            rid = f"r{index}"
            if level not in never:
                bound_at[rid] = (
                    arrival_at
                    + aging.threshold_s
                    + level / aging.rate_per_s
                    + (len(queue) + 1) * pick_every_s
                )
                last_bound_at = max(last_bound_at, bound_at[rid])
            assert isinstance(
                queue.admit(Request(rid, "m", level, arrival_at), arrival_at), Admitted
            )
            index += 1
        for request in queue.pop(1, clock, levels=frozenset(served)):
            assert request.priority not in never, (request, served)
            assert clock <= bound_at[request.id] + 1e-9, (request, clock, bound_at[request.id])
            picked.add(request.id)
        clock += pick_every_s
    assert picked == set(bound_at)
