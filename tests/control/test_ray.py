"""RayWorkers on a real multi-node Ray cluster started on this host, on loopback only.

The cluster (``ray.cluster_utils.Cluster``): three nodes, the head among them, each declaring
one GPU of ``NODE_MEMORY_MB`` (``gpu_mem_mb``) in pool ``shared`` and one CPU. No GPU is
used: workers run the simulated engine, and Ray only accounts the declared resources. One
cluster serves the module (starting one takes seconds); the test that loses a node adds that
node first, so the others always see three.

Placements, start-ups and Ray's resource view take seconds, more on a busy machine: tests wait
for them with generous deadlines (``DEADLINE_S``). Only a placement that can never succeed
is given a short one, to see it refused.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

# Read by Ray when it is imported: 0 keeps every node and the driver on 127.0.0.1.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table

from tests.control.raycluster import loopback_cluster
from tests.control.test_local import DEADLINE_S, Changes
from tests.gateway.harness import flat_profile
from tidegate.config import parse_config
from tidegate.control.orchestrator import ReplicaSpec
from tidegate.control.ray import PlacementRefused, RayWorkers
from tidegate.control.ray_resources import (
    MIN_CPUS,
    POOL_UNITS,
    check_fits,
    declares_pools,
    device_memory_mb,
    plan_resources,
)
from tidegate.gateway.app import Gateway, create_gateway_app
from tidegate.gateway.replicas import Replica, ReplicaState
from tidegate.worker.runtime import WorkerSettings

READY, FAILED, STOPPED = ReplicaState.READY, ReplicaState.FAILED, ReplicaState.STOPPED
MODEL = "sim-embed"
SIM = WorkerSettings(model=MODEL, engine="simulated", task="embeddings")
NODE_MEMORY_MB = 1000.0
NODE = {
    "num_cpus": 1,
    "num_gpus": 1,
    "resources": {"gpu_mem_mb": NODE_MEMORY_MB, "pool:shared": 1},
    "node_ip_address": "127.0.0.1",
    "object_store_memory": 80 * 1024 * 1024,
}


def spec(replica_id: str, memory_mb: float = 200.0, **extra: Any) -> ReplicaSpec:
    options: dict[str, Any] = {"memory_mb": memory_mb, **extra}
    pool, settings = options.pop("pool", "shared"), options.pop("settings", SIM)
    return ReplicaSpec(replica_id, MODEL, pool, settings, **options)


# ----------------------------------------------------------------------------- no cluster
def test_a_replica_asks_for_its_gpu_share_memory_and_pool() -> None:
    share = plan_resources(spec("a", memory_mb=333), 1000.0, 1.0)
    assert share == {"CPU": 1.0, "GPU": 0.333, "gpu_mem_mb": 333, "pool:shared": POOL_UNITS}
    rounded_up = plan_resources(spec("b", memory_mb=100), 3000.0, 0.0)
    assert rounded_up["GPU"] == 0.0334  # Ray's 1/10000, never below the memory share
    whole = plan_resources(spec("c", memory_mb=0, exclusive=True, pool="dedicated"), 800.0, 0)
    assert whole == {"GPU": 1.0, "gpu_mem_mb": 800.0, "pool:dedicated": POOL_UNITS}
    assert plan_resources(spec("d", memory_mb=0), None, 2.0) == {
        "CPU": 2.0,
        "pool:shared": POOL_UNITS,
    }
    # a cluster that declares no pools: none asked for; a bundle always holds something
    assert plan_resources(spec("e", memory_mb=0), None, 0.0, pools_declared=False) == {
        "CPU": MIN_CPUS
    }
    assert declares_pools([node(1, 1000, **{"pool:shared": 1})])
    assert not declares_pools([node(1, 1000)])


def test_a_gpu_share_the_cluster_cannot_express_is_refused() -> None:
    with pytest.raises(PlacementRefused, match="more than one device"):
        plan_resources(spec("big", memory_mb=1500), 1000.0, 0.0)
    with pytest.raises(PlacementRefused, match="no alive node declares gpu_mem_mb"):
        plan_resources(spec("nowhere"), None, 0.0)


def node(gpus: float, memory_mb: float, **extra: float) -> dict[str, Any]:
    """A ``ray.nodes()`` entry: its total resources."""
    return {"Alive": True, "Resources": {"GPU": gpus, "gpu_mem_mb": memory_mb, **extra}}


def test_shares_are_computed_from_the_smallest_declared_device() -> None:
    nodes = [node(2, 160_000), node(1, 24_000), node(0, 0, CPU=8)]
    assert device_memory_mb(nodes) == 24_000  # never over-commits the smaller device
    assert device_memory_mb([node(0, 0, CPU=8)]) is None


def test_what_no_node_holds_or_the_cluster_lacks_is_refused_at_once() -> None:
    nodes = [node(1, 1000, **{"pool:shared": 1}), node(1, 1000, **{"pool:shared": 1})]
    bundle = {"GPU": 0.6, "gpu_mem_mb": 600, "pool:shared": POOL_UNITS}
    free = {"GPU": 0.8, "gpu_mem_mb": 800, "pool:shared": 1.998}
    check_fits("fits", bundle, nodes, free)  # room cluster-wide: the placement group decides
    with pytest.raises(PlacementRefused, match=r"the cluster is full: needs gpu_mem_mb 900"):
        check_fits("full", {**bundle, "gpu_mem_mb": 900}, nodes, free)
    with pytest.raises(PlacementRefused, match=r"no alive node could ever hold .*pool:dedicated"):
        check_fits("pool", {"pool:dedicated": POOL_UNITS}, nodes, free)
    with pytest.raises(PlacementRefused, match=r"the most any node has: GPU 1"):
        check_fits("two", {"GPU": 2}, nodes, {"GPU": 2})


def test_tidegate_imports_without_ray_and_says_how_to_get_it() -> None:
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from tidegate.control.ray import RayWorkers\n"
        "try:\n"
        "    RayWorkers().connect()\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "pip install 'tidegate[ray]'" in result.stdout


class _RayInit:
    """What ``ray.init`` does to this process's signals (ray/_private/worker.py), no more."""

    def __init__(self) -> None:
        self.initialized = False

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, **options: Any) -> None:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        self.initialized = True


