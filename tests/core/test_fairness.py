"""Fair sharing inside a level: virtual token counters (core.fairness) and the WaitQueue's
use of them. Table tests, then Hypothesis properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.core.fairness import (
    FairnessConfig,
    VirtualTokenCounters,
    reserve_slots,
    sequence_to_pause,
    slot_share,
)
from tidegate.core.queue import Admitted, AgingConfig, LevelSpec, QueueConfig, WaitQueue
from tidegate.core.request import Request

NO_AGING = AgingConfig(threshold_s=30.0, rate_per_s=0.0)
FAIR = FairnessConfig(input_weight=1.0, output_weight=2.0, lag_tokens=0.0)


def treq(rid: str, tenant: str, at: float = 0.0, level: int = 0, tokens: int = 1) -> Request:
    return Request(rid, "m", level, at, cost_tokens=tokens, tenant=tenant)


def fair_queue(
    fairness: FairnessConfig | None = FAIR,
    aging: AgingConfig = NO_AGING,
    levels: int = 3,
    max_size: int = 10_000,
) -> WaitQueue:
    specs = tuple(LevelSpec(f"l{i}") for i in range(levels))
    return WaitQueue(QueueConfig(levels=specs, max_size=max_size, aging=aging, fairness=fairness))


def admit_all(queue: WaitQueue, requests: list[Request], now: float = 0.0) -> None:
    for request in requests:
        assert isinstance(queue.admit(request, now), Admitted)


def pop_ids(queue: WaitQueue, count: int, now: float = 0.0) -> list[str]:
    ids = []
    for _ in range(count):
        popped = queue.pop(1, now)
        if not popped:
            break
        ids.append(popped[0].id)
    return ids


# ----------------------------------------------------------------------- counters
def test_config_rejects_bad_weights() -> None:
    with pytest.raises(ValueError, match="weights must be >= 0"):
        FairnessConfig(input_weight=-1)
    with pytest.raises(ValueError, match="positive input or output"):
        FairnessConfig(input_weight=0, output_weight=0)
    with pytest.raises(ValueError, match="lag_tokens"):
        FairnessConfig(lag_tokens=-1)
    with pytest.raises(ValueError, match="share must be > 0"):
        FairnessConfig(shares=(("a", 0.0),))
    for fraction in (-0.1, 1.0):
        with pytest.raises(ValueError, match="reserve_fraction"):
            FairnessConfig(reserve_fraction=fraction)


@pytest.mark.parametrize(
    ("input_tokens", "output_tokens", "expected"),
    [(10, 0, 10.0), (0, 10, 20.0), (100, 50, 200.0)],
)
def test_cost_weighs_output_twice(input_tokens: int, output_tokens: int, expected: float) -> None:
    assert FAIR.cost(input_tokens, output_tokens) == expected


def test_settle_replaces_the_estimate() -> None:
    counters = VirtualTokenCounters(FAIR)
    counters.arrive("a")
    counters.charge("a", counters.estimate(30))  # picked: estimate 30 at the input weight
    counters.leave("a")
    counters.settle("a", 30, input_tokens=10, output_tokens=5)  # served 10 in + 5 out
    assert counters.counter("a") == pytest.approx(20.0)


def test_share_divides_the_charge() -> None:
    counters = VirtualTokenCounters(FairnessConfig(shares=(("big", 2.0),), lag_tokens=0))
    counters.charge("big", 100.0)
    counters.charge("small", 100.0)
    assert counters.counter("big") == 50.0
    assert counters.counter("small") == 100.0


@pytest.mark.parametrize("lag", [0.0, 300.0, 5000.0])
def test_newcomer_lifted_to_min_minus_lag(lag: float) -> None:
    counters = VirtualTokenCounters(FairnessConfig(lag_tokens=lag))
    for tenant, served in (("a", 1000.0), ("b", 3000.0)):
        counters.arrive(tenant)
        counters.charge(tenant, served)
    least = min(counters.counter("a"), counters.counter("b"))
    counters.arrive("new")  # never served: lifted to the least backlogged counter - lag
    assert counters.counter("new") == least - lag
    counters.charge("new", 10 * lag + 10)
    before = counters.counter("new")
    counters.leave("new")
    counters.arrive("new")  # served more than the others: a lift never lowers a counter
    assert counters.counter("new") == before


def test_idle_tenant_banks_no_more_than_the_lag() -> None:
    counters = VirtualTokenCounters(FairnessConfig(lag_tokens=100.0))
    counters.arrive("idle")
    counters.charge("idle", 10.0)
    counters.leave("idle")
    counters.arrive("busy")
    counters.charge("busy", 10_000.0)
    counters.arrive("idle")  # comes back after busy was served much more
    assert counters.counter("idle") == counters.counter("busy") - 100.0


def test_lift_with_nobody_backlogged_uses_the_last_counter() -> None:
    counters = VirtualTokenCounters(FairnessConfig(lag_tokens=50.0))
    counters.arrive("a")
    counters.charge("a", 500.0)
    left_with = counters.counter("a")
    counters.leave("a")
    counters.arrive("b")
    assert counters.counter("b") == left_with - 50.0


def test_least_served_ties_go_to_the_first() -> None:
    counters = VirtualTokenCounters(FAIR)
    counters.charge("a", 5.0)
    counters.charge("b", 5.0)
    counters.charge("c", 9.0)
    assert counters.least_served(["b", "a", "c"]) == "b"
    with pytest.raises(ValueError, match="at least one tenant"):
        counters.least_served([])


def test_idle_counters_are_forgotten() -> None:
    counters = VirtualTokenCounters(FairnessConfig(lag_tokens=0.0))
    counters.arrive("busy")
    counters.charge("busy", 1e9)
    for index in range(1000):
        tenant = f"t{index}"
        counters.arrive(tenant)
        counters.leave(tenant)
    assert len(counters.describe()) < 200


# ----------------------------------------------------------------------- the queue
def test_flooding_tenant_does_not_delay_a_light_one() -> None:
    queue = fair_queue()
    admit_all(queue, [treq(f"heavy{i}", "heavy", at=i * 0.001) for i in range(100)])
    admit_all(queue, [treq("light0", "light", at=1.0)])
    # FIFO would pick the light request 101st; VTC picks it as soon as its counter is least.
    assert pop_ids(queue, 3) == ["heavy0", "light0", "heavy1"]


def test_without_fairness_the_level_is_fifo() -> None:
    queue = fair_queue(fairness=None)
    admit_all(queue, [treq(f"heavy{i}", "heavy", at=i * 0.001) for i in range(5)])
    admit_all(queue, [treq("light0", "light", at=1.0)])
    assert pop_ids(queue, 6)[-1] == "light0"
    assert queue.tenants() == {}


def test_round_robin_between_equal_tenants() -> None:
    queue = fair_queue()
    admit_all(queue, [treq(f"a{i}", "a", at=i) for i in range(3)])
    admit_all(queue, [treq(f"b{i}", "b", at=10 + i) for i in range(3)])
    assert pop_ids(queue, 6) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_costs_are_shared_by_tokens_not_requests() -> None:
    queue = fair_queue()
    admit_all(queue, [treq(f"big{i}", "big", at=i, tokens=30) for i in range(3)])
    admit_all(queue, [treq(f"small{i}", "small", at=10 + i, tokens=10) for i in range(9)])
    order = pop_ids(queue, 8)
    # After big0 (30 tokens), small is served three requests (30 tokens) before big1.
    assert order == ["big0", "small0", "small1", "small2", "big1", "small3", "small4", "small5"]


def test_levels_still_come_first() -> None:
    queue = fair_queue()
    admit_all(queue, [treq("low", "light", at=0.0, level=2)])
    admit_all(queue, [treq(f"high{i}", "heavy", at=1 + i, level=0) for i in range(3)])
    assert pop_ids(queue, 4, now=5.0) == ["high0", "high1", "high2", "low"]


def test_aged_head_is_taken_whatever_its_tenant() -> None:
    aging = AgingConfig(threshold_s=1.0, rate_per_s=1.0)
    queue = fair_queue(aging=aging)
    # Medium: heavy's old request (aged to high at t=2) ahead of light's fresh one.
    admit_all(queue, [treq("old", "heavy", at=0.0, level=1)], now=0.0)
    queue.pop(1, 0.0)  # nothing else yet: heavy is charged, its counter is now above light's
    admit_all(queue, [treq("aged", "heavy", at=0.0, level=1)], now=0.0)
    admit_all(queue, [treq("fresh", "light", at=4.0, level=1)], now=4.0)
    admit_all(queue, [treq("high", "other", at=4.0, level=0)], now=4.0)
    # At t=4, "aged" has effective priority 0 and arrived before "high": its level wins by
    # aging, so its head is taken, not light's fresh request (light's counter is least).
    assert queue.pop(1, 4.0)[0].id == "aged"
    assert pop_ids(queue, 2, now=4.0) == ["high", "fresh"]


def test_restricted_pick_takes_the_aged_head() -> None:
    aging = AgingConfig(threshold_s=1.0, rate_per_s=1.0)
    queue = fair_queue(aging=aging)
    admit_all(queue, [treq("h0", "heavy", at=0.0, level=1)])
    queue.pop(1, 0.0)
    admit_all(queue, [treq("h1", "heavy", at=0.0, level=1), treq("l1", "light", at=0.5, level=1)])
    # A high-only pool: only what has aged to high may go, the head h1 (aged at t=2).
    assert queue.pop(1, 2.0, levels={0})[0].id == "h1"
    assert queue.pop(1, 2.0, levels={0}) == ()  # l1 reaches high at 2.5
    assert queue.pop(1, 2.0, levels={1})[0].id == "l1"


def test_requeue_refunds_and_settle_corrects() -> None:
    queue = fair_queue()
    admit_all(queue, [treq("a0", "a", tokens=100), treq("b0", "b", tokens=10)])
    (a0,) = queue.pop(1, 0.0)
    assert queue.tenants()["a"]["counter"] == 100.0
    queue.requeue(a0, 0.0)
    assert queue.tenants()["a"]["counter"] == 0.0
    (first,) = queue.pop(1, 0.0)
    queue.settle(first, input_tokens=20, output_tokens=10)  # 20 + 2 * 10 = 40, not 100
    assert queue.tenants()[first.tenant]["counter"] == 40.0


def test_batch_pick_shares_too() -> None:
    queue = fair_queue()
    admit_all(queue, [treq(f"a{i}", "a", at=i) for i in range(4)])
    admit_all(queue, [treq(f"b{i}", "b", at=10 + i) for i in range(4)])
    assert [r.id for r in queue.peek(4, 0.0)] == ["a0", "b0", "a1", "b1"]
    assert [r.id for r in queue.pop(4, 0.0, max_tokens=3)] == ["a0", "b0", "a1"]
    assert len(queue) == 5


# ----------------------------------------------------------------------- slot shares
@pytest.mark.parametrize(
    ("slots", "share", "active_shares", "expected"),
    [
        (64, 1.0, 2.0, 32.0),  # two equal tenants: half each
        (64, 1.0, 1.0, 64.0),  # alone: every slot
        (64, 2.0, 3.0, 128 / 3),  # share 2 beside a share 1: two thirds
        (4, 1.0, 8.0, 1.0),  # more tenants than slots: still one each
        (8, 1.0, 0.0, 8.0),  # nobody active yet (a newcomer counted before it arrives)
    ],
)
def test_slot_share_is_slots_times_share_over_active_shares(
    slots: int, share: float, active_shares: float, expected: float
) -> None:
    assert slot_share(slots, share, active_shares) == pytest.approx(expected)


def _heavy_holds(queue: WaitQueue, slots: int, held: int) -> None:
    """``light`` holds one slot (``light-old``) and ``heavy`` takes ``held`` more; then
    ``light-old`` settles at 500 tokens (its counter far above heavy's) and ``light0``
    waits beside heavy's backlog."""
    queue.set_slots(slots)
    admit_all(queue, [treq("light-old", "light")])
    admit_all(queue, [treq(f"heavy{i}", "heavy", at=1 + i) for i in range(held + 3)], now=1)
    assert [r.id for r in queue.pop(1, 1.0)] == ["light-old"]  # counters tie: the earlier
    assert len(queue.pop(held, 1.0)) == held
    queue.settle(treq("light-old", "light"), input_tokens=500, output_tokens=0)
    admit_all(queue, [treq("light0", "light", at=50.0)], now=50.0)


@pytest.mark.parametrize(
    ("slots", "expected"),
    [
        (0, "heavy"),  # no slot bound: the counters alone, heavy's is least
        (4, "light"),  # heavy holds 3 of 4, over its share of 2: light, under it, goes
        (64, "heavy"),  # heavy holds 3 of 64, under its share of 32 too: the counters
    ],
)
def test_tenant_over_its_slot_share_gives_way_to_one_under(slots: int, expected: str) -> None:
    queue = fair_queue()
    _heavy_holds(queue, slots, held=3)
    queue.vacate(treq("light-old", "light"))  # light's old request ended
    assert queue.pop(1, 50.0)[0].tenant == expected


def test_a_tenant_at_its_share_still_competes_by_its_counter() -> None:
    """4 slots, shares of 2: light at its share (2) keeps its lower counter's turn over heavy
    under its share (1); once light is over (3), heavy, under, goes first."""
    queue = fair_queue()
    queue.set_slots(4)
    admit_all(queue, [treq("h-old", "heavy", tokens=500)])
    admit_all(queue, [treq(f"l{i}", "light", at=1 + i) for i in range(3)], now=3)
    admit_all(queue, [treq(f"h{i}", "heavy", at=4 + i) for i in range(1, 3)], now=5)
    assert pop_ids(queue, 4, now=5.0) == ["h-old", "l0", "l1", "l2"]
    admit_all(queue, [treq("l3", "light", at=6)], now=6)
    queue.vacate(treq("h-old", "heavy"))  # heavy holds none now, light 3: over its 2
    assert pop_ids(queue, 1, now=6.0) == ["h1"]


def test_every_waiting_tenant_over_its_share_the_counters_decide() -> None:
    """Work-conserving: light, holding its share already, still gets a free slot."""
    queue = fair_queue()
    _heavy_holds(queue, 2, held=1)  # light holds 1 (its old request), heavy 1: 1 each
    assert queue.pop(1, 50.0)[0].tenant == "heavy"  # both at their share: heavy's counter
    assert queue.pop(1, 50.0)[0].tenant == "heavy"


def test_vacate_and_requeue_give_the_slot_back() -> None:
    queue = fair_queue()
    queue.set_slots(2)
    admit_all(queue, [treq("a0", "a"), treq("a1", "a", at=1), treq("b0", "b", at=2)])
    (a0,) = queue.pop(1, 2.0)
    assert queue.tenants()["a"]["in_flight"] == 1
    queue.requeue(a0, 2.0)
    assert queue.tenants()["a"]["in_flight"] == 0
    (first,) = queue.pop(1, 2.0)
    queue.vacate(first)
    queue.vacate(first)  # a second vacate of a tenant holding nothing: no-op
    assert all(t["in_flight"] == 0 for t in queue.tenants().values())


def test_tenant_view_shows_slots_and_share() -> None:
    queue = fair_queue()
    queue.set_slots(6)
    admit_all(queue, [treq("a0", "a"), treq("a1", "a", at=1), treq("b0", "b", at=2)])
    queue.pop(1, 2.0)
    view = queue.tenants()
    assert view["a"]["in_flight"] == 1
    assert view["a"]["slot_share"] == 3.0
    assert view["b"]["slot_share"] == 3.0


def test_batch_pick_respects_slot_shares_as_single_picks_do() -> None:
    def build() -> WaitQueue:
        queue = fair_queue()
        _heavy_holds(queue, 6, held=2)
        admit_all(queue, [treq(f"light{i}", "light", at=51 + i) for i in range(1, 5)], now=55)
        return queue

    batch, single = build(), build()
    assert [r.id for r in batch.pop(4, 55.0)] == pop_ids(single, 4, now=55.0)


# ----------------------------------------------------------------------- the slot reserve
RESERVE = FairnessConfig(lag_tokens=0.0, reserve_fraction=0.25)


@pytest.mark.parametrize(
    ("slots", "fraction", "expected"),
    [
        (64, 0.0625, 4),  # a sixteenth of 64
        (64, 0.05, 3),  # rounded down
        (60, 0.05, 3),  # 3.0 exactly, whatever the float
        (4, 0.0625, 0),  # a quarter slot: none
        (2, 0.9, 1),  # never every slot: one stays for a tenant alone
        (1, 0.5, 0),  # one slot: nothing to hold back
        (0, 0.5, 0),  # no slot bound
        (64, 0.0, 0),  # off
    ],
)
def test_reserve_is_a_fraction_of_the_slots_rounded_down(
    slots: int, fraction: float, expected: int
) -> None:
    assert reserve_slots(slots, fraction) == expected


def test_tenant_alone_leaves_the_reserve_free_for_a_newcomer() -> None:
    """8 slots, 2 reserved: heavy, alone, takes 6 and no more; light, arriving, gets one at
    once (under its share of 3), and a second; heavy still gets none of the reserve."""
    queue = fair_queue(fairness=RESERVE)
    queue.set_slots(8)
    admit_all(queue, [treq(f"h{i}", "heavy", at=i) for i in range(10)], now=9)
    assert pop_ids(queue, 10, now=9.0) == [f"h{i}" for i in range(6)]
    assert queue.tenants()["heavy"]["slot_share"] == 6.0
    admit_all(queue, [treq(f"l{i}", "light", at=20 + i) for i in range(2)], now=21)
    assert pop_ids(queue, 3, now=21.0) == ["l0", "l1"]
    queue.vacate(treq("l0", "light"))  # one free, in the reserve: heavy (6, over 3) waits
    assert queue.pop(1, 21.0) == ()
    queue.vacate(treq("h0", "heavy"))  # two free, still the reserve's
    assert queue.pop(1, 21.0) == ()
    queue.vacate(treq("h1", "heavy"))  # three free: one outside the reserve, heavy's
    assert pop_ids(queue, 2, now=21.0) == ["h6"]


def test_reserved_slot_goes_to_a_less_urgent_tenant_under_its_share() -> None:
    """Heavy's high request may not have the reserve; light's medium one, under its share,
    does: the pick looks past the level it cannot serve."""
    queue = fair_queue(fairness=RESERVE)
    queue.set_slots(4)  # 1 reserved
    admit_all(queue, [treq(f"h{i}", "heavy", at=i) for i in range(4)], now=3)
    assert len(queue.pop(4, 3.0)) == 3
    admit_all(queue, [treq("l0", "light", at=5, level=1)], now=5)
    assert [r.id for r in queue.peek(2, 5.0)] == ["l0"]
    assert queue.pop(1, 5.0)[0].id == "l0"


def test_aged_head_takes_a_reserved_slot() -> None:
    """Aging's bound on the wait comes first: an aged request is taken whatever its tenant."""
    aging = AgingConfig(threshold_s=1.0, rate_per_s=1.0)
    queue = fair_queue(fairness=RESERVE, aging=aging)
    queue.set_slots(4)  # 1 reserved
    admit_all(queue, [treq(f"h{i}", "heavy", at=0.0, level=1) for i in range(4)])
    assert len(queue.pop(4, 0.0)) == 3
    assert queue.pop(1, 0.0, levels={1}) == ()  # at its own level: held back
    assert queue.pop(1, 2.0, levels={0})[0].id == "h3"  # aged to high: taken


def test_batch_pick_respects_the_reserve_as_single_picks_do() -> None:
    def build() -> WaitQueue:
        queue = fair_queue(fairness=RESERVE)
        queue.set_slots(8)
        admit_all(queue, [treq(f"h{i}", "heavy", at=i) for i in range(9)], now=9)
        admit_all(queue, [treq(f"l{i}", "light", at=10 + i, level=1) for i in range(3)], now=12)
        return queue

    batch, single = build(), build()
    expected = [f"h{i}" for i in range(6)] + ["l0", "l1"]  # heavy up to the reserve, light in it
    assert [r.id for r in batch.pop(8, 12.0)] == pop_ids(single, 8, now=12.0) == expected


PREEMPT = FairnessConfig(lag_tokens=0.0, reserve_fraction=0.0, preemption=True)


def test_preemption_takes_a_slot_from_the_tenant_over_its_share() -> None:
    """4 slots, heavy took them all alone; light arrives with none free: its request may
    pause one of heavy's (2 over its share of 2). Light's second too (1 held, under 2); a
    third no more (light at its share)."""
    queue = fair_queue(fairness=PREEMPT)
    queue.set_slots(4)
    admit_all(queue, [treq(f"h{i}", "heavy", at=i) for i in range(6)], now=6)
    assert len(queue.pop(4, 6.0)) == 4  # (the caller bounds the slots: it picks no more)
    admit_all(queue, [treq(f"l{i}", "light", at=10 + i) for i in range(3)], now=12)
    taken = queue.preempt(12.0)
    assert taken is not None
    assert (taken[0].id, taken[1]) == ("l0", "heavy")
    taken = queue.preempt(12.0)
    assert taken is not None
    assert (taken[0].id, taken[1]) == ("l1", "heavy")
    assert queue.preempt(12.0) is None  # light holds its share of 2
    assert queue.tenants()["light"]["in_flight"] == 2
    assert queue.tenants()["heavy"]["in_flight"] == 4  # paused ones still count as heavy's


@pytest.mark.parametrize(
    ("config", "free", "why"),
    [
        (FairnessConfig(lag_tokens=0.0, reserve_fraction=0.0), 0, "preemption off"),
        (PREEMPT, 1, "a slot is free"),
    ],
)
def test_no_preemption_when_off_or_a_slot_is_free(
    config: FairnessConfig, free: int, why: str
) -> None:
    queue = fair_queue(fairness=config)
    queue.set_slots(4)
    admit_all(queue, [treq(f"h{i}", "heavy", at=i) for i in range(4 - free)], now=4)
    queue.pop(4, 4.0)
    admit_all(queue, [treq("l0", "light", at=5)], now=5)
    assert queue.preempt(5.0) is None, why
    assert "l0" in queue


def test_preemption_picks_the_most_urgent_level_and_only_served_levels() -> None:
    queue = fair_queue(fairness=PREEMPT)
    queue.set_slots(2)
    admit_all(queue, [treq("h0", "heavy", at=0), treq("h1", "heavy", at=1)], now=1)
    queue.pop(2, 1.0)
    admit_all(queue, [treq("l1", "light", at=2, level=1), treq("l0", "light", at=3)], now=3)
    assert queue.preempt(3.0, levels={1}) is not None  # level 0 not served there: l1
    assert "l0" in queue
    assert "l1" not in queue


def test_a_tenant_alone_never_preempts_itself() -> None:
    queue = fair_queue(fairness=PREEMPT)
    queue.set_slots(2)
    admit_all(queue, [treq(f"h{i}", "heavy", at=i) for i in range(4)], now=4)
    queue.pop(2, 4.0)
    assert queue.preempt(4.0) is None


def test_take_picks_one_request_out_of_order() -> None:
    queue = fair_queue(fairness=PREEMPT)
    queue.set_slots(4)
    admit_all(queue, [treq("h0", "heavy", at=0, tokens=5), treq("l0", "light", at=1)], now=1)
    taken = queue.take("l0")
    assert taken is not None
    assert taken.id == "l0"
    assert queue.take("l0") is None
    assert queue.tenants()["light"]["in_flight"] == 1
    assert queue.tenants()["light"]["counter"] == 1
    assert [r.id for r in queue.pop(2, 1.0)] == ["h0"]


@pytest.mark.parametrize(
    ("running", "expected"),
    [
        ([("a", 5, 0), ("b", 2, 1), ("c", 2, 2)], "c"),  # fewest made; ties: latest granted
        ([("a", 0, 0), ("b", 3, 1)], "b"),  # one not yet at its first token is never paused
        ([("a", 0, 0)], None),
        ([], None),
    ],
)
def test_the_sequence_paused_is_the_decoding_one_with_the_fewest_tokens(
    running: list[tuple[str, int, int]], expected: str | None
) -> None:
    assert sequence_to_pause(running) == expected


def test_victim_is_the_tenant_most_over_its_share() -> None:
    fair = VirtualTokenCounters(PREEMPT)
    fair.slots = 6
    for tenant, held in (("a", 4), ("b", 2)):
        for _ in range(held):
            fair.occupy(tenant)
    fair.arrive("c")  # share 2 each: a is 2 over, b at its share
    assert fair.victim("c") == "a"
    assert fair.victim("a") is None  # over its own share: it may not preempt
    fair.vacate("a")  # a slot free: nobody preempts
    assert fair.victim("c") is None


def test_full_level_sheds_the_flooding_tenant() -> None:
    queue = fair_queue(max_size=4)
    admit_all(queue, [treq(f"heavy{i}", "heavy", at=i) for i in range(4)])
    decision = queue.admit(treq("light0", "light", at=10), 10.0)
    assert isinstance(decision, Admitted)
    assert [r.id for r in decision.shed] == ["heavy3"]  # its newest
    decision = queue.admit(treq("light1", "light", at=11), 11.0)
    assert isinstance(decision, Admitted)
    assert [r.id for r in decision.shed] == ["heavy2"]
    # Now heavy holds 2 and light 2: nobody holds more, the next arrival is refused.
    assert not isinstance(queue.admit(treq("light2", "light", at=12), 12.0), Admitted)
    assert not isinstance(queue.admit(treq("heavy9", "heavy", at=12), 12.0), Admitted)


@pytest.mark.parametrize("fairness", [FAIR, None])
def test_holdback_makes_the_flooding_tenant_give_way(fairness: FairnessConfig | None) -> None:
    specs = (LevelSpec("high"), LevelSpec("medium", holdback_above=0.5))
    queue = WaitQueue(QueueConfig(levels=specs, aging=NO_AGING, fairness=fairness))
    admit_all(queue, [treq(f"heavy{i}", "heavy", at=i, level=1) for i in range(3)])
    decision = queue.admit(treq("light0", "light", at=9, level=1), 9.0, saturation=0.8)
    if fairness is None:
        assert not isinstance(decision, Admitted)
    else:  # the same number queued as before, and the flood gave up its newest place
        assert isinstance(decision, Admitted)
        assert [r.id for r in decision.shed] == ["heavy2"]
        assert len(queue) == 3
    refused = queue.admit(treq("heavy9", "heavy", at=9, level=1), 9.0, saturation=0.8)
    assert not isinstance(refused, Admitted)


def test_full_level_without_fairness_refuses() -> None:
    queue = fair_queue(fairness=None, max_size=2)
    admit_all(queue, [treq(f"heavy{i}", "heavy", at=i) for i in range(2)])
    assert not isinstance(queue.admit(treq("light0", "light", at=10), 10.0), Admitted)


def test_tenant_views() -> None:
    queue = fair_queue()
    admit_all(queue, [treq("a0", "a"), treq("a1", "a"), treq("b0", "b", level=1)])
    assert queue.tenant_depths(0) == {"a": 2}
    assert queue.tenants()["a"]["queued"] == 2
    queue.cancel("a0")
    queue.cancel("b0")
    assert queue.tenant_depths(0) == {"a": 1}
    assert queue.tenant_depths(1) == {}


# ----------------------------------------------------------------------- properties
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("admit"),
            st.integers(0, 2),  # level
            st.sampled_from(["", "a", "b", "c"]),
            st.integers(0, 50),  # tokens
        ),
        st.tuples(st.just("pop"), st.integers(1, 4), st.none(), st.none()),
        st.tuples(st.just("cancel"), st.integers(0, 40), st.none(), st.none()),
        st.tuples(st.just("requeue"), st.none(), st.none(), st.none()),
        st.tuples(st.just("tick"), st.integers(1, 20), st.none(), st.none()),
    ),
    max_size=80,
)

