"""Bad input gets a clear 4xx with an OpenAI-shaped body, and the worker keeps serving."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.procs import DEADLINE_S
from tidegate.worker.app import create_app
from tidegate.worker.runtime import WorkerSettings


def _client(model: str, task: str) -> Iterator[TestClient]:
    app = create_app(WorkerSettings(model=model, engine="simulated", task=task))
    with TestClient(app) as client:
        deadline = time.monotonic() + DEADLINE_S
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "simulated worker never became ready"
            time.sleep(0.05)
        yield client


@pytest.fixture(scope="module")
def embed_client() -> Iterator[TestClient]:
    yield from _client("emb", "embeddings")


@pytest.fixture(scope="module")
def gen_client() -> Iterator[TestClient]:
    yield from _client("gen", "generate")


@dataclass(frozen=True)
class Bad:
    name: str
    path: str
    body: Any  # dict -> JSON; str -> raw bytes
    status: int
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


EMB = "/v1/embeddings"
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

EMBEDDING_CASES = [
    Bad("invalid_json", EMB, "{not json", 400),
    Bad("empty_body", EMB, "", 400),
    Bad("body_not_an_object", EMB, [1, 2], 400),
    Bad("missing_input", EMB, {"model": "emb"}, 400, "input"),
    Bad("missing_model", EMB, {"input": "x"}, 400, "model"),
    Bad("input_wrong_type", EMB, {"model": "emb", "input": 5}, 400, "input"),
    Bad("empty_input_string", EMB, {"model": "emb", "input": ""}, 400, "input"),
    Bad("empty_input_list", EMB, {"model": "emb", "input": []}, 400, "input"),
    Bad("empty_item_in_list", EMB, {"model": "emb", "input": ["a", ""]}, 400, "input"),
    Bad("too_many_inputs", EMB, {"model": "emb", "input": ["a"] * 2049}, 400, "input"),
    Bad("input_over_context", EMB, {"model": "emb", "input": "x" * 10_000}, 413, "input"),
    Bad("token_id_input", EMB, {"model": "emb", "input": [1, 2, 3]}, 400, "input"),
    Bad(
        "bad_encoding_format",
        EMB,
        {"model": "emb", "input": "a", "encoding_format": "hex"},
        400,
        "encoding_format",
    ),
    Bad(
        "wrong_dimensions", EMB, {"model": "emb", "input": "a", "dimensions": 7}, 400, "dimensions"
    ),
    Bad("unknown_model", EMB, {"model": "nope", "input": "a"}, 404, "model"),
    Bad("completion_on_embedding_model", CMPL, {"model": "emb", "prompt": "a"}, 400, "model"),
    Bad(
        "bad_priority_header",
        EMB,
        {"model": "emb", "input": "a"},
        400,
        "X-Tidegate-Priority",
        {"X-Tidegate-Priority": "urgent"},
    ),
    Bad("unknown_route", "/v1/nothing", {"model": "emb"}, 404),
    Bad("input_a_boolean", EMB, {"model": "emb", "input": True}, 400, "input"),
    Bad(
        "nested_100000_levels",
        EMB,
        '{"model": "emb", "input": ' + "[" * 100_000 + "]" * 100_000 + "}",
        400,
    ),
    Bad("lone_surrogate", EMB, '{"model": "emb", "input": "\\udc00"}', 400),
]

GENERATION_CASES = [
    Bad("embeddings_on_generation_model", EMB, {"model": "gen", "input": "a"}, 400, "model"),
    Bad("missing_prompt", CMPL, {"model": "gen"}, 400, "prompt"),
    Bad("several_prompts", CMPL, {"model": "gen", "prompt": ["a", "b"]}, 400, "prompt"),
    Bad(
        "max_tokens_zero", CMPL, {"model": "gen", "prompt": "a", "max_tokens": 0}, 400, "max_tokens"
    ),
    Bad(
        "max_tokens_above_limit",
        CMPL,
        {"model": "gen", "prompt": "a", "max_tokens": 10**6},
        400,
        "max_tokens",
    ),
    Bad(
        "max_tokens_not_a_number",
        CMPL,
        {"model": "gen", "prompt": "a", "max_tokens": "many"},
        400,
        "max_tokens",
    ),
    Bad("prompt_over_context", CMPL, {"model": "gen", "prompt": "word " * 5000}, 413, "prompt"),
    Bad(
        "temperature_out_of_range",
        CMPL,
        {"model": "gen", "prompt": "a", "temperature": 9},
        400,
        "temperature",
    ),
    Bad("n_above_one", CMPL, {"model": "gen", "prompt": "a", "n": 3}, 400, "n"),
    Bad(
        "too_many_stops", CMPL, {"model": "gen", "prompt": "a", "stop": list("abcde")}, 400, "stop"
    ),
    Bad("no_messages", CHAT, {"model": "gen", "messages": []}, 400, "messages"),
    Bad(
        "bad_role",
        CHAT,
        {"model": "gen", "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
    ),
    Bad(
        "chat_over_context",
        CHAT,
        {"model": "gen", "messages": [{"role": "user", "content": "w " * 9000}]},
        413,
        "messages",
    ),
    Bad(
        "max_completion_tokens_zero",
        CHAT,
        {"model": "gen", "messages": MSG, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    Bad("unknown_model", CHAT, {"model": "nope", "messages": MSG}, 404, "model"),
    Bad(
        "stream_not_bool",
        CHAT,
        {"model": "gen", "messages": MSG, "stream": "yes please"},
        400,
        "stream",
    ),
    # Issue 11: the gateway and the worker now apply the same strict rules.
    Bad("messages_a_number", CHAT, {"model": "gen", "messages": 5}, 400, "messages"),
    Bad("messages_a_boolean", CHAT, {"model": "gen", "messages": True}, 400, "messages"),
    Bad(
        "negative_max_tokens",
        CMPL,
        {"model": "gen", "prompt": "a", "max_tokens": -5},
        400,
        "max_tokens",
    ),
    Bad(
        "max_tokens_a_boolean",
        CHAT,
        {"model": "gen", "messages": MSG, "max_tokens": True},
        400,
        "max_tokens",
    ),
    Bad(
        "stream_yes",
        CHAT,
        {"model": "gen", "messages": MSG, "stream": "yes"},
        400,
        "stream",
    ),
    Bad("n_a_boolean", CHAT, {"model": "gen", "messages": MSG, "n": True}, 400, "n"),
    Bad(
        "nested_100000_levels",
        CMPL,
        '{"model": "gen", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
        400,
    ),
    Bad(
        "temperature_infinity",
        CMPL,
        '{"model": "gen", "prompt": "a", "temperature": Infinity}',
        400,
    ),
    Bad("lone_surrogate", CMPL, '{"model": "gen", "prompt": "\\ud800"}', 400),
    Bad(
        "tenant_header_with_a_space",
        CHAT,
        {"model": "gen", "messages": MSG},
        400,
        "X-Tidegate-Tenant",
        {"X-Tidegate-Tenant": "team a"},
    ),
    Bad(
        "tenant_header_too_long",
        CMPL,
        {"model": "gen", "prompt": "a"},
        400,
        "X-Tidegate-Tenant",
        {"X-Tidegate-Tenant": "t" * 129},
    ),
]


def _send(client: TestClient, case: Bad) -> Any:
    raw = case.body if isinstance(case.body, str) else json.dumps(case.body)
    headers = {"Content-Type": "application/json", **case.headers}
    return client.post(case.path, content=raw.encode(), headers=headers)


def _check(response: Any, case: Bad) -> None:
    assert response.status_code == case.status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    for leak in ("http://", "Traceback", "invalid literal", "Error:", "Exception"):
        assert leak not in error["message"], error
    if case.param is not None:
        assert error["param"] == case.param, error


@pytest.mark.parametrize("case", EMBEDDING_CASES, ids=lambda c: c.name)
def test_bad_embedding_request_gets_4xx(embed_client: TestClient, case: Bad) -> None:
    _check(_send(embed_client, case), case)


@pytest.mark.parametrize("case", GENERATION_CASES, ids=lambda c: c.name)
def test_bad_generation_request_gets_4xx(gen_client: TestClient, case: Bad) -> None:
    _check(_send(gen_client, case), case)


def test_worker_keeps_serving_after_the_whole_table(
    embed_client: TestClient, gen_client: TestClient
) -> None:
    for case in EMBEDDING_CASES:
        assert _send(embed_client, case).status_code < 500
    for case in GENERATION_CASES:
        assert _send(gen_client, case).status_code < 500
    ok = embed_client.post(EMB, json={"model": "emb", "input": ["still", "here"]})
    assert ok.status_code == 200
    assert len(ok.json()["data"]) == 2
    ok = gen_client.post(CHAT, json={"model": "gen", "messages": MSG, "max_tokens": 3})
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] == 3
