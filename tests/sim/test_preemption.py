"""Fair sharing's preemption in the simulator: with every sequence slot taken by a flood, a
light tenant's request pauses one of the flood's sequences instead of waiting for it to end;
the paused one resumes on its replica and completes with all its tokens, and every request
ends exactly once. Off, nothing changes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.config import TidegateConfig
from tidegate.sim.gateway import Ticket
from tidegate.sim.recorder import RequestRecord
from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.service import ServiceModel
from tidegate.sim.workers import BatchWorker, SequenceWorker
from tidegate.sim.workload import Arrival, Listed

from .conftest import config_of, flat_batch_service, flat_step_service
from .test_fairness_sim import _generation as fair_generation

STEP_S = 0.01  # flat_step_service(10.0): every engine step


def preempting(config: TidegateConfig, on: bool = True) -> TidegateConfig:
    """``config`` with fair sharing's preemption on (or as it is)."""
    tenancy = config.tenancy
    fairness = dataclasses.replace(tenancy.fairness, preemption=on)
    return dataclasses.replace(config, tenancy=dataclasses.replace(tenancy, fairness=fairness))


def _generation(max_num_seqs: int = 4, **batching: Any) -> dict[str, Any]:
    """test_fairness_sim's generation model with fair sharing, no slot reserve."""
    data = fair_generation(True)
    data["models"][0]["batching"] = {"max_num_seqs": max_num_seqs, **batching}
    data["tenancy"]["slot_reserve_fraction"] = 0.0
    return data


class _Run:
    """A run with every ticket seen at its end (the workers' ``done``), by id, and each
    replica's in-flight count and running sequences right after each release."""

    def __init__(
        self,
        config: TidegateConfig,
        arrivals: list[Arrival],
        replicas: int = 1,
        service: ServiceModel | None = None,
        before_run: Callable[[Simulation], None] | None = None,
    ) -> None:
        scenario = Scenario(
            config,
            "m",
            service or flat_step_service(STEP_S * 1000),
            Listed("test", arrivals),
            {"shared": replicas},
            keep_requests=True,
        )
        self.simulation = simulation = Simulation(scenario)
        self.done: dict[str, list[Ticket]] = {}
        self.after_release: list[tuple[float, str, int, int]] = []  # at, replica, flying, running
        sink_done = simulation.done

        def done(replica_id: str, tickets: list[Ticket]) -> None:
            for ticket in tickets:
                self.done.setdefault(ticket.request.id, []).append(ticket)
            sink_done(replica_id, tickets)
            replica = simulation.fleet.live.get(replica_id)
            if replica is None:  # a drained replica's last: it stopped
                return
            worker = replica.worker
            running = worker.num_running if isinstance(worker, SequenceWorker) else 0
            self.after_release.append(
                (simulation.kernel.time, replica_id, replica.in_flight, running)
            )

        simulation.done = done
        if before_run is not None:
            before_run(simulation)
        result = simulation.run()
        assert result.recorder.requests is not None
        self.result = result
        self.records = {record.id: record for record in result.recorder.requests}
        assert len(self.records) == len(result.recorder.requests) == len(arrivals)

    def workers(self) -> list[SequenceWorker]:
        found = []
        for replica in self.simulation.fleet.live.values():
            assert isinstance(replica.worker, SequenceWorker)
            found.append(replica.worker)
        return found

    def assert_all_ended_once_with_their_tokens(self) -> None:
        assert all(record.outcome == "completed" for record in self.records.values())
        assert sorted(self.done) == sorted(self.records)
        for tickets in self.done.values():
            (ticket,) = tickets  # done once
            assert ticket.made_tokens == ticket.output_tokens
        for worker in self.workers():
            assert worker.num_running == worker.pending_prefill == len(worker.queue) == 0
            assert not worker.pausing
            assert all(t["in_flight"] == 0 for t in worker.queue.tenants().values())
        assert all(t["in_flight"] == 0 for t in self.simulation.gateway.queue.tenants().values())


# Heavy alone sends ten at t=0..0.009 (200 output tokens: 2 s of decode); light one at 0.5.
FLOOD = [Arrival(0.001 * i, 10, 200, None, "heavy") for i in range(10)]
FLOOD.append(Arrival(0.5, 10, 5, None, "light"))
LIGHT = str(len(FLOOD) - 1)


