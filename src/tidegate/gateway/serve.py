"""``tidegate serve``: the gateway, its dispatchers and the replicas it supervises.

Shutdown (SIGTERM or SIGINT) has one deadline, ``shutdown_timeout_s`` after the signal:
new requests and /readyz get 503 ``shutting_down`` at once; queued and in-flight requests
may finish until the deadline; then every one left is answered 503 ``shutting_down`` (a
stream: an error event, then ``[DONE]``) and counted once (outcome ``shutdown``). The
server then closes its socket, gives those answers up to ``SHUTDOWN_FLUSH_S`` to leave,
and stops the workers. A second signal moves the deadline to now; a third stops at once.
Workers die with the gateway even if it is killed (see control.local).

The HTTP server bounds what a client may send (worker.server: header and body timeouts,
``max_request_bytes`` by Content-Length before the body is read).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import Receive, Scope

from tidegate.config import TidegateConfig
from tidegate.control.health import UpstreamHealth
from tidegate.control.local import LocalWorkers
from tidegate.fastroute import FastRoutes, Reply
from tidegate.gateway.app import Gateway, create_gateway_app
from tidegate.gateway.forward import TASK_OF_PATH, proxy_call
from tidegate.worker.server import ReadLimits, address_of, bind, limited_app, server_config

log = logging.getLogger("tidegate.gateway")
# After the deadline, for the 503 answers to reach their clients; past it uvicorn cancels
# what is left (a client that does not read). Whole seconds: uvicorn's setting is an int.
SHUTDOWN_FLUSH_S = 2


class _GracefulServer(uvicorn.Server):
    """uvicorn, with the gateway's shutdown: one deadline, then 503 for what is left."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.signalled_at: float | None = None  # monotonic time of the first signal
        self._draining: asyncio.Task[None] | None = None
        self._hurry = asyncio.Event()  # a second signal: the deadline is now

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._hurry.is_set():
            super().handle_exit(sig, frame)  # a third signal: uvicorn's own, stop at once
            return
        # A signal handler runs between two bytecodes of the loop's thread: act from the loop.
        asyncio.get_event_loop().call_soon_threadsafe(self._on_signal, signal.Signals(sig))

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._draining is None:
            self.signalled_at = time.monotonic()
            grace_s = self.gateway.config.gateway.shutdown_timeout_s
            log.info("%s: admission closed; work in progress has %gs to finish", sig.name, grace_s)
            self._draining = asyncio.create_task(self._drain(grace_s), name="shutdown")
        else:
            log.warning("%s again: answering what is left with 503 now", sig.name)
            self._hurry.set()

    async def _drain(self, grace_s: float) -> None:
        gateway = self.gateway
        gateway.close_admission("the gateway is shutting down")
        idle = asyncio.create_task(gateway.wait_idle(grace_s), name="shutdown-idle")
        hurry = asyncio.create_task(self._hurry.wait(), name="shutdown-hurry")
        await asyncio.wait({idle, hurry}, return_when=asyncio.FIRST_COMPLETED)
        for task in (idle, hurry):
            task.cancel()
        await asyncio.gather(idle, hurry, return_exceptions=True)
        queued, in_flight = gateway.cut_off()
        if queued or in_flight:
            log.warning(
                "shutdown deadline: %d queued and %d in-flight requests answered 503 shutting_down",
                queued,
                in_flight,
            )
        self.should_exit = True


