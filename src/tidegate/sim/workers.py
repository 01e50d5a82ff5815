"""A replica's worker in virtual time: ``tidegate.worker.scheduling``'s loops, by the core.

- ``BatchWorker`` mirrors ``EmbeddingBatcher`` (dynamic batching): requests wait in the
  worker's own ``WaitQueue`` (levels high/medium/low, as the worker's); each arrival is
  told to its core ``BatchPlanner``; when the engine is idle it asks the planner over
  ``peek(planner.peek_size)``, takes the released batch (``planner.take``) and runs it for
  ``batch_s(n, tokens)``, then tells the planner the batch finished (the AIMD cap); a
  ``WaitUntil`` becomes a timer. After a batch the loop plans again at once, before the
  gateway hears of the completions (they travel back over HTTP in the real stack).
- ``SequenceWorker`` mirrors ``SequenceScheduler`` (continuous batching): a sequence waits
  in the queue until one of ``max_num_seqs`` slots is free, most urgent first; the engine
  runs iterations: each step every running sequence makes one token and the sequences that
  joined since the last step are prefilled; a finished sequence leaves at the end of its
  step and frees its slot at once. With a ``PrefixCache`` (``sim.prefix_cache``) each
  replica keeps an LRU of prompt blocks: a joining sequence's cached leading blocks are not
  prefilled again (fewer prefill tokens for the step, and no ``prefill_s_per_block``).
  With ``max_prefill_tokens`` (the worker's prefill budget) a sequence takes a free slot only
  while the prompts granted and not yet prefilled stay within it, so the rest wait in the
  queue, where fair sharing (the tenant's counters, when the worker's queue has them) and
  priority still order them, instead of in the engine's next prefill.
- Preemption (fair sharing's, core.fairness): a ticket that comes with ``preempt`` = a
  tenant V is queued as any; if V has a running sequence here (joining, prefilling or
  decoding, not already being paused), the one of V's that has made the fewest tokens (ties:
  the latest granted) gives its slot to the ticket at once (``WaitQueue.take``: it joins at
  the next step) and goes back to the queue (``WaitQueue.requeue``: refunded and vacated in
  a fair queue, its arrival kept): one still joining leaves at once, having made nothing; one
  in the engine leaves at the end of the step in progress (it makes that step's token, or
  ends with it). It keeps the tokens it made: given a slot again it prefills its prompt and
  them (recompute, ``recomputed_tokens``), then decodes only the rest, and its first token
  is not sent again. Until then the replica runs one sequence over ``max_num_seqs``. With no
  running sequence of V's here the ticket waits in the queue like any. ``BatchWorker``s
  never preempt: a ticket sent to preempt there is just queued.

The engine is not stepped token by token: between two changes of its running set every
step lasts the same, so one event covers a whole run of steps, up to the first sequence to
finish; a sequence that joins meanwhile cuts that run at the next step boundary.
"""

from __future__ import annotations

import heapq
from typing import Protocol

from tidegate.core.batch_adapt import BatchPlanner, CapConfig
from tidegate.core.batching import BatchConfig, Release, plan_batch
from tidegate.core.fairness import sequence_to_pause
from tidegate.core.queue import QueueConfig, Rejected, WaitQueue
from tidegate.core.request import Request
from tidegate.sim.gateway import Ticket
from tidegate.sim.kernel import Kernel
from tidegate.sim.prefix_cache import BlockLRU, PrefixCache
from tidegate.sim.recorder import Recorder
from tidegate.sim.service import BatchService, StepService


class Sink(Protocol):
    """Where a worker reports: first tokens and finished requests."""

    def first_token(self, ticket: Ticket) -> None: ...

    def done(self, replica_id: str, tickets: list[Ticket]) -> None: ...

    def refused(self, replica_id: str, ticket: Ticket) -> None: ...


def worker_level(level: int, num_worker_levels: int) -> int:
    """The gateway forwards ``X-Tidegate-Priority`` = its level, capped to the worker's."""
    return min(level, num_worker_levels - 1)


