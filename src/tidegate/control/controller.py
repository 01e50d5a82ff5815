"""The controller: per autoscaled model, observe demand, ask the core, make it so.

Every ``interval_s`` (and at once when a request arrives for a model with no ready replica)
the controller builds ``ScaleInputs`` from the gateway's own queue and in-flight counts,
calls ``core.autoscale.decide_scale``, records the decision, and executes it:

- up: ``core.placement.place`` picks a device for each new replica (declared inventory), or
  the pool's devices take turns; the orchestrator starts it on that device (``spec.device``
  is the placed id, which its logs and its replica's detail name; the worker's own
  ``--device`` is that id as a local device: ``cuda:N``, else cpu); the gateway routes to it
  once its warm-up passed (READY);
- down: ``core.placement.pick_victims`` orders the candidates (fewest in flight, most memory
  freed, newest); each victim is drained: DRAINING (no new requests), its worker hands back
  what it has not started (the gateway requeues those), in-flight requests finish within
  the model's ``drain_timeout_s``, then the orchestrator stops it.

Autoscaling adds and removes replicas in the model's *scaled pool*: the last pool it lists
(by convention the widest, e.g. ``shared``). Replicas in its other pools stay as configured
and count towards its replicas. Static models are left alone.

The decisions and their explanation are kept per model (``describe``), for
``GET /admin/autoscaler`` and ``tidegate explain``; each change counts in
``tidegate_scale_events_total`` and the last desired count is ``tidegate_desired_replicas``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

import httpx

from tidegate.clock import SYSTEM_CLOCK, Clock
from tidegate.config import TidegateConfig
from tidegate.config.values import ModelSpec
from tidegate.control.fleet import ConfiguredFleet
from tidegate.control.inventory import memory_fraction, nvml_devices
from tidegate.control.local import resolve_devices
from tidegate.control.orchestrator import Orchestrator, ReplicaSpec
from tidegate.control.ray_resources import PlacementRefused
from tidegate.core.autoscale import (
    AutoscaleConfig,
    DemandSample,
    Direction,
    ScaleDecision,
    ScaleInputs,
    ScaleState,
    decide_scale,
)
from tidegate.core.forecast import SeasonalHistory, forecast_floor, record_hour
from tidegate.core.placement import (
    DefragPlan,
    Device,
    Move,
    Placed,
    Placement,
    ReplicaAsk,
    VictimCandidate,
    pick_victims,
    place,
    plan_defrag,
)
from tidegate.gateway.replicas import Replica, ReplicaState
from tidegate.gateway.state import Gateway

log = logging.getLogger("tidegate.controller")

DEFRAG_EVERY_S = 300.0  # how often the off-peak window is checked for a useful plan
KEPT_DECISIONS = 200  # per model, for /admin/autoscaler and explain
KEPT_SCALE_EVENTS = 500  # all models, for the dashboard's time axis
STOP_TIMEOUT_S = 10.0  # SIGTERM to SIGKILL, once drained
_ACTIVE = (ReplicaState.STARTING, ReplicaState.WARMING, ReplicaState.READY, ReplicaState.FAILED)


@dataclass
class _Model:
    """The controller's state for one autoscaled model (owned by its loop task)."""

    spec: ModelSpec
    config: AutoscaleConfig
    pool: str  # the scaled pool
    state: ScaleState = field(default_factory=ScaleState)
    decisions: deque[ScaleDecision] = field(default_factory=lambda: deque(maxlen=KEPT_DECISIONS))
    started_at: dict[str, float] = field(default_factory=dict)  # replica id -> launch
    draining: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    demand: asyncio.Event = field(default_factory=asyncio.Event)
    refused: str = ""  # why the last scale-up could not place everything
    history: SeasonalHistory = field(default_factory=SeasonalHistory)  # the forecast's memory
    ids: itertools.count[int] = field(default_factory=itertools.count)


