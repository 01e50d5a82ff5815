"""The gateway's HTTP API: OpenAI-compatible, with priorities, admission and routing.

Per request: authenticate (API key → class and cap), read only the fields the scheduler
needs (model, stream, priority, a token estimate), submit to the model's dispatcher (429
with Retry-After when refused), wait for a replica slot (504 on queue timeout, cancelled
when the client goes away), forward (retry once on another replica if nothing reached the
first), pass the answer through. Every request ends in exactly one counted outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tidegate.asgi import (
    SSE_DONE,
    ClientGone,
    error_response,
    install_error_handlers,
    json_body,
    sse,
    unless_disconnected,
)
from tidegate.config import KeySpec, TidegateConfig
from tidegate.core.request import Request as CoreRequest
from tidegate.errors import (
    InvalidRequest,
    ModelNotFound,
    NotReady,
    PriorityForbidden,
    PromptTooLong,
    ReplicaFailed,
    TidegateError,
    Unauthorized,
)
from tidegate.gateway.dispatcher import ModelDispatcher, Ticket
from tidegate.gateway.proxy import ConnectFailed, Forwarded, forward, replica_client
from tidegate.gateway.replicas import Replica
from tidegate.metrics import GatewayMetrics

log = logging.getLogger("tidegate.gateway")
WORKER_LEVELS = ("high", "medium", "low")  # the worker's local queue levels
TASK_OF_PATH = {
    "/v1/embeddings": "embeddings",
    "/v1/completions": "generate",
    "/v1/chat/completions": "generate",
}


@dataclass
class Gateway:
    """The gateway's state: config, one dispatcher per model, the client to replicas."""

    config: TidegateConfig
    replicas: dict[str, list[Replica]]
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    dispatchers: dict[str, ModelDispatcher] = field(default_factory=dict)
    client: aiohttp.ClientSession | None = None
    shutting_down: bool = False
    orchestrators: list[Any] = field(default_factory=list)  # start() / stop() replicas
    controller: Any = None  # control.controller.Controller when a model is autoscaled
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _release_waiters: set[asyncio.Event] = field(default_factory=set)

    def __post_init__(self) -> None:
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
            )

    def _released(self) -> None:
        self._changed.set()
        for waiter in self._release_waiters:
            waiter.set()

    def on_replica_change(self, replica: Replica) -> None:
        log.info("replica %s: %s %s", replica.id, replica.state.value, replica.detail)
        dispatcher = self.dispatchers.get(replica.model)
        if dispatcher is not None:
            dispatcher.wake()

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
        self.client = replica_client()
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
        if self.client is not None:
            await self.client.close()

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
        error = NotReady("the gateway is shutting down", code="shutting_down")
        return sum(d.fail_all(error) for d in self.dispatchers.values())

    def ready_models(self) -> list[str]:
        """Models that take requests: a replica is ready, or one cold-starts on demand."""
        return [
            m
            for m, rs in self.replicas.items()
            if any(r.ready for r in rs) or self.dispatchers[m].on_demand is not None
        ]


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
        _authenticate(config, request)
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

    @app.get("/admin/replicas")
    async def admin_replicas(request: Request) -> dict[str, Any]:
        _authenticate(config, request)
        return {
            model: {
                "queued": len(gateway.dispatchers[model].queue),
                "replicas": [replica.describe() for replica in replicas],
            }
            for model, replicas in gateway.replicas.items()
        }

    @app.get("/admin/autoscaler")
    async def admin_autoscaler(request: Request) -> dict[str, Any]:
        _authenticate(config, request)
        controller = gateway.controller
        if controller is None:
            return {"models": {}, "note": "no model is autoscaled in this configuration"}
        return {"models": controller.describe()}

    @app.get("/admin/defrag")
    async def admin_defrag_plan(request: Request) -> dict[str, Any]:
        _authenticate(config, request)
        controller = _controller(gateway)
        plan = controller.plan_defrag()
        return {
            "moves": [
                {"replica": m.replica_id, "from": m.from_device, "to": m.to_device}
                for m in plan.moves
            ],
            "frees": list(plan.freed_devices),
            "in_offpeak_window": controller.in_offpeak_window(),
        }

    @app.post("/admin/defrag")
    async def admin_defrag(request: Request, force: bool = False) -> JSONResponse:
        _authenticate(config, request)
        controller = _controller(gateway)
        if not force and not controller.in_offpeak_window():
            return JSONResponse(
                {
                    "status": "refused",
                    "reason": "outside the off-peak window (force=true overrides)",
                },
                409,
            )
        return JSONResponse(await controller.run_defrag())

    async def handle(request: Request) -> Response:
        return await _proxy(gateway, request)

    for path in TASK_OF_PATH:
        app.add_api_route(path, handle, methods=["POST"])
    return app


def _controller(gateway: Gateway) -> Any:
    if gateway.controller is None:
        raise InvalidRequest("no model is autoscaled or placed by the controller here")
    return gateway.controller


