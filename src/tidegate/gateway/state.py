"""The gateway's state: config, one dispatcher per model, the replicas, the clients to them.

The dispatchers own the queues (one task each); this object starts and stops them with the
orchestrators, and offers the waits that shutdown and scale-in need (idle, a replica idle).

Shutdown's cut-off: ``close_admission()`` refuses new work, ``cut_off()`` ends what is left.
Each await on a replica's answer runs inside ``until_cut_off()``, an ``asyncio.Timeout``
with no deadline until ``cut_off()`` sets it to now: queued requests then fail with 503
``shutting_down`` at once, and every in-flight one raises the same error where it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import httpx

from tidegate.asgi import ClientWatch
from tidegate.config import TidegateConfig
from tidegate.errors import NotReady
from tidegate.gateway.dispatcher import ModelDispatcher
from tidegate.gateway.proxy import ReplicaPool
from tidegate.gateway.quotas import KeyQuotas
from tidegate.gateway.replicas import Replica
from tidegate.metrics import GatewayMetrics

log = logging.getLogger("tidegate.gateway")


@dataclass
class Gateway:
    """The gateway's state: config, one dispatcher per model, the clients to replicas.

    ``pool`` carries the proxied requests (``proxy.forward``); ``client``, a general one,
    the dashboard's reads of the replicas' metrics.
    """

    config: TidegateConfig
    replicas: dict[str, list[Replica]]
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    dispatchers: dict[str, ModelDispatcher] = field(default_factory=dict)
    client: httpx.AsyncClient | None = None
    pool: ReplicaPool = field(default_factory=ReplicaPool)
    shutting_down: bool = False
    orchestrators: list[Any] = field(default_factory=list)  # start() / stop() replicas
    controller: Any = None  # control.controller.Controller when a model is autoscaled
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _release_waiters: set[asyncio.Event] = field(default_factory=set)
    _cut_off_at: float | None = None  # loop time of shutdown's cut-off; None: not yet
    _cut_scopes: set[asyncio.Timeout] = field(default_factory=set)  # in-flight awaits
    quotas: KeyQuotas = field(init=False)  # the buckets of keys with a rate_limit

    def __post_init__(self) -> None:
        self.quotas = KeyQuotas(self.config.keys, self.metrics)
        pools = self.config.pool_specs()
        for name in self.config.models:
            self.replicas.setdefault(name, [])
            self.dispatchers[name] = ModelDispatcher(
                name,
                self.config.queue_config(name),
                pools,
                self.replicas[name],
                self.metrics,
                on_release=self._released,
                outliers=self.config.gateway.outlier_detection,
                affinity=self.config.model(name).routing.affinity,
            )
            served = [pools[p].priorities for p in self.config.model(name).pools if p in pools]
            self.dispatchers[name].refuse_unservable(frozenset().union(*served))

    def _released(self) -> None:
        self._changed.set()
        for waiter in self._release_waiters:
            waiter.set()

    def on_replica_change(self, replica: Replica) -> None:
        log.info("replica %s: %s %s", replica.id, replica.state.value, replica.detail)
        dispatcher = self.dispatchers.get(replica.model)
        if dispatcher is not None:
            dispatcher.wake()

    def refresh_gauges(self) -> None:
        """The gauges as of now, for a scrape: series of replicas and states that no longer
        exist go away (a scaled-in replica's in-flight and ejection series too)."""
        for gauge in (self.metrics.replicas, self.metrics.inflight, self.metrics.ejected):
            gauge.clear()
        for dispatcher in self.dispatchers.values():
            dispatcher.refresh_gauges()

    def add_replica(self, replica: Replica) -> None:
        """A replica the controller started: routed to once it is READY."""
        self.replicas[replica.model].append(replica)
        self.dispatchers[replica.model].wake()

    def remove_replica(self, replica: Replica) -> None:
        """A replica the controller stopped (drained first): forget it."""
        replicas = self.replicas[replica.model]
        if replica in replicas:
            replicas.remove(replica)
        self.dispatchers[replica.model].wake()

    async def start(self) -> None:
        """Dispatchers first, then the replicas in the background: the gateway is live at
        once and routes to each replica as soon as it is ready."""
        # httpx, the library the orchestrators' checks already load: one client library on
        # the gateway's start-up path. As aiohttp did: no proxy from the environment, no
        # User-Agent header.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), trust_env=False)
        del self.client.headers["User-Agent"]
        for dispatcher in self.dispatchers.values():
            self._tasks.append(asyncio.create_task(dispatcher.run(), name=dispatcher.model))
        for orchestrator in self.orchestrators:
            self._tasks.append(asyncio.create_task(orchestrator.start(), name="replicas"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for orchestrator in self.orchestrators:
            await orchestrator.stop()
        await self.pool.close()
        if self.client is not None:
            await self.client.aclose()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or in flight, for at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.num_pending():
            self._changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return True

    async def wait_replica_idle(self, replica: Replica, timeout_s: float) -> bool:
        """Wait until nothing is in flight on ``replica``, for at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        released = asyncio.Event()
        self._release_waiters.add(released)
        try:
            while replica.in_flight > 0:
                released.clear()
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(released.wait(), left)
            return True
        finally:
            self._release_waiters.discard(released)

    def num_pending(self) -> int:
        return sum(len(d.queue) + d.num_in_flight() for d in self.dispatchers.values())

    def close_admission(self, reason: str) -> None:
        self.shutting_down = True
        for dispatcher in self.dispatchers.values():
            dispatcher.closed = reason

    def fail_queued(self) -> int:
        return sum(d.fail_all(_shutting_down()) for d in self.dispatchers.values())

    def until_cut_off(self, watch: ClientWatch | None = None) -> _UntilCutOff:
        """``async with gateway.until_cut_off():`` around one await on a replica's answer.

        Raises NotReady ``shutting_down`` from it once ``cut_off()`` is called (at once when
        it already was); with ``watch``, also ClientGone when the client goes away (as
        ``async with watch`` would, in the same scope). Wrap a single await, never a
        ``yield``: the timeout cancels the task that entered it.
        """
        return _UntilCutOff(self, watch)

    def cut_off(self) -> tuple[int, int]:
        """Shutdown's deadline: answer what is queued and what is in flight with 503 now.

        Returns (queued, in flight) as found; each counts its own outcome as it ends.
        """
        now = asyncio.get_running_loop().time()
        self._cut_off_at = now
        in_flight = 0
        for scope in self._cut_scopes:
            if not scope.expired():
                scope.reschedule(now)
                in_flight += 1
        return self.fail_queued(), in_flight

    def ready_models(self) -> list[str]:
        """Models that take requests: a replica is ready, or one cold-starts on demand."""
        return [
            m
            for m, rs in self.replicas.items()
            if any(r.ready for r in rs) or self.dispatchers[m].on_demand is not None
        ]


def _shutting_down() -> NotReady:
    return NotReady("the gateway is shutting down", code="shutting_down")


class _UntilCutOff:
    """One await bounded by shutdown's cut-off (see ``Gateway.until_cut_off``), and by the
    client going away when a ``ClientWatch`` is given: one timeout scope for both."""

    __slots__ = ("_gateway", "_timeout", "_watch")

    def __init__(self, gateway: Gateway, watch: ClientWatch | None) -> None:
        self._gateway = gateway
        self._watch = watch
        self._timeout = None if watch is not None else asyncio.timeout_at(gateway._cut_off_at)

    async def __aenter__(self) -> None:
        if self._watch is None:
            assert self._timeout is not None
            await self._timeout.__aenter__()
        else:  # raises ClientGone when the client already went
            self._timeout = await self._watch.__aenter__()
            if self._gateway._cut_off_at is not None:
                self._timeout.reschedule(self._gateway._cut_off_at)
        self._gateway._cut_scopes.add(self._timeout)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._timeout is not None
        self._gateway._cut_scopes.discard(self._timeout)
        try:  # the client gone raises ClientGone from the watch's exit; a cut-off, this
            if self._watch is None:
                await self._timeout.__aexit__(exc_type, exc, tb)
            else:
                await self._watch.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            raise _shutting_down() from None