def test_joining_ray_keeps_the_processs_own_sigterm_handler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def graceful(signum: int, frame: object) -> None:  # the gateway's shutdown, say
        pass

    monkeypatch.setattr("tidegate.control.ray.import_ray", _RayInit)
    previous = signal.signal(signal.SIGTERM, graceful)
    try:
        RayWorkers(address="127.0.0.1:6379").connect()
        assert signal.getsignal(signal.SIGTERM) is graceful
    finally:
        signal.signal(signal.SIGTERM, previous)


# ----------------------------------------------------------------------------- the cluster
@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with loopback_cluster(NODE) as cluster:
        ray.init(address=cluster.address, namespace="tidegate-test")
        try:
            yield cluster
        finally:
            ray.shutdown()


# A soft spread gives up its preferred nodes after this: short, for the tests where no node
# is free of the model; a test that needs the spread raises it (``spread_over_nodes``).
SPREAD_WAIT_S = 1.0


@pytest_asyncio.fixture
async def workers(cluster: Cluster) -> AsyncIterator[RayWorkers]:
    orchestrator = RayWorkers(
        address=None,
        cpus_per_replica=0,
        place_timeout_s=DEADLINE_S,
        spread_wait_s=SPREAD_WAIT_S,
        ready_timeout_s=DEADLINE_S,
        max_backoff_s=2,
        close_timeout_s=30,
    )
    try:
        yield orchestrator
    finally:
        async with asyncio.timeout(DEADLINE_S):  # a hung stop fails the test, not blocks
            await orchestrator.close()
    free = await settled(all_free)
    assert free, f"resources left reserved: {ray.available_resources()}"


