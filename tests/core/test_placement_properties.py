"""Placement invariants on random fleets and asks (Hypothesis): no over-commit, exclusivity,
pools respected, refusals only when nothing has room, and defrag plans that can be executed
move by move and free exactly the devices they claim."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.core.placement import (
    Device,
    Placement,
    PlacementResult,
    Refusal,
    ReplicaAsk,
    place,
    placement_violations,
    plan_defrag,
)

POOL_NAMES = ("dedicated", "shared")


@st.composite
def fleets(draw: st.DrawFn) -> list[Device]:
    num_devices = draw(st.integers(1, 6))
    return [
        Device(
            id=f"d{i}",
            memory_mb=draw(st.sampled_from([8000.0, 16000.0, 24000.0, 40000.0])),
            node=draw(st.sampled_from(["n0", "n1", "n2"])),
            pool=draw(st.sampled_from([None, *POOL_NAMES])),
        )
        for i in range(num_devices)
    ]


@st.composite
def ask_lists(draw: st.DrawFn, prefix: str = "r") -> list[ReplicaAsk]:
    num_asks = draw(st.integers(0, 12))
    return [
        ReplicaAsk(
            replica_id=f"{prefix}{i}",
            model=draw(st.sampled_from(["m0", "m1", "m2", "m3"])),
            pool=draw(st.sampled_from(POOL_NAMES)),
            memory_mb=float(draw(st.integers(500, 20000))),
            exclusive=draw(st.integers(0, 9)) == 0,
        )
        for i in range(num_asks)
    ]


strategies = st.sampled_from(["binpack", "spread"])


def could_take(ask: ReplicaAsk, device: Device, placement: Placement) -> bool:
    """Brute force: whether ``device`` has room for ``ask`` in ``placement``."""
    if device.pool not in (None, ask.pool):
        return False
    if ask.exclusive:
        return not placement.on_device(device.id) and ask.memory_mb <= device.memory_mb
    return placement.free_mb(device) >= ask.memory_mb


# Both properties of one placement are checked on the same 300 drawn fleets and asks (the
# order one had 200 of its own): drawing them was most of each test's time.
@settings(max_examples=300, deadline=None)
@given(fleets(), ask_lists(), strategies, st.randoms(use_true_random=False))
def test_place_keeps_every_invariant_whatever_the_order_of_devices_and_asks(
    devices: list[Device], asks: list[ReplicaAsk], strategy: str, rng: random.Random
) -> None:
    result = place(asks, devices, strategy=strategy)
    place_keeps_every_invariant(devices, asks, result)
    order_of_devices_and_asks_does_not_matter(devices, asks, strategy, rng, result)


def place_keeps_every_invariant(
    devices: list[Device], asks: list[ReplicaAsk], result: PlacementResult
) -> None:
    assert placement_violations(result.placement, devices) == ()
    placed = {p.ask.replica_id for p in result.new}
    refused = {r.ask.replica_id for r in result.refused}
    assert placed | refused == {a.replica_id for a in asks}
    assert not placed & refused
    for refusal in result.refused:
        # Placement only fills devices up: what had no room then has none at the end.
        assert not any(could_take(refusal.ask, d, result.placement) for d in devices)
        if refusal.reason is Refusal.TOO_LARGE:
            pool = [d for d in devices if d.pool in (None, refusal.ask.pool)]
            assert all(d.memory_mb < refusal.ask.memory_mb for d in pool)


def order_of_devices_and_asks_does_not_matter(
    devices: list[Device],
    asks: list[ReplicaAsk],
    strategy: str,
    rng: random.Random,
    result: PlacementResult,
) -> None:
    shuffled_devices, shuffled_asks = devices[:], asks[:]
    rng.shuffle(shuffled_devices)
    rng.shuffle(shuffled_asks)
    again = place(shuffled_asks, shuffled_devices, strategy=strategy)
    assert again == result
    assert plan_defrag(again.placement, shuffled_devices) == plan_defrag(result.placement, devices)


@settings(max_examples=200, deadline=None)
@given(fleets(), ask_lists("a"), ask_lists("b"), strategies)
def test_placing_more_never_moves_what_is_placed(
    devices: list[Device], first: list[ReplicaAsk], second: list[ReplicaAsk], strategy: str
) -> None:
    before = place(first, devices, strategy=strategy).placement
    after = place(second, devices, before, strategy).placement
    assert after.placed[: len(before.placed)] == before.placed
    assert placement_violations(after, devices) == ()


@settings(max_examples=300, deadline=None)
@given(
    fleets(),
    ask_lists(),
    ask_lists("p"),
    st.sampled_from([None, 1, 3]),
    strategies,
    st.randoms(use_true_random=False),
)
def test_defrag_plan_runs_move_by_move_and_frees_what_it_claims(
    devices: list[Device],
    asks: list[ReplicaAsk],
    pending: list[ReplicaAsk],
    max_moves: int | None,
    strategy: str,
    rng: random.Random,
) -> None:
    # Scale-in after placement is what fragments a fleet: drop about half the replicas.
    placed = place(asks, devices, strategy=strategy).placement
    current = placed.without({a.replica_id for a in asks if rng.random() < 0.5})
    plan = plan_defrag(current, devices, pending, max_moves=max_moves)
    by_id = {d.id: d for d in devices}
    moved: set[str] = set()
    state = current
    for move in plan.moves:
        target = by_id[move.to_device]
        replica = next(p.ask for p in state.placed if p.ask.replica_id == move.replica_id)
        assert move.replica_id not in moved, "a replica moves at most once"
        assert state.device_of(move.replica_id) == move.from_device != move.to_device
        assert state.on_device(target.id), "a move onto an empty device frees nothing"
        assert all(other.model != replica.model for other in state.on_device(target.id))
        # Make-before-break: the target holds the new copy while the old one still runs.
        assert could_take(replica, target, state)
        moved.add(move.replica_id)
        state = state.with_moves([move])
    assert state == plan.placement
    assert placement_violations(plan.placement, devices) == ()
    assert all(not plan.placement.on_device(d) for d in plan.freed_devices)
    assert set(plan.freed_devices) <= current.used_devices
    assert len(current.used_devices) - len(plan.placement.used_devices) == len(plan.freed_devices)
    if max_moves is not None:
        assert len(plan.moves) <= max_moves
    if pending and plan.fits_pending:
        assert place(pending, devices, plan.placement).refused == ()
