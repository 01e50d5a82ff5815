"""The generation side that benchmarks compare a worker with: the model called directly.

``GenerateBatch`` runs transformers' ``model.generate_batch`` in this process on a model
folder, greedy, with the engine's KV cache sizing (``cache_sizing``); tokens/s, TTFT and ITL
come from the per-token timestamps it records, from the requests' creation to their last
token, so the manager's start and stop in each call are not counted.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

from loadgen import OtherLoad, StreamRound


class GenerateBatch:
    """transformers' ``generate_batch`` on ``folder``, sized like the engine."""

    def __init__(self, folder: Path, max_num_seqs: int, context_tokens: int | None) -> None:
        import torch
        import transformers

        from tidegate.engines.generation import cache_sizing
        from tidegate.engines.hf_runtime import quiet_transformers

        quiet_transformers()
        hf: Any = transformers  # partly untyped
        self.hf = hf
        self.tokenizer: Any = hf.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.model: Any = hf.AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, attn_implementation="sdpa", dtype=torch.float32
        )
        self.model.eval()
        if context_tokens is None:
            context_tokens = min(int(self.model.config.max_position_embeddings), 8192)
        sizing = cache_sizing(max_num_seqs, context_tokens)
        self.cb_config = hf.ContinuousBatchingConfig(
            page_size=sizing.page_size,
            num_blocks=sizing.num_blocks,
            max_batch_tokens=sizing.max_batch_tokens,
            max_requests_per_batch=max_num_seqs,
            seed=0,
        )
        eos = self.model.generation_config.eos_token_id
        self.eos = eos if eos is not None else -1

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def encode_chat(self, chat: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def wave(
        self, inputs: list[list[int]], max_tokens: int
    ) -> tuple[int, float, list[float], list[float]]:
        """(tokens, span from first request created to last token, TTFTs, ITLs)."""
        config = self.hf.GenerationConfig(
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=self.eos,
            pad_token_id=self.tokenizer.pad_token_id or 0,
        )
        results = self.model.generate_batch(
            inputs,
            generation_config=config,
            continuous_batching_config=self.cb_config,
            record_timestamps=True,
            progress_bar=False,
            max_new_tokens=max_tokens,
        )
        outputs = list(results.values())
        if len(outputs) != len(inputs):
            raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(inputs)} outputs")
        tokens = sum(len(o.generated_tokens) for o in outputs)
        created = min(o.created_time for o in outputs)
        last = max(o.timestamps[-1] for o in outputs if o.timestamps)
        ttfts = [o.timestamps[0] - o.created_time for o in outputs if o.timestamps]
        itls = [b - a for o in outputs for a, b in itertools.pairwise(o.timestamps)]
        return tokens, last - created, ttfts, itls

    def round(self, inputs: list[list[int]], max_tokens: int, duration_s: float) -> StreamRound:
        """Waves of ``inputs`` for at least one wave and ``duration_s``."""
        out = StreamRound()
        load = OtherLoad()
        started = time.perf_counter()
        while out.waves == 0 or time.perf_counter() - started < duration_s:
            tokens, span, ttfts, itls = self.wave(inputs, max_tokens)
            out.tokens += tokens
            out.busy_s += span
            out.ttfts_s += ttfts
            out.itls_s += itls
            out.waves += 1
        out.other_cores = load.cores()
        return out
