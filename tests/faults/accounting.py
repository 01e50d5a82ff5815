"""Fire a bounded load at a gateway and account for every request.

The fault suite's one question: did every request get exactly one HTTP answer (a status
code, and for a stream a last event that is ``[DONE]``), and did the gateway count each
one exactly once in ``tidegate_requests_total``?
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Answer:
    status: int | None  # None: no HTTP answer at all (a reset, a hang cut by the client)
    body: bytes = b""
    stream_events: tuple[str, ...] = ()
    transport_error: str | None = None

    @property
    def error_code(self) -> str | None:
        try:
            error = json.loads(self.body).get("error", {})
        except (ValueError, AttributeError):
            return None
        return error.get("code") if isinstance(error, dict) else None

    @property
    def stream_ended_cleanly(self) -> bool:
        """A stream's last event is ``[DONE]``; an error event, if any, comes just before."""
        return bool(self.stream_events) and self.stream_events[-1] == "[DONE]"


async def send(
    client: httpx.AsyncClient, path: str, payload: dict[str, object], headers: dict[str, str]
) -> Answer:
    try:
        if payload.get("stream") is True:
            events: list[str] = []
            async with client.stream("POST", path, json=payload, headers=headers) as response:
                if response.status_code != 200:
                    return Answer(response.status_code, await response.aread())
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: ") :])
            return Answer(response.status_code, stream_events=tuple(events))
        response = await client.post(path, json=payload, headers=headers)
        return Answer(response.status_code, response.content)
    except httpx.HTTPError as exc:
        return Answer(None, transport_error=f"{type(exc).__name__}: {exc}")


async def fire(
    url: str,
    path: str,
    payloads: list[dict[str, object]],
    *,
    concurrency: int,
    headers: dict[str, str] | None = None,
    timeout_s: float = 120.0,
    started: asyncio.Event | None = None,
) -> list[Answer]:
    """Send every payload, ``concurrency`` at a time; one Answer per payload, in order."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:

        async def one(payload: dict[str, object]) -> Answer:
            async with gate:
                if started is not None:
                    started.set()
                return await send(client, path, payload, headers or {})

        return list(await asyncio.gather(*(one(p) for p in payloads)))


def outcomes(metrics_text: str, model: str) -> Counter[str]:
    """``tidegate_requests_total`` of one model, summed over priorities, by outcome."""
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "tidegate_requests":
            continue
        for sample in family.samples:
            if sample.name == "tidegate_requests_total" and sample.labels.get("model") == model:
                counts[sample.labels["outcome"]] += int(sample.value)
    return counts


def scrape(url: str, model: str, headers: dict[str, str] | None = None) -> Counter[str]:
    text = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=30).text
    return outcomes(text, model)


def counted_since(before: Counter[str], after: Counter[str]) -> Counter[str]:
    return Counter({k: after[k] - before[k] for k in after if after[k] - before[k]})
