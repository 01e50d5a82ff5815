"""plan_batch: when a replica should release the batch it is forming, and which one.

Design note. Waiting makes batches larger (throughput) and requests later (latency). The
fixed rule bounds the cost of waiting: a batch is released as soon as it is full, by count
(``max_batch_size``) or by tokens (``max_batch_tokens``), and never later than
``batch_window_ms`` after its oldest member arrived. When more than a full batch is queued
the batch is full by construction, so it goes at once: waiting could not make it larger.

Three adaptive levers refine it, each off unless configured:

- Priority-aware window (``level_windows_ms``): each level may wait less than
  ``batch_window_ms``; a batch waits only as long as its most urgent member's level allows,
  so a high request does not sit out the window a batch job may.
- Load-aware window (``load_aware``, with ``BatchView.arrival_rate_per_s`` from
  ``core.batch_adapt.ArrivalRate``): a partial batch is released as soon as the expected
  number of arrivals in what is left of its window, rate x time left, drops to one: waiting
  longer is more likely to add nobody than someone. At low load that is at once.
- Length-aware formation (``length_candidates`` > 1): a batch runs padded to its longest
  input, so mixed lengths waste work. The batch always holds the head of the pick order (the
  most urgent, most aged request); its companions are the requests among the first
  ``length_candidates`` in pick order whose token length is nearest the head's, taken while
  the padding pays. Two rules say when it does. By default, while the padded tokens
  (members x longest) stay within ``max_padding_ratio`` x their real tokens. On cost, with
  ``batch_overhead_tokens`` (a batch costs a fixed overhead plus a cost per padded token;
  the overhead in tokens of work is the ratio of the two): while the padding stays within
  (members - 1) x that overhead, i.e. while one padded batch is predicted to cost no more
  than its members run apart. The ratio rule pairs two long inputs that waste more than a
  batch saves, and refuses two short ones that waste less (measured on minilm on CPU,
  docs/benchmarks.md). Bound: only those first ``length_candidates`` can overtake, and
  every release takes the current head, so a request at position p of the pick order is in
  a batch within p releases unless more urgent work arrives (which the priority order itself
  allows). Neither rule changes who may overtake, only which candidates join. When
  requests left out for their length are waiting, the batch goes at once: the engine does
  not idle while work waits.

The adaptive cap (``BatchView.max_batch_size``, from ``core.batch_adapt.AdaptiveCap``, on
when ``target_p99_ms`` is set) lowers the count bound below ``max_batch_size`` when the
most urgent level misses its latency target, and raises it back when it has slack.

The view is the head of a WaitQueue in pick order; the caller removes exactly the released
requests. Without length-aware formation they are a prefix of the head, so ``WaitQueue.pop``
with the same ``now`` returns the same ones (``Release.is_prefix``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tidegate.core.request import Request

# Why a batch left: what /stats and explain show.
RELEASE_REASONS = (
    "full_size",  # count bound (max_batch_size, or the adaptive cap) reached
    "full_tokens",  # token budget spent
    "backlog",  # more queued than the batch could take: waiting cannot make it larger
    "length",  # requests left out for their length wait: the engine should not idle
    "window",  # the oldest member waited batch_window_ms
    "level_window",  # the oldest member waited its most urgent member's level window
    "no_companions",  # load-aware: under one arrival expected in what is left of the window
)


@dataclass(frozen=True, slots=True)
class BatchConfig:
    max_batch_size: int = 32
    max_batch_tokens: int | None = None  # None: only the count bounds a batch
    batch_window_ms: float = 5.0  # longest a request waits for companions
    # Per level (index 0 most urgent): that level's window; a level past the end, or None,
    # waits batch_window_ms. A window above batch_window_ms is refused (it would not bind).
    level_windows_ms: tuple[float | None, ...] = ()
    load_aware: bool = False  # release when under one companion is expected (needs a rate)
    length_candidates: int = 0  # <= 1: batches are the head of the pick order, as before
    max_padding_ratio: float = 1.25  # length-aware: padded tokens / real tokens, at most
    # Length-aware on cost: a batch's fixed cost in tokens of work (its overhead / the cost
    # of one padded token); padding stays within (members - 1) x this. None: the ratio rule.
    batch_overhead_tokens: float | None = None
    # AIMD cap (core.batch_adapt.AdaptiveCap): the most urgent level's P99 target, in ms;
    # None: the count bound stays max_batch_size. The cap never goes below min_batch_size.
    target_p99_ms: float | None = None
    min_batch_size: int = 1

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.batch_window_ms < 0:
            raise ValueError(f"batch_window_ms must be >= 0, got {self.batch_window_ms}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        for level, window in enumerate(self.level_windows_ms):
            if window is not None and not 0 <= window <= self.batch_window_ms:
                raise ValueError(
                    f"level {level} window must be in [0, batch_window_ms="
                    f"{self.batch_window_ms:g}] ms, got {window}"
                )
        if self.length_candidates < 0:
            raise ValueError(f"length_candidates must be >= 0, got {self.length_candidates}")
        if self.max_padding_ratio < 1:
            raise ValueError(f"max_padding_ratio must be >= 1, got {self.max_padding_ratio}")
        if self.batch_overhead_tokens is not None and not self.batch_overhead_tokens >= 0:
            raise ValueError(
                f"batch_overhead_tokens must be >= 0, got {self.batch_overhead_tokens}"
            )
        if self.target_p99_ms is not None and self.target_p99_ms <= 0:
            raise ValueError(f"target_p99_ms must be > 0, got {self.target_p99_ms}")
        if not 1 <= self.min_batch_size <= self.max_batch_size:
            raise ValueError(
                f"min_batch_size must be in [1, max_batch_size={self.max_batch_size}], "
                f"got {self.min_batch_size}"
            )

    @property
    def length_aware(self) -> bool:
        return self.length_candidates > 1

    def padding_pays(self, members: int, padded_tokens: int, real_tokens: int) -> bool:
        """Whether a length-aware batch of ``members`` may run ``padded_tokens`` (members x
        longest) for its ``real_tokens`` (the module note's two rules)."""
        if self.batch_overhead_tokens is not None:
            return padded_tokens - real_tokens <= (members - 1) * self.batch_overhead_tokens
        return padded_tokens <= self.max_padding_ratio * real_tokens

    def peek_size(self) -> int:
        """How much of the pick order the planner needs to see."""
        return max(self.max_batch_size + 1, self.length_candidates)

    def window_ms(self, level: int) -> float:
        if level < len(self.level_windows_ms):
            window = self.level_windows_ms[level]
            if window is not None:
                return window
        return self.batch_window_ms


@dataclass(frozen=True, slots=True, init=False)
class BatchView:
    """What the planner sees: the head of the queue in pick order, its size, and load."""

    head: Sequence[Request]  # at least config.peek_size() requests when that many are queued
    num_queued: int
    arrival_rate_per_s: float | None = None  # load-aware window: arrivals/s, None: unknown
    max_batch_size: int | None = None  # the adaptive cap; None: config.max_batch_size

    # written out for a compiled build, as Request's __init__ (core/request.py)
    def __init__(
        self,
        head: Sequence[Request],
        num_queued: int,
        arrival_rate_per_s: float | None = None,
        max_batch_size: int | None = None,
    ) -> None:
        object.__setattr__(self, "head", head)
        object.__setattr__(self, "num_queued", num_queued)
        object.__setattr__(self, "arrival_rate_per_s", arrival_rate_per_s)
        object.__setattr__(self, "max_batch_size", max_batch_size)


@dataclass(frozen=True, slots=True, init=False)
class Release:
    batch: tuple[Request, ...]  # in pick order
    reason: str  # one of RELEASE_REASONS
    is_prefix: bool = True  # the batch is the first len(batch) of the view's head

    # written out for a compiled build, as Request's __init__ (core/request.py)
    def __init__(self, batch: tuple[Request, ...], reason: str, is_prefix: bool = True) -> None:
        object.__setattr__(self, "batch", batch)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "is_prefix", is_prefix)


