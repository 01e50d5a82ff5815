"""The proxy loop of one request: admit, wait for a slot, forward, pass the answer through.

Per request: authenticate (API key → class and cap), validate the body once against its
endpoint's schema (``wire``) and take what the scheduler needs from it (model, stream,
priority, a token estimate), check the key's quota (429 with Retry-After when over it),
submit to the model's dispatcher (429 with Retry-After when refused), wait for a replica
slot (504 on queue timeout, cancelled when the client goes away), forward (retried on
another replica while nothing reached one, up to ``CONNECT_ATTEMPTS`` replicas), pass the
answer through. Every request ends
in exactly one counted outcome.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tidegate import wire
from tidegate.asgi import (
    CLIENT_CLOSED_REQUEST,
    SSE_DONE,
    ClientGone,
    ClientWatch,
    decode_json,
    sse,
)
from tidegate.config.values import RoutingSpec
from tidegate.core.request import Request as CoreRequest
from tidegate.errors import (
    InvalidRequest,
    ModelNotFound,
    NotReady,
    PromptTooLong,
    ReplicaFailed,
    TidegateError,
)
from tidegate.fastroute import Reply, error_reply
from tidegate.gateway.auth import authenticate, request_tenant, requested_level
from tidegate.gateway.dispatcher import ModelDispatcher, Ticket
from tidegate.gateway.proxy import ConnectFailed, Forwarded, ReplicaGone, forward
from tidegate.gateway.replicas import Replica
from tidegate.gateway.state import Gateway

log = logging.getLogger("tidegate.gateway")
WORKER_LEVELS = ("high", "medium", "low")  # the worker's local queue levels
TENANT_HEADER = "x-tidegate-tenant"  # to tidegate's own workers: whose request it is
PREEMPT_HEADER = "x-tidegate-preempt"  # and whose sequence it pauses (fair preemption)
# A request no replica could take before any byte is tried on this many, each one another
# while one serves its level: a lost node takes all its replicas at once, and the first
# retry may land on one of them before the orchestrator has marked it (Envoy: num_retries
# with the previous-hosts predicate).
CONNECT_ATTEMPTS = 3
TASK_OF_PATH = {
    "/v1/embeddings": "embeddings",
    "/v1/completions": "generate",
    "/v1/chat/completions": "generate",
}


@dataclass
class _Call:
    """What the gateway knows about one request while it is in flight."""

    rid: str  # the client's X-Request-Id, else ``key``: in logs and both answers' headers
    key: str  # unique: the scheduler's id of it (queue, tickets): "<X-Request-Id>~<random>"
    watch: ClientWatch
    model: str = "-"
    priority: str = "none"
    outcome: str | None = None
    started: float = field(default_factory=time.monotonic)
    queue_s: float = 0.0

    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.rid, "X-Tidegate-Queue-Ms": f"{self.queue_s * 1e3:.1f}"}

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        return [
            (b"x-request-id", self.rid.encode("latin-1")),
            (b"x-tidegate-queue-ms", f"{self.queue_s * 1e3:.1f}".encode()),
        ]


OWN_HEADERS = {b"x-request-id", b"x-tidegate-queue-ms"}  # the gateway's, never the replica's


class _Passed(Response):
    """A whole answer passed on as it is: its headers are already ASGI's, so none of
    ``Response``'s own header building."""

    def __init__(self, status: int, raw_headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status_code = status
        self.body = body
        self.background = None
        self.raw_headers = [*raw_headers, (b"content-length", str(len(body)).encode())]


async def serve_proxy(gateway: Gateway, scope: Scope, receive: Receive, send: Send) -> None:
    """The proxy routes as a bare ASGI app, for a gateway served by an ASGI server that is
    not ``tidegate serve``'s (tests run it in process): the gateway's app hands them over
    before any routing, middleware or dependency resolution of FastAPI's. ``tidegate
    serve`` takes them off the HTTP protocol before ASGI (``gateway.http``). The routes stay
    registered with FastAPI for the OpenAPI document."""
    request = Request(scope, receive)
    reply = await proxy_call(gateway, scope["path"], request.headers, await request.body(), receive)
    try:
        await asgi_response(reply)(scope, receive, send)
    finally:
        reply.settle()


async def proxy_request(gateway: Gateway, request: Request) -> Response:
    """The proxy loop for a Starlette request (FastAPI's route, for the document)."""
    body = await request.body()
    reply = await proxy_call(gateway, request.url.path, request.headers, body, request.receive)
    reply.settle()
    return asgi_response(reply)


def asgi_response(reply: Reply) -> Response:
    if reply.chunks is None:
        return _Passed(reply.status, reply.headers, reply.body)
    return StreamingResponse(
        reply.chunks,
        reply.status,
        headers={n.decode("latin-1"): v.decode("latin-1") for n, v in reply.headers},
        media_type="text/event-stream",
    )


async def proxy_call(
    gateway: Gateway, path: str, headers: Mapping[str, str], body: bytes, receive: Receive
) -> Reply:
    """One request to a proxy route, from its (lower-case) headers and whole body to its
    answer; ``receive`` shows the client going away. Never raises but for cancellation: a
    bug is logged and answered 500, and every outcome is counted once."""
    # A client's X-Request-Id is its own to reuse: it names the request (and starts its key,
    # for an operator reading the queue), never keys it alone.
    named = headers.get("x-request-id")
    key = f"{named}~{os.urandom(8).hex()}" if named else f"req-{os.urandom(16).hex()}"
    call = _Call(rid=named or key, key=key, watch=ClientWatch(receive))
    try:
        reply = await _admit_and_forward(gateway, path, headers, body, call)
    except ClientGone:
        call.outcome = call.outcome or "cancelled"
        reply = Reply(CLIENT_CLOSED_REQUEST, [])
    except TidegateError as exc:
        call.outcome = call.outcome or outcome_of(exc)
        reply = error_reply(exc, call.headers())
    except asyncio.CancelledError:  # the server is cancelling this handler
        call.outcome = call.outcome or "cancelled"
        _count(gateway, call)
        raise
    except Exception:  # a bug: 500, the details for the log only; still counted
        call.outcome = "failed"
        log.exception("unexpected error on POST %s", path)
        reply = error_reply(
            TidegateError("internal error: the server failed on this request; it is logged")
        )
    finally:
        call.watch.close()  # the answer's own sending watches the client from here
    if call.outcome == "streaming":  # a stream counts its outcome when it ends
        return reply
    settle = reply.after

    def account() -> None:
        if settle is not None:
            settle()
        _count(gateway, call)

    reply.after = account  # the caller runs it once the answer is written (or cannot be)
    return reply


def outcome_of(exc: TidegateError) -> str:
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
    gateway.metrics.count(call.model, call.priority, str(call.outcome))


async def _admit_and_forward(
    gateway: Gateway, path: str, headers_in: Mapping[str, str], raw: bytes, call: _Call
) -> Reply:
    config = gateway.config
    key = authenticate(config, headers_in)
    if gateway.shutting_down:
        raise NotReady("the gateway is shutting down", code="shutting_down")
    if len(raw) > config.gateway.max_request_bytes:
        raise PromptTooLong(
            f"request body of {len(raw)} bytes is over the limit of "
            f"{config.gateway.max_request_bytes}"
        )
    # Validated once, here, with the worker's own schema: a bad request never waits in the
    # queue, and what reaches a replica is a request it accepts (bar model-specific limits).
    payload = decode_json(raw)
    name = payload.get("model") if isinstance(payload, dict) else None
    named = gateway.config.models.get(name) if isinstance(name, str) else None
    schemas = (
        wire.UPSTREAM_REQUEST_OF_PATH
        if named is not None and not named.tidegate_workers
        else wire.REQUEST_OF_PATH
    )
    parsed = wire.parse(schemas[path], payload)
    model = parsed.model
    if model not in gateway.dispatchers:
        raise ModelNotFound(f"model {model!r} does not exist; see /v1/models", param="model")
    call.model = model
    task = TASK_OF_PATH[path]
    spec = config.model(model)
    if spec.task != task:
        other = "/v1/embeddings" if spec.task == "embeddings" else "/v1/chat/completions"
        raise InvalidRequest(
            f"model {model} is a {spec.task} model; use {other}", param="model", code="wrong_task"
        )
    level = requested_level(config, key, headers_in, {"priority": parsed.priority})
    call.priority = config.level_names[level] if not config.fifo else "fifo"
    stream = not isinstance(parsed, wire.EmbeddingsRequest) and parsed.stream
    dispatcher = gateway.dispatchers[model]
    tenant = request_tenant(config, key, headers_in)  # 400 on a bad trusted header
    core = CoreRequest(
        call.key, model, level, call.started, None, estimate_tokens(parsed), tenant=tenant
    )
    try:  # before the queue: a key over its quota displaces nobody
        quota = gateway.quotas.check(key, core.cost_tokens)
    except TidegateError:
        call.outcome = "rejected_quota"
        raise
    # The client's bytes go on as they came, but for the gateway's own field: some
    # OpenAI-compatible servers refuse it.
    body = (
        raw
        if "priority" not in payload
        else json.dumps({k: v for k, v in payload.items() if k != "priority"}).encode()
    )
    ticket = dispatcher.submit(core, _prefix_key(spec.routing, parsed))  # raises 429 / 503
    gateway.quotas.charge(key, quota)  # admitted: now it spends its key's quota
    worker_level = WORKER_LEVELS[min(level, len(WORKER_LEVELS) - 1)]
    headers = {
        "content-type": "application/json",
        "x-tidegate-priority": worker_level,
        "x-request-id": call.rid,
    }
    if tenant and spec.tidegate_workers and task == "generate":
        headers[TENANT_HEADER] = tenant  # its sequence queue shares a level by it (fairness)
    connect_failures = 0
    while True:
        replica = await _wait_for_slot(dispatcher, ticket, call)
        sent = headers if ticket.preempt is None else {**headers, PREEMPT_HEADER: ticket.preempt}
        try:
            forwarded = await _send(gateway, replica, path, body, sent, stream, call)
        except ConnectFailed as exc:
            if not isinstance(exc, ReplicaGone):
                dispatcher.record_answer(replica, ok=False)
            connect_failures += 1
            if connect_failures >= CONNECT_ATTEMPTS:
                dispatcher.release(replica, completed=False, request=ticket.request)
                call.outcome = "failed"
                log.warning("%s: replica %s unreachable too: %s", call.rid, replica.id, exc)
                raise ReplicaFailed(
                    f"model {model}: replica {replica.id} could not be reached, nor the "
                    "replicas tried before it"
                ) from exc
            log.warning("%s: retrying on another replica: %s", call.rid, exc)
            gateway.metrics.retries.labels(model).inc()
            ticket = dispatcher.retry(ticket, replica)
            continue
        except BaseException as exc:
            if isinstance(exc, ReplicaFailed):  # cut mid-answer; a client gone is no vote
                dispatcher.record_answer(replica, ok=False)
            dispatcher.release(replica, completed=False, request=ticket.request)
            if isinstance(exc, NotReady):  # shutdown's cut-off (Gateway.until_cut_off)
                call.outcome = outcome_of(exc)
            else:
                cancelled = isinstance(exc, ClientGone | asyncio.CancelledError)
                call.outcome = "cancelled" if cancelled else "failed"
            raise
        if _handed_back(forwarded):
            # A draining replica returned it unstarted: it goes back to the front of its
            # level in the gateway's queue, for another replica. Not a failure, no limit:
            # each replica drains once.
            log.info("%s: handed back by draining replica %s", call.rid, replica.id)
            ticket = dispatcher.retry(ticket, replica)
            continue
        return _respond(gateway, dispatcher, ticket, replica, forwarded, call)


def _handed_back(forwarded: Forwarded) -> bool:
    """A 503 ``draining`` answer: the replica did not start the request."""
    if forwarded.status != 503 or forwarded.body is None:
        return False
    try:
        error = json.loads(forwarded.body).get("error", {})
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == "draining"


async def _wait_for_slot(dispatcher: ModelDispatcher, ticket: Ticket, call: _Call) -> Replica:
    try:
        if ticket.assigned.done():  # a slot was free: no wait to watch
            replica = ticket.assigned.result()
        else:
            async with call.watch:
                replica = await asyncio.shield(ticket.assigned)
    except (ClientGone, asyncio.CancelledError):
        # The client went away, or the server cancelled this handler: either way the
        # request must leave the queue (or give back the slot it was just handed).
        dispatcher.cancel(ticket)
        call.outcome = "cancelled"
        raise
    call.queue_s = time.monotonic() - call.started
    dispatcher.metrics.observe(call.model, call.priority, "queue", call.queue_s)
    return replica


async def _send(
    gateway: Gateway,
    replica: Replica,
    path: str,
    body: bytes,
    headers: dict[str, str],
    stream: bool,
    call: _Call,
) -> Forwarded:
    if replica.url is None or not replica.ready:  # it died while this handler woke up
        raise ReplicaGone(f"replica {replica.id} stopped before the request was sent")
    if replica.auth_headers:
        headers = {**headers, **replica.auth_headers}
    try:
        # Shutdown's deadline answers 503; a client gone cancels the forward.
        async with gateway.until_cut_off(call.watch):
            return await forward(
                gateway.pool,
                replica.url,
                path,
                body,
                headers,
                stream=stream,
                on_first_byte=_ttft_observer(gateway, call) if stream else None,
            )
    except ReplicaFailed as exc:
        raise ReplicaFailed(f"replica {replica.id}: {exc.message}") from exc


def _ttft_observer(gateway: Gateway, call: _Call) -> Callable[[float], None]:
    """A stream's time to its first chunk with content (a whole answer's: its head)."""
    metrics = gateway.metrics
    return lambda at: metrics.observe(call.model, call.priority, "ttft", at - call.started)


def _respond(
    gateway: Gateway,
    dispatcher: ModelDispatcher,
    ticket: Ticket,
    replica: Replica,
    forwarded: Forwarded,
    call: _Call,
) -> Reply:
    headers = [(n, v) for n, v in forwarded.headers if n not in OWN_HEADERS]
    headers += call.raw_headers()
    metrics = gateway.metrics

    def e2e(seconds: float) -> None:
        metrics.observe(call.model, call.priority, "e2e", seconds)

    status = forwarded.status
    if forwarded.chunks is None:
        call.outcome = "completed" if status < 400 else ("invalid" if status < 500 else "failed")

        def account() -> None:  # once the answer is on its way: off the client's wait
            # A whole answer's first byte is its head.
            metrics.observe(call.model, call.priority, "ttft", forwarded.head_at - call.started)
            dispatcher.record_answer(replica, ok=status < 500)  # outlier detection
            if status < 400:
                dispatcher.settle(ticket.request, forwarded.body)  # fair sharing: usage served
            dispatcher.release(replica, completed=status < 500, request=ticket.request)
            e2e(time.monotonic() - call.started)

        return Reply(status, headers, forwarded.body or b"", after=account)

    dispatcher.record_answer(replica, ok=status < 500)  # outlier detection
    chunks = forwarded.chunks

    async def passthrough() -> AsyncIterator[bytes]:
        outcome = "cancelled"  # unless the stream runs to its end
        try:
            while True:
                # Shutdown's deadline ends the stream with an error event; the scope covers
                # the read only, never the yield (it cancels the task that entered it).
                async with gateway.until_cut_off():
                    chunk = await anext(chunks, None)
                if chunk is None:
                    break
                yield chunk
            outcome = "completed"
        except ReplicaFailed as exc:
            outcome = "failed"
            dispatcher.record_answer(replica, ok=False)
            log.warning("%s: %s", call.rid, exc)
            yield sse(exc.body())
            yield SSE_DONE
        except NotReady as exc:  # cut off by shutdown
            outcome = outcome_of(exc)
            yield sse(exc.body())
            yield SSE_DONE
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
            dispatcher.release(replica, completed=outcome == "completed", request=ticket.request)
            call.outcome = outcome
            e2e(time.monotonic() - call.started)
            _count(gateway, call)

    call.outcome = "streaming"  # counted when the stream ends, not now
    return Reply(forwarded.status, headers, chunks=passthrough())


def _prefix_key(routing: RoutingSpec, body: wire.EndpointRequest) -> int | None:
    """The prompt's prefix key, for a model routed by prefix affinity (core.prefix)."""
    if routing.affinity is None or isinstance(body, wire.EmbeddingsRequest):
        return None
    if isinstance(body, wire.CompletionRequest):
        return routing.prefix_key(body.prompt_text())
    return routing.prefix_key("".join(f"{m.role}\n{m.text()}\n" for m in body.messages))


def estimate_tokens(body: wire.EndpointRequest) -> int:
    """A cheap token estimate for queue budgets: four characters per token, plus output.

    From a validated request, so every term is bounded and the sum is at least 1.
    """
    output = 0
    if isinstance(body, wire.EmbeddingsRequest):
        items = [body.input] if isinstance(body.input, str) else body.input
        chars = 0
        for item in items:
            # A list of token ids is its own count: four "characters" a token.
            chars += len(item) if isinstance(item, str) else 4 * _num_ids(item)
    elif isinstance(body, wire.CompletionRequest):
        chars = len(body.prompt_text())
        output = (body.max_tokens or 0) * body.n
    else:
        chars = sum(len(message.text()) for message in body.messages)
        output = (body.output_limit() or 0) * body.n
    return chars // 4 + output + 1


def _num_ids(item: int | list[int]) -> int:
    return len(item) if isinstance(item, list) else 1
