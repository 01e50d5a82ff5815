"""The load generator: a closed loop of OpenAI requests, ``concurrency`` of them in flight.

Each of ``concurrency`` client tasks sends one request, waits for its whole answer, records
it and sends the next, so the server always holds exactly that many (the gateway's flow
control drives a replica the same way, up to its slots). Each completion also records its
cycle: the time since the same client's previous completion, from which the throughput is
taken (see measure.py). Embeddings send one input per
request with ``encoding_format: base64`` (the OpenAI SDK's default); generation streams
``/v1/completions`` with ``stream_options.include_usage`` and records the time of every
chunk with text: time to first token, and the gaps between tokens (inter-token latency).
Token counts come from the server's ``usage``. The client is aiohttp, whose cost per request
is a fraction of httpx's (see gateway/proxy.py); the planner's own CPU is measured anyway.

A ``Recorder`` collects completions for the current measurement window; ``cut`` closes the
window and opens the next. At the end of a point the clients send nothing new and the
requests in flight may finish (``stop(drain_s)``); they are not recorded either way.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tidegate.errors import ReplicaFailed
from tidegate.profile.workload import TextSizer, Workload

ERROR_PAUSE_S = 0.05  # after a failed request, so a dead server is not hammered


@dataclass(frozen=True, slots=True)
class RequestSpec:
    path: str  # /v1/embeddings or /v1/completions
    body: bytes
    stream: bool


@dataclass(slots=True)
class Completion:
    done_at: float
    latency_s: float
    ok: bool
    input_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between chunks with text
    error: str = ""
    # From the client's previous completion to this one: the request plus the client's own
    # time in between. In a closed loop, throughput = concurrency / mean cycle (Little's law).
    cycle_s: float = 0.0


def build_requests(
    model: str, task: str, workload: Workload, sizer: TextSizer
) -> list[RequestSpec]:
    """One request per workload sample, built once (the bodies are replayed in a cycle)."""
    pairs = zip(workload.input_tokens, workload.output_tokens, strict=True)
    return [
        request_spec(model, task, sizer.text(prompt, index), output)
        for index, (prompt, output) in enumerate(pairs)
    ]


def request_spec(model: str, task: str, text: str, output_tokens: int) -> RequestSpec:
    if task == "embeddings":
        body: dict[str, Any] = {"model": model, "input": text, "encoding_format": "base64"}
        return RequestSpec("/v1/embeddings", json.dumps(body).encode(), False)
    body = {
        "model": model,
        "prompt": text,
        "max_tokens": max(1, output_tokens),
        "temperature": 0.0,
        "ignore_eos": True,  # vLLM: generate max_tokens; others ignore the field
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return RequestSpec("/v1/completions", json.dumps(body).encode(), True)


class RequestStream:
    """What a run sends, in order: one counter for every point of the run.

    Generation never sends the same prompt twice in a run. A served prompt's full KV pages
    stay in the engine's prefix cache (transformers' block sharing, vLLM's prefix caching),
    so a prompt sent again skips most of its prefill: when every point replayed the workload
    from its first sample, the open-loop point measured a prompt joining a decoding batch at
    42 ms; with fresh prompts it measured 130 ms, and real runs of the same stack paid
    120-144 ms (docs/benchmarks.md, "Fidelity"). So the points go on where the last one
    stopped, and past the workload's samples each generation prompt gets new words of the
    same token count. Embeddings have no such cache: their bodies are replayed in a cycle,
    built once.
    """

    def __init__(self, model: str, task: str, workload: Workload, sizer: TextSizer) -> None:
        self.model = model
        self.task = task
        self.workload = workload
        self.sizer = sizer
        self.specs = build_requests(model, task, workload, sizer)
        self._sent = itertools.count()

    def __len__(self) -> int:
        return len(self.specs)

    def next(self) -> RequestSpec:
        sent = next(self._sent)
        index = sent % len(self.specs)
        if sent < len(self.specs) or self.task == "embeddings":
            return self.specs[index]
        prompt = self.workload.input_tokens[index]
        text = self.sizer.text(prompt, sent)  # other words: a prompt the cache has not seen
        return request_spec(self.model, self.task, text, self.workload.output_tokens[index])


def client_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=300.0)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        headers={"content-type": "application/json"},
        auto_decompress=False,
    )


class Recorder:
    """Completions of the current window; wakes a waiter once the window holds enough."""

    def __init__(self) -> None:
        self._window: list[Completion] = []
        self._want = 0
        self._enough = asyncio.Event()

    def add(self, completion: Completion) -> None:
        self._window.append(completion)
        if self._want and len(self._window) >= self._want:
            self._enough.set()

    def cut(self) -> list[Completion]:
        window, self._window = self._window, []
        self._want = 0
        self._enough.clear()
        return window

    async def wait_for(self, count: int) -> None:
        """Until the current window holds ``count`` completions (ok or not)."""
        if len(self._window) >= count:
            return
        self._want = count
        await self._enough.wait()


class LoadGenerator:
    """``concurrency`` client tasks sending ``requests`` in turn against ``url``."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        requests: RequestStream,
        concurrency: int,
        recorder: Recorder,
    ) -> None:
        self.session = session
        self.url = url.rstrip("/")
        self.requests = requests
        self.concurrency = concurrency
        self.recorder = recorder
        self._tasks: list[asyncio.Task[None]] = []
        self._draining = False

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._client(), name=f"load-{index}")
            for index in range(self.concurrency)
        ]

    async def stop(self, drain_s: float = 0.0) -> None:
        """No new requests; those in flight get ``drain_s`` to finish, then are cut off.

        Draining leaves the server idle for the next point, and spares it the clients that
        vanish mid-request (a cut-off request is not recorded either way).
        """
        self._draining = True
        if drain_s > 0 and self._tasks:
            await asyncio.wait(self._tasks, timeout=drain_s)
        for task in self._tasks:
            task.cancel()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result

    async def _client(self) -> None:
        last_done_at: float | None = None
        while not self._draining:
            spec = self.requests.next()
            completion = await send(self.session, self.url, spec)
            if last_done_at is None:  # the client's first: it waited for nothing before
                completion.cycle_s = completion.latency_s
            else:
                completion.cycle_s = completion.done_at - last_done_at
            last_done_at = completion.done_at
            self.recorder.add(completion)
            if not completion.ok:
                await asyncio.sleep(ERROR_PAUSE_S)


