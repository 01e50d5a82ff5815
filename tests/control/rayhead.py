"""A Ray head node started with the ``ray`` CLI, as a platform team starts one, on loopback.

``ray start --head`` in a session of its own (every process it starts stays in that session),
its files in a short temporary folder (``--temp-dir``, and ``RAY_TMPDIR`` for whoever looks
for "the cluster on this host": ``ray_address: auto`` reads its address file there), every
port it opens chosen free here, the Ray Client server included. Torn down by killing that
session's processes, not with ``ray stop``: that stops every Ray process of the user on the
host, other tests' clusters included.

``actors`` reads the actors from the cluster's GCS (no driver, no dashboard): what the test
sees is what the cluster holds, not what the gateway says.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

# Read by Ray when it is imported: 0 keeps Ray on 127.0.0.1. Without it a driver that is
# given 127.0.0.1:PORT (or finds it with ``auto``) dials the host's own IP instead, where a
# head started with --node-ip-address 127.0.0.1 does not listen.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

RAY = str(Path(sys.executable).with_name("ray"))
START_DEADLINE_S = 120.0  # ``ray start`` takes 5-25 s here, depending on the load
TERM_GRACE_S = 3.0  # the GCS and the autoscaler's monitor take 15 s or more to leave on SIGTERM
STOP_DEADLINE_S = 30.0


@dataclass(frozen=True)
class Head:
    gcs_address: str  # 127.0.0.1:PORT, for ``ray start --address`` and drivers
    client_address: str  # ray://127.0.0.1:PORT, the Ray Client server
    temp_dir: str
    env: Mapping[str, str]  # what a process of this host needs to find the cluster (``auto``)

    def actors(self, class_name: str) -> list[dict[str, Any]]:
        """The cluster's actors of that class: ``State`` (``ALIVE``, ``DEAD`` ...),
        ``Address.NodeID``, ``JobID`` and the rest of Ray's actor table entry."""
        # What ``ray.util.state`` reads, from the GCS directly: no driver, no dashboard.
        # (GcsClient's async calls hang from a second event loop: this one is synchronous.)
        from ray._private.state import GlobalState
        from ray._raylet import GcsClientOptions  # type: ignore[attr-defined]

        state = GlobalState()  # type: ignore[no-untyped-call]
        state._initialize_global_state(
            GcsClientOptions.create(
                self.gcs_address, None, allow_cluster_id_nil=True, fetch_cluster_id_if_nil=False
            )
        )
        try:
            table = state.actor_table(None)
        finally:
            state.disconnect()  # type: ignore[no-untyped-call]
        return [actor for actor in table.values() if actor["ActorClassName"] == class_name]


def free_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 now (all held until every one is chosen: no duplicates)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


@contextlib.contextmanager
def cli_head(
    num_cpus: int, num_gpus: int = 0, resources: Mapping[str, float] | None = None
) -> Iterator[Head]:
    """A one-node cluster: ``ray start --head`` with these resources, stopped afterwards."""
    tmp = tempfile.mkdtemp(prefix="tg-rh-")  # short: Ray's socket paths must fit
    gcs, client, dashboard, agent = free_ports(4)
    env = {
        **os.environ,
        "RAY_TMPDIR": tmp,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    env.pop("RAY_ADDRESS", None)
    command = [
        RAY, "start", "--head",
        "--node-ip-address", "127.0.0.1",
        "--port", str(gcs),
        "--ray-client-server-port", str(client),
        "--include-dashboard", "false",
        "--dashboard-host", "127.0.0.1",
        "--dashboard-port", str(dashboard),  # its headless process binds it all the same
        "--dashboard-agent-listen-port", str(agent),
        "--num-cpus", str(num_cpus),
        "--num-gpus", str(num_gpus),
        "--resources", json.dumps(dict(resources or {})),
        "--object-store-memory", str(80 * 1024 * 1024),
        "--temp-dir", os.path.join(tmp, "ray"),
        "--disable-usage-stats",
    ]  # fmt: skip
    log = Path(tmp, "ray-start.log")
    with log.open("w") as out:
        start = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    session = start.pid  # the session of every process the head runs
    try:
        try:
            code = start.wait(timeout=START_DEADLINE_S)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, f"ray start exited {code}:\n{log.read_text()[-4000:]}"
        yield Head(f"127.0.0.1:{gcs}", f"ray://127.0.0.1:{client}", tmp, env)
    finally:
        _kill_session(session)
        shutil.rmtree(tmp, ignore_errors=True)


def _in_session(session: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            if os.getsid(process.pid) == session and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def _kill_session(session: int) -> None:
    """SIGTERM every process of the head's session (as ``ray stop`` does); SIGKILL what is
    left after ``TERM_GRACE_S`` (the cluster is thrown away: nothing to save). A zombie
    counts as gone: its parent is no longer ours to wait for."""
    for sig, wait_s in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, STOP_DEADLINE_S)):
        for process in _in_session(session):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(sig)
        deadline = time.monotonic() + wait_s
        while _in_session(session):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        else:
            return
    raise AssertionError(f"Ray processes of session {session} survived SIGKILL")
