"""The fleet-level simulator: every model of a fleet as a fluid, in time steps.

The request-level simulator (``sim.run``) follows each request; a two-week replay of a
10,000-GPU fleet is billions of them. This mode keeps, per model (a *group* of replicas of
one service model), only amounts: requests queued at the gateway per priority level,
sequences running on the ready replicas, sequences finishing on draining ones. Every
``step_s`` (default 5 s) it moves them with the arrival rate of the trace and the capacity
the service model gives the ready replicas. What it shares with the request-level simulator,
unchanged: the controller (``sim.autoscale.CoreAutoscaler``: the core's ``decide_scale``
with its state, windows, rate policies, panic, schedules and forecast, every
``interval_s``), the victims of a scale-down (``core.placement.pick_victims``), the replica
lifecycle and its timings (``sim.fleet.Lifecycle``: cold start, warm-up, drain timeout),
the config (queue size, holdback, batching), and, new here, the placement of every replica
on a GPU inventory (``sim.inventory``, through ``core.placement.place``).

The queueing model, and why. A group is many replicas of many slots each (tens to
thousands of sequences), so by the law of large numbers the running set follows its mean:
this is a fluid (mean-value) model, not M/G/c. Per replica, continuous batching at ``B``
running sequences makes ``mu(B) = B / (E[output] d(B) + B pf)`` completions/s, where ``d(B)``
is the service model's decode step and ``pf = E[prefill(prompt)]`` the mean prefill of one
request (each second of engine time is decode steps, each advancing ``B`` sequences by a
token, plus the prefill of the requests that joined); a sequence spends ``T(B) = B / mu(B)``
in the engine. Each step the ready replicas take what arrived, most urgent level first (fifo:
one order), up to the dispatch rate that keeps the running set within ``max_num_seqs`` per
replica; the running set relaxes towards ``dispatch rate x T(B)`` (Little's law) with time
constant ``T(B)``, exactly over the step for a constant rate, so a step longer than ``T`` is
still stable. What no slot takes queues at the gateway with the core's graded holdback
(``saturation = queued / max_size``) and shedding when full. The stochastic queue of
an M/G/c near saturation is left out on purpose: with c in the hundreds its waits are
sub-second within ``1/sqrt(c)`` of full load, while the misses that decide SLO attainment
come from capacity lagging demand (cold starts, scale-down windows), which the fluid keeps.

Latency. An arrival's time to first token is its gateway wait (the queue ahead of it over
the capacity left by more urgent levels) plus an engine part, from dispatch to first token.
The engine part is measured, not derived (``sim.fluid_ttft``): a few replicas of the
request-level worker behind the core's ``pick_replica`` at the rate ``mu(B)``, once per
group for each point ``B`` of a grid of running-set sizes (about sqrt(2) apart, linear
between) and each ready count up to the router's power-of-two threshold (one table above
it). Routing decides it where prefill is much of the engine's time: the least loaded
replica is rarely the one still prefilling the last arrival, so fewer requests share or
wait behind a prefill step than an even split of the arrivals gives (an analytic split was
7% low on 2,000-token prompts). SLO attainment per level is the share of its requests that
were admitted and whose time to first token is within the level's SLO (refused, shed and
failed ones are misses), as in the request-level report.

Lifecycle. A started replica is placed at once (refused when no node has room: counted, and
the controller asks again at its next tick), holds its GPUs from then on, and serves after
``cold_start_s + warmup_s``. A drained ready replica takes its share of the running
sequences with it; they finish over the time its longest one needs (the ``B/(B+1)``
quantile of the output length times the step), at most ``drain_timeout_s``, after which the
sequences still running fail (the share whose output outlasts the timeout), and it stops.
GPU-hours count from the start of each replica to its stop, as in the request-level
simulator.

Not modelled: aging, queue timeouts and predicted-wait deadlines (a level's backlog is
FIFO), prefix caching, routing across pools (a group is its model's scaled pool), request
retries, and embeddings (request-level batching): groups need an iteration-level (generation)
service model.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidegate.config import TidegateConfig
from tidegate.core.placement import Placement, VictimCandidate, pick_victims
from tidegate.core.queue import Admitted, QueueConfig, WaitQueue
from tidegate.core.request import Request
from tidegate.sim.autoscale import CoreAutoscaler
from tidegate.sim.control import CONTROLLERS, ControllerContext
from tidegate.sim.fleet import Lifecycle
from tidegate.sim.fluid_ttft import routed_replicas, routed_ttft
from tidegate.sim.inventory import GpuInventory, Inventory
from tidegate.sim.run import DEFAULT_SLO_TTFT_S, FALLBACK_SLO_TTFT_S
from tidegate.sim.service import ServiceModel
from tidegate.sim.synthetic import Lengths, LognormalLengths, Segment

DEFAULT_STEP_S = 5.0
DEFAULT_SAMPLE_S = 600.0  # replicas over time: one point per trace window
DRAIN_SAMPLES = 2000  # output lengths for the drain times
TTFT_SAMPLES = 4000  # engine-part TTFT samples per table (sim.fluid_ttft)
TTFT_WARMUP_SOJOURNS = 3.0  # a table's warm-up: times a sequence's time in the engine
# running sequences per replica at which the TTFT is measured (about sqrt(2) apart)
TTFT_GRID = (1, 2, 3, 4, 6, 8, 11, 16, 22, 32, 45, 64, 90, 128, 181, 256)
MEAN_SAMPLES = 100_000  # draws for the mean output and prefill
STARTING, READY, DRAINING = "starting", "ready", "draining"


@dataclass(frozen=True)
class FleetGroup:
    """One model of the fleet: its rate curve and what serves it."""

    model: str  # a model of the config (batching, queue, autoscaling)
    rates: Sequence[Segment]  # arrivals/s over time (sorted, not overlapping)
    service: ServiceModel  # iteration level (generation)
    lengths: Lengths = field(default_factory=LognormalLengths)
    memory_mb: float = 73_728.0  # per GPU of a replica (vLLM's 90% of an 80 GB GPU)
    replicas: int | None = None  # ready at time 0; None: the config's starting count
    gpus: int | None = None  # per replica; None: the service model's (tensor parallel)


@dataclass(frozen=True)
class FleetScenario:
    config: TidegateConfig
    groups: Sequence[FleetGroup]
    inventory: Inventory = field(default_factory=Inventory)
    controller: str = "tidegate"  # tidegate, hpa-default, static, static-peak
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    mix: tuple[tuple[str, float], ...] = ()  # priority shares; () = the config's default
    slo_ttft_s: Mapping[str, float] = field(default_factory=dict)
    step_s: float = DEFAULT_STEP_S
    sample_s: float = DEFAULT_SAMPLE_S
    start_wall_s: float = 0.0
    end_s: float | None = None  # None: the end of the longest rate curve
    seed: int = 0

    def slos(self) -> dict[str, float]:
        return {
            level: self.slo_ttft_s.get(level, DEFAULT_SLO_TTFT_S.get(level, FALLBACK_SLO_TTFT_S))
            for level in self.config.levels
        }


def holdback_saturation(queue: QueueConfig, level: int) -> float | None:
    """The saturation above which the core's ``WaitQueue.admit`` refuses ``level`` (graded
    holdback), found by asking it on an empty queue (bisection to 1e-9); None: never.

    The fluid moves amounts, not requests, so it cannot call ``admit`` per request; it
    asks the core where the rule's threshold lies instead of reading the config's."""
    probe = WaitQueue(queue)
    asked = 0

    def admits(saturation: float) -> bool:
        nonlocal asked
        asked += 1
        request = Request(f"probe-{asked}", "probe", level, 0.0)
        if isinstance(probe.admit(request, 0.0, saturation), Admitted):
            probe.cancel(request.id)
            return True
        return False

    if admits(1.0):
        return None
    if not admits(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while high - low > 1e-9:
        middle = (low + high) / 2
        if admits(middle):
            low = middle
        else:
            high = middle
    return low


class EngineCurve:
    """A group's engine from its service model and lengths (module docstring)."""

    def __init__(self, service: ServiceModel, lengths: Lengths, slots: int, seed: int) -> None:
        if service.step is None:
            raise ValueError(
                f"the fleet-level simulator needs a generation (iteration-level) service "
                f"model; {service.name!r} is {service.task}"
            )
        step = service.step
        rng = random.Random(f"{seed}:fluid-lengths")
        # the means from many draws (a heavy tail: 2,000 would leave a few % of noise),
        # the drain table from the first DRAIN_SAMPLES of them
        draws = [lengths.draw(rng) for _ in range(MEAN_SAMPLES)]
        self.slots = slots
        self.mean_output = sum(max(1, o) for _, o in draws) / len(draws)
        cost: dict[int, float] = {}
        total_prefill = 0.0
        for p, _ in draws:
            seconds = cost.get(p)
            if seconds is None:
                seconds = cost[p] = step.step_s(0, 1, p)
            total_prefill += seconds
        self.mean_prefill_s = total_prefill / len(draws)
        self.decode_s = [step.step_s(b, 0, 0) for b in range(slots + 1)]
        self.outputs = sorted(max(1, o) for _, o in draws[:DRAIN_SAMPLES])
        # mu(b): completions/s of one replica with b running (cumulative max: monotone)
        mu = [0.0]
        for b in range(1, slots + 1):
            rate = b / (self.mean_output * self.decode_s[b] + b * self.mean_prefill_s)
            mu.append(max(rate, mu[-1]))
        self.mu = mu
        self.capacity_per_s = mu[slots]
        # time in the engine at b running (Little: b / mu(b)); below one, that of one
        self._sojourn = [1.0 / mu[1]] + [b / mu[b] for b in range(1, slots + 1)]
        # the engine part of the TTFT is measured on the grid and interpolated between
        self._step = step
        self._lengths = lengths
        self._seed = seed
        self.grid = sorted({b for b in TTFT_GRID if b < slots} | {slots})
        self._ttft: dict[tuple[int, int], list[float]] = {}

    def ttft(self, running: int, ready: int) -> list[float]:
        """The engine part of the TTFT (dispatch to first token), sorted, at ``running``
        sequences per replica (a point of ``grid``) over ``ready`` ready replicas: measured
        by ``sim.fluid_ttft`` at the rate that keeps ``running`` in the engine."""
        key = (running, routed_replicas(ready))
        samples = self._ttft.get(key)
        if samples is None:
            samples = self._ttft[key] = routed_ttft(
                self._step,
                self._lengths,
                self.slots,
                key[1],
                self.mu[running],
                TTFT_WARMUP_SOJOURNS * self._sojourn[running],
                TTFT_SAMPLES,
                self._seed,
            )
        return samples

    def sojourn_s(self, running: float) -> float:
        """Mean seconds a sequence spends in the engine at ``running`` per replica."""
        if running <= 1.0:
            return self._sojourn[1]
        if running >= self.slots:
            return self._sojourn[-1]
        low = int(running)
        part = running - low
        return self._sojourn[low] * (1.0 - part) + self._sojourn[low + 1] * part

    def running(self, per_replica_per_s: float) -> float:
        """B with mu(B) = the rate (linear between integers); the slots when above mu(S)."""
        mu = self.mu
        if per_replica_per_s >= mu[-1]:
            return float(self.slots)
        if per_replica_per_s <= 0:
            return 0.0
        b = bisect.bisect_left(mu, per_replica_per_s)
        low, high = mu[b - 1], mu[b]
        return b - 1 + (per_replica_per_s - low) / (high - low) if high > low else float(b)

    def within(self, running: float, ready: int, wait_s: float, slo_s: float) -> float:
        """Share of requests whose TTFT (wait + engine part) is within ``slo_s``, at
        ``running`` sequences per replica over ``ready`` replicas (linear between the
        grid's points; below the first, that of the first)."""
        grid = self.grid
        b = min(float(self.slots), max(float(grid[0]), running))
        i = min(len(grid) - 2, bisect.bisect_right(grid, b) - 1) if len(grid) > 1 else 0
        low = self.ttft(grid[i], ready)
        share = bisect.bisect_right(low, slo_s - wait_s) / len(low)
        if len(grid) == 1 or b <= grid[i]:
            return share
        high = self.ttft(grid[i + 1], ready)
        part = (b - grid[i]) / (grid[i + 1] - grid[i])
        return share * (1.0 - part) + part * bisect.bisect_right(high, slo_s - wait_s) / len(high)

    def drain(self, running: float, timeout_s: float) -> tuple[float, float]:
        """(seconds until a draining replica's longest sequence ends, share that fails)."""
        d = self.decode_s[min(self.slots, max(1, round(running)))]
        q = running / (running + 1.0)
        longest = self.outputs[min(len(self.outputs) - 1, int(q * len(self.outputs)))] * d
        limit = int(timeout_s / d) if d > 0 else len(self.outputs)
        fails = 1.0 - bisect.bisect_right(self.outputs, limit) / len(self.outputs)
        return min(timeout_s, longest), fails


