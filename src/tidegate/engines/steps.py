"""The engine's own step times, by kind and by sequences (or inputs) running.

transformers' continuous batching runs one step of every running sequence at a time: each
decoding sequence makes a token, and each joining one (no token yet) prefills its prompt.
What a step costs decides what a replica serves, and a step where prompts join a batch that is
decoding costs what no client can see: the client's stamps show a joiner's first token, not
the step that prefilled it (docs/benchmarks.md, "Fidelity"). So the engine times its own
steps, in the manager's thread, and keeps per (kind, sequences running) the count of steps,
their seconds and their joiners:

- ``decode``: nobody joins;
- ``join``: one or more prompts join a batch that is decoding (the running count includes
  them, as the simulator's ``step_s`` does);
- ``start``: every sequence of the step is joining (an idle engine);
- ``batch``: an embeddings engine's batch, ``running`` its inputs (the worker's batcher times
  it around the engine's call: ``StepTally.add_batch``).

The worker exports the table as counters (``tidegate_engine_steps_total``,
``tidegate_engine_step_seconds_total``, ``tidegate_engine_step_joins_total``, labels
``model``, ``kind``, ``running``; at most three kinds x ``max_num_seqs``, or one kind x
``max_batch_size``), read at scrape time. ``join_cost_ms`` turns two reads into what one
joiner adds to its step over a decode step of as many sequences: the price ``tidegate
profile --through-gateway`` writes into a generation profile (``generate.join_ms``) and the
simulator charges.

The hook (``clock_steps``) wraps two methods of the manager that are not transformers'
public API (``_generation_loop_body`` and ``_generation_step``, as of transformers 5.x);
where they are missing, or labelling a step fails, steps go untimed and generation goes on.
A step's time is the loop body's: prepare the batch, run it, hand its outputs over.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import astuple, dataclass, replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tidegate.engines.profile import Curve, EngineProfile

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepTotals:
    """Cumulative figures of one (kind, running) cell."""

    num_steps: float
    seconds: float
    num_joins: float


StepTable = Mapping[tuple[str, int], StepTotals]
BATCH = "batch"  # an embeddings batch
KINDS = ("decode", "join", "start", BATCH)


def kind_of(decoding: int, joining: int) -> str:
    if not joining:
        return "decode"
    return "join" if decoding else "start"


class StepTally:
    """Steps counted by the engine's thread, read by the worker's scrapes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cells: dict[tuple[str, int], list[float]] = {}

    def add(self, decoding: int, joining: int, seconds: float) -> None:
        self._add((kind_of(decoding, joining), decoding + joining), joining, seconds)

    def add_batch(self, size: int, seconds: float) -> None:
        """One embeddings batch of ``size`` inputs."""
        self._add((BATCH, size), 0, seconds)

    def _add(self, key: tuple[str, int], joining: int, seconds: float) -> None:
        with self._lock:
            cell = self._cells.get(key)
            if cell is None:
                cell = self._cells[key] = [0.0, 0.0, 0.0]
            cell[0] += 1
            cell[1] += seconds
            cell[2] += joining

    def table(self) -> dict[tuple[str, int], StepTotals]:
        with self._lock:
            return {key: StepTotals(*cell) for key, cell in self._cells.items()}


def clock_steps(manager: Any, tally: StepTally) -> bool:
    """Time every step ``manager`` runs from now on into ``tally``; False if it cannot."""
    loop_body: Callable[[Any, bool], bool] | None = getattr(manager, "_generation_loop_body", None)
    run_step: Callable[[], None] | None = getattr(manager, "_generation_step", None)
    if not callable(loop_body) or not callable(run_step):
        log.warning("this transformers has no step hook: engine steps go untimed")
        return False
    labels: list[tuple[int, int] | None] = [None]  # the manager's one thread writes it
    told = threading.Event()  # set once the manager's insides were not as expected

    def labelled_step() -> None:
        labels[0] = _labels(manager)
        if labels[0] is None and not told.is_set():
            told.set()
            log.warning("cannot label this transformers' engine steps: they go untimed")
        run_step()

    def timed_body(processor: Any, bootstrapping: bool) -> bool:
        labels[0] = None
        started = time.perf_counter()
        more = loop_body(processor, bootstrapping)
        step = labels[0]
        if step is not None:  # None: no batch ran (it waited for requests)
            tally.add(step[0], step[1], time.perf_counter() - started)
        return more

    manager._generation_step = labelled_step
    manager._generation_loop_body = timed_body
    return True


