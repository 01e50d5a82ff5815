"""The oracle: a controller that knows the future load and starts replicas instantly.

It is the limit an autoscaler can be measured against, not a policy anyone could run: at
every control step (the model's ``interval_s``, compressed like the others') it reads the
number of requests that *will* arrive in the next interval (counted once from the run's own
workload, so it knows the bursts too, not only the rate curve) and keeps

    replicas = ceil(arrivals_per_s / (target_utilisation x capacity_per_s))

clamped to the model's ``[min_replicas, max_replicas]``, where ``capacity_per_s`` is one
replica's best throughput from the service model (max over batch sizes of size / batch
time). Replicas it adds are ready at once (``StartReplica(warm=True)``: no cold start, no
warm-up); those it removes drain like anyone's. Everything else (gateway, queue, routing,
workers, drains) is the simulation shared with the other controllers, so the oracle's SLO
attainment is measured, not assumed.

Invariants: the count is in ``[min_replicas, max_replicas]``; it is the smallest count in
that range whose capacity at the target covers the interval's arrivals; an interval past
the end of the workload counts as no arrivals.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from tidegate.sim.control import (
    CONTROLLERS,
    COUNTED,
    ControllerContext,
    ControllerFactory,
    FleetAction,
    FleetView,
    StartReplica,
    drain_least_busy,
)
from tidegate.sim.service import ServiceModel

# Its cheapest setting: bench_autoscale's curve held every SLO there (docs/benchmarks.md),
# since the priority queue keeps the urgent levels fast on a fully loaded replica.
DEFAULT_TARGET_UTILISATION = 1.0
_EPSILON = 1e-9  # a tick scheduled at k x interval may land a hair before it


def arrival_rates(arrival_times_s: Iterable[float], interval_s: float) -> tuple[float, ...]:
    """Arrivals per second in each interval ``[k x interval_s, (k + 1) x interval_s)``."""
    if interval_s <= 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    counts: list[int] = []
    for at in arrival_times_s:
        index = int(at / interval_s + _EPSILON)
        if index >= len(counts):
            counts.extend([0] * (index + 1 - len(counts)))
        counts[index] += 1
    return tuple(count / interval_s for count in counts)


def oracle_replicas(
    arrivals_per_s: float,
    capacity_per_s: float,
    target_utilisation: float,
    min_replicas: int,
    max_replicas: int,
) -> int:
    """The fewest replicas in ``[min, max]`` that serve ``arrivals_per_s`` at the target."""
    if capacity_per_s <= 0 or not 0 < target_utilisation <= 1:
        raise ValueError(
            f"need capacity_per_s > 0 and 0 < target_utilisation <= 1, got {capacity_per_s} "
            f"and {target_utilisation}"
        )
    needed = math.ceil(arrivals_per_s / (capacity_per_s * target_utilisation) - _EPSILON)
    return max(min_replicas, min(max_replicas, needed))


def batch_capacity_per_s(service: ServiceModel, max_batch_size: int) -> float:
    """One replica's best throughput (requests/s) over batch sizes up to ``max_batch_size``."""
    if service.batch is None:
        raise ValueError(
            f"the oracle needs a request-level (embeddings) service model; {service.name!r} "
            f"is {service.task}"
        )
    batch = service.batch
    return max(size / batch.batch_s(size, 0) for size in range(1, max_batch_size + 1))


class OracleController:
    """Keeps ``oracle_replicas`` of the next interval's arrivals; see the docstring."""

    def __init__(
        self,
        rates_per_s: Sequence[float],
        interval_s: float,
        capacity_per_s: float,
        target_utilisation: float,
        pool: str,
        bounds: tuple[int, int],
    ) -> None:
        self.rates_per_s = rates_per_s  # arrivals/s of interval k, from time 0
        self.interval_s = interval_s
        self.capacity_per_s = capacity_per_s
        self.target_utilisation = target_utilisation
        self.pool = pool
        self.min_replicas, self.max_replicas = bounds
        self.changes: list[tuple[float, int, int]] = []  # (at, from, to), for reports

    def desired(self, now: float) -> int:
        index = int(now / self.interval_s + _EPSILON)
        rate = self.rates_per_s[index] if index < len(self.rates_per_s) else 0.0
        return oracle_replicas(
            rate,
            self.capacity_per_s,
            self.target_utilisation,
            self.min_replicas,
            self.max_replicas,
        )

    def decide(self, view: FleetView) -> Sequence[FleetAction]:
        current = view.count(self.pool, *COUNTED)
        desired = self.desired(view.now)
        if desired == current:
            return ()
        self.changes.append((view.now, current, desired))
        if desired > current:
            return [StartReplica(self.pool, warm=True)] * (desired - current)
        return drain_least_busy(view, self.pool, current - desired)


def oracle_controller(target_utilisation: float = DEFAULT_TARGET_UTILISATION) -> ControllerFactory:
    """A factory of ``CONTROLLERS``: the oracle at ``target_utilisation``, with the model's
    autoscaling interval (compressed by the run's speedup) and bounds."""

    def build(context: ControllerContext) -> OracleController:
        spec = context.config.model(context.model)
        autoscaling = spec.autoscaling
        if autoscaling is None or context.workload is None or context.service is None:
            raise ValueError(
                f"the oracle needs model {context.model}'s autoscaling: block (interval and "
                "bounds), the run's workload and its service model"
            )
        interval_s = autoscaling.interval_s / context.speedup
        rates = arrival_rates((a.arrival_s for a in context.workload), interval_s)
        return OracleController(
            rates,
            interval_s,
            batch_capacity_per_s(context.service, spec.batching.max_batch_size),
            target_utilisation,
            spec.pools[-1],
            (autoscaling.min_replicas, autoscaling.max_replicas),
        )

    return build


CONTROLLERS["oracle"] = oracle_controller()