@dataclass(slots=True)
class FluidReplica:
    id: str
    state: str
    started_at: float
    stop_at: float = math.inf  # draining: when it stops


@dataclass
class LevelTally:
    arrivals: float = 0.0
    admitted: float = 0.0
    dispatched: float = 0.0
    refused_holdback: float = 0.0
    refused_full: float = 0.0
    unavailable: float = 0.0
    shed: float = 0.0
    failed: float = 0.0
    met: float = 0.0  # admitted with a TTFT within the SLO (minus shed and failed)
    max_wait_s: float = 0.0


class FluidGroup:
    """One group's state and its step (module docstring)."""

    def __init__(self, scenario: FleetScenario, group: FleetGroup, inventory: GpuInventory) -> None:
        config = scenario.config
        spec = config.model(group.model)
        if spec.task != group.service.task:
            raise ValueError(
                f"model {spec.name} does {spec.task} but the service model "
                f"{group.service.name!r} is for {group.service.task}"
            )
        self.model = spec.name
        self.pool = spec.pools[-1]
        self.inventory = inventory
        self.gpus = group.gpus or group.service.gpus_per_replica
        self.memory_mb = group.memory_mb
        self.lifecycle = scenario.lifecycle
        slots = spec.slots if spec.slots is not None else spec.batching.max_num_seqs
        self.engine = EngineCurve(group.service, group.lengths, slots, scenario.seed)
        self.rates = sorted(group.rates, key=lambda s: s.start_s)
        self._rate_index = 0
        # levels: the queue's (one under fifo), and each priority name's level
        queue = config.queue_config(spec.name)
        self.fifo = config.fifo
        self.max_size = float(queue.max_size)
        self.names = tuple(config.levels)
        shares = dict(scenario.mix) if scenario.mix else {config.default_priority: 1.0}
        self.shares = [shares.get(name, 0.0) for name in self.names]
        slos = scenario.slos()
        self.slo = [slos[name] for name in self.names]
        if self.fifo:
            self.holdback: list[float | None] = [None] * len(self.names)
            self.level_cap: list[int | None] = [None] * len(self.names)
        else:
            self.holdback = [holdback_saturation(queue, level) for level in range(len(self.names))]
            self.level_cap = [level.max_size for level in queue.levels]
        n = len(self.names)
        self.queued = [0.0] * n
        self.tally = [LevelTally() for _ in range(n)]
        self.running = 0.0  # sequences on ready replicas
        self.draining: list[tuple[float, float, float, int]] = []  # (end, amount, rate, level)
        self.drain_by_level = [0.0] * n  # amounts on draining replicas, per level
        self.run_by_level = [0.0] * n  # running amounts per level (shares of self.running)
        # replicas
        self.replicas: dict[str, FluidReplica] = {}
        self.ready = 0
        self.counted = 0  # starting + ready
        self._pending: list[tuple[float, int, str]] = []  # (ready at, seq, replica id)
        self._stopping: list[tuple[float, int, str]] = []  # draining: (stop at, seq, id)
        self._ids = 0
        self._seq = 0
        self.replica_seconds = 0.0  # of stopped replicas; live ones added by ``held_s``
        self.placement_refusals = 0
        self.started = 0
        self.stopped = 0
        self.series: list[tuple[float, int, int, float]] = []  # (t, counted, ready, queued)
        self.max_queued = 0.0
        self._within_now: dict[tuple[int, int], list[float]] = {}  # share within, no wait
        # the controller: the request-level simulator's, on counts
        start = group.replicas if group.replicas is not None else sum(spec.replicas.values())
        self.initial = start
        context = ControllerContext(
            config, spec.name, {self.pool: start}, scenario.start_wall_s, 1.0
        )
        name = scenario.controller
        if name not in CONTROLLERS:
            raise ValueError(f"unknown controller {name!r}; known: {', '.join(CONTROLLERS)}")
        controller = CONTROLLERS[name](context)
        self.autoscaler: CoreAutoscaler | None = None
        self.static_count: int | None = None
        if isinstance(controller, CoreAutoscaler):
            self.autoscaler = controller
            self.interval_s = controller.interval_s
        elif name in ("static", "static-peak"):
            self.static_count = sum(controller.replicas.values())  # type: ignore[attr-defined]
            self.interval_s = controller.interval_s
        else:
            raise ValueError(
                f"controller {name!r} is not available in the fleet-level simulator; use "
                "tidegate, hpa-default, static or static-peak"
            )
        self.next_tick = self.interval_s

    # ------------------------------------------------------------------ replicas
    def start(self, now: float, warm: bool) -> bool:
        replica_id = f"{self.model}-{self._ids}"
        self._ids += 1
        if not self.inventory.put(replica_id, self.model, self.pool, self.gpus, self.memory_mb):
            self.placement_refusals += 1
            return False
        self.started += 1
        replica = FluidReplica(replica_id, READY if warm else STARTING, now)
        self.replicas[replica_id] = replica
        self.counted += 1
        if warm:
            self.ready += 1
        else:
            ready_at = now + self.lifecycle.cold_start_s + self.lifecycle.warmup_s
            self._seq += 1
            heapq.heappush(self._pending, (ready_at, self._seq, replica_id))
        return True

    def _stop(self, replica: FluidReplica, now: float) -> None:
        del self.replicas[replica.id]
        self.inventory.release(replica.id)
        self.replica_seconds += now - replica.started_at
        self.stopped += 1

    def drain(self, count: int, now: float) -> None:
        """Drain ``count`` counted replicas chosen by ``core.placement.pick_victims``."""
        share = self.running / self.ready if self.ready else 0.0
        in_flight = round(share)
        # With no placement (the request-level simulator's ``drain_least_busy`` passes none
        # either) pick_victims orders by in flight, then newest: the ``count`` newest of
        # each in-flight value (ready ones carry the mean share, the others none) hold its
        # whole answer, and keep the call O(count) instead of O(replicas x count).
        newest: dict[int, list[VictimCandidate]] = {}
        for r in reversed(self.replicas.values()):  # insertion order: oldest first
            if r.state == DRAINING:
                continue
            value = in_flight if r.state == READY else 0
            kept = newest.setdefault(value, [])
            if len(kept) < count:
                kept.append(VictimCandidate(r.id, value, r.started_at))
        candidates = [c for kept in newest.values() for c in kept]
        for replica_id in pick_victims(candidates, count, Placement()):
            replica = self.replicas[replica_id]
            self.counted -= 1
            if replica.state == STARTING:
                self._stop(replica, now)
                continue
            self.ready -= 1
            replica.state = DRAINING
            if share <= 0:
                self._stop(replica, now)
                continue
            seconds, fails = self.engine.drain(share, self.lifecycle.drain_timeout_s)
            replica.stop_at = now + seconds
            self._seq += 1
            heapq.heappush(self._stopping, (replica.stop_at, self._seq, replica.id))
            total = self.running
            for level, amount in enumerate(self.run_by_level):
                part = share * amount / total if total > 0 else 0.0
                if part <= 0:
                    continue
                self.run_by_level[level] -= part
                self.drain_by_level[level] += part
                failed = part * fails
                self.tally[level].failed += failed
                # a failed request had been counted as met at admission when it was within
                self.tally[level].met -= failed * self._met_share(level)
                self.draining.append((replica.stop_at, part, part / max(seconds, 1e-9), level))
            self.running -= share

    def _met_share(self, level: int) -> float:
        t = self.tally[level]
        return t.met / t.admitted if t.admitted > 0 else 0.0

    def held_s(self, now: float) -> float:
        """Replica-seconds of every replica so far (live ones up to ``now``)."""
        live = sum(now - r.started_at for r in self.replicas.values())
        return self.replica_seconds + live

    # ------------------------------------------------------------------ the step
    def rate(self, now: float) -> float:
        rates = self.rates
        i = self._rate_index
        while i < len(rates) and rates[i].end_s <= now:
            i += 1
        self._rate_index = i
        if i < len(rates) and rates[i].start_s <= now:
            return rates[i].arrivals_per_s
        return 0.0

    def step(self, now: float, dt: float) -> None:
        self._lifecycle(now)
        if now + 1e-9 >= self.next_tick:
            self._control(now)
            self.next_tick += self.interval_s
        self._flow(now, dt)

    def _lifecycle(self, now: float) -> None:
        pending = self._pending
        while pending and pending[0][0] <= now + 1e-9:
            _, _, replica_id = heapq.heappop(pending)
            replica = self.replicas.get(replica_id)
            if replica is not None and replica.state == STARTING:
                replica.state = READY
                self.ready += 1
        stopping = self._stopping
        while stopping and stopping[0][0] <= now + 1e-9:
            stop_at, _, replica_id = heapq.heappop(stopping)
            replica = self.replicas.get(replica_id)
            if replica is not None and replica.state == DRAINING:
                self._stop(replica, stop_at)

    def finish(self, end: float) -> None:
        """The lifecycle up to the end of the run (drains that ended by then stop)."""
        self._lifecycle(end)

    def in_flight(self) -> float:
        return self.running + sum(self.drain_by_level)

    def _control(self, now: float) -> None:
        queued = sum(self.queued)
        if self.autoscaler is not None:
            arrived = sum(t.arrivals for t in self.tally)  # the fluid counter of arrivals
            delta = self.autoscaler.scale_delta(
                now, self.counted, self.ready, queued, self.in_flight(), arrived
            )
        else:
            assert self.static_count is not None
            delta = max(0, self.static_count - self.counted)
        if delta > 0:
            for _ in range(delta):
                if not self.start(now, warm=False):
                    break  # the inventory is full: the next tick asks again
        elif delta < 0:
            self.drain(-delta, now)

    def _flow(self, now: float, dt: float) -> None:
        tally = self.tally
        n = len(self.names)
        rate = self.rate(now)
        arrivals = [rate * share * dt for share in self.shares]
        for level in range(n):
            tally[level].arrivals += arrivals[level]
        if self.draining:
            self._finish_draining(now + dt, dt)
        ready = self.ready
        engine = self.engine
        if ready:
            # The running set relaxes towards (dispatch rate x time in the engine) with that
            # time as its constant: exact over the step for a constant dispatch rate and
            # time in the engine (taken at the step's start), stable for any step.
            sojourn_s = engine.sojourn_s(self.running / ready)
            decay = math.exp(-dt / sojourn_s)
            room = ready * engine.slots - self.running * decay
            most_per_s = max(0.0, room / (sojourn_s * (1.0 - decay)))
        else:
            sojourn_s, decay, most_per_s = 1.0, 0.0, 0.0
            self.running, self.run_by_level = 0.0, [0.0] * n
        capacity = most_per_s * dt
        queued = self.queued
        if ready and rate <= most_per_s and not any(queued):
            self._keep_up(arrivals, ready, dt, sojourn_s, decay)  # every arrival has a slot
            return
        if ready == 0 and (self.autoscaler is None or not self.autoscaler.scales_from_zero):
            for level in range(n):  # no replica ready: 503, as the gateway answers
                tally[level].unavailable += arrivals[level]
            arrivals = [0.0] * n
        before = list(queued)
        queued_before = sum(before)
        from_queue = [0.0] * n
        from_arrivals = [0.0] * n
        left = capacity
        if self.fifo:  # one order: the queue first (every level alike), then the arrivals
            for pool, taken in ((queued, from_queue), (arrivals, from_arrivals)):
                total = sum(pool)
                take = min(total, left)
                if total > 0 and take > 0:
                    for level in range(n):
                        part = pool[level] * take / total
                        pool[level] -= part
                        taken[level] += part
                left -= take
        else:  # most urgent first: a level's queue, then its arrivals
            for level in range(n):
                for pool, taken in ((queued, from_queue), (arrivals, from_arrivals)):
                    take = min(pool[level], left)
                    if take > 0:
                        pool[level] -= take
                        taken[level] += take
                        left -= take
        waiting = self._admit(arrivals)  # what no slot took, within the queue's limits
        served = [a + b for a, b in zip(from_queue, from_arrivals, strict=True)]
        queued_after = sum(queued)
        if ready:
            self._relax(served, dt, sojourn_s, decay)
        b = self.running / ready if ready else 0.0
        # this step's admitted arrivals see the queue ahead of them
        service_per_s = capacity / dt
        ahead_before = ahead_after = urgent_per_s = 0.0
        for level in range(n):
            t = tally[level]
            t.dispatched += served[level]
            admitted = from_arrivals[level] + waiting[level]
            t.admitted += admitted
            if self.fifo:
                ahead_before, ahead_after = queued_before, queued_after
            else:
                ahead_before += before[level]
                ahead_after += queued[level]
            if admitted > 0:
                wait = self._wait(ahead_before, ahead_after, service_per_s - urgent_per_s)
                t.max_wait_s = max(t.max_wait_s, wait)
                t.met += admitted * self.engine.within(b, ready, wait, self.slo[level])
            if not self.fifo:
                urgent_per_s += rate * self.shares[level]
        self.max_queued = max(self.max_queued, queued_after)

    def _relax(self, served: list[float], dt: float, sojourn_s: float, decay: float) -> None:
        """Each level's running amount after a step that dispatched ``served`` of it."""
        running = 0.0
        by_level = self.run_by_level
        for level, amount in enumerate(served):
            steady = amount / dt * sojourn_s
            by_level[level] = value = max(0.0, steady + (by_level[level] - steady) * decay)
            running += value
        self.running = running

    def _keep_up(
        self, arrivals: list[float], ready: int, dt: float, sojourn_s: float, decay: float
    ) -> None:
        """``_flow`` when the ready replicas take every arrival and nothing is queued."""
        self._relax(arrivals, dt, sojourn_s, decay)
        key = (round(self.running / ready), routed_replicas(ready))
        within = self._within_now.get(key)
        if within is None:
            within = [self.engine.within(key[0], ready, 0.0, slo) for slo in self.slo]
            self._within_now[key] = within
        for level, amount in enumerate(arrivals):
            t = self.tally[level]
            t.admitted += amount
            t.dispatched += amount
            t.met += amount * within[level]

    def _finish_draining(self, end: float, dt: float) -> None:
        kept = []
        for stop_at, amount, per_s, level in self.draining:
            done = min(amount, per_s * dt) if stop_at > end else amount
            self.drain_by_level[level] = max(0.0, self.drain_by_level[level] - done)
            if amount - done > 1e-12:
                kept.append((stop_at, amount - done, per_s, level))
        self.draining = kept

    @staticmethod
    def _wait(ahead_before: float, ahead_after: float, per_s: float) -> float:
        ahead = (ahead_before + ahead_after) / 2
        if ahead <= 1e-9:
            return 0.0
        return ahead / per_s if per_s > 1e-9 else math.inf

    def _admit(self, left: list[float]) -> list[float]:
        """Queue what no slot took, level by level, with the core's limits: graded holdback
        at ``saturation = queued / max_size``, a level's own bound, and when full, shedding
        the newest of a less urgent level present. Returns the amounts queued per level."""
        n = len(self.names)
        tally = self.tally
        queued = self.queued
        waiting = [0.0] * n
        total = sum(queued)
        for level in range(n):
            amount = left[level]
            if amount <= 0:
                continue
            holdback = None if self.fifo else self.holdback[level]
            cap = None if self.fifo else self.level_cap[level]
            room_full = self.max_size - total
            room_hold = math.inf if holdback is None else holdback * self.max_size - total
            room_cap = math.inf if cap is None else cap - queued[level]
            take = min(amount, max(0.0, min(room_full, room_hold, room_cap)))
            refused = amount - take
            if refused > 1e-12 and room_hold <= min(room_full, room_cap):
                tally[level].refused_holdback += refused
                refused = 0.0
            elif refused > 1e-12 and room_full <= room_cap and not self.fifo:
                for lower in range(n - 1, level, -1):  # the newest of a less urgent level
                    shed = min(refused, queued[lower])
                    if shed > 0:
                        queued[lower] -= shed
                        tally[lower].shed += shed
                        tally[lower].met -= shed * self._met_share(lower)
                        total -= shed
                        take += shed
                        refused -= shed
            if refused > 1e-12:
                tally[level].refused_full += refused
            queued[level] += take
            total += take
            waiting[level] = take
        return waiting

    # ------------------------------------------------------------------ results
    def summary(self, end: float) -> dict[str, Any]:
        levels = {}
        for level, (name, t) in enumerate(zip(self.names, self.tally, strict=True)):
            in_flight = self.run_by_level[level] + self.drain_by_level[level]
            completed = t.dispatched - t.failed - in_flight
            levels[name] = {
                "requests": t.arrivals,
                "completed": completed,
                "refused_holdback": t.refused_holdback,
                "refused_full": t.refused_full,
                "unavailable": t.unavailable,
                "shed": t.shed,
                "failed": t.failed,
                "queued": self.queued[level],
                "in_flight": in_flight,
                "slo_attainment": (t.met / t.arrivals) if t.arrivals > 0 else None,
                "max_wait_s": t.max_wait_s,
            }
        replica_s = self.held_s(end)
        counts = [c for _, c, _, _ in self.series]
        return {
            "model": self.model,
            "service": self.engine_description(),
            "gpus_per_replica": self.gpus,
            "replica_hours": replica_s / 3600.0,
            "gpu_hours": replica_s * self.gpus / 3600.0,
            "peak_replicas": max(counts, default=self.counted),
            "mean_replicas": (sum(counts) / len(counts)) if counts else float(self.counted),
            "replicas_started": self.started,
            "placement_refusals": self.placement_refusals,
            "max_queued": self.max_queued,
            "levels": levels,
            "replicas_over_time": [[t, c, r] for t, c, r, _ in self.series],
        }

    def engine_description(self) -> dict[str, float]:
        return {
            "capacity_per_replica_per_s": self.engine.capacity_per_s,
            "mean_output_tokens": self.engine.mean_output,
            "mean_prefill_s": self.engine.mean_prefill_s,
        }


