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


def _generate(batching: dict[str, Any], engine: str = "simulated", **extra: Any) -> dict[str, Any]:
    model: dict[str, Any] = {"name": "gen", "task": "generate", "engine": engine}
    if engine == "openai":
        model["upstreams"] = ["http://127.0.0.1:9"]
    return {"models": [{**model, "batching": batching}], **extra}


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


def test_defaults_keep_the_fixed_rule_but_the_most_urgent_level_skips_the_window() -> None:
    config = parse_config(_config({}), "c.yaml")
    batch = config.batch_config("emb")
    assert batch.level_windows_ms == (0.0, None, None)
    assert batch.window_ms(0) == 0.0
    assert batch.window_ms(1) == batch.window_ms(2) == batch.batch_window_ms
    assert not batch.load_aware
    assert not batch.length_aware
    assert batch.target_p99_ms is None
    from tidegate.control.local import worker_command

    command = worker_command(config.worker_settings("emb"))
    assert command[command.index("--level-windows-ms") + 1] == "0,,"


def test_the_default_level_window_names_the_configured_most_urgent_level() -> None:
    data = {**_config({}), "priorities": {"levels": ["urgent", "normal"], "default": "normal"}}
    assert parse_config(data, "c.yaml").batch_config("emb").level_windows_ms == (0.0, None)


@pytest.mark.parametrize(
    "data",
    [
        _config({"window_ms_by_priority": {}}),
        {**_config({}), "gateway": {"policy": "fifo"}},
        _generate({}),
        _generate({}, engine="openai"),
    ],
    ids=["asked_off", "fifo_one_level", "generation", "openai_upstream"],
)
def test_no_default_level_window_where_it_is_asked_off_or_cannot_apply(
    data: dict[str, Any],
) -> None:
    config = parse_config(data, "c.yaml")
    (name,) = config.models
    assert config.model(name).batching.level_windows_ms == ()
    again = parse_config(yaml.safe_load(render_config(config)), "rendered")
    assert again.model(name).batching == config.model(name).batching


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


def test_the_prefill_budget_reaches_the_worker_and_renders_back() -> None:
    config = parse_config(_generate({"max_prefill_tokens": 4096}), "c.yaml")
    assert config.model("gen").batching.max_prefill_tokens == 4096
    assert config.worker_settings("gen").max_prefill_tokens == 4096
    again = parse_config(yaml.safe_load(render_config(config)), "rendered")
    assert again.model("gen").batching == config.model("gen").batching
    assert parse_config(_generate({}), "c.yaml").worker_settings("gen").max_prefill_tokens == 0


def test_fair_sharing_reaches_the_worker_without_a_slot_reserve() -> None:
    tenancy = {"fair_sharing": True, "output_weight": 3, "weights": {"team-a": 2}}
    config = parse_config(_generate({}, tenancy=tenancy), "c.yaml")
    fairness = config.worker_settings("gen").fairness
    assert config.fairness is not None
    assert fairness is not None
    assert fairness.output_weight == 3
    assert fairness.shares == (("team-a", 2.0),)
    assert fairness.reserve_fraction == 0.0 < config.fairness.reserve_fraction
    assert parse_config(_generate({}), "c.yaml").worker_settings("gen").fairness is None


@pytest.mark.parametrize(
    ("data", "names"),
    [
        (_config({"max_prefill_tokens": 512}), "task embeddings"),
        (_generate({"max_prefill_tokens": 512}, engine="openai"), "engine openai"),
    ],
    ids=["embeddings_model", "openai_upstream"],
)
def test_a_prefill_budget_only_for_own_generation_workers(data: dict[str, Any], names: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "c.yaml")
    assert info.value.file == "c.yaml"
    assert info.value.key == "models[0].batching.max_prefill_tokens"
    assert names in str(info.value)
    assert "remove max_prefill_tokens" in str(info.value)


def test_a_negative_prefill_budget_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_generate({"max_prefill_tokens": -1}), "c.yaml")
    assert info.value.key == "models[0].batching.max_prefill_tokens"