def _state_counts(replicas: list[Replica]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for replica in replicas:
        counts[replica.state.value] = counts.get(replica.state.value, 0) + 1
    return counts


# --------------------------------------------------------------------------- per request
@dataclass
class _Call:
    """What the gateway knows about one request while it is in flight."""

    rid: str
    model: str = "-"
    priority: str = "none"
    outcome: str | None = None
    started: float = field(default_factory=time.monotonic)
    queue_s: float = 0.0

    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.rid, "X-Tidegate-Queue-Ms": f"{self.queue_s * 1e3:.1f}"}


async def _proxy(gateway: Gateway, request: Request) -> Response:
    call = _Call(rid=request.headers.get("x-request-id") or f"req-{uuid.uuid4().hex}")
    try:
        response = await _admit_and_forward(gateway, request, call)
    except ClientGone:
        call.outcome = call.outcome or "cancelled"
        response = Response(status_code=499)
    except TidegateError as exc:
        call.outcome = call.outcome or _outcome_of(exc)
        response = error_response(exc, call.headers())
    except asyncio.CancelledError:  # the server is cancelling this handler
        call.outcome = call.outcome or "cancelled"
        _count(gateway, call)
        raise
    except Exception:  # a bug: the error handler answers 500; the outcome is still counted
        call.outcome = "failed"
        _count(gateway, call)
        raise
    if call.outcome != "streaming":  # a stream counts its outcome when it ends
        _count(gateway, call)
    return response


def _outcome_of(exc: TidegateError) -> str:
    if exc.code == "shutting_down":
        return "shutdown"
    if exc.status in (400, 401, 403, 404, 413):
        return "invalid"
    if exc.status == 429:
        return exc.code or "rejected_full"
    if exc.status == 504:
        return "expired"
    if exc.status == 503:
        return "rejected_unavailable"
    return "failed"


def _count(gateway: Gateway, call: _Call) -> None:
    gateway.metrics.requests.labels(call.model, call.priority, call.outcome).inc()


async def _admit_and_forward(gateway: Gateway, request: Request, call: _Call) -> Response:
    config = gateway.config
    key = _authenticate(config, request)
    if gateway.shutting_down:
        raise NotReady("the gateway is shutting down", code="shutting_down")
    raw = await request.body()
    if len(raw) > config.gateway.max_request_bytes:
        raise PromptTooLong(
            f"request body of {len(raw)} bytes is over the limit of "
            f"{config.gateway.max_request_bytes}"
        )
    payload = await json_body(request)
    if not isinstance(payload, dict):
        raise InvalidRequest("request body must be a JSON object")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model: a model name is required", param="model")
    if model not in gateway.dispatchers:
        raise ModelNotFound(f"model {model!r} does not exist; see /v1/models", param="model")
    call.model = model
    task = TASK_OF_PATH[request.url.path]
    spec = config.model(model)
    if spec.task != task:
        other = "/v1/embeddings" if spec.task == "embeddings" else "/v1/chat/completions"
        raise InvalidRequest(
            f"model {model} is a {spec.task} model; use {other}", param="model", code="wrong_task"
        )
    level = _priority(config, key, request, payload)
    call.priority = config.level_names[level] if not config.fifo else "fifo"
    stream = payload.get("stream") is True
    dispatcher = gateway.dispatchers[model]
    core = CoreRequest(call.rid, model, level, call.started, None, _estimate_tokens(payload))
    # The gateway's own field is not forwarded: some OpenAI-compatible servers refuse it.
    body = (
        raw
        if "priority" not in payload
        else json.dumps({k: v for k, v in payload.items() if k != "priority"}).encode()
    )
    ticket = dispatcher.submit(core)  # raises 429 / 503
    worker_level = WORKER_LEVELS[min(level, len(WORKER_LEVELS) - 1)]
    headers = {
        "content-type": "application/json",
        "x-tidegate-priority": worker_level,
        "x-request-id": call.rid,
    }
    connect_failures = 0
    while True:
        replica = await _wait_for_slot(dispatcher, request, ticket, call)
        try:
            forwarded = await _send(gateway, replica, request, body, headers, stream, call)
        except ConnectFailed as exc:
            connect_failures += 1
            if connect_failures > 1:
                dispatcher.release(replica, completed=False)
                call.outcome = "failed"
                raise ReplicaFailed(f"{model}: {exc}") from exc
            log.warning("%s: retrying on another replica: %s", call.rid, exc)
            gateway.metrics.retries.labels(model).inc()
            ticket = dispatcher.retry(ticket, replica)
            continue
        except BaseException as exc:
            dispatcher.release(replica, completed=False)
            call.outcome = (
                "cancelled" if isinstance(exc, ClientGone | asyncio.CancelledError) else "failed"
            )
            raise
        if _handed_back(forwarded):
            # A draining replica returned it unstarted: it goes back to the front of its
            # level in the gateway's queue, for another replica. Not a failure, no limit:
            # each replica drains once.
            log.info("%s: handed back by draining replica %s", call.rid, replica.id)
            ticket = dispatcher.retry(ticket, replica)
            continue
        return _respond(gateway, dispatcher, replica, forwarded, call)