class Controller:
    """Owns replica counts of autoscaled models. ``start()`` / ``stop()`` like an orchestrator."""

    def __init__(
        self,
        gateway: Gateway,
        orchestrator: Orchestrator,
        config: TidegateConfig,
        *,
        clock: Clock = SYSTEM_CLOCK,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.gateway = gateway
        self.orchestrator = orchestrator
        self.config = config
        self.clock = clock
        self.wall = wall
        self.replicas: list[Replica] = []  # orchestrator-style attribute: none of its own
        self.models: dict[str, _Model] = {}
        self.placement = Placement()
        # The inventory placement works on: none when Ray places the replicas on its cluster
        # (this host's GPUs are not where they run, and a declared list is not Ray's view).
        self.devices: tuple[Device, ...] = (
            () if config.controller.orchestrator == "ray" else config.devices or nvml_devices()
        )
        self._turn: dict[str, int] = {}
        # (model, decision) of every change; decisions also holds the no-ops, which push
        # a change out of it within KEPT_DECISIONS intervals.
        self.scale_events: deque[tuple[str, ScaleDecision]] = deque(maxlen=KEPT_SCALE_EVENTS)
        self._tasks: list[asyncio.Task[None]] = []
        self._client: httpx.AsyncClient | None = None
        self._ready_waiters: dict[str, asyncio.Event] = {}
        self._moves = itertools.count()
        self._defrag_lock = asyncio.Lock()
        # Off-peak window of automatic defragmentation: local minutes [from, to); None: only
        # on request (POST /admin/defrag?force=true).
        self.defrag_window = config.controller.defrag_window
        self.defrag_timezone = config.controller.defrag_timezone
        self.defrag_move_timeout_s = config.controller.defrag_move_timeout_s
        self.defrag_every_s = DEFRAG_EVERY_S
        for spec in config.models.values():
            if spec.autoscaling is None or not spec.local:
                continue
            model = _Model(spec, spec.autoscaling, spec.pools[-1])
            existing = gateway.replicas[spec.name]
            model.ids = itertools.count(sum(r.pool == model.pool for r in existing))
            now = clock.now()
            for replica in existing:
                model.started_at[replica.id] = now
                replica.on_change = self._on_change
            self.models[spec.name] = model
            if model.config.scale_to_zero:
                gateway.dispatchers[spec.name].on_demand = model.demand.set
        for name, replicas in gateway.replicas.items():
            if config.model(name).local:
                self._adopt(config.model(name), replicas)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(5.0, connect=1.0))
        for name in self.models:
            self._tasks.append(asyncio.create_task(self._loop(name), name=f"autoscale-{name}"))
        if self.defrag_window is not None and self.devices:
            self._tasks.append(asyncio.create_task(self._defrag_loop(), name="defrag"))

    async def _defrag_loop(self) -> None:
        """Inside the off-peak window, free whole devices when a plan can."""
        while True:
            await asyncio.sleep(self.defrag_every_s)
            if not self.in_offpeak_window() or not self.plan_defrag().moves:
                continue
            try:
                log.info("defrag: %s", await self.run_defrag())
            except Exception:  # one failed round must not end defragmentation for good
                log.exception("defrag round failed")

    async def stop(self, timeout_s: float = 10) -> None:
        tasks = self._tasks + [t for m in self.models.values() for t in m.draining.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._client is not None:
            await self._client.aclose()

    async def _loop(self, name: str) -> None:
        model = self.models[name]
        await self._configured_replicas_started()
        while True:
            try:
                await self.tick(name)
            except Exception:  # a bug in one tick must not stop autoscaling for good
                log.exception("autoscaler %s: tick failed", name)
            model.demand.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(model.demand.wait(), model.config.interval_s)

    async def _configured_replicas_started(self) -> None:
        """Wait until a remote orchestrator's configured replicas were asked for. Local
        workers exist from the start; Ray's are placed one by one after it, and a decision
        made meanwhile would see none, start one more, and give it the id of one of them."""
        for starter in self.gateway.orchestrators:
            if isinstance(starter, ConfiguredFleet):
                await starter.started.wait()

    # ------------------------------------------------------------------ one decision
    def inputs(self, name: str) -> ScaleInputs:
        model = self.models[name]
        now = self.clock.now()
        dispatcher = self.gateway.dispatchers[name]
        active = self._active(name)
        wall = self.wall()
        local = wall.astimezone(ZoneInfo(model.config.timezone))
        forecast = (
            forecast_floor(model.history, wall.timestamp(), model.config.cold_start_s)
            if model.config.forecast
            else None
        )
        return ScaleInputs(
            replicas=len(active),
            ready_replicas=sum(r.ready for r in active),
            demand=DemandSample(
                now, len(dispatcher.queue), dispatcher.num_in_flight(), dispatcher.num_arrived
            ),
            local_time=(local.weekday(), local.hour * 60 + local.minute),
            forecast_replicas=forecast,
        )

    async def tick(self, name: str) -> ScaleDecision:
        """Decide once for ``name`` and start executing it; returns the decision."""
        model = self.models[name]
        now = self.clock.now()
        decision, model.state = decide_scale(self.inputs(name), model.state, model.config, now)
        model.decisions.append(decision)
        if decision.recommendation is not None:
            # What demand asked for, not the count floors gave: a forecast must not feed
            # on itself.
            model.history = record_hour(
                model.history, self.wall().timestamp(), decision.recommendation
            )
        metrics = self.gateway.metrics
        metrics.desired_replicas.labels(name).set(decision.desired_replicas)
        if decision.direction is Direction.NONE:
            return decision
        log.info("autoscaler %s: %s", name, decision.describe())
        self.scale_events.append((name, decision))
        metrics.scale_events.labels(name, decision.direction.value, decision.reason.value).inc()
        delta = decision.desired_replicas - decision.current_replicas
        if delta > 0:
            await self._scale_up(model, delta)
        else:
            self._scale_down(model, -delta)
        return decision

    def _active(self, name: str) -> list[Replica]:
        model = self.models[name]
        return [
            r
            for r in self.gateway.replicas[name]
            if r.state in _ACTIVE and r.id not in model.draining
        ]

    # ------------------------------------------------------------------ scale up
    async def _scale_up(self, model: _Model, count: int) -> None:
        name = model.spec.name
        ids = [self._new_id(model) for _ in range(count)]
        model.refused = ""
        devices = self._devices_for(model, ids)
        for replica_id, device in zip(ids, devices, strict=True):
            if device is None:
                continue
            settings = dataclasses.replace(
                self.config.worker_settings(name, _local_device(device)),
                memory_fraction=memory_fraction(
                    device, model.spec.memory_mb, model.spec.exclusive, self.devices
                ),
            )
            spec = ReplicaSpec(
                replica_id=replica_id,
                model=name,
                pool=model.pool,
                settings=settings,
                device=device,  # as placed: what the replica is listed on
                memory_mb=model.spec.memory_mb,
                exclusive=model.spec.exclusive,
                slots=model.spec.slots,
            )
            model.started_at[replica_id] = self.clock.now()
            try:
                replica = await self.orchestrator.start_replica(spec, self._on_change)
            except PlacementRefused as exc:  # the cluster has no room: say why, ask again later
                model.started_at.pop(replica_id, None)
                model.refused = str(exc)
                log.warning("autoscaler %s: %s not started: %s", name, replica_id, exc)
                continue
            self.gateway.add_replica(replica)
            log.info("autoscaler %s: started %s on %s", name, replica_id, device)

    def _new_id(self, model: _Model) -> str:
        """``model-pool-N`` with the lowest N never used (replicas may also come from config)."""
        taken = {r.id for r in self.gateway.replicas[model.spec.name]}
        while True:
            candidate = f"{model.spec.name}-{model.pool}-{next(model.ids)}"
            if candidate not in taken:
                return candidate

    def _devices_for(self, model: _Model, ids: list[str]) -> list[str | None]:
        """A device for each new replica: placement on the declared inventory, else turns."""
        if not self.devices:
            pool_devices = resolve_devices(self.config.pools[model.pool].devices)
            turn = self._turn.get(model.pool, 0)
            self._turn[model.pool] = turn + len(ids)
            return [pool_devices[(turn + i) % len(pool_devices)] for i in range(len(ids))]
        asks = [
            ReplicaAsk(rid, model.spec.name, model.pool, model.spec.memory_mb, model.spec.exclusive)
            for rid in ids
        ]
        strategy = self.config.pools[model.pool].placement
        result = place(asks, self.devices, self.placement, strategy)
        self.placement = result.placement
        placed = {p.ask.replica_id: p.device_id for p in result.new}
        if result.refused:
            model.refused = "; ".join(r.message for r in result.refused)
            log.warning("autoscaler %s: cannot place: %s", model.spec.name, model.refused)
        return [placed.get(rid) for rid in ids]

    def _adopt(self, spec: ModelSpec, replicas: list[Replica]) -> None:
        """Record where the configured replicas run, so placement counts their memory."""
        if not self.devices:
            return
        known = {device.id for device in self.devices}
        where = getattr(self.orchestrator, "device_of", None)
        placed: list[Placed] = []
        unplaced: list[ReplicaAsk] = []
        for r in replicas:
            ask = ReplicaAsk(r.id, r.model, r.pool, spec.memory_mb, spec.exclusive)
            device = where(r.id) if where is not None else None
            if device in known:
                placed.append(Placed(ask, device))
            else:
                unplaced.append(ask)
        current = Placement((*self.placement.placed, *placed))
        self.placement = place(unplaced, self.devices, current).placement

    def _on_change(self, replica: Replica) -> None:
        waiter = self._ready_waiters.get(replica.id)
        if waiter is not None and replica.state in (ReplicaState.READY, ReplicaState.FAILED):
            waiter.set()
        model = self.models.get(replica.model)
        if model is not None and replica.state is ReplicaState.READY:
            started = model.started_at.pop(replica.id, None)
            if started is not None:
                self.gateway.metrics.cold_start.labels(replica.model).observe(
                    self.clock.now() - started
                )
        self.gateway.on_replica_change(replica)

    # ------------------------------------------------------------------ scale down
    def _scale_down(self, model: _Model, count: int) -> None:
        candidates = [
            VictimCandidate(r.id, r.in_flight, model.started_at.get(r.id, 0.0))
            for r in self._active(model.spec.name)
            if r.pool == model.pool
        ]
        by_id = {r.id: r for r in self.gateway.replicas[model.spec.name]}
        for victim in pick_victims(candidates, count, self.placement):
            replica = by_id[victim]
            model.draining[victim] = asyncio.create_task(
                self._drain(model, replica), name=f"drain-{victim}"
            )

    async def _drain(self, model: _Model, replica: Replica) -> None:
        """No new requests; unstarted ones go back to the queue; in-flight ones finish."""
        started = self.clock.now()
        was_ready = replica.ready
        replica.set_state(ReplicaState.DRAINING, "scale-in")
        try:
            if was_ready:
                await self._hand_back(replica)
            idle = await self.gateway.wait_replica_idle(replica, model.spec.drain_timeout_s)
            if not idle:
                log.warning(
                    "drain %s: %d requests still in flight after %gs; stopping it",
                    replica.id,
                    replica.in_flight,
                    model.spec.drain_timeout_s,
                )
            await self.orchestrator.stop_replica(replica.id, STOP_TIMEOUT_S)
            self.gateway.remove_replica(replica)
            self.placement = self.placement.without({replica.id})
            self.gateway.metrics.drain.labels(replica.model).observe(self.clock.now() - started)
        finally:
            model.draining.pop(replica.id, None)

    async def _hand_back(self, replica: Replica) -> None:
        """Ask the worker to return what it has not started (the gateway requeues it)."""
        if replica.url is None or self._client is None:
            return
        try:
            await self._client.post(f"{replica.url}/admin/drain")
        except httpx.HTTPError as exc:  # it may be gone already: nothing to hand back
            log.warning("drain %s: %r", replica.id, exc)

    # ------------------------------------------------------------------ defragmentation
    def in_offpeak_window(self) -> bool:
        if self.defrag_window is None:
            return False
        local = self.wall().astimezone(ZoneInfo(self.defrag_timezone))
        minute = local.hour * 60 + local.minute
        start, end = self.defrag_window
        return start <= minute < end if start <= end else (minute >= start or minute < end)

    def plan_defrag(self) -> DefragPlan:
        """The fewest moves that free whole devices, from the live placement."""
        return plan_defrag(self.placement, self.devices)

    async def run_defrag(self, move_timeout_s: float | None = None) -> dict[str, Any]:
        """Execute the plan one move at a time, make-before-break; stop at the first failure.

        Each move starts a replica of the same model on the target device, waits for it to
        be READY (warm-up passed) for at most ``move_timeout_s``, then drains and stops the
        old one. A new replica that fails or is not ready in time is stopped again (rollback)
        and the old one keeps serving; the remaining moves are not tried.
        """
        if move_timeout_s is None:
            move_timeout_s = self.defrag_move_timeout_s
        async with self._defrag_lock:
            plan = self.plan_defrag()
            done: list[str] = []
            for move in plan.moves:
                error = await self._move(move, move_timeout_s)
                if error:
                    return {"moved": done, "rolled_back": move.replica_id, "error": error}
                done.append(move.replica_id)
            return {"moved": done, "freed": list(plan.freed_devices)}

    async def _move(self, move: Move, timeout_s: float) -> str:
        by_id = {r.id: r for rs in self.gateway.replicas.values() for r in rs}
        old = by_id.get(move.replica_id)
        if old is None or not old.ready:
            return f"{move.replica_id} is not a ready replica any more"
        spec = self.config.model(old.model)
        new_id = f"{old.model}-{old.pool}-m{next(self._moves)}"
        settings = dataclasses.replace(
            self.config.worker_settings(old.model, _local_device(move.to_device)),
            memory_fraction=memory_fraction(
                move.to_device, spec.memory_mb, spec.exclusive, self.devices
            ),
        )
        ready = self._ready_waiters[new_id] = asyncio.Event()
        try:
            new = await self.orchestrator.start_replica(
                ReplicaSpec(
                    new_id,
                    old.model,
                    old.pool,
                    settings,
                    move.to_device,
                    spec.memory_mb,
                    spec.exclusive,
                    spec.slots,
                ),
                self._on_change,
            )
            self.gateway.add_replica(new)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ready.wait(), timeout_s)
        finally:
            self._ready_waiters.pop(new_id, None)
        if not new.ready:
            error = f"{new_id} on {move.to_device} not ready within {timeout_s:g}s ({new.detail})"
            log.warning("defrag: %s: rolling back", error)
            await self.orchestrator.stop_replica(new_id, STOP_TIMEOUT_S)
            self.gateway.remove_replica(new)
            return error
        ask = ReplicaAsk(new_id, old.model, old.pool, spec.memory_mb, spec.exclusive)
        self.placement = Placement((*self.placement.placed, Placed(ask, move.to_device)))
        log.info("defrag: %s ready on %s; draining %s", new_id, move.to_device, old.id)
        model = self.models.get(old.model)
        if model is not None:
            model.started_at.pop(new_id, None)
            await self._drain(model, old)
        else:
            await self._drain_static(old, spec.drain_timeout_s)
        return ""

    async def _drain_static(self, replica: Replica, drain_timeout_s: float) -> None:
        replica.set_state(ReplicaState.DRAINING, "defrag")
        await self._hand_back(replica)
        await self.gateway.wait_replica_idle(replica, drain_timeout_s)
        await self.orchestrator.stop_replica(replica.id, STOP_TIMEOUT_S)
        self.gateway.remove_replica(replica)
        self.placement = self.placement.without({replica.id})

    # ------------------------------------------------------------------ views
    def describe(self) -> dict[str, Any]:
        """What ``GET /admin/autoscaler`` shows: per model, the state and recent decisions."""
        out: dict[str, Any] = {}
        for name, model in self.models.items():
            active = self._active(name)
            last = model.decisions[-1] if model.decisions else None
            out[name] = {
                "pool": model.pool,
                "replicas": len(active),
                "ready_replicas": sum(r.ready for r in active),
                "draining": sorted(model.draining),
                "desired_replicas": None if last is None else last.desired_replicas,
                "panicking": model.state.panicking,
                "refused": model.refused,
                "config": {
                    "min_replicas": model.config.min_replicas,
                    "max_replicas": model.config.max_replicas,
                    "target_per_replica": model.config.target_per_replica,
                    "interval_s": model.config.interval_s,
                    "scale_down_window_s": model.config.scale_down.stabilization_window_s,
                    "scale_to_zero": model.config.scale_to_zero,
                },
                "decisions": [_decision_view(d) for d in model.decisions],
            }
        return out

    def placed(self) -> tuple[Placed, ...]:
        return self.placement.placed


def _decision_view(decision: ScaleDecision) -> dict[str, Any]:
    return {
        "at": round(decision.decided_at, 3),
        "current": decision.current_replicas,
        "desired": decision.desired_replicas,
        "direction": decision.direction.value,
        "reason": decision.reason.value,
        "demand": decision.demand,
        "rate": None if decision.rate is None else round(decision.rate, 3),
        "ratio": None if decision.ratio is None else round(decision.ratio, 3),
        "ready": decision.inputs.ready_replicas,
        "floor": decision.floor,
        "ceiling": decision.ceiling,
        "clamps": [c.value for c in decision.clamps],
        "explain": decision.describe(),
    }


def _local_device(device: str) -> str:
    """A declared device id as a local worker's device: cuda:N stays, anything else is cpu."""
    return device if device.startswith("cuda:") or device == "cpu" else "cpu"
