"""The simulator: real traces through the same ``tidegate.core`` policies, in virtual time.

- ``kernel``: the discrete-event kernel (a heap of ``(time, seq, callback, argument)``);
- ``gateway`` / ``workers`` / ``fleet``: the server's dispatcher, worker loops and replica
  lifecycle, driving ``WaitQueue``, ``plan_batch`` and ``pick_replica`` on the virtual clock;
- ``control``: the controller seam (``Controller``, ``FleetView``, ``StaticController``);
  ``autoscale``: the server's autoscaler and its baselines on it; ``oracle``: the limit
  (knows the coming arrivals, starts replicas with no cold start);
- ``service``: engine service times from a profile or the A100/H100 ``perf_model.csv``;
- ``workload`` / ``traces`` / ``synthetic`` / ``specs``: arrivals from traces and generators;
- ``run``: one run of a ``Scenario``; ``recorder`` / ``report`` / ``plot``: what it observed;
- ``command``: ``tidegate simulate``.

docs/simulator.md explains the model and its fidelity.
"""

from tidegate.sim.command import SimulateOptions, simulate, write_outputs
from tidegate.sim.control import (
    CONTROLLERS,
    Controller,
    DrainReplica,
    FleetAction,
    FleetView,
    ReplicaStatus,
    StartReplica,
    StaticController,
)
from tidegate.sim.fleet import Lifecycle
from tidegate.sim.kernel import Kernel
from tidegate.sim.run import RunResult, Scenario, Simulation
from tidegate.sim.service import ServiceModel, default_service, load_service
from tidegate.sim.workload import Arrival, Workload

__all__ = [
    "CONTROLLERS",
    "Arrival",
    "Controller",
    "DrainReplica",
    "FleetAction",
    "FleetView",
    "Kernel",
    "Lifecycle",
    "ReplicaStatus",
    "RunResult",
    "Scenario",
    "ServiceModel",
    "SimulateOptions",
    "Simulation",
    "StartReplica",
    "StaticController",
    "Workload",
    "default_service",
    "load_service",
    "simulate",
    "write_outputs",
]