def _handed_back(forwarded: Forwarded) -> bool:
    """A 503 ``draining`` answer: the replica did not start the request."""
    if forwarded.status != 503 or forwarded.body is None:
        return False
    try:
        error = json.loads(forwarded.body).get("error", {})
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == "draining"


async def _wait_for_slot(
    dispatcher: ModelDispatcher, request: Request, ticket: Ticket, call: _Call
) -> Replica:
    try:
        replica = await unless_disconnected(request, asyncio.shield(ticket.assigned))
    except (ClientGone, asyncio.CancelledError):
        # The client went away, or the server cancelled this handler: either way the
        # request must leave the queue (or give back the slot it was just handed).
        dispatcher.cancel(ticket)
        call.outcome = "cancelled"
        raise
    call.queue_s = time.monotonic() - call.started
    dispatcher.metrics.request_duration.labels(call.model, call.priority, "queue").observe(
        call.queue_s
    )
    return replica


async def _send(
    gateway: Gateway,
    replica: Replica,
    request: Request,
    body: bytes,
    headers: dict[str, str],
    stream: bool,
    call: _Call,
) -> Forwarded:
    assert gateway.client is not None
    url = f"{replica.url}{request.url.path}"
    observe = gateway.metrics.request_duration.labels(call.model, call.priority, "ttft").observe
    work = forward(
        gateway.client,
        url,
        body,
        headers,
        stream=stream,
        on_first_byte=lambda at: observe(at - call.started),
    )
    return await unless_disconnected(request, work)


def _respond(
    gateway: Gateway,
    dispatcher: ModelDispatcher,
    replica: Replica,
    forwarded: Forwarded,
    call: _Call,
) -> Response:
    headers = {**forwarded.headers, **call.headers()}
    e2e = gateway.metrics.request_duration.labels(call.model, call.priority, "e2e").observe
    if forwarded.chunks is None:
        dispatcher.release(replica, completed=forwarded.status < 500)
        call.outcome = (
            "completed"
            if forwarded.status < 400
            else ("invalid" if forwarded.status < 500 else "failed")
        )
        e2e(time.monotonic() - call.started)
        return Response(forwarded.body, forwarded.status, headers=headers)

    chunks = forwarded.chunks

    async def passthrough() -> AsyncIterator[bytes]:
        outcome = "cancelled"  # unless the stream runs to its end
        try:
            async for chunk in chunks:
                yield chunk
            outcome = "completed"
        except ReplicaFailed as exc:
            outcome = "failed"
            log.warning("%s: %s", call.rid, exc)
            yield sse(exc.body())
            yield SSE_DONE
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
            dispatcher.release(replica, completed=outcome == "completed")
            call.outcome = outcome
            e2e(time.monotonic() - call.started)
            _count(gateway, call)

    call.outcome = "streaming"  # counted when the stream ends, not now
    return StreamingResponse(
        passthrough(), forwarded.status, headers=headers, media_type="text/event-stream"
    )


# --------------------------------------------------------------------------- keys, priority
def _authenticate(config: TidegateConfig, request: Request) -> KeySpec | None:
    if config.open_service:
        return None
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("an API key is required: Authorization: Bearer <key>")
    key = config.key_for(token.strip())
    if key is None:
        raise Unauthorized("invalid API key")
    return key


def _priority(
    config: TidegateConfig, key: KeySpec | None, request: Request, payload: dict[str, Any]
) -> int:
    asked: Any = request.headers.get("x-priority")
    if asked is None:
        asked = payload.get("priority")
    default = key.default_level if key else config.default_level
    if asked is None:
        return default
    if isinstance(asked, bool) or not isinstance(asked, str | int):
        raise InvalidRequest("priority must be a level name or index", param="priority")
    try:
        level = config.parse_priority(asked)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="priority") from None
    if key is not None and level < key.max_level:
        raise PriorityForbidden(
            f"key {key.name} may ask for {key.max_priority} at most, not {asked}",
            param="priority",
        )
    return level


def _estimate_tokens(payload: dict[str, Any]) -> int:
    """A cheap token estimate for queue budgets: four characters per token, plus output."""
    chars = 0
    for field_name in ("input", "prompt"):
        value = payload.get(field_name)
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, list):
            chars += sum(len(v) for v in value if isinstance(v, str))
    for message in payload.get("messages") or []:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            chars += len(message["content"])
    max_tokens = payload.get("max_tokens") or payload.get("max_completion_tokens") or 0
    return chars // 4 + (max_tokens if isinstance(max_tokens, int) else 0) + 1