@pytest.mark.spies  # replaces a method of the simulation to watch it
@pytest.mark.parametrize("on", [True, False])
def test_a_light_request_pauses_a_flood_sequence_instead_of_waiting_for_one_to_end(
    on: bool,
) -> None:
    """4 slots, all heavy's. With preemption light is sent at once and its first token
    comes at the end of its prefill step, the step after the one in progress (t=0.52);
    heavy 3 (the fewest tokens made, 50, tied with 1 and 2: the latest granted) is paused
    at t=0.51, resumes when light ends (t=0.56) prefilling its prompt and 50 tokens, and
    ends 50 ms late (5 steps paused); the replica's in-flight is 5 of 4 slots until light
    ends. Off: light waits for heavy 0 to end (t=2.0) and nothing is paused."""
    run = _Run(preempting(config_of(_generation()), on), FLOOD)
    run.assert_all_ended_once_with_their_tokens()
    light = run.records[LIGHT]
    assert light.ttft_s is not None
    (worker,) = run.workers()
    gateway = run.simulation.gateway
    if on:
        assert light.wait_s == 0.0
        assert light.ttft_s == pytest.approx(2 * STEP_S)
        assert (worker.num_preempted, gateway.num_preempts) == (1, 1)
        assert worker.recomputed_tokens == 10 + 50
        assert run.simulation.recorder.preempted == {worker.replica_id: 1}
        heavy_e2e = {rid: run.records[str(rid)].e2e_s for rid in range(4)}
        assert heavy_e2e[3] == pytest.approx(2.007 + 5 * STEP_S)
        assert heavy_e2e[2] == pytest.approx(2.008)
        assert run.records["3"].ttft_s == pytest.approx(0.017)  # its first token, not again
        flying = [(at, flying, running) for at, _, flying, running in run.after_release]
        at, *counts = flying[0]
        assert at == pytest.approx(0.56)
        assert counts == [4, 4]  # light ended: 4 in flight of 4 slots, 4 running
        assert all(f <= 4 and r <= 4 for _, f, r in flying)
    else:
        assert light.wait_s == pytest.approx(1.5)
        assert (worker.num_preempted, gateway.num_preempts, worker.recomputed_tokens) == (0, 0, 0)
        assert not run.simulation.recorder.preempted


@pytest.mark.spies  # replaces a method of the simulation to watch it
def test_the_request_goes_to_the_replica_holding_most_of_the_victims() -> None:
    """2 replicas of 2 slots: light's long request lands on the first, heavy's three on
    the second (2) and the first (1). Light's second (under its share of 2, heavy 1 over)
    goes to the second replica, which holds two of heavy's, and pauses one there."""
    arrivals = [Arrival(0.0, 10, 400, None, "light")]
    arrivals += [Arrival(0.001 * (i + 1), 10, 200, None, "heavy") for i in range(3)]
    arrivals.append(Arrival(0.5, 10, 5, None, "light"))
    run = _Run(preempting(config_of(_generation(max_num_seqs=2))), arrivals, replicas=2)
    run.assert_all_ended_once_with_their_tokens()
    replica_of = {rid: tickets[0].replica for rid, tickets in run.done.items()}
    first, second = run.simulation.fleet.live
    assert [replica_of[str(i)] for i in range(4)] == [first, second, first, second]
    assert replica_of["4"] == second
    ttft = run.records["4"].ttft_s
    assert ttft is not None
    assert ttft <= 2 * STEP_S + 1e-9  # the step in progress there, then its prefill
    assert [w.num_preempted for w in run.workers()] == [0, 1]


@pytest.mark.spies  # replaces a method of the simulation to watch it
def test_a_drained_replica_keeps_its_paused_sequence_which_resumes_and_ends_there() -> None:
    """2 replicas of 4 slots, heavy's ten fill them (two wait at the gateway); light pauses
    one of heavy's on the first at t=0.51; that replica is drained at 0.515. The paused
    sequence has started: it is not handed back but resumes there when light ends, and
    completes with its tokens once; the replica stops after; nothing is lost."""
    drained: list[str] = []

    def drain_the_preempting_replica(simulation: Simulation) -> None:
        def drain(_: object) -> None:
            for replica_id, replica in list(simulation.fleet.live.items()):
                worker = replica.worker
                if isinstance(worker, SequenceWorker) and worker.num_preempted:
                    drained.append(replica_id)
                    simulation.fleet.drain(replica_id)

        simulation.kernel.at(0.515, drain)

    arrivals = [Arrival(0.001 * i, 10, 200, None, "heavy") for i in range(10)]
    arrivals.append(Arrival(0.5, 10, 5, None, "light"))
    config = preempting(config_of(_generation()))
    run = _Run(config, arrivals, replicas=2, before_run=drain_the_preempting_replica)
    run.assert_all_ended_once_with_their_tokens()
    (replica_id,) = drained
    (stopped,) = [r for r in run.simulation.fleet.stopped if r.id == replica_id]
    assert isinstance(stopped.worker, SequenceWorker)
    assert stopped.worker.num_preempted == 1
    assert stopped.worker.num_running == len(stopped.worker.queue) == 0
    on_drained = [rid for rid, tickets in run.done.items() if tickets[0].replica == replica_id]
    assert len(on_drained) == 5  # its 4 heavy (the paused one among them) and light


