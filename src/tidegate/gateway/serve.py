"""``tidegate serve``: the gateway, its dispatchers and the replicas it supervises.

Shutdown (SIGTERM or SIGINT): stop admitting (new requests and /readyz get 503
``shutting_down``), let queued and in-flight requests finish for up to
``shutdown_timeout_s``, answer what is left with 503, then stop the workers. A second
signal stops at once. Workers die with the gateway even if it is killed (see control.local).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from types import FrameType
from typing import Any

import uvicorn

from tidegate.config import TidegateConfig
from tidegate.control.health import UpstreamHealth
from tidegate.control.local import LocalWorkers
from tidegate.gateway.app import Gateway, create_gateway_app
from tidegate.worker.server import address_of, bind

log = logging.getLogger("tidegate.gateway")


class _GracefulServer(uvicorn.Server):
    """uvicorn, with the gateway's drain before the server closes."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.draining: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining is not None or self.gateway.config.gateway.shutdown_timeout_s <= 0:
            super().handle_exit(sig, frame)  # second signal: stop now
            return
        log.info(
            "signal %s: draining for up to %.0fs",
            signal.Signals(sig).name,
            self.gateway.config.gateway.shutdown_timeout_s,
        )
        loop = asyncio.get_event_loop()
        self.draining = loop.create_task(self._drain())

    async def _drain(self) -> None:
        gateway = self.gateway
        gateway.close_admission("the gateway is shutting down")
        await gateway.wait_idle(gateway.config.gateway.shutdown_timeout_s)
        left = gateway.fail_queued()
        if left:
            log.warning("shutdown: answered %d queued requests with 503", left)
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
    app = create_gateway_app(gateway)
    settings = config.gateway
    uv_config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=int(settings.shutdown_timeout_s) + 1,
    )
    server = _GracefulServer(uv_config, gateway)
    sock = bind(settings.host, settings.port)
    # The first line of output is the address (port 0 picks a free one): tests read it.
    print(address_of(sock), flush=True)
    started = time.monotonic()
    server.run(sockets=[sock])
    log.info("gateway stopped after %.0fs", time.monotonic() - started)
    return 0
