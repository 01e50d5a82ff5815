"""Real worker processes with real models, driven by the official openai client."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from tests.procs import DEADLINE_S, Proc, worker_process
from tidegate.engines.steps import parse_step_metrics


@pytest.fixture(scope="module")
def minilm() -> Iterator[Proc]:
    with worker_process("--model", "minilm", "--max-batch-size", "8") as proc:
        yield proc


@pytest.fixture(scope="module")
def tiny_llama() -> Iterator[Proc]:
    with worker_process("--model", "tiny-llama", "--max-num-seqs", "4") as proc:
        yield proc


def client(proc: Proc) -> openai.OpenAI:
    """Use it in a ``with`` block: it closes its connections there (an unclosed socket is a
    ResourceWarning, an error in this suite)."""
    return openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)


def test_openai_embeddings_float_and_base64(minilm: Proc) -> None:
    texts = ["a cat on a mat", "a dog on a log", "stock markets fell sharply"]
    with client(minilm) as c:
        result = c.embeddings.create(model="minilm", input=texts)  # base64 on the wire
    vectors = np.array([item.embedding for item in result.data])
    assert vectors.shape == (3, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]  # real semantics, not noise
    assert result.usage.prompt_tokens > 0
    floats = httpx.post(
        f"{minilm.url}/v1/embeddings",
        json={"model": "minilm", "input": texts[0], "encoding_format": "float"},
        timeout=DEADLINE_S,
    ).json()
    assert np.allclose(floats["data"][0]["embedding"], vectors[0], atol=1e-6)
    raw = httpx.post(
        f"{minilm.url}/v1/embeddings",
        json={"model": "minilm", "input": texts[0], "encoding_format": "base64"},
        timeout=DEADLINE_S,
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, vectors[0], atol=1e-6)


def test_models_lists_the_model_and_its_task(minilm: Proc, tiny_llama: Proc) -> None:
    with client(minilm) as c:
        (embedder,) = c.models.list().data
    assert embedder.id == "minilm"
    assert embedder.model_extra["task"] == "embeddings"
    with client(tiny_llama) as c:
        (generator,) = c.models.list().data
    assert generator.id == "tiny-llama"
    assert generator.model_extra["synthetic"] is True
    assert "SYNTHETIC" in generator.model_extra["description"]


def test_openai_completion(tiny_llama: Proc) -> None:
    with client(tiny_llama) as c:
        result = c.completions.create(
            model="tiny-llama", prompt="The tide", max_tokens=8, temperature=0.0
        )
        again = c.completions.create(
            model="tiny-llama", prompt="The tide", max_tokens=8, temperature=0.0
        )
    assert result.choices[0].finish_reason in {"stop", "length"}
    assert result.usage.completion_tokens <= 8
    assert again.choices[0].text == result.choices[0].text  # greedy is deterministic


def test_openai_chat_and_streaming(tiny_llama: Proc) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    pieces, usage, finish = [], None, None
    with client(tiny_llama) as c:
        whole = c.chat.completions.create(
            model="tiny-llama", messages=messages, max_tokens=6, temperature=0.0
        )
        stream = c.chat.completions.create(
            model="tiny-llama",
            messages=messages,
            max_tokens=6,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
    assert whole.choices[0].message.role == "assistant"
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish in {"stop", "length"}
    assert usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_the_engine_steps_are_on_metrics(tiny_llama: Proc) -> None:
    with client(tiny_llama) as c:
        c.completions.create(model="tiny-llama", prompt="Steps", max_tokens=5, temperature=0.0)
    text = httpx.get(f"{tiny_llama.url}/metrics", timeout=DEADLINE_S).text
    table = parse_step_metrics(text)  # one model: tiny-llama
    # The warm-up, the readiness probe and the request each start alone on an idle engine.
    assert table[("start", 1)].num_steps >= 1
    assert table[("start", 1)].num_joins == table[("start", 1)].num_steps
    assert table[("decode", 1)].num_steps >= 4  # the request's other four tokens at least
    assert table[("decode", 1)].seconds > 0


def test_unknown_model_is_404_for_the_openai_client(minilm: Proc) -> None:
    with client(minilm) as c, pytest.raises(openai.NotFoundError):
        c.embeddings.create(model="nope", input="x")


def test_stats_report_slots_for_flow_control(minilm: Proc, tiny_llama: Proc) -> None:
    generator = httpx.get(f"{tiny_llama.url}/stats", timeout=DEADLINE_S).json()
    assert generator["slots"] == 4  # --max-num-seqs
    assert generator["task"] == "generate"
    embedder = httpx.get(f"{minilm.url}/stats", timeout=DEADLINE_S).json()
    assert embedder["slots"] == 16  # two batches of --max-batch-size
    assert embedder["in_flight"] == 0
