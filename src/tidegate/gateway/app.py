"""The gateway's HTTP API: OpenAI-compatible, with priorities, admission and routing.

This module only wires routes: probes and metrics here, the admin API in ``admin``, the
proxy loop of the OpenAI endpoints in ``forward``, keys and priorities in ``auth``, the
gateway's state in ``state``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tidegate.asgi import install_error_handlers
from tidegate.gateway.admin import add_admin_routes
from tidegate.gateway.auth import authenticate
from tidegate.gateway.forward import TASK_OF_PATH, proxy_request
from tidegate.gateway.replicas import Replica
from tidegate.gateway.state import Gateway

__all__ = ["Gateway", "create_gateway_app"]


def create_gateway_app(gateway: Gateway) -> FastAPI:
    """The ASGI app over ``gateway``; its lifespan starts and stops the dispatchers."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="tidegate gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway
    install_error_handlers(app)
    config = gateway.config

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        ready = gateway.ready_models()
        ok = not gateway.shutting_down and len(ready) == len(gateway.replicas)
        status = "shutting_down" if gateway.shutting_down else ("ready" if ok else "starting")
        return JSONResponse({"status": status, "ready_models": ready}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        gateway.metrics.replicas.clear()
        for dispatcher in gateway.dispatchers.values():
            dispatcher.refresh_gauges()
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authenticate(config, request)
        data = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "tidegate",
                "task": config.model(name).task,
                "ready_replicas": sum(r.ready for r in gateway.replicas[name]),
                "replicas": _state_counts(gateway.replicas[name]),
            }
            for name in gateway.ready_models()
        ]
        return {"object": "list", "data": data}

    add_admin_routes(app, gateway)

    async def handle(request: Request) -> Response:
        return await proxy_request(gateway, request)

    for path in TASK_OF_PATH:
        app.add_api_route(path, handle, methods=["POST"])
    return app


def _state_counts(replicas: list[Replica]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for replica in replicas:
        counts[replica.state.value] = counts.get(replica.state.value, 0) + 1
    return counts
