"""The Engine protocols: what a worker needs from a model, whatever runs it.

An embedding engine turns a batch of texts into vectors; the worker forms the batches.
A generation engine runs many sequences at once (iteration-level batching): the worker
decides which sequence starts when, the engine streams each one's tokens back.
Engines are loaded and warmed before a worker reports ready.

An engine that runs a loop of its own (transformers' continuous batching thread) can die
while the worker lives: it then tells its owner through ``on_failure``, fails whatever it
still runs, and refuses every later request. It never looks alive once it is not.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

log = logging.getLogger("tidegate.engine")

Task = Literal["embeddings", "generate"]
GREEDY_BELOW = 1e-5  # temperatures under this are greedy decoding
# A batch of embeddings: float32, one C-contiguous row per input (inputs x dimensions). Rows
# go to the wire as they are (base64 is their bytes), with no Python float in between.
Vectors: TypeAlias = "NDArray[np.float32]"
Vector: TypeAlias = "NDArray[np.float32]"  # one row of Vectors (a view: no copy)


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What a model is and what it accepts."""

    name: str
    task: Task
    engine: str  # "transformers" or "simulated"
    max_context_tokens: int  # longest input (embeddings) or prompt + output (generate)
    max_output_tokens: int = 0  # generate: largest max_tokens accepted
    default_output_tokens: int = 16  # generate: max_tokens when the request gives none
    max_inputs: int = 2048  # embeddings: inputs per request
    dimensions: int = 0  # embeddings: vector size
    synthetic: bool = False  # random weights: for load and scheduling work only
    description: str = ""
    # generate: the KV cache, in tokens (0: unbounded) and tokens per page. A sequence
    # holds whole pages for its prompt + max_tokens; the worker starts one only if it fits.
    max_cached_tokens: int = 0
    cache_page_tokens: int = 1
    # generate: a request's seed makes its sampled text reproducible. When False, the
    # worker refuses seed with temperature > 0 (greedy text needs no seed).
    per_request_seed: bool = True


@dataclass(frozen=True, slots=True)
class MemoryReport:
    device: str
    weights_bytes: int  # parameters and buffers of the loaded model
    peak_bytes: int  # CUDA: allocator peak; CPU: peak process RSS


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """New output of one sequence: the text added since the last event."""

    text: str
    num_tokens: int  # tokens generated so far
    finish_reason: Literal["stop", "length"] | None = None
    # the ids of every token generated so far (a paused sequence resumes from them)
    token_ids: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class Resume:
    """A paused sequence going on (fair sharing's preemption): the tokens it had made, which
    the engine recomputes as prompt, and how many characters of its text the client has."""

    token_ids: tuple[int, ...]
    text_chars: int


class _Loaded(Protocol):
    card: ModelCard

    def load(self) -> None:
        """Load weights; blocking, run off the event loop."""

    def memory(self) -> MemoryReport: ...

    def close(self) -> None: ...

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Have ``callback(reason)`` called once if the engine dies and can serve no more.

        It may be called from any thread, and at once if the engine has died already.
        Closing the engine is not a failure. Engines without a loop of their own never call it.
        """


class FailureNotice:
    """The ``on_failure`` half of an engine with a loop of its own: owners are told once.

    ``subscribe`` keeps a callback (called at once when the death is known already);
    ``announce(reason)`` calls each one once, on the calling thread. A callback that raises
    is logged and the others are still told; with no callback the reason is logged, so that
    a death is never silent.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._callbacks: list[Callable[[str], None]] = []

    @property
    def reason(self) -> str | None:
        """Why the engine died; None while it lives."""
        return self._reason

    def subscribe(self, callback: Callable[[str], None]) -> None:
        with self._lock:
            reason = self._reason
            if reason is None:
                self._callbacks.append(callback)
        if reason is not None:
            callback(reason)

    def announce(self, reason: str) -> None:
        with self._lock:
            if self._reason is not None:
                return
            self._reason = reason
            callbacks, self._callbacks = self._callbacks, []
        if not callbacks:  # nobody owns this engine to say it: say it here
            log.error("%s", reason)
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:  # one owner's bug must not keep the others uninformed
                log.exception("engine %s: a failure callback failed", self.name)


@runtime_checkable
class EmbeddingEngine(_Loaded, Protocol):
    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text, before truncation: for token budgets and the context check."""

    async def embed(self, texts: Sequence[str]) -> Vectors:
        """One batch, a row per text; inference runs off the event loop."""


@runtime_checkable
class GenerationEngine(_Loaded, Protocol):
    def encode(self, prompt: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt of a chat, through the model's chat template."""

    def generate(
        self,
        seq_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        resume: Resume | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Start a sequence now; its tokens stream as they are made.

        Closing the iterator early (client gone) cancels the sequence and frees its slot.
        With ``resume`` it goes on from a pause: its tokens are prefilled after the prompt,
        ``num_tokens`` and ``params.max_tokens`` count them, and the text the client already
        has is not sent again (``text.CatchUp``).
        """


Engine = EmbeddingEngine | GenerationEngine
