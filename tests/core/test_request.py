from __future__ import annotations

import pytest

from tidegate.core.request import (
    TERMINAL_STATES,
    IllegalTransition,
    Request,
    RequestState,
    advance,
)

S = RequestState


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (S.NEW, S.QUEUED),
        (S.NEW, S.REJECTED_FULL),
        (S.NEW, S.REJECTED_DEADLINE),
        (S.NEW, S.REJECTED_HOLDBACK),
        (S.QUEUED, S.DISPATCHED),
        (S.QUEUED, S.SHED),
        (S.QUEUED, S.EXPIRED),
        (S.QUEUED, S.CANCELLED),
        (S.DISPATCHED, S.COMPLETED),
        (S.DISPATCHED, S.FAILED),
        (S.DISPATCHED, S.CANCELLED),
        (S.DISPATCHED, S.QUEUED),
    ],
)
def test_legal_transition_returns_target(current: RequestState, target: RequestState) -> None:
    assert advance(current, target) is target


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (S.NEW, S.COMPLETED),
        (S.NEW, S.DISPATCHED),
        (S.QUEUED, S.COMPLETED),
        (S.DISPATCHED, S.SHED),
        (S.DISPATCHED, S.EXPIRED),
    ],
)
def test_illegal_transition_raises(current: RequestState, target: RequestState) -> None:
    with pytest.raises(IllegalTransition, match=f"{current.value} to {target.value}"):
        advance(current, target)


@pytest.mark.parametrize("terminal", sorted(TERMINAL_STATES, key=lambda s: s.value))
def test_terminal_state_never_changes(terminal: RequestState) -> None:
    assert terminal.is_terminal
    for target in RequestState:
        with pytest.raises(IllegalTransition):
            advance(terminal, target)


def test_terminal_outcomes_are_the_documented_ones() -> None:
    assert {s.value for s in TERMINAL_STATES} == {
        "completed",
        "shed",
        "rejected_full",
        "rejected_deadline",
        "rejected_holdback",
        "expired",
        "cancelled",
        "failed",
    }


def test_negative_priority_is_refused() -> None:
    with pytest.raises(ValueError, match="priority must be >= 0"):
        Request(id="r", model="m", priority=-1, arrival_at=0.0)
