"""The MiniLM engine matches sentence-transformers' own encode."""

from __future__ import annotations

import asyncio

import numpy as np

from tidegate.engines.embeddings import TransformersEmbeddings, minilm_path

TEXTS = [
    "The cat sits on the mat.",
    "A man is playing a guitar.",
    "tidegate keeps interactive requests fast while batch work fills the gaps.",
    "Ünïcödé and emoji 🚀 survive tokenization.",
    "A long input beyond the 256-token window is truncated the same way. " * 40,
]


def test_cosine_against_sentence_transformers_is_at_least_0_999(
    in_process: TransformersEmbeddings,
) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm_path()), device="cpu").encode(TEXTS)
    ours = np.array(asyncio.run(in_process.embed(TEXTS)))
    reference = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    cosine = (ours * reference).sum(axis=1)
    assert cosine.min() >= 0.999, cosine
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_card_and_token_counts(in_process: TransformersEmbeddings) -> None:
    assert in_process.card.dimensions == 384
    assert in_process.card.max_context_tokens == 512
    counts = in_process.count_tokens(["hello world", TEXTS[-1]])
    assert counts[0] == 4  # [CLS] hello world [SEP]
    assert counts[1] > 256  # counted before truncation, for the context check


def test_memory_reports_weights_and_peak(in_process: TransformersEmbeddings) -> None:
    memory = in_process.memory()
    assert 80e6 < memory.weights_bytes < 100e6  # 22.7M float32 parameters
    assert memory.peak_bytes > memory.weights_bytes


def test_counting_tokens_while_a_batch_runs_is_safe(in_process: TransformersEmbeddings) -> None:
    # The worker counts tokens on the event loop while batches run in a thread; one shared
    # Hugging Face tokenizer used that way failed batches with "Unable to create tensor".
    import threading

    errors: list[BaseException] = []
    done = threading.Event()

    def batches() -> None:
        try:
            # 30 batches: with one shared tokenizer a batch failed within the first 4 in
            # each of 6 tries; every batch here runs beside the spinning count below.
            for i in range(30):
                # Different lengths: the batch needs padding, which the counting call resets.
                in_process.embed_sync(["tide " * (1 + j * 7) + str(i) for j in range(4)])
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=batches)
    thread.start()
    while not done.is_set():
        in_process.count_tokens(["counting on the event loop", "while batches run"])
    thread.join()
    assert errors == []


def test_engine_threads_set_torchs_intra_op_threads() -> None:
    import pytest
    import torch

    from tidegate.engines.hf_runtime import claim_device

    before = torch.get_num_threads()
    try:
        assert claim_device("cpu", None, 1).type == "cpu"
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="at least 1"):
        TransformersEmbeddings("minilm", threads=0)


def test_build_engine_hands_the_threads_to_either_transformers_engine() -> None:
    from tidegate.engines.registry import build_engine

    for model in ("minilm", "tiny-llama"):
        engine = build_engine(model, threads=1)  # not loaded: load() applies them
        assert getattr(engine, "threads", None) == 1, model
        assert getattr(build_engine(model), "threads", "unset") is None, model