class Worker:
    """The worker's own WaitQueue: what both workers share, and what the fleet calls.

    A base class rather than a Protocol: compiled, the fleet's ``submit`` per request is then
    a direct call instead of a method looked up by name.
    """

    def __init__(
        self,
        kernel: Kernel,
        replica_id: str,
        model: str,
        queue: QueueConfig,
        sink: Sink,
        recorder: Recorder,
    ) -> None:
        self.kernel = kernel
        self.replica_id = replica_id
        self.model = model
        self.queue = WaitQueue(queue)
        self.sink = sink
        self.recorder = recorder
        self.tickets: dict[str, Ticket] = {}  # waiting in the queue
        self._levels = len(queue.levels)
        self._version = 0  # bumped when the engine's work is abandoned (drain timeout)

    def _admit(self, ticket: Ticket, cost_tokens: int, now: float) -> bool:
        """Queue ``ticket`` here as the worker does on receipt; False if refused."""
        request = ticket.request
        level = worker_level(request.priority, self._levels)
        local = Request(
            request.id, self.model, level, now, None, cost_tokens, tenant=request.tenant
        )
        if isinstance(self.queue.admit(local, now), Rejected):
            self.sink.refused(self.replica_id, ticket)
            return False
        ticket.local = local
        self.tickets[request.id] = ticket
        return True

    def submit(self, ticket: Ticket) -> None:
        raise NotImplementedError  # each worker's own

    def take_waiting(self) -> list[Ticket]:
        """Remove and return what has not started (a drain hands it back)."""
        now = self.kernel.time
        return [self.tickets.pop(r.id) for r in self.queue.pop(len(self.queue) or 1, now)]

    def take_running(self) -> list[Ticket]:
        """Stop the engine and return what it was running (a drain that timed out)."""
        raise NotImplementedError  # each worker's own


class BatchWorker(Worker):
    def __init__(
        self,
        kernel: Kernel,
        replica_id: str,
        model: str,
        service: BatchService,
        batch: BatchConfig,
        queue: QueueConfig,
        sink: Sink,
        recorder: Recorder,
        cap: CapConfig | None = None,
    ) -> None:
        super().__init__(kernel, replica_id, model, queue, sink, recorder)
        self.service = service
        self.batch = batch
        self.planner = BatchPlanner(batch, cap)
        self.running: tuple[Request, ...] = ()
        self._peek = self.planner.peek_size
        self._timer_at: float | None = None
        self._started_at = 0.0  # when the running batch went to the engine

    def submit(self, ticket: Ticket) -> None:
        now = self.kernel.time
        if self._admit(ticket, ticket.prompt_tokens, now):
            self.planner.arrived(now)
            if not self.running:
                self._plan(now)

    def _plan(self, now: float) -> None:
        queue = self.queue
        planner = self.planner
        plan = plan_batch(
            planner.view(queue.peek(self._peek, now), len(queue), now), self.batch, now
        )
        if isinstance(plan, Release):
            planner.released(plan)
            batch = planner.take(queue, plan, now)
            self.running = batch
            self._started_at = now
            self.recorder.batch_sizes[len(batch)] += 1
            tokens = 0
            for request in batch:
                tokens += request.cost_tokens
            self.kernel.at(
                now + self.service.batch_s(len(batch), tokens), self._done, self._version
            )
        elif plan.at is not None and plan.at != self._timer_at:
            self._timer_at = plan.at
            self.kernel.at(plan.at, self._on_timer, plan.at)

    def _on_timer(self, at: float) -> None:
        if at != self._timer_at:
            return  # a later plan replaced this window
        self._timer_at = None
        if not self.running:
            self._plan(self.kernel.time)

    def _done(self, version: int) -> None:
        if version != self._version:
            return
        waiting = self.tickets
        tickets = []
        for request in self.running:  # (dict.pop is a method looked up by name, compiled)
            tickets.append(waiting[request.id])
            del waiting[request.id]
        self.planner.finished(self.running, self.kernel.time, self._started_at)
        self.running = ()
        self._plan(self.kernel.time)
        self.sink.done(self.replica_id, tickets)

    def take_running(self) -> list[Ticket]:
        self._version += 1
        tickets = [self.tickets.pop(request.id) for request in self.running]
        self.running = ()
        return tickets


