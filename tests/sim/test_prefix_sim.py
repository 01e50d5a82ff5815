"""Prefix caching in the simulator: the per-replica block LRU, the Mooncake blocks, and
prefix-affinity routing against least loaded on a hand-made conversation workload."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from tests.sim.conftest import FIXTURES, config_of, flat_step_service
from tidegate.core.prefix import PrefixAffinity
from tidegate.sim.prefix_cache import BlockLRU, PrefixCache
from tidegate.sim.report import run_summary
from tidegate.sim.run import Scenario, Simulation
from tidegate.sim.traces import read_mooncake
from tidegate.sim.workload import Arrival, Listed

GENERATE = {
    "models": [
        {
            "name": "llm",
            "task": "generate",
            "engine": "simulated",
            "replicas": 4,
            "batching": {"max_num_seqs": 8},
        }
    ]
}


def test_lru_counts_only_the_leading_cached_run() -> None:
    cache = BlockLRU(10)
    assert cache.fill([0, 1, 2]) == 0
    assert cache.fill([0, 1, 9]) == 2
    assert cache.fill([5, 1, 2]) == 0  # 1 and 2 are cached, but after a miss


def test_lru_evicts_the_least_recently_used() -> None:
    cache = BlockLRU(3)
    cache.fill([1, 2, 3])
    cache.fill([1])  # 1 is the most recent now
    cache.fill([4])
    assert 2 not in cache
    assert 1 in cache
    assert len(cache) == 3


def test_prefix_cache_knobs_are_checked() -> None:
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixCache(capacity_blocks=0)


def test_mooncake_arrivals_carry_their_hash_ids() -> None:
    path = FIXTURES / "mooncake_conv_head.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    arrivals = list(read_mooncake(path, seed=1))
    by_length = {(a.prompt_tokens, a.output_tokens): a.blocks for a in arrivals}
    for row in rows:
        assert by_length[(row["input_length"], row["output_length"])] == tuple(row["hash_ids"])


def conversations(num: int, turns: int, gap_s: float) -> list[Arrival]:
    """``num`` conversations, one turn each ``gap_s``; each turn extends the last by a block."""
    arrivals = []
    order = list(range(num))
    for turn in range(turns):
        random.Random(turn).shuffle(order)  # no fixed phase that least loaded could follow
        for slot, conv in enumerate(order):
            base = 1000 * (conv + 1)
            blocks = (0, base, *range(base + 1, base + turn))
            at = turn * gap_s + slot * gap_s / num
            arrivals.append(Arrival(at, 512 * len(blocks), 50, blocks=blocks))
    return arrivals


def scenario_of(affinity: PrefixAffinity | None, num_conversations: int = 12) -> Scenario:
    gap_s = 2.0 if num_conversations <= 12 else 1.0
    return Scenario(
        config_of(GENERATE),
        "llm",
        flat_step_service(10.0),
        Listed("conversations", conversations(num=num_conversations, turns=6, gap_s=gap_s)),
        {"shared": 4},
        label="prefix" if affinity else "least_loaded",
        affinity=affinity,
        prefix_cache=PrefixCache(capacity_blocks=40, prefill_s_per_block=0.05),
    )


def run(affinity: PrefixAffinity | None) -> dict[str, Any]:
    return run_summary(Simulation(scenario_of(affinity)).run())


def ttft_p50(summary: dict[str, Any]) -> float:
    (used,) = [c for c in summary["classes"].values() if c["requests"]]
    return float(used["ttft_s"]["p50"])


def test_prefix_affinity_hits_more_and_prefills_less_than_least_loaded() -> None:
    least = run(None)
    prefix = run(PrefixAffinity())
    least_cache = least["overall"]["prefix_cache"]
    prefix_cache = prefix["overall"]["prefix_cache"]
    assert least_cache["blocks"] == prefix_cache["blocks"]
    # A replica holds 40 of the 85 blocks: enough for the conversations the ring gives it,
    # not for all of them, which is what least loaded, spreading the turns, asks of it.
    assert prefix_cache["hit_rate"] > least_cache["hit_rate"] + 0.2
    assert ttft_p50(prefix) < ttft_p50(least)


def test_same_scenario_same_report() -> None:
    assert run(PrefixAffinity()) == run(PrefixAffinity())


def test_the_fleet_counts_tokens_in_flight_only_for_prefix_affinity() -> None:
    """With affinity each replica's view carries the cost_tokens of its requests in flight
    (the bound in tokens reads them), all given back by the end; without, nothing is
    counted. On 24 conversations the bound changes the routing: were the tokens not counted,
    the two affinity runs would be the same."""
    caches = []
    for affinity in (None, PrefixAffinity(), PrefixAffinity(token_bound=False)):
        simulation = Simulation(scenario_of(affinity, num_conversations=24))
        caches.append(run_summary(simulation.run())["overall"]["prefix_cache"])
        assert simulation.fleet.count_tokens is (affinity is not None)
        for replica in simulation.fleet.live.values():
            assert replica.in_flight == 0
            assert replica.tokens == 0
    _, by_tokens, by_requests = caches
    assert by_tokens != by_requests