def test_with_none_of_the_victims_where_the_request_may_go_it_waits_for_a_slot() -> None:
    """Pools: ``fast`` serves high only, ``bulk`` medium and low; a replica each of 2 slots.
    Mid holds fast's two (high), heavy bulk's two (low, long prompts: the larger counter,
    the victim). Light's high request may preempt heavy, but no replica serving high holds
    any of heavy's: it is put back and starts when mid's first ends (t=0.2)."""
    data = _generation(max_num_seqs=2)
    data["pools"] = {
        "fast": {"priorities": ["high"], "devices": ["cpu"]},
        "bulk": {"priorities": ["medium", "low"], "devices": ["cpu"]},
    }
    data["models"][0]["pools"] = ["fast", "bulk"]
    arrivals = [
        Arrival(0.0, 10, 20, "high", "mid"),
        Arrival(0.0, 10, 40, "high", "mid"),
        Arrival(0.0, 4000, 200, "low", "heavy"),
        Arrival(0.0, 4000, 200, "low", "heavy"),
        Arrival(0.1, 10, 5, "high", "light"),
    ]
    config = preempting(config_of(data))
    scenario = Scenario(
        config,
        "m",
        flat_step_service(STEP_S * 1000),
        Listed("test", arrivals),
        {"fast": 1, "bulk": 1},
        keep_requests=True,
    )
    simulation = Simulation(scenario)
    result = simulation.run()
    assert result.recorder.requests is not None
    records = {record.id: record for record in result.recorder.requests}
    assert all(record.outcome == "completed" for record in records.values())
    assert simulation.gateway.num_preempts == 0
    mid_end = records["0"].e2e_s
    assert mid_end is not None
    assert 0.1 + (records["4"].wait_s or 0.0) == pytest.approx(mid_end)


@pytest.mark.spies  # replaces a method of the simulation to watch it
def test_a_batch_worker_sent_a_preempting_request_just_queues_it() -> None:
    """Embeddings, one replica of 2 slots: heavy's flood holds both, light's request comes
    as if sent to pause one of heavy's (the gateway's queue never preempts for embeddings:
    a batch has nothing to pause); the batch worker runs it in its next batch."""
    data = {
        "models": [
            {
                "name": "m",
                "task": "embeddings",
                "engine": "simulated",
                "replicas": 1,
                "slots": 2,
                "batching": {"max_batch_size": 2, "batch_window_ms": 0},
            }
        ],
        "tenancy": {"fair_sharing": True, "slot_reserve_fraction": 0.0},
    }
    arrivals = [Arrival(0.001 * i, 10, 0, None, "heavy") for i in range(6)]
    arrivals.append(Arrival(0.015, 10, 0, None, "light"))
    scenario = Scenario(
        config_of(data),
        "m",
        flat_batch_service(10.0),
        Listed("test", arrivals),
        {"shared": 1},
        keep_requests=True,
    )
    simulation = Simulation(scenario)
    fleet = simulation.fleet
    occupy = fleet.occupy

    def sent(replica_id: str, ticket: Ticket) -> None:
        if ticket.request.tenant == "light":
            ticket.preempt = "heavy"
        occupy(replica_id, ticket)

    fleet.occupy = sent
    result = simulation.run()
    assert result.recorder.requests is not None
    records = {record.id: record for record in result.recorder.requests}
    assert all(record.outcome == "completed" for record in records.values())
    (replica,) = fleet.live.values()
    assert isinstance(replica.worker, BatchWorker)
    assert replica.in_flight == 0
    light = records["6"]
    assert light.e2e_s is not None
    assert light.wait_s is not None
    assert light.e2e_s - light.wait_s <= 0.02 + 1e-9  # the batch after the one running


@settings(max_examples=40, deadline=None)
@given(
    replicas=st.integers(min_value=1, max_value=2),
    max_num_seqs=st.integers(min_value=1, max_value=4),
    budget=st.sampled_from([0, 30, 200]),
    arrivals=st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=0.3),
            st.integers(min_value=1, max_value=100),
            st.integers(min_value=1, max_value=80),
            st.sampled_from(["a", "a", "a", "b", "c"]),
        ),
        min_size=1,
        max_size=30,
    ),
)
@pytest.mark.spies  # replaces a method of the simulation to watch it
def test_with_preemption_every_request_ends_once_with_all_its_tokens(
    replicas: int, max_num_seqs: int, budget: int, arrivals: list[tuple[float, int, int, str]]
) -> None:
    """Whatever arrives: every request completes exactly once having made its output
    tokens, and nothing is left running, pending, paused or held, in a worker or the
    gateway."""
    data = _generation(max_num_seqs, max_prefill_tokens=budget)
    workload = [
        Arrival(at, prompt, output, None, tenant) for at, prompt, output, tenant in sorted(arrivals)
    ]
    run = _Run(preempting(config_of(data)), workload, replicas=replicas)
    run.assert_all_ended_once_with_their_tokens()
    preempted = sum(worker.num_preempted for worker in run.workers())
    assert preempted <= run.simulation.gateway.num_preempts


def _records(run: _Run) -> list[RequestRecord]:
    return sorted(run.records.values(), key=lambda record: int(record.id))


@pytest.mark.spies  # replaces a method of the simulation to watch it
def test_preemption_off_runs_as_before_it() -> None:
    """The flag off and a config without it: the same records."""
    plain = _Run(config_of(_generation()), FLOOD)
    off = _Run(preempting(config_of(_generation()), on=False), FLOOD)
    assert _records(plain) == _records(off)
