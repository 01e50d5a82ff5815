"""The Ray actor of one replica: it serves the tidegate worker app, as ``tidegate worker`` does.

An async actor: uvicorn serves on the actor's own event loop, beside its methods. ``serve``
binds a free port on the node's IP and returns the URL at once (readiness is the worker's
``/readyz``, asked by the driver); ``wait`` returns only when the server has stopped, so the
driver learns of every end from one call (its answer, or an error when the actor or its node
died); ``stop`` lets in-flight requests finish first. ``ray`` is imported lazily: tidegate
imports without it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from typing import Any

import uvicorn

from tidegate.worker.app import create_app
from tidegate.worker.runtime import WorkerSettings
from tidegate.worker.server import address_of, bind


def import_ray() -> Any:
    """The ``ray`` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("the ray orchestrator needs Ray: pip install 'tidegate[ray]'") from exc
    return ray


@functools.cache
def actor_class() -> Any:
    """``WorkerActor`` as a Ray actor class."""
    return import_ray().remote(WorkerActor)


class WorkerActor:
    """Inside a Ray actor: one tidegate worker server."""

    def __init__(self, settings: WorkerSettings, log_level: str = "warning") -> None:
        self.settings = settings
        self.log_level = log_level
        self._app: Any = None
        self._server: uvicorn.Server | None = None
        self._serving: asyncio.Task[None] | None = None
        self._error: str | None = None

    async def serve(self, host: str | None) -> tuple[str, str]:
        """Bind a free port on ``host`` (default: the node's IP) and serve; (url, node id)."""
        ray = import_ray()
        logging.basicConfig(
            level=self.log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        sock = bind(host or ray.util.get_node_ip_address(), 0)
        self._app = create_app(self.settings, on_fatal=self._on_fatal)
        config = uvicorn.Config(
            self._app, log_level=self.log_level, access_log=False, lifespan="on", log_config=None
        )
        self._server = uvicorn.Server(config)
        self._serving = asyncio.create_task(self._server.serve(sockets=[sock]), name="serve")
        return address_of(sock), ray.get_runtime_context().get_node_id()

    def _on_fatal(self) -> None:
        self._error = self._app.state.worker.error or "the engine failed to start"
        if self._server is not None:
            self._server.should_exit = True

    async def wait(self) -> str:
        """Return once the server has stopped, saying why."""
        assert self._serving is not None, "serve() first"
        await asyncio.wait({self._serving})
        if self._error is not None:
            return f"worker failed: {self._error}"
        if not self._serving.cancelled() and (exc := self._serving.exception()) is not None:
            return f"worker server crashed: {exc!r}"
        return "worker server stopped"

    async def stop(self, timeout_s: float) -> None:
        """Stop serving: no new connections; in-flight requests get ``timeout_s`` to finish."""
        if self._server is None or self._serving is None:
            return
        self._server.config.timeout_graceful_shutdown = max(1, math.ceil(timeout_s))
        self._server.should_exit = True
        await asyncio.wait({self._serving}, timeout=timeout_s + 1)
