"""The gateway's HTTP API: OpenAI-compatible, with priorities, admission and routing.

This module only wires routes: probes and metrics here, the admin API in ``admin``, the
proxy loop of the OpenAI endpoints in ``forward``, keys and priorities in ``auth``, the
gateway's state in ``state``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema
from starlette.types import Receive, Scope, Send

from tidegate import wire
from tidegate.asgi import install_error_handlers
from tidegate.config import TidegateConfig
from tidegate.gateway.admin import add_admin_routes
from tidegate.gateway.auth import authenticate, authorize_metrics
from tidegate.gateway.dashboard import add_dashboard_routes
from tidegate.gateway.forward import TASK_OF_PATH, proxy_request, serve_proxy
from tidegate.gateway.observe import add_observe_routes
from tidegate.gateway.replicas import Replica
from tidegate.gateway.state import Gateway

__all__ = ["Gateway", "GatewayApp", "create_gateway_app"]


class GatewayApp(FastAPI):
    """FastAPI for every route but the proxy's: ``POST`` to an OpenAI endpoint goes straight
    to the proxy loop (``forward.serve_proxy``), the one path where the framework's routing
    and middleware would cost as much as the scheduling itself."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in TASK_OF_PATH:
            await serve_proxy(self.state.gateway, scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def create_gateway_app(gateway: Gateway) -> FastAPI:
    """The ASGI app over ``gateway``; its lifespan starts and stops the dispatchers."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            async with app.state.doctor.running():  # doctor's rules every few seconds
                yield
        finally:
            await gateway.stop()

    app = GatewayApp(title="tidegate gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway
    install_error_handlers(app)
    config = gateway.config

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"description": "Starting, or shutting down."}})
    async def readyz() -> JSONResponse:
        ready = gateway.ready_models()
        ok = not gateway.shutting_down and len(ready) == len(gateway.replicas)
        status = "shutting_down" if gateway.shutting_down else ("ready" if ok else "starting")
        return JSONResponse({"status": status, "ready_models": ready}, 200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        authorize_metrics(config, request)  # gateway.metrics_auth: open, key or admin
        gateway.refresh_gauges()
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses={401: _error_response(401)})
    async def models(request: Request) -> dict[str, Any]:
        authenticate(config, request.headers)
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
    add_dashboard_routes(app, gateway)  # GET /dashboard: the live page (admin role)
    add_observe_routes(app, gateway)  # Prometheus service discovery, tidegate_replica_info

    async def handle(request: Request) -> Response:  # for the document: GatewayApp serves them
        return await proxy_request(gateway, request)

    # The body is read and validated by the proxy loop itself (once, cheaply), not by
    # FastAPI: the document says what it accepts, from the same wire schemas.
    for path, (operation_id, summary) in _OPERATIONS.items():
        app.add_api_route(
            path,
            handle,
            methods=["POST"],
            operation_id=operation_id,
            summary=summary,
            responses=_responses(path),
            openapi_extra=_request_docs(path, config),
        )
    _document_wire_schemas(app, config)
    return app


_OPERATIONS = {
    "/v1/embeddings": ("create_embeddings", "Embed texts (OpenAI-compatible)"),
    "/v1/completions": ("create_completion", "Continue a prompt (OpenAI-compatible)"),
    "/v1/chat/completions": ("create_chat_completion", "Answer a chat (OpenAI-compatible)"),
}
_ERRORS = {
    400: "Invalid request: the body breaks its schema, the model serves another task, or a "
    "limit of the model (context, output tokens, dimensions, inputs) is exceeded.",
    401: "No API key, or an unknown one.",
    403: "The priority asked for is above the API key's cap.",
    404: "No such model here; see /v1/models.",
    413: "The body or the prompt is over its limit, or the request counts more tokens than "
    "its API key's rate limit allows at once.",
    429: "Refused by admission: the API key is over its rate limit, the queue is full, the "
    "request was shed for a more urgent one, or its predicted wait is beyond its deadline. "
    "Retry after Retry-After seconds.",
    500: "Internal error: a bug, logged by the gateway.",
    502: "The replica failed the request.",
    503: "No replica is ready, or the gateway is shutting down. Retry after Retry-After seconds.",
    504: "The request waited in the queue past its deadline.",
}
_REF = "#/components/schemas/{model}"


def _schema_ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _responses(path: str) -> dict[int | str, dict[str, Any]]:
    trace = {
        "X-Request-Id": {"description": "The request's id.", "schema": {"type": "string"}},
        "X-Tidegate-Queue-Ms": {
            "description": "Time spent in the gateway's queue, in milliseconds.",
            "schema": {"type": "string"},
        },
    }
    response_model = wire.RESPONSE_OF_PATH[path]
    success: dict[str, Any] = {"application/json": {"schema": _schema_ref(response_model)}}
    if path != "/v1/embeddings":
        # When stream is true. Open API 3.1 reads this schema as one event's.
        event = {
            "type": "object",
            "properties": {
                "data": {
                    "type": "string",
                    "description": "One chunk of the answer as JSON, an error object, or [DONE].",
                }
            },
            "required": ["data"],
        }
        success["text/event-stream"] = {"schema": event}
    responses: dict[int | str, dict[str, Any]] = {
        200: {"description": "The model's answer.", "content": success, "headers": trace}
    }
    retry_after = {
        "Retry-After": {"description": "Seconds to wait.", "schema": {"type": "integer"}}
    }
    for status in _ERRORS:
        responses[status] = _error_response(status)
        responses[status]["headers"] = {**trace, **(retry_after if status in (429, 503) else {})}
    return responses


def _error_response(status: int) -> dict[str, Any]:
    return {
        "description": _ERRORS[status],
        "content": {"application/json": {"schema": _schema_ref(wire.ErrorBody)}},
    }


def _request_docs(path: str, config: TidegateConfig) -> dict[str, Any]:
    levels = list(config.levels)
    x_priority = {
        "name": "X-Priority",
        "in": "header",
        "required": False,
        "description": "The priority level to queue at, by name or index (0 is the most "
        "urgent); wins over the body's priority. Never above the API key's cap (403).",
        "schema": {"type": "string", "enum": levels + [str(i) for i in range(len(levels))]},
    }
    body_schema = _schema_ref(wire.REQUEST_OF_PATH[path])
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": body_schema}}},
        "parameters": [x_priority],
    }


def _document_wire_schemas(app: FastAPI, config: TidegateConfig) -> None:
    """Add the wire schemas to the document, narrowed to this gateway's models and levels."""
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = default_openapi()
            components = document.setdefault("components", {}).setdefault("schemas", {})
            components.update(_wire_schemas(config))
            _validation_errors_are_400(document)
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]