@dataclass
class FleetResult:
    scenario: FleetScenario
    groups: list[FluidGroup]
    end_s: float
    steps: int
    wall_s: float
    gpus_in_use: list[tuple[float, int]]  # (t, GPUs holding a replica), every sample_s
    inventory: GpuInventory

    @property
    def gpu_hours(self) -> float:
        return sum(g.held_s(self.end_s) * g.gpus for g in self.groups) / 3600.0

    def attainment(self) -> dict[str, float | None]:
        """SLO attainment per level over every group (met / requests)."""
        out: dict[str, float | None] = {}
        for level, name in enumerate(self.groups[0].names if self.groups else ()):
            requests = sum(g.tally[level].arrivals for g in self.groups)
            met = sum(g.tally[level].met for g in self.groups)
            out[name] = met / requests if requests > 0 else None
        return out

    def report(self) -> dict[str, Any]:
        inventory = self.scenario.inventory
        return {
            "mode": "fleet",
            "controller": self.scenario.controller,
            "step_s": self.scenario.step_s,
            "end_s": self.end_s,
            "steps": self.steps,
            "inventory": {
                "nodes": inventory.nodes,
                "gpus_per_node": inventory.gpus_per_node,
                "gpu_memory_mb": inventory.gpu_memory_mb,
                "gpus": inventory.gpus,
            },
            "gpu_hours": self.gpu_hours,
            "peak_gpus_in_use": max((used for _, used in self.gpus_in_use), default=0),
            "placement_refusals": self.inventory.refusals,
            "slo_attainment": self.attainment(),
            "slo_ttft_s": self.scenario.slos(),
            "groups": {g.model: g.summary(self.end_s) for g in self.groups},
            "gpus_in_use": [[t, used] for t, used in self.gpus_in_use],
        }


