"""The worker's HTTP API: OpenAI-compatible endpoints of one engine replica.

The gateway treats a worker exactly like a vLLM server. Extra: ``/stats`` (what the gateway
needs for flow control), ``/readyz`` gated on warm-up, the ``X-Tidegate-Priority`` header
that orders the worker's local queue, ``X-Tidegate-Tenant``, the tenant the gateway
forwards, by which the generation queue shares a level when fair sharing is on, and
``X-Tidegate-Preempt``, a tenant one of whose decoding sequences pauses for this one (the
gateway's fair-sharing preemption; ``SequenceScheduler.stream``).

``on_fatal`` is called when the worker can serve nothing more: its engine failed to start,
or died later (``Worker.fail``). The server then exits non-zero, so that it is replaced.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Receive

from tidegate import wire
from tidegate.asgi import (
    CLIENT_CLOSED_REQUEST,
    SSE_DONE,
    SSE_HEADERS,
    ClientGone,
    decode_json,
    install_error_handlers,
    json_body,
    sse,
    unless_disconnected,
    unless_gone,
)
from tidegate.engines.base import (
    GREEDY_BELOW,
    EmbeddingEngine,
    Engine,
    GenerationEngine,
    ModelCard,
    SamplingParams,
    TokenEvent,
    Vector,
)
from tidegate.engines.process import Counting, ProcessEmbeddingEngine, wants_engine_process
from tidegate.engines.registry import build_engine
from tidegate.errors import (
    InvalidRequest,
    ModelNotFound,
    NotReady,
    Overloaded,
    PromptTooLong,
    TidegateError,
)
from tidegate.fastroute import FastRoutes, Reply, error_reply, json_reply
from tidegate.worker.runtime import (
    MAX_TENANT_CHARS,
    TENANT_RE,
    WORKER_LEVELS,
    Worker,
    WorkerSettings,
)

log = logging.getLogger("tidegate.worker")
PRIORITY_HEADER = "x-tidegate-priority"
TENANT_HEADER = "x-tidegate-tenant"
PREEMPT_HEADER = "x-tidegate-preempt"
DEFAULT_LEVEL = 1  # medium, as the gateway's default for keyless requests
LEVEL_NAMES = [spec.name for spec in WORKER_LEVELS]
CHAT_DEFAULT_MAX_TOKENS = 256


def default_engine_factory(settings: WorkerSettings) -> Engine:
    """The engine of ``settings``, in this process or in one of its own (engine_process)."""
    build = functools.partial(
        build_engine,
        settings.model,
        settings.engine,
        model_path=settings.model_path,
        device=settings.device,
        profile=settings.profile,
        task=settings.task,
        seed=settings.seed,
        max_num_seqs=settings.max_num_seqs,
        memory_fraction=settings.memory_fraction,
        threads=settings.engine_threads,
    )
    engine = build()
    if not wants_engine_process(settings.engine_process, engine.card):
        return engine
    assert isinstance(engine, Counting)  # every embedding engine counts without loading
    return ProcessEmbeddingEngine(build, engine)


def create_app(
    settings: WorkerSettings,
    engine_factory: Callable[[WorkerSettings], Engine] = default_engine_factory,
    on_fatal: Callable[[], None] | None = None,
) -> FastAPI:
    worker = Worker(settings, on_fatal=on_fatal)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def start() -> None:
            try:
                await worker.start(engine_factory)
            except Exception:
                if on_fatal is not None:
                    on_fatal()

        starter = asyncio.create_task(start(), name="worker-start")
        try:
            yield
        finally:
            starter.cancel()
            await asyncio.gather(starter, return_exceptions=True)
            await worker.stop()

    app = FastAPI(title="tidegate worker", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.worker = worker
    install_error_handlers(app)

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        body: dict[str, Any] = {"status": worker.phase, "model": settings.model}
        if worker.error:
            body["error"] = worker.error
        return JSONResponse(body, 200 if worker.ready else 503)

    @app.post("/admin/drain")
    async def drain() -> dict[str, Any]:
        """Scale-in: take no new request, and hand back what has not started.

        What waits in this worker's queue gets 503 ``draining`` (the gateway puts it back in
        its own queue for another replica); running batches and sequences finish.
        """
        return {"status": "draining", "returned": worker.drain()}

    @app.get("/metrics")
    async def metrics() -> Response:
        _refresh_gauges(worker)
        return Response(generate_latest(worker.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return _stats(worker)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_entry(worker)]}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        # ``tidegate worker`` serves this route off the HTTP protocol (``fast_routes``);
        # this is the same work for an ASGI server (in-process tests, the document).
        body = await request.body()
        return JSONResponse(await _embed(worker, request.headers, body, request.receive))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = wire.parse(wire.CompletionRequest, await json_body(request))
        engine = cast(GenerationEngine, _engine_for(worker, body.model, "generate"))
        prompt_ids = _some_tokens(_tokenized(worker, engine.encode, body.prompt_text()), "prompt")
        params = _sampling(body, body.max_tokens, engine.card, len(prompt_ids), 16)
        return await _generate(request, worker, body, prompt_ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = wire.parse(wire.ChatCompletionRequest, await json_body(request))
        engine = cast(GenerationEngine, _engine_for(worker, body.model, "generate"))
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt_ids = _some_tokens(_tokenized(worker, engine.encode_chat, messages), "messages")
        default = min(CHAT_DEFAULT_MAX_TOKENS, engine.card.max_output_tokens)
        params = _sampling(body, body.output_limit(), engine.card, len(prompt_ids), default)
        return await _generate(request, worker, body, prompt_ids, params, chat=True)

    return app


# --------------------------------------------------------------------------- validation
_In = TypeVar("_In")
_Out = TypeVar("_Out")


async def _embed(
    worker: Worker, headers: Mapping[str, str], raw: bytes, receive: Receive
) -> dict[str, Any]:
    """One embeddings request, from its body to its answer's JSON; raises TidegateError."""
    body = wire.parse(wire.EmbeddingsRequest, decode_json(raw))
    engine = cast(EmbeddingEngine, _engine_for(worker, body.model, "embeddings"))
    priority = _priority(headers)
    texts = _texts(body, engine.card)
    tokens = _tokenized(worker, engine.count_tokens, texts)
    for index, count in enumerate(tokens):
        if count > engine.card.max_context_tokens:
            raise PromptTooLong(
                f"input[{index}] has {count} tokens; {engine.card.name} accepts at most "
                f"{engine.card.max_context_tokens}",
                param="input",
            )
    assert worker.batcher is not None
    started = time.monotonic()
    with _outcome(worker, priority) as outcome:
        vectors = await unless_gone(receive, worker.batcher.embed(texts, tokens, priority))
        outcome.observe_e2e(time.monotonic() - started)
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}
    worker.metrics.tokens.labels(worker.settings.model, "prompt").inc(sum(tokens))
    return {"object": "list", "data": data, "model": body.model, "usage": usage}