def _validation_errors_are_400(document: dict[str, Any]) -> None:
    """FastAPI documents a 422 for typed parameters; the error handlers answer 400."""
    for operations in document["paths"].values():
        for operation in operations.values():
            if operation.get("responses", {}).pop("422", None) is not None:
                operation["responses"].setdefault("400", _error_response(400))
    for name in ("HTTPValidationError", "ValidationError"):
        document["components"]["schemas"].pop(name, None)


def _wire_schemas(config: TidegateConfig) -> dict[str, Any]:
    documented: list[type[BaseModel]] = [
        *wire.REQUEST_OF_PATH.values(),
        *wire.RESPONSE_OF_PATH.values(),
        wire.ErrorBody,
    ]
    modes: list[tuple[type[BaseModel], JsonSchemaMode]] = [(m, "validation") for m in documented]
    _, top = models_json_schema(modes, ref_template=_REF)
    schemas: dict[str, Any] = top["$defs"]
    levels = list(config.levels)
    for path, request_model in wire.REQUEST_OF_PATH.items():
        properties = schemas[request_model.__name__]["properties"]
        served = [name for name in config.models if config.model(name).task == TASK_OF_PATH[path]]
        if served:  # a name outside these gets 404
            properties["model"]["enum"] = served
        properties["priority"] = {
            "description": properties["priority"].get("description", ""),
            "anyOf": [
                {"type": "string", "enum": levels},
                {"type": "integer", "minimum": 0, "maximum": len(levels) - 1},
                {"type": "null"},
            ],
        }
    return schemas


def _state_counts(replicas: list[Replica]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for replica in replicas:
        counts[replica.state.value] = counts.get(replica.state.value, 0) + 1
    return counts
