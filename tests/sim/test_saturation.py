"""sim/saturation.py: what one replica answers per second under arrivals that never wait."""

from __future__ import annotations

import pytest

from tidegate.engines.cost import ConcurrencySteps, CurveBatch
from tidegate.engines.profile import Curve
from tidegate.sim.saturation import saturated_per_s
from tidegate.sim.service import ServiceModel

ITL = Curve((1.0, 8.0), (100.0, 200.0))  # ms per decode step, by sequences running


def chat_engine(join_ms: float) -> ServiceModel:
    """Decode steps of ITL; a prompt's prefill costs ``join_ms`` over a decode step."""
    ttft = Curve(ITL.xs, tuple(y + join_ms for y in ITL.ys))
    return ServiceModel("chat", "generate", step=ConcurrencySteps(ttft, ITL))


def fluid_rate(join_ms: float, seqs: int = 8, out: int = 16) -> float:
    """A full engine: ``seqs / out`` sequences end and join per step of ``itl(seqs)`` plus
    their prefills, one by one."""
    per_step = seqs / out
    return per_step / ((ITL(seqs) + per_step * join_ms) / 1e3)


def test_embeddings_past_capacity_run_full_batches_back_to_back() -> None:
    engine = ServiceModel("e", "embeddings", batch=CurveBatch(Curve((1.0, 32.0), (10, 100))))
    assert saturated_per_s(engine, 32, 640.0) == pytest.approx(32 / 0.1, rel=0.02)


def test_chats_whose_prompts_cost_nothing_decode_a_full_engine_all_the_time() -> None:
    rate = saturated_per_s(chat_engine(0.0), 8, 5.0, output_tokens=16)
    assert rate == pytest.approx(fluid_rate(0.0), rel=0.05)  # 8 / (16 x 200 ms)


def test_each_joiner_pays_its_prefill_so_a_full_engine_refills_slower() -> None:
    free = saturated_per_s(chat_engine(0.0), 8, 5.0, output_tokens=16)
    paid = saturated_per_s(chat_engine(150.0), 8, 5.0, output_tokens=16)
    assert paid == pytest.approx(fluid_rate(150.0), rel=0.05)
    assert paid < 0.8 * free


def test_below_capacity_it_answers_what_it_is_offered() -> None:
    assert saturated_per_s(chat_engine(150.0), 8, 1.0, output_tokens=16) == pytest.approx(
        1.0, rel=0.1
    )


def test_a_slower_engine_answers_proportionally_less() -> None:
    fast = saturated_per_s(chat_engine(100.0), 4, 10.0, output_tokens=8)
    slow_itl = Curve(ITL.xs, tuple(2 * y for y in ITL.ys))
    slow_ttft = Curve(ITL.xs, tuple(2 * (y + 100.0) for y in ITL.ys))
    slow = ServiceModel("slow", "generate", step=ConcurrencySteps(slow_ttft, slow_itl))
    assert saturated_per_s(slow, 4, 10.0, output_tokens=8) == pytest.approx(fast / 2, rel=0.05)


@pytest.mark.parametrize(
    ("max_batch", "rate", "duration"), [(0, 1.0, 10.0), (4, 0.0, 10.0), (4, 1.0, -1.0)]
)
def test_nonsense_is_refused(max_batch: int, rate: float, duration: float) -> None:
    with pytest.raises(ValueError, match=r"must be >= 1|need a rate and a duration"):
        saturated_per_s(chat_engine(0.0), max_batch, rate, duration_s=duration)


def test_too_few_answers_to_tell_is_zero() -> None:
    assert saturated_per_s(chat_engine(0.0), 8, 0.01, output_tokens=16, duration_s=1.0) == 0.0
