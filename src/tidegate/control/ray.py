"""Ray replicas: each one a Ray actor that runs the tidegate worker server, placed by Ray.

The controller decides how many replicas a model has (not Ray Serve: there is none here);
``RayWorkers`` runs each one as an actor (``WorkerActor``) that serves the same FastAPI app as
``tidegate worker`` on a free port of its node's IP, and reports its lifecycle like
``LocalWorkers`` does: STARTING while placed and launched, WARMING until its ``/readyz``
answers 200, READY, FAILED when it dies, STOPPED after ``stop_replica``.

Resources of one replica: a GPU share (fractional ``num_gpus`` and ``gpu_mem_mb``), its pool
(``pool:<name>``) and CPUs, as ``control.ray_resources.plan_resources`` computes them.

Placement: every replica has its own placement group of one bundle. Resources are reserved
atomically, ready or refused in bounded time, and freed exactly when it stops. Replicas of
one model spread over nodes (per model: ``SPREAD`` soft, ``STRICT_SPREAD`` hard, ``PACK``
none): the bundle's label selector excludes the nodes (``ray.io/node-id``) that hold another
replica of the model; soft spread drops the selector after ``spread_wait_s``. Placements run
one at a time, so replicas started together still see each other's nodes.

Refusal: ``start_replica`` raises ``PlacementRefused`` (nothing is left behind) when no alive
node could ever hold the bundle, when the cluster's free resources (``ray.available_resources``)
are short, or when its placement group is not ready within ``place_timeout_s``. It returns
once the resources are reserved (STARTING); readiness comes later through ``on_change``.

Failures: an actor's own end is the liveness signal (a call that returns only when its server
stops; a lost node or a killed actor fails it at once). Then FAILED with the reason, its
placement group is removed, and after a back-off it is placed again (Ray may pick another
node). A restart the cluster cannot place is FAILED with ``refused: ...`` and tried again.

No orphans: actors and placement groups belong to the driver's job (not detached), so they
end with the gateway even when it is killed. ``ray`` is an optional extra, imported lazily.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from tidegate.control import lifecycle, ray_resources
from tidegate.control.orchestrator import ReplicaSpec
from tidegate.control.ray_actor import actor_class, import_ray
from tidegate.control.ray_resources import PlacementRefused, describe
from tidegate.gateway.replicas import Replica, ReplicaState

log = logging.getLogger("tidegate.control")

__all__ = ["STRATEGIES", "PlacementRefused", "RayWorkers"]
NODE_ID_LABEL = "ray.io/node-id"
STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD")
STOP_GRACE_S = 5.0  # on top of a stop's timeout_s, for the actor's own shutdown
SETTLE_S = 2.0  # how long a cancelled placement may take to finish before it is removed


def _future(ref: Any) -> asyncio.Future[Any]:
    """An ObjectRef as an asyncio future of this loop.

    Cancelling it (a timeout, a stop) does not cancel the ref's own future: Ray Client
    (``ray://``) sets a result on that future without checking, and logs an
    ``InvalidStateError`` from its data thread for every one that was cancelled.
    """
    source: concurrent.futures.Future[Any] = ref.future()
    proxy: concurrent.futures.Future[Any] = concurrent.futures.Future()
    source.add_done_callback(functools.partial(_settle, proxy))
    return asyncio.wrap_future(proxy)


def _settle(proxy: concurrent.futures.Future[Any], source: concurrent.futures.Future[Any]) -> None:
    """Pass ``source``'s outcome on to ``proxy`` unless the proxy was cancelled meanwhile."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if source.cancelled():
            proxy.cancel()
        elif (exc := source.exception()) is not None:
            proxy.set_exception(exc)
        else:
            proxy.set_result(source.result())


async def _result(ref: Any, timeout_s: float) -> Any:
    """An ObjectRef's value, or TimeoutError after ``timeout_s``.

    Not ``asyncio.wait_for``: before Python 3.12 it swallows a cancellation that races the
    result, and a supervisor that misses its cancellation never stops.
    """
    async with asyncio.timeout(timeout_s):
        return await _future(ref)


async def _remove_once_settled(group: Any) -> None:
    """Remove a placement group whose creation may be in flight, once it is not.

    Ray (2.60) keeps a bundle's resources reserved for good when its group is removed while
    a node has prepared it and the commit has not landed: a loopback cluster leaked 200 MB of
    a 3,000 MB cluster within 3 to 80 create-then-remove rounds, and none in 300 rounds that
    waited for ``ready()`` first. A stop that cancels a placement the cluster has room for
    lets it finish (it takes milliseconds); one still pending after ``SETTLE_S`` has no room
    anywhere and is removed as it is.
    """
    from ray.util.placement_group import remove_placement_group

    try:
        with contextlib.suppress(TimeoutError, _ray_error()):
            await _result(group.ready(), SETTLE_S)
    finally:  # cancelled again meanwhile: removed at once all the same
        remove_placement_group(group)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


# ----------------------------------------------------------------------------- orchestrator
@dataclass(eq=False)
class _Slot:
    spec: ReplicaSpec
    replica: Replica
    group: Any = None  # its placement group, while reserved
    bundle: dict[str, float] = dataclasses.field(default_factory=dict)  # what group holds
    actor: Any = None  # its actor handle, while launched
    node_id: str | None = None  # where its bundle is
    supervisor: asyncio.Task[None] | None = None
    stopping: asyncio.Task[None] | None = None


class RayWorkers:
    """The Orchestrator protocol on a Ray cluster (see the module docstring)."""

    def __init__(
        self,
        *,
        address: str | None = None,  # None: RAY_ADDRESS, a cluster on this host, else a new one
        namespace: str = "tidegate",
        strategy: str = "SPREAD",
        strategies: Mapping[str, str] | None = None,  # per model, else ``strategy``
        device_memory_mb: float | None = None,  # None: the cluster's gpu_mem_mb / GPU
        cpus_per_replica: float = 1.0,
        host: str | None = None,  # the workers bind here; None: their node's IP
        place_timeout_s: float = 30.0,
        spread_wait_s: float = 2.0,
        ready_timeout_s: float = 300.0,
        max_backoff_s: float = 30.0,
        close_timeout_s: float = 10.0,
        worker_log_level: str = "warning",
    ) -> None:
        self.strategies = dict(strategies or {})
        for value in (strategy, *self.strategies.values()):
            if value not in STRATEGIES:
                raise ValueError(f"placement strategy {value!r}: use one of {STRATEGIES}")
        self.address = address
        self.namespace = namespace
        self.strategy = strategy
        self.device_memory_mb = device_memory_mb
        self.cpus_per_replica = cpus_per_replica
        self.host = host
        self.place_timeout_s = place_timeout_s
        self.spread_wait_s = min(spread_wait_s, place_timeout_s)
        self.ready_timeout_s = ready_timeout_s
        self.max_backoff_s = max_backoff_s
        self.close_timeout_s = close_timeout_s
        self.worker_log_level = worker_log_level
        self._slots: dict[str, _Slot] = {}
        self._placing = asyncio.Lock()
        self._client: httpx.AsyncClient | None = None
        self._owns_ray = False
        self._closed = False

    # ------------------------------------------------------------------ the protocol
    async def start_replica(
        self, spec: ReplicaSpec, on_change: Callable[[Replica], None]
    ) -> Replica:
        """Reserve a replica's resources (or raise ``PlacementRefused``), then launch it."""
        if self._closed:
            raise RuntimeError("RayWorkers were closed: no new replica")
        if spec.replica_id in self._slots:
            raise ValueError(f"replica {spec.replica_id} exists already")
        self.connect()
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(2.0, connect=1.0))
        replica = Replica(
            id=spec.replica_id,
            model=spec.model,
            pool=spec.pool,
            kind="ray",
            slots=spec.slots or 1,
            detail="placing",
            on_change=on_change,
        )
        slot = _Slot(spec, replica)
        await self._place(slot)
        if self._closed or spec.replica_id in self._slots:  # closed, or started twice, meanwhile
            self._discard(slot)
            raise RuntimeError(f"replica {spec.replica_id}: RayWorkers closed or it exists")
        self._slots[replica.id] = slot
        run_once = functools.partial(self._run_once, slot)
        slot.supervisor = asyncio.create_task(
            lifecycle.restart_forever(replica, run_once, self.max_backoff_s),
            name=f"supervise-{replica.id}",
        )
        slot.supervisor.add_done_callback(functools.partial(self._supervisor_done, slot))
        return replica

    async def stop_replica(self, replica_id: str, timeout_s: float) -> None:
        """Stop its server (in-flight requests get ``timeout_s``), its actor and its group."""
        slot = self._slots.get(replica_id)
        if slot is None:
            return  # stopped already
        if slot.stopping is None:
            slot.stopping = asyncio.create_task(
                self._stop(slot, timeout_s), name=f"stop-{replica_id}"
            )
        # Shielded: a caller that gives up waiting does not leave the replica half-stopped.
        await asyncio.shield(slot.stopping)

    def list_replicas(self) -> list[Replica]:
        return [slot.replica for slot in self._slots.values()]

    def endpoint(self, replica_id: str) -> str | None:
        slot = self._slots.get(replica_id)
        return None if slot is None else slot.replica.url

    async def close(self) -> None:
        """Stop every replica; disconnect from Ray if ``connect`` connected. Idempotent."""
        self._closed = True
        await asyncio.gather(
            *(self.stop_replica(rid, self.close_timeout_s) for rid in list(self._slots))
        )
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._owns_ray:
            import_ray().shutdown()
            self._owns_ray = False

    # ------------------------------------------------------------------ queries
    def node_of(self, replica_id: str) -> str | None:
        """The Ray node id that holds a replica's bundle, or None while it has none."""
        slot = self._slots.get(replica_id)
        return None if slot is None else slot.node_id

    def device_of(self, replica_id: str) -> str:
        """Where a replica runs, as ``tidegate_replica_info`` shows it: ``ray:<node id>``
        ("" while it is not placed); KeyError for a replica that is not one of these."""
        node_id = self._slots[replica_id].node_id
        return "" if node_id is None else f"ray:{node_id}"

    def connect(self) -> None:
        """Join the Ray cluster at ``address`` unless this process already has (blocks once).

        ``ray.init`` sets a SIGTERM handler that exits at once; the process's own is put
        back (the gateway's: admission closed, work in progress finished, replicas stopped).
        """
        ray = import_ray()
        if not ray.is_initialized():
            on_sigterm = signal.getsignal(signal.SIGTERM)
            try:
                ray.init(address=self.address, namespace=self.namespace)
            finally:
                if on_sigterm is not None and threading.current_thread() is threading.main_thread():
                    signal.signal(signal.SIGTERM, on_sigterm)
            self._owns_ray = True

    # ------------------------------------------------------------------ placement
    def _bundle(self, spec: ReplicaSpec) -> dict[str, float]:
        nodes = _alive_nodes()
        device_memory_mb = self.device_memory_mb
        if device_memory_mb is None:
            device_memory_mb = ray_resources.device_memory_mb(nodes)
        pools = ray_resources.declares_pools(nodes)
        return ray_resources.plan_resources(spec, device_memory_mb, self.cpus_per_replica, pools)

    async def _place(self, slot: _Slot) -> None:
        """Reserve the slot's bundle in a placement group of its own, or raise PlacementRefused."""
        from ray.util.placement_group import placement_group_table

        rid = slot.spec.replica_id
        async with self._placing:
            bundle = self._bundle(slot.spec)
            ray_resources.check_fits(rid, bundle, _alive_nodes(), _free(bundle))
            strategy = self.strategies.get(slot.spec.model, self.strategy)
            avoid = sorted(
                {
                    other.node_id
                    for other in self._slots.values()
                    if other is not slot
                    and other.spec.model == slot.spec.model
                    and other.node_id is not None
                }
            )
            attempts: list[tuple[list[dict[str, str]], float]] = []  # (label selector, wait)
            if avoid and strategy != "PACK":
                elsewhere = [{NODE_ID_LABEL: f"!in({','.join(avoid)})"}]
                soft = strategy == "SPREAD"
                attempts.append((elsewhere, self.spread_wait_s if soft else self.place_timeout_s))
            if not avoid or strategy != "STRICT_SPREAD":
                attempts.append(([], self.place_timeout_s))
            for selector, wait_s in attempts:
                if await self._reserve(slot, bundle, selector, wait_s):
                    table = placement_group_table(slot.group)
                    slot.node_id = table["bundles_to_node_id"][0]
                    slot.bundle = bundle
                    return
            strict = avoid and strategy == "STRICT_SPREAD"
            where = f" without a replica of {slot.spec.model}" if strict else ""
            free = _free(bundle)
            raise PlacementRefused(
                f"{rid}: no node{where} had room for {describe(bundle)} within "
                f"{self.place_timeout_s:g}s ({strategy}; cluster-wide free: {describe(free)})"
            )

    async def _reserve(
        self,
        slot: _Slot,
        bundle: dict[str, float],
        selector: list[dict[str, str]],
        wait_s: float,
    ) -> bool:
        from ray.util.placement_group import placement_group, remove_placement_group

        name = f"tidegate-{slot.spec.replica_id}"
        labels = {"bundle_label_selector": selector} if selector else {}
        slot.group = placement_group([bundle], name=name, **labels)
        try:
            await _result(slot.group.ready(), wait_s)
        except TimeoutError:  # pending for want of room all along (see _remove_once_settled)
            remove_placement_group(slot.group)
            slot.group = None
            return False
        except BaseException:  # cancelled (a stop): nothing stays reserved
            group, slot.group = slot.group, None
            await _remove_once_settled(group)
            raise
        return True

    def _discard(self, slot: _Slot) -> None:
        """Kill the slot's actor and free its placement group (both may be gone already)."""
        ray = import_ray()
        from ray.util.placement_group import remove_placement_group

        if slot.actor is not None:
            ray.kill(slot.actor, no_restart=True)
            slot.actor = None
        if slot.group is not None:
            remove_placement_group(slot.group)
            slot.group = None
        slot.node_id = None
        slot.bundle = {}

    # ------------------------------------------------------------------ one life
    async def _run_once(self, slot: _Slot) -> float:
        """One actor from placement to its end; returns how long it was READY."""
        replica = slot.replica
        replica.url = None
        what = "launching" if replica.restarts == 0 else f"restart {replica.restarts}"
        if slot.group is None:
            replica.set_state(ReplicaState.STARTING, f"{what}: placing")
            try:
                await self._place(slot)
            except PlacementRefused as exc:
                replica.set_state(ReplicaState.FAILED, lifecycle.clip(f"refused: {exc}"))
                return 0.0
        node = (slot.node_id or "?")[:12]
        replica.set_state(ReplicaState.STARTING, f"{what} on node {node}")
        deadline = time.monotonic() + self.ready_timeout_s
        slot.actor = self._launch(slot)
        try:
            url, _ = await _result(slot.actor.serve.remote(self.host), self.ready_timeout_s)
        except (TimeoutError, _ray_error()) as exc:
            self._discard(slot)
            detail = f"its actor did not start: {_first_line(exc) if str(exc) else 'timed out'}"
            replica.set_state(ReplicaState.FAILED, lifecycle.clip(detail))
            return 0.0
        replica.url = url
        exited = _future(slot.actor.wait.remote())
        try:
            ready_for_s, detail = await self._watch(slot, url, exited, deadline)
        finally:
            await lifecycle.cancel([exited])
        self._discard(slot)
        replica.url = None
        replica.set_state(ReplicaState.FAILED, lifecycle.clip(detail))
        return ready_for_s

    def _launch(self, slot: _Slot) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = slot.bundle
        settings = slot.spec.settings
        share = bundle.get("GPU", 0.0)
        # Ray sets CUDA_VISIBLE_DEVICES to the GPU it assigned: it is cuda:0 inside. A share
        # is enforced, not only counted: the worker caps its memory to it.
        fraction = share if 0 < share < 1 else None
        device = "cuda:0" if share else "cpu"
        settings = dataclasses.replace(settings, device=device, memory_fraction=fraction)
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        return (
            actor_class()
            .options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                resources=custom,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    slot.group, placement_group_bundle_index=0
                ),
                max_restarts=0,  # the supervisor restarts it, with back-off
            )
            .remote(settings, self.worker_log_level)
        )

    async def _watch(
        self, slot: _Slot, url: str, exited: asyncio.Future[Any], deadline: float
    ) -> tuple[float, str]:
        """Readiness, then the actor's end; (seconds READY, why it ended)."""
        replica = slot.replica
        assert self._client is not None
        slots = await lifecycle.ready_before(
            self._client, replica, url, slot.spec.slots, exited, deadline
        )
        if exited.done():
            return 0.0, f"{_ended(exited)} while starting"
        if slots is None:
            return 0.0, f"not ready within {self.ready_timeout_s:g}s of its launch"
        replica.slots = slots
        ready_at = time.monotonic()
        replica.set_state(
            ReplicaState.READY, f"actor on node {(slot.node_id or '?')[:12]} at {url}"
        )
        log.info("replica %s ready at %s (%d slots)", replica.id, url, replica.slots)
        await asyncio.wait({exited})  # the actor's own end: the only liveness signal
        return time.monotonic() - ready_at, f"{_ended(exited)} while ready"

    # ------------------------------------------------------------------ stopping
    async def _stop(self, slot: _Slot, timeout_s: float) -> None:
        replica = slot.replica
        if slot.supervisor is not None:
            await lifecycle.cancel([slot.supervisor])
        if slot.actor is not None:
            try:
                await _result(slot.actor.stop.remote(timeout_s), timeout_s + STOP_GRACE_S)
            except (TimeoutError, _ray_error()) as exc:
                log.warning("replica %s did not stop cleanly: %s", replica.id, _first_line(exc))
        self._discard(slot)
        del self._slots[replica.id]
        replica.url = None
        replica.set_state(ReplicaState.STOPPED, "stopped")

    def _supervisor_done(self, slot: _Slot, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # a bug: say so loudly, and keep the replica out of rotation
            log.error("supervisor of %s crashed", slot.replica.id, exc_info=exc)
            slot.replica.set_state(ReplicaState.FAILED, f"supervisor crashed: {exc!r}")


# ----------------------------------------------------------------------------- cluster views
def _ray_error() -> type[Exception]:
    return import_ray().exceptions.RayError  # type: ignore[no-any-return]


def _ended(exited: asyncio.Future[Any]) -> str:
    """Why an actor's ``wait()`` call ended: its answer, or how the actor died."""
    if exited.cancelled():
        return "its watch was cancelled"
    exc = exited.exception()
    if exc is None:
        return str(exited.result())
    if isinstance(exc, import_ray().exceptions.ActorDiedError) and "node" in str(exc).lower():
        return "its node died"
    return f"its actor died ({_first_line(exc)})"


def _alive_nodes() -> list[dict[str, Any]]:
    return [node for node in import_ray().nodes() if node.get("Alive")]


def _free(bundle: Mapping[str, float]) -> dict[str, float]:
    available = import_ray().available_resources()
    return {name: float(available.get(name, 0.0)) for name in bundle}
