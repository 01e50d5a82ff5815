"""place / plan_defrag / pick_victims: which device each replica runs on.

Design note. A replica asks for GPU memory (``memory_mb``, from its profile) on a shared
device, or for a whole device (``exclusive``). Devices belong to a pool (``Device.pool``;
None: any pool may use it), and a replica only lands on its own pool's devices, which is
how a ``dedicated`` pool keeps its GPU for high priority. Within the pool:

- ``place`` is best-fit decreasing: exclusive asks first, then by memory, largest first;
  each goes where it leaves the least memory free (``binpack``: fewer devices in use, big
  holes kept for big asks) or the most (``spread``: headroom everywhere). Before fit, a
  device with fewer replicas of the same model wins, then a node with fewer: two replicas
  of one model on one GPU share its compute and fail together, so they spread whenever
  there is room elsewhere. Whatever has no room is refused with the reason, never squeezed.
- ``plan_defrag`` frees whole devices by moving replicas onto devices already in use:
  devices are emptied cheapest first (fewest replicas, then least memory), a replica moves
  at most once, never onto a device holding its own model, never to an empty device (that
  frees nothing). Moves run one at a time and make-before-break, so each target must have
  room with everything moved before it in place. Greedy: bin packing is NP-hard, but each
  device freed is the cheapest one still freeable. With ``pending`` asks, it stops as soon
  as they fit.
- ``pick_victims`` orders scale-in: fewest requests in flight (least to drain), then the
  removal that frees most (a whole device, else the device left emptiest), then newest.

Invariants, after every function here: memory is never over-committed (the asks on a
device sum to at most its memory); a device with an exclusive replica holds nothing else;
every replica is on a device of its pool; the same inputs give the same outputs (every
tie goes to the smaller id).
"""

from __future__ import annotations

import enum
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

STRATEGIES = ("binpack", "spread")


@dataclass(frozen=True, slots=True)
class Device:
    id: str
    memory_mb: float
    node: str
    pool: str | None = None  # the pool owning it; None: any pool may use it


@dataclass(frozen=True, slots=True)
class ReplicaAsk:
    replica_id: str
    model: str
    pool: str
    memory_mb: float  # what it needs on a shared device; an exclusive one takes the device
    exclusive: bool = False


@dataclass(frozen=True, slots=True)
class Placed:
    ask: ReplicaAsk
    device_id: str


@dataclass(frozen=True, slots=True)
class Placement:
    """Replicas and the devices they run on. An immutable value: changes return a new one."""

    placed: tuple[Placed, ...] = ()

    @property
    def assignments(self) -> dict[str, str]:
        """replica id -> device id."""
        return {p.ask.replica_id: p.device_id for p in self.placed}

    @property
    def used_devices(self) -> frozenset[str]:
        return frozenset(p.device_id for p in self.placed)

    def device_of(self, replica_id: str) -> str | None:
        return next((p.device_id for p in self.placed if p.ask.replica_id == replica_id), None)

    def on_device(self, device_id: str) -> tuple[ReplicaAsk, ...]:
        return tuple(p.ask for p in self.placed if p.device_id == device_id)

    def used_mb(self, device_id: str) -> float:
        return sum(ask.memory_mb for ask in self.on_device(device_id))

    def free_mb(self, device: Device) -> float:
        """Memory still free on ``device``; none at all once it hosts an exclusive replica."""
        asks = self.on_device(device.id)
        if any(ask.exclusive for ask in asks):
            return 0.0
        return device.memory_mb - sum(ask.memory_mb for ask in asks)

    def without(self, replica_ids: Collection[str]) -> Placement:
        return Placement(tuple(p for p in self.placed if p.ask.replica_id not in replica_ids))

    def with_moves(self, moves: Iterable[Move]) -> Placement:
        """The placement once ``moves`` are done."""
        targets = {move.replica_id: move.to_device for move in moves}
        return Placement(
            tuple(Placed(p.ask, targets.get(p.ask.replica_id, p.device_id)) for p in self.placed)
        )