AGING = AgingConfig(threshold_s=3.0, rate_per_s=0.5)


def run_ops(
    queue: WaitQueue, ops: list[tuple[object, ...]], one_tenant: bool = False
) -> tuple[list[object], dict[str, int]]:
    """Apply ``ops``; returns what the queue answered, and per id how many times it left."""
    now = 0.0
    answers: list[object] = []
    left: dict[str, int] = {}
    admitted: list[str] = []
    dispatched: list[Request] = []
    for index, (op, a, b, c) in enumerate(ops):
        if op == "admit":
            assert isinstance(a, int)
            assert isinstance(b, str)
            assert isinstance(c, int)
            tenant = "" if one_tenant else b
            request = Request(
                f"r{index}", "m", a, now, deadline_at=now + 40, cost_tokens=c, tenant=tenant
            )
            decision = queue.admit(request, now)
            answers.append(type(decision).__name__)
            if isinstance(decision, Admitted):
                admitted.append(request.id)
                left.setdefault(request.id, 0)
                for victim in decision.shed:
                    left[victim.id] += 1
        elif op == "pop":
            assert isinstance(a, int)
            popped = queue.pop(a, now, max_tokens=60)
            answers.append([r.id for r in popped])
            for request in popped:
                left[request.id] += 1
            dispatched.extend(popped)
        elif op == "cancel" and admitted:
            assert isinstance(a, int)
            rid = admitted[a % len(admitted)]
            cancelled = queue.cancel(rid)
            answers.append(None if cancelled is None else cancelled.id)
            if cancelled is not None:
                left[rid] += 1
        elif op == "requeue" and dispatched:
            request = dispatched.pop()
            queue.requeue(request, now)
            left[request.id] -= 1  # back in: it will leave again
        elif op == "tick":
            assert isinstance(a, int)
            now += a * 0.5
            expired = queue.expire(now)
            answers.append([r.id for r in expired])
            for request in expired:
                left[request.id] += 1
    drained = queue.pop(len(queue) + 1, now)
    for request in drained:
        left[request.id] += 1
    assert len(queue) == 0
    return answers, left


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_every_admitted_request_leaves_exactly_once(ops: list[tuple[object, ...]]) -> None:
    queue = fair_queue(fairness=FairnessConfig(lag_tokens=20.0), aging=AGING, max_size=12)
    _, left = run_ops(queue, ops)
    assert all(count == 1 for count in left.values()), left
    assert queue.tenants() == {} or all(t["queued"] == 0 for t in queue.tenants().values())


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_one_tenant_picks_exactly_as_fifo(ops: list[tuple[object, ...]]) -> None:
    fair = fair_queue(fairness=FairnessConfig(), aging=AGING, max_size=12)
    fifo = fair_queue(fairness=None, aging=AGING, max_size=12)
    assert run_ops(fair, ops, one_tenant=True) == run_ops(fifo, ops, one_tenant=True)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 20), min_size=1, max_size=60),  # cost of each tenant's requests
    st.integers(2, 5),  # tenants
    st.integers(1, 200),  # picks
)
def test_no_tenant_starves(costs: list[int], num_tenants: int, picks: int) -> None:
    """Every tenant stays backlogged: the counters never drift apart by more than the
    largest single charge, so none waits longer than the others' share of it."""
    queue = fair_queue(fairness=FairnessConfig(lag_tokens=0.0))
    tenants = [f"t{i}" for i in range(num_tenants)]
    for tenant in tenants:
        admit_all(
            queue,
            [
                treq(f"{tenant}-{i}", tenant, at=i, tokens=costs[(i + len(tenant)) % len(costs)])
                for i in range(picks + 1)
            ],
        )
    served: dict[str, int] = dict.fromkeys(tenants, 0)
    for _ in range(picks):
        (request,) = queue.pop(1, 0.0)
        served[request.tenant] += 1
        counters = [queue.tenants()[tenant]["counter"] for tenant in tenants]
        assert max(counters) - min(counters) <= max(costs)
    if picks >= num_tenants * max(costs):
        assert min(served.values()) >= 1


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 100), st.integers(1, 4), st.floats(0.0, 500.0))
def test_newcomer_served_within_one_round(backlog: int, others: int, lag: float) -> None:
    queue = fair_queue(fairness=FairnessConfig(lag_tokens=lag))
    for index in range(others):
        tenant = f"t{index}"
        admit_all(queue, [treq(f"{tenant}-{i}", tenant, at=i) for i in range(backlog + 5)])
    pop_ids(queue, backlog)
    admit_all(queue, [treq("new", "newcomer", at=1000.0)])
    assert "new" in pop_ids(queue, others + 1)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("admit"), st.sampled_from(["a", "b", "c"]), st.integers(0, 30)),
            st.tuples(st.just("pop"), st.none(), st.none()),
            st.tuples(st.just("cancel"), st.none(), st.integers(0, 60)),
        ),
        max_size=120,
    ),
    st.floats(0.0, 50.0),
)
def test_picks_match_a_brute_force_vtc(ops: list[tuple[object, ...]], lag: float) -> None:
    """One level, no aging: every pick is the least-counter tenant's oldest request (ties:
    the earlier head), across tenants joining and leaving the level (split and merge)."""
    config = FairnessConfig(lag_tokens=lag)
    queue = fair_queue(fairness=config, levels=1)
    model = VirtualTokenCounters(config)
    queued: list[Request] = []  # in arrival order
    for index, (op, tenant, number) in enumerate(ops):
        if op == "admit":
            assert isinstance(tenant, str)
            assert isinstance(number, int)
            request = treq(f"r{index}", tenant, at=float(index), tokens=number)
            admit_all(queue, [request], now=float(index))
            model.arrive(tenant)
            queued.append(request)
        elif op == "pop":
            popped = queue.pop(1, float(index))
            if not queued:
                assert popped == ()
                continue
            heads: dict[str, Request] = {}
            for request in queued:
                heads.setdefault(request.tenant, request)
            expected = min(heads.values(), key=lambda r: (model.counter(r.tenant), r.arrival_at))
            assert [r.id for r in popped] == [expected.id]
            model.charge_estimate(expected.tenant, expected.cost_tokens)
            model.leave(expected.tenant)
            queued.remove(expected)
        elif queued:
            assert isinstance(number, int)
            victim = queued[number % len(queued)]
            assert queue.cancel(victim.id) is not None
            model.leave(victim.tenant)
            queued.remove(victim)
        assert sum(queue.tenant_depths(0).values()) == len(queued)


