"""tiny-llama: a synthetic 2-layer Llama with random weights, built offline from a fixed seed.

It exists so that the real generation path (transformers, continuous batching, streaming,
cancellation) runs anywhere without downloading a model: its text is meaningless. The
tokenizer is byte-level BPE with no merges (one token per UTF-8 byte, plus ``<pad>``,
``<s>`` and ``</s>``), so any text encodes and decodes losslessly.

``ensure_tiny_llama()`` builds it once into a cache folder (safetensors weights and
tokenizer files, the same bytes on every build) and returns the folder; it then loads like
any local Hugging Face model folder. The build writes to a temporary folder and renames it
into place, so two processes racing to build it both end up with one complete folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from tidegate.engines.hf_runtime import quiet_transformers

NAME = "tiny-llama-v1"
MARKER = "README.md"
CONTEXT_TOKENS = 1024  # what the engine accepts: prompt + output
POSITIONS = 2048  # the model's position table, above CONTEXT_TOKENS
SEED = 0
SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
# Weights drawn wider than Llama's 0.02, so that next-token distributions are peaked enough
# for greedy output to vary instead of repeating one byte.
INIT_STD = 0.25
DESCRIPTION = (
    "SYNTHETIC: a 2-layer Llama with random weights and a byte tokenizer, built offline "
    "from a fixed seed; for load and scheduling work, its text is meaningless"
)

_README = f"""# {NAME} (SYNTHETIC)

This folder was built by tidegate (`tidegate.engines.tiny_llama.ensure_tiny_llama`).
It is a 2-layer Llama with RANDOM WEIGHTS (seed {SEED}) and a byte-level tokenizer.
It has learnt nothing: its text is meaningless. It is for load and scheduling work only.
Delete the folder to rebuild it; every build writes the same bytes.
"""


def default_cache_dir() -> Path:
    """``$TIDEGATE_CACHE``, else ``~/.cache/tidegate``."""
    root = os.environ.get("TIDEGATE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "tidegate"


def tiny_llama_dir(cache_dir: Path | None = None) -> Path:
    return (cache_dir if cache_dir is not None else default_cache_dir()) / "models" / NAME


def ensure_tiny_llama(cache_dir: Path | None = None) -> Path:
    """tiny-llama's folder under ``cache_dir`` (default: ``default_cache_dir()``), built once."""
    folder = tiny_llama_dir(cache_dir)
    if (folder / MARKER).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = folder.parent / f".{NAME}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        build_tiny_llama(scratch)
        if folder.exists() and not (folder / MARKER).is_file():
            _discard(folder)  # a partial folder left by something else: replace it
        try:
            scratch.rename(folder)
        except OSError:
            # Another process renamed its build into place first: use that one.
            if not (folder / MARKER).is_file():
                raise
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return folder


def build_tiny_llama(out: Path) -> None:
    """Write the model, tokenizer and README into ``out`` (created; must not exist)."""
    import torch
    import transformers

    hf: Any = transformers  # its functions are untyped

    quiet_transformers()
    out.mkdir(parents=True)
    tokenizer = _build_tokenizer()
    config = hf.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=POSITIONS,
        initializer_range=INIT_STD,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    # A private RNG state: building must not disturb the caller's torch seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = hf.LlamaForCausalLM(config).eval()
    model.generation_config = hf.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / MARKER).write_text(_README)  # last: its presence means the folder is complete


def _build_tokenizer() -> Any:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    hf: Any = transformers

    # Byte-level BPE without merges: a lossless byte tokenizer, no training needed.
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: index for index, token in enumerate([*SPECIALS, *byte_chars])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIALS))  # already in the vocabulary: ids 0..2 stay
    return hf.PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=CONTEXT_TOKENS,
        padding_side="left",
    )


def _discard(folder: Path) -> None:
    aside = folder.parent / f".{NAME}.stale-{uuid.uuid4().hex[:8]}"
    with contextlib.suppress(OSError):
        folder.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)
