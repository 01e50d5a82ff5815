from __future__ import annotations

from tidegate.core.request import Request


def req(
    rid: str,
    level: int,
    at: float = 0.0,
    *,
    deadline_at: float | None = None,
    tokens: int = 1,
) -> Request:
    """A request of model ``m``: short to write in tables."""
    return Request(
        id=rid,
        model="m",
        priority=level,
        arrival_at=at,
        deadline_at=deadline_at,
        cost_tokens=tokens,
    )
