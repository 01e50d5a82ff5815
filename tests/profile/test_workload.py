"""The planner's request mix: trace files, the synthetic distribution, clipping, text sizing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidegate.errors import ConfigError
from tidegate.profile.loadgen import RequestStream
from tidegate.profile.workload import (
    TextSizer,
    Workload,
    clip_workload,
    load_workload,
    probe_text,
    synthetic_workload,
)


def test_synthetic_workload_is_seeded_and_documented() -> None:
    first = synthetic_workload("embeddings", seed=3)
    assert first == synthetic_workload("embeddings", seed=3)
    assert first != synthetic_workload("embeddings", seed=4)
    assert first.details["distribution"]["input"] == {
        "kind": "lognormal",
        "median": 64.0,
        "sigma": 0.8,
    }
    assert set(first.output_tokens) == {0}  # embeddings have no output
    median = sorted(first.input_tokens)[len(first.input_tokens) // 2]
    assert 50 <= median <= 80


def test_synthetic_generation_has_outputs() -> None:
    workload = synthetic_workload("generate", seed=0)
    assert min(workload.output_tokens) >= 1
    assert "output" in workload.details["distribution"]


@pytest.mark.parametrize(
    ("name", "content"),
    [
        (
            "azure.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n",
        ),
        (
            "ours.csv",
            "arrival_s,prompt_tokens,output_tokens,priority,tenant\n0.0,374,44,high,a\n"
            "0.5,396,109,low,b\n",
        ),
        (
            "mooncake.jsonl",
            json.dumps({"timestamp": 0, "input_length": 374, "output_length": 44, "hash_ids": []})
            + "\n"
            + json.dumps({"timestamp": 9, "input_length": 396, "output_length": 109})
            + "\n",
        ),
    ],
    ids=["azure_csv", "tidegate_csv", "mooncake_jsonl"],
)
def test_trace_files_give_their_token_lengths(tmp_path: Path, name: str, content: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    workload = load_workload(path, seed=0)
    assert sorted(zip(workload.input_tokens, workload.output_tokens, strict=True)) == [
        (374, 44),
        (396, 109),
    ]
    assert workload.source == str(path)


def test_a_long_trace_is_sampled_with_the_seed(tmp_path: Path) -> None:
    path = tmp_path / "long.csv"
    rows = "\n".join(f"{i / 10},{i},{i},," for i in range(1, 2001))
    path.write_text("arrival_s,prompt_tokens,output_tokens,priority,tenant\n" + rows + "\n")
    first = load_workload(path, seed=1, num_samples=100)
    assert len(first.input_tokens) == 100
    assert first == load_workload(path, seed=1, num_samples=100)
    assert first.details["rows_read"] == 2000


def test_bad_trace_files_are_config_errors(tmp_path: Path) -> None:
    path = tmp_path / "columns.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match="not a trace format"):
        load_workload(path, seed=0)
    empty = tmp_path / "empty.csv"
    empty.write_text("arrival_s,prompt_tokens,output_tokens,priority,tenant\n")
    with pytest.raises(ConfigError, match="no requests"):
        load_workload(empty, seed=0)


def test_missing_trace_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_workload(tmp_path / "absent.csv", seed=0)


def test_clipping_keeps_inputs_to_what_the_model_reads_and_the_context() -> None:
    workload = Workload("t", (10, 300, 2000, 900), (5, 50, 10, 500))
    clipped = clip_workload(
        workload, max_input_tokens=256, max_output_tokens=100, context_tokens=1000
    )
    # room = 1000 - output - 100 (a tenth of the context kept free)
    assert clipped.input_tokens == (10, 256, 256, 256)
    assert clipped.output_tokens == (5, 50, 10, 100)
    assert clipped.details["clipping"]["num_clipped"] == 3
    generate = clip_workload(
        workload, max_input_tokens=1000, max_output_tokens=600, context_tokens=1000
    )
    assert generate.input_tokens[3] == 1000 - 500 - 100


def test_text_sizer_inverts_the_calibration() -> None:
    sizer = TextSizer.calibrated([(16, 26), (128, 194)], seed=0)  # 2 + 1.5 tokens per word
    assert sizer.tokens_per_word == pytest.approx(1.5)
    assert sizer.overhead_tokens == pytest.approx(2.0)
    assert sizer.words_for(152) == 100
    text = sizer.text(152, index=7)
    assert len(text.split()) == 100
    assert text == sizer.text(152, index=7)
    assert text != sizer.text(152, index=8)


def test_probe_text_is_deterministic() -> None:
    assert probe_text(5, "k") == probe_text(5, "k")
    assert len(probe_text(5, "k").split()) == 5


def test_a_run_never_sends_a_generation_prompt_twice() -> None:
    """A prompt sent again finds its pages in the engine's prefix cache and skips its prefill:
    the run's points go on where the last stopped, and past the samples prompts get new
    words of the same length."""
    workload = Workload("w", (20, 40, 60), (8, 8, 8))
    sizer = TextSizer(overhead_tokens=2.0, tokens_per_word=1.0, seed=3)
    stream = RequestStream("m", "generate", workload, sizer)
    bodies = [json.loads(stream.next().body) for _ in range(9)]
    prompts = [body["prompt"] for body in bodies]
    assert len(set(prompts)) == 9
    assert [len(p.split()) for p in prompts] == [18, 38, 58] * 3  # the samples' lengths, in turn
    assert {body["max_tokens"] for body in bodies} == {8}
    embeddings = RequestStream("m", "embeddings", workload, sizer)
    inputs = [json.loads(embeddings.next().body)["input"] for _ in range(6)]
    assert inputs[:3] == inputs[3:]  # no cache to dodge: the bodies built once, in a cycle