def fast_routes(app: FastAPI, max_bytes: int, body_timeout_s: float) -> FastRoutes:
    """``POST /v1/embeddings`` of ``app``'s worker, served by the HTTP protocol itself
    (``tidegate.fastroute``): on a CPU the HTTP work shares the cores with the model."""
    worker: Worker = app.state.worker

    async def handle(path: str, headers: Mapping[str, str], body: bytes, receive: Receive) -> Reply:
        try:
            answer = await _embed(worker, headers, body, receive)
        except ClientGone:
            gone = TidegateError("the client closed the connection", code="client_closed_request")
            return json_reply(CLIENT_CLOSED_REQUEST, gone.body())
        except TidegateError as exc:
            return error_reply(exc)
        except Exception:  # a bug: 500, the details for the log only
            log.exception("unexpected error on POST %s", path)
            return error_reply(
                TidegateError("internal error: the server failed on this request; it is logged")
            )
        return Reply(200, [(b"content-type", b"application/json")], _json_bytes(answer))

    return FastRoutes(
        paths=frozenset({b"/v1/embeddings"}),
        handler=handle,
        max_bytes=max_bytes,
        body_timeout_s=body_timeout_s,
    )


def _json_bytes(content: Any) -> bytes:
    """As Starlette's JSONResponse renders it."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


def _tokenized(worker: Worker, tokenize: Callable[[_In], _Out], value: _In) -> _Out:
    """``tokenize(value)``, timed into tidegate_tokenize_seconds (failures took time too)."""
    started = time.perf_counter()
    try:
        return tokenize(value)
    finally:
        elapsed_s = time.perf_counter() - started
        worker.metrics.tokenize.labels(worker.settings.model).observe(elapsed_s)


def _engine_for(worker: Worker, model: str, task: str) -> Engine:
    if model != worker.settings.model:
        raise ModelNotFound(
            f"model {model!r} is not served here; this worker serves {worker.settings.model!r}",
            param="model",
        )
    if worker.phase == "failed":
        raise NotReady(
            f"model {model}: the engine of this replica failed; it is being replaced",
            code="engine_failed",
            retry_after_s=1.0,
        )
    if not worker.ready or worker.engine is None:
        code = "draining" if worker.phase == "draining" else "not_ready"
        raise NotReady(f"model {model} is {worker.phase}", code=code, retry_after_s=1.0)
    engine = worker.engine
    if engine.card.task != task:
        other = "/v1/embeddings" if engine.card.task == "embeddings" else "/v1/completions"
        raise InvalidRequest(
            f"model {model} is a{'n' if task == 'generate' else ''} "
            f"{engine.card.task} model; use {other}",
            param="model",
            code="wrong_task",
        )
    return engine


def _some_tokens(prompt_ids: list[int], param: str) -> list[int]:
    """A prompt of no tokens has nothing to continue from (and would kill the engine's loop)."""
    if not prompt_ids:
        raise InvalidRequest(
            f"the {param} is empty: it encodes to 0 tokens; give at least one",
            param=param,
            code="empty_prompt",
        )
    return prompt_ids


def _priority(headers: Mapping[str, str]) -> int:
    raw = headers.get(PRIORITY_HEADER)
    if raw is None:
        return DEFAULT_LEVEL
    value = raw.strip().lower()
    if value in LEVEL_NAMES:
        return LEVEL_NAMES.index(value)
    if value.isascii() and value.isdigit() and int(value) < len(LEVEL_NAMES):
        return int(value)
    raise InvalidRequest(
        f"X-Tidegate-Priority must be one of {', '.join(LEVEL_NAMES)} or 0..{len(LEVEL_NAMES) - 1}",
        param="X-Tidegate-Priority",
    )


def _tenant(headers: Mapping[str, str], name: str = TENANT_HEADER) -> str:
    """The tenant the gateway forwards in header ``name``; "" (the anonymous tenant, or no
    preemption) when it sends none."""
    raw = headers.get(name, "")
    if raw and not TENANT_RE.fullmatch(raw):
        param = "-".join(part.capitalize() for part in name.split("-"))  # X-Tidegate-...
        raise InvalidRequest(
            f"{param} must be 1-{MAX_TENANT_CHARS} printable ASCII characters without spaces",
            param=param,
            code="invalid_tenant",
        )
    return raw


def _texts(body: wire.EmbeddingsRequest, card: ModelCard) -> list[str]:
    raw = body.input
    if isinstance(raw, str):
        texts = [raw]
    elif all(isinstance(item, str) for item in raw):
        texts = [str(item) for item in raw]
    else:
        raise InvalidRequest("token-id inputs are not supported; send text", param="input")
    if len(texts) > card.max_inputs:
        raise InvalidRequest(
            f"{len(texts)} inputs; at most {card.max_inputs} per request", param="input"
        )
    if body.dimensions is not None and body.dimensions != card.dimensions:
        raise InvalidRequest(
            f"{card.name} returns {card.dimensions} dimensions; it cannot return {body.dimensions}",
            param="dimensions",
        )
    return texts


def _sampling(
    body: wire.CompletionRequest | wire.ChatCompletionRequest,
    max_tokens: int | None,
    card: ModelCard,
    prompt_tokens: int,
    default_max_tokens: int,
) -> SamplingParams:
    if prompt_tokens >= card.max_context_tokens:
        raise PromptTooLong(
            f"prompt has {prompt_tokens} tokens; {card.name}'s context is "
            f"{card.max_context_tokens} tokens",
            param="messages" if isinstance(body, wire.ChatCompletionRequest) else "prompt",
        )
    limit = min(card.max_output_tokens, card.max_context_tokens - prompt_tokens)
    wanted = max_tokens if max_tokens is not None else min(default_max_tokens, limit)
    if wanted > limit:
        raise InvalidRequest(
            f"max_tokens={wanted} is above the limit of {limit} for this prompt "
            f"({prompt_tokens} prompt tokens, context {card.max_context_tokens}, "
            f"output at most {card.max_output_tokens})",
            param="max_tokens",
        )
    if body.seed is not None and body.temperature >= GREEDY_BELOW and not card.per_request_seed:
        # Accepting it would promise reproducible text that this engine cannot give.
        raise InvalidRequest(
            f"{card.name} cannot honour seed when sampling (temperature > 0): its engine "
            "samples all running sequences from one shared random generator, so a "
            "sequence's draws depend on the others in the batch; send temperature 0 "
            "(greedy decoding is deterministic) or leave seed out",
            param="seed",
            code="seed_not_supported",
        )
    return SamplingParams(
        max_tokens=wanted,
        temperature=body.temperature,
        top_p=body.top_p,
        stop=tuple(body.stop_list()),
        seed=body.seed,
    )


# --------------------------------------------------------------------------- generation
async def _generate(
    request: Request,
    worker: Worker,
    body: wire.CompletionRequest | wire.ChatCompletionRequest,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    chat: bool,
) -> Response:
    assert worker.sequences is not None
    priority = _priority(request.headers)
    tenant = _tenant(request.headers)
    preempt = _tenant(request.headers, PREEMPT_HEADER)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    chunks = _Chunks(rid, body.model, created, chat)
    usage = {"prompt_tokens": len(prompt_ids)}
    events = worker.sequences.stream(rid, prompt_ids, params, priority, tenant, preempt)
    if not body.stream:
        started = time.monotonic()
        with _outcome(worker, priority) as outcome:
            text, made, finish = await unless_disconnected(request, _collect(events))
            outcome.observe_e2e(time.monotonic() - started)
        _count_tokens(worker, len(prompt_ids), made)
        usage |= {"completion_tokens": made, "total_tokens": len(prompt_ids) + made}
        return JSONResponse(chunks.whole(text, finish, usage))

    # Streaming: admission errors must surface as a status code, before the first byte.
    first = await _first_event(worker, priority, events)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def body_iter() -> AsyncIterator[bytes]:
        started = time.monotonic()
        made = 0
        with _outcome(worker, priority) as outcome:
            try:
                if chat:
                    yield sse(chunks.delta({"role": "assistant", "content": ""}, None))
                event: TokenEvent | None = first
                while event is not None:
                    if made == 0:
                        outcome.observe("ttft", time.monotonic() - started)
                    made = event.num_tokens
                    content = {"content": event.text} if chat else event.text
                    yield sse(chunks.delta(content, event.finish_reason))
                    event = await anext(events, None)
                if include_usage:
                    usage.update(completion_tokens=made, total_tokens=len(prompt_ids) + made)
                    yield sse(chunks.usage_only(usage))
                yield SSE_DONE
                outcome.observe_e2e(time.monotonic() - started)
            except TidegateError as exc:
                outcome.fail(exc)
                yield sse(exc.body())
                yield SSE_DONE
            finally:
                await events.aclose()
                _count_tokens(worker, len(prompt_ids), made)

    return StreamingResponse(body_iter(), media_type="text/event-stream", headers=SSE_HEADERS)


async def _first_event(
    worker: Worker, priority: int, events: AsyncIterator[TokenEvent]
) -> TokenEvent | None:
    try:
        return await anext(events, None)
    except TidegateError as exc:
        worker.metrics.count(worker.settings.model, LEVEL_NAMES[priority], _outcome_name(exc))
        raise


async def _collect(events: AsyncIterator[TokenEvent]) -> tuple[str, int, str | None]:
    parts: list[str] = []
    made = 0
    finish: str | None = None
    async for event in events:
        parts.append(event.text)
        made = event.num_tokens
        finish = event.finish_reason
    return "".join(parts), made, finish


class _Chunks:
    """OpenAI response shapes of one completion, whole or as stream chunks."""

    def __init__(self, rid: str, model: str, created: int, chat: bool) -> None:
        self.rid, self.model, self.created, self.chat = rid, model, created, chat

    def _envelope(self, suffix: str) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.rid,
            "object": kind + suffix,
            "created": self.created,
            "model": self.model,
        }

    def whole(self, text: str, finish: str | None, usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._envelope("") | {"choices": [choice], "usage": usage}

    def delta(self, content: Any, finish: str | None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish}
            return self._envelope(".chunk") | {"choices": [choice]}
        choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish}
        return self._envelope("") | {"choices": [choice]}

    def usage_only(self, usage: dict[str, int]) -> dict[str, Any]:
        suffix = ".chunk" if self.chat else ""
        return self._envelope(suffix) | {"choices": [], "usage": usage}


