"""A replica's prefix cache of KV blocks, as an engine with prefix caching keeps it.

``PrefixCache`` is the knob (``Scenario.prefix_cache``): the capacity in blocks, the block
size in tokens (Mooncake's ``hash_ids`` are 512-token blocks) and an optional prefill cost
per uncached block. ``BlockLRU`` is one replica's cache: a request's leading blocks that are
cached are a hit, counted only as a leading run (a block's KV depends on every token before
it, so a cached block after a miss cannot be reused, as in vLLM's hash-chained blocks);
then all its blocks become the most recently used, and the least recently used ones are
evicted beyond the capacity. Blocks still in use by running sequences are not pinned (an
engine would keep them; at the capacities simulated here the difference is small).

Prefill cost: the uncached prompt tokens (``prompt_tokens - hit blocks x block_tokens``, at
least 1) go to the service model as the step's prefill tokens, so a token-priced service
(``perf_model.csv``) charges only what is computed; ``prefill_s_per_block`` adds a fixed
cost per uncached block on top, for a service model that does not price tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_BLOCK_TOKENS = 512  # Mooncake's hash_ids block size


@dataclass(frozen=True, slots=True)
class PrefixCache:
    capacity_blocks: int  # KV blocks one replica keeps for reuse
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    prefill_s_per_block: float = 0.0  # added per uncached block (0: the service prices tokens)

    def __post_init__(self) -> None:
        if self.capacity_blocks < 1 or self.block_tokens < 1 or self.prefill_s_per_block < 0:
            raise ValueError("need capacity_blocks >= 1, block_tokens >= 1, prefill_s >= 0")


class BlockLRU:
    """One replica's cached blocks, least recently used first."""

    __slots__ = ("_blocks", "capacity")

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def fill(self, blocks: Sequence[int]) -> int:
        """Prefill ``blocks``: how many leading ones were cached; all become most recent."""
        cached = self._blocks
        hits = 0
        for block in blocks:
            if block not in cached:
                break
            hits += 1
        for block in blocks:
            if block in cached:
                cached.move_to_end(block)
            else:
                cached[block] = None
        while len(cached) > self.capacity:
            cached.popitem(last=False)
        return hits