@dataclass(frozen=True, slots=True)
class WaitUntil:
    at: float | None  # None: nothing queued, wait for an arrival


BatchPlan = Release | WaitUntil


def plan_batch(view: BatchView, config: BatchConfig, now: float) -> BatchPlan:
    """Release the batch now, or say when to look again (see the module design note)."""
    size = config.max_batch_size
    if view.max_batch_size is not None:
        size = max(1, min(size, view.max_batch_size))
    if config.length_aware:
        batch, stopped_by_tokens, is_prefix = _form_by_length(view.head, config, size)
    else:
        batch, stopped_by_tokens = _fill(view.head, config.max_batch_tokens, size)
        is_prefix = True
    if not batch:
        return WaitUntil(None)
    if len(batch) >= size:
        return Release(batch, "full_size", is_prefix)
    if stopped_by_tokens:
        return Release(batch, "full_tokens", is_prefix)
    if view.num_queued > len(batch):
        # Others wait that this batch cannot take: left out for length, or a short view.
        return Release(batch, "length" if config.length_aware else "backlog", is_prefix)
    return _by_window(batch, view, config, now)


def _by_window(
    batch: tuple[Request, ...], view: BatchView, config: BatchConfig, now: float
) -> BatchPlan:
    """A partial batch: release at its window's end, or earlier when waiting cannot pay."""
    # the smallest window and the earliest arrival by a plain scan: what min() over a
    # generator gives, without the generator (a generic call per member, compiled)
    window_ms = config.window_ms(batch[0].priority)
    oldest_at = batch[0].arrival_at
    for request in batch:
        window = config.window_ms(request.priority)
        if window < window_ms:
            window_ms = window
        if request.arrival_at < oldest_at:
            oldest_at = request.arrival_at
    ends_at = oldest_at + window_ms / 1e3
    if now >= ends_at:
        reason = "level_window" if window_ms < config.batch_window_ms else "window"
        return Release(batch, reason)
    rate = view.arrival_rate_per_s
    if config.load_aware and rate is not None:
        # Expected arrivals until ends_at: rate * (ends_at - now); below one from give_up_at.
        give_up_at = ends_at - 1.0 / rate if rate > 0 else now
        if now >= give_up_at:
            return Release(batch, "no_companions")
        return WaitUntil(give_up_at)
    return WaitUntil(ends_at)