def _labels(manager: Any) -> tuple[int, int] | None:
    """(decoding, joining) of the batch about to run: its scheduler's active requests, those
    without a token yet joining. None when the manager's insides are not as expected."""
    try:
        active = manager.batch_processor.scheduler.active_requests.values()
        joining = sum(1 for state in active if state.generated_len() == 0)
        return len(active) - joining, joining
    except Exception:  # a newer transformers: untimed, never a failed step
        return None


@dataclass(frozen=True, slots=True)
class JoinCost:
    """What one prompt joining a decoding batch added to its step, over a window."""

    join_ms: float  # per joiner, over a decode step of as many running sequences
    num_joins: int  # joiners it is measured over
    decode_ms: float  # the mean decode step those were set against

    def describe(self) -> dict[str, Any]:
        return {
            "join_ms": round(self.join_ms, 2),
            "num_joins": self.num_joins,
            "decode_ms": round(self.decode_ms, 2),
        }


def table_between(first: StepTable, last: StepTable) -> dict[tuple[str, int], StepTotals]:
    """The steps of a window: ``last`` less ``first`` (cells absent at first count from 0)."""
    zero = StepTotals(0.0, 0.0, 0.0)
    window = {}
    for key, end in last.items():
        start = first.get(key, zero)
        steps = end.num_steps - start.num_steps
        if steps > 0:
            window[key] = StepTotals(
                steps, end.seconds - start.seconds, end.num_joins - start.num_joins
            )
    return window


def mean_step_ms(window: StepTable, kind: str, running: int, least: int = 1) -> float | None:
    """The mean step of ``kind`` with ``running`` sequences over ``window``, in ms; None with
    fewer than ``least`` such steps."""
    cell = window.get((kind, running))
    if cell is None or cell.num_steps < least:
        return None
    return 1e3 * cell.seconds / cell.num_steps


def join_cost_ms(window: StepTable) -> JoinCost | None:
    """Each ``join`` step less the mean ``decode`` step of as many sequences running in the
    same window, over the joiners: None without a pair of those (a window where nobody joined
    a decoding batch, or no decode step ran at that count)."""
    extra_s = decode_s = steps = joins = 0.0
    for (kind, running), cell in window.items():
        decode = window.get(("decode", running))
        if kind != "join" or decode is None:
            continue
        per_step_s = decode.seconds / decode.num_steps
        extra_s += cell.seconds - cell.num_steps * per_step_s
        decode_s += cell.num_steps * per_step_s
        steps += cell.num_steps
        joins += cell.num_joins
    if joins <= 0:
        return None
    return JoinCost(
        join_ms=max(0.0, 1e3 * extra_s / joins),
        num_joins=round(joins),
        decode_ms=1e3 * decode_s / steps,
    )


