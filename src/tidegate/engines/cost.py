"""What a profile says one batch or one step of an engine costs.

Two prices from a ``tidegate profile`` (``tidegate.engines.profile``), shared by the two
sides that charge them: the simulated engine sleeps them in wall time and the simulator
(``tidegate.sim.service``) charges them in virtual time, so a stack on the simulated engine
is the simulator's model of its engine, run for real.

- ``CurveBatch``: one batch of embeddings, from the ``batch_latency_ms`` curve (batch size
  -> latency, linear between measured points);
- ``ConcurrencySteps``: one step of continuous batching, ``step_s(num_decode, num_prefill,
  prefill_tokens)``, from ``ttft_ms`` / ``itl_ms`` by running sequences.

A profile measured by concurrency (``ttft_ms`` and ``itl_ms`` of ``n`` running sequences)
becomes a step model this way, for a step of ``n`` running sequences of which ``p`` join:

- nobody joins: ``itl(n)``;
- all ``n`` join an idle engine at once: ``ttft(n)`` (``itl(n) + ttft(p) - itl(p)`` with
  ``p = n``), which is how the profile's closed loop measured them (its clients' equal
  answers keep them in step);
- ``p`` join a batch that is decoding: ``itl(n) + p * join``: each joiner pays ``join``, the
  profile's ``generate.join_ms`` where ``tidegate profile --through-gateway`` measured it (the
  engine's own steps in the serving stack, ``tidegate.engines.steps``), else what its
  prompt's prefill costs alone over a decode step, ``ttft(1) - itl(1)``.

The last is measured, not assumed (2026-12-03, smollm2 on the 2-CPU machine, every engine
step of a real run at 120% timed inside transformers' manager): a decoding step of 8 took
229 ms; with 1 joiner 431, with 3 832; 7 running of which 5 joined, 1,066 ms: 160-215 ms
per joiner whatever their number, against 138 ms for a prompt alone. In that run a prefill
mixed into steps that also decoded gained nothing from its company, while prompts that joined
an idle engine together did (4 at once: 315 ms in all, one sample); ``bench_join_steps`` times
the same steps on the engine alone. The models of before shared the prefill out:
``itl(n) + (ttft(n) - itl(n)) * p / n`` made a lone joiner among ``n`` cost a ``1/n``
share of ``n`` prompts, and ``itl(n) + ttft(p) - itl(p)`` made 3 joiners cost half of what
they did. Both gave first tokens too early and, past capacity, a stack that served more
than the real one (docs/benchmarks.md, "Fidelity").
"""

from __future__ import annotations

from tidegate.engines.profile import Curve


class CurveBatch:
    """``batch_s`` from a batch-size -> milliseconds curve; tokens do not change it."""

    __slots__ = ("_cache", "_curve")

    def __init__(self, curve: Curve) -> None:
        self._curve = curve
        self._cache: dict[int, float] = {}

    def batch_s(self, num_requests: int, num_tokens: int) -> float:
        seconds = self._cache.get(num_requests)
        if seconds is None:
            seconds = self._cache[num_requests] = self._curve(num_requests) / 1e3
        return seconds


class ConcurrencySteps:
    """``step_s`` from ``ttft_ms`` / ``itl_ms`` by running sequences (see the module note)."""

    __slots__ = ("_decode", "_itl", "_join_s", "_prefill", "_ttft")

    def __init__(self, ttft_ms: Curve, itl_ms: Curve, join_ms: float | None = None) -> None:
        self._ttft = ttft_ms
        self._itl = itl_ms
        self._decode: dict[int, float] = {}  # n running -> itl(n), seconds
        self._prefill: dict[int, float] = {}  # p joining an idle engine -> ttft(p) - itl(p)
        # one joiner into a decoding batch: as measured in the serving stack (the profile's
        # join_ms), else its prompt's prefill alone over a decode step
        if join_ms is None:
            join_ms = ttft_ms(1) - itl_ms(1)
        self._join_s = max(0.0, join_ms) / 1e3

    def step_s(self, num_decode: int, num_prefill: int, prefill_tokens: int) -> float:
        running = num_decode + num_prefill
        if running == 0:
            return 0.0
        decode_s = self._decode.get(running)
        if decode_s is None:
            decode_s = self._decode[running] = self._itl(running) / 1e3
        if not num_prefill:
            return decode_s
        if num_decode:
            return decode_s + num_prefill * self._join_s
        prefill_s = self._prefill.get(num_prefill)
        if prefill_s is None:
            extra_ms = self._ttft(num_prefill) - self._itl(num_prefill)
            prefill_s = self._prefill[num_prefill] = max(0.0, extra_ms / 1e3)
        return decode_s + prefill_s