# --------------------------------------------------------------------------- accounting
class _Outcome:
    """Counts one request's terminal outcome exactly once."""

    def __init__(self, worker: Worker, priority: int) -> None:
        self.model = worker.settings.model
        self.priority = LEVEL_NAMES[priority]
        self.metrics = worker.metrics
        self.name: str | None = None

    def observe(self, phase: str, seconds: float) -> None:
        self.metrics.observe(self.model, self.priority, phase, seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.observe("e2e", seconds)
        self.name = self.name or "completed"

    def fail(self, exc: BaseException) -> None:
        self.name = self.name or _outcome_name(exc)


def _outcome_name(exc: BaseException) -> str:
    if isinstance(exc, ClientGone | asyncio.CancelledError | GeneratorExit):
        return "cancelled"
    if isinstance(exc, Overloaded):
        return exc.code or "rejected_full"
    return "failed"


@contextlib.contextmanager
def _outcome(worker: Worker, priority: int) -> Any:
    outcome = _Outcome(worker, priority)
    try:
        yield outcome
    except BaseException as exc:
        outcome.fail(exc)
        raise
    finally:
        outcome.name = outcome.name or "cancelled"  # a stream closed without finishing
        worker.metrics.count(outcome.model, outcome.priority, outcome.name)


def _count_tokens(worker: Worker, prompt: int, completion: int) -> None:
    worker.metrics.tokens.labels(worker.settings.model, "prompt").inc(prompt)
    worker.metrics.tokens.labels(worker.settings.model, "completion").inc(completion)


def _encode(vector: Vector, encoding_format: str) -> list[float] | str:
    """One row of an engine's float32 vectors: its bytes in base64, or Python floats."""
    if encoding_format == "base64":
        return base64.b64encode(vector.data).decode()
    floats: list[float] = vector.tolist()
    return floats


def _model_entry(worker: Worker) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "id": worker.settings.model,
        "object": "model",
        "created": 0,
        "owned_by": "tidegate",
        "ready": worker.ready,
    }
    if worker.engine is not None:
        card = worker.engine.card
        entry |= {
            "task": card.task,
            "engine": card.engine,
            "synthetic": card.synthetic,
            "description": card.description,
            "max_model_len": card.max_context_tokens,
        }
    return entry


