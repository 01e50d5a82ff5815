"""Replica lifecycle in the simulator, driven through the controller seam."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from tidegate.gateway.replicas import ReplicaState
from tidegate.sim import control
from tidegate.sim.control import (
    DrainReplica,
    FleetAction,
    FleetView,
    ReplicaStatus,
    StartReplica,
    StaticController,
)
from tidegate.sim.fleet import Lifecycle
from tidegate.sim.run import RunResult, Scenario, Simulation
from tidegate.sim.workload import Arrival, Listed

from .conftest import config_of, flat_batch_service, flat_step_service

S = ReplicaState


class Scripted:
    """A controller that plays fixed actions at given ticks and remembers what it saw."""

    def __init__(self, script: Mapping[float, Sequence[FleetAction]], interval_s: float = 0.5):
        self.script = script
        self.interval_s = interval_s
        self.views: list[FleetView] = []

    def decide(self, view: FleetView) -> Sequence[FleetAction]:
        self.views.append(view)
        return self.script.get(view.now, ())


def run_with(
    monkeypatch: pytest.MonkeyPatch,
    controller: Scripted,
    data: dict[str, Any],
    arrivals: list[Arrival],
    replicas: int,
    service: Any,
    lifecycle: Lifecycle,
) -> RunResult:
    factory: Callable[[Mapping[str, int]], Scripted] = lambda _: controller  # noqa: E731
    monkeypatch.setitem(control.CONTROLLERS, "scripted", factory)
    model = data["models"][0]["name"]
    scenario = Scenario(
        config_of(data),
        model,
        service,
        Listed("t", arrivals),
        {"shared": replicas},
        controller="scripted",
        lifecycle=lifecycle,
        keep_requests=True,
    )
    return Simulation(scenario).run()


def embeddings(slots: int, window_ms: float) -> dict[str, Any]:
    return {
        "models": [
            {
                "name": "emb",
                "task": "embeddings",
                "engine": "simulated",
                "slots": slots,
                # the fixed window for every level: these scripts batch high requests
                "batching": {
                    "max_batch_size": 2,
                    "batch_window_ms": window_ms,
                    "window_ms_by_priority": {},
                },
            }
        ]
    }


def test_a_started_replica_cold_starts_warms_up_then_takes_queued_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One replica (2 slots, batches of 2 taking 10 s) and 10 requests at 0: 8 wait in the
    # gateway. At the 0.5 s tick a replica is started: starting until 1.5 (cold start 1 s),
    # warming until 2.0, then ready: it takes 2 of the waiting requests at once.
    controller = Scripted({0.5: [StartReplica("shared")]})
    result = run_with(
        monkeypatch,
        controller,
        embeddings(slots=2, window_ms=1000),
        [Arrival(0.0, 10, 0, "high") for _ in range(10)],
        1,
        flat_batch_service(10_000.0),
        Lifecycle(cold_start_s=1.0, warmup_s=0.5),
    )
    states = {view.now: tuple(r.state for r in view.replicas) for view in controller.views}
    assert states[0.5] == (S.READY,)  # the view is taken before the action
    assert states[1.0] == (S.READY, S.STARTING)
    assert states[1.5] == (S.READY, S.WARMING)
    assert states[2.0] == (S.READY, S.READY)
    view = controller.views[0]
    assert (view.queued, view.in_flight, view.demand_per_ready) == (8, 2, 10.0)
    assert result.recorder.requests is not None
    waits = sorted(round(r.wait_s or 0.0, 9) for r in result.recorder.requests)
    assert waits[:4] == [0.0, 0.0, 2.0, 2.0]  # two at once, two when the new one is ready


def test_draining_hands_back_unstarted_work_lets_the_batch_finish_then_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two replicas (4 slots, batches of 2 taking 1 s); 8 requests at 0 alternate between
    # them (least loaded, ties by id): emb-0 gets r0 r2 r4 r6 and runs r0+r2 at once.
    # At 0.5 emb-0 drains: r4 and r6 go back to the gateway (emb-1 is full), r0+r2 finish
    # at 1.0 and emb-0 stops. emb-1 then runs r5+r7 (1-2 s) and takes r4, r6 (2-3 s).
    controller = Scripted({0.5: [DrainReplica("emb-0")]})
    result = run_with(
        monkeypatch,
        controller,
        embeddings(slots=4, window_ms=100),
        [Arrival(0.0, 10, 0, "high") for _ in range(8)],
        2,
        flat_batch_service(1000.0),
        Lifecycle(drain_timeout_s=30.0),
    )
    assert result.recorder.requests is not None
    records = {r.id: r for r in result.recorder.requests}
    assert {rid: r.outcome for rid, r in records.items()} == {str(i): "completed" for i in range(8)}
    assert (records["4"].wait_s, records["4"].e2e_s) == (1.0, 3.0)
    assert (records["6"].wait_s, records["6"].e2e_s) == (1.0, 3.0)
    assert records["5"].e2e_s == 2.0
    assert records["0"].e2e_s == 1.0
    assert result.end_at == 3.0
    assert result.replica_seconds == pytest.approx(1.0 + 3.0)  # emb-0 stopped at 1.0
    at_1 = next(view for view in controller.views if view.now == 1.0)
    assert [r.id for r in at_1.replicas] == ["emb-1"]


def test_a_drain_that_times_out_fails_what_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # A 1000-token sequence at 10 ms a step needs 10 s; its only replica drains at 0.5 with
    # a 2 s timeout: at 2.5 the sequence fails and the replica stops.
    controller = Scripted({0.5: [DrainReplica("gen-0")]})
    data = {"models": [{"name": "gen", "task": "generate", "engine": "simulated"}]}
    result = run_with(
        monkeypatch,
        controller,
        data,
        [Arrival(0.0, 10, 1000, "low")],
        1,
        flat_step_service(10.0),
        Lifecycle(drain_timeout_s=2.0),
    )
    assert result.recorder.requests is not None
    (record,) = result.recorder.requests
    assert record.outcome == "failed"
    assert result.replica_seconds == pytest.approx(2.5)


def test_with_no_ready_replica_requests_are_refused_as_unavailable() -> None:
    data = embeddings(slots=2, window_ms=0)
    scenario = Scenario(
        config_of(data),
        "emb",
        flat_batch_service(1.0),
        Listed("t", [Arrival(0.0, 1, 0, "high"), Arrival(1.0, 1, 0, "low")]),
        {"shared": 0},
    )
    result = Simulation(scenario).run()
    assert [dict(c.outcomes) for c in result.recorder.classes] == [
        {"unavailable": 1},
        {},
        {"unavailable": 1},
    ]


def test_the_static_controller_replaces_what_went_away() -> None:
    def status(rid: str, state: ReplicaState) -> ReplicaStatus:
        return ReplicaStatus(rid, "shared", state, 0, 4, 0.0)

    view = FleetView(
        10.0,
        0,
        (0, 0, 0),
        0,
        (status("a", S.READY), status("b", S.DRAINING), status("c", S.STARTING)),
    )
    assert StaticController({"shared": 3}).decide(view) == [StartReplica("shared")]
    assert StaticController({"shared": 2}).decide(view) == []
    assert view.num_ready == 1
    assert FleetView(0.0, 3, (3,), 0, (status("b", S.WARMING),)).demand_per_ready is None
