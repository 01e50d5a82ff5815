"""One simulation run: a scenario in, what was observed out.

A ``Scenario`` is everything a run depends on: the resolved ``TidegateConfig`` (so a serve
config and a simulation agree: queue levels, limits, aging, holdback, timeouts, pools,
batching, slots, and the policy, ``fifo`` or ``priority``), the model, its service model,
the workload (priorities already assigned), the initial replicas per pool, the lifecycle
timings and the controller. ``Simulation.run`` wires the kernel, the gateway, the fleet and
the workers and returns a ``RunResult``.

Request path (as in the server): arrival -> ``SimGateway.submit`` (admission, queue) ->
dispatch to a replica with a free slot -> its worker's queue and batching -> the engine's
service time -> completion: the slot is released and the gateway dispatches again.

Determinism: everything runs on the kernel's clock, random draws come from seeded
``random.Random`` objects (in the workload), and events at equal times run in the order
they were scheduled, so a scenario always gives the same result.

Termination: the periodic events (samples, controller ticks) go on while arrivals, work in
flight, replicas in transition, or queued requests that may still run are left. A queued
request may still run unless (a) no pool the model can have replicas in serves its level
and aging cannot bring it to one that does (``WaitQueue.unreachable_levels``); (b) the
fleet is static, complete and idle, and no queued request will ever age into a level it
serves (``WaitQueue.next_eligible_at`` is None): nothing will ever change; or (c) nothing
was dispatched or left the queue for ``max_stall_s`` of virtual time with nothing in flight
or starting (a guard for what (a) and (b) cannot foresee, e.g. an autoscaler that never
starts the pool they need). Then the periodic events stop, timers already set (deadlines,
aging) still run, and what is left in the queue ends as ``unservable`` (a) or ``stranded``
(b, c), counted per class, with the reason in ``RunResult.stopped``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from tidegate.config import TidegateConfig
from tidegate.core.prefix import DEFAULT_NUM_BLOCKS, PrefixAffinity, block_key
from tidegate.core.request import Request
from tidegate.core.routing import servable_levels
from tidegate.sim.control import (
    CONTROLLERS,
    Controller,
    ControllerContext,
    FleetView,
    StartReplica,
    StaticController,
)
from tidegate.sim.fleet import Fleet, Lifecycle
from tidegate.sim.gateway import SimGateway, Ticket
from tidegate.sim.kernel import Kernel
from tidegate.sim.prefix_cache import PrefixCache
from tidegate.sim.recorder import Recorder
from tidegate.sim.service import ServiceModel
from tidegate.sim.workers import BatchWorker, SequenceWorker, Worker
from tidegate.sim.workload import Arrival, Workload
from tidegate.worker.runtime import Worker as ServerWorker
from tidegate.worker.runtime import WorkerSettings

DEFAULT_SLO_TTFT_S: Mapping[str, float] = {"high": 1.0, "medium": 5.0, "low": 30.0}
FALLBACK_SLO_TTFT_S = 30.0
# Virtual time without progress after which a run gives up on what is queued: a day of the
# workload's time (divided by its speedup), longer than any cold start, aging or schedule gap.
DEFAULT_MAX_STALL_S = 86_400.0


@dataclass(frozen=True)
class Scenario:
    config: TidegateConfig
    model: str
    service: ServiceModel
    workload: Workload
    replicas: Mapping[str, int]  # pool -> replicas ready at time 0
    label: str = ""  # the policy's name in reports; default: the config's policy
    controller: str = "static"
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    slo_ttft_s: Mapping[str, float] = field(default_factory=dict)  # by level name
    network_s: float = 0.0  # gateway <-> replica round trip added to every request
    start_wall_s: float = 0.0  # wall-clock epoch seconds at virtual time 0 (for schedules)
    speedup: float = 1.0  # the workload's time compression: controllers compress with it
    keep_requests: bool = False
    max_stall_s: float | None = None  # None: DEFAULT_MAX_STALL_S / speedup (module docstring)
    affinity: PrefixAffinity | None = None  # prefix-affinity routing (core.prefix); None: off
    prefix_blocks: int = DEFAULT_NUM_BLOCKS  # leading prompt blocks hashed into a prefix key
    prefix_cache: PrefixCache | None = None  # generation: each replica's LRU of prompt blocks

    @property
    def name(self) -> str:
        return self.label or self.config.policy

    def slos(self) -> dict[str, float]:
        return {
            level: self.slo_ttft_s.get(level, DEFAULT_SLO_TTFT_S.get(level, FALLBACK_SLO_TTFT_S))
            for level in self.config.levels
        }


@dataclass(frozen=True)
class RunResult:
    scenario: Scenario
    recorder: Recorder
    num_requests: int
    first_arrival_at: float
    end_at: float  # when the last request reached its terminal state
    replica_seconds: float
    num_events: int
    stopped: str | None = None  # why requests were left queued (module docstring); None: none

    @property
    def label(self) -> str:
        return self.scenario.name


def worker_slots(config: TidegateConfig, model: str) -> int:
    """In-flight requests per replica: the config's ``slots``, else what the worker's /stats
    reports (2 x max batch for dynamic batching, max_num_seqs for continuous batching)."""
    spec = config.model(model)
    if spec.slots is not None:
        return spec.slots
    if spec.task == "embeddings":
        return 2 * spec.batching.max_batch_size
    return spec.batching.max_num_seqs


class Simulation:
    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        config = scenario.config
        spec = config.model(scenario.model)
        if spec.task != scenario.service.task:
            raise ValueError(
                f"model {spec.name} does {spec.task} but the service model "
                f"{scenario.service.name!r} is for {scenario.service.task}"
            )
        self.kernel = Kernel()
        self.recorder = Recorder(scenario.slos(), scenario.keep_requests)
        # priority name -> (its class in the report, its queue level: 0 for all under fifo)
        self._classes = {
            name: (i, config.level_index(name)) for i, name in enumerate(config.levels)
        }
        self._default = config.default_priority
        self._model = spec.name
        # The worker's own queue, as a worker with this model's batching builds it.
        settings = config.worker_settings(spec.name) if spec.local else None
        if settings is None:  # served by upstreams: a worker with this model's batching
            settings = WorkerSettings(model=spec.name, **dataclasses.asdict(spec.batching))
        server = ServerWorker(settings)
        self._worker_queue = server.queue_config()
        self._sequence_queue = server.sequence_queue_config()
        self._max_prefill_tokens = settings.max_prefill_tokens
        self._batch = config.batch_config(spec.name)
        self.fleet = Fleet(
            self.kernel,
            spec.name,
            worker_slots(config, spec.name),
            self._make_worker,
            self,
            scenario.lifecycle,
            scenario.network_s,
        )
        self.fleet.count_tokens = scenario.affinity is not None
        queue = config.queue_config(spec.name)
        pools = config.pool_specs()
        self.gateway = SimGateway(
            self.kernel, queue, pools, self.fleet, self.recorder, scenario.affinity
        )
        context = ControllerContext(
            config,
            spec.name,
            scenario.replicas,
            scenario.start_wall_s,
            scenario.speedup,
            scenario.workload,
            scenario.service,
        )
        self.controller: Controller = CONTROLLERS[scenario.controller](context)
        self._tick_pending = False
        if getattr(self.controller, "scales_from_zero", False):
            # As the dispatcher's on_demand: requests wait in the queue, and the controller
            # decides at once instead of at its next period.
            self.gateway.on_demand = self._demand
        self._num_requests = 0
        self._arrivals_done = False
        self._half_hop_s = scenario.network_s / 2
        # Levels no pool this model can have replicas in takes, even aged (docstring: a).
        self._pools_ever = {*spec.pools, *scenario.replicas}
        served = {
            level for name in self._pools_ever if name in pools for level in pools[name].priorities
        }
        self._never = frozenset(self.gateway.queue.unreachable_levels(served))
        self._max_stall_s = (
            scenario.max_stall_s
            if scenario.max_stall_s is not None
            else DEFAULT_MAX_STALL_S / scenario.speedup
        )
        self._progress: tuple[int, int] | None = None  # (dispatched, queued) when last seen
        self._progress_at = 0.0
        self._stopped: str | None = None

    def _make_worker(self, replica_id: str) -> Worker:
        service = self.scenario.service
        if service.batch is not None:
            return BatchWorker(
                self.kernel,
                replica_id,
                self.scenario.model,
                service.batch,
                self._batch,
                self._worker_queue,
                self,
                self.recorder,
            )
        assert service.step is not None
        return SequenceWorker(
            self.kernel,
            replica_id,
            self.scenario.model,
            service.step,
            self.scenario.config.model(self.scenario.model).batching.max_num_seqs,
            self._sequence_queue,
            self,
            self.recorder,
            self.scenario.prefix_cache,
            self._max_prefill_tokens,
        )

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        for pool, count in self.scenario.replicas.items():
            for _ in range(count):
                self.fleet.add(pool, warm=True)
        self.kernel.feed(self._stream(), self._on_arrival)
        self.kernel.at(0.0, self._sample)
        self.kernel.at(self.controller.interval_s, self._tick)
        self.kernel.run()
        stopped = self._end_unserved()
        end_at = self.recorder.last_done_at if self._num_requests else 0.0
        return RunResult(
            self.scenario,
            self.recorder,
            self._num_requests,
            self.recorder.first_arrival_at or 0.0,
            end_at,
            self.fleet.replica_seconds(end_at),
            self.kernel.num_events,
            stopped,
        )

    def _end_unserved(self) -> str | None:
        """Count what is still queued once nothing is left to run; why, or None if nothing."""
        tickets = self.gateway.tickets
        if not tickets:
            return None
        now = self.kernel.time
        never = self._never
        counts = {"unservable": 0, "stranded": 0}
        for ticket in tickets.values():
            request = ticket.request
            outcome = "unservable" if request.priority in never else "stranded"
            counts[outcome] += 1
            self.recorder.unserved(ticket.klass, outcome, request.id, now - request.arrival_at)
        reasons = []
        if counts["unservable"]:
            levels = ", ".join(self.scenario.config.level_names[level] for level in sorted(never))
            pools = ", ".join(sorted(self._pools_ever))
            reasons.append(
                f"{counts['unservable']} unservable: no pool of {pools} serves {levels} and "
                "aging cannot bring them to a level one serves"
            )
        if counts["stranded"]:
            reasons.append(f"{counts['stranded']} stranded: {self._stopped or 'nothing left'}")
        return "; ".join(reasons)

    def _stream(self) -> Iterator[tuple[float, Arrival]]:
        for arrival in self.scenario.workload:
            yield arrival.arrival_s, arrival
        self._arrivals_done = True

    def _on_arrival(self, arrival: Arrival) -> None:
        now = self.kernel.time
        name = arrival.priority or self._default
        classified = self._classes.get(name)
        if classified is None:
            levels = ", ".join(self._classes)
            raise ValueError(f"workload priority {name!r} is not a level ({levels})")
        klass, level = classified
        index = self._num_requests
        self._num_requests = index + 1
        if index == 0:
            self.recorder.first_arrival_at = now
        prompt = arrival.prompt_tokens
        output = arrival.output_tokens
        request = Request(
            str(index), self._model, level, now, None, prompt + output, tenant=arrival.tenant
        )
        blocks = arrival.blocks
        key = None
        if blocks and self.scenario.affinity is not None:
            key = block_key(blocks, self.scenario.prefix_blocks)
        self.gateway.submit(Ticket(request, klass, prompt, output, blocks, key))

    def _active(self) -> bool:
        if not self._arrivals_done or self.fleet.in_flight > 0 or self.fleet.transitioning():
            self._progress = None
            return True
        if self._stopped is not None:
            return False  # given up once: the sample and tick chains stop alike
        return self._may_still_run() and not self._stuck()

    def _may_still_run(self) -> bool:
        """Something is queued at a level some pool of the model could take (docstring: a)."""
        never = self._never
        return any(
            depth for level, depth in enumerate(self.gateway.queue.depths()) if level not in never
        )

    def _stuck(self) -> bool:
        """Nothing will ever change (b), or nothing has for ``max_stall_s`` (c)."""
        now = self.kernel.time
        queue = self.gateway.queue
        if isinstance(self.controller, StaticController) and not self.controller.decide(
            self._view()
        ):
            # A complete, idle, static fleet: free slots are all it will ever have.
            levels = servable_levels(self.fleet.views.values(), self.gateway.pools)
            if queue.next_eligible_at(levels) is None:
                self._stopped = (
                    "the fleet is static and no queued request will ever age into a level "
                    "its pools serve"
                )
                return True
        progress = (self.gateway.num_dispatched, len(queue))
        if progress != self._progress:
            self._progress, self._progress_at = progress, now
            return False
        if now - self._progress_at >= self._max_stall_s:
            self._stopped = (
                f"nothing was dispatched for {now - self._progress_at:g} s of virtual time "
                "with nothing in flight or starting"
            )
            return True
        return False

    def _sample(self, _: object = None) -> None:
        self.recorder.sample(
            self.kernel.time, len(self.gateway.queue), self.fleet.in_flight, self.fleet.num_ready
        )
        if self._active():
            self.kernel.at(self.kernel.time + self.recorder.sample_interval_s, self._sample)

    def _demand(self) -> None:
        if not self._tick_pending:
            self._tick_pending = True
            self.kernel.at(self.kernel.time, self._decide)

    def _decide(self, _: object = None) -> None:
        self._tick_pending = False
        self._apply_decision()

    def _tick(self, _: object = None) -> None:
        self._apply_decision()
        if self._active():
            self.kernel.at(self.kernel.time + self.controller.interval_s, self._tick)

    def _view(self) -> FleetView:
        return FleetView(
            self.kernel.time,
            len(self.gateway.queue),
            self.gateway.queue.depths(),
            self.fleet.in_flight,
            self.fleet.statuses(),
            self._num_requests,
        )

    def _apply_decision(self) -> None:
        for action in self.controller.decide(self._view()):
            if isinstance(action, StartReplica):
                self.fleet.add(action.pool, warm=action.warm)
            else:
                self.fleet.drain(action.replica_id)

    # ------------------------------------------------------------------ worker sink
    def first_token(self, ticket: Ticket) -> None:
        ticket.first_at = self.kernel.time + self._half_hop_s

    def done(self, replica_id: str, tickets: list[Ticket]) -> None:
        if self._half_hop_s:
            back_at = self.kernel.time + self._half_hop_s
            self.kernel.at(back_at, self._returned, (replica_id, tickets))
        else:
            self._returned((replica_id, tickets))

    def _returned(self, item: tuple[str, list[Ticket]]) -> None:
        replica_id, tickets = item
        now = self.kernel.time
        recorder = self.recorder  # (a method called on it: compiled, a native call)
        for ticket in tickets:
            first_at = ticket.first_at if ticket.first_at >= 0 else now
            recorder.completed(
                ticket.klass,
                ticket.request.id,
                ticket.request.arrival_at,
                ticket.dispatched_at,
                first_at,
                now,
                ticket.output_tokens,
            )
        self.gateway.release(replica_id, tickets, completed=True)

    def refused(self, replica_id: str, ticket: Ticket) -> None:
        self.abandoned(replica_id, [ticket])

    # ------------------------------------------------------------------ fleet events
    def replica_ready(self, replica_id: str) -> None:
        self.gateway.wake()

    def hand_back(self, replica_id: str, tickets: list[Ticket]) -> None:
        self.gateway.retry(tickets, replica_id)

    def abandoned(self, replica_id: str, tickets: list[Ticket]) -> None:
        now = self.kernel.time
        for ticket in tickets:
            wait = ticket.dispatched_at - ticket.request.arrival_at
            self.recorder.ended(ticket.klass, "failed", ticket.request.id, now, wait)
        self.gateway.release(replica_id, tickets, completed=False)
