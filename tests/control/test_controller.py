"""The controller against a fake orchestrator (the process boundary) and a manual clock.

The gateway, its dispatcher and the core policies are real; only starting and stopping a
worker process is faked, so scale decisions, placement, drain and scale-from-zero can be
checked step by step.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from tidegate.config import parse_config
from tidegate.control.controller import Controller
from tidegate.control.orchestrator import ReplicaSpec
from tidegate.core.request import Request
from tidegate.gateway.replicas import Replica, ReplicaState
from tidegate.gateway.state import Gateway


class ManualClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


class FakeOrchestrator:
    """Starts replicas that stay STARTING until ``ready()``; records what it was asked."""

    def __init__(self) -> None:
        self.started: list[ReplicaSpec] = []
        self.stopped: list[str] = []
        self.replicas: dict[str, Replica] = {}

    async def start_replica(
        self, spec: ReplicaSpec, on_change: Callable[[Replica], None]
    ) -> Replica:
        self.started.append(spec)
        replica = Replica(spec.replica_id, spec.model, spec.pool, "local", on_change=on_change)
        replica.url = f"http://fake/{spec.replica_id}"
        self.replicas[spec.replica_id] = replica
        return replica

    async def stop_replica(self, replica_id: str, timeout_s: float) -> None:
        self.stopped.append(replica_id)
        self.replicas[replica_id].set_state(ReplicaState.STOPPED, "stopped")

    def list_replicas(self) -> list[Replica]:
        return list(self.replicas.values())

    def endpoint(self, replica_id: str) -> str | None:
        return self.replicas[replica_id].url

    async def close(self) -> None:
        pass

    def ready(self, *ids: str) -> None:
        for rid in ids:
            self.replicas[rid].set_state(ReplicaState.READY, "ready")


def _config(**autoscaling: Any) -> Any:
    scaling = {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_per_replica": 2,
        "interval_s": 1,
        "stable_window_s": 0,
        **autoscaling,
    }
    return parse_config(
        {
            "devices": [
                {"id": "gpu-a", "memory_mb": 1000, "node": "n1"},
                {"id": "gpu-b", "memory_mb": 1000, "node": "n2"},
            ],
            "pools": {
                "shared": {"priorities": ["high", "medium", "low"], "devices": ["gpu-a", "gpu-b"]}
            },
            "models": [
                {
                    "name": "m",
                    "task": "embeddings",
                    "engine": "simulated",
                    "pools": ["shared"],
                    "replicas": 0 if scaling["min_replicas"] == 0 else 1,
                    "slots": 1,
                    "memory_mb": 400,
                    "drain_timeout_s": 5,
                    "autoscaling": scaling,
                }
            ],
        },
        "<test>",
    )


def _setup(**autoscaling: Any) -> tuple[Gateway, Controller, FakeOrchestrator, ManualClock]:
    config = _config(**autoscaling)
    gateway = Gateway(config, replicas={})
    orchestrator = FakeOrchestrator()
    clock = ManualClock()
    controller = Controller(
        gateway, orchestrator, config, clock=clock, wall=lambda: datetime(2026, 11, 30, tzinfo=UTC)
    )
    return gateway, controller, orchestrator, clock


def _request(rid: str, at: float) -> Request:
    return Request(rid, "m", 1, at)


@pytest.mark.asyncio
async def test_demand_scales_up_onto_declared_devices_and_spreads_the_model() -> None:
    gateway, controller, orchestrator, clock = _setup()
    first = (await controller.tick("m")).desired_replicas
    assert first == 1  # nothing there yet: the floor
    orchestrator.ready("m-shared-0")
    dispatcher = gateway.dispatchers["m"]
    dispatcher.clock = clock
    for i in range(6):  # 1 dispatched to the one slot, 5 queued: demand 6 = 3x target
        dispatcher.submit(_request(f"r{i}", clock.t))
    clock.t += 1
    decision = await controller.tick("m")
    assert (decision.current_replicas, decision.desired_replicas) == (1, 3)
    assert decision.reason == "target"
    assert controller.placement.used_mb("gpu-a") + controller.placement.used_mb("gpu-b") == 1200
    placed = [controller.placement.device_of(spec.replica_id) for spec in orchestrator.started]
    assert set(placed) == {"gpu-a", "gpu-b"}
    # Each replica starts on the device placement chose, and is named so (not "cpu"); its
    # worker runs on the cpu, as a declared id is no local cuda:N.
    assert [spec.device for spec in orchestrator.started] == placed
    assert {spec.settings.device for spec in orchestrator.started} == {"cpu"}


@pytest.mark.asyncio
async def test_a_rate_target_sizes_on_what_the_dispatcher_counted_arriving() -> None:
    # 2 arrivals/s per replica; 4 submitted in the 1 s between two decisions: 2 replicas,
    # where the queue (3 waiting, 1 in flight) on a target of 1 would have asked for 4.
    gateway, controller, orchestrator, clock = _setup(
        target_rate_per_replica=2, target_per_replica=1
    )
    await controller.tick("m")
    orchestrator.ready("m-shared-0")
    dispatcher = gateway.dispatchers["m"]
    dispatcher.clock = clock
    before = dispatcher.num_arrived
    for i in range(4):
        dispatcher.submit(_request(f"r{i}", clock.t))
    assert dispatcher.num_arrived == before + 4
    clock.t += 1
    decision = await controller.tick("m")
    assert decision.rate == pytest.approx(4.0)
    assert (decision.current_replicas, decision.desired_replicas) == (1, 2)
    assert "arrivals/s" in decision.describe()


@pytest.mark.asyncio
async def test_a_replica_that_does_not_fit_is_refused_and_said_so() -> None:
    gateway, controller, orchestrator, clock = _setup(max_replicas=8)
    await controller.tick("m")
    orchestrator.ready("m-shared-0")
    dispatcher = gateway.dispatchers["m"]
    dispatcher.clock = clock
    clock.t += 16  # past the scale-up period of the first replica's start
    for i in range(40):
        dispatcher.submit(_request(f"r{i}", clock.t))
    await controller.tick("m")
    # 2 devices x 1000 MB hold 4 replicas of 400 MB: 4 more were asked (+4), 3 fit.
    assert len(orchestrator.started) == 4
    refused = controller.describe()["m"]["refused"]
    assert "m-shared-4" in refused
    assert "400 MB free" in refused


@pytest.mark.asyncio
async def test_scale_in_drains_the_idlest_newest_replica_after_the_window() -> None:
    gateway, controller, orchestrator, clock = _setup(
        scale_down={
            "stabilization_window_s": 10,
            "select_policy": "max",
            "policies": [{"type": "pods", "value": 1, "period_s": 1}],
        }
    )
    await controller.tick("m")
    dispatcher = gateway.dispatchers["m"]
    dispatcher.clock = clock
    orchestrator.ready("m-shared-0")
    for i in range(4):
        dispatcher.submit(_request(f"r{i}", clock.t))
    clock.t += 1
    await controller.tick("m")  # demand 4: 2 replicas
    orchestrator.ready("m-shared-1")
    busy = next(r for r in gateway.replicas["m"] if r.in_flight)
    # The queue drains: only what is in flight remains.
    for _ in range(len(dispatcher.queue)):
        dispatcher.queue.pop(1, clock.t)
    clock.t += 5
    assert (await controller.tick("m")).desired_replicas == 2  # inside the window: hold
    clock.t += 6
    decision = await controller.tick("m")
    assert decision.desired_replicas == 1
    await asyncio.gather(*controller.models["m"].draining.values())
    victim = orchestrator.stopped[0]
    assert victim != busy.id  # the replica with a request in flight stays
    assert [r.id for r in gateway.replicas["m"]] == [busy.id]


@pytest.mark.asyncio
async def test_scale_from_zero_queues_requests_and_starts_a_replica_at_once() -> None:
    gateway, controller, orchestrator, clock = _setup(min_replicas=0, scale_to_zero=True)
    dispatcher = gateway.dispatchers["m"]
    dispatcher.clock = clock
    assert gateway.replicas["m"] == []
    ticket = dispatcher.submit(_request("r0", clock.t))  # no 503: it waits for a cold start
    assert len(dispatcher.queue) == 1
    assert controller.models["m"].demand.is_set()  # the loop wakes at once, not next period
    decision = await controller.tick("m")
    assert decision.desired_replicas == 1
    assert decision.reason == "cold_start_from_zero"
    (spec,) = orchestrator.started
    orchestrator.ready(spec.replica_id)
    dispatcher._dispatch(clock.t)
    assert ticket.assigned.result().id == spec.replica_id


def _fragmented() -> tuple[Gateway, Controller, FakeOrchestrator]:
    """Two static replicas of 300 and 200 MB, one on each 1000 MB device."""
    config = parse_config(
        {
            "devices": [
                {"id": "gpu-a", "memory_mb": 1000, "node": "n1"},
                {"id": "gpu-b", "memory_mb": 1000, "node": "n1"},
            ],
            "pools": {
                "shared": {"priorities": ["high", "medium", "low"], "devices": ["gpu-a", "gpu-b"]}
            },
            "models": [
                {
                    "name": name,
                    "task": "embeddings",
                    "engine": "simulated",
                    "pools": ["shared"],
                    "memory_mb": mb,
                    "slots": 1,
                    "drain_timeout_s": 1,
                }
                for name, mb in (("one", 300), ("two", 200))
            ],
        },
        "<test>",
    )
    gateway = Gateway(config, replicas={})
    orchestrator = FakeOrchestrator()
    where = {"one-shared-0": "gpu-a", "two-shared-0": "gpu-b"}
    orchestrator.device_of = where.get  # type: ignore[attr-defined]
    for rid in where:
        replica = Replica(rid, rid.split("-")[0], "shared", "local", state=ReplicaState.READY)
        orchestrator.replicas[rid] = replica
        gateway.replicas[replica.model].append(replica)
    controller = Controller(gateway, orchestrator, config)
    return gateway, controller, orchestrator


@pytest.mark.asyncio
async def test_defrag_moves_make_before_break_and_frees_a_device() -> None:
    gateway, controller, orchestrator = _fragmented()
    plan = controller.plan_defrag()
    (move,) = plan.moves
    assert len(plan.freed_devices) == 1

    started = asyncio.Event()
    launch = orchestrator.start_replica

    async def start_and_tell(spec: ReplicaSpec, on_change: Callable[[Replica], None]) -> Replica:
        replica = await launch(spec, on_change)
        started.set()
        return replica

    orchestrator.start_replica = start_and_tell  # type: ignore[method-assign]

    async def warm_up_the_new_one() -> None:
        await started.wait()
        # The old replica still serves while the new one warms up: make before break.
        assert gateway.replicas[orchestrator.started[0].model][0].ready
        orchestrator.ready(orchestrator.started[0].replica_id)

    warming = asyncio.create_task(warm_up_the_new_one())
    result = await controller.run_defrag(move_timeout_s=5)
    await warming
    assert result["moved"] == [move.replica_id]
    (new,) = orchestrator.started
    assert (new.device, new.settings.device) == (move.to_device, "cpu")  # named as placed
    assert orchestrator.stopped == [move.replica_id]
    assert controller.placement.used_devices == {move.to_device}
    model = orchestrator.started[0].model
    assert [r.id for r in gateway.replicas[model]] == [orchestrator.started[0].replica_id]


@pytest.mark.asyncio
async def test_defrag_rolls_back_a_move_whose_replica_never_gets_ready() -> None:
    gateway, controller, orchestrator = _fragmented()
    (move,) = controller.plan_defrag().moves
    result = await controller.run_defrag(move_timeout_s=0.05)
    assert result["rolled_back"] == move.replica_id
    assert "not ready within" in result["error"]
    (new,) = orchestrator.started
    assert orchestrator.stopped == [new.replica_id]  # the new one, never the old one
    assert all(r.ready for rs in gateway.replicas.values() for r in rs)
    assert controller.placement.used_devices == {"gpu-a", "gpu-b"}


@pytest.mark.parametrize(
    ("hour", "inside"), [(22, False), (23, True), (0, True), (4, True), (5, False), (12, False)]
)
def test_the_off_peak_window_may_cross_midnight(hour: int, inside: bool) -> None:
    _, controller, _ = _fragmented()
    controller.defrag_window = (23 * 60, 5 * 60)
    controller.wall = lambda: datetime(2026, 11, 30, hour, 30, tzinfo=UTC)
    assert controller.in_offpeak_window() is inside


def _ray_gateway(*, devices: list[dict[str, Any]] | None = None, **model: Any) -> Gateway:
    """``build_gateway`` of a Ray configuration: nothing runs, no Ray contacted yet."""
    from tidegate.gateway.serve import build_gateway

    config = parse_config(
        {
            "controller": {"orchestrator": "ray", "ray_address": "127.0.0.1:6379"},
            "devices": devices or [],
            "models": [
                {
                    "name": "m",
                    "task": "embeddings",
                    "engine": "simulated",
                    "replicas": 2,
                    "autoscaling": {"max_replicas": 4, "target_per_replica": 8},
                    **model,
                }
            ],
        },
        "<test>",
    )
    gateway, _ = build_gateway(config)
    return gateway


def test_orchestrator_ray_in_the_config_runs_replicas_as_ray_actors() -> None:
    from tidegate.control.fleet import ConfiguredFleet
    from tidegate.control.ray import RayWorkers

    gateway = _ray_gateway()
    assert isinstance(gateway.controller, Controller)
    assert isinstance(gateway.controller.orchestrator, RayWorkers)
    assert gateway.controller.orchestrator.address == "127.0.0.1:6379"
    fleet = next(o for o in gateway.orchestrators if isinstance(o, ConfiguredFleet))
    assert [s.replica_id for s in fleet.specs()] == ["m-shared-0", "m-shared-1"]
    assert gateway.replicas["m"] == []  # nothing runs before start(): no Ray contacted


def test_with_ray_and_a_fixed_count_the_replica_info_says_where_each_runs() -> None:
    """No autoscaling, so no controller: the fleet that started the replicas says where its
    orchestrator put them (``tidegate_replica_info``'s device label was empty)."""
    from tidegate.control.fleet import ConfiguredFleet
    from tidegate.gateway.observe import device_of

    gateway = _ray_gateway(autoscaling=None)
    assert gateway.controller is None
    (fleet,) = [o for o in gateway.orchestrators if isinstance(o, ConfiguredFleet)]

    class Placed:
        def device_of(self, replica_id: str) -> str:
            return {"m-shared-0": "node-a"}[replica_id]  # KeyError: not one of mine

    fleet.orchestrator = Placed()  # type: ignore[assignment]
    on = Replica("m-shared-0", "m", "shared", "ray", "http://x", ReplicaState.READY, 4)
    other = Replica("elsewhere", "m", "shared", "ray", "http://y", ReplicaState.READY, 4)
    assert (device_of(gateway, on), device_of(gateway, other)) == ("node-a", "")


class PlacingOrchestrator(FakeOrchestrator):
    """Every placement waits for ``placed`` (a Ray cluster placing one replica after another)."""

    def __init__(self) -> None:
        super().__init__()
        self.placed = asyncio.Event()
        self.asked: list[str] = []  # replica ids, as start_replica is called

    async def start_replica(
        self, spec: ReplicaSpec, on_change: Callable[[Replica], None]
    ) -> Replica:
        self.asked.append(spec.replica_id)
        await self.placed.wait()
        return await super().start_replica(spec, on_change)


@pytest.mark.asyncio
async def test_with_ray_the_controller_decides_only_after_the_configured_replicas_started() -> None:
    from tidegate.control.fleet import ConfiguredFleet

    gateway = _ray_gateway()
    controller = gateway.controller
    assert controller is not None
    (fleet,) = [o for o in gateway.orchestrators if isinstance(o, ConfiguredFleet)]
    orchestrator = PlacingOrchestrator()
    controller.orchestrator = fleet.orchestrator = orchestrator
    await controller.start()
    starting = asyncio.create_task(fleet.start())
    try:
        for _ in range(20):  # every task runs until it waits: the fleet on its placement
            await asyncio.sleep(0)
        # Deciding now would see no replica and start one more: "m-shared-0" a second time.
        assert orchestrator.asked == ["m-shared-0"]
        assert controller.models["m"].decisions == deque()
        orchestrator.placed.set()
        await asyncio.wait_for(starting, 5)
        async with asyncio.timeout(5):
            while not controller.models["m"].decisions:  # noqa: ASYNC110 (its loop's first tick)
                await asyncio.sleep(0.01)
    finally:
        await controller.stop()
    assert controller.models["m"].decisions[0].current_replicas == 2
    assert orchestrator.asked == ["m-shared-0", "m-shared-1"]


@pytest.mark.asyncio
async def test_with_ray_placement_is_rays_not_the_local_or_declared_inventory() -> None:
    # One declared 1000 MB device would hold two 400 MB replicas; Ray's cluster may hold more.
    gateway = _ray_gateway(devices=[{"id": "gpu-a", "memory_mb": 1000}], memory_mb=400)
    controller = gateway.controller
    assert controller is not None
    assert controller.devices == ()
    orchestrator = FakeOrchestrator()
    controller.orchestrator = orchestrator
    for rid in ("m-shared-0", "m-shared-1"):  # the configured two, ready
        replica = await orchestrator.start_replica(
            ReplicaSpec(rid, "m", "shared", gateway.config.worker_settings("m")), lambda r: None
        )
        gateway.add_replica(replica)
        replica.set_state(ReplicaState.READY, "ready")
    orchestrator.started.clear()
    for i in range(24):  # demand 24 on 2 ready replicas: 1.5x the target of 8 each
        gateway.dispatchers["m"].submit(_request(f"r{i}", 0.0))
    decision = await controller.tick("m")
    assert (decision.current_replicas, decision.desired_replicas) == (2, 3)
    assert [spec.replica_id for spec in orchestrator.started] == ["m-shared-2"]
    assert controller.models["m"].refused == ""
