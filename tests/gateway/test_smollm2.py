"""The real chat model through ``tidegate serve``, with the official openai client.

One gateway with one smollm2 worker serves the whole module (a start loads 135M
parameters). Greedy answers to fixed factual questions are checked for the one word they
must contain; outputs stay short, so the module runs in about a minute on 2 busy cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.procs import Proc, gateway_process

MODEL = "smollm2"
FRANCE = "What is the capital of France? Answer in one sentence."


def ask(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def served(smollm2_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    config = tmp_path_factory.mktemp("smollm2") / "tidegate.yaml"
    model = {"name": MODEL, "replicas": 1, "batching": {"max_num_seqs": 4}}
    config.write_text(yaml.safe_dump({"models": [model]}))
    with gateway_process("--config", str(config)) as proc:
        yield proc


@pytest.fixture
def client(served: Proc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_the_model_is_listed(client: openai.OpenAI) -> None:
    (entry,) = client.models.list().data
    assert (entry.id, (entry.model_extra or {})["task"]) == (MODEL, "generate")


@pytest.mark.parametrize(
    ("question", "word"),
    [
        (FRANCE, "Paris"),
        ("What is the capital of Japan?", "Tokyo"),
        ("What is the chemical symbol for gold?", "Au"),
        ("Which language is spoken in Brazil?", "Portuguese"),
    ],
)
def test_greedy_chat_answers_a_factual_question(
    client: openai.OpenAI, question: str, word: str
) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ask(question), max_tokens=12, temperature=0
    )
    (choice,) = reply.choices
    assert word in (choice.message.content or ""), choice.message.content
    assert choice.finish_reason in {"stop", "length"}
    usage = reply.usage
    assert usage is not None
    assert usage.prompt_tokens > 20  # the template's system prompt and the question
    assert 1 <= usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_the_end_of_turn_token_stops_and_max_tokens_cuts(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=ask(FRANCE), max_tokens=32, temperature=0
    )
    assert whole.choices[0].message.content == "The capital of France is Paris."
    assert whole.choices[0].finish_reason == "stop"  # <|im_end|>, well before 32 tokens
    assert whole.usage is not None
    assert whole.usage.completion_tokens < 32
    cut = client.chat.completions.create(
        model=MODEL, messages=ask(FRANCE), max_tokens=3, temperature=0
    )
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage is not None
    assert cut.usage.completion_tokens == 3
    assert "The capital of France is Paris.".startswith(cut.choices[0].message.content or "-")


def test_streamed_chunks_add_up_to_the_whole_answer(client: openai.OpenAI) -> None:
    request = {"model": MODEL, "messages": ask(FRANCE), "max_tokens": 16, "temperature": 0}
    whole = client.chat.completions.create(**request)
    stream = client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == whole.choices[0].message.content
    assert finishes[-1] == whole.choices[0].finish_reason == "stop"
    assert chunks[-1].usage == whole.usage  # the usage chunk comes last


def test_a_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ask(FRANCE), max_tokens=16, temperature=0, stop=[" Paris"]
    )
    assert reply.choices[0].message.content == "The capital of France is"
    assert reply.choices[0].finish_reason == "stop"


def test_completions_continue_a_plain_prompt(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0
    )
    assert "Paris" in reply.choices[0].text


def test_sampling_with_temperature_and_top_p_answers(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ask(FRANCE), max_tokens=8, temperature=0.8, top_p=0.9
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None
    assert 1 <= reply.usage.completion_tokens <= 8


def test_a_seeded_greedy_request_gives_the_same_text_alone_or_in_a_batch(
    client: openai.OpenAI,
) -> None:
    def seeded() -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=ask("Name a fruit."), max_tokens=10, temperature=0, seed=7
        )
        return reply.choices[0].message.content or ""

    def sampled(index: int) -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=ask(f"Count to {index}."), max_tokens=10, temperature=1.0
        )
        return reply.choices[0].message.content or ""

    alone = seeded()
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(sampled, index) for index in range(3, 6)]
        in_batch = pool.submit(seeded)
        assert in_batch.result() == alone
        assert all(other.result() for other in others)


def test_a_seed_with_sampling_is_refused_with_the_reason(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=ask(FRANCE), max_tokens=4, temperature=0.7, seed=1
        )
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["param"], error["code"]) == ("seed", "seed_not_supported")
    assert "shared random generator" in error["message"]


def test_a_prompt_over_the_context_is_413(served: Proc) -> None:
    long = "tide " * 9000  # over 8192 tokens
    with httpx.Client(timeout=120) as http:
        reply = http.post(
            f"{served.url}/v1/chat/completions",
            json={"model": MODEL, "messages": ask(long), "max_tokens": 4},
        )
    assert reply.status_code == 413, reply.text
    assert reply.json()["error"]["code"] == "context_length_exceeded"