def _stats(worker: Worker) -> dict[str, Any]:
    now = time.monotonic()
    s = worker.settings
    base: dict[str, Any] = {"model": s.model, "phase": worker.phase, "ready": worker.ready}
    base["engine_threads"] = s.engine_threads  # None: the engine's default (every core)
    if worker.batcher is not None:
        b = worker.batcher
        return base | {
            "task": "embeddings",
            "queued": len(b.queue),
            "queued_by_priority": dict(zip(LEVEL_NAMES, b.queue.depths(), strict=True)),
            "in_flight": len(b.queue) + b.num_running,
            "running": b.num_running,
            "slots": b.slots,
            "max_batch_size": b.batch.max_batch_size,
            "throughput_per_s": round(b.throughput.per_s(now), 3),
            # the adaptive cap and windows now, and why batches left (core.batch_adapt)
            "batching": b.planner.describe(now),
        }
    if worker.sequences is not None:
        q = worker.sequences
        return base | {
            "task": "generate",
            "queued": len(q.queue),
            "queued_by_priority": dict(zip(LEVEL_NAMES, q.queue.depths(), strict=True)),
            "in_flight": len(q.queue) + q.num_running,
            "running": q.num_running,
            "slots": q.slots,
            "max_batch_size": q.max_num_seqs,
            "throughput_per_s": round(q.throughput.per_s(now), 3),
            # the prefill budget (0: none) and the prompt tokens admitted, not yet prefilled
            "max_prefill_tokens": q.max_prefill_tokens,
            "prefilling_tokens": q.prefilling_tokens,
            "fair_sharing": q.queue.fair is not None,
            "tenants": q.queue.tenants(),  # {} without fair sharing
            # what bounds the sequences now and why they waited (tidegate explain)
            "batching": q.describe(),
        }
    return base | {"queued": 0, "in_flight": 0, "running": 0, "slots": 0}


def _refresh_gauges(worker: Worker) -> None:
    model = worker.settings.model
    scheduler = worker.batcher or worker.sequences
    if scheduler is None:
        return
    for name, depth in zip(LEVEL_NAMES, scheduler.queue.depths(), strict=True):
        worker.metrics.queue_depth.labels(model, name).set(depth)
    worker.metrics.inflight.labels(model).set(scheduler.num_running)
