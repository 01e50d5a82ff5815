"""What a real worker process exports for operations: its process's CPU and memory, and the
time it spends tokenizing requests (simulated engines, and the real MiniLM tokenizer)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.harness import flat_profile
from tests.procs import DEADLINE_S, Proc, worker_process
from tidegate.engines.steps import parse_step_metrics

pytestmark = pytest.mark.e2e

Sample = tuple[str, dict[str, str], float]


def samples(text: str) -> list[Sample]:
    """Every sample of a /metrics text: (name, labels, value)."""
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def value(text: str, name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    found = [v for n, ls, v in samples(text) if n == name and labels.items() <= ls.items()]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def scrape(proc: Proc) -> str:
    answer = httpx.get(f"{proc.url}/metrics", timeout=DEADLINE_S)
    answer.raise_for_status()
    return answer.text


def post(proc: Proc, path: str, body: dict[str, object]) -> None:
    answer = httpx.post(f"{proc.url}{path}", json=body, timeout=DEADLINE_S)
    assert answer.status_code == 200, answer.text


def assert_process_metrics(text: str) -> None:
    assert value(text, "process_cpu_seconds_total") > 0
    assert value(text, "process_resident_memory_bytes") > 10 * 1024 * 1024
    assert not [n for n, _, _ in samples(text) if n.startswith("DCGM_")]  # a cpu worker


@pytest.fixture(scope="module")
def minilm() -> Iterator[Proc]:
    with worker_process("--model", "minilm", "--max-batch-size", "8") as proc:
        yield proc


def test_a_simulated_embedding_worker_times_tokenizing_each_request(tmp_path: Path) -> None:
    profile = flat_profile(tmp_path / "embed.json", 1.0)
    args = ("--model", "sim", "--engine", "simulated", "--profile", str(profile))
    with worker_process(*args) as worker:
        before = scrape(worker)
        assert_process_metrics(before)
        # Warm-up and the readiness probe call the engine directly: no request tokenized yet.
        assert value(before, "tidegate_tokenize_seconds_count", model="sim") == 0
        post(worker, "/v1/embeddings", {"model": "sim", "input": "one text"})
        post(worker, "/v1/embeddings", {"model": "sim", "input": ["two", "texts"]})
        after = scrape(worker)
        assert value(after, "tidegate_tokenize_seconds_count", model="sim") == 2
        assert value(after, "tidegate_tokenize_seconds_bucket", model="sim", le="+Inf") == 2
        # Its engine time by batch size (the step table's kind "batch"): three inputs in at
        # most two batches, each at least the profile's 1 ms.
        batches = parse_step_metrics(after)
        assert {kind for kind, _ in batches} == {"batch"}
        assert sum(size * cell.num_steps for (_, size), cell in batches.items()) == 3
        assert all(cell.seconds >= 1e-3 * cell.num_steps for cell in batches.values())
        assert parse_step_metrics(before) == {}
        assert value(after, "process_cpu_seconds_total") >= value(
            before, "process_cpu_seconds_total"
        )


def test_a_simulated_generation_worker_times_prompts_and_chat_templates(tmp_path: Path) -> None:
    profile = flat_profile(tmp_path / "chat.json", 1.0, task="generate")
    args = ("--model", "sim", "--engine", "simulated", "--profile", str(profile))
    with worker_process(*args) as worker:
        post(worker, "/v1/completions", {"model": "sim", "prompt": "tide", "max_tokens": 2})
        chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        post(worker, "/v1/chat/completions", chat)
        post(worker, "/v1/chat/completions", chat | {"stream": True})
        text = scrape(worker)
        assert value(text, "tidegate_tokenize_seconds_count", model="sim") == 3
        assert_process_metrics(text)


def test_minilm_worker_measures_its_real_tokenizer(minilm: Proc) -> None:
    before = scrape(minilm)
    num_before = value(before, "tidegate_tokenize_seconds_count", model="minilm")
    seconds_before = value(before, "tidegate_tokenize_seconds_sum", model="minilm")
    long_texts = [
        f"sentence {i} about tides, harbours and the gates between them " * 20 for i in range(8)
    ]
    for texts in (["a cat on a mat"], long_texts):
        post(minilm, "/v1/embeddings", {"model": "minilm", "input": texts})
    after = scrape(minilm)
    assert value(after, "tidegate_tokenize_seconds_count", model="minilm") == num_before + 2
    # A real tokenizer takes time: the sum grew (a floor of nothing, whatever the load).
    assert value(after, "tidegate_tokenize_seconds_sum", model="minilm") > seconds_before
    assert_process_metrics(after)
    # Its weights are in its memory: the resident set is at least the model's weights.
    weights = value(after, "tidegate_engine_memory_bytes", model="minilm", kind="weights")
    assert value(after, "process_resident_memory_bytes") > weights


def test_a_request_refused_for_its_length_was_still_tokenized(minilm: Proc) -> None:
    before = value(scrape(minilm), "tidegate_tokenize_seconds_count", model="minilm")
    too_long = "tide " * 2000  # over MiniLM's 512 positions: 413
    answer = httpx.post(
        f"{minilm.url}/v1/embeddings",
        json={"model": "minilm", "input": too_long},
        timeout=DEADLINE_S,
    )
    assert answer.status_code == 413
    after = value(scrape(minilm), "tidegate_tokenize_seconds_count", model="minilm")
    assert after == before + 1
