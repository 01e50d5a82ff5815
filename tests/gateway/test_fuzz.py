"""Fuzzing a live ``tidegate serve`` from its own OpenAPI document, with schemathesis.

One gateway serves a simulated embedding model, a simulated generation model and the real
tiny-llama engine. For each endpoint, seeded Hypothesis examples that fit the document and
examples that break it go through the gateway to the workers. Schemathesis' checks hold for
every answer: no 5xx, status codes, content types, headers and bodies as documented,
schema-breaking requests refused, schema-fitting ones accepted (or refused for a limit of
the model the schema cannot know: its context, output tokens, dimensions). Afterwards every
model still answers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
import yaml
from hypothesis import HealthCheck, Phase, given, seed, settings
from schemathesis import GenerationMode

from tests.procs import Proc, gateway_process

pytestmark = pytest.mark.e2e

SEED = 20_611  # issue 11
MAX_EXAMPLES = 12  # per endpoint and mode: ~75 requests in all, a few seconds of serving
# A request that fits the schema may still break a limit only the model knows (400: output
# tokens or dimensions, token-id input to a text engine; 413: over the model's context).
ACCEPTED = ["2xx", "400", "413"]
MSG = [{"role": "user", "content": "hi"}]
REQUEST_TIMEOUT_S = 60.0  # for what takes well under a second on an idle machine


def _profile(path: Path, name: str, task: str) -> str:
    if task == "embeddings":
        points: list[dict[str, float]] = [
            {"batch_size": 1, "latency_ms": 1.0},
            {"batch_size": 64, "latency_ms": 1.0},
        ]
    else:  # 2048 tokens, the simulator's most, in about 0.2 s
        points = [{"concurrency": 1, "ttft_ms": 1.0, "itl_ms": 0.1}]
    profile = {"version": 1, "model": name, "task": task, task: {"points": points}}
    path.write_text(json.dumps(profile))
    return str(path)


def _config(tmp_path: Path) -> Path:
    models: list[dict[str, Any]] = [
        {
            "name": name,
            "task": task,
            "engine": "simulated",
            "profile": _profile(tmp_path / f"{name}.json", name, task),
            "replicas": 1,
        }
        for name, task in (("sim-embed", "embeddings"), ("sim-chat", "generate"))
    ]
    models.append({"name": "tiny-llama", "replicas": 1})  # the real engine, on CPU
    path = tmp_path / "tidegate.yaml"
    path.write_text(yaml.safe_dump({"models": models}))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    with gateway_process("--config", str(_config(tmp_path_factory.mktemp("fuzz")))) as proc:
        yield proc


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/completions", "/v1/chat/completions"])
def test_fuzzing_an_endpoint_finds_no_server_error_and_no_schema_violation(
    served: Proc, path: str
) -> None:
    config = schemathesis.Config.from_dict(
        {"checks": {"positive_data_acceptance": {"expected-statuses": ACCEPTED}}}
    )
    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json", config=config)
    operation = schema[path]["POST"]
    session = requests.Session()

    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        # No deadline and no shrinking: a busy machine must not fail a run, nor stretch one.
        @seed(SEED)
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(mode))
        def fuzz(case: schemathesis.Case) -> None:
            case.call_and_validate(session=session, timeout=REQUEST_TIMEOUT_S)

        fuzz()
    assert served.process.poll() is None, "the gateway died"


def test_every_model_still_answers_after_the_fuzzing(served: Proc) -> None:
    with httpx.Client(base_url=served.url, timeout=REQUEST_TIMEOUT_S) as client:
        embedded = client.post("/v1/embeddings", json={"model": "sim-embed", "input": ["a"]})
        assert embedded.status_code == 200, embedded.text
        for model in ("sim-chat", "tiny-llama"):
            body = {"model": model, "messages": MSG, "max_tokens": 2}
            answered = client.post("/v1/chat/completions", json=body)
            assert answered.status_code == 200, answered.text
            assert answered.json()["choices"][0]["message"]["role"] == "assistant"