async def send(session: aiohttp.ClientSession, url: str, spec: RequestSpec) -> Completion:
    """One request, timed from the send to the end of its answer."""
    started = time.monotonic()
    try:
        async with session.post(url + spec.path, data=spec.body) as response:
            if response.status != 200:
                detail = (await response.read())[:200].decode("utf-8", "replace")
                return _failed(started, f"{response.status} {detail}")
            if spec.stream:
                return await _read_stream(response, started)
            payload = json.loads(await response.read())
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return _failed(started, f"{type(exc).__name__}: {exc}")
    done = time.monotonic()
    usage = payload.get("usage") or {}
    return Completion(done, done - started, True, int(usage.get("prompt_tokens", 0)))


def _failed(started: float, error: str) -> Completion:
    done = time.monotonic()
    return Completion(done, done - started, False, error=error)


async def _read_stream(response: aiohttp.ClientResponse, started: float) -> Completion:
    """Server-sent events: the time of each chunk with text, and the usage at the end."""
    stamps: list[float] = []
    usage: dict[str, Any] = {}
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            return _failed(started, json.dumps(chunk["error"])[:200])
        if any(choice.get("text") for choice in chunk.get("choices") or ()):
            stamps.append(time.monotonic())
        usage = chunk.get("usage") or usage
    done = time.monotonic()
    if not stamps:
        return _failed(started, "the stream had no text")
    return Completion(
        done,
        done - started,
        True,
        int(usage.get("prompt_tokens", 0)),
        int(usage.get("completion_tokens", len(stamps))),
        stamps[0] - started,
        [later - earlier for earlier, later in itertools.pairwise(stamps)],
    )


async def calibrate(
    session: aiohttp.ClientSession, url: str, model: str, task: str, seed: int
) -> TextSizer:
    """A ``TextSizer`` for this server's tokenizer, from the usage of two probe requests."""
    probes: list[tuple[int, int]] = []
    for words in TextSizer.PROBE_WORDS:
        probe = Workload("probe", (words,), (1,))
        (spec,) = build_requests(model, task, probe, _AS_WORDS)
        completion = await send(session, url.rstrip("/"), spec)
        if not completion.ok or completion.input_tokens <= 0:
            raise ReplicaFailed(
                f"{url}: a probe request got no token count back "
                f"({completion.error or 'no usage.prompt_tokens in the answer'})"
            )
        probes.append((words, completion.input_tokens))
    return TextSizer.calibrated(probes, seed)


# Reads a token count as a word count: the probes send that many words.
_AS_WORDS = TextSizer(overhead_tokens=0.0, tokens_per_word=1.0, seed=-1)