def profile_at_steps(profile: EngineProfile, window: StepTable, least: int = 3) -> EngineProfile:
    """``profile`` with the engine's own steps of ``window`` for its step prices: what the
    simulator charges a run whose worker reported them (``tidegate simulate --validate
    --own-engine-time``).

    The inter-token curve becomes the window's mean decode step at every count of sequences
    with at least ``least`` decode steps (only those points: the profile's were another
    moment's speed); the time to first token curve takes the window's mean start step (every
    sequence joining an idle engine) where it has ``least`` of them and keeps the profile's
    elsewhere; the join price is the window's (``join_cost_ms``). A price the window did not
    measure stays the profile's.

    An embeddings profile takes the window's mean batch at every size with at least ``least``
    batches; outside the sizes the window measured, the profile's points scaled by the
    window's speed against the profile over all its batches (``batch_curve_at``)."""
    if profile.batch_latency_ms is not None:
        batches = batch_curve_at(profile.batch_latency_ms, window, least)
        return profile if batches is None else replace(profile, batch_latency_ms=batches)
    if profile.ttft_ms is None or profile.itl_ms is None:
        return profile

    def means(kind: str) -> dict[float, float]:
        found = {n: mean_step_ms(window, kind, n, least) for k, n in window if k == kind}
        return {float(n): ms for n, ms in found.items() if ms is not None}

    decode, start = means("decode"), means("start")
    itl = Curve.of(decode) if decode else profile.itl_ms
    ttft = Curve.of({**dict(zip(profile.ttft_ms.xs, profile.ttft_ms.ys, strict=True)), **start})
    join = join_cost_ms(window)
    return replace(
        profile,
        ttft_ms=ttft,
        itl_ms=itl,
        join_ms=profile.join_ms if join is None else join.join_ms,
    )


def batch_curve_at(profiled: Curve, window: StepTable, least: int = 3) -> Curve | None:
    """The batch curve of ``window``'s embeddings batches (see ``profile_at_steps``); None
    when it has none."""
    cells = {n: cell for (kind, n), cell in window.items() if kind == BATCH}
    if not cells:
        return None
    profiled_s = sum(cell.num_steps * profiled(n) / 1e3 for n, cell in cells.items())
    factor = sum(cell.seconds for cell in cells.values()) / profiled_s if profiled_s > 0 else 1.0
    found = {n: mean_step_ms(window, BATCH, n, least) for n in cells}
    measured = {float(n): ms for n, ms in found.items() if ms is not None}
    low, high = (min(measured), max(measured)) if measured else (math.inf, -math.inf)
    outside = {
        x: y * factor for x, y in zip(profiled.xs, profiled.ys, strict=True) if not low <= x <= high
    }
    return Curve.of({**outside, **measured})


def step_rows(window: StepTable) -> list[dict[str, Any]]:
    """A step table as JSON rows (a run file's ``engine_steps``)."""
    return [
        {
            "kind": kind,
            "running": running,
            "steps": cell.num_steps,
            "seconds": round(cell.seconds, 6),
            "joins": cell.num_joins,
        }
        for (kind, running), cell in sorted(window.items())
    ]


def table_of_rows(rows: Iterable[Mapping[str, Any]]) -> dict[tuple[str, int], StepTotals]:
    """``step_rows`` read back (KeyError, TypeError, ValueError on a bad row)."""
    table = {}
    for row in rows:
        kind = str(row["kind"])
        if kind not in KINDS:
            raise ValueError(f"unknown step kind {kind!r}")
        running = int(row["running"])
        cell = StepTotals(float(row["steps"]), float(row["seconds"]), float(row.get("joins", 0)))
        if running < 1 or not all(0.0 <= value < math.inf for value in astuple(cell)):
            raise ValueError(f"running must be >= 1 and the figures finite and >= 0: {row}")
        table[(kind, running)] = cell
    return table


def parse_step_metrics(text: str) -> StepTable:
    """The step table of a worker's /metrics text."""
    return parse_step_samples(
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    )


def parse_step_samples(samples: Iterable[tuple[str, Mapping[str, str], float]]) -> StepTable:
    """The step table from /metrics samples ``(name, labels, value)``, summed over models."""
    cells: dict[tuple[str, int], list[float]] = {}
    column = {
        "tidegate_engine_steps_total": 0,
        "tidegate_engine_step_seconds_total": 1,
        "tidegate_engine_step_joins_total": 2,
    }
    for name, labels, value in samples:
        index = column.get(name)
        if index is None:
            continue
        try:
            key = (labels["kind"], int(labels["running"]))
        except (KeyError, ValueError):
            continue
        cells.setdefault(key, [0.0, 0.0, 0.0])[index] += value
    return {key: StepTotals(*cell) for key, cell in cells.items()}