def _fill(
    head: Sequence[Request], budget: int | None, size: int
) -> tuple[tuple[Request, ...], bool]:
    """Take requests in order while they fit; True when the token budget stopped it."""
    taken: list[Request] = []
    tokens = 0
    for request in head:
        if len(taken) >= size:
            break
        if budget is not None and taken and tokens + request.cost_tokens > budget:
            return tuple(taken), True
        taken.append(request)
        tokens += request.cost_tokens
    # A batch whose budget is spent cannot grow either, even if nothing more is queued.
    return tuple(taken), budget is not None and tokens >= budget


def _form_by_length(
    head: Sequence[Request], config: BatchConfig, size: int
) -> tuple[tuple[Request, ...], bool, bool]:
    """The head plus the candidates nearest its length (module note); in pick order.

    Returns the batch, whether the token budget stopped it, and whether it is a prefix.
    """
    candidates = head[: max(size, config.length_candidates)]
    if not candidates:
        return (), False, True
    first = candidates[0]
    anchor = first.cost_tokens
    order = sorted(
        range(1, len(candidates)), key=lambda i: (abs(candidates[i].cost_tokens - anchor), i)
    )
    budget = config.max_batch_tokens
    chosen = [0]
    tokens = first.cost_tokens
    longest = max(1, first.cost_tokens)
    real = longest
    stopped_by_tokens = False
    for index in order:
        if len(chosen) >= size:
            break
        cost = candidates[index].cost_tokens
        if budget is not None and tokens + cost > budget:
            stopped_by_tokens = True
            continue  # a nearer length may still fit; the batch is full by tokens anyway
        padded = (len(chosen) + 1) * max(longest, cost)
        if not config.padding_pays(len(chosen) + 1, padded, real + max(1, cost)):
            continue
        chosen.append(index)
        tokens += cost
        longest = max(longest, cost)
        real += max(1, cost)
    chosen.sort()
    batch = tuple(candidates[i] for i in chosen)
    stopped_by_tokens = stopped_by_tokens or (budget is not None and tokens >= budget)
    return batch, stopped_by_tokens, chosen[-1] == len(chosen) - 1