class Refusal(enum.StrEnum):
    ALREADY_PLACED = "already_placed"  # the replica id is in the placement already
    NO_DEVICE_IN_POOL = "no_device_in_pool"  # the pool owns no device
    TOO_LARGE = "too_large"  # larger than every device of the pool, even empty
    NO_ROOM = "no_room"  # would fit an empty device, but none has room now


@dataclass(frozen=True, slots=True)
class Refused:
    ask: ReplicaAsk
    reason: Refusal
    message: str


@dataclass(frozen=True, slots=True)
class PlacementResult:
    placement: Placement  # the current placement plus every ask placed
    new: tuple[Placed, ...]  # the asks placed, in the order they were
    refused: tuple[Refused, ...]


@dataclass(frozen=True, slots=True)
class Move:
    replica_id: str
    from_device: str
    to_device: str


@dataclass(frozen=True, slots=True)
class DefragPlan:
    moves: tuple[Move, ...]  # in order: each target has room once the moves before it are done
    freed_devices: tuple[str, ...]  # empty once every move is done
    placement: Placement  # after every move
    fits_pending: bool = True  # whether the pending asks fit the placement after the moves

    def describe(self) -> list[str]:
        """Lines for ``tidegate defrag --dry-run``."""
        if not self.moves:
            return ["nothing to move"]
        lines = [f"move {m.replica_id}: {m.from_device} -> {m.to_device}" for m in self.moves]
        lines.append(f"frees {len(self.freed_devices)}: {', '.join(self.freed_devices)}")
        if not self.fits_pending:
            lines.append("the pending replicas still do not fit")
        return lines


@dataclass(frozen=True, slots=True)
class VictimCandidate:
    replica_id: str
    in_flight: int  # requests it would have to finish before it stops
    started_at: float  # monotonic seconds; the newest goes first among equals


class _Usage:
    """Mutable tallies of a placement, for one call: what is on each device and node."""

    __slots__ = ("exclusive", "mb", "models", "node_models", "replicas")

    def __init__(self, placement: Placement, devices: Iterable[Device]) -> None:
        self.mb: defaultdict[str, float] = defaultdict(float)
        self.replicas: Counter[str] = Counter()
        self.exclusive: set[str] = set()
        self.models: Counter[tuple[str, str]] = Counter()  # (device, model)
        self.node_models: Counter[tuple[str, str]] = Counter()  # (node, model)
        nodes = {device.id: device.node for device in devices}
        for p in placement.placed:
            self.add(p.ask, p.device_id, nodes.get(p.device_id, ""))

    def add(self, ask: ReplicaAsk, device_id: str, node: str, sign: int = 1) -> None:
        self.mb[device_id] += sign * ask.memory_mb
        self.replicas[device_id] += sign
        self.models[device_id, ask.model] += sign
        self.node_models[node, ask.model] += sign
        if ask.exclusive:
            if sign > 0:
                self.exclusive.add(device_id)
            else:
                self.exclusive.discard(device_id)

    def fits(self, ask: ReplicaAsk, device: Device) -> bool:
        if device.pool is not None and device.pool != ask.pool:
            return False
        if device.id in self.exclusive or ask.memory_mb > device.memory_mb:
            return False
        if ask.exclusive:
            return self.replicas[device.id] == 0
        return self.mb[device.id] + ask.memory_mb <= device.memory_mb

    def free_after(self, ask: ReplicaAsk, device: Device) -> float:
        if ask.exclusive:
            return 0.0
        return device.memory_mb - self.mb[device.id] - ask.memory_mb


