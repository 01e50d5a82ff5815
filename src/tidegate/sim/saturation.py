"""Open-loop capacity: what one replica answers per second when arrivals never wait for it.

Design note. A closed loop (the profiler's clients, each sending its next request when its
last is answered) measures a stack that is never offered more than it finishes, and its
best rate is not what the stack answers when arrivals keep coming. For generation the gap is
wide. The closed loop's clients join an idle engine together and their equal answers end
together, so their prompts share one prefill; arrivals that do not wait for each other join
a batch that is decoding, a few at a time, and each pays its prefill alone (sim/service.py,
``ConcurrencySteps``). A full engine then refills slower than the lockstep: on 2026-12-03
the closed loop's best rate, ``c / (ttft(c) + (out - 1) * itl(c))``, overstated what the
real smollm2 stack answered under Poisson arrivals by about 40% (1.84 against 1.26-1.31
requests/s).

Embeddings have a milder form of the same gap. The best rate of a batch curve is at the
size where a batch costs least per input, but a replica past capacity takes whatever is
queued, up to ``max_batch_size``: on the 2-CPU machine a batch of 32 cost 2.1-2.5x a batch
of 16, so an overloaded minilm replica answered 78-95% of the curve's best rate.

So the capacity of a replica is measured the way the stack is run: the simulator
(the gateway's and the worker's own policy code) is offered Poisson arrivals well past what
the replica can serve, and the completions per second are counted over the middle of the
run (the first fifth fills the engine, the last fifth is the queue running dry). The
profiler aims its open-loop point at a fraction of this figure; ``bench_sim_fidelity`` sets
its loads by it.
"""

from __future__ import annotations

import random

from tidegate.config.loading import parse_config
from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.service import ServiceModel
from tidegate.sim.workload import Arrival, Listed

DURATION_S = 200.0  # simulated seconds of arrivals, at most ...
MAX_ARRIVALS = 20_000  # ... and this many (embeddings take hundreds a second)
SEED = "saturation"
_MODEL = "replica"


def saturated_per_s(
    service: ServiceModel,
    max_batch: int,
    offered_per_s: float,
    output_tokens: int = 1,
    prompt_tokens: int = 1,
    duration_s: float = DURATION_S,
    batch_window_ms: float | None = None,
) -> float:
    """Completions per second of one replica of ``service`` (batches of at most
    ``max_batch`` requests formed within ``batch_window_ms``, or ``max_batch`` sequences
    running) offered Poisson arrivals at ``offered_per_s`` for ``duration_s`` (or
    MAX_ARRIVALS of them, if fewer), counted between the first and the last fifth of the
    completions; 0.0 when too few completed to tell (module docstring).

    ``offered_per_s`` should be past the replica's capacity (twice the closed loop's best
    rate is): below it, the figure is the offered rate."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if not offered_per_s > 0 or not duration_s > 0:
        raise ValueError(f"need a rate and a duration > 0, got {offered_per_s}, {duration_s}")
    duration_s = min(duration_s, MAX_ARRIVALS / offered_per_s)
    generate = service.task == "generate"
    draw = random.Random(SEED)
    arrivals: list[Arrival] = []
    at = draw.expovariate(offered_per_s)
    while at < duration_s:
        arrivals.append(Arrival(at, prompt_tokens, output_tokens if generate else 0, "low"))
        at += draw.expovariate(offered_per_s)
    batching: dict[str, float] = (
        {"max_num_seqs": max_batch} if generate else {"max_batch_size": max_batch}
    )
    if batch_window_ms is not None and not generate:
        batching["batch_window_ms"] = batch_window_ms
    model = {"name": _MODEL, "task": service.task, "engine": "simulated", "batching": batching}
    config = parse_config(
        {"gateway": {"policy": "fifo"}, "models": [model]}, "<open-loop capacity>"
    )
    scenario = Scenario(
        config,
        _MODEL,
        service,
        Listed("saturation", arrivals),
        {pool: 1 for pool in config.model(_MODEL).replicas},
        keep_requests=True,
    )
    records = Simulation(scenario).run().recorder.requests
    assert records is not None  # keep_requests
    ends = sorted(
        arrivals[int(r.id)].arrival_s + r.e2e_s
        for r in records
        if r.outcome == "completed" and r.e2e_s is not None
    )
    first, last = len(ends) // 5, 4 * len(ends) // 5
    if last <= first or ends[last] <= ends[first]:
        return 0.0
    return (last - first) / (ends[last] - ends[first])
