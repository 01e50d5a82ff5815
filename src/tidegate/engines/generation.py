"""Text generation with transformers' continuous batching, streamed to asyncio.

One ``ContinuousBatchingManager`` per engine runs the model in its own thread: sequences
join and leave its running batch at every step (iteration-level batching). The worker's
``SequenceScheduler`` decides when a sequence starts (at most ``max_num_seqs`` at once);
``generate`` adds it to the manager and streams its tokens back.

Routing: one reader thread takes every output from the manager's queue and hands it to
its sequence on that sequence's event loop (``call_soon_threadsafe``, one call per batch of
outputs). Outputs are cumulative, so a sequence keeps only the newest: a slow client costs
no memory and gets the tokens made meanwhile in one event. Outputs of sequences no longer
listening (cancelled, or ended by a stop string) are dropped.
If the manager dies, every live sequence fails with ``ReplicaFailed`` and so does every
later one; nothing hangs. The reader notices the death (at most ``_POLL_S`` later when idle)
and tells the owner once through ``on_failure``: a dead engine must not look alive.
A prompt of no tokens is refused before it reaches the manager: it would kill its loop.

Sizing: the paged KV cache holds one full context, and ``max_num_seqs`` sequences of up to
``TYPICAL_SEQ_TOKENS`` each (``cache_sizing``): a model's whole context (8192 tokens for
SmolLM2) for every sequence at once would cost gigabytes. The card tells the worker the
cache's capacity and page size; the worker starts a sequence only when its prompt +
``max_tokens`` fits in what the running ones may still use, so the manager never has to
preempt one (it would, by recomputing; a request larger than the whole cache would kill
its loop). The card's ``max_context_tokens`` is the model's position table (its config),
capped by ``max_context_tokens`` (default ``MAX_CONTEXT_TOKENS``), never above the cache.

Sampling: temperature, top_p and top_k are per sequence; temperature 0 is greedy (top_k 1).
The manager samples every running sequence with one random generator (torch's, seeded
once from the engine's ``seed``), so what a sampled sequence draws depends on the others
in the batch: a request's ``seed`` cannot make sampled text reproducible. The card says
so (``per_request_seed=False``) and the worker refuses ``seed`` with temperature > 0;
greedy decoding is deterministic and needs no seed.

Model folders: ``model_path`` is a local Hugging Face folder or a ``.gguf`` file, which
``model_folder`` converts once into a cached folder; no path is the synthetic tiny-llama.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidegate.engines import tiny_llama
from tidegate.engines.base import (
    GREEDY_BELOW,
    FailureNotice,
    MemoryReport,
    ModelCard,
    Resume,
    SamplingParams,
    TokenEvent,
)
from tidegate.engines.hf_runtime import (
    check_threads,
    claim_device,
    engine_memory,
    quiet_transformers,
)
from tidegate.engines.model_folder import local_model_folder
from tidegate.engines.steps import StepTally, clock_steps
from tidegate.engines.text import CatchUp, StopScanner
from tidegate.errors import InvalidRequest, PromptTooLong, ReplicaFailed

log = logging.getLogger(__name__)
# Context of a model given by path, when its position table is larger: one full context
# must fit in the KV cache.
MAX_CONTEXT_TOKENS = 8192
# Tokens (prompt + output) the cache holds for each of max_num_seqs sequences at once;
# longer sequences wait in the worker until running ones leave room.
TYPICAL_SEQ_TOKENS = 512
PAGE_SIZE = 32  # tokens per KV page: small pages waste little on short sequences
STOP_TIMEOUT_S = 10.0
_POLL_S = 0.05  # how often the reader thread checks the manager is alive when idle
_DETOKENIZE_LOOKBACK = 4  # prompt tokens decoded before the output, for leading spaces


@dataclass(frozen=True, slots=True)
class CacheSizing:
    """The paged KV cache of the continuous batching manager."""

    page_size: int
    num_blocks: int
    max_batch_tokens: int  # tokens in one forward pass; longer prompts prefill in chunks

    @property
    def capacity_tokens(self) -> int:
        return self.page_size * self.num_blocks


def cache_sizing(
    max_num_seqs: int,
    context_tokens: int,
    page_size: int = PAGE_SIZE,
    typical_seq_tokens: int = TYPICAL_SEQ_TOKENS,
) -> CacheSizing:
    """Whole pages for one full context, and for ``max_num_seqs`` typical sequences at once."""
    whole = math.ceil(context_tokens / page_size)
    typical = math.ceil(min(context_tokens, typical_seq_tokens) / page_size)
    return CacheSizing(
        page_size=page_size,
        num_blocks=max(whole, max(1, max_num_seqs) * typical),
        max_batch_tokens=max(256, min(context_tokens, 2048)),
    )


class IncrementalDetokenizer:
    """Text deltas from a growing list of generated tokens.

    Each step decodes a short window (a few tokens already shown plus the new ones) and
    returns the text past what the window's older part decodes to. A delta ending in an
    incomplete UTF-8 character (decoded as U+FFFD) is held back until the next token
    completes it, or until the sequence ends.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        prompt_ids: Sequence[int],
        lookback: int = _DETOKENIZE_LOOKBACK,
    ) -> None:
        self._decode = decode
        self._tokens = list(prompt_ids[-lookback:]) if lookback else []
        self._base = len(self._tokens)
        self._prefix = 0  # window start
        self._read = self._base  # tokens before this are shown

    def update(self, generated: Sequence[int], final: bool = False) -> str:
        """The new text, given all tokens generated so far."""
        known = len(self._tokens) - self._base
        self._tokens.extend(generated[known:])
        shown = self._decode(self._tokens[self._prefix : self._read])
        text = self._decode(self._tokens[self._prefix :])
        if not final and (len(text) <= len(shown) or text.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return text[len(shown) :]


@dataclass(slots=True)
class _Route:
    """Where one sequence's outputs go. Outputs are cumulative, so only the newest is kept:
    a slow reader costs no memory. Touched only on its event loop's thread."""

    loop: asyncio.AbstractEventLoop
    ready: asyncio.Event
    latest: Any = None  # the newest GenerationOutput
    error: BaseException | None = None

    def offer(self, output: Any) -> None:
        if self.latest is None or not self.latest.is_finished():
            self.latest = output
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()


class TransformersGenerator:
    """A ``GenerationEngine`` over a causal LM in a local Hugging Face folder or GGUF file.

    ``model_path=None`` serves the built-in synthetic tiny-llama (built on first use by
    ``ensure_tiny_llama``). ``memory_fraction`` caps this process's share of a CUDA device
    (``torch.cuda.set_per_process_memory_fraction``); ``max_context_tokens`` caps prompt +
    output (default: 1024 for tiny-llama, else the position table up to 8192).
    ``cache_dir`` holds built and converted model folders (default ``$TIDEGATE_CACHE``).
    """

    def __init__(
        self,
        name: str,
        *,
        model_path: str | None = None,
        device: str = "cpu",
        seed: int = 0,
        max_num_seqs: int = 16,
        synthetic: bool = False,
        memory_fraction: float | None = None,
        max_context_tokens: int | None = None,
        cache_dir: Path | None = None,
        description: str | None = None,
        threads: int | None = None,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, not {max_num_seqs}")
        if memory_fraction is not None and not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], not {memory_fraction}")
        self.name = name
        self.model_path = model_path
        self.device = device
        self.seed = seed
        self.max_num_seqs = max_num_seqs
        self.synthetic = synthetic
        self.memory_fraction = memory_fraction
        self.threads = None if threads is None else check_threads(threads)
        self.cache_dir = cache_dir
        self._context_limit = max_context_tokens
        self._description = description
        self.card = self._make_card(self._default_context(), "")
        self.sizing: CacheSizing | None = None
        self._tokenizer: Any = None
        self._model: Any = None
        self._manager: Any = None
        self._eos_ids: frozenset[int] = frozenset()
        self._vocab_size = 0
        self._routes: dict[str, _Route] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._stopping = threading.Event()
        self._failure: str | None = None  # set once the engine cannot generate any more
        self._notice = FailureNotice(name)  # the manager died (a failure that is not close())
        self._closed = False
        self.steps = StepTally()  # every step the manager runs, timed in its thread

    # ------------------------------------------------------------------ card
    def _default_context(self) -> int:
        if self._context_limit is not None:
            return self._context_limit
        if self.model_path is None:
            return tiny_llama.CONTEXT_TOKENS
        return MAX_CONTEXT_TOKENS

    def _make_card(self, context: int, folder: str, sizing: CacheSizing | None = None) -> ModelCard:
        if self._description is not None:
            description = self._description
        elif self.model_path is None:
            description = tiny_llama.DESCRIPTION
        else:
            description = f"local model {folder or self.model_path}"
            if self.synthetic:
                description = "SYNTHETIC (random weights): " + description
        return ModelCard(
            name=self.name,
            task="generate",
            engine="transformers",
            max_context_tokens=context,
            max_output_tokens=context - 1,
            synthetic=self.synthetic,
            description=description,
            max_cached_tokens=sizing.capacity_tokens if sizing else 0,
            cache_page_tokens=sizing.page_size if sizing else 1,
            per_request_seed=False,
        )

    @property
    def num_running(self) -> int:
        """Sequences streaming now."""
        with self._lock:
            return len(self._routes)

    # ------------------------------------------------------------------ life cycle
    def load(self) -> None:
        """Load tokenizer and weights, allocate the KV cache, start the manager; blocking."""
        import torch
        import transformers

        hf: Any = transformers  # its functions are untyped
        quiet_transformers()
        if self._closed:
            raise ReplicaFailed(f"engine {self.name} is closed")
        if self._manager is not None:
            return  # loaded already
        if self.model_path is not None:
            folder = local_model_folder(self.model_path, self.cache_dir)
        else:
            folder = tiny_llama.ensure_tiny_llama(self.cache_dir)
        device = claim_device(self.device, self.memory_fraction, self.threads)
        tokenizer = hf.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = hf.AutoModelForCausalLM.from_pretrained(
            folder,
            local_files_only=True,
            attn_implementation="sdpa",
            # Half precision as saved on a GPU; float32 on CPU, where bf16 matmuls are slow.
            dtype="auto" if device.type == "cuda" else torch.float32,
        )
        model = model.to(device).eval()

        config = model.config.get_text_config()
        positions = int(getattr(config, "max_position_embeddings", 0) or MAX_CONTEXT_TOKENS)
        context = min(self._default_context(), positions)
        if context < 2:
            raise ValueError(f"context of {context} tokens is too small to generate")
        self._eos_ids = frozenset(_eos_ids(model, tokenizer))
        self._vocab_size = int(config.vocab_size)
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = min(self._eos_ids) if self._eos_ids else 0
        # Defaults that make the manager build temperature, top-p and top-k processors, so
        # that every request can set its own; each request passes all three.
        generation = hf.GenerationConfig(
            do_sample=True,
            temperature=0.7,
            top_p=0.9,
            top_k=50,
            max_new_tokens=16,
            eos_token_id=sorted(self._eos_ids) if self._eos_ids else -1,
            pad_token_id=pad,
        )
        sizing = cache_sizing(self.max_num_seqs, context)
        manager = model.init_continuous_batching(
            generation_config=generation,
            continuous_batching_config=hf.ContinuousBatchingConfig(
                page_size=sizing.page_size,
                num_blocks=sizing.num_blocks,
                max_batch_tokens=sizing.max_batch_tokens,
                max_requests_per_batch=self.max_num_seqs,
                per_request_processors=True,
                seed=self.seed,
            ),
        )
        try:
            manager.warmup()  # allocates the cache here, so that a failure fails load()
            clock_steps(manager, self.steps)  # from the first step served, not the warm-up's
            with torch.inference_mode():  # the manager's thread inherits it
                manager.start()
        except BaseException:
            manager.stop(block=True, timeout=STOP_TIMEOUT_S, hard_stop=True)
            raise
        self._tokenizer, self._model, self._manager, self.sizing = tokenizer, model, manager, sizing
        self.card = self._make_card(context, str(folder), sizing)
        self._reader = threading.Thread(
            target=self._read_outputs, name=f"tidegate-gen-reader-{self.name}", daemon=True
        )
        self._reader.start()

    def close(self) -> None:
        """Fail what still runs, stop the manager's thread and the reader; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._failure = self._failure or f"engine {self.name} is closed"
        manager = self._manager
        if manager is not None:
            try:
                manager.stop(block=True, timeout=STOP_TIMEOUT_S, hard_stop=True)
            except Exception:
                log.exception("engine %s: stopping the generation manager failed", self.name)
            if manager.is_running():
                log.error("engine %s: generation thread still running after stop", self.name)
        self._stopping.set()
        if self._reader is not None:
            self._reader.join(timeout=STOP_TIMEOUT_S)
        self._fail_all(self._failure)
        self._model = self._manager = None

    def memory(self) -> MemoryReport:
        return engine_memory(self._model, self.device)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once, from the reader thread, when the manager dies."""
        self._notice.subscribe(callback)

    def _die(self, reason: str) -> None:
        """The manager can generate no more: refuse new sequences, tell the owners once."""
        with self._lock:
            if self._notice.reason is None:  # the first death's reason stays
                self._failure = reason
        self._notice.announce(reason)

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt: str) -> list[int]:
        ids: list[int] = self._require_tokenizer()(prompt)["input_ids"]
        return list(ids)

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        tokenizer = self._require_tokenizer()
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
            )
            # The template writes its own special tokens (BOS and the like).
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._require_tokenizer().decode(list(ids), skip_special_tokens=True)
        return text

    def _require_tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise ReplicaFailed(f"engine {self.name} is not loaded")
        return self._tokenizer

    # ------------------------------------------------------------------ generation
    def _sampling_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        if params.temperature < GREEDY_BELOW:
            return {"temperature": 1.0, "top_p": 1.0, "top_k": 1}
        top_p = float(params.top_p)
        return {
            "temperature": float(params.temperature),
            "top_p": min(1.0, top_p) if top_p > 0.0 else 1.0,
            "top_k": self._vocab_size,
        }

    async def generate(
        self,
        seq_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        resume: Resume | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Stream one sequence; closing the iterator early cancels it in the manager. With
        ``resume``, go on after a pause (``GenerationEngine.generate``)."""
        from transformers.generation.continuous_batching import RequestStatus

        manager = self._manager
        if self._failure is not None or manager is None:
            raise ReplicaFailed(self._failure or f"engine {self.name} is not loaded")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, not {params.max_tokens}")
        if not prompt_ids:
            # The manager cannot run a sequence of no tokens: its whole loop would die.
            raise InvalidRequest(
                f"engine {self.name}: the prompt has no tokens", param="prompt", code="empty_prompt"
            )
        if len(prompt_ids) + params.max_tokens > self.card.max_context_tokens:
            # The worker checks this first; a request larger than the cache kills the manager.
            raise PromptTooLong(
                f"engine {self.name}: {len(prompt_ids)} prompt + {params.max_tokens} output "
                f"tokens exceed the context of {self.card.max_context_tokens}"
            )
        rid = f"{seq_id}#{next(self._ids)}"  # unique even if a seq_id comes again
        route = _Route(asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._routes[rid] = route
        done = False  # the manager finished or failed the request: nothing to cancel
        try:
            if self._failure is not None:  # died while this sequence was being set up
                done = True
                raise ReplicaFailed(_loop_failed(self.name))
            before = list(resume.token_ids) if resume is not None else []
            if len(before) >= params.max_tokens:
                raise ValueError(f"a resumed sequence has made its {params.max_tokens} tokens")
            added = manager.add_request(
                list(prompt_ids) + before,
                request_id=rid,
                max_new_tokens=params.max_tokens - len(before),
                streaming=True,
                **self._sampling_kwargs(params),
            )
            if added is None:
                done = True
                raise ReplicaFailed(f"engine {self.name}: the generation loop is not running")
            text_of = IncrementalDetokenizer(self.decode, prompt_ids)
            scanner = StopScanner(params.stop)
            catch_up = None
            if resume is not None:  # the paused part's text, as the client got it
                catch_up = CatchUp(scanner.feed(text_of.update(before))[0], resume.text_chars)
            while True:
                await route.ready.wait()
                route.ready.clear()
                if route.error is not None:
                    raise route.error
                output = route.latest
                done = output.is_finished()
                if output.status == RequestStatus.FAILED:
                    if self._closed:
                        raise ReplicaFailed(f"engine {self.name} is closed")
                    # The engine's own text stays in the log: clients read no Python errors.
                    log.warning("engine %s: sequence %s failed: %s", self.name, rid, output.error)
                    raise ReplicaFailed(f"engine {self.name}: generating this sequence failed")
                tokens = before + output.generated_tokens if before else output.generated_tokens
                made = len(tokens)
                text, stopped = scanner.feed(text_of.update(tokens, final=done))
                if done and not stopped:
                    text += scanner.flush()
                if catch_up is not None:
                    text = catch_up(text)
                if stopped:
                    yield TokenEvent(text, made, "stop", tokens)
                    return
                if done:
                    eos = bool(tokens) and tokens[-1] in self._eos_ids
                    yield TokenEvent(text, made, "stop" if eos else "length", tokens)
                    return
                if text:
                    yield TokenEvent(text, made, token_ids=tokens)
        finally:
            with self._lock:
                self._routes.pop(rid, None)
            if not done:
                manager.cancel_request(rid)

    # ------------------------------------------------------------------ reader thread
    def _read_outputs(self) -> None:
        manager = self._manager
        try:
            while not self._stopping.is_set():
                output = manager.get_result(timeout=_POLL_S)
                if output is None:
                    if not manager.is_running() or _fatal_error(manager) is not None:
                        if not self._closed:
                            reason = _fatal_error(manager) or "the generation loop stopped"
                            self._die(f"engine {self.name}: generation loop died: {reason}")
                        break
                    continue
                batch = [output]
                while (more := manager.get_result(timeout=0)) is not None:
                    batch.append(more)
                self._dispatch(batch)
        except Exception as exc:  # a bug here must not leave sequences waiting forever
            log.exception("engine %s: output reader failed", self.name)
            self._die(f"engine {self.name}: output reader failed: {exc}")
        if self._failure is not None:
            self._fail_all(self._failure)

    def _dispatch(self, outputs: list[Any]) -> None:
        """Hand outputs to their sequences' loops, one callback per loop."""
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Route, Any]]] = {}
        with self._lock:
            for output in outputs:
                route = self._routes.get(output.request_id)
                if route is not None:  # else: a sequence that stopped listening
                    per_loop.setdefault(route.loop, []).append((route, output))
        for loop, items in per_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # its loop is closed: nobody will read these
                with self._lock:
                    for key in [k for k, r in self._routes.items() if r.loop is loop]:
                        self._routes.pop(key, None)

    def _fail_all(self, reason: str) -> None:
        """Fail every waiting sequence; ``reason`` is for the log, clients get a plain one."""
        public = f"engine {self.name} is closed" if self._closed else _loop_failed(self.name)
        with self._lock:
            routes = list(self._routes.values())
        for route in routes:
            with contextlib.suppress(RuntimeError):  # its loop is closed
                route.loop.call_soon_threadsafe(route.fail, ReplicaFailed(public))


def _loop_failed(name: str) -> str:
    """What a client reads when the loop died; the reason is in the worker's log."""
    return f"engine {name}: the generation loop failed; this replica is being replaced"


def _put_all(items: list[tuple[_Route, Any]]) -> None:
    for route, output in items:
        route.offer(output)


def _fatal_error(manager: Any) -> str | None:
    error = manager.background_thread_status.fatal_error
    return None if error is None else f"{type(error).__name__}: {error}"


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    found: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, (list, tuple)):
            found.update(int(v) for v in value)
    if not found and tokenizer.eos_token_id is not None:
        found.add(int(tokenizer.eos_token_id))
    return {eos for eos in found if eos >= 0}


__all__ = [
    "CacheSizing",
    "IncrementalDetokenizer",
    "TransformersGenerator",
    "cache_sizing",
]
