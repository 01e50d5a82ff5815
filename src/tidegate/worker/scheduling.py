"""The worker's two scheduling loops, both over a core WaitQueue.

- ``EmbeddingBatcher`` (dynamic batching, request level): every input of every request is
  one queue entry; one owner task asks its core ``BatchPlanner`` (``plan_batch`` with the
  adaptive levers: per-level and load-aware windows, length-aware formation, the AIMD cap)
  when to release a batch and which, takes it from the queue and runs it on the engine, one
  batch at a time; /stats shows the planner's cap, windows and why batches left.
- ``SequenceScheduler`` (continuous batching, iteration level): a sequence waits in the
  queue until one of ``max_num_seqs`` slots is free and the engine's KV cache has room for
  its prompt + ``max_tokens`` (whole pages, ``ModelCard.max_cached_tokens``), then joins the
  engine's running batch; a finished or cancelled sequence frees its slot and its pages at
  once and the most urgent waiting one takes them. The most urgent sequence is never
  overtaken by a smaller one that would fit: it waits for room (a sequence always fits an
  empty cache). With a prefill budget (``max_prefill_tokens`` > 0) a sequence also joins
  only while the prompts of the sequences admitted and not yet at their first token
  (``prefilling_tokens``) stay within it with its own (one always joins when none is
  pending): a burst of long prompts does not take every free slot at once, so a sequence
  dispatched behind it waits one or two engine steps, not the whole burst's prefill. The
  head is never overtaken here either. With fair sharing (``QueueConfig.fairness``) the
  queue orders by tenant inside a level (core.fairness, the tenant the gateway forwards);
  a sequence that ends settles its tenant's counter with the tokens it was served. Both
  are event-driven: they wake on an arrival, a slot freed, a first token or a window's
  end.

``fail(error)`` is for an engine that died: every request still waiting (and, for
embeddings, every input of the batch that was running) is answered with ``error``, and
every later one is refused with it. Nothing waits on a dead engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from tidegate.clock import SYSTEM_CLOCK, Clock
from tidegate.core.batch_adapt import BatchPlanner, CapConfig
from tidegate.core.batching import BatchConfig, Release, plan_batch
from tidegate.core.fairness import sequence_to_pause
from tidegate.core.queue import QueueConfig, Rejected, WaitQueue
from tidegate.core.request import Request
from tidegate.engines.base import (
    EmbeddingEngine,
    GenerationEngine,
    Resume,
    SamplingParams,
    TokenEvent,
    Vector,
)
from tidegate.engines.steps import StepTally
from tidegate.errors import Overloaded, ReplicaFailed
from tidegate.metrics import WorkerMetrics

log = logging.getLogger("tidegate.worker")

# Completions remembered for the recent-throughput figure of /stats.
_THROUGHPUT_WINDOW_S = 10.0


@dataclass
class Throughput:
    """Items completed per second over the last few seconds."""

    window_s: float = _THROUGHPUT_WINDOW_S
    _events: deque[tuple[float, int]] = field(default_factory=deque)

    def record(self, now: float, count: int) -> None:
        self._events.append((now, count))

    def per_s(self, now: float) -> float:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        return sum(count for _, count in self._events) / self.window_s


def _refuse(decision: Rejected) -> Overloaded:
    return Overloaded(
        f"worker queue: {decision.message}",
        code=decision.reason.value,
        retry_after_s=decision.retry_after_s or 1.0,
    )


def _shed(victim: Request) -> Overloaded:
    return Overloaded(
        "worker queue full: shed for a more urgent request", code="shed", retry_after_s=1.0
    )


class EmbeddingBatcher:
    def __init__(
        self,
        engine: EmbeddingEngine,
        batch: BatchConfig,
        queue: QueueConfig,
        metrics: WorkerMetrics,
        clock: Clock = SYSTEM_CLOCK,
        cap: CapConfig | None = None,
    ) -> None:
        self.engine = engine
        self.batch = batch
        self.planner = BatchPlanner(batch, cap)
        self.queue = WaitQueue(queue)
        self.metrics = metrics
        self.clock = clock
        self.throughput = Throughput()
        self.steps = StepTally()  # engine time by batch size (kind "batch"), for /metrics
        self.num_running = 0  # inputs in the batch on the engine now
        self._texts: dict[str, str] = {}
        self._results: dict[str, asyncio.Future[Vector]] = {}
        self._wake = asyncio.Event()
        self._ids = itertools.count()
        self.failure: BaseException | None = None  # set by fail(): the engine is gone

    @property
    def slots(self) -> int:
        # A replica holds what it can batch soon: the running batch and the next one.
        return 2 * self.batch.max_batch_size

    async def embed(
        self, texts: Sequence[str], tokens: Sequence[int], priority: int
    ) -> list[Vector]:
        """Queue every input, wait for all; cancelling this removes what is still queued."""
        if self.failure is not None:
            raise self.failure
        now = self.clock.now()
        loop = asyncio.get_running_loop()
        ids: list[str] = []
        try:
            for text, cost in zip(texts, tokens, strict=True):
                rid = f"e{next(self._ids)}"
                decision = self.queue.admit(
                    Request(rid, self.engine.card.name, priority, now, cost_tokens=cost), now
                )
                if isinstance(decision, Rejected):
                    raise _refuse(decision)
                for victim in decision.shed:
                    self._settle(victim.id, exc=_shed(victim))
                ids.append(rid)
                self._texts[rid] = text
                self._results[rid] = loop.create_future()
            self.planner.arrived(now, len(ids))
            self._wake.set()
            return list(await asyncio.gather(*(self._results[rid] for rid in ids)))
        finally:
            for rid in ids:
                self.queue.cancel(rid)  # no-op for inputs already batched
                self._texts.pop(rid, None)
                future = self._results.pop(rid, None)
                if future is not None and not future.done():
                    future.cancel()

    def drain(self, error: BaseException) -> int:
        """Answer every input not yet in a batch with ``error``; returns how many."""
        waiting = self.queue.pop(len(self.queue), self.clock.now()) if len(self.queue) else ()
        for request in waiting:
            self._settle(request.id, exc=error)
        return len(waiting)

    def fail(self, error: BaseException) -> None:
        """Answer every input, waiting or in the running batch, with ``error``; refuse more."""
        self.failure = error
        self.drain(error)
        for rid in list(self._results):  # a dead loop leaves its batch's futures open
            self._settle(rid, exc=error)

    async def run(self) -> None:
        """The owner loop: plan, pop, run; sleep until the next arrival or window end."""
        planner = self.planner
        while True:
            now = self.clock.now()
            head = self.queue.peek(planner.peek_size, now)
            plan = plan_batch(planner.view(head, len(self.queue), now), planner.config, now)
            if isinstance(plan, Release):
                planner.released(plan)
                await self._run_batch(planner.take(self.queue, plan, now))
                continue
            self._wake.clear()
            timeout = None if plan.at is None else max(0.0, plan.at - now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    async def _run_batch(self, batch: Sequence[Request]) -> None:
        texts = [self._texts[r.id] for r in batch]
        self.num_running = len(batch)
        started = self.clock.now()
        try:
            vectors = await self.engine.embed(texts)
        except Exception:  # the engine failed this batch: fail its requests, go on
            log.exception("engine %s failed a batch of %d", self.engine.card.name, len(batch))
            # Why it failed is in the log line above, not in what the client reads.
            failure = ReplicaFailed(f"engine {self.engine.card.name}: this batch failed")
            for r in batch:
                self._settle(r.id, exc=failure)
            return
        finally:
            self.num_running = 0
        done = self.clock.now()
        self.planner.finished(batch, done, started)
        self.metrics.batch_size.labels(self.engine.card.name).observe(len(batch))
        self.metrics.batch_duration.labels(self.engine.card.name).observe(done - started)
        self.steps.add_batch(len(batch), done - started)
        self.throughput.record(done, len(batch))
        self.queue.drain.record(done, len(batch))
        for r, vector in zip(batch, vectors, strict=True):
            self._settle(r.id, vector)

    def _settle(
        self, rid: str, vector: Vector | None = None, exc: BaseException | None = None
    ) -> None:
        future = self._results.get(rid)
        if future is None or future.done():
            return  # its request was cancelled meanwhile
        if exc is not None:
            future.set_exception(exc)
        else:
            assert vector is not None
            future.set_result(vector)


class SequenceScheduler:
    def __init__(
        self,
        engine: GenerationEngine,
        max_num_seqs: int,
        queue: QueueConfig,
        metrics: WorkerMetrics,
        clock: Clock = SYSTEM_CLOCK,
        max_prefill_tokens: int = 0,
    ) -> None:
        if max_prefill_tokens < 0:
            raise ValueError(f"max_prefill_tokens must be >= 0, got {max_prefill_tokens}")
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens  # 0: no bound
        self.queue = WaitQueue(queue)
        self.metrics = metrics
        self.clock = clock
        self.throughput = Throughput()
        self.num_running = 0
        self.cached_tokens = 0  # KV cache tokens reserved by running sequences, whole pages
        self.prefilling_tokens = 0  # prompt tokens of running sequences before their 1st token
        self._granted: dict[str, asyncio.Future[None]] = {}
        self._prompt_tokens: dict[str, int] = {}  # waiting sequences: their prompt's tokens
        self._prefilling: dict[str, int] = {}  # running, before their first token: the same
        self.failure: BaseException | None = None  # set by fail(): the engine is gone
        self.holds: dict[str, int] = {}  # sequences that waited, by what held them
        self._last_hold: tuple[str, str] | None = None  # (seq_id, reason) last counted
        self._running: dict[str, _Running] = {}  # sequences in the engine, by seq_id
        self._paused: set[str] = set()  # paused sequences waiting for a slot again
        self._grants = itertools.count()  # the order slots were granted in
        self.num_preempted = 0  # sequences paused for a preempting one
        self.recomputed_tokens = 0  # tokens they had made, prefilled again on resuming

    @property
    def slots(self) -> int:
        return self.max_num_seqs

    async def stream(
        self,
        seq_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        priority: int,
        tenant: str = "",
        preempt: str = "",
    ) -> AsyncGenerator[TokenEvent, None]:
        """Wait for a slot in priority order (by tenant inside a level with fair sharing),
        then stream the sequence's tokens.

        ``preempt`` (fair sharing's preemption, decided by the gateway: core.fairness): with
        every slot taken, one of that tenant's decoding sequences pauses at its next token
        and hands its slot to this one; it waits in the queue again (first of its level by
        its arrival) and resumes from its tokens (``Resume``: recomputed, its client's text
        going on where it stopped)."""
        if self.failure is not None:
            raise self.failure
        now = self.clock.now()
        request = Request(
            seq_id,
            self.engine.card.name,
            priority,
            now,
            cost_tokens=len(prompt_ids) + params.max_tokens,
            tenant=tenant,
        )
        decision = self.queue.admit(request, now)
        if isinstance(decision, Rejected):
            raise _refuse(decision)
        for victim in decision.shed:
            self._granted.pop(victim.id).set_exception(_shed(victim))
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._granted[seq_id] = granted
        self._prompt_tokens[seq_id] = len(prompt_ids)
        if preempt and self.num_running >= self.max_num_seqs:
            self._preempt(preempt, seq_id)
        self._fill_slots()
        if not granted.done() and self.num_running >= self.max_num_seqs:
            self._hold(seq_id, "slots")  # it came with every slot taken (counted here, once:
            # not by _fill_slots, which runs at every release and first token)
        await self._wait_for_slot(request, granted)
        made = 0
        sent_chars = 0
        token_ids: Sequence[int] = ()
        resume: Resume | None = None
        try:
            while True:
                running = self._running[seq_id] = _Running(tenant, next(self._grants))
                events = cast(
                    AsyncGenerator[TokenEvent, None],
                    self.engine.generate(seq_id, prompt_ids, params)
                    if resume is None
                    else self.engine.generate(seq_id, prompt_ids, params, resume),
                )
                async with contextlib.aclosing(events):
                    async for event in events:
                        if seq_id in self._prefilling:  # its first token: its prefill is done
                            self._prefilled(seq_id)
                            self._fill_slots()
                        made = running.made = event.num_tokens
                        sent_chars += len(event.text)
                        token_ids = event.token_ids
                        yield event
                        if running.handover is not None and event.finish_reason is None:
                            if self._waiting(running.handover):
                                break  # paused, for the sequence its slot goes to
                            running.handover = None  # that one went away meanwhile
                    else:
                        return  # finished (or stopped)
                # (the ids as of its last event: an engine may share a list that grows)
                resume = Resume(tuple(token_ids[:made]), sent_chars)
                granted = self._pause(request, running, len(prompt_ids) + made)
                await self._wait_for_slot(request, granted, resumed=True)
        finally:
            self.throughput.record(self.clock.now(), made)
            self.queue.drain.record(self.clock.now())
            if resume is None or seq_id not in self._granted:
                self._release_slot(request, len(prompt_ids), made)  # (hands over if asked)
            else:  # paused, and gone while it waited: no slot held, its estimate refunded
                self._granted.pop(seq_id, None)
                self._prompt_tokens.pop(seq_id, None)
                fair = self.queue.fair
                if fair is not None:
                    fair.charge(request.tenant, fair.config.cost(len(prompt_ids), made))
            self._running.pop(seq_id, None)
            self._paused.discard(seq_id)

    async def _wait_for_slot(
        self, request: Request, granted: asyncio.Future[None], resumed: bool = False
    ) -> None:
        """Wait until ``request`` is granted a slot; if it goes away first, it leaves the
        queue (a paused one settles what it was served; the caller's ``finally`` does)."""
        seq_id = request.id
        try:
            await granted
        except BaseException:
            self._granted.pop(seq_id, None)
            self._prompt_tokens.pop(seq_id, None)
            self.queue.cancel(seq_id)
            if granted.done() and not granted.cancelled() and granted.exception() is None:
                # the slot was granted just as this request went away: nothing more served
                self._release_slot(request, prompt_tokens=0, made=0)
            else:
                self._fill_slots()  # it may have been the head that waited for cache room
            if resumed:
                self._granted[seq_id] = granted  # (tells the caller's ``finally`` it waited)
            raise

    def _preempt(self, tenant: str, seq_id: str) -> None:
        """``seq_id`` came to preempt one of ``tenant``'s sequences: the one decoding with
        the fewest tokens made (ties: the latest granted) pauses at its next token and hands
        its slot over. None decoding or all already pausing: it waits as any other."""
        victim = sequence_to_pause(
            (running, running.made, running.order)
            for running in self._running.values()
            if running.tenant == tenant and running.handover is None
        )
        if victim is not None:
            victim.handover = seq_id

    def _pause(
        self, request: Request, running: _Running, prefill_tokens: int
    ) -> asyncio.Future[None]:
        """A sequence stopped for a preempting one: its slot, pages and tenant's slot are
        free; it waits in the queue again (``requeue``: refunded, first of its level by its
        arrival) and its slot goes to the preempting sequence if that one still waits."""
        seq_id = request.id
        self.num_preempted += 1
        self.recomputed_tokens += running.made
        self.num_running -= 1
        self.cached_tokens -= self._cache_cost(request)
        self._prefilled(seq_id)
        self._running.pop(seq_id, None)
        self._paused.add(seq_id)
        self.queue.requeue(request, self.clock.now())
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._granted[seq_id] = granted
        self._prompt_tokens[seq_id] = prefill_tokens
        self._hand_over(running.handover)
        self._fill_slots()
        return granted

    def _waiting(self, seq_id: str) -> bool:
        granted = self._granted.get(seq_id)
        return granted is not None and not granted.done()

    def _hand_over(self, seq_id: str | None) -> None:
        """The slot just freed goes to the preempting ``seq_id``, whatever the queue's order,
        when it still waits and the slot is free."""
        if seq_id is None or self.num_running >= self.max_num_seqs or not self._waiting(seq_id):
            return
        request = self.queue.take(seq_id)
        if request is not None:
            self._grant(request)

    def drain(self, error: BaseException, keep_paused: bool = True) -> int:
        """Answer every sequence still waiting for a slot with ``error``; returns how many.
        A paused one (preemption) has started: it stays, and resumes when a slot frees,
        unless ``keep_paused`` is off (the engine is gone)."""
        now = self.clock.now()
        waiting = self.queue.pop(len(self.queue), now) if len(self.queue) else ()
        answered = 0
        for request in waiting:
            if keep_paused and request.id in self._paused:
                self.queue.requeue(request, now)  # (refunds the pop's charge and slot)
                continue
            answered += 1
            # A fair queue's pick gave its tenant a slot and charged it: it was served none.
            self.queue.vacate(request)
            self.queue.settle(request, 0, 0)
            granted = self._granted.pop(request.id, None)
            if granted is not None and not granted.done():
                granted.set_exception(error)
        return answered

    def fail(self, error: BaseException) -> None:
        """Answer every waiting sequence with ``error`` and refuse new ones.

        Running sequences are the engine's to fail: it fails them when it dies.
        """
        self.failure = error
        self.drain(error, keep_paused=False)

    def _cache_cost(self, request: Request) -> int:
        """KV cache tokens a sequence may hold: its prompt + max_tokens, in whole pages."""
        page = max(1, self.engine.card.cache_page_tokens)
        return -(-request.cost_tokens // page) * page

    def _fits(self, request: Request) -> bool:
        capacity = self.engine.card.max_cached_tokens
        if capacity <= 0 or self.num_running == 0:
            return True  # an unbounded cache; or an empty one, which any sequence fits
        return self.cached_tokens + self._cache_cost(request) <= capacity

    def _prefill_fits(self, request: Request) -> bool:
        """Within the prefill budget with ``request``'s prompt; one always fits when no
        prefill is pending, or a prompt over the budget could never start."""
        budget = self.max_prefill_tokens
        if budget <= 0 or not self._prefilling:
            return True
        return self.prefilling_tokens + self._prompt_tokens[request.id] <= budget

    def _prefilled(self, seq_id: str) -> None:
        """``seq_id``'s prompt leaves the prefill budget: its first token came, or it ended
        before one. Exactly once: a no-op after the first call."""
        self.prefilling_tokens -= self._prefilling.pop(seq_id, 0)

    def _release_slot(self, request: Request, prompt_tokens: int, made: int) -> None:
        """A running sequence ended (finished, cancelled or failed) having made ``made``
        tokens: its slot, pages and any pending prefill are free; with fair sharing its
        tenant gives the slot back and is settled with what it was served, its prompt in
        and ``made`` out (the worker knows them exactly, whatever the ending). A sequence
        that was to pause for a preempting one hands it the slot."""
        self.num_running -= 1
        self.cached_tokens -= self._cache_cost(request)
        self._prefilled(request.id)
        self.queue.vacate(request)
        self.queue.settle(request, prompt_tokens, made)
        running = self._running.pop(request.id, None)
        if running is not None:
            self._hand_over(running.handover)
        self._fill_slots()

    def _fill_slots(self) -> None:
        """Start the most urgent waiting sequences while slots, cache room and the prefill
        budget allow."""
        now = self.clock.now()
        while self.num_running < self.max_num_seqs and len(self.queue):
            heads = self.queue.peek(1, now)  # none: a fair queue's slot reserve holds
            if heads and self._granted[heads[0].id].done():
                # Its waiter was cancelled and has not run yet to leave the queue: it goes
                # now (a pick would charge its tenant), and its waiter finds it gone.
                self.queue.cancel(heads[0].id)
                continue
            if not heads:
                self._hold("", "slot_reserve")
                break
            if not self._fits(heads[0]):
                self._hold(heads[0].id, "cache_room")
                break  # it waits for room: a smaller, less urgent one must not overtake it
            if not self._prefill_fits(heads[0]):
                self._hold(heads[0].id, "prefill_budget")
                break  # likewise
            (request,) = self.queue.pop(1, now)
            self._grant(request)

    def _grant(self, request: Request) -> None:
        """``request``, out of the queue, takes a free slot: its waiter goes on."""
        granted = self._granted.pop(request.id)
        prompt_tokens = self._prompt_tokens.pop(request.id)
        self._paused.discard(request.id)
        self.num_running += 1
        self.cached_tokens += self._cache_cost(request)
        self._prefilling[request.id] = prompt_tokens
        self.prefilling_tokens += prompt_tokens
        self.metrics.batch_size.labels(self.engine.card.name).observe(self.num_running)
        granted.set_result(None)

    def _hold(self, seq_id: str, reason: str) -> None:
        """The head ``seq_id`` waits, for ``reason``: counted once per sequence and reason."""
        if self._last_hold != (seq_id, reason):
            self._last_hold = (seq_id, reason)
            self.holds[reason] = self.holds.get(reason, 0) + 1

    def describe(self) -> dict[str, Any]:
        """What the scheduler bounds now and why sequences waited (``/stats``' batching)."""
        return {
            "kind": "sequences",
            "max_num_seqs": self.max_num_seqs,
            "running": self.num_running,
            "max_prefill_tokens": self.max_prefill_tokens,  # 0: no bound
            "prefilling_tokens": self.prefilling_tokens,
            "cached_tokens": self.cached_tokens,
            "fair_sharing": self.queue.fair is not None,
            # sequences that waited, by what held them: every slot taken when they came,
            # or, at the head, the KV cache's room, the prefill budget, a fair queue's reserve
            "held_by": dict(self.holds),
            "last_held_by": self._last_hold[1] if self._last_hold else None,
            # fair sharing's preemption: sequences paused for another tenant's, and the
            # tokens they had made, prefilled again when they resumed
            "preempted": self.num_preempted,
            "recomputed_tokens": self.recomputed_tokens,
        }


@dataclass(slots=True)
class _Running:
    """A sequence in the engine: whose, when granted, how far, and whom it pauses for."""

    tenant: str
    order: int
    made: int = 0
    handover: str | None = None  # a preempting sequence's id: pause at the next token