class FleetSimulation:
    """Every group of a ``FleetScenario`` on one clock, in steps of ``step_s``."""

    def __init__(self, scenario: FleetScenario) -> None:
        if scenario.step_s <= 0:
            raise ValueError(f"step_s must be > 0, got {scenario.step_s}")
        if not scenario.groups:
            raise ValueError("a fleet needs at least one group")
        models = [g.model for g in scenario.groups]
        if len(set(models)) != len(models):
            raise ValueError(f"each model may have one group only, got {', '.join(models)}")
        self.scenario = scenario
        self.inventory = GpuInventory(scenario.inventory)
        self.groups = [FluidGroup(scenario, g, self.inventory) for g in scenario.groups]

    def run(self) -> FleetResult:
        scenario = self.scenario
        started = time.perf_counter()
        for group in self.groups:
            for _ in range(group.initial):
                group.start(0.0, warm=True)
        end = scenario.end_s
        if end is None:
            end = max((s.end_s for g in scenario.groups for s in g.rates), default=0.0)
        dt = scenario.step_s
        steps = max(1, math.ceil(end / dt - 1e-9))
        sample_every = max(1, round(scenario.sample_s / dt))
        gpus_in_use: list[tuple[float, int]] = []
        for index in range(steps):
            now = index * dt
            if index % sample_every == 0:
                for group in self.groups:
                    group.series.append((now, group.counted, group.ready, sum(group.queued)))
                gpus_in_use.append((now, self.inventory.used_gpus))
            for group in self.groups:
                group.step(now, dt)
        end_at = steps * dt
        for group in self.groups:
            group.finish(end_at)
        return FleetResult(
            scenario,
            self.groups,
            end_at,
            steps,
            time.perf_counter() - started,
            gpus_in_use,
            self.inventory,
        )
