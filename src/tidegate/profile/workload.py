"""The request mix the planner sends: token lengths from a trace or a synthetic distribution.

A workload is a list of (input tokens, output tokens) samples. From a file, read by the
simulator's trace readers:

- the Azure LLM inference traces (CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``);
- Mooncake JSONL (``input_length``, ``output_length`` per line);
- tidegate's own CSV (``arrival_s,prompt_tokens,output_tokens,priority,tenant``).

Without a file, the documented synthetic distribution (docs/profile.md): log-normal lengths,
seeded. Only the lengths are used: the planner measures one replica at its capacity, so
arrival times do not matter (every point is a closed loop).

Lengths are clipped to what the model takes: an input longer than the model reads costs no
more than one of that length (MiniLM truncates at 256 tokens), and a prompt plus its output
must fit the context. The clipping is recorded with the workload.

Texts are built from a fixed list of common English words, seeded per request, and sized to
the wanted token count through a calibration against the server's own ``usage`` counts
(``TextSizer``), so the same code works for any tokenizer.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from tidegate.errors import ConfigError

# Synthetic defaults: (median, sigma of the log) per task and direction; see docs/profile.md.
SYNTHETIC = {
    "embeddings": {"input": (64.0, 0.8), "output": (0.0, 0.0)},
    "generate": {"input": (256.0, 0.8), "output": (64.0, 0.6)},
}
NUM_SAMPLES = 512  # requests in the mix; the load generator cycles through them
MAX_TRACE_ROWS = 200_000
MIN_INPUT_TOKENS = 4

_WORDS = (
    "the of and to in is was for on are with as at be by this had not but from or have an "
    "they which one you were all we when there can more if no out so said what up its about "
    "into than them only other new some could time these two may then first any my now such "
    "like our over man me even most made after also did many before must through back years "
    "where much your way well down should because each just those people how too little state "
    "good very make world still own see men work long get here between both life being under "
    "never day same another know while last might us great old year off come since against go "
    "came right used take three house water river harbour ship cargo tide gate light signal "
    "city road north south east west morning evening market bridge stone field garden music "
    "paper letter number table window door school story night summer winter spring autumn"
).split()


@dataclass(frozen=True)
class Workload:
    source: str  # "synthetic" or the file it came from
    input_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]  # 0 for embeddings
    details: dict[str, Any] = field(default_factory=dict)  # distribution, seed, clipping

    def describe(self) -> dict[str, Any]:
        """What profile.json records about the mix."""
        return {
            "source": self.source,
            "num_samples": len(self.input_tokens),
            "input_tokens": _summary(self.input_tokens),
            "output_tokens": _summary(self.output_tokens),
            **self.details,
        }


def _summary(values: Sequence[int]) -> dict[str, float]:
    if not values:
        return {}
    array = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return {
        "mean": round(float(array.mean()), 1),
        "p50": round(float(p50), 1),
        "p90": round(float(p90), 1),
        "p99": round(float(p99), 1),
        "max": float(array.max()),
    }


def synthetic_workload(task: str, seed: int, num_samples: int = NUM_SAMPLES) -> Workload:
    """Log-normal input (and, for generation, output) lengths, seeded."""
    rng = np.random.default_rng(seed)
    spec = SYNTHETIC[task]

    def draw(median: float, sigma: float) -> tuple[int, ...]:
        if median <= 0:
            return (0,) * num_samples
        values = rng.lognormal(math.log(median), sigma, num_samples)
        return tuple(max(1, round(float(v))) for v in values)

    inputs = draw(*spec["input"])
    outputs = draw(*spec["output"])
    distribution = {
        direction: {"kind": "lognormal", "median": median, "sigma": sigma}
        for direction, (median, sigma) in spec.items()
        if median > 0
    }
    return Workload("synthetic", inputs, outputs, {"distribution": distribution, "seed": seed})


def load_workload(path: Path, seed: int, num_samples: int = NUM_SAMPLES) -> Workload:
    """Token lengths of a trace file, ``num_samples`` requests drawn with the seed.

    The simulator's readers parse the file (``tidegate.sim.traces``: Azure, Mooncake, our
    CSV), so both tools accept the same traces. Only the first ``MAX_TRACE_ROWS`` requests
    are read (a ServeGen rate file can describe billions, and carries no lengths of its own).
    """
    from tidegate.sim.traces import open_trace

    arrivals = itertools.islice(open_trace(str(path), seed=seed), MAX_TRACE_ROWS)
    pairs = [(a.prompt_tokens, a.output_tokens) for a in arrivals]
    if not pairs:
        raise ConfigError(str(path), "workload", "no requests in it", "pass a non-empty trace")
    rng = random.Random(seed)
    drawn = rng.sample(pairs, num_samples) if len(pairs) > num_samples else pairs
    return Workload(
        str(path),
        tuple(max(1, p[0]) for p in drawn),
        tuple(p[1] for p in drawn),
        {"seed": seed, "rows_read": len(pairs)},
    )


def clip_workload(
    workload: Workload, *, max_input_tokens: int, max_output_tokens: int, context_tokens: int
) -> Workload:
    """Lengths the model accepts: inputs to what it reads, prompt + output to its context.

    The context keeps a margin of a tenth (at least 8 tokens): a text sized for n tokens
    comes out within a few percent of n, and special tokens and templates add some.
    """
    inputs: list[int] = []
    outputs: list[int] = []
    clipped = 0
    for prompt, output in zip(workload.input_tokens, workload.output_tokens, strict=True):
        new_output = min(output, max_output_tokens)
        # Texts hit their token count only roughly (TextSizer): keep a tenth of the context free.
        room = context_tokens - new_output - max(8, context_tokens // 10)
        new_prompt = max(MIN_INPUT_TOKENS, min(prompt, max_input_tokens, room))
        clipped += (new_prompt, new_output) != (prompt, output)
        inputs.append(new_prompt)
        outputs.append(new_output)
    clipping = {
        "max_input_tokens": max_input_tokens,
        "max_output_tokens": max_output_tokens,
        "context_tokens": context_tokens,
        "num_clipped": clipped,
    }
    return replace(
        workload,
        input_tokens=tuple(inputs),
        output_tokens=tuple(outputs),
        details={**workload.details, "clipping": clipping},
    )


@dataclass(frozen=True)
class TextSizer:
    """Texts of a wanted token count: tokens = overhead + per_word * words (calibrated)."""

    overhead_tokens: float
    tokens_per_word: float
    seed: int = 0

    PROBE_WORDS = (16, 128)  # the two probe sizes the calibration sends

    @classmethod
    def calibrated(cls, probes: Sequence[tuple[int, int]], seed: int) -> TextSizer:
        """From (words, tokens the server counted) of the two probes."""
        (w1, t1), (w2, t2) = probes
        per_word = max(0.05, (t2 - t1) / (w2 - w1))
        return cls(
            overhead_tokens=max(0.0, t1 - per_word * w1), tokens_per_word=per_word, seed=seed
        )

    def words_for(self, tokens: int) -> int:
        return max(1, round((tokens - self.overhead_tokens) / self.tokens_per_word))

    def text(self, tokens: int, index: int) -> str:
        return probe_text(self.words_for(tokens), f"{self.seed}:{index}")


def probe_text(num_words: int, key: str) -> str:
    """``num_words`` common words, the same for the same key."""
    return " ".join(random.Random(key).choices(_WORDS, k=num_words))
