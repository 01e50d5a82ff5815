"""The adaptive batching keys of a model's batching section: resolved, refused, rendered."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tidegate.config import parse_config
from tidegate.config.render import render_config
from tidegate.errors import ConfigError


def _config(batching: dict[str, Any]) -> dict[str, Any]:
    return {
        "models": [
            {"name": "emb", "task": "embeddings", "engine": "simulated", "batching": batching}
        ]
    }


def test_adaptive_keys_reach_the_batch_rule_and_the_worker() -> None:
    config = parse_config(
        _config(
            {
                "batch_window_ms": 8,
                "window_ms_by_priority": {"high": 0, "medium": 4},
                "load_aware_window": True,
                "length_candidates": 64,
                "max_padding_ratio": 1.5,
                "batch_overhead_tokens": 35,
                "target_p99_ms": 200,
                "min_batch_size": 2,
            }
        ),
        "c.yaml",
    )
    batch = config.batch_config("emb")
    assert batch.level_windows_ms == (0.0, 4.0, None)
    assert batch.window_ms(0) == 0.0
    assert batch.window_ms(2) == 8.0
    assert batch.load_aware
    assert batch.length_candidates == 64
    assert batch.max_padding_ratio == 1.5
    assert batch.batch_overhead_tokens == 35
    assert batch.target_p99_ms == 200
    assert batch.min_batch_size == 2
    worker = config.worker_settings("emb")
    assert worker.batch_config() == batch
    from tidegate.control.local import worker_command

    command = worker_command(worker)
    assert command[command.index("--batch-overhead-tokens") + 1] == "35"


def test_defaults_keep_the_fixed_rule() -> None:
    batch = parse_config(_config({}), "c.yaml").batch_config("emb")
    assert batch.level_windows_ms == ()
    assert not batch.load_aware
    assert not batch.length_aware
    assert batch.target_p99_ms is None


@pytest.mark.parametrize(
    ("batching", "key", "fix"),
    [
        (
            {"window_ms_by_priority": {"urgent": 0}},
            "models[0].batching.window_ms_by_priority",
            "use one of priorities.levels",
        ),
        (
            {"batch_window_ms": 5, "window_ms_by_priority": {"high": 9}},
            "models[0].batching.window_ms_by_priority.high",
            "at most 5",
        ),
        (
            {"max_batch_size": 4, "min_batch_size": 8},
            "models[0].batching.min_batch_size",
            "min_batch_size <= max_batch_size",
        ),
    ],
    ids=["unknown_level", "window_over_the_batch_window", "floor_over_the_max"],
)
def test_bad_adaptive_keys_name_the_key_and_the_fix(
    batching: dict[str, Any], key: str, fix: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_config(batching), "c.yaml")
    assert info.value.file == "c.yaml"
    assert info.value.key == key
    assert fix in str(info.value)


@pytest.mark.parametrize(
    "batching",
    [
        {"max_padding_ratio": 0.5},
        {"length_candidates": -1},
        {"target_p99_ms": 0},
        {"batch_overhead_tokens": -1},
    ],
    ids=["padding_ratio_under_one", "negative_candidates", "zero_target", "negative_overhead"],
)
def test_out_of_range_adaptive_keys_are_refused(batching: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_config(batching), "c.yaml")
    assert "batching" in info.value.key


def test_rendered_config_reads_back_the_same() -> None:
    config = parse_config(
        _config(
            {
                "window_ms_by_priority": {"high": 0},
                "length_candidates": 32,
                "batch_overhead_tokens": 35,
            }
        ),
        "c.yaml",
    )
    again = parse_config(yaml.safe_load(render_config(config)), "rendered")
    assert again.batch_config("emb") == config.batch_config("emb")
