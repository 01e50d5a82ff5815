"""Workloads: streams of arrivals, how they are scaled, and how they get a priority.

An ``Arrival`` is one request as a trace or a generator describes it. A ``Workload`` is a
re-iterable stream of arrivals in time order: every ``iter()`` starts over and yields the
same arrivals (all randomness comes from ``random.Random`` seeded by the workload), so
several policies see the identical workload, and a 14-day replay never sits in memory.

Two kinds, scaled differently (``--rate-scale F``: F times the load; ``--speedup K``: the
same load level, the time axis K times shorter):

- request traces (Azure, Mooncake, our CSV): times are divided by F (the trace plays F times
  faster). Speedup K divides times by K and keeps one request in K (seeded), so the rate
  stays as it was while a long trace's shape passes K times faster;
- rate-defined workloads (synthetic, ServeGen): the rate curve is multiplied by F; speedup K
  replays ``rate(K t)``.

Priority: from the file when it names one, else the first matching ``--priority-rules``
rule (by tenant or length), else a seeded draw from ``--priority-mix``, else the config's
default level.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Arrival:
    arrival_s: float  # seconds from the start of the workload
    prompt_tokens: int
    output_tokens: int  # 0 for embeddings
    priority: str | None = None  # a level name, when the source says
    tenant: str = ""
    blocks: tuple[int, ...] = ()  # the prompt's prefix-block ids, when the trace has them


class Workload(Protocol):
    name: str  # for reports: a file name or a spec, never a path

    def __iter__(self) -> Iterator[Arrival]: ...


@dataclass(frozen=True, slots=True)
class Scale:
    rate_scale: float = 1.0
    speedup: float = 1.0

    def __post_init__(self) -> None:
        if self.rate_scale <= 0 or self.speedup <= 0:
            raise ValueError("rate scale and speedup must be > 0")

    @property
    def identity(self) -> bool:
        return self.rate_scale == 1.0 and self.speedup == 1.0


NO_SCALE = Scale()


class TraceWorkload:
    """A request trace, scaled as the module docstring says."""

    def __init__(
        self,
        name: str,
        read: Callable[[], Iterable[Arrival]],
        scale: Scale | None = None,
        seed: int = 0,
    ) -> None:
        self.name = name
        self._read = read
        self.scale = scale or NO_SCALE
        self.seed = seed

    def __iter__(self) -> Iterator[Arrival]:
        arrivals = iter(self._read())
        if self.scale.identity:
            yield from arrivals
            return
        divide = self.scale.rate_scale * self.scale.speedup
        keep = 1.0 / self.scale.speedup
        thin = random.Random(f"{self.seed}:thin")
        for a in arrivals:
            if keep < 1.0 and thin.random() >= keep:
                continue
            yield Arrival(
                a.arrival_s / divide,
                a.prompt_tokens,
                a.output_tokens,
                a.priority,
                a.tenant,
                a.blocks,
            )


class Limited:
    """The first ``duration_s`` seconds of another workload."""

    def __init__(self, inner: Workload, duration_s: float) -> None:
        self.name = f"{inner.name} (first {duration_s:g} s)"
        self.inner = inner
        self.duration_s = duration_s

    def __iter__(self) -> Iterator[Arrival]:
        for arrival in self.inner:
            if arrival.arrival_s >= self.duration_s:
                return
            yield arrival


class Listed:
    """A workload held in memory (tests, benchmarks)."""

    def __init__(self, name: str, arrivals: Sequence[Arrival]) -> None:
        self.name = name
        self.arrivals = tuple(sorted(arrivals, key=lambda a: a.arrival_s))

    def __iter__(self) -> Iterator[Arrival]:
        return iter(self.arrivals)


# ----------------------------------------------------------------------------- priorities


@dataclass(frozen=True, slots=True)
class Rule:
    """``tenant:NAME``, ``prompt<N``, ``prompt>=N``, ``output<N``, ``output>=N`` or ``*``."""

    field: str  # "tenant", "prompt", "output" or "*"
    op: str  # "=", "<" or ">="
    value: str
    level: str

    def matches(self, arrival: Arrival) -> bool:
        if self.field == "*":
            return True
        if self.field == "tenant":
            return arrival.tenant == self.value
        tokens = arrival.prompt_tokens if self.field == "prompt" else arrival.output_tokens
        bound = int(self.value)
        return tokens < bound if self.op == "<" else tokens >= bound


def parse_rules(text: str) -> tuple[Rule, ...]:
    """``tenant:chunk-0=high,prompt<256=high,*=low`` (first match wins)."""
    rules = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        condition, sep, level = item.rpartition("=")
        if not sep or not level or not condition:
            raise ValueError(f"priority rule {item!r}: write CONDITION=LEVEL")
        rules.append(_rule(condition.strip(), level.strip(), item))
    return tuple(rules)


def _rule(condition: str, level: str, item: str) -> Rule:
    if condition == "*":
        return Rule("*", "=", "", level)
    if condition.startswith("tenant:"):
        return Rule("tenant", "=", condition.removeprefix("tenant:"), level)
    for field in ("prompt", "output"):
        for op in (">=", "<"):
            if condition.startswith(field + op):
                bound = condition.removeprefix(field + op)
                if bound.isdigit():
                    return Rule(field, op, bound, level)
    raise ValueError(
        f"priority rule {item!r}: the condition is one of tenant:NAME, prompt<N, prompt>=N, "
        "output<N, output>=N or *"
    )


def parse_mix(text: str) -> tuple[tuple[str, float], ...]:
    """``high=0.2,medium=0.3,low=0.5`` -> shares normalised to sum 1."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, share = item.partition("=")
        try:
            value = float(share)
        except ValueError:
            value = -1.0
        if not sep or value < 0:
            raise ValueError(f"priority mix {item!r}: write LEVEL=SHARE with SHARE >= 0")
        pairs.append((name.strip(), value))
    total = sum(share for _, share in pairs)
    if not pairs or total <= 0:
        raise ValueError("priority mix: give at least one level with a share above 0")
    return tuple((name, share / total) for name, share in pairs)


class Prioritized:
    """Gives every arrival a priority name (see the module docstring)."""

    def __init__(
        self,
        inner: Workload,
        default: str,
        mix: tuple[tuple[str, float], ...] = (),
        rules: tuple[Rule, ...] = (),
        seed: int = 0,
    ) -> None:
        self.name = inner.name
        self.inner = inner
        self.default = default
        self.mix = mix
        self.rules = rules
        self.seed = seed

    def levels_named(self) -> set[str]:
        return {self.default, *(name for name, _ in self.mix), *(r.level for r in self.rules)}

    def __iter__(self) -> Iterator[Arrival]:
        draw = random.Random(f"{self.seed}:priority")
        cumulative = []
        total = 0.0
        for name, share in self.mix:
            total += share
            cumulative.append((total, name))
        for a in self.inner:
            if a.priority is None:
                name = self._pick(a, draw, cumulative)
                a = Arrival(a.arrival_s, a.prompt_tokens, a.output_tokens, name, a.tenant, a.blocks)
            yield a

    def _pick(
        self, arrival: Arrival, draw: random.Random, cumulative: list[tuple[float, str]]
    ) -> str:
        for rule in self.rules:
            if rule.matches(arrival):
                return rule.level
        if not cumulative:
            return self.default
        point = draw.random()
        for bound, name in cumulative:
            if point < bound:
                return name
        return cumulative[-1][1]