@contextlib.contextmanager
def spread_over_nodes(workers: RayWorkers) -> Iterator[None]:
    """Placements inside wait for a node without the model as long as any placement may."""
    workers.spread_wait_s = workers.place_timeout_s
    try:
        yield
    finally:
        workers.spread_wait_s = SPREAD_WAIT_S


async def settled(predicate: Callable[[], bool], timeout_s: float = DEADLINE_S) -> bool:
    """Ask ``predicate`` until it holds (Ray's resource view lags a little); False on timeout."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            while not predicate():  # noqa: ASYNC110 (Ray's view has no event to wait on)
                await asyncio.sleep(0.1)
            return True
    return False


def all_free() -> bool:
    return ray.available_resources().get("gpu_mem_mb") == 3 * NODE_MEMORY_MB


async def embed(client: httpx.AsyncClient, url: str, inputs: list[str]) -> httpx.Response:
    return await client.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": inputs})


def group_states(replica_id: str) -> set[str]:
    groups = placement_group_table().values()
    return {group["state"] for group in groups if group["name"] == f"tidegate-{replica_id}"}


async def start_all(
    workers: RayWorkers, specs: list[ReplicaSpec], changes: Changes
) -> list[Replica]:
    replicas = await asyncio.gather(*(workers.start_replica(s, changes) for s in specs))
    await changes.until(lambda: all(replica.ready for replica in replicas))
    return list(replicas)


# ----------------------------------------------------------------------------- scenarios
@pytest.mark.e2e
@pytest.mark.asyncio
async def test_replicas_of_one_model_spread_over_nodes_and_serve(
    workers: RayWorkers, cluster: Cluster
) -> None:
    changes = Changes()
    with spread_over_nodes(workers):
        replicas = await start_all(workers, [spec(f"sim-{i}", 300) for i in range(3)], changes)
    nodes = [workers.node_of(replica.id) for replica in replicas]
    assert len(set(nodes)) == 3  # one per node
    assert set(nodes) == {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert workers.list_replicas() == replicas
    reserved = 3 * NODE_MEMORY_MB - 900
    assert await settled(lambda: ray.available_resources().get("gpu_mem_mb") == reserved)
    async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
        for replica in replicas:
            url = workers.endpoint(replica.id)
            assert url is not None
            assert url.startswith("http://127.0.0.1:")
            response = await embed(client, url, ["tide", "gate"])
            assert response.status_code == 200, response.text
            assert len(response.json()["data"]) == 2
            stats = (await client.get(f"{url}/stats")).json()
            assert replica.slots == stats["slots"] > 0  # slots from the worker's /stats
    for replica in replicas:
        assert replica.kind == "ray"
        assert changes.states(replica.id)[-1] is READY
        assert FAILED not in changes.states(replica.id)


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_a_replica_that_does_not_fit_is_refused_and_leaves_nothing(
    workers: RayWorkers,
) -> None:
    changes = Changes()
    await start_all(workers, [spec(f"sim-{i}", 700) for i in range(3)], changes)
    # 3 x 300 MB free, but on three devices: 950 MB is refused at once (cluster-wide short),
    # 400 MB after the placement group was not ready in time (no single device has room).
    with pytest.raises(PlacementRefused, match=r"the cluster is full: needs .*gpu_mem_mb 950"):
        await workers.start_replica(spec("too-big", 950), changes)
    workers.place_timeout_s = 1  # short: no node can ever hold it, however long it waits
    with pytest.raises(
        PlacementRefused, match=r"no node had room for .*gpu_mem_mb 400, .* within 1s"
    ):
        await workers.start_replica(spec("no-room", 400), changes)
    workers.place_timeout_s = DEADLINE_S
    with pytest.raises(PlacementRefused, match="no alive node could ever hold"):
        await workers.start_replica(spec("no-pool", 100, pool="dedicated"), changes)
    assert [r.id for r in workers.list_replicas()] == ["sim-0", "sim-1", "sim-2"]
    assert group_states("no-room") <= {"REMOVED"}  # its group was created, then removed
    assert group_states("too-big") == set()  # refused before asking Ray for anything
    fits = await workers.start_replica(spec("fits", 300), changes)  # memory, not count
    assert fits.state is not FAILED


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_a_placement_cancelled_while_ray_reserves_it_leaves_nothing_reserved(
    workers: RayWorkers,
) -> None:
    """A stop that lands while a placement group is being created (a crash-looping replica
    placed again, say) frees its resources: the fixture checks that all are free after.

    Ray leaked one bundle for good in 3 to 80 such rounds when the group was removed at once;
    the delays sweep the window between the group's creation and its commit on a node.
    """
    changes = Changes()
    for round_ in range(40):
        # Ray's view of free resources lags a removal: the next start must not see it full.
        assert await settled(all_free), f"round {round_ - 1} left {ray.available_resources()}"
        placing = asyncio.create_task(workers.start_replica(spec(f"cut-{round_}"), changes))
        await asyncio.sleep(round_ * 0.0001)  # 0-4 ms: a placement takes ~5
        placing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await placing
            await workers.stop_replica(f"cut-{round_}", timeout_s=0)  # placed in time
    for round_ in range(40):
        assert group_states(f"cut-{round_}") <= {"REMOVED"}


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_node_loss_replaces_its_replica_on_a_surviving_node(
    workers: RayWorkers, cluster: Cluster
) -> None:
    doomed = cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    try:
        changes = Changes()
        with spread_over_nodes(workers):  # one replica on each node, the doomed one too
            replicas = await start_all(workers, [spec(f"sim-{i}") for i in range(4)], changes)
        (lost,) = [r for r in replicas if workers.node_of(r.id) == doomed.node_id]
        cluster.remove_node(doomed)
        await changes.until(lambda: lost.state is FAILED)
        assert "its node died while ready" in lost.detail
        await changes.until(lambda: lost.ready)
    finally:
        if doomed in cluster.worker_nodes:
            cluster.remove_node(doomed)
    survivors = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert workers.node_of(lost.id) in survivors
    assert lost.restarts == 1
    assert changes.states(lost.id)[-3:] == [FAILED, ReplicaState.STARTING, READY] or (
        changes.states(lost.id)[-4:] == [FAILED, ReplicaState.STARTING, ReplicaState.WARMING, READY]
    )
    for other in replicas:
        if other is not lost:
            assert other.ready
            assert other.restarts == 0
    async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
        url = workers.endpoint(lost.id)
        assert url is not None
        assert (await embed(client, url, ["back"])).status_code == 200


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_stop_replica_lets_in_flight_requests_finish_and_ends_stopped(
    workers: RayWorkers, tmp_path: Path
) -> None:
    slow = WorkerSettings(
        model=MODEL,
        engine="simulated",
        task="embeddings",
        max_batch_size=1,  # a short warm-up: one batch
        batch_window_ms=0,
        profile=str(flat_profile(tmp_path / "slow.json", latency_ms=1000)),
    )
    changes = Changes()
    (replica,) = await start_all(workers, [spec("slow", settings=slow)], changes)
    url = replica.url
    assert url is not None
    async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
        request = asyncio.create_task(embed(client, url, ["in flight"]))

        async def in_flight() -> bool:
            return bool((await client.get(f"{url}/stats")).json()["in_flight"])

        async with asyncio.timeout(DEADLINE_S):
            while not await in_flight():  # noqa: ASYNC110 (another process's state)
                await asyncio.sleep(0.05)
        async with asyncio.timeout(DEADLINE_S):
            await workers.stop_replica(replica.id, timeout_s=30)
        response = await request
        assert response.status_code == 200, response.text
        with pytest.raises(httpx.ConnectError):
            await client.get(f"{url}/livez")
    assert replica.state is STOPPED
    assert changes.states(replica.id)[-2:] == [READY, STOPPED]
    assert workers.list_replicas() == []
    assert workers.endpoint(replica.id) is None
    assert group_states("slow") == {"REMOVED"}
    await workers.stop_replica(replica.id, timeout_s=10)  # idempotent
    assert replica.state is STOPPED


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_a_worker_that_cannot_start_fails_with_its_reason_and_is_retried(
    workers: RayWorkers, tmp_path: Path
) -> None:
    broken = WorkerSettings(
        model=MODEL, engine="simulated", task="embeddings", profile=str(tmp_path / "missing")
    )
    changes = Changes()
    replica = await workers.start_replica(spec("broken", settings=broken), changes)
    await changes.until(lambda: replica.restarts >= 1)
    assert FAILED in changes.states(replica.id)
    failure = next(detail for rid, state, detail in changes.history if state is FAILED)
    assert failure.startswith("worker failed: "), failure
    assert "missing" in failure  # the engine's own error names the file
    assert "while starting" in failure
    async with asyncio.timeout(DEADLINE_S):
        await workers.stop_replica(replica.id, timeout_s=30)  # a crash loop stops too
    assert replica.state is STOPPED
    assert group_states("broken") <= {"REMOVED"}


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_scale_1_4_1_under_load_through_the_gateway_loses_nothing(
    workers: RayWorkers,
) -> None:
    config = parse_config(
        {
            "pools": {"shared": {"devices": ["cpu"]}},
            "models": [{"name": MODEL, "engine": "simulated", "task": "embeddings"}],
        },
        "<test>",
    )
    gateway = Gateway(config, replicas={MODEL: []})
    live = gateway.replicas[MODEL]  # what the dispatcher routes over
    changes = Changes()

    def on_change(replica: Replica) -> None:
        changes(replica)
        gateway.on_replica_change(replica)

    settings = config.worker_settings(MODEL, "cpu")
    started = 0

    async def scale_to(count: int) -> None:  # what the controller does, step by step
        nonlocal started
        while len(live) < count:  # start; the gateway routes to it once READY
            replica_spec = ReplicaSpec(f"sim-{started}", MODEL, "shared", settings, memory_mb=200)
            started += 1
            gateway.add_replica(await workers.start_replica(replica_spec, on_change))
        await changes.until(lambda: all(replica.ready for replica in live))
        while len(live) > count:  # drain the newest: no new requests, in-flight finish
            victim = live[-1]
            victim.set_state(ReplicaState.DRAINING, "scale-in")
            assert await settled(lambda victim=victim: victim.in_flight == 0)
            async with asyncio.timeout(DEADLINE_S):
                await workers.stop_replica(victim.id, timeout_s=30)
            gateway.remove_replica(victim)

    statuses: collections.Counter[int] = collections.Counter()
    stop = asyncio.Event()

    async def client_loop(client: httpx.AsyncClient, index: int) -> None:
        while not stop.is_set():
            response = await client.post(
                "/v1/embeddings", json={"model": MODEL, "input": [f"load {index}"]}
            )
            statuses[response.status_code] += 1

    async def served(count: int) -> None:
        target = statuses.total() + count
        assert await settled(lambda: statuses.total() >= target)

    app = create_gateway_app(gateway)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=transport, base_url="http://gateway", timeout=DEADLINE_S
        ) as client,
    ):
        await scale_to(1)
        load = [asyncio.create_task(client_loop(client, i)) for i in range(6)]
        try:
            await served(30)
            await scale_to(4)
            await served(120)
            completed = [await completed_requests(replica) for replica in live]
            await scale_to(1)
            await served(30)
        finally:
            stop.set()
            await asyncio.gather(*load)
    assert set(statuses) == {200}, statuses  # nothing lost, refused or failed
    assert all(count > 0 for count in completed), completed  # all four served
    assert [replica.id for replica in workers.list_replicas()] == ["sim-0"]
    assert {changes.states(f"sim-{i}")[-1] for i in (1, 2, 3)} == {STOPPED}


async def completed_requests(replica: Replica) -> float:
    """Requests a worker completed, from its own /metrics."""
    async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
        text = (await client.get(f"{replica.url}/metrics")).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tidegate_requests_total" and sample.labels["outcome"] == "completed"
    )