def place(
    asks: Iterable[ReplicaAsk],
    devices: Sequence[Device],
    current: Placement | None = None,
    strategy: str = "binpack",
) -> PlacementResult:
    """Place ``asks`` on ``devices`` around ``current``; what has no room is refused."""
    if strategy not in STRATEGIES:
        raise ValueError(f"placement strategy must be one of {STRATEGIES}, got {strategy!r}")
    current = current or Placement()
    usage = _Usage(current, devices)
    known = set(current.assignments)
    new: list[Placed] = []
    refused: list[Refused] = []
    for ask in sorted(asks, key=_largest_first):
        if ask.replica_id in known:
            message = f"{ask.replica_id} is already on {current.device_of(ask.replica_id)}"
            refused.append(Refused(ask, Refusal.ALREADY_PLACED, message))
            continue
        device = _best_device(ask, devices, usage, strategy)
        if device is None:
            refused.append(_refusal(ask, devices))
            continue
        usage.add(ask, device.id, device.node)
        known.add(ask.replica_id)
        new.append(Placed(ask, device.id))
    return PlacementResult(Placement((*current.placed, *new)), tuple(new), tuple(refused))


def _largest_first(ask: ReplicaAsk) -> tuple[bool, float, str]:
    # Exclusive asks need an empty device: place them before shared ones fill the devices.
    return (not ask.exclusive, -ask.memory_mb, ask.replica_id)


def _best_device(
    ask: ReplicaAsk,
    devices: Sequence[Device],
    usage: _Usage,
    strategy: str,
    exclude: Collection[str] = (),
) -> Device | None:
    candidates = [d for d in devices if d.id not in exclude and usage.fits(ask, d)]
    if not candidates:
        return None
    sign = 1.0 if strategy == "binpack" else -1.0

    def key(device: Device) -> tuple[int, int, float, str]:
        return (
            usage.models[device.id, ask.model],  # spread a model over devices ...
            usage.node_models[device.node, ask.model],  # ... and over nodes
            sign * usage.free_after(ask, device),  # best fit (binpack) or worst fit (spread)
            device.id,
        )

    return min(candidates, key=key)


def _refusal(ask: ReplicaAsk, devices: Sequence[Device]) -> Refused:
    pool = [d for d in devices if d.pool is None or d.pool == ask.pool]
    if not pool:
        return Refused(ask, Refusal.NO_DEVICE_IN_POOL, f"pool {ask.pool} has no device")
    largest = max(d.memory_mb for d in pool)
    if ask.memory_mb > largest:
        message = (
            f"{ask.replica_id} asks {ask.memory_mb:g} MB; the largest device of pool "
            f"{ask.pool} has {largest:g} MB"
        )
        return Refused(ask, Refusal.TOO_LARGE, message)
    need = "an empty device" if ask.exclusive else f"{ask.memory_mb:g} MB free"
    message = f"no device of pool {ask.pool} has {need} for {ask.replica_id}"
    return Refused(ask, Refusal.NO_ROOM, message)


def plan_defrag(
    placement: Placement,
    devices: Sequence[Device],
    pending: Sequence[ReplicaAsk] = (),
    *,
    max_moves: int | None = None,
    strategy: str = "binpack",
) -> DefragPlan:
    """Moves that free whole devices, cheapest first (see the module docstring).

    Without ``pending``, frees every device it can; with it, stops as soon as the pending
    asks would all be placed by ``place(pending, devices, ..., strategy)`` (and moves
    nothing when they already would be).
    """
    usage = _Usage(placement, devices)
    by_id = {device.id: device for device in devices}
    moves: list[Move] = []
    freed: list[str] = []
    received: set[str] = set()
    if pending and _all_fit(pending, devices, placement, strategy):
        return DefragPlan((), (), placement)
    for source in _sources(placement, devices):
        if source.id in received:
            continue  # a replica moves at most once, and never off a device it was moved to
        cost = len(placement.on_device(source.id))
        if max_moves is not None and len(moves) + cost > max_moves:
            continue
        emptying = _empty_device(source, placement, usage, by_id, exclude={*freed, source.id})
        if emptying is None:
            continue
        moves.extend(emptying)
        freed.append(source.id)
        received.update(move.to_device for move in emptying)
        if pending and _all_fit(pending, devices, placement.with_moves(moves), strategy):
            break
    after = placement.with_moves(moves)
    fits = not pending or _all_fit(pending, devices, after, strategy)
    return DefragPlan(tuple(moves), tuple(freed), after, fits)


