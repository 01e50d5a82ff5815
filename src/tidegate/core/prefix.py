"""Prefix affinity: requests that share a prompt prefix go to the same replica, load allowing.

Design note. An engine with a prefix cache (vLLM's automatic prefix caching, SGLang's radix
cache) skips the prefill of the leading blocks it still holds, but only on the replica that
computed them. So the router maps a request's *prefix key* (a hash of its leading blocks:
the system prompt and the conversation so far) to a replica with a consistent-hash ring
(``HashRing``: ``num_vnodes`` points per replica), and takes that replica only while its
load allows: consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018,
as llm-d's and SGLang's routers bound their cache-aware choice). The preferred replica takes
the request when, with it, its in-flight requests stay within
``load_factor * (in-flight of all candidates + 1) * its slots / their slots + slack``, and
(``token_bound``, on by default) the tokens it holds in flight (``ReplicaView.tokens``: the
requests' ``cost_tokens``, prompt and output) stay within ``load_factor * (tokens of all
candidates + this request's) * its slots / their slots``; else the next replica clockwise on
the ring that does, and when none does (every candidate is over the bound), the least
loaded. So a hot prefix spills over to the next replicas of the ring instead of queueing
behind one, and the same neighbours take it every time.

Why a bound in tokens as well: counting requests does not see how much work each holds. On
the Mooncake conversation trace (prompts up to 85k tokens) the request bound let affinity
stack short prompts behind a few long prefills on one replica: a higher cache hit rate but
TTFT p99 16-20% worse than least loaded; bounded in tokens too, the hit rate stays higher and
the p99 is no worse (benchmarks/bench_prefix.py, docs/benchmarks.md).

Invariants (tested): the choice is among ``candidates`` only (``pick_replica``'s rules of
pools, readiness and free slots are decided before, see ``core.routing``); with equal loads
the same key always lands on the same replica; a pick exceeds the bound only when every
candidate would; removing a replica from the ring moves only the keys it owned. Keys and
ring points come from ``blake2b``, never ``hash()``, so every gateway copy, process and
simulation run agrees on them.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # routing calls pick_by_prefix: the view type only, no import cycle
    from tidegate.core.routing import ReplicaView

DEFAULT_NUM_BLOCKS = 2  # leading blocks in a key: a system prompt and the conversation's start
DEFAULT_BLOCK_CHARS = 2048  # text block: about 512 tokens at ~4 characters per token
DEFAULT_LOAD_FACTOR = 1.25  # 1 + epsilon of the bounded-load rule
DEFAULT_SLACK = 1.0  # requests over the bound a replica may hold (an idle fleet still groups)
DEFAULT_NUM_VNODES = 64  # ring points per replica: keys spread evenly over few replicas


@dataclass(frozen=True, slots=True)
class PrefixAffinity:
    """How prefix-affinity routing bounds the load of a preferred replica."""

    load_factor: float = DEFAULT_LOAD_FACTOR  # >= 1: allowed multiple of the mean load
    slack: float = DEFAULT_SLACK  # in-flight requests allowed above that multiple
    num_vnodes: int = DEFAULT_NUM_VNODES
    token_bound: bool = True  # bound the tokens in flight as well as the requests

    def __post_init__(self) -> None:
        if self.load_factor < 1 or self.slack < 0 or self.num_vnodes < 1:
            raise ValueError("need load_factor >= 1, slack >= 0, num_vnodes >= 1")


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def block_key(blocks: Sequence[int], num_blocks: int = DEFAULT_NUM_BLOCKS) -> int | None:
    """The key of the leading ``num_blocks`` block ids (a trace's ``hash_ids``); None: none."""
    if not blocks:
        return None
    leading = blocks[:num_blocks]
    return _hash64(",".join(map(str, leading)).encode())


def text_key(
    text: str, num_blocks: int = DEFAULT_NUM_BLOCKS, block_chars: int = DEFAULT_BLOCK_CHARS
) -> int | None:
    """The key of the leading whole ``block_chars`` blocks of ``text`` (at most
    ``num_blocks``); None when not one block is whole (too short for a cache to matter)."""
    whole = min(num_blocks, len(text) // block_chars)
    if whole <= 0:
        return None
    return _hash64(text[: whole * block_chars].encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)
class HashRing:
    """Points on a 64-bit circle, each owned by a replica id; sorted by point."""

    points: tuple[int, ...]
    owners: tuple[str, ...]

    def walk(self, key: int) -> Iterator[str]:
        """Replica ids clockwise from ``key``, each once: the preferred one first."""
        points, owners = self.points, self.owners
        if not points:
            return
        start = bisect.bisect_left(points, key)
        seen: set[str] = set()
        for offset in range(len(points)):
            owner = owners[(start + offset) % len(points)]
            if owner not in seen:
                seen.add(owner)
                yield owner

    def owner(self, key: int) -> str | None:
        return next(self.walk(key), None)


@functools.lru_cache(maxsize=64)
def _ring(ids: tuple[str, ...], num_vnodes: int) -> HashRing:
    placed = sorted(
        (_hash64(f"{rid}#{vnode}".encode()), rid) for rid in ids for vnode in range(num_vnodes)
    )
    return HashRing(tuple(point for point, _ in placed), tuple(rid for _, rid in placed))


def build_ring(ids: Iterable[str], num_vnodes: int = DEFAULT_NUM_VNODES) -> HashRing:
    """The ring of ``ids`` (order does not matter; memoized: fleets change rarely)."""
    return _ring(tuple(sorted(set(ids))), num_vnodes)


def within_bound(
    view: ReplicaView,
    total_in_flight: int,
    total_slots: int,
    affinity: PrefixAffinity,
    total_tokens: int = 0,
    tokens: int = 0,
) -> bool:
    """Whether ``view`` may take one more request (of ``tokens``) under the bounded-load
    rule: ``total_in_flight`` and ``total_tokens`` are the candidates' (module docstring)."""
    share = view.slots / total_slots if total_slots > 0 else 1.0
    allowed = affinity.load_factor * (total_in_flight + 1) * share + affinity.slack
    if view.in_flight + 1 > allowed:
        return False
    if not affinity.token_bound:
        return True
    # No slack in tokens: what a replica holds before this request is what is bounded, so
    # an idle fleet (nothing held) still groups every key on its replica.
    return view.tokens <= affinity.load_factor * (total_tokens + tokens) * share


def pick_by_prefix(
    candidates: Sequence[ReplicaView],
    key: int,
    ring: HashRing,
    affinity: PrefixAffinity,
    tokens: int = 0,
) -> ReplicaView | None:
    """The first replica clockwise from ``key`` among ``candidates`` within the bound for a
    request of ``tokens``, else the least loaded candidate; None when there is none."""
    if not candidates:
        return None
    total_in_flight = 0
    total_slots = 0
    total_tokens = 0
    by_id: dict[str, ReplicaView] = {}
    for view in candidates:
        total_in_flight += view.in_flight
        total_tokens += view.tokens
        total_slots += view.slots
        by_id[view.id] = view
    for rid in ring.walk(key):
        found = by_id.get(rid)
        if found is not None and within_bound(
            found, total_in_flight, total_slots, affinity, total_tokens, tokens
        ):
            return found
    # Why least loaded: every candidate is over the bound (or off the ring), so affinity
    # has nothing left to give and spreading the load is all that matters.
    return min(candidates, key=lambda view: (view.load, view.id))