class SequenceWorker(Worker):
    def __init__(
        self,
        kernel: Kernel,
        replica_id: str,
        model: str,
        service: StepService,
        max_num_seqs: int,
        queue: QueueConfig,
        sink: Sink,
        recorder: Recorder,
        prefix_cache: PrefixCache | None = None,
        max_prefill_tokens: int = 0,
    ) -> None:
        super().__init__(kernel, replica_id, model, queue, sink, recorder)
        self.service = service
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens  # 0: no bound
        self.pending_prefill = 0  # prompt tokens granted a slot, not yet at a first token
        self.prefix_cache = prefix_cache
        self.cached = BlockLRU(prefix_cache.capacity_blocks) if prefix_cache else None
        self.num_running = 0  # slots granted: joining + prefilling + decoding
        self.joining: list[Ticket] = []  # granted; enter the engine at the next step
        self.prefilling: list[Ticket] = []  # prefilled by the current step
        self.decoding: list[tuple[int, int, Ticket]] = []  # heap of (last step, order, ticket)
        self._order = 0
        self.step_index = 0  # steps completed when the current run of steps began
        self.run_at = 0.0  # when the current run of steps began
        self.step_s = 0.0  # how long each of its steps lasts
        self.boundary_at: float | None = None  # end of the run (None: the engine is idle)
        self.boundary_step = 0
        self.pausing: list[Ticket] = []  # preempted: leave the engine at the step's end
        self.num_preempted = 0  # sequences paused for another tenant's (the /stats count)
        self.recomputed_tokens = 0  # prefilled again by resumed sequences: prompt + made

    def submit(self, ticket: Ticket) -> None:
        now = self.kernel.time
        cost = ticket.prompt_tokens + ticket.output_tokens
        victim = ticket.preempt
        ticket.preempt = ""
        if not self._admit(ticket, cost, now):
            return
        preempted = bool(victim) and self._preempt(ticket, victim, now)
        if self._fill_slots(now) or preempted:
            self._wake_engine(now)

    # ------------------------------------------------------------------ preemption
    def _preempt(self, ticket: Ticket, victim: str, now: float) -> bool:
        """Pause a running sequence of ``victim``'s for ``ticket`` (module docstring); True
        if one was, and ``ticket`` took its slot."""
        paused = self._pick_paused(victim, now)
        if paused is None:
            return False
        taken = self.queue.take(ticket.request.id)
        assert taken is not None
        self.joining.append(self.tickets.pop(taken.id))
        self.pending_prefill += ticket.prefill_tokens
        self.num_running += 1
        self.pausing.append(paused)
        return True

    def _pick_paused(self, tenant: str, now: float) -> Ticket | None:
        """``tenant``'s decoding sequence that has made the fewest tokens; ties: the latest
        granted; None when it has none decoding (or all are being paused already). As the
        real worker (``SequenceScheduler``): a sequence not yet at its first token is not
        paused (the real one could only stop it at that token)."""
        pausing = self.pausing
        steps = self._steps_done(now)
        return sequence_to_pause(
            (ticket, ticket.output_tokens - (last - steps), order)
            for last, order, ticket in self.decoding
            if ticket.request.tenant == tenant and ticket not in pausing
        )

    def _steps_done(self, now: float) -> int:
        """Engine steps completed by ``now`` (a step in progress does not count)."""
        if self.boundary_at is None or self.prefilling or self.step_s <= 0:
            return self.step_index
        elapsed = int((now - self.run_at) / self.step_s)
        return min(self.boundary_step, self.step_index + elapsed)

    def _pause(self, step: int, done: list[Ticket], now: float) -> bool:
        """At a step's end: the sequences being paused leave the engine with the tokens made
        (those that ended with this step just end); True if any left."""
        pausing = [ticket for ticket in self.pausing if ticket not in done]
        self.pausing = []
        if not pausing:
            return False
        kept = []
        for entry in self.decoding:
            last, _, ticket = entry
            if ticket in pausing:
                ticket.made_tokens = ticket.output_tokens - (last - step)
            else:
                kept.append(entry)
        heapq.heapify(kept)
        self.decoding = kept
        self._requeue_paused(pausing, now)
        return True

    def _requeue_paused(self, paused: list[Ticket], now: float) -> None:
        """Paused sequences back in the queue, ahead of later arrivals in their levels."""
        self.num_running -= len(paused)
        self.num_preempted += len(paused)
        self.recorder.preempted[self.replica_id] += len(paused)
        for ticket in paused:
            self.queue.requeue(ticket.local, now)
            self.tickets[ticket.request.id] = ticket

    def _fill_slots(self, now: float) -> bool:
        """Grant free slots to the most urgent waiting sequences; True if any joined."""
        free = self.max_num_seqs - self.num_running
        if free <= 0 or not len(self.queue):
            return False
        budget = self.max_prefill_tokens
        if not budget:
            granted = self.queue.pop(free, now)
            tokens = 0
            for request in granted:
                ticket = self.tickets.pop(request.id)
                self.joining.append(ticket)
                tokens += ticket.prefill_tokens
            self.pending_prefill += tokens
            self.num_running += len(granted)
            return True
        # The prefill budget: the head joins while the prompts not yet prefilled stay within
        # it (one always may, alone); it is never overtaken by a shorter one behind it.
        queue = self.queue
        tickets = self.tickets
        joined = 0
        while joined < free and len(queue):
            (head,) = queue.peek(1, now)
            tokens = tickets[head.id].prefill_tokens
            if self.pending_prefill and self.pending_prefill + tokens > budget:
                break
            queue.pop(1, now)
            self.joining.append(tickets.pop(head.id))
            self.pending_prefill += tokens
            joined += 1
        self.num_running += joined
        return joined > 0

    def _wake_engine(self, now: float) -> None:
        if self.boundary_at is None:
            self._start_run(now)
            return
        if self.prefilling or self.step_s <= 0:
            return  # a one-step run: the joiners enter when it ends
        elapsed = int((now - self.run_at) / self.step_s)
        step = self.step_index + elapsed + 1
        if step < self.boundary_step:
            self._schedule(max(now, self.run_at + (elapsed + 1) * self.step_s), step)

    def _start_run(self, now: float) -> None:
        joiners = self.joining
        self.joining = []
        self.prefilling = joiners
        num_decode = len(self.decoding)
        if not joiners and not num_decode:
            self.boundary_at = None
            return
        extra_s = 0.0
        if self.prefix_cache is None:
            tokens = 0
            for ticket in joiners:
                tokens += ticket.prompt_tokens
        else:
            tokens, extra_s = self._prefill_cost(joiners)
        for ticket in joiners:
            if ticket.made_tokens:  # resumed after a pause: its tokens made are prefilled too
                tokens += ticket.made_tokens
                self.recomputed_tokens += ticket.prefill_tokens
                self.recorder.recomputed_tokens[self.replica_id] += ticket.prefill_tokens
        self.run_at = now
        self.step_s = self.service.step_s(num_decode, len(joiners), tokens) + extra_s
        if joiners:
            self.recorder.prefill_s[self.replica_id] += self.step_s
        steps = 1 if joiners else self.decoding[0][0] - self.step_index
        self._schedule(now + steps * self.step_s, self.step_index + steps)

    def _prefill_cost(self, joiners: list[Ticket]) -> tuple[int, float]:
        """Prompt tokens to compute and the extra seconds, after this replica's cache."""
        spec = self.prefix_cache
        cached = self.cached
        assert spec is not None
        assert cached is not None
        recorder = self.recorder
        tokens = 0
        uncached = 0
        for ticket in joiners:
            blocks = ticket.blocks
            hits = cached.fill(blocks) if blocks else 0
            recorder.cache_blocks += len(blocks)
            recorder.cache_hit_blocks += hits
            uncached += len(blocks) - hits
            tokens += max(1, ticket.prompt_tokens - hits * spec.block_tokens)
        return tokens, uncached * spec.prefill_s_per_block

    def _schedule(self, at: float, step: int) -> None:
        self._version += 1
        self.boundary_at = at
        self.boundary_step = step
        self.kernel.at(at, self._on_boundary, self._version)

    def _on_boundary(self, version: int) -> None:
        if version != self._version:
            return
        now = self.kernel.time
        step = self.boundary_step
        recorder = self.recorder
        recorder.batch_sizes[len(self.decoding) + len(self.prefilling)] += step - self.step_index
        recorder.busy_s[self.replica_id] += now - self.run_at
        self.step_index = step
        done: list[Ticket] = []
        for ticket in self.prefilling:
            made = ticket.made_tokens
            self.pending_prefill -= ticket.prompt_tokens + made
            if not made:  # else a resumed one: its first token went out before its pause
                self.sink.first_token(ticket)
            left = ticket.output_tokens - made
            if left <= 1:
                ticket.made_tokens = ticket.output_tokens
                done.append(ticket)
            else:
                self._order += 1
                heapq.heappush(self.decoding, (step - 1 + left, self._order, ticket))
        self.prefilling = []
        decoding = self.decoding
        while decoding and decoding[0][0] <= step:
            last, _, ticket = heapq.heappop(decoding)
            ticket.made_tokens = ticket.output_tokens - (last - step)
            done.append(ticket)
        paused = bool(self.pausing) and self._pause(step, done, now)
        if done:
            self.num_running -= len(done)
            if self.queue.fair is not None:
                self._settle(done)
        if done or paused or self.max_prefill_tokens:
            self._fill_slots(now)  # a slot freed, or the budget: the prefilled left it
        self._start_run(now)
        if done:
            self.sink.done(self.replica_id, done)

    def _settle(self, done: list[Ticket]) -> None:
        """Fair sharing in the worker's queue: each ended sequence's tenant gives its slot
        back and is settled with the tokens served, as the worker does."""
        queue = self.queue
        for ticket in done:
            request = ticket.request
            tokens = ticket.prompt_tokens + ticket.output_tokens
            local = Request(request.id, self.model, 0, 0.0, None, tokens, tenant=request.tenant)
            queue.vacate(local)
            queue.settle(local, ticket.prompt_tokens, ticket.output_tokens)

    def take_waiting(self) -> list[Ticket]:
        """What has not started; a paused sequence stays (it has: it resumes here when a
        slot frees, as the real worker's drain keeps it)."""
        now = self.kernel.time
        waiting = []
        for request in self.queue.pop(len(self.queue) or 1, now):
            ticket = self.tickets[request.id]
            if ticket.made_tokens:
                self.queue.requeue(ticket.local, now)  # (refunds the pop's charge and slot)
            else:
                waiting.append(self.tickets.pop(request.id))
        return waiting

    def take_running(self) -> list[Ticket]:
        """Stop the engine: what it was running, and the paused sequences waiting to resume."""
        self._version += 1
        running = self.joining + self.prefilling + [entry[2] for entry in self.decoding]
        paused = self.queue.pop(len(self.queue), self.kernel.time) if len(self.queue) else ()
        running += [self.tickets.pop(request.id) for request in paused]
        self.joining, self.prefilling, self.decoding = [], [], []
        self.pausing = []
        self.num_running = 0
        self.pending_prefill = 0
        self.boundary_at = None
        return running