def build_gateway(config: TidegateConfig, log_dir: str | None = None) -> tuple[Gateway, list[Any]]:
    """The gateway and its orchestrators, replicas wired to the dispatchers."""
    gateway = Gateway(config, replicas={})
    runner: Any
    if config.controller.orchestrator == "ray":
        from tidegate.control.fleet import ConfiguredFleet
        from tidegate.control.ray import RayWorkers

        runner = RayWorkers(address=config.controller.ray_address)
        starter: Any = ConfiguredFleet(config, runner, gateway)
    else:
        runner = starter = LocalWorkers(config, on_change=gateway.on_replica_change)
    orchestrators: list[Any] = [
        starter,
        UpstreamHealth(config, on_change=gateway.on_replica_change),
    ]
    for orchestrator in orchestrators:
        for replica in orchestrator.replicas:
            gateway.replicas[replica.model].append(replica)
    if config.devices or any(m.autoscaling is not None and m.local for m in config.models.values()):
        from tidegate.control.controller import Controller

        gateway.controller = Controller(gateway, runner, config)
        # First to stop: no scaling decision races the workers' shutdown.
        orchestrators.insert(0, gateway.controller)
    gateway.orchestrators = orchestrators
    return gateway, orchestrators


def serve_gateway(config: TidegateConfig, log_level: str = "info") -> int:
    """Serve until a signal (see the module's docstring). Raises CannotBind at once when
    the address is taken: nothing has started yet."""
    settings = config.gateway
    sock = bind(settings.host, settings.port)
    logging.basicConfig(
        level=log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # One line per health check would drown the log; httpx's own errors still show.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for note in config.notes:
        log.warning("config: %s", note)
    gateway, _ = build_gateway(config)
    limits = ReadLimits(
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        max_request_bytes=settings.max_request_bytes,
    )
    count_refusal = _counter_of_refusals(gateway)
    app = limited_app(create_gateway_app(gateway), limits, count_refusal)
    uv_config = server_config(
        app,
        limits,
        log_level,
        fast_routes=proxy_routes(gateway, limits, count_refusal),
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=SHUTDOWN_FLUSH_S,
    )
    server = _GracefulServer(uv_config, gateway)
    # The start-up heap (modules, config, app: some 80k objects) is never garbage, so the
    # collector need not scan it again: shorter full collections while serving, and a
    # shorter interpreter exit (its collections took seconds on a loaded machine).
    gc.collect()
    gc.freeze()
    # The first line of output is the address (port 0 picks a free one): tests read it.
    print(address_of(sock), flush=True)
    server.run(sockets=[sock])
    if server.signalled_at is not None:
        cut = _count_of(gateway, "shutdown")
        log.log(
            logging.WARNING if cut else logging.INFO,
            "gateway stopped %.1fs after the signal (shutdown_timeout_s %g); "
            'tidegate_requests_total{outcome="shutdown"} %d',
            time.monotonic() - server.signalled_at,
            settings.shutdown_timeout_s,
            cut,
        )
    return 0


def proxy_routes(
    gateway: Gateway, limits: ReadLimits, count_refusal: Callable[[Scope, str], None]
) -> FastRoutes:
    """The proxy routes, served by the HTTP protocol straight into the proxy loop."""

    async def handle(path: str, headers: Mapping[str, str], body: bytes, receive: Receive) -> Reply:
        return await proxy_call(gateway, path, headers, body, receive)

    def refused(path: str, outcome: str) -> None:
        count_refusal({"path": path}, outcome)

    return FastRoutes(
        paths=frozenset(path.encode() for path in TASK_OF_PATH),
        handler=handle,
        max_bytes=limits.max_request_bytes,
        body_timeout_s=limits.body_timeout_s,
        on_refused=refused,
    )


def _counter_of_refusals(gateway: Gateway) -> Callable[[Scope, str], None]:
    """Counts a request the HTTP server refused before the gateway saw it (too large,
    too slow, gone): model and priority are unknown then."""

    def count(scope: Scope, outcome: str) -> None:
        if scope.get("path") in TASK_OF_PATH:
            gateway.metrics.requests.labels("-", "none", outcome).inc()

    return count


def _count_of(gateway: Gateway, outcome: str) -> int:
    """The sum of tidegate_requests_total over every label with this outcome."""
    return int(
        sum(
            sample.value
            for metric in gateway.metrics.requests.collect()
            for sample in metric.samples
            if sample.name.endswith("_total") and sample.labels.get("outcome") == outcome
        )
    )
