from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidegate.engines.profile import Curve, default_profile, load_profile
from tidegate.engines.text import CatchUp, StopScanner
from tidegate.errors import ConfigError


@pytest.mark.parametrize(
    ("stops", "deltas", "shown", "stopped"),
    [
        ((), ["ab", "cd"], "abcd", False),
        (("END",), ["hello ", "E", "N", "D tail"], "hello ", True),
        (("END",), ["hello E", "Nx"], "hello ENx", False),  # a false start is released
        (("\n\n", "###"), ["a\n", "\nb"], "a", True),
        (("stop",), ["nonstop"], "non", True),
    ],
    ids=["no_stops", "split_across_tokens", "false_start", "earliest_of_several", "inside"],
)
def test_stop_scanner(stops: tuple[str, ...], deltas: list[str], shown: str, stopped: bool) -> None:
    scanner = StopScanner(stops)
    out, hit = "", False
    for delta in deltas:
        text, hit = scanner.feed(delta)
        out += text
        if hit:
            break
    if not hit:
        out += scanner.flush()
    assert (out, hit) == (shown, stopped)


@pytest.mark.parametrize(
    ("x", "y"),
    [(1, 10.0), (2, 15.0), (3, 20.0), (5, 25.0), (9, 35.0), (0, 5.0)],
    ids=["first", "between", "point", "second_segment", "extrapolated", "below_first"],
)
def test_curve_interpolates_and_extrapolates(x: float, y: float) -> None:
    assert Curve((1.0, 3.0, 7.0), (10.0, 20.0, 30.0))(x) == pytest.approx(y)


def test_default_profiles_exist_for_both_tasks() -> None:
    assert default_profile("embeddings").batch_latency_ms is not None
    assert default_profile("generate").itl_ms is not None


@pytest.mark.parametrize(
    ("content", "key"),
    [
        ("not json", "profile"),
        (json.dumps({"version": 9, "task": "embeddings"}), "version"),
        (json.dumps({"version": 1, "task": "speech"}), "task"),
        (
            json.dumps({"version": 1, "task": "embeddings", "embeddings": {"points": []}}),
            "embeddings.points",
        ),
        (
            json.dumps({"version": 1, "task": "generate", "generate": {"points": [{"x": 1}]}}),
            "generate.points[0]",
        ),
        (
            json.dumps(
                {
                    "version": 1,
                    "task": "generate",
                    "generate": {
                        "points": [{"concurrency": 1, "ttft_ms": 9, "itl_ms": 3}],
                        "join_ms": -4,
                    },
                }
            ),
            "generate.join_ms",
        ),
    ],
    ids=["not_json", "bad_version", "unknown_task", "no_points", "bad_point", "bad_join"],
)
def test_bad_profile_names_file_key_and_fix(tmp_path: Path, content: str, key: str) -> None:
    path = tmp_path / "profile.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as raised:
        load_profile(path)
    assert str(path) in str(raised.value)
    assert raised.value.key == key
    assert "Fix:" in str(raised.value)


def test_missing_profile_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_profile(tmp_path / "absent.json")


@pytest.mark.parametrize(
    ("replayed", "sent", "deltas", "expected"),
    [
        ("abc", 3, ["de", "f"], ["de", "f"]),  # the replay released what the client has
        ("abcd", 2, ["e"], ["cde"]),  # it released more: the client gets the rest first
        ("ab", 4, ["c", "de", "f"], ["", "e", "f"]),  # less: what the client has is skipped
    ],
)
def test_catch_up_sends_a_resumed_sequence_s_text_once(
    replayed: str, sent: int, deltas: list[str], expected: list[str]
) -> None:
    catch_up = CatchUp(replayed, sent)
    assert [catch_up(delta) for delta in deltas] == expected