SLOT_OPS = st.lists(
    st.tuples(
        # admissions weigh most: slots are contested only when several tenants wait
        st.sampled_from(["admit", "admit", "admit", "end", "end", "cancel", "slots"]),
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 50),  # admit: level (mod 2); end, cancel: which (mod len); slots: 1-8
    ),
    max_size=120,
)


@settings(max_examples=800, deadline=None)  # (300 found a disabled slot rule 2 times in 3)
@given(
    SLOT_OPS,
    st.integers(1, 8),
    st.lists(st.integers(0, 40), min_size=3, max_size=3),
    st.sampled_from([0.0, 0.0, 0.25, 0.5]),
)
def test_slot_shares_bound_the_over_share_and_idle_no_slot(
    ops: list[tuple[str, str, int]], slots: int, costs: list[int], reserve_fraction: float
) -> None:
    """A dispatcher's loop over a fair queue (two levels, no aging; tenant ``a`` of share
    2): whenever a slot is free it picks. No tenant over its slot share takes a slot while
    one under its share waits in the level picked; no tenant at or over its share takes one
    of the reserve's slots; and no slot outside the reserve idles while anything waits, nor
    one of the reserve's while a tenant under its share waits. Shares, holdings and the
    reserve are counted here, by brute force. Each tenant's requests cost its own number of
    tokens: a cheap tenant's counter stays least, so only the slot shares keep it from
    taking every slot."""
    shares = {"a": 2.0, "b": 1.0, "c": 1.0}
    config = FairnessConfig(lag_tokens=0.0, shares=(("a", 2.0),), reserve_fraction=reserve_fraction)
    queue = fair_queue(fairness=config, levels=2)
    queue.set_slots(slots)
    queued: dict[str, Request] = {}
    running: list[Request] = []

    def dispatch(now: float) -> None:
        reserve = min(slots - 1, int(slots * reserve_fraction)) if slots > 1 else 0
        while len(running) < slots and len(queue):
            held = {t: sum(r.tenant == t for r in running) for t in shares}
            active = {r.tenant for r in running} | {r.tenant for r in queued.values()}
            total = sum(shares[t] for t in active)
            share = {t: max(1.0, (slots - reserve) * shares[t] / total) for t in shares}
            under = {t for t in shares if held[t] < share[t]}
            waiting = {r.tenant for r in queued.values()}
            in_reserve = slots - len(running) <= reserve
            popped = queue.pop(1, now)
            if not popped:  # only the reserve is free, and no one under its share waits
                assert in_reserve, (held, share)
                assert not (waiting & under), (held, share, waiting)
                break
            (picked,) = popped
            assert not in_reserve or picked.tenant in under, (picked, held, share)
            if held[picked.tenant] > share[picked.tenant]:  # over its share
                level = {r.tenant for r in queued.values() if r.priority == picked.priority}
                assert not (level & under), (picked, held, level & under)
            del queued[picked.id]
            running.append(picked)
        assert len(running) >= slots - reserve or not len(queue)  # work-conserving outside

    for index, (op, tenant, number) in enumerate(ops):
        now = float(index)
        if op == "admit":
            cost = costs["abc".index(tenant)]
            request = treq(f"r{index}", tenant, at=now, level=number % 2, tokens=cost)
            admit_all(queue, [request], now=now)
            queued[request.id] = request
        elif op == "end" and running:
            queue.vacate(running.pop(number % len(running)))
        elif op == "cancel" and queued:
            victim = list(queued)[number % len(queued)]
            assert queue.cancel(victim) is not None
            del queued[victim]
        elif op == "slots":
            slots = number % 8 + 1
            queue.set_slots(slots)
        dispatch(now)
        assert {t: int(v["in_flight"]) for t, v in queue.tenants().items() if v["in_flight"]} == {
            t: n for t in shares if (n := sum(r.tenant == t for r in running))
        }
