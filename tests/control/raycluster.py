"""A multi-node Ray cluster started on this host for tests, on loopback only.

``ray.cluster_utils.Cluster``: the head and the other nodes are separate raylets of one GCS,
all on 127.0.0.1, no dashboard. Each node declares what ``node`` says (GPUs, ``gpu_mem_mb``,
pools): no GPU is used, Ray only accounts the declared resources. Ray's files go to a short
temporary folder (its socket paths must fit), removed afterwards with the environment as it
was. Child processes (a ``tidegate serve`` that joins the cluster) inherit that environment.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

import psutil

# Read by Ray when it is imported: 0 keeps every node and the driver on 127.0.0.1.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
from ray._private import ray_constants
from ray.cluster_utils import Cluster

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}
# Ray waits a fixed 30 s for a new node's raylet to register (ray/_private/node.py, not
# configurable); on a machine loaded past that, starting the cluster again is the only remedy.
CLUSTER_ATTEMPTS = 3
START_DEADLINE_S = 120.0  # a busy machine's worst seen: about a third of it


@contextlib.contextmanager
def loopback_cluster(node: Mapping[str, Any], num_nodes: int = 3) -> Iterator[Cluster]:
    """``num_nodes`` nodes (the head among them), each started with ``node``'s arguments."""
    assert not ray_constants.ENABLE_RAY_CLUSTER, "Ray was imported before this module set it"
    tmp = tempfile.mkdtemp(prefix="tg-ray-")
    saved = {name: os.environ.get(name) for name in [*RAY_ENV, "RAY_TMPDIR"]}
    os.environ.update(RAY_ENV, RAY_TMPDIR=tmp)
    os.mkdir(os.path.join(tmp, "ray"))
    cluster = None
    try:
        cluster = _start_cluster(node, num_nodes)
        assert cluster.address.startswith("127.0.0.1:"), cluster.address  # loopback only
        yield cluster
    finally:
        if cluster is not None:
            cluster.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(tmp, ignore_errors=True)


def _start_cluster(node: Mapping[str, Any], num_nodes: int) -> Cluster:
    """The cluster, started again (after killing what a failed start left) when Ray gives up
    on a raylet that registers late."""
    for attempt in range(1, CLUSTER_ATTEMPTS + 1):
        cluster, started = None, time.time()
        try:
            cluster = Cluster(
                initialize_head=True, head_node_args={**node, "include_dashboard": False}
            )
            for _ in range(num_nodes - 1):
                cluster.add_node(**node)
            cluster.wait_for_nodes(timeout=START_DEADLINE_S)  # Ray's default 30 s fails if loaded
            return cluster
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == CLUSTER_ATTEMPTS:
                raise
            if cluster is not None:
                cluster.shutdown()
            _kill_children_since(started)
    raise AssertionError("unreachable")


def _kill_children_since(started: float) -> None:
    """Ray's processes (GCS, raylets) a failed start left behind: this process's children
    started since then."""
    children = [
        child
        for child in psutil.Process().children(recursive=True)
        if child.create_time() >= started - 1.0  # create_time has a coarse clock
    ]
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(children, timeout=START_DEADLINE_S)
