"""``tidegate explain``'s fair-sharing lines (control.explain.format_tenants)."""

from __future__ import annotations

from tidegate.control.explain import format_tenants


def test_off() -> None:
    assert "fair sharing off" in format_tenants("m", {"fair_sharing": False, "tenants": {}})


def test_nobody_yet() -> None:
    assert "no tenant served yet" in format_tenants("m", {"fair_sharing": True, "tenants": {}})


def test_least_served_first_with_shares_and_the_anonymous_tenant() -> None:
    text = format_tenants(
        "m",
        {
            "fair_sharing": True,
            "tenants": {
                "heavy": {"counter": 5000.0, "queued": 900, "share": 1.0},
                "": {"counter": 10.0, "queued": 0, "share": 1.0},
                "acme": {"counter": 1200.5, "queued": 2, "share": 2.0},
            },
        },
    )
    lines = text.splitlines()
    assert lines[0].startswith("m: fair sharing on")
    assert lines[1:] == [
        "  (anonymous): 10.0 virtual tokens, 0 queued",
        "  acme: 1,200.5 virtual tokens, 2 queued, share 2",
        "  heavy: 5,000.0 virtual tokens, 900 queued",
    ]


def _holding(counter: float, queued: int, *, in_flight: int, slot_share: float) -> dict[str, float]:
    """A tenant's state as ``/admin/replicas`` gives it with slots (share 1)."""
    return {
        "counter": counter,
        "queued": queued,
        "share": 1.0,
        "in_flight": in_flight,
        "slot_share": slot_share,
    }


def test_slot_shares_shown_with_the_slots() -> None:
    text = format_tenants(
        "m",
        {
            "fair_sharing": True,
            "slots": 64,
            "tenants": {
                "heavy": _holding(5000.0, 900, in_flight=60, slot_share=32.0),
                "light": _holding(10.0, 1, in_flight=4, slot_share=32.0),
            },
        },
    )
    lines = text.splitlines()
    assert "(of 64)" in lines[1]
    assert lines[2:] == [
        "  light: 10.0 virtual tokens, 1 queued, 4 in flight of a slot share of 32",
        "  heavy: 5,000.0 virtual tokens, 900 queued, 60 in flight of a slot share of 32",
    ]


def test_slot_reserve_shown_with_the_slots() -> None:
    text = format_tenants(
        "m",
        {
            "fair_sharing": True,
            "slots": 64,
            "reserve_slots": 2,
            "tenants": {"heavy": _holding(5000.0, 900, in_flight=62, slot_share=62.0)},
        },
    )
    lines = text.splitlines()
    assert "last 2 free slots are held for a tenant under its slot share" in lines[2]
    assert "the other 62" in lines[2]
    assert (
        lines[3]
        == "  heavy: 5,000.0 virtual tokens, 900 queued, 62 in flight of a slot share of 62"
    )


def test_preemption_shown_with_its_count() -> None:
    text = format_tenants(
        "m",
        {
            "fair_sharing": True,
            "slots": 8,
            "reserve_slots": 0,
            "preemption": True,
            "preemptions": 3,
            "tenants": {"heavy": _holding(5000.0, 900, in_flight=8, slot_share=8.0)},
        },
    )
    lines = text.splitlines()
    assert "pauses a decoding sequence of the one most over its own: 3 so far" in lines[2]