def _sources(placement: Placement, devices: Sequence[Device]) -> list[Device]:
    """Devices worth emptying, cheapest first: fewest replicas, then least memory."""
    used = placement.used_devices
    # An exclusive replica would need an empty device elsewhere: moving it frees nothing.
    candidates = [
        d
        for d in devices
        if d.id in used and not any(ask.exclusive for ask in placement.on_device(d.id))
    ]
    return sorted(
        candidates, key=lambda d: (len(placement.on_device(d.id)), placement.used_mb(d.id), d.id)
    )


def _empty_device(
    source: Device,
    placement: Placement,
    usage: _Usage,
    by_id: dict[str, Device],
    exclude: Collection[str],
) -> list[Move] | None:
    """Moves that empty ``source`` onto devices in use, applied to ``usage``; None: cannot."""
    moves: list[Move] = []
    trial: list[tuple[ReplicaAsk, Device]] = []
    in_use = [d for d in by_id.values() if usage.replicas[d.id] > 0]
    for ask in sorted(placement.on_device(source.id), key=_largest_first):
        targets = [d for d in in_use if usage.models[d.id, ask.model] == 0]
        target = _best_device(ask, targets, usage, "binpack", exclude)
        if target is None:
            for undo_ask, undo_device in trial:  # roll the tallies back
                usage.add(undo_ask, undo_device.id, undo_device.node, sign=-1)
            return None
        usage.add(ask, target.id, target.node)
        trial.append((ask, target))
        moves.append(Move(ask.replica_id, source.id, target.id))
    for ask, _ in trial:
        usage.add(ask, source.id, source.node, sign=-1)
    return moves


def _all_fit(
    asks: Sequence[ReplicaAsk], devices: Sequence[Device], placement: Placement, strategy: str
) -> bool:
    return not place(asks, devices, placement, strategy).refused


def pick_victims(
    candidates: Iterable[VictimCandidate],
    count: int,
    placement: Placement,
) -> tuple[str, ...]:
    """Up to ``count`` replica ids to drain, in the order to drain them."""
    remaining = sorted(candidates, key=lambda c: c.replica_id)
    victims: list[str] = []
    while remaining and len(victims) < count:
        victim = min(remaining, key=lambda c: _victim_key(c, placement))
        victims.append(victim.replica_id)
        remaining.remove(victim)
        placement = placement.without({victim.replica_id})  # the next pick sees it gone
    return tuple(victims)


def _victim_key(
    candidate: VictimCandidate, placement: Placement
) -> tuple[int, bool, float, float, str]:
    device_id = placement.device_of(candidate.replica_id)
    if device_id is None:
        frees_device, left_mb = False, 0.0  # not placed on a known device: frees nothing
    else:
        others = [a for a in placement.on_device(device_id) if a.replica_id != candidate.replica_id]
        frees_device = not others
        left_mb = sum(a.memory_mb for a in others)
    return (
        candidate.in_flight,
        not frees_device,
        left_mb,
        -candidate.started_at,
        candidate.replica_id,
    )


def placement_violations(placement: Placement, devices: Sequence[Device]) -> tuple[str, ...]:
    """What breaks the invariants (over-commit, exclusivity, pools, unknown devices, twice)."""
    by_id = {device.id: device for device in devices}
    problems: list[str] = []
    ids = [p.ask.replica_id for p in placement.placed]
    problems += [f"{rid} is placed twice" for rid, n in Counter(ids).items() if n > 1]
    for p in placement.placed:
        device = by_id.get(p.device_id)
        if device is None:
            problems.append(f"{p.ask.replica_id} is on unknown device {p.device_id}")
        elif device.pool is not None and device.pool != p.ask.pool:
            problems.append(f"{p.ask.replica_id} (pool {p.ask.pool}) is on {device.id}")
    for device in devices:
        asks = placement.on_device(device.id)
        if any(a.exclusive for a in asks) and len(asks) > 1:
            problems.append(f"{device.id} shares an exclusive replica")
        if sum(a.memory_mb for a in asks) > device.memory_mb:
            problems.append(f"{device.id} is over-committed")
    return tuple(problems)
